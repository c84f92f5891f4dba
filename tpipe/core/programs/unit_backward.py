"""A chunk's backward one layer unit at a time, its parameter gradients summed in place.

Differentiating a chunk whole (``jax.vjp`` of the chunk program) builds the chunk's whole
parameter gradient, the stacked output of the backward scan over its units, before the tick adds
it to the stage's running sum; on the TPU the compiler reserves about as much again. The backward
here (:func:`backward_into`) runs the units backwards one at a time from
:meth:`tpipe.core.programs.chunks.ChunkSet.unit_steps` and adds each unit's parameter gradient into
the
running sums inside the loop over a run's copies, which XLA updates in place. The fused tick loop
(:mod:`tpipe.core.loops.fused`) runs its ``B`` actions this way where the step's backward plan says
so (:func:`tpipe.core.planning.backward_plan.resolve`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from tpipe.core.base import float_leaves as floats_lib
from tpipe.core.base import jax_compat
from tpipe.core.base import spmd
from tpipe.core.planning import backward_plan
from tpipe.core.programs import chunks as chunks_lib
from tpipe.core.programs import weight_casts


class ChunkArgs(NamedTuple):
  """A chunk program's arguments after its variables, for one micro-batch: the micro-batch's
  inputs ``fresh``, the chunk's input ``incoming`` (from the previous chunk), the arrays every
  chunk sees whole (``broadcast``), the per-example ones, the random keys and the global
  micro-batch number."""

  fresh: Any
  incoming: Any
  broadcast: Any
  per_example: Any
  rngs: Any
  microbatch: Any


def backward_into(chunkset: chunks_lib.ChunkSet, index: int,
                  plan: backward_plan.BackwardPlan):
  """Branch ``index`` of ``chunkset``: its backward one unit at a time, its parameter gradients
  added into running sums: ``fn(sums, staged, args, chunk, outputs, cotangent) -> (sums,
  g_fresh, g_incoming, g_side)``, ``args`` being the chunk program's :class:`ChunkArgs`.

  ``sums`` are the float leaves of ``staged`` (:func:`tpipe.core.base.float_leaves.float_leaves`)
  holding
  the gradients so far; ``outputs((to_next, output))`` picks the differentiated outputs of the
  chunk's results and ``cotangent(outputs)`` gives their cotangent. The gradients returned are
  those of the float leaves of ``args.fresh``, ``args.incoming`` and ``(args.broadcast,
  args.per_example)``.

  It recomputes the chunk's forward, then runs the units backwards, each unit's parameter
  gradient added into ``sums`` inside the loop over a run's copies: XLA updates the running
  sums in place, where differentiating the whole chunk would first build the chunk's whole
  parameter gradient (the scan's stacked output) and then add it. Where ``plan`` keeps unit
  residuals (``"chunk"`` granularity) the recomputed forward keeps every unit's residuals (its
  VJP, less the unit's variables and the side inputs as they are, which the backward reads
  again, and less the casts
  of the variables the unit only casts, which it casts again:
  :mod:`tpipe.core.programs.weight_casts`;
  what else is computed from them, such as an FSDP gather, stays a residual, as under
  autodiff), for the FLOPs of differentiating the chunk's checkpoint; finer, it keeps each
  unit's input and recomputes the unit under ``jax.vjp`` in the backward, for the FLOPs of
  ``remat_granularity="layer"``.
  """
  steps = chunkset.unit_steps(index)

  def run(sums, staged, args: ChunkArgs, chunk, outputs, cotangent):
    units = _Units(chunkset, index, steps, plan, staged, args, chunk)
    records = units.forward()
    h = records.pop()
    rows = jax.tree.leaves(args.fresh)[0].shape[0]
    tail = lambda hf: outputs(chunkset.results_of(index, floats_lib.with_float_leaves(h, hf), rows))
    out, tail_vjp = jax.vjp(tail, floats_lib.float_leaves(h))
    (g_h,) = tail_vjp(cotangent(out))
    g_h, sums, g_side = units.backward(g_h, list(sums), records)
    _, input_vjp = jax.vjp(
        lambda f, i: floats_lib.float_leaves(chunkset.input_of(
            index, chunk, floats_lib.with_float_leaves(args.fresh, f),
            floats_lib.with_float_leaves(args.incoming, i))),
        floats_lib.float_leaves(args.fresh), floats_lib.float_leaves(args.incoming))
    g_fresh, g_incoming = input_vjp(g_h)
    return sums, g_fresh, g_incoming, g_side

  return run


class _Units:
  """One chunk backward by units, as :func:`backward_into` traces it: the chunk's units
  (``steps``: per segment ``(copies, read, apply)``) on one micro-batch.

  Per segment, what its forward learned while traced (the dtypes of its unit's float leaves,
  which it only casts, and where a kept VJP's residuals come from) is read by its backward in
  the same trace.
  """

  def __init__(self, chunkset, index, steps, plan, staged, args: ChunkArgs, chunk):
    self.chunkset, self.index, self.steps = chunkset, index, steps
    self.keep_residuals = plan.unit_residuals
    self.unroll = chunkset.spec.unroll
    self.staged, self.args, self.chunk = staged, args, chunk
    self.side = (args.broadcast, args.per_example)
    self.staged_floats = floats_lib.float_leaves(staged)
    self.side_floats = floats_lib.float_leaves(self.side)
    # Per segment: its unit's float leaves' own dtypes; the casts of those it only casts; a
    # kept VJP's residuals' sources (the unit's variables and the side inputs are read again).
    self.dtypes: dict[int, list] = {}
    self.casts: dict[int, list] = {}
    self.reread: dict[int, tuple] = {}

  def unit_vjp(self, k, h_in, copy, after=None):
    """``(h_out, vjp, floats)``: segment ``k``'s unit ``copy`` read and applied to ``h_in``, and
    the VJP from its output's float leaves to ``floats`` (the unit's float leaves, those it
    only casts as cast: :mod:`tpipe.core.programs.weight_casts`), ``h_in``'s and the side
    inputs'. ``after``: a value the unit's reading and running wait for (None: none)."""
    _, read, apply = self.steps[k]
    unit, side, args = read(self.staged, self.chunk, copy), self.side, self.args
    if after is not None:
      unit, h_in, _ = lax.optimization_barrier((unit, h_in, after))

    def f(unit_floats, h_floats, side_floats):
      h_out = apply(floats_lib.with_float_leaves(unit, unit_floats),
                    floats_lib.with_float_leaves(side, side_floats), args.rngs, args.microbatch,
                    floats_lib.with_float_leaves(h_in, h_floats))
      return floats_lib.float_leaves(h_out), h_out

    unit_floats = floats_lib.float_leaves(unit)
    self.dtypes[k] = [a.dtype for a in unit_floats]
    if self.keep_residuals and k not in self.casts:  # Traced once per segment.
      with weight_casts.untied():  # The unit's own casts, tied where it runs, read as casts.
        self.casts[k] = weight_casts.only_cast_dtypes(
            lambda floats, h_floats, side_floats: f(floats, h_floats, side_floats)[0],
            unit_floats, floats_lib.float_leaves(h_in), self.side_floats)
    unit_floats = weight_casts.cast(unit_floats, self.casts.get(k, [None] * len(unit_floats)),
                                    self._tie(copy))
    _, vjp, h_out = jax.vjp(f, unit_floats, floats_lib.float_leaves(h_in), self.side_floats,
                            has_aux=True)
    return h_out, vjp, unit_floats

  def _tie(self, copy):
    """Casts tied to the loops' steps (the unit's copy, the micro-batch), so that XLA casts each
    unit's weights where they are used instead of hoisting the casts of a whole stack out of
    the loops (:func:`tpipe.core.programs.weight_casts.tie_to_steps`)."""
    return lambda a: weight_casts.tie_to_steps(a, (copy, self.args.microbatch))

  def keep(self, k, vjp, unit_floats) -> list:
    """A kept VJP's residuals without what the backward reads again (the unit's variables and
    the side inputs, the same every copy); their sources are noted for :meth:`kept_vjp`."""
    leaves, treedef = jax_compat.vjp_residuals(vjp)
    in_unit = jax_compat.identical_positions(leaves, unit_floats)
    in_side = jax_compat.identical_positions(leaves, self.side_floats)
    sources = [("unit", u) if u is not None else ("side", s) if s is not None else None
               for u, s in zip(in_unit, in_side)]
    self.reread[k] = (treedef, sources)
    return [a for a, where in zip(leaves, sources) if where is None]

  def kept_vjp(self, k, kept, copy):
    """Segment ``k``'s VJP for unit ``copy`` from its ``kept`` residuals, the unit's variables
    (cast again) and the side inputs."""
    _, read, _ = self.steps[k]
    treedef, sources = self.reread[k]
    unit_floats = weight_casts.cast(
        floats_lib.float_leaves(read(self.staged, self.chunk, copy)), self.casts[k],
        self._tie(copy))
    kept = iter(kept)
    leaves = [next(kept) if where is None else
              (unit_floats if where[0] == "unit" else self.side_floats)[where[1]]
              for where in sources]
    return jax_compat.vjp_with_residuals(treedef, leaves)

  def forward(self) -> list:
    """The chunk's forward: per segment what its backward starts from (its units' kept
    residuals, or their inputs), and last the chunk's output."""
    h = self.chunkset.input_of(self.index, self.chunk, self.args.fresh, self.args.incoming)
    records = []
    for k, (copies, read, apply) in enumerate(self.steps):
      if self.keep_residuals:
        def body(h, copy, k=k):
          h, vjp, unit_floats = self.unit_vjp(k, h, copy)
          return h, self.keep(k, vjp, unit_floats)
      else:
        args = self.args
        body = lambda h, copy, read=read, apply=apply: (
            apply(read(self.staged, self.chunk, copy), self.side, args.rngs, args.microbatch,
                  h), h)
      if copies is None:
        h, record = body(h, 0)
      else:
        h, record = lax.scan(body, h, jnp.arange(copies), unroll=self.unroll)
      records.append(record)
    return records + [h]

  def unit_backward(self, carry, k, record, copy):
    """One unit's backward: its parameter gradient added into the running sums (through the
    VJP of reading it from the whole staged tree, zero outside its slice), its input's and the
    side inputs' gradients."""
    _, read, _ = self.steps[k]
    if self.keep_residuals:
      vjp = self.kept_vjp(k, record, copy)
    elif self.unroll is True:
      # Unrolled, no loop orders the units: the unit's recomputation (its weights read and
      # cast) waits for the gradient from the unit after it, so XLA neither merges it with the
      # forward's nor runs every unit's at once, holding their activations.
      vjp = self.unit_vjp(k, record, copy, after=carry[0])[1]
    else:
      vjp = self.unit_vjp(k, record, copy)[1]
    g_h, sums, g_side = carry
    d_unit, d_h, d_side = vjp(g_h)
    d_unit = weight_casts.uncast(d_unit, self.dtypes[k])
    _, read_vjp = jax.vjp(
        lambda floats: floats_lib.float_leaves(
            read(floats_lib.with_float_leaves(self.staged, floats), self.chunk, copy)),
        self.staged_floats)
    (d_staged,) = read_vjp(d_unit)
    add = lambda total, g: [t + d for t, d in zip(total, g)]
    sums = add(sums, d_staged)
    if self.steps[k][0] is None:
      # A unit of its own (an end: an embedding, a head) has its gradient summed, the FSDP
      # reduce-scatter included, before the units before it run: left free, the compiler
      # delays the scatter to overlap it with them, and the end's whole gradient (vocabulary
      # x width, float32) stays live through the chunk's backward. A run's units keep the
      # overlap: their gradients are a layer's.
      d_h, sums = lax.optimization_barrier((d_h, sums))
    return d_h, sums, add(g_side, d_side)

  def backward(self, g_h, sums: list, records: list):
    """The units backwards from the chunk output's gradient ``g_h``: ``(g_h, sums, g_side)``,
    the chunk input's gradient, the running sums with the chunk's parameter gradients added,
    and the side inputs' gradients."""
    carry = (g_h, sums, [spmd.zeros_like_varying(a) for a in self.side_floats])
    for k in reversed(range(len(self.steps))):
      copies = self.steps[k][0]
      if copies is None:
        carry = self.unit_backward(carry, k, records[k], 0)
      else:
        body = lambda carry, xs, k=k: (self.unit_backward(carry, k, xs[1], xs[0]), None)
        carry, _ = lax.scan(body, carry, (jnp.arange(copies), records[k]), reverse=True,
                            unroll=self.unroll)
    return carry
