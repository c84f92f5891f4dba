"""FSDP inside the tick loops: weights split over the ``fsdp`` axis, gathered one unit at a time.

With a mesh whose ``fsdp`` axis has more than one device, the tick loops run manual over it as
over ``data`` (:class:`tpipe.core.base.spmd.Axes`): each device holds its share of every staged
weight (split on the dimension its partition spec gives, :meth:`StageLayout.partition_specs`)
and computes on its own rows of each micro-batch. A layer unit gathers its weights just before
it runs (``lax.all_gather`` over ``fsdp``, whose transpose is the ``psum_scatter`` that leaves
each device its share of the weight gradient, summed over the fsdp group's rows), so a device
holds one unit's whole weights at a time, never a stage's. A chunk's packed buffer (plain layers
such as an embedding or a head, see :mod:`tpipe.core.layout.description`) is gathered whole when
the chunk reads it: its leaves start anywhere in it.

A weight the unit only casts (a mixed-precision layer's float32 kernel read as bfloat16,
:func:`casts_before_gather`) is cast before its gather
(:func:`gather_cast`): the gather moves half the bytes, and the backward holds the weight's
whole gradient in bfloat16, converting it to float32 and reduce-scattering it a piece of at most
:data:`GRADIENT_PIECE_BYTES` at a time, where differentiating the cast after the gather would
first build the whole float32 gradient (a vocabulary head at Llama-3-8B: 1 GiB per device).

The gathered weights are named :data:`tpipe.core.planning.remat.CHUNK_PARAMS_NAME`, which no remat
policy tpipe makes saves: the backward gathers them again rather than keep a copy per tick.

Every device of an fsdp group sits on the same stage and data replica, so the gathers inside a
stage's ``lax.switch`` branch run on exactly the devices that take that branch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from tpipe.core.base import jax_compat
from tpipe.core.base import spmd
from tpipe.core.layout import description as desc
from tpipe.core.layout import packed_places as places
from tpipe.core.planning import remat as remat_lib
from tpipe.core.programs import weight_casts

# The gather over fsdp inside a nested shard_map (Split._gather_split) must not sit in a called
# function: see jax_compat.inline_calls_of_shard_maps.
jax_compat.inline_calls_of_shard_maps()

NOT_SPLIT = -1

# The largest piece of a cast weight's gradient converted and reduce-scattered at once
# (:func:`gather_cast`). Measured on v5p (experiments/memory_at_scale.py), Llama-3-8B 4 x 8 x 2
# 1F1B, whose head's float32 gradient is 1 GiB per device: converted whole, 7.53 GiB per device
# (the float32 gradient beside its bfloat16 one); in 4 pieces of 250 MiB, 5.94; in 8, the same.
# gemma-256k 1F1B: 12.65 whole, 9.82 in pieces.
GRADIENT_PIECE_BYTES = 256 * 2**20


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
    for layer, tree in specs[desc.STACKED].items():
      flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_spec)[0]
      stacked[layer] = {jax.tree_util.keystr(path): dim(spec) for path, spec in flat}
    packed = {k: axis in tuple(spec) for k, spec in specs[desc.PACKED].items()}
    shared = {k: dim(spec, lead=2) for k, spec in specs.get(desc.SHARED, {}).items()}
    return cls(axis=axis, stacked=stacked, packed=packed, shared=shared)

  def is_split(self, path_in_slot) -> bool:
    """Whether the slot leaf at ``path_in_slot`` (a key path in one slot's tree) is split."""
    keys = [getattr(k, "key", None) for k in path_in_slot]
    if keys[0] == desc.PACKED:
      return self.packed[keys[1]]
    if keys[0] == desc.SHARED:
      return self.shared[keys[1]] != NOT_SPLIT
    layer = self.stacked[keys[1]]
    return layer[jax.tree_util.keystr(tuple(path_in_slot[2:]))] != NOT_SPLIT

  def gather_packed(self, slot):
    """A slot's packed buffers, each whole (gathered where it is split)."""
    packed = {k: self._gather(a, 0) if self.packed[k] else a
              for k, a in slot[desc.PACKED].items()}
    return {**slot, desc.PACKED: packed}

  def gather_unit(self, layer: str, params, copy_axis: bool = False,
                  casts: Mapping[str, Any] | None = None, tie=None, specs=None):
    """One unit's weights of stacked layer ``layer`` (``"layers_i"``), whole; with
    ``copy_axis``, every leaf still has its copies' axis in front. ``casts``: ``{keystr(path):
    dtype}`` of the leaves the unit only casts, gathered cast (:func:`gather_cast`), each
    passed through ``tie`` first (an array to an array of the same values; see
    :func:`tpipe.core.programs.weight_casts.tie_to_steps`) where given. ``specs``:
    ``{"layers_i": {keystr(path): spec}}``, how one copy of each leaf is split over the
    partitioner's axes (expert, tensor; None where it is not), as :meth:`gather_piece` takes
    it."""
    dims, casts = self.stacked[layer], casts or {}
    specs = (specs or {}).get(layer, {})

    def gather(path, leaf):
      key = jax.tree_util.keystr(path)
      d = dims[key]
      if d == NOT_SPLIT:
        return leaf
      spec = specs.get(key)
      if spec is not None and copy_axis:
        spec = P(None, *spec)
      return self._gather_split(leaf, d + int(copy_axis), spec, casts.get(key), tie)

    return jax.tree_util.tree_map_with_path(gather, params)

  def gather_piece(self, piece, dim: int, shape, spec=None, dtype=None, tie=None):
    """A packed leaf of ``shape`` whole from this device's piece of it
    (:meth:`tpipe.core.layout.description.StageLayout.chunk_trees` from one block), cut along
    ``dim`` or
    :data:`tpipe.core.layout.packed_places.FLAT`: one ``all_gather`` over fsdp, whose transpose
    leaves this device the piece of the leaf's gradient, summed over the group.

    ``spec``: how the piece is split over the partitioner's axes (tensor; never along ``dim``).
    The gather then runs on each device's part (manual over those axes too), so neither it nor
    its transpose, the reduce-scatter of the gradient, ever holds the leaf whole over them.

    ``dtype``: the leaf is cast to it before the gather (:func:`gather_cast`), passed through
    ``tie`` first where given (as :meth:`gather_unit`); not with
    :data:`tpipe.core.layout.packed_places.FLAT` (the piece holds other leaves too)."""
    if dim == places.FLAT:
      flat = self._gather(piece, 0)
      return flat[:math.prod(shape)].reshape(shape)
    return self._gather_split(piece, dim, spec, dtype, tie)

  def _gather_split(self, leaf, dim: int, spec=None, dtype=None, tie=None):
    """:meth:`_gather` of ``leaf`` split over the partitioner's axes as ``spec`` says (or not,
    for None), on each device's part. Left to the partitioner, a gather over fsdp of a leaf
    split over ``expert`` gathered it over ``expert`` first: every device held every expert's
    weights whole (Mixtral-8x7B on v5p:4x4x4, stage 4 x expert 8 x fsdp 2: two all-gathers of
    448 and 896 MiB per expert matrix and unit)."""
    if _casts(leaf, dtype) and tie is not None:
      leaf = tie(leaf)
    if spec is None:
      return self._gather(leaf, dim, dtype)
    names = {a for entry in spec if entry is not None
             for a in (entry if isinstance(entry, tuple) else (entry,))}
    return jax.shard_map(lambda p: self._gather(p, dim, dtype), in_specs=spec, out_specs=spec,
                         axis_names=names)(leaf)

  def _gather(self, leaf, dim: int, dtype=None, tie=None):
    if not _casts(leaf, dtype):
      whole = lax.all_gather(leaf, self.axis, axis=dim, tiled=True)
    else:
      leaf = leaf if tie is None else tie(leaf)
      whole = gather_cast(leaf, self.axis, dim, np.dtype(dtype))
    return checkpoint_name(whole, remat_lib.CHUNK_PARAMS_NAME)


def specs_over_axes(full_specs, axes) -> tuple[dict, dict]:
  """``(shared, stacked)``: how one entry of each shared leaf (``{name: spec}``) and one copy
  of each stacked leaf (``{"layers_i": {keystr(path): spec}}``) split over the mesh axes
  ``axes`` (the partitioner's inside the tick loops: expert, tensor), from the staged partition
  specs (:meth:`StageLayout.partition_specs`'s tree); None where a leaf names none of them.
  What :meth:`Split.gather_piece` and :meth:`Split.gather_unit` take."""

  def over_axes(full_spec, lead):
    inner = [tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a in axes)
             for e in tuple(full_spec)[lead:]]
    if not any(inner):
      return None
    return P(*[None if not a else a[0] if len(a) == 1 else a for a in inner])

  shared = {name: over_axes(spec, 2) for name, spec in full_specs.get(desc.SHARED, {}).items()}
  stacked = {layer: {jax.tree_util.keystr(path): over_axes(spec, 3)
                     for path, spec in jax.tree_util.tree_flatten_with_path(
                         tree, is_leaf=_is_spec)[0]}
             for layer, tree in full_specs[desc.STACKED].items()}
  return shared, stacked


def _casts(leaf, dtype) -> bool:
  return dtype is not None and np.dtype(dtype) != leaf.dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather_cast(leaf, axis: str, dim: int, dtype):
  """``leaf`` (this device's share of a weight) cast to ``dtype`` and gathered over mesh axis
  ``axis`` along ``dim``: the values of ``lax.all_gather(leaf, axis, axis=dim,
  tiled=True).astype(dtype)``, moving ``dtype``'s bytes.

  Its gradient is that expression's too (each device gets its share of the whole gradient,
  summed over ``axis`` in ``leaf``'s dtype), computed a piece at a time: the whole gradient, in
  ``dtype``, is cut along its longest dimension other than ``dim`` into as many pieces as
  :data:`GRADIENT_PIECE_BYTES` of the converted gradient need (the last one smaller where they
  do not divide it; a 1-D gradient whole), and each is converted and reduce-scattered in turn
  (a loop, so the pieces' collectives are not combined back into one)."""
  return lax.all_gather(leaf.astype(dtype), axis, axis=dim, tiled=True)


def _gather_cast_forward(leaf, axis, dim, dtype):
  return gather_cast(leaf, axis, dim, dtype), leaf  # The leaf itself: no copy kept.


def _gather_cast_backward(axis, dim, dtype, leaf, grad):
  del dtype
  scatter = lambda g: lax.psum_scatter(g.astype(leaf.dtype), axis, scatter_dimension=dim,
                                       tiled=True)
  others = [d for d in range(grad.ndim) if d != dim]
  if not others:
    return (scatter(grad),)
  cut = max(others, key=lambda d: grad.shape[d])
  size = grad.shape[cut]
  pieces = -(-grad.size * np.dtype(leaf.dtype).itemsize // GRADIENT_PIECE_BYTES)
  step = -(-size // min(max(pieces, 1), size))
  if step == size:
    return (scatter(grad),)
  full = size // step  # Pieces of ``step`` in a loop, then what is left after them.

  def one_piece(i, total):
    piece = scatter(lax.dynamic_slice_in_dim(grad, i * step, step, axis=cut))
    return lax.dynamic_update_slice_in_dim(total, piece, i * step, axis=cut)

  total = lax.fori_loop(0, full, one_piece, spmd.zeros_like_varying(leaf))
  if full * step < size:
    rest = scatter(lax.slice_in_dim(grad, full * step, size, axis=cut))
    total = lax.dynamic_update_slice_in_dim(total, rest, full * step, axis=cut)
  return (total,)


gather_cast.defvjp(_gather_cast_forward, _gather_cast_backward)


def casts_before_gather(whole, run) -> dict[str, Any]:
  """``{keystr(path): dtype}``: the float leaves of ``whole`` (a unit's variables, gathered) that
  ``run(whole)`` only casts to a narrower float dtype, each element once
  (:func:`tpipe.core.programs.weight_casts.only_cast_dtypes` with ``through_moves``), so they can
  be cast before their gather (:func:`gather_cast`). None where casting them first would change what
  ``run`` returns (its shapes and dtypes: a layer that reads a leaf's dtype in Python). ``run`` is
  traced, nothing runs."""
  flat = jax.tree_util.tree_flatten_with_path(whole)[0]
  floats = [(jax.tree_util.keystr(path), leaf) for path, leaf in flat
            if jnp.issubdtype(leaf.dtype, jnp.floating)]

  def run_on(leaves):
    replaced = dict(zip([key for key, _ in floats], leaves))
    return run(jax.tree_util.tree_map_with_path(
        lambda path, leaf: replaced.get(jax.tree_util.keystr(path), leaf), whole))

  leaves = [leaf for _, leaf in floats]
  dtypes = weight_casts.only_cast_dtypes(run_on, leaves, through_moves=True)
  casts = {key: dtype for (key, leaf), dtype in zip(floats, dtypes)
           if dtype is not None and jnp.issubdtype(dtype, jnp.floating)
           and np.dtype(dtype).itemsize < np.dtype(leaf.dtype).itemsize}
  if casts:
    cast = [leaf.astype(casts[key]) if key in casts else leaf for key, leaf in floats]
    types = lambda tree: [(a.shape, a.dtype) for a in jax.tree.leaves(tree)]
    if types(jax.eval_shape(run_on, leaves)) != types(jax.eval_shape(run_on, cast)):
      return {}
  return casts


def _is_spec(value: Any) -> bool:
  return isinstance(value, jax.sharding.PartitionSpec)
