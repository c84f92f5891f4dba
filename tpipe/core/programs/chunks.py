"""The programs the tick loops run: a chunk of layer units applied to one micro-batch.

Every tick a device runs one of its model chunks as a branch of a ``lax.switch``
(:mod:`tpipe.core.loops.gated`). Chunks whose programs are the same up to traced values (which
chunk,
hence which of the device's parameter slots and which unit numbers for the RNG) share one branch:
a chunk's **signature** (:mod:`tpipe.core.programs.signatures`) is its segments' layers and copy
counts, its packed layouts, where its input comes from and where its output goes. An even stack of
identical blocks (``tpipe.pipeline``) is one branch whatever S and R; an LM with an embedding and
a head is three.

Three formats meet at chunk boundaries: the pipeline's input (read by the first chunk), the
**ring** that crosses the boundaries between chunks (one micro-batch; the activation itself when
every boundary has one type, else packed per dtype and padded to the largest,
:mod:`tpipe.core.programs.ring`), and the last chunk's **output**. When the input, ring and output
types
agree the first and last chunks need no branch of their own: a chunk selects the fresh input on
model chunk 0 and hands its result both on and out.

A branch applies its segments (:class:`tpipe.core.layout.description.Segment`) with
:func:`tpipe.core.planning.remat.apply_units`, runs of copies scanned, each unit with its keys from
:func:`tpipe.core.base.layers.unit_rngs`. In the split form (:meth:`ChunkSet.tapped_branch`) each
unit
runs through :mod:`tpipe.core.programs.taps`, and :meth:`ChunkSet.weight_branch` forms the weight
gradients the taps deferred. :meth:`ChunkSet.unit_steps` are a branch's units one at a time, for
the backward by units (:mod:`tpipe.core.programs.unit_backward`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from tpipe import spec as spec_lib
from tpipe.core.base import float_leaves as floats_lib
from tpipe.core.base import layers as layers_lib
from tpipe.core.base import spmd
from tpipe.core.layout import description as desc
from tpipe.core.layout import device_view as view_lib
from tpipe.core.layout import pack as layout_pack
from tpipe.core.layout import packed_places as places
from tpipe.core.planning import plan as plan_lib
from tpipe.core.planning import remat as remat_lib
from tpipe.core.programs import fsdp as fsdp_lib
from tpipe.core.programs import ring as ring_lib
from tpipe.core.programs import signatures as signatures_lib
from tpipe.core.programs import taps as taps_lib
from tpipe.core.programs import weight_casts


def _is_spec(value) -> bool:
  return isinstance(value, P)


class ChunkSet:
  """The chunk programs of one planned, laid-out sequence.

  Args:
    layers: the :class:`~tpipe.core.base.layers.Layer` sequence.
    plan: its :class:`~tpipe.core.planning.plan.Plan`.
    layout: the parameters' :class:`~tpipe.core.layout.description.StageLayout`.
    stats_layout: the running statistics' layout (built with ``layout``'s stacked copies), or
      None when no layer has statistics.
    spec: the pipeline's settings (remat, granularity, unroll).
    split: the call's keyword arguments (:class:`tpipe.core.base.arguments.SplitArguments`).
    axes: the mesh's axes, or None (no FSDP): with an ``fsdp`` axis the parameters are split
      over it as :meth:`~tpipe.core.layout.description.StageLayout.partition_specs` says, and
      every unit gathers its own (:mod:`tpipe.core.programs.fsdp`).
  """

  def __init__(self, layers, plan: plan_lib.Plan, layout: desc.StageLayout,
               stats_layout: desc.StageLayout | None, spec: spec_lib.PipelineSpec, split,
               axes: spmd.Axes | None = None):
    self.layers, self.plan, self.layout, self.stats_layout = layers, plan, layout, stats_layout
    self.spec, self.split = spec, split
    # Where the staged parameters are split: over stages, and over fsdp where the mesh has it.
    staged_spec = P(None, spec.stage_axis)
    self.param_specs = jax.tree.map(lambda _: staged_spec, layout.local_shapes())
    self.fsdp = None
    if axes is not None and axes.fsdp:
      specs = layout.partition_specs(spec.stage_axis, mesh=axes.mesh)
      self.param_specs = jax.tree.map(axes.manual_spec, specs, is_leaf=_is_spec)
      self.fsdp = fsdp_lib.Split.of(self.param_specs, axes.fsdp)
    # Per unit call (branch, segment and the types of its arguments): the variables cast
    # before their gather (:meth:`_unit_variables`).
    self._casts: dict[tuple, dict] = {}
    self.ring = ring_lib.Ring.of(plan)
    self.output_example = ring_lib.without_rows(plan.layer_inputs[-1])
    self.signatures, self.branch_of_chunk = signatures_lib.signatures(plan, layout, stats_layout,
                                                                      self.ring)
    self.chunks_of = [[c for c, b in enumerate(self.branch_of_chunk) if b == index]
                      for index in range(len(self.signatures))]
    # Per model chunk: its local chunk index, and each segment's first unit.
    num_chunks = plan.num_chunks
    self.local_index = np.array([layout.position(c)[0] for c in range(num_chunks)], np.int32)
    # Per model chunk: its packed slot, and per dtype its window's start in a block.
    self.packed_slot = np.array([layout.packed_place(c)[0] for c in range(num_chunks)],
                                np.int32)
    self.packed_offsets = {k: np.array([layout.packed_offsets[c].get(k, 0)
                                        for c in range(num_chunks)], np.int32)
                           for k in layout.packed_sizes}
    self.first_units = [np.array([seg.first_unit for seg in layout.segments[c]], np.int32)
                        for c in range(num_chunks)]
    # How many fsdp blocks of each packed buffer a device holds inside the tick loops: one
    # where the buffers are split over fsdp (its packed leaves are then its pieces of them,
    # gathered whole one unit at a time where the unit runs), else all of them.
    self.gathers_pieces = self.fsdp is not None and any(self.fsdp.packed.values())
    self.held_blocks = 1 if self.gathers_pieces else layout.packed_shards
    # The mesh and the axes the partitioner splits inside the tick loops (tensor): packed
    # leaves are constrained to their logical names' split over them where they run.
    self._mesh = axes.mesh if axes is not None else None
    self._auto_axes = axes.auto if axes is not None else ()
    # Per branch, per shared weight (group, layer, path): the entry each chunk reads.
    self.shared_slots = []
    for chunks in self.chunks_of:
      tables = {}
      for c in chunks:
        for _, g, m in layout.shared_members(c):
          tables.setdefault((g.name, m.layer, m.path), np.zeros(num_chunks, np.int32))[c] = (
              m.slot)
      self.shared_slots.append(tables)
    # Shared leaves (per entry) and stacked leaves (per copy) split over the partitioner's axes
    # (expert, tensor) as their names say: their fsdp gathers run on each device's part.
    self._shared_specs = {g.name: None for g in layout.shared}
    self._stacked_specs = None
    if axes is not None and axes.auto:
      shared, self._stacked_specs = fsdp_lib.specs_over_axes(
          layout.partition_specs(spec.stage_axis, mesh=axes.mesh), axes.auto)
      self._shared_specs.update(shared)

  @property
  def num_branches(self) -> int:
    return len(self.signatures)

  # ------------------------------------------------------------------------------------------
  # Traced lookups: a Python value when the branch serves one chunk (or R is 1).

  def _per_chunk(self, branch: int, chunk, table: np.ndarray):
    """``table[chunk]``: a Python int when every chunk of the branch has the same value."""
    values = table[self.chunks_of[branch]]
    if np.all(values == values[0]):
      return int(values[0])
    return jnp.asarray(table)[chunk]

  def _local(self, branch: int, chunk):
    return self._per_chunk(branch, chunk, self.local_index)

  def _first_unit(self, branch: int, chunk, segment: int):
    chunks = self.chunks_of[branch]
    table = np.zeros(self.plan.num_chunks, np.int32)  # Segment indices are the branch's own.
    table[chunks] = [self.first_units[c][segment] for c in chunks]
    return self._per_chunk(branch, chunk, table)

  def staged_specs(self, staged) -> dict:
    """``shard_map`` in-specs of ``staged`` (``{"params": ..., "stats": ...}``): parameters as
    :attr:`param_specs`, statistics over stages only."""
    specs = {view_lib.PARAMS: self.param_specs}
    if view_lib.STATS in staged:
      specs[view_lib.STATS] = P(None, self.spec.stage_axis)
    return specs

  def float_specs(self, staged) -> list:
    """The in-spec of each float leaf of ``staged`` (in
    :func:`~tpipe.core.base.float_leaves.float_leaves` order)."""
    specs = self.staged_specs(staged)
    out = []
    for key in sorted(staged):
      leaves = jax.tree.leaves(staged[key])
      key_specs = specs[key]
      if isinstance(key_specs, P):
        key_specs = [key_specs] * len(leaves)
      else:
        key_specs = jax.tree.leaves(key_specs, is_leaf=_is_spec)
      out += [spec for leaf, spec in zip(leaves, key_specs) if floats_lib.is_float(leaf)]
    return out

  def split_over_fsdp(self, staged) -> list[bool]:
    """Per float leaf of ``staged`` (:func:`~tpipe.core.base.float_leaves.float_leaves` order),
    whether it is split over the fsdp axis (its gradient is then reduced over fsdp by the gathers'
    transposes)."""
    flags = []
    for key in sorted(staged):
      flat = jax.tree_util.tree_flatten_with_path(staged[key])[0]
      for path, leaf in flat:
        if floats_lib.is_float(leaf):
          flags.append(key == view_lib.PARAMS and self.fsdp is not None
                       and self.fsdp.is_split(path))
    return flags

  def _slot(self, staged, r):
    if isinstance(r, int):
      return jax.tree.map(lambda a: a[r], staged)
    return spmd.read_slot(staged, r)

  def _packed_offsets(self, branch: int, chunk) -> dict:
    """Per dtype, where model ``chunk``'s packed window starts in each block: ints when that
    is the same for every chunk of the branch, else traced."""
    return {k: self._per_chunk(branch, chunk, table) for k, table in self.packed_offsets.items()}

  def _packed_at(self, branch: int, chunk):
    """:meth:`_packed_offsets` when they are all static, else None."""
    offsets = self._packed_offsets(branch, chunk)
    return offsets if all(isinstance(o, int) for o in offsets.values()) else None

  def _chunk_trees(self, local, branch: int, chunk) -> list:
    """Model ``chunk``'s variables per segment from :meth:`_param_slot`'s ``local``: packed
    leaves as this device's pieces where it holds one fsdp block, a run's leaves cut as
    flattened elements already gathered whole (:meth:`_gather_packed`)."""
    rep = self.chunks_of[branch][0]
    slots = {key: self._per_chunk(branch, chunk, table)
             for key, table in self.shared_slots[branch].items()}
    # Pinned again where the leaves are cut: what came through an optimization barrier or a
    # checkpoint name is a new value the partitioner may split afresh.
    local = {**local, desc.PACKED: spmd.whole_over_auto_axes(local[desc.PACKED])}
    trees = layout_pack.chunk_trees(self.layout, local, rep, self._packed_at(branch, chunk),
                                    self.held_blocks, shared_slots=slots, canonical=True)
    if self.gathers_pieces:
      for k, seg in self._packed_segments(branch):
        if seg.copies is not None:
          trees[k] = self._gather_packed(branch, k, trees[k], flat_only=True)
    return trees

  def _param_slot(self, params, branch: int, chunk):
    """What model ``chunk`` (one of branch ``branch``'s) reads of the per-device parameters
    (:func:`~tpipe.core.layout.device_view.device_view`: packed buffers ``[P, 1, n]``): its stacked
    slot, and the packed buffers as the device holds them (:attr:`held_blocks`; never gathered
    whole here), whole where the chunk's window starts at a static offset (:meth:`_packed_at`;
    its leaves are sliced from them as from one buffer per chunk), else its window cut at the
    traced offset."""
    stacked = self._slot(params[desc.STACKED], self._local(branch, chunk))
    p = self._per_chunk(branch, chunk, self.packed_slot)
    buffers = spmd.whole_over_auto_axes(
        {k: self._slot(a, p)[0] for k, a in params[desc.PACKED].items()})
    if self._packed_at(branch, chunk) is None:
      buffers = self.layout.window(buffers, self.chunks_of[branch][0],
                                   self._packed_offsets(branch, chunk), self.held_blocks)
    return {desc.STACKED: stacked, desc.PACKED: buffers,
            desc.SHARED: dict(params.get(desc.SHARED, {}))}

  def _packed_segments(self, branch: int) -> list:
    """``(segment index, segment)`` of branch ``branch``'s packed segments, in order."""
    rep = self.chunks_of[branch][0]
    return [(k, seg) for k, seg in enumerate(self.layout.segments[rep]) if not seg.stacked]

  def _gather_packed(self, branch: int, segment: int, tree, one_copy: bool = False,
                     flat_only: bool = False, casts=None, tie=None):
    """Packed segment ``segment``'s variables (``tree``: this device's pieces where it holds one
    fsdp block) whole, each leaf split over the partitioner's axes (tensor) as its logical names
    say, the split taken before the gather so the gathered leaf is split too.

    ``one_copy``: ``tree`` is one copy of a run (inside the scan over its copies), whose leaves
    cut as flattened elements were gathered before the scan; ``flat_only``: gather only those,
    the copy axis kept (what :meth:`_chunk_trees` does for a run); ``casts``: ``{keystr(path):
    dtype}`` of leaves gathered cast, each through ``tie`` first (:meth:`_unit_variables`)."""
    rep = self.chunks_of[branch][0]
    j = [k for k, _ in self._packed_segments(branch)].index(segment)
    run = self.layout.segments[rep][segment].copies is not None
    one_copy = one_copy and run
    lead = int(run and not one_copy)  # A copy axis in front of every leaf of ``tree``.
    pieces, casts = self.gathers_pieces, casts or {}
    auto = self._mesh is not None and bool(self._auto_axes) and bool(spmd.auto_axes_here())

    def leaf(piece, dim, whole, spec, dtype):
      if dim == places.FLAT:
        if pieces and not one_copy:
          piece = self.fsdp.gather_piece(piece, dim, whole.shape)
        if flat_only:
          return piece
      elif flat_only:
        return piece
      if auto:
        # Sliced from the buffer whole on every device (then split as the leaf's names say): a
        # local slice. Unpinned, the partitioner may split the slice (as the leaf's use
        # suggests, names or none) and fetch the neighbours' parts of its operand with
        # collective-permutes inside the branch (see spmd.whole_over_auto_axes).
        piece = lax.with_sharding_constraint(piece, P())
        if spec is not None:
          piece = lax.with_sharding_constraint(piece, P(*([None] * lead), *spec))
      if pieces and dim != places.FLAT:
        piece = self.fsdp.gather_piece(piece, dim - int(one_copy), whole.shape,
                                       None if spec is None else P(*([None] * lead), *spec),
                                       dtype, tie)
      return piece

    shared = {m.path: g for k, g, m in self.layout.shared_members(rep) if k == segment}
    transposed = {m.path: m.transposed for k, _, m in self.layout.shared_members(rep)
                  if k == segment}

    def any_leaf(path, value, dim, whole, spec):
      key = jax.tree_util.keystr(path)
      if key not in shared:
        return leaf(value, dim, whole, spec, casts.get(key))
      if flat_only:
        return value
      name = shared[key].name
      fsdp_dim = self.fsdp.shared[name] if self.fsdp is not None else fsdp_lib.NOT_SPLIT
      if fsdp_dim != fsdp_lib.NOT_SPLIT:
        value = self.fsdp.gather_piece(value, fsdp_dim, None, self._shared_specs[name],
                                       casts.get(key), tie)
      return value.T if transposed[key] else value

    return jax.tree_util.tree_map_with_path(
        any_leaf, tree, self.layout.piece_dims(rep)[j], self.layout.packed_shapes(rep)[j],
        self._piece_specs(rep)[j])

  def _unit_variables(self, branch: int, segment: int, params, layer, args, steps):
    """Segment ``segment``'s unit variables whole from ``params`` (this device's pieces where it
    holds one fsdp block), those the unit only casts cast before their gather, tied to the
    loops' ``steps`` so XLA keeps each cast where the gather needs it
    (:func:`tpipe.core.programs.weight_casts.tie_to_steps`): which those are is read from the
    program of
    ``layer.apply(variables, *args)`` (:func:`tpipe.core.programs.fsdp.casts_before_gather`), once
    per
    segment and types of ``args``. Without fsdp (nothing gathered), a stacked unit's weights it
    only casts are cast here the same way (where they are not cast already): XLA would otherwise
    hoist their casts out of the tick loop, a bfloat16 copy of the stage's weights live all step
    (Mixtral-8x7B on stage 4 x expert 8 x tensor 2, GPipe: 1.81 GiB per device of weight casts,
    0.56 tied)."""
    seg = self.layout.segments[self.chunks_of[branch][0]][segment]

    def gather(casts, tie=None):
      if self.fsdp is not None and seg.stacked:
        return self.fsdp.gather_unit(f"layers_{seg.layer}", params, casts=casts, tie=tie,
                                     specs=self._stacked_specs)
      if not seg.stacked:
        return self._gather_packed(branch, segment, params, one_copy=seg.copies is not None,
                                   casts=casts, tie=tie)
      return params

    if self.fsdp is None and not seg.stacked:
      return gather({})
    key = (branch, segment, _trace_key(params, args))
    if key not in self._casts:
      # The analysis reads the layer's program on the gathered variables' types (inside
      # shard_map, the mesh axes they vary over too), so it traces a plain gather first; where
      # some are then gathered cast, that first gather is dead code, removed by the compiler.
      whole = gather({})
      self._casts[key] = fsdp_lib.casts_before_gather(whole, lambda v: layer.apply(v, *args))
      if not self._casts[key]:
        return whole
    tie = lambda a: weight_casts.tie_to_steps(a, steps)
    if self.fsdp is None:  # Nothing to gather: the stacked weights cast where the unit runs.
      return weight_casts.cast_by_path(params, self._casts[key], tie)
    return gather(self._casts[key], tie)

  def _piece_specs(self, rep: int) -> list:
    """:meth:`tpipe.core.layout.description.StageLayout.piece_specs` of model chunk ``rep`` over
    the partitioner's axes here (None per leaf without a mesh or such axes)."""
    if self._mesh is None or not self._auto_axes:
      return [jax.tree.map(lambda _: None, tree) for tree in self.layout.packed_shapes(rep)]
    return self.layout.piece_specs(rep, self._mesh, self._auto_axes)

  # ------------------------------------------------------------------------------------------
  # The branch programs.

  def input_of(self, branch: int, chunk, fresh, incoming):
    """Branch ``branch``'s input on model ``chunk``: the fresh data, or the ring's message."""
    sig, rep = self.signatures[branch], self.chunks_of[branch][0]
    if sig.input_kind == "fresh":
      return fresh
    if sig.input_kind == "select":  # The ring is unpacked and has the input's type.
      return spmd.select(chunk == 0, fresh, incoming)
    return self.ring.unpack(incoming, rep - 1)

  def results_of(self, branch: int, h, rows: int):
    """``(to_next, output)`` for the chunk's result ``h``."""
    sig = self.signatures[branch]
    if sig.output_kind == "both":
      return h, h
    if sig.output_kind == "output":
      return ring_lib.zeros_with_rows(self.ring.example, rows), h
    boundary = self.chunks_of[branch][0]
    return self.ring.pack(h, boundary), ring_lib.zeros_with_rows(self.output_example, rows)

  def _runs(self, branch: int, chunk, trees, stats, side, rngs, microbatch, taps=None,
            tapped: bool = False, programs: dict | None = None):
    """``apply_units`` runs for the branch's segments (tapped: see :meth:`_unit`)."""
    rep = self.chunks_of[branch][0]
    runs = []
    for k, seg in enumerate(self.layout.segments[rep]):
      layer = self.layers[seg.layer]
      first = self._first_unit(branch, chunk, k)
      apply = self._unit(branch, k, layer, side, rngs, microbatch, tapped, programs)
      seg_taps = None if taps is None else taps[k]
      if seg.copies is None:
        runs.append((apply, (trees[k], stats[k], first, seg_taps), None))
      else:
        units = first + jnp.arange(seg.copies)
        runs.append((apply, (trees[k], stats[k], units, seg_taps), seg.copies))
    return runs

  def _unit(self, branch, segment, layer, side, rngs, microbatch, tapped,
            programs=None):
    """``fn(h, (params, stats, unit, taps)) -> (h, (statistics, records))`` for one unit.

    Tapped, it runs the unit's traced program (:func:`tpipe.core.programs.taps.trace`), and files
    it in
    ``programs`` under ``segment`` where a dict is given (:meth:`unit_programs`)."""

    def apply(params, stats, h, unit, taps):
      kwargs = layers_lib.layer_keywords(layer, self.split, *side)
      unit_rngs = layers_lib.unit_rngs(rngs, unit, microbatch) if rngs else {}
      params = self._unit_variables(branch, segment, params, layer,
                                    (stats, h, kwargs, unit_rngs), (unit, microbatch))
      if not tapped:
        return layer.apply(params, stats, h, kwargs, unit_rngs), ()
      run = lambda p, s, h, kw, r: layer.apply(p, s, h, kw, r)
      program = taps_lib.trace(run, params, stats, h, kwargs, unit_rngs)
      if programs is not None:
        programs.setdefault(segment, program)
      param_leaves, others, _ = taps_lib.split_leaves(params, (stats, h, kwargs, unit_rngs))
      out, records, outputs = program.forward(param_leaves, others, taps)
      return out, (records, outputs)

    def step(h, xs):
      params, stats, unit, taps = xs
      if self.spec.unroll is True:
        # Unrolled, no loop orders the units: the unit's weights (their gathers and casts)
        # wait for its input, so they are not all prepared, and held, at once.
        params, h = lax.optimization_barrier((params, h))
      (h, statistics), records = apply(params, stats, h, unit, taps)
      return h, (statistics, records)

    return step

  def _apply(self, branch: int, staged, fresh, incoming, broadcast, per_example, rngs,
             microbatch, chunk, taps=None, tapped=False, tie_to_tick=False,
             programs=None):
    """``(results, statistics, records)`` of model ``chunk`` (one of branch ``branch``'s) on one
    micro-batch: :meth:`results_of` its output, per segment its running statistics and its
    units' tap records (empty untapped). The chunk program's operands come first, then how it
    runs: ``taps``, ``tapped`` and ``programs`` as in :meth:`_unit`, ``tie_to_tick`` as in
    :meth:`branch`."""
    rep = self.chunks_of[branch][0]
    r = self._local(branch, chunk)
    local = self._param_slot(staged[view_lib.PARAMS], branch, chunk)
    if tie_to_tick:  # See :meth:`branch`.
      local, _ = lax.optimization_barrier((local, jnp.asarray(microbatch, jnp.float32)))
    local = checkpoint_name(local, remat_lib.CHUNK_PARAMS_NAME)
    trees = self._chunk_trees(local, branch, chunk)
    if self.stats_layout is not None:
      stats = layout_pack.chunk_trees(self.stats_layout, self._slot(staged[view_lib.STATS], r), rep)
    else:
      stats = [{} for _ in trees]
    h = self.input_of(branch, chunk, fresh, incoming)
    runs = self._runs(branch, chunk, trees, stats, (broadcast, per_example), rngs, microbatch,
                      taps, tapped, programs)
    h, outs = remat_lib.apply_units(h, runs, self.spec.remat, self.spec.remat_granularity,
                                    self.spec.unroll)
    rows = jax.tree.leaves(fresh)[0].shape[0]
    results = self.results_of(branch, h, rows)
    statistics = [out[0] for out in outs]
    records = [out[1] for out in outs]
    return results, statistics, records

  def branch(self, index: int, policy=None, tie_to_tick: bool = False):
    """Branch ``index`` as the forward tick loop runs it: ``fn(staged, fresh, incoming,
    broadcast, per_example, rngs, microbatch, chunk) -> (to_next, output[, sums])``, under
    ``jax.checkpoint`` with ``policy`` (``remat.FULL`` for ``None``: save nothing; ``None`` for
    no checkpoint). ``sums`` (with running statistics only) is the chunk's slot of pooled
    statistics. ``tie_to_tick`` puts an optimization barrier between the parameter slice and the
    micro-batch index, so the slice is taken inside each tick. The forward tick loop asks for it;
    the fused one does not, as there it raises the step's peak on the TPU target
    (experiments/tpu_memory.py, with and without it). The TPU compiler hoists the layers' weight
    casts out of the tick either way (FSDP's casts stay inside through
    :func:`tpipe.core.programs.weight_casts.tie_to_steps`). On XLA:CPU the barrier makes autodiff
    through the forward ticks keep more (13.2 against 8.7 MB in the reference of
    tests/core/planning/test_remat.py's backward-by-units test, whose 2x margin is measured against
    the
    tied reference)."""

    def run(staged, fresh, incoming, broadcast, per_example, rngs, microbatch, chunk):
      results, statistics, _ = self._apply(index, staged, fresh, incoming, broadcast,
                                           per_example, rngs, microbatch, chunk,
                                           tie_to_tick=tie_to_tick)
      if self.stats_layout is None:
        return results
      sums = layout_pack.chunk_slot(self.stats_layout, lax.stop_gradient(statistics),
                                    self.chunks_of[index][0])
      return results + (sums,)

    return remat_lib.checkpointed(run, policy)

  def tapped_branch(self, index: int, policy=None):
    """Branch ``index`` in the split backward's form: ``fn(staged, fresh, incoming, broadcast,
    per_example, rngs, microbatch, chunk, taps) -> ((to_next, output), (records, outputs))``:
    with ``taps`` (per segment, per tapped operation; stacked over a run's copies; None to only
    record) added to the tapped operations' outputs, whose weights get no gradient here."""

    def run(staged, fresh, incoming, broadcast, per_example, rngs, microbatch, chunk, taps):
      results, _, records = self._apply(index, staged, fresh, incoming, broadcast, per_example,
                                        rngs, microbatch, chunk, taps, tapped=True)
      return results, ([r[0] for r in records], [r[1] for r in records])

    return remat_lib.checkpointed(run, policy)

  def unit_programs(self, index: int, staged, inputs: tuple, chunk) -> dict:
    """Branch ``index``'s units as traced programs (:class:`tpipe.core.programs.taps.Program`), what
    :meth:`weight_branch` forms weight gradients with: ``{segment: program}``, traced (abstractly)
    on ``staged`` and the chunk program's ``inputs`` ``(fresh, incoming, broadcast, per_example,
    rngs, microbatch)``."""
    programs: dict = {}
    jax.eval_shape(lambda: self._apply(index, staged, *inputs, chunk, None, tapped=True,
                                       programs=programs))
    return programs

  def weight_branch(self, index: int, programs: dict):
    """``W`` of branch ``index``: ``fn(staged, chunk, records, output_grads) -> grads`` shaped
    like ``staged["params"]``: the tapped operations' weight gradients, from the units' traced
    ``programs`` (:meth:`unit_programs`)."""
    rep = self.chunks_of[index][0]

    def run(staged, chunk, records, output_grads):

      def outputs(params):
        trees = self._chunk_trees(self._param_slot(params, index, chunk), index, chunk)
        outs = []
        for k, seg in enumerate(self.layout.segments[rep]):
          program = programs.get(k)
          if program is None or not program.taps:
            outs.append([])
            continue
          leaves = lambda tree: jax.tree.leaves(tree)
          apply = lambda tree, recs, program=program: program.weight_outputs(leaves(tree), recs)
          tree = trees[k]
          casts = weight_casts.casts_read_by(program, tree)
          if not seg.stacked:
            tree = self._gather_packed(index, k, tree, casts=casts)
          if seg.copies is not None:
            apply = jax.vmap(apply)
            if self.fsdp is not None and seg.stacked:
              tree = self.fsdp.gather_unit(f"layers_{seg.layer}", tree, copy_axis=True,
                                           casts=casts, specs=self._stacked_specs)
          if self.fsdp is None and seg.stacked:
            tree = weight_casts.cast_by_path(tree, casts)  # As the forward read them.
          outs.append(apply(tree, records[k]))
        return outs

      _, vjp = jax.vjp(outputs, staged[view_lib.PARAMS])
      return vjp(output_grads)[0]

    return run

  def unit_steps(self, index: int) -> list:
    """Branch ``index``'s units one at a time: per segment, ``(copies, read, apply)``.

    ``read(staged, chunk, copy) -> unit`` takes the variables of the segment's unit ``copy`` (0
    for a single unit; a traced index into a run) from the whole ``staged`` tree, with the
    unit's number; ``apply(unit, side, rngs, microbatch, h) -> h`` applies it. The VJP of
    ``read`` is zero outside that unit's slice, so a unit's parameter gradient taken back
    through it adds into a running gradient sum in place
    (:func:`tpipe.core.programs.unit_backward.backward_into`)."""
    rep = self.chunks_of[index][0]
    steps = []
    for k, seg in enumerate(self.layout.segments[rep]):

      def read(staged, chunk, copy, k=k, seg=seg):
        r = self._local(index, chunk)
        params = self._chunk_trees(self._param_slot(staged[view_lib.PARAMS], index, chunk), index,
                                   chunk)[k]
        if self.stats_layout is not None:
          stats = layout_pack.chunk_trees(
              self.stats_layout, self._slot(staged[view_lib.STATS], r), rep)[k]
        else:
          stats = {}
        unit = self._first_unit(index, chunk, k)
        if seg.copies is not None:
          params, stats = jax.tree.map(
              lambda a: lax.dynamic_index_in_dim(a, copy, keepdims=False), (params, stats))
          unit = unit + copy
        return params, stats, unit

      def apply(unit, side, rngs, microbatch, h, k=k, seg=seg):
        params, stats, number = unit
        step = self._unit(index, k, self.layers[seg.layer], side, rngs, microbatch, False)
        h, _ = step(h, (params, stats, number, None))
        return h

      steps.append((seg.copies, read, apply))
    return steps


def _trace_key(*trees) -> tuple:
  """What tracing a unit depends on in ``trees``: their structure and each array's type (shape,
  dtype, weak type, the mesh axes it varies over); other leaves as they are."""
  leaves, treedef = jax.tree.flatten(trees)
  return str(treedef), tuple(str(jax.typeof(a)) if hasattr(a, "shape") and hasattr(a, "dtype")
                             else repr(a) for a in leaves)
