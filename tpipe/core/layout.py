"""Where a layer sequence's variables live on the stages, and the exact way back.

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
  layers that some chunk lacks, packed per dtype (:mod:`tpipe.core.packing`): the one buffer a
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

Example::

  layout = StageLayout.build(plan.groups, param_shapes, num_stages=4, num_repeats=1)
  staged = layout.to_staged(params)           # {"stacked": {...}, "packed": {...}}
  params_again = layout.to_logical(staged)    # == params, bit for bit
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
from tpipe.core import layers as layers_lib
from tpipe.core import packed_places as places
from tpipe.core import packing as packing_lib
from tpipe.core import plan as plan_lib
from tpipe.core import shared_leaves as shared_lib

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


def _segments(chunk: Sequence[plan_lib.Group], stacked: Mapping[int, int]) -> tuple[Segment, ...]:
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


def _slice(tree, start: int, stop: int):
  return jax.tree.map(lambda a: a[start:stop], tree)


def _slice_shapes(tree, start: int, stop: int):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct((stop - start,) + tuple(a.shape[1:]),
                                                     a.dtype), tree)


@dataclasses.dataclass(frozen=True, eq=False)
class StageLayout:
  """The staged tree of one collection for one split (see the module documentation).

  Attributes:
    groups: per model chunk (in model-chunk order), its groups.
    num_stages: S.
    num_repeats: R, chunks per stage.
    placement: where model chunk ``c`` lives (:func:`tpipe.schedules.virtual_stages`).
    logical: the logical variables' abstract shapes ``{"layers_i": tree}``.
    stacked: ``{layer: k}``: the copies per chunk a repeated layer keeps per leaf.
    segments: per model chunk, its :class:`Segment` s in order.
    packed_layouts: per model chunk, the packing of its packed segments' trees (a list).
    packed_sizes: per dtype, the packed buffer's length: ``packed_shards`` blocks of the fullest
      stage's need (``packing="stage"``) or chunk's (``"slot"``).
    packing: ``"stage"``: a stage's chunks share one packed buffer per dtype; ``"slot"``: each
      chunk slot has its own (see the module documentation).
    packed_offsets: per model chunk, per dtype, where its window starts in each block.
    packed_windows: per model chunk, per dtype, its window's length in each block (its own need
      with ``"stage"``; the whole block with ``"slot"``).
    packed_shards: the blocks a packed buffer is cut into (the mesh's ``fsdp`` size).
    packed_dims: per model chunk, per leaf of its packing, the dimension a leaf is cut along
      into ``packed_shards`` pieces, or :data:`tpipe.core.packed_places.FLAT` (its flattened
      elements, padded). The packing (``packed_layouts``) describes one piece of each leaf.
    axes: per layer ``"layers_i"``, the logical axis names its own annotations give each leaf
      (``{jax.tree_util.keystr(path): names}``, one name or None per dimension of one copy), or
      None for a leaf without annotation; layers or leaves absent have none. Read by
      :meth:`partition_specs`.
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
            mesh=None, rules=None, packing: str = "stage") -> "StageLayout":
    """The layout of ``logical_shapes`` (arrays or ShapeDtypeStructs) cut by ``groups``.

    Args:
      groups: per model chunk, its groups (:attr:`tpipe.core.plan.Plan.groups`).
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
    schedules.virtual_stages(placement, num_stages, num_repeats)  # Raises if unknown.
    logical = layers_lib.abstract(dict(logical_shapes))
    if stacked is None:
      stacked = {}
      repeated = {g.layer for chunk in groups for g in chunk if g.repeated}
      for layer in sorted(repeated):
        per_chunk = [sum(g.size for g in chunk if g.layer == layer) for chunk in groups]
        if min(per_chunk) and jax.tree.leaves(logical.get(f"layers_{layer}", {})):
          stacked[layer] = min(per_chunk)
    stacked = dict(stacked)
    segments = tuple(_segments(chunk, stacked) for chunk in groups)
    axes = {k: dict(v) for k, v in (axes or {}).items()}
    shards = dict(mesh.shape).get(mesh_lib.FSDP_AXIS, 1) if mesh is not None else 1
    shared = ()
    if packing == "stage":  # Running statistics (a slot the branches hand back) stay packed.
      shared = shared_lib.plan(_shared_candidates(logical, segments, axes, num_stages,
                                                  placement), num_stages)
    moved = {(m.chunk, m.layer, m.path) for g in shared for m in g.members}
    layouts, dims = [], []
    for c, chunk in enumerate(segments):
      pieces, chunk_dims = [], []
      for seg in chunk:
        if seg.stacked:
          continue
        names = axes.get(f"layers_{seg.layer}", {})
        copy_axis = int(seg.copies is not None)

        def piece(path, a, names=names, copy_axis=copy_axis, layer=seg.layer, c=c):
          if (c, layer, jax.tree_util.keystr(path)) in moved:
            return None  # In a shared leaf: left out of the packing.
          dim = places.cut_dim(a.shape[copy_axis:], names.get(jax.tree_util.keystr(path)),
                               shards, mesh, rules)
          dim = dim if dim == places.FLAT else dim + copy_axis
          chunk_dims.append(dim)
          return jax.ShapeDtypeStruct(places.piece_shape(a.shape, dim, shards), a.dtype)

        pieces.append(jax.tree_util.tree_map_with_path(piece, segment_shapes(logical, seg)))
      layouts.append(packing_lib.layout_of(pieces))
      dims.append(tuple(chunk_dims))
    offsets, windows, block = places.windows(layouts, num_stages, num_repeats, placement, packing)
    return cls(groups=tuple(groups), num_stages=num_stages, num_repeats=num_repeats,
               placement=placement, logical=logical, stacked=stacked, segments=segments,
               packed_layouts=tuple(layouts),
               packed_sizes={k: n * shards for k, n in block.items()}, axes=axes,
               packed_shards=shards, packed_dims=tuple(dims), packing=packing,
               packed_offsets=offsets, packed_windows=windows, shared=shared)

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
    ``{dtype: [blocks * n]}`` (:func:`tpipe.core.packed_places.window`): at ``offsets`` (per
    dtype, ints or traced; default the chunk's own), ``blocks`` blocks (default
    ``packed_shards``: whole buffers; 1 for a device's own fsdp block)."""
    blocks = self.packed_shards if blocks is None else blocks
    offsets = self.packed_offsets[chunk] if offsets is None else offsets
    return places.window(buffers, offsets, self.packed_windows[chunk], blocks)

  def chunk_local(self, staged, chunk: int) -> dict[str, Any]:
    """What model chunk ``chunk`` reads (:meth:`chunk_trees`) from a whole staged tree: its
    stacked slot and its packed window."""
    r, s = self.position(chunk)
    p, _ = self.packed_place(chunk)
    stacked = jax.tree.map(lambda a: a[r, s], staged[STACKED])
    packed = self.window({k: a[p, s] for k, a in staged[PACKED].items()}, chunk)
    shared = {k: a[:, s] for k, a in staged.get(SHARED, {}).items()}
    return {STACKED: stacked, PACKED: packed, SHARED: shared}

  # ------------------------------------------------------------------------------------------
  # Shapes.

  def local_shapes(self) -> dict[str, Any]:
    """The staged tree without its leading axes: one chunk slot's stacked leaves, one packed
    slot's buffers (``[n]``; with ``packing="slot"`` the whole tree is one chunk slot) and one
    entry of each shared leaf."""
    stacked = {f"layers_{i}": _slice_shapes(self.logical[f"layers_{i}"], 0, k)
               for i, k in self.stacked.items()}
    packed = {k: jax.ShapeDtypeStruct((n,), jnp.dtype(k)) for k, n in self.packed_sizes.items()}
    shared = {g.name: jax.ShapeDtypeStruct(g.shape, jnp.dtype(g.dtype)) for g in self.shared}
    return {STACKED: stacked, PACKED: packed, SHARED: shared}

  def chunk_shapes(self, chunk: int) -> dict[str, Any]:
    """What model chunk ``chunk`` reads (:meth:`chunk_local`), abstract."""
    local = self.local_shapes()
    packed = {k: jax.ShapeDtypeStruct((w * self.packed_shards,), jnp.dtype(k))
              for k, w in self.packed_windows[chunk].items()}
    shared = {g.name: jax.ShapeDtypeStruct((g.slots,) + g.shape, jnp.dtype(g.dtype))
              for g in self.shared}
    return {STACKED: local[STACKED], PACKED: packed, SHARED: shared}

  def staged_shapes(self) -> dict[str, Any]:
    """The staged tree's abstract shapes (stacked leaves ``[R, S, ...]``, packed ``[P, S, n]``,
    shared ``[P_g, S, ...]``)."""
    lead = lambda n: lambda a: jax.ShapeDtypeStruct((n, self.num_stages) + tuple(a.shape),
                                                    a.dtype)
    local = self.local_shapes()
    return {STACKED: jax.tree.map(lead(self.num_repeats), local[STACKED]),
            PACKED: jax.tree.map(lead(self.packed_slots), local[PACKED]),
            SHARED: {g.name: lead(g.slots)(local[SHARED][g.name]) for g in self.shared}}

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

    stacked = {layer: jax.tree_util.tree_map_with_path(stacked_spec(layer), tree)
               for layer, tree in local[STACKED].items()}
    # In blocks over fsdp when the layout was built for this mesh's fsdp axis; else whole.
    split = self.packed_shards > 1 and self.packed_shards == dict(mesh.shape).get(
        mesh_lib.FSDP_AXIS, 1)
    packed = {k: P(None, stage_axis, mesh_lib.FSDP_AXIS) if split else P(None, stage_axis)
              for k in local[PACKED]}
    shared = {g.name: P(None, stage_axis, *axis_rules.weight_spec(g.shape, g.names, mesh, rules,
                                                                  reserved=reserved))
              for g in self.shared}
    return {STACKED: stacked, PACKED: packed, SHARED: shared}

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
          "made for another split (stages, repeats or balance): convert them with that "
          "model's layout.to_logical(...) and this one's to_staged(...), or pass logical "
          "variables {'layers_0': ..., ...}.")

  # ------------------------------------------------------------------------------------------
  # One chunk.

  def chunk_trees(self, local, chunk: int, at: Mapping[str, int] | None = None,
                  blocks: int | None = None, shared_slots: Mapping | None = None,
                  canonical: bool = False) -> list:
    """Model chunk ``chunk``'s variables, one tree per segment, from what it reads ``local``
    (:meth:`chunk_local`: its stacked slot, packed window and shared leaves' entries; with
    ``at``, per dtype where the window starts in each block of the packed buffers ``local``
    holds instead).

    ``blocks``: how many fsdp blocks the packed buffers hold (default ``packed_shards``: the
    whole buffers, whose packed leaves come back whole). With one block of several (a device's
    own, inside the tick loops), each packed leaf comes back as that block's piece of it
    (:meth:`piece_dims` says where to gather it whole). ``shared_slots``: per ``(group name,
    layer, path)`` of the chunk's shared weights, the entry to read (default its own; traced where a
    program serves several chunks). ``canonical``: shared weights as their entries hold them
    (a matrix stored transposed stays so), else as the layer takes them."""
    packed = iter(self.unpack_chunk(local[PACKED], chunk, at, blocks))
    trees = [local[STACKED][f"layers_{seg.layer}"] if seg.stacked else next(packed)
             for seg in self.segments[chunk]]
    for k, group, member in self.shared_members(chunk):
      slot = (shared_slots or {}).get((group.name, member.layer, member.path), member.slot)
      value = local[SHARED][group.name][slot]
      if member.transposed and not canonical:
        value = value.T
      trees[k] = _with_leaf(trees[k], member.path, value)
    return trees

  def shared_members(self, chunk: int) -> list:
    """Model chunk ``chunk``'s weights in shared leaves: ``(segment index, group, member)``."""
    index = {seg.layer: k for k, seg in enumerate(self.segments[chunk])
             if not seg.stacked and seg.copies is None}
    return [(index[m.layer], g, m) for g in self.shared for m in g.members if m.chunk == chunk]

  def piece_specs(self, chunk: int, mesh, axes_used, rules=None) -> list:
    """Per packed segment of model chunk ``chunk``, a tree of one copy's partition specs over
    the mesh axes in ``axes_used`` alone (inside the tick loops: the axes left to the
    partitioner, ``tensor``), as the leaves' logical names say, or None for a leaf with none
    of them. A dimension the leaf was cut along into fsdp pieces stays whole: the piece
    gathers whole along it."""
    rules = axis_rules.resolve_rules(rules)
    reserved = tuple(a for a in mesh.axis_names if a not in axes_used)
    out = []
    for seg, shapes, dims in zip([g for g in self.segments[chunk] if not g.stacked],
                                 self.packed_shapes(chunk), self.piece_dims(chunk)):
      names = self.axes.get(f"layers_{seg.layer}", {})
      copy_axis = int(seg.copies is not None)

      def spec(path, leaf, dim, names=names, copy_axis=copy_axis):
        shape = leaf.shape[copy_axis:]
        entries = list(axis_rules.weight_spec(shape, names.get(jax.tree_util.keystr(path)),
                                              mesh, rules, reserved=reserved))
        if dim != places.FLAT and dim - copy_axis < len(entries):
          entries[dim - copy_axis] = None
        return P(*entries) if any(e is not None for e in entries) else None

      out.append(jax.tree_util.tree_map_with_path(spec, shapes, dims))
    return out

  def piece_dims(self, chunk: int) -> list:
    """Per packed segment of model chunk ``chunk`` (in order), a tree shaped like its variables
    holding where each leaf was cut into ``packed_shards`` pieces: a dimension of the segment's
    tree (a run's copy axis first), or :data:`tpipe.core.packed_places.FLAT`."""
    trees = self.packed_shapes(chunk)
    dims = iter(self.packed_dims[chunk])
    return [jax.tree.map(lambda _: next(dims), tree) for tree in trees]

  def chunk_slot(self, trees: Sequence[Any], chunk: int):
    """The inverse of :meth:`chunk_trees`: a slot holding ``trees`` (one per segment); a shared
    leaf's entries that hold none of this chunk's weights are zeros."""
    stacked = {f"layers_{seg.layer}": tree for seg, tree in zip(self.segments[chunk], trees)
               if seg.stacked}
    packed = [tree for seg, tree in zip(self.segments[chunk], trees) if not seg.stacked]
    shared = {g.name: jnp.zeros((g.slots,) + g.shape, jnp.dtype(g.dtype)) for g in self.shared}
    for k, g, m in self.shared_members(chunk):  # The chunk's entries; the others zeros.
      entries = shared[g.name]
      value = _leaf_at(trees[k], m.path)
      shared[g.name] = entries.at[m.slot].set((value.T if m.transposed else value).astype(
          entries.dtype))
    return {STACKED: stacked, PACKED: self.pack_chunk(packed, chunk), SHARED: shared}

  def packed_shapes(self, chunk: int) -> list:
    """Model chunk ``chunk``'s packed trees (one per packed segment), abstract, whole; a weight
    in a shared leaf is None there."""
    trees = [segment_shapes(self.logical, seg) for seg in self.segments[chunk]]
    return [tree for seg, tree in zip(self.segments[chunk], self._without_shared(trees, chunk))
            if not seg.stacked]

  def _without_shared(self, trees: Sequence[Any], chunk: int) -> list:
    """``trees`` (one per segment of ``chunk``) with the weights in shared leaves None."""
    trees = list(trees)
    for k, _, member in self.shared_members(chunk):
      trees[k] = _with_leaf(trees[k], member.path, None)
    return trees

  def pack_chunk(self, trees: Sequence[Any], chunk: int) -> dict[str, jax.Array]:
    """Model chunk ``chunk``'s packed window ``{dtype: [packed_shards * w]}`` holding ``trees``
    (its packed segments' trees, whole; weights in shared leaves are left out): block ``f``
    holds piece ``f`` of every leaf."""
    packed_segments = [k for k, seg in enumerate(self.segments[chunk]) if not seg.stacked]
    full = [None] * len(self.segments[chunk])
    for k, tree in zip(packed_segments, trees):
      full[k] = tree
    trees = [self._without_shared(full, chunk)[k] for k in packed_segments]
    leaves, treedef = jax.tree.flatten(list(trees))
    cut = [places.cut_pieces(a, d, self.packed_shards)
           for a, d in zip(leaves, self.packed_dims[chunk])]
    layout = dataclasses.replace(self.packed_layouts[chunk], batch_dims=1)
    window = self.packed_windows[chunk]
    if not cut and not window:
      return {}
    if not cut:
      return packing_lib.empty({k: w * self.packed_shards for k, w in window.items()})
    buffers = packing_lib.pack(jax.tree.unflatten(treedef, cut), layout, window)
    return {k: v.reshape(-1) for k, v in buffers.items()}

  def unpack_chunk(self, buffers: Mapping[str, jax.Array], chunk: int,
                   at: Mapping[str, int] | None = None, blocks: int | None = None) -> list:
    """The inverse of :meth:`pack_chunk`: the packed segments' trees from a whole window, or
    from buffers whose blocks hold the window at ``at`` (per dtype). From ``blocks=1`` block of
    several, each leaf's piece in it (see :meth:`chunk_trees`)."""
    blocks = self.packed_shards if blocks is None else blocks
    layout = dataclasses.replace(self.packed_layouts[chunk], batch_dims=1)
    if at is not None:
      layout = dataclasses.replace(layout, offsets=tuple(
          offset + at[key] for offset, key in zip(layout.offsets, layout.dtypes)))
    rows = {k: v.reshape(blocks, -1) for k, v in buffers.items()}
    pieces, treedef = jax.tree.flatten(packing_lib.unpack(rows, layout))
    if blocks != self.packed_shards:
      if blocks != 1:
        raise ValueError(f"packed buffers hold {self.packed_shards} blocks; read all or one, "
                         f"not {blocks}.")
      return jax.tree.unflatten(treedef, [p[0] for p in pieces])
    whole = jax.tree.leaves(self.packed_shapes(chunk))
    return jax.tree.unflatten(treedef, [
        places.join_pieces(p, d, a.shape)
        for p, d, a in zip(pieces, self.packed_dims[chunk], whole)])

  def chunk_bytes(self) -> list[int]:
    """Per model chunk, the bytes of variables it holds (without padding)."""
    out = []
    for chunk in self.segments:
      total = 0
      for seg in chunk:
        tree = segment_shapes(self.logical, seg)
        total += sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
                     for a in jax.tree.leaves(tree))
      out.append(total)
    return out

  def chunk_elements(self) -> list[Any]:
    """Per model chunk, a tree shaped like :meth:`local_shapes` holding how many of each leaf's
    elements are the chunk's own (the rest is other chunks' or padding)."""
    out = []
    for c, chunk in enumerate(self.segments):
      stacked = {f"layers_{seg.layer}": jax.tree.map(lambda a: int(np.prod(a.shape)),
                                                     segment_shapes(self.logical, seg))
                 for seg in chunk if seg.stacked}
      sizes = packing_lib.layout_of(self.packed_shapes(c)).sizes()
      packed = {k: sizes.get(k, 0) for k in self.packed_sizes}
      shared = {g.name: sum(int(np.prod(g.shape)) for m in g.members if m.chunk == c)
                for g in self.shared}
      out.append({STACKED: stacked, PACKED: packed, SHARED: shared})
    return out

  def stage_bytes(self) -> int:
    """Bytes of one stage's variables, padding included (what every stage occupies): R chunk
    slots of stacked leaves and P packed slots."""
    nbytes = lambda tree: sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
                              for a in jax.tree.leaves(tree))
    local = self.local_shapes()
    return (self.num_repeats * nbytes(local[STACKED]) + self.packed_slots * nbytes(local[PACKED])
            + sum(g.slots * g.entry_bytes for g in self.shared))

  def packed_mask(self, predicate):
    """Which elements of the packed buffers belong to leaves ``predicate(path)`` selects.

    Args:
      predicate: takes a leaf's key path inside its layer's tree (e.g. ending in
        ``DictKey("kernel")``) and returns whether to select it.

    Returns:
      Per dtype, ``mask(shape) -> bool array`` of the staged buffer's shape ``[P, S, n]``,
      computed from the elements' positions (a few comparisons per selected range; no stored
      mask).
    """
    ranges = {k: {} for k in self.packed_sizes}
    for c, layout in enumerate(self.packed_layouts):
      paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(
          jax.tree.unflatten(layout.treedef, list(range(len(layout.shapes)))))[0]]
      slot = self.packed_place(c)
      whole = [int(np.prod(a.shape)) for a in jax.tree.leaves(self.packed_shapes(c))]
      for f in range(self.packed_shards):  # Block f holds piece f of every leaf.
        leaves = zip(paths, layout.shapes, layout.dtypes, layout.offsets, self.packed_dims[c],
                     whole)
        for path, shape, key, offset, dim, size in leaves:
          if predicate(path):
            found = ranges[key].setdefault(slot, [])
            start = (f * self.packed_sizes[key] // self.packed_shards
                     + self.packed_offsets[c][key] + offset)
            piece = int(np.prod(shape))
            # A flat cut's last pieces end in padding, which is no leaf's.
            stop = start + (min(piece, max(0, size - f * piece)) if dim == places.FLAT else piece)
            if stop == start:
              continue
            if found and found[-1][1] == start:
              found[-1] = (found[-1][0], stop)
            else:
              found.append((start, stop))
    return {k: places.range_mask(found, self.packed_slots, self.num_stages)
            for k, found in ranges.items()}

  def shared_mask(self, predicate) -> dict[str, np.ndarray]:
    """Per shared leaf, a bool ``[P, S, 1, ...]`` table (broadcasting over an entry): whether the
    weight in each entry is one ``predicate(path)`` selects (see :meth:`packed_mask`)."""
    out = {}
    for g in self.shared:
      table = np.zeros((g.slots, self.num_stages) + (1,) * len(g.shape), bool)
      for m in g.members:
        tree = self.logical[f"layers_{m.layer}"]
        path = next(p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
                    if jax.tree_util.keystr(p) == m.path)
        table[m.slot, self.position(m.chunk)[1]] = predicate(path)
      out[g.name] = table
    return out

  # ------------------------------------------------------------------------------------------
  # The whole tree.

  def _uniform(self, layer: int) -> bool:
    """Whether repeated ``layer`` is cut evenly in loop placement (staged = a reshape)."""
    k = self.stacked[layer]
    n = jax.tree.leaves(self.logical[f"layers_{layer}"])[0].shape[0]
    return (self.placement == "loop" and n == k * self.num_chunks and
            all(seg.first_copy == c * k for c, chunk in enumerate(self.segments)
                for seg in chunk if seg.stacked and seg.layer == layer))

  def to_staged(self, logical: Mapping[str, Any]):
    """Logical ``{"layers_i": tree}`` to the staged tree; exact."""
    order = [self.chunk_at(r, s) for r in range(self.num_repeats)
             for s in range(self.num_stages)]
    lead = (self.num_repeats, self.num_stages)
    stacked = {}
    for layer, k in self.stacked.items():
      name = f"layers_{layer}"
      if self._uniform(layer):
        stacked[name] = jax.tree.map(lambda a: a.reshape(lead + (k,) + a.shape[1:]),
                                     logical[name])
        continue
      # One gather: a stack of slices keeps a padded copy of the whole per slice (XLA CPU).
      rows = np.concatenate([np.arange(seg.first_copy, seg.first_copy + k) for c in order
                             for seg in self.segments[c] if seg.stacked and seg.layer == layer])
      stacked[name] = jax.tree.map(lambda a: jnp.take(a, rows, axis=0, unique_indices=True).reshape(
          lead + (k,) + a.shape[1:]), logical[name])
    places_ = [(p, s) for p in range(self.packed_slots) for s in range(self.num_stages)]
    packed = {k: v.reshape(self.packed_slots, self.num_stages, -1)
              for k, v in self._packed_buffers(logical, places_).items()}
    return {STACKED: stacked, PACKED: packed, SHARED: self._shared_arrays(logical)}

  def _shared_arrays(self, logical) -> dict[str, jax.Array]:
    """Each shared leaf ``[P, S, ...]`` from the logical weights it holds (zeros elsewhere)."""
    out = {}
    for g in self.shared:
      entries = [[None] * self.num_stages for _ in range(g.slots)]
      for m in g.members:
        value = _leaf_at(logical[f"layers_{m.layer}"], m.path)
        entries[m.slot][self.position(m.chunk)[1]] = value.T if m.transposed else value
      zeros = jnp.zeros(g.shape, jnp.dtype(g.dtype))
      out[g.name] = jnp.stack([jnp.stack([zeros if e is None else e.astype(zeros.dtype)
                                          for e in row]) for row in entries])
    return out

  def _packed_buffers(self, logical, slots) -> dict[str, jax.Array]:
    """Per dtype, the packed buffers of ``slots`` (``(packed slot, stage)``) flat, one after the
    other: each slot's chunks' windows (in local order) block by block, each block padded with
    zeros. One concatenation: XLA padded stacked per-slot buffers to the whole, S copies live."""
    shards = self.packed_shards
    chunks = {(p, s): [c for c in (self.chunk_at(r, s) for r in range(self.num_repeats))
                       if self.packed_place(c)[0] == p] for p, s in slots}
    windows = {c: self._pack_chunk(logical, c) for c in sorted(set(sum(chunks.values(), [])))}
    out = {}
    for k, n in self.packed_sizes.items():
      pieces = []
      for place in slots:
        rows = [windows[c][k].reshape(shards, -1) for c in chunks[place] if k in windows[c]]
        pad = [jnp.zeros((n // shards - sum(row.shape[1] for row in rows),), jnp.dtype(k))]
        pieces += [piece for b in range(shards) for piece in [row[b] for row in rows] + pad]
      out[k] = jnp.concatenate(pieces)
    return out

  def _pack_chunk(self, logical, chunk: int) -> dict[str, jax.Array]:
    """Chunk ``chunk``'s packed buffers ``{dtype: [n]}`` from logical trees."""
    trees = [_segment_values(logical, self.logical, seg) for seg in self.segments[chunk]
             if not seg.stacked]
    return self.pack_chunk(trees, chunk)

  def to_logical(self, staged) -> dict[str, Any]:
    """The staged tree back to logical ``{"layers_i": tree}``; exact."""
    self.check_staged(staged)
    pieces: dict[int, list] = {}
    for c in range(self.num_chunks):
      for seg, tree in zip(self.segments[c], self.chunk_trees(self.chunk_local(staged, c), c)):
        pieces.setdefault(seg.layer, []).append((seg.first_copy, seg.copies, tree))
    logical = {}
    for layer, tree in self.logical.items():
      index = int(layer.split("_")[1])
      if index in self.stacked and self._uniform(index):
        leaves = staged[STACKED][layer]
        logical[layer] = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[3:]), leaves)
      elif index not in pieces or not jax.tree.leaves(tree):
        logical[layer] = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)
      elif pieces[index][0][1] is None:
        logical[layer] = pieces[index][0][2]
      else:
        parts = [p[2] for p in sorted(pieces[index], key=lambda p: p[0])]
        logical[layer] = jax.tree.map(lambda *a: jnp.concatenate(a, 0), *parts)
    return logical


def segment_shapes(logical, seg: Segment):
  tree = logical[f"layers_{seg.layer}"]
  if seg.copies is None:
    return tree
  return _slice_shapes(tree, seg.first_copy, seg.first_copy + seg.copies)


def _segment_values(values, logical, seg: Segment):
  """A segment's slice of logical ``values`` (a layer without variables may be absent: Flax
  omits empty collections)."""
  name = f"layers_{seg.layer}"
  if name not in values:
    if jax.tree.leaves(logical[name]):
      raise ValueError(f"the variables hold no {name!r}, which has "
                       f"{jax.tree.map(lambda a: tuple(a.shape), logical[name])}.")
    return logical[name]
  tree = values[name]
  if seg.copies is None:
    return tree
  return _slice(tree, seg.first_copy, seg.first_copy + seg.copies)


def _with_leaf(tree, path: str, value):
  """``tree`` with the leaf (or None hole) at key path ``path`` (a keystr) replaced."""
  return jax.tree_util.tree_map_with_path(
      lambda p, leaf: value if jax.tree_util.keystr(p) == path else leaf, tree,
      is_leaf=lambda x: x is None)


def _shared_candidates(logical, segments, axes, num_stages: int, placement: str) -> list:
  """The plain layers' weights (:class:`tpipe.core.shared_leaves.Candidate`), chunk by chunk."""
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


def _leaf_at(tree, path: str):
  """The leaf of ``tree`` at key path ``path`` (a keystr)."""
  for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if jax.tree_util.keystr(p) == path:
      return leaf
  raise KeyError(f"no leaf at {path} in {jax.tree.map(jnp.shape, tree)}.")
