"""Parameters in the executor's stage layout, and the lossless way back to the logical layout.

At the API boundary a layer sequence's parameters are **logical**: ``{"layers_0": tree, ...}``,
one entry per layer as ``nn.Sequential`` names them, a repeated layer's copies stacked on a leading
axis (``nn.scan``'s layout). The executor wants them **staged**: the units of chunk
``c = r * S + s`` (stage ``s``'s ``r``-th chunk) flattened into one buffer per dtype, padded to the
largest chunk, and stacked ``[R, S, n]``, so the buffers split over the mesh's ``stage`` axis and
each device holds its own chunks only.

A training state kept staged needs no re-layout in the step: no all-gather or all-to-all of
parameters over ``stage``, for any schedule. Checkpoints are written logical (so they do not depend
on stages, balance or repeats) with :meth:`StageLayout.to_logical`, and read back with
:meth:`StageLayout.to_staged`; both are exact (reshapes and slices, no arithmetic).

Example::

  layout = StageLayout.build(groups, param_shapes, num_stages=4, num_repeats=1)
  staged = layout.to_staged(params)           # {"float32": [1, 4, n]}
  params_again = layout.to_logical(staged)    # == params, bit for bit
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from tpipe.core import packing


@dataclasses.dataclass(frozen=True)
class Group:
  """Consecutive units of one layer inside one chunk: a plain layer, or a slice of a repeated one.

  Attributes:
    layer: the layer's index in the sequence (its parameters are ``layers_{layer}``).
    first_unit: the global index of the group's first unit (RNG streams are folded by it).
    start: the first copy of a repeated layer in this group (0 for a plain layer).
    stop: one past the last copy (1 for a plain layer).
    repeated: whether the layer is repeated (its parameters have a leading copy axis).
  """

  layer: int
  first_unit: int
  start: int
  stop: int
  repeated: bool


def group_units(copies: Sequence[int | None],
                counts: Sequence[int]) -> tuple[tuple[Group, ...], ...]:
  """Cuts a layer sequence into chunks of ``counts`` units, grouped by layer.

  Args:
    copies: per layer, the number of copies of a repeated layer, or None for a plain layer (one
      unit).
    counts: units per chunk, in order; they sum to the number of units.

  Returns:
    Per chunk, its groups in order.
  """
  unit_layer = []
  for i, n in enumerate(copies):
    unit_layer += [(i, j) for j in range(1 if n is None else n)]
  if sum(counts) != len(unit_layer):
    raise ValueError(f"counts {tuple(counts)} sum to {sum(counts)}, not the {len(unit_layer)} "
                     "units of the layers.")
  groups, start = [], 0
  for count in counts:
    chunk = []
    for u in range(start, start + count):
      i, j = unit_layer[u]
      if chunk and chunk[-1].layer == i:
        chunk[-1] = dataclasses.replace(chunk[-1], stop=j + 1)
      else:
        chunk.append(Group(layer=i, first_unit=u, start=j, stop=j + 1,
                           repeated=copies[i] is not None))
    groups.append(tuple(chunk))
    start += count
  return tuple(groups)


def _slice_shapes(tree, start: int, stop: int):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct((stop - start,) + tuple(a.shape[1:]),
                                                     a.dtype), tree)


def _abstract(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


@dataclasses.dataclass(frozen=True, eq=False)
class StageLayout:
  """Where every logical parameter lives in the staged buffers ``{dtype: [R, S, n]}``.

  Attributes:
    groups: per chunk (``c = r * S + s``), the layer groups it holds.
    num_stages: S.
    num_repeats: R, chunks per stage.
    placement: where chunk ``c`` lives (see :func:`tpipe.schedules.virtual_stages`): ``"loop"``
      puts it at ``[c // S, c % S]``; ``"v"`` (ZB-V, ``R = 2``) puts the first S chunks down
      the stages and the next S back up, chunk ``c >= S`` at ``[1, 2S - 1 - c]``.
    chunk_layouts: per chunk, the packing of its groups' parameter trees (a list, one per group).
    sizes: per dtype, the buffer length n (the largest chunk's need).
    logical: the logical parameters' abstract shapes ``{"layers_i": tree}``.
  """

  groups: tuple[tuple[Group, ...], ...]
  num_stages: int
  num_repeats: int
  chunk_layouts: tuple[packing.Layout, ...]
  sizes: dict[str, int]
  logical: Any
  placement: str = "loop"

  @classmethod
  def build(cls, groups, param_shapes: Mapping[str, Any], num_stages: int,
            num_repeats: int, placement: str = "loop") -> "StageLayout":
    """The layout of ``param_shapes`` (logical, arrays or ShapeDtypeStructs) cut by ``groups``."""
    if len(groups) != num_stages * num_repeats:
      raise ValueError(f"{len(groups)} chunks for {num_stages} stages x {num_repeats} repeats.")
    if placement not in ("loop", "v") or (placement == "v" and num_repeats != 2):
      raise ValueError(f"placement must be 'loop', or 'v' with 2 repeats; got {placement!r} with "
                       f"{num_repeats} repeats.")
    logical = _abstract(dict(param_shapes))
    layouts = []
    for chunk in groups:
      trees = [_slice_shapes(logical[f"layers_{g.layer}"], g.start, g.stop) if g.repeated
               else logical[f"layers_{g.layer}"] for g in chunk]
      layouts.append(packing.layout_of(trees))
    return cls(groups=tuple(groups), num_stages=num_stages, num_repeats=num_repeats,
               chunk_layouts=tuple(layouts), sizes=packing.buffer_sizes(layouts),
               logical=logical, placement=placement)

  @property
  def num_chunks(self) -> int:
    return len(self.groups)

  def position(self, chunk: int) -> tuple[int, int]:
    """``(r, s)``: chunk ``chunk``'s local chunk index and stage in the staged buffers."""
    r, s = divmod(chunk, self.num_stages)
    if self.placement == "v" and r == 1:
      s = self.num_stages - 1 - s
    return r, s

  def staged_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
    """The staged buffers' abstract shapes ``{dtype: [R, S, n]}``."""
    return {k: jax.ShapeDtypeStruct((self.num_repeats, self.num_stages, n), jnp.dtype(k))
            for k, n in self.sizes.items()}

  def check_staged(self, staged, what: str = "staged params") -> None:
    """Raises ValueError unless ``staged`` has this layout's buffers and shapes."""
    want = {k: tuple(s.shape) for k, s in self.staged_shapes().items()}
    got = ({k: tuple(np.shape(v)) for k, v in staged.items()} if isinstance(staged, Mapping)
           else type(staged).__name__)
    if got != want:
      raise ValueError(
          f"{what} have buffers {got}, but this model's stage layout needs {want} (R x S x "
          "elements per dtype). They were made for another split (stages, repeats or balance): "
          "convert them with that model's layout.to_logical(...) and this one's to_staged(...), "
          "or pass logical params {'layers_0': ..., ...}.")

  def chunk_params(self, buffers: Mapping[str, jax.Array], chunk: int) -> list:
    """Chunk ``chunk``'s group parameter trees from its 1-D buffers ``{dtype: [n]}``."""
    return packing.unpack(buffers, self.chunk_layouts[chunk])

  def to_staged(self, params: Mapping[str, Any]) -> dict[str, jax.Array]:
    """Logical ``{"layers_i": tree}`` to staged ``{dtype: [R, S, n]}``; exact."""
    packed = []
    for chunk, layout in zip(self.groups, self.chunk_layouts):
      trees = []
      for g in chunk:
        name = f"layers_{g.layer}"
        # A layer without variables may be left out (Flax omits empty collections).
        tree = params[name] if name in params or jax.tree.leaves(self.logical[name]) else {}
        trees.append(jax.tree.map(lambda a, g=g: a[g.start:g.stop], tree) if g.repeated
                     else tree)
      packed.append(packing.pack(trees, layout, self.sizes))
    # Buffer position r * S + s holds the chunk placed at (r, s).
    order = np.argsort([r * self.num_stages + s for r, s in map(self.position,
                                                                range(self.num_chunks))])
    return {k: jnp.stack([packed[c][k] for c in order]).reshape(
        (self.num_repeats, self.num_stages, self.sizes[k])) for k in self.sizes}

  def to_logical(self, staged: Mapping[str, jax.Array]) -> dict[str, Any]:
    """Staged ``{dtype: [R, S, n]}`` to logical ``{"layers_i": tree}``; exact."""
    self.check_staged(staged)
    pieces: dict[int, list] = {}
    for c, chunk in enumerate(self.groups):
      r, s = self.position(c)
      trees = self.chunk_params({k: v[r, s] for k, v in staged.items()}, c)
      for g, tree in zip(chunk, trees):
        pieces.setdefault(g.layer, []).append((g.start, g.repeated, tree))
    logical = {}
    for layer in sorted(pieces):
      parts = sorted(pieces[layer], key=lambda p: p[0])
      if parts[0][1]:
        logical[f"layers_{layer}"] = jax.tree.map(lambda *a: jnp.concatenate(a, 0),
                                                  *[p[2] for p in parts])
      else:
        logical[f"layers_{layer}"] = parts[0][2]
    return logical

  def partition_specs(self, stage_axis: str = "stage") -> dict[str, P]:
    """Where the staged buffers live: split over ``stage_axis`` on their stage axis."""
    return {k: P(None, stage_axis) for k in self.sizes}

  def chunk_bytes(self) -> list[int]:
    """Per chunk, the bytes of parameters it holds (without padding)."""
    return [sum(n * jnp.dtype(k).itemsize for k, n in layout.sizes().items())
            for layout in self.chunk_layouts]

  def buffer_bytes(self) -> int:
    """Bytes of one chunk's padded buffers (what every chunk slot occupies)."""
    return sum(n * jnp.dtype(k).itemsize for k, n in self.sizes.items())
