"""FSDP inside the tick loops: weights split over the ``fsdp`` axis, gathered one unit at a time.

With a mesh whose ``fsdp`` axis has more than one device, the tick loops run manual over it as
over ``data`` (:class:`tpipe.core.spmd.Axes`): each device holds its share of every staged
weight (split on the dimension its partition spec gives, :meth:`StageLayout.partition_specs`)
and computes on its own rows of each micro-batch. A layer unit gathers its weights just before
it runs (``lax.all_gather`` over ``fsdp``, whose transpose is the ``psum_scatter`` that leaves
each device its share of the weight gradient, summed over the fsdp group's rows), so a device
holds one unit's whole weights at a time, never a stage's. A chunk's packed buffer (plain layers
such as an embedding or a head, see :mod:`tpipe.core.layout`) is gathered whole when the chunk
reads it: its leaves start anywhere in it.

The gathered weights are named :data:`tpipe.core.remat.CHUNK_PARAMS_NAME`, which no remat policy
tpipe makes saves: the backward gathers them again rather than keep a copy per tick.

Every device of an fsdp group sits on the same stage and data replica, so the gathers inside a
stage's ``lax.switch`` branch run on exactly the devices that take that branch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from tpipe.core import layout as layout_lib
from tpipe.core import packed_places as places
from tpipe.core import remat as remat_lib

NOT_SPLIT = -1


@dataclasses.dataclass(frozen=True)
class Split:
  """Where each staged weight is split over the fsdp axis.

  Attributes:
    axis: the fsdp mesh axis.
    stacked: ``{"layers_i": {keystr(path): dim}}``: per stacked leaf, the dimension of one copy
      (the leaf without its ``[R, S, k]`` axes) split over ``axis``, or :data:`NOT_SPLIT`.
    packed: ``{dtype: bool}``: whether each packed buffer is split.
    shared: ``{name: dim}``: per shared leaf, the dimension of one entry (without its ``[P,
      S]`` axes) split over ``axis``, or :data:`NOT_SPLIT`.
  """

  axis: str
  stacked: Mapping[str, Mapping[str, int]]
  packed: Mapping[str, bool]
  shared: Mapping[str, int] = dataclasses.field(default_factory=dict)

  @classmethod
  def of(cls, specs, axis: str) -> "Split":
    """From the staged partition specs (:meth:`StageLayout.partition_specs`'s tree)."""

    def dim(spec, lead: int = 3) -> int:
      for i, entry in enumerate(tuple(spec)):
        names = entry if isinstance(entry, tuple) else (entry,)
        if axis in names:
          return i - lead  # A stacked leaf is [R, S, k, ...one copy]; a shared [P, S, ...].
      return NOT_SPLIT

    stacked = {}
    for layer, tree in specs[layout_lib.STACKED].items():
      flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_spec)[0]
      stacked[layer] = {jax.tree_util.keystr(path): dim(spec) for path, spec in flat}
    packed = {k: axis in tuple(spec) for k, spec in specs[layout_lib.PACKED].items()}
    shared = {k: dim(spec, lead=2) for k, spec in specs.get(layout_lib.SHARED, {}).items()}
    return cls(axis=axis, stacked=stacked, packed=packed, shared=shared)

  def is_split(self, path_in_slot) -> bool:
    """Whether the slot leaf at ``path_in_slot`` (a key path in one slot's tree) is split."""
    keys = [getattr(k, "key", None) for k in path_in_slot]
    if keys[0] == layout_lib.PACKED:
      return self.packed[keys[1]]
    if keys[0] == layout_lib.SHARED:
      return self.shared[keys[1]] != NOT_SPLIT
    layer = self.stacked[keys[1]]
    return layer[jax.tree_util.keystr(tuple(path_in_slot[2:]))] != NOT_SPLIT

  def gather_packed(self, slot):
    """A slot's packed buffers, each whole (gathered where it is split)."""
    packed = {k: self._gather(a, 0) if self.packed[k] else a
              for k, a in slot[layout_lib.PACKED].items()}
    return {**slot, layout_lib.PACKED: packed}

  def gather_unit(self, layer: str, params, copy_axis: bool = False):
    """One unit's weights of stacked layer ``layer`` (``"layers_i"``), whole; with
    ``copy_axis``, every leaf still has its copies' axis in front."""
    dims = self.stacked[layer]

    def gather(path, leaf):
      d = dims[jax.tree_util.keystr(path)]
      return leaf if d == NOT_SPLIT else self._gather(leaf, d + int(copy_axis))

    return jax.tree_util.tree_map_with_path(gather, params)

  def gather_piece(self, piece, dim: int, shape, spec=None):
    """A packed leaf of ``shape`` whole from this device's piece of it
    (:meth:`tpipe.core.layout.StageLayout.chunk_trees` from one block), cut along ``dim`` or
    :data:`tpipe.core.packed_places.FLAT`: one ``all_gather`` over fsdp, whose transpose leaves
    this device the piece of the leaf's gradient, summed over the group.

    ``spec``: how the piece is split over the partitioner's axes (tensor; never along ``dim``).
    The gather then runs on each device's part (manual over those axes too), so neither it nor
    its transpose, the reduce-scatter of the gradient, ever holds the leaf whole over them."""
    if dim == places.FLAT:
      flat = self._gather(piece, 0)
      return flat[:math.prod(shape)].reshape(shape)
    if spec is None:
      return self._gather(piece, dim)
    names = {a for entry in spec if entry is not None
             for a in (entry if isinstance(entry, tuple) else (entry,))}
    return jax.shard_map(lambda p: self._gather(p, dim), in_specs=spec, out_specs=spec,
                         axis_names=names)(piece)

  def _gather(self, leaf, dim: int):
    whole = lax.all_gather(leaf, self.axis, axis=dim, tiled=True)
    return checkpoint_name(whole, remat_lib.CHUNK_PARAMS_NAME)


def _is_spec(value: Any) -> bool:
  return isinstance(value, jax.sharding.PartitionSpec)
