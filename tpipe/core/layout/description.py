"""The stage layout: where a layer sequence's variables live on the stages, and the way back.

At the API boundary variables are **logical**: ``{"layers_0": tree, "layers_1": tree, ...}``, one
entry per layer as ``nn.Sequential`` names them, a repeated layer's copies stacked on a leading
axis (``nn.scan``'s layout). The tick loops read them **staged**: every leaf has leading
``[R, S]`` axes (stage ``s``'s ``r``-th chunk at ``[r, s]``) split over the mesh's ``stage``
axis, so each device holds its own chunks only. A :class:`StageLayout` describes the staged tree
of one collection (parameters, or BatchNorm's statistics) for one split::

  {"stacked": {"layers_i": tree of [R, S, k_i, ...]},   # per leaf, a repeated layer's copies
   "packed": {dtype: [P, S, n]}}                        # everything else, one buffer per dtype

* **Stacked, per leaf.** A repeated layer with copies in every chunk keeps ``k_i`` copies per
  chunk (the fewest any chunk has) as real leaves, with the layer's own names and shapes, so
  optimizer masks, per-weight partition specs and checkpoints see them. For an even split (every
  chunk the same number of copies, ``tpipe.pipeline``) that is all of them and the staged leaf is
  the logical one reshaped, ``[L, ...] -> [R, S, L / (S R), ...]``.
* **Packed.** Plain layers (an embedding, a head), a chunk's copies beyond ``k_i``, and repeated
  layers that some chunk lacks, packed per dtype (:mod:`tpipe.core.base.packing`): the one buffer a
  ``lax.switch`` branch can read whatever its layers are. Each chunk reads a **window** of its
  stage's buffer: its own elements, at its own offset. With ``packing="stage"`` (parameters) a
  stage's R chunks lie one after the other in one buffer (``P = 1``), padded to the fullest
  stage's: circular repeats with the embedding on stage 0's first chunk and the head on the last
  stage's last chunk hold each once, where a buffer per slot would pad every slot to the
  embedding. With ``packing="slot"`` (running statistics, which a branch hands back as a whole
  slot) each chunk has a slot of its own (``P = R``) padded to the fullest chunk. With R = 1 the
  two are the same. Splitting a chunk's copies this way pads no stage beyond the fullest. On a
  mesh with ``fsdp``
  devices a buffer is ``fsdp`` equal blocks, and block ``f`` holds piece ``f`` of every leaf: the
  leaf cut evenly along one of its own dimensions (the one its partition spec splits over
  ``fsdp``, else its largest divisible one; the flattened elements, padded, where none divides),
  so the device holding block ``f`` holds whole rows or columns of each weight; a chunk's window
  is the same range of every block.

Every conversion is exact (slices, reshapes, concatenations; no arithmetic).

A :class:`StageLayout` is a description: it holds no arrays and runs nothing. What reads it lives
in its own module: packing one chunk (:mod:`tpipe.core.layout.pack`), bytes and masks
(:mod:`tpipe.core.layout.accounting`) and whole trees logical to staged and back
(:mod:`tpipe.core.layout.staging`).

Example::

  layout = StageLayout.build(plan.groups, param_shapes, num_stages=4, num_repeats=1)
  staged = staging.to_staged(layout, params)         # {"stacked": {...}, "packed": {...}}
  params_again = staging.to_logical(layout, staged)  # == params, bit for bit
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from tpipe import axis_rules
from tpipe import mesh as mesh_lib
from tpipe import schedules
from tpipe.core.base import layers as layers_lib
from tpipe.core.base import packing as packing_lib
from tpipe.core.layout import packed_places as places
from tpipe.core.layout import shared_leaves as shared_lib
from tpipe.core.planning import plan as plan_lib

STACKED = "stacked"
PACKED = "packed"
SHARED = "shared"
PACKINGS = ("stage", "slot")


@dataclasses.dataclass(frozen=True)
class Segment:
  """Units of one group that a chunk reads from one place of the staged tree.

  Attributes:
    group: the group's index in its chunk.
    layer: the layer's index in the sequence.
    first_unit: the global index of the segment's first unit.
    first_copy: the first copy of the layer in the segment (0 for a plain layer).
    copies: ``None`` for a plain layer's one unit; the number of copies of a repeated layer.
    stacked: read from the layer's per-leaf stacked arrays (else from the packed buffers).
  """

  group: int
  layer: int
  first_unit: int
  first_copy: int
  copies: int | None
  stacked: bool


def chunk_segments(chunk: Sequence[plan_lib.Group],
                   stacked: Mapping[int, int]) -> tuple[Segment, ...]:
  """A chunk's groups cut into segments: a stacked layer's first ``k`` copies, then the rest."""
  out = []
  for gi, g in enumerate(chunk):
    if not g.repeated:
      out.append(Segment(gi, g.layer, g.first_unit, 0, None, False))
      continue
    k = stacked.get(g.layer, 0)
    if k:
      out.append(Segment(gi, g.layer, g.first_unit, g.start, k, True))
    if g.size > k:
      out.append(Segment(gi, g.layer, g.first_unit + k, g.start + k, g.size - k, False))
  return tuple(out)


def slice_shapes(tree, start: int, stop: int):
  """The abstract shapes of ``tree``'s leaves cut to ``[start:stop]`` on their leading axis."""

  def cut(a):
    return jax.ShapeDtypeStruct((stop - start,) + tuple(a.shape[1:]), a.dtype)

  return jax.tree.map(cut, tree)


def segment_shapes(logical, seg: Segment):
  """The abstract variables of segment ``seg`` (a repeated layer's copies in it)."""
  tree = logical[f"layers_{seg.layer}"]
  if seg.copies is None:
    return tree
  return slice_shapes(tree, seg.first_copy, seg.first_copy + seg.copies)


def with_leaf(tree, path: str, value):
  """``tree`` with the leaf (or None hole) at key path ``path`` (a keystr) replaced."""

  def replace(p, leaf):
    return value if jax.tree_util.keystr(p) == path else leaf

  return jax.tree_util.tree_map_with_path(replace, tree, is_leaf=lambda x: x is None)


def leaf_at(tree, path: str):
  """The leaf of ``tree`` at key path ``path`` (a keystr)."""
  for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if jax.tree_util.keystr(p) == path:
      return leaf
  raise KeyError(f"no leaf at {path} in {jax.tree.map(jnp.shape, tree)}.")


def _default_stacked(groups, logical) -> dict[int, int]:
  """Every repeated layer with copies in every chunk (and variables), with the fewest copies
  any chunk has."""
  stacked = {}
  repeated = {g.layer for chunk in groups for g in chunk if g.repeated}
  for layer in sorted(repeated):
    per_chunk = [sum(g.size for g in chunk if g.layer == layer) for chunk in groups]
    has_leaves = bool(jax.tree.leaves(logical.get(f"layers_{layer}", {})))
    if min(per_chunk) and has_leaves:
      stacked[layer] = min(per_chunk)
  return stacked


@dataclasses.dataclass(frozen=True)
class _Cut:
  """How packed leaves are cut into fsdp pieces: ``shards`` pieces, split where the leaves'
  logical ``axes`` and the ``mesh``'s ``rules`` say; weights in shared leaves (``moved``:
  ``(chunk, layer, path)``) are left out."""

  axes: Mapping[str, Mapping[str, tuple | None]]
  shards: int
  mesh: Any
  rules: Any
  moved: frozenset


def _packed_pieces(logical, segments, cut: _Cut):
  """Per chunk, the packing of its packed segments' pieces, and where each leaf is cut."""
  layouts, dims = [], []
  for c, chunk in enumerate(segments):
    pieces, chunk_dims = [], []
    for seg in chunk:
      if seg.stacked:
        continue
      names = cut.axes.get(f"layers_{seg.layer}", {})
      copy_axis = int(seg.copies is not None)

      def piece(path, a, names=names, copy_axis=copy_axis, layer=seg.layer, c=c):
        key = jax.tree_util.keystr(path)
        if (c, layer, key) in cut.moved:
          return None  # In a shared leaf: left out of the packing.
        dim = places.cut_dim(a.shape[copy_axis:], names.get(key), cut.shards, cut.mesh,
                             cut.rules)
        if dim != places.FLAT:
          dim += copy_axis
        chunk_dims.append(dim)
        return jax.ShapeDtypeStruct(places.piece_shape(a.shape, dim, cut.shards), a.dtype)

      pieces.append(jax.tree_util.tree_map_with_path(piece, segment_shapes(logical, seg)))
    layouts.append(packing_lib.layout_of(pieces))
    dims.append(tuple(chunk_dims))
  return tuple(layouts), tuple(dims)


def _shared_candidates(logical, segments, axes, num_stages: int, placement: str) -> list:
  """The plain layers' weights (:class:`tpipe.core.layout.shared_leaves.Candidate`), chunk by
  chunk."""
  out = []
  for c, chunk in enumerate(segments):
    _, stage = places.position(c, num_stages, placement)
    for seg in chunk:
      if seg.stacked or seg.copies is not None:
        continue
      names = axes.get(f"layers_{seg.layer}", {})
      for path, leaf in jax.tree_util.tree_flatten_with_path(segment_shapes(logical, seg))[0]:
        key = jax.tree_util.keystr(path)
        given = names.get(key)
        out.append(shared_lib.Candidate(
            chunk=c, stage=stage, layer=seg.layer, path=key, shape=tuple(leaf.shape),
            dtype=jnp.dtype(leaf.dtype).name,
            names=tuple(given) if given is not None else None))
  return out


@dataclasses.dataclass(frozen=True, eq=False)
class StageLayout:
  """The staged tree of one collection for one split (see the module documentation).

  Attributes:
    groups: per model chunk (in model-chunk order), its groups.
    num_stages: S.
    num_repeats: R, chunks per stage.
    placement: where model chunk ``c`` lives (:func:`tpipe.schedules.actions.virtual_stages`).
    logical: the logical variables' abstract shapes ``{"layers_i": tree}``.
    stacked: ``{layer: k}``: the copies per chunk a repeated layer keeps per leaf.
    segments: per model chunk, its :class:`Segment` s in order.
    packed_layouts: per model chunk, the packing of its packed segments' trees (a list).
    packed_sizes: per dtype, the packed buffer's length: ``packed_shards`` blocks of the fullest
      stage's need (``packing="stage"``) or chunk's (``"slot"``).
    axes: per layer ``"layers_i"``, the logical axis names its own annotations give each leaf
      (``{jax.tree_util.keystr(path): names}``, one name or None per dimension of one copy), or
      None for a leaf without annotation; layers or leaves absent have none. Read by
      :meth:`partition_specs`.
    packed_shards: the blocks a packed buffer is cut into (the mesh's ``fsdp`` size).
    packed_dims: per model chunk, per leaf of its packing, the dimension a leaf is cut along
      into ``packed_shards`` pieces, or :data:`tpipe.core.layout.packed_places.FLAT` (its flattened
      elements, padded). The packing (``packed_layouts``) describes one piece of each leaf.
    packing: ``"stage"``: a stage's chunks share one packed buffer per dtype; ``"slot"``: each
      chunk slot has its own (see :mod:`tpipe.core.layout.description`).
    packed_offsets: per model chunk, per dtype, where its window starts in each block.
    packed_windows: per model chunk, per dtype, its window's length in each block (its own need
      with ``"stage"``; the whole block with ``"slot"``).
    shared: the shared leaves (:class:`tpipe.core.layout.shared_leaves.Group`).
  """

  groups: tuple[tuple[plan_lib.Group, ...], ...]
  num_stages: int
  num_repeats: int
  placement: str
  logical: Any
  stacked: dict[int, int]
  segments: tuple[tuple[Segment, ...], ...]
  packed_layouts: tuple[packing_lib.Layout, ...]
  packed_sizes: dict[str, int]
  axes: Mapping[str, Mapping[str, tuple | None]] = dataclasses.field(default_factory=dict)
  packed_shards: int = 1
  packed_dims: tuple[tuple[int, ...], ...] = ()
  packing: str = "stage"
  packed_offsets: tuple[dict[str, int], ...] = ()
  packed_windows: tuple[dict[str, int], ...] = ()
  shared: tuple[shared_lib.Group, ...] = ()

  @classmethod
  def build(cls, groups, logical_shapes: Mapping[str, Any], num_stages: int, num_repeats: int,
            placement: str = "loop", stacked: Mapping[int, int] | None = None, *,
            axes: Mapping[str, Mapping[str, tuple | None]] | None = None,
            mesh=None, rules=None, packing: str = "stage"):
    """The layout of ``logical_shapes`` (arrays or ShapeDtypeStructs) cut by ``groups``.

    Args:
      groups: per model chunk, its groups (:attr:`tpipe.core.planning.plan.Plan.groups`).
      logical_shapes: ``{"layers_i": tree}``, arrays or ShapeDtypeStructs.
      num_stages: S.
      num_repeats: R.
      placement: where model chunks live.
      stacked: ``{layer: k}`` to keep per leaf; by default every repeated layer with copies in
        every chunk keeps the fewest any chunk has. Give another collection's layout's
        ``stacked`` so both cut their chunks into the same segments.
      axes: the leaves' logical axis names (see the class attribute).
      mesh: the mesh the layout is for (a ``Mesh`` or ``AbstractMesh``), or None: with an
        ``fsdp`` axis of more than one device the packed buffers are cut in that many blocks.
      rules: logical-name rules, for where a packed leaf is cut (default
        :func:`tpipe.axis_rules.resolve_rules`'s).
      packing: ``"stage"`` (a stage's chunks in one buffer) or ``"slot"`` (a buffer per chunk
        slot, for a collection the branches hand back a slot of).
    """
    if packing not in PACKINGS:
      raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}.")
    if len(groups) != num_stages * num_repeats:
      raise ValueError(f"{len(groups)} chunks for {num_stages} stages x {num_repeats} repeats.")
    schedules.actions.virtual_stages(placement, num_stages, num_repeats)  # Raises if unknown.
    logical = layers_lib.abstract(dict(logical_shapes))
    if stacked is None:
      stacked = _default_stacked(groups, logical)
    stacked = dict(stacked)
    segments = tuple(chunk_segments(chunk, stacked) for chunk in groups)
    axes = {k: dict(v) for k, v in (axes or {}).items()}
    shards = 1
    if mesh is not None:
      shards = dict(mesh.shape).get(mesh_lib.FSDP_AXIS, 1)
    shared = ()
    if packing == "stage":  # Running statistics (a slot the branches hand back) stay packed.
      candidates = _shared_candidates(logical, segments, axes, num_stages, placement)
      shared = shared_lib.plan(candidates, num_stages)
    moved = frozenset((m.chunk, m.layer, m.path) for g in shared for m in g.members)
    cut = _Cut(axes=axes, shards=shards, mesh=mesh, rules=rules, moved=moved)
    layouts, dims = _packed_pieces(logical, segments, cut)
    offsets, windows, block = places.windows(layouts, num_stages, num_repeats, placement, packing)
    packed_sizes = {k: n * shards for k, n in block.items()}
    return cls(groups=tuple(groups), num_stages=num_stages, num_repeats=num_repeats,
               placement=placement, logical=logical, stacked=stacked, segments=segments,
               packed_layouts=layouts, packed_sizes=packed_sizes, axes=axes,
               packed_shards=shards, packed_dims=dims, packing=packing,
               packed_offsets=offsets, packed_windows=windows, shared=shared)

  # ------------------------------------------------------------------------------------------
  # Places.

  @property
  def num_chunks(self) -> int:
    return len(self.groups)

  def position(self, chunk: int) -> tuple[int, int]:
    """``(r, s)``: model chunk ``chunk``'s local chunk index and stage."""
    return places.position(chunk, self.num_stages, self.placement)

  def chunk_at(self, r: int, s: int) -> int:
    """The model chunk at local chunk ``r`` of stage ``s``."""
    return next(c for c in range(self.num_chunks) if self.position(c) == (r, s))

  @property
  def packed_slots(self) -> int:
    """P: packed buffers per stage and dtype (1 with ``packing="stage"``, else R)."""
    return 1 if self.packing == "stage" else self.num_repeats

  def packed_place(self, chunk: int) -> tuple[int, int]:
    """``(p, s)``: the packed slot and stage whose buffers hold model chunk ``chunk``'s
    window."""
    r, s = self.position(chunk)
    return (0 if self.packing == "stage" else r), s

  def window(self, buffers: Mapping[str, jax.Array], chunk: int, offsets=None,
             blocks: int | Mapping[str, int] | None = None) -> dict[str, jax.Array]:
    """Model chunk ``chunk``'s window ``{dtype: [blocks * w]}`` of one packed slot's buffers
    ``{dtype: [blocks * n]}`` (:func:`tpipe.core.layout.packed_places.window`): at ``offsets`` (per
    dtype, ints or traced; default the chunk's own), ``blocks`` blocks (default
    ``packed_shards``: whole buffers; 1 for a device's own fsdp block)."""
    blocks = self.packed_shards if blocks is None else blocks
    offsets = self.packed_offsets[chunk] if offsets is None else offsets
    return places.window(buffers, offsets, self.packed_windows[chunk], blocks)

  def chunk_local(self, staged, chunk: int) -> dict[str, Any]:
    """What model chunk ``chunk`` reads (:func:`tpipe.core.layout.pack.chunk_trees`) from a
    whole staged tree: its stacked slot and its packed window."""
    r, s = self.position(chunk)
    p, _ = self.packed_place(chunk)
    stacked = jax.tree.map(lambda a: a[r, s], staged[STACKED])
    buffers = {k: a[p, s] for k, a in staged[PACKED].items()}
    packed = self.window(buffers, chunk)
    shared = {k: a[:, s] for k, a in staged.get(SHARED, {}).items()}
    return {STACKED: stacked, PACKED: packed, SHARED: shared}

  def shared_members(self, chunk: int) -> list:
    """Model chunk ``chunk``'s weights in shared leaves: ``(segment index, group, member)``."""
    index = {}
    for k, seg in enumerate(self.segments[chunk]):
      if not seg.stacked and seg.copies is None:
        index[seg.layer] = k
    out = []
    for g in self.shared:
      for m in g.members:
        if m.chunk == chunk:
          out.append((index[m.layer], g, m))
    return out

  # ------------------------------------------------------------------------------------------
  # Shapes.

  def local_shapes(self) -> dict[str, Any]:
    """The staged tree without its leading axes: one chunk slot's stacked leaves, one packed
    slot's buffers (``[n]``; with ``packing="slot"`` the whole tree is one chunk slot) and one
    entry of each shared leaf."""
    stacked = {}
    for i, k in self.stacked.items():
      stacked[f"layers_{i}"] = slice_shapes(self.logical[f"layers_{i}"], 0, k)
    packed = {k: jax.ShapeDtypeStruct((n,), jnp.dtype(k)) for k, n in self.packed_sizes.items()}
    shared = {g.name: jax.ShapeDtypeStruct(g.shape, jnp.dtype(g.dtype)) for g in self.shared}
    return {STACKED: stacked, PACKED: packed, SHARED: shared}

  def chunk_shapes(self, chunk: int) -> dict[str, Any]:
    """What model chunk ``chunk`` reads (:meth:`chunk_local`), abstract."""
    local = self.local_shapes()
    packed = {}
    for k, w in self.packed_windows[chunk].items():
      packed[k] = jax.ShapeDtypeStruct((w * self.packed_shards,), jnp.dtype(k))
    shared = {}
    for g in self.shared:
      shared[g.name] = jax.ShapeDtypeStruct((g.slots,) + g.shape, jnp.dtype(g.dtype))
    return {STACKED: local[STACKED], PACKED: packed, SHARED: shared}

  def staged_shapes(self) -> dict[str, Any]:
    """The staged tree's abstract shapes (stacked leaves ``[R, S, ...]``, packed ``[P, S, n]``,
    shared ``[P_g, S, ...]``)."""

    def lead(n):
      def shape(a):
        return jax.ShapeDtypeStruct((n, self.num_stages) + tuple(a.shape), a.dtype)
      return shape

    local = self.local_shapes()
    shared = {g.name: lead(g.slots)(local[SHARED][g.name]) for g in self.shared}
    return {STACKED: jax.tree.map(lead(self.num_repeats), local[STACKED]),
            PACKED: jax.tree.map(lead(self.packed_slots), local[PACKED]),
            SHARED: shared}

  def packed_shapes(self, chunk: int) -> list:
    """Model chunk ``chunk``'s packed trees (one per packed segment), abstract, whole; a weight
    in a shared leaf is None there."""
    segments = self.segments[chunk]
    trees = self.without_shared([segment_shapes(self.logical, seg) for seg in segments], chunk)
    return [tree for seg, tree in zip(segments, trees) if not seg.stacked]

  def without_shared(self, trees: Sequence[Any], chunk: int) -> list:
    """``trees`` (one per segment of ``chunk``) with the weights in shared leaves None."""
    trees = list(trees)
    for k, _, member in self.shared_members(chunk):
      trees[k] = with_leaf(trees[k], member.path, None)
    return trees

  def piece_dims(self, chunk: int) -> list:
    """Per packed segment of model chunk ``chunk`` (in order), a tree shaped like its variables
    holding where each leaf was cut into ``packed_shards`` pieces: a dimension of the segment's
    tree (a run's copy axis first), or :data:`tpipe.core.layout.packed_places.FLAT`."""
    trees = self.packed_shapes(chunk)
    dims = iter(self.packed_dims[chunk])
    return [jax.tree.map(lambda _: next(dims), tree) for tree in trees]

  def check_staged(self, staged, what: str = "staged variables") -> None:
    """Raises ValueError unless ``staged`` has this layout's structure and shapes."""
    want = jax.tree.map(lambda a: tuple(a.shape), self.staged_shapes())
    try:
      got = jax.tree.map(lambda a: tuple(np.shape(a)), dict(staged))
    except (TypeError, ValueError):
      got = type(staged).__name__
    if got != want:
      raise ValueError(
          f"{what} have shapes {got}, but this model's stage layout needs {want}. They were "
          "made for another split (stages, repeats or balance): convert them with "
          "tpipe.staging.to_logical(that model's layout, ...) and tpipe.staging.to_staged(this "
          "one's layout, ...), or pass logical variables {'layers_0': ..., ...}.")

  # ------------------------------------------------------------------------------------------
  # Partition specs.

  def partition_specs(self, stage_axis: str = "stage", mesh=None, rules=None):
    """Where the staged tree lives: every leaf split over ``stage_axis`` on its stage axis.

    With a ``mesh`` that has ``fsdp`` or ``tensor`` devices, each weight is split over them
    inside its stage too: a per-leaf weight ``[R, S, k, ...]`` as its logical axis names and
    ``rules`` say (:func:`tpipe.axis_rules.weight_spec`; FSDP over its largest axis without
    names), a packed buffer ``[R, S, n]`` over ``fsdp`` (its elements belong to many weights,
    so it takes no tensor axis).

    Args:
      stage_axis: the stage axis.
      mesh: the mesh (a ``Mesh`` or ``AbstractMesh``), or None for the stage split alone.
      rules: logical-name rules (default :func:`tpipe.axis_rules.resolve_rules`'s).
    """
    if mesh is None:
      return jax.tree.map(lambda _: P(None, stage_axis), self.local_shapes())
    # (Shared leaves: the stage axis in front of their entries, split inside a stage by their
    # logical names as a stacked leaf is.)
    reserved = (stage_axis, mesh_lib.DATA_AXIS)  # The tick loops' manual axes.
    rules = axis_rules.resolve_rules(rules)
    local = self.local_shapes()

    def stacked_spec(layer):
      names = self.axes.get(layer, {})

      def spec(path, leaf):
        inner = axis_rules.weight_spec(leaf.shape[1:], names.get(jax.tree_util.keystr(path)),
                                       mesh, rules, reserved=reserved)
        return P(None, stage_axis, None, *inner) if inner else P(None, stage_axis)

      return spec

    stacked = {}
    for layer, tree in local[STACKED].items():
      stacked[layer] = jax.tree_util.tree_map_with_path(stacked_spec(layer), tree)
    # In blocks over fsdp when the layout was built for this mesh's fsdp axis; else whole.
    mesh_shards = dict(mesh.shape).get(mesh_lib.FSDP_AXIS, 1)
    split = self.packed_shards > 1 and self.packed_shards == mesh_shards
    packed_spec = P(None, stage_axis, mesh_lib.FSDP_AXIS) if split else P(None, stage_axis)
    packed = {k: packed_spec for k in local[PACKED]}
    shared = {}
    for g in self.shared:
      inner = axis_rules.weight_spec(g.shape, g.names, mesh, rules, reserved=reserved)
      shared[g.name] = P(None, stage_axis, *inner)
    return {STACKED: stacked, PACKED: packed, SHARED: shared}

  def piece_specs(self, chunk: int, mesh, axes_used, rules=None) -> list:
    """Per packed segment of model chunk ``chunk``, a tree of one copy's partition specs over
    the mesh axes in ``axes_used`` alone (inside the tick loops: the axes left to the
    partitioner, ``tensor``), as the leaves' logical names say, or None for a leaf with none
    of them. A dimension the leaf was cut along into fsdp pieces stays whole: the piece
    gathers whole along it."""
    rules = axis_rules.resolve_rules(rules)
    reserved = tuple(a for a in mesh.axis_names if a not in axes_used)
    packed_segments = [seg for seg in self.segments[chunk] if not seg.stacked]
    out = []
    for seg, shapes, dims in zip(packed_segments, self.packed_shapes(chunk),
                                 self.piece_dims(chunk)):
      names = self.axes.get(f"layers_{seg.layer}", {})
      copy_axis = int(seg.copies is not None)

      def spec(path, leaf, dim, names=names, copy_axis=copy_axis):
        shape = leaf.shape[copy_axis:]
        given = names.get(jax.tree_util.keystr(path))
        entries = list(axis_rules.weight_spec(shape, given, mesh, rules, reserved=reserved))
        if dim != places.FLAT and dim - copy_axis < len(entries):
          entries[dim - copy_axis] = None
        if all(e is None for e in entries):
          return None
        return P(*entries)

      out.append(jax.tree_util.tree_map_with_path(spec, shapes, dims))
    return out
