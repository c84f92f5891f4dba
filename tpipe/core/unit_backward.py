"""A chunk's backward one layer unit at a time, its parameter gradients summed in place.

Differentiating a chunk whole (``jax.vjp`` of the chunk program) builds the chunk's whole
parameter gradient, the stacked output of the backward scan over its units, before the tick adds
it to the stage's running sum; on the TPU the compiler reserves about as much again. The backward
here (:func:`backward_into`) runs the units backwards one at a time from
:meth:`tpipe.core.chunks.ChunkSet.unit_steps` and adds each unit's parameter gradient into the
running sums inside the loop over a run's copies, which XLA updates in place. The fused tick loop
(:mod:`tpipe.core.fused`) runs its ``B`` actions this way where the step's backward plan says
so (:func:`tpipe.core.backward_plan.resolve`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tpipe.core import backward_plan
from tpipe.core import chunks as chunks_lib
from tpipe.core import jax_compat
from tpipe.core import spmd
from tpipe.core import weight_casts

_floats = chunks_lib.float_leaves
_with_floats = chunks_lib.with_float_leaves


def backward_into(chunkset: chunks_lib.ChunkSet, index: int,
                  plan: backward_plan.BackwardPlan):
  """Branch ``index`` of ``chunkset``: its backward one unit at a time, its parameter gradients
  added into running sums: ``fn(sums, staged, fresh, incoming, broadcast, per_example, rngs,
  microbatch, chunk, outputs, cotangent) -> (sums, g_fresh, g_incoming, g_side)``.

  ``sums`` are the float leaves of ``staged`` (:func:`tpipe.core.chunks.float_leaves`) holding
  the gradients so far; ``outputs((to_next, output))`` picks the differentiated outputs of the
  chunk's results and ``cotangent(outputs)`` gives their cotangent. The gradients returned are
  those of the float leaves of ``fresh``, ``incoming`` and ``(broadcast, per_example)``.

  It recomputes the chunk's forward, then runs the units backwards, each unit's parameter
  gradient added into ``sums`` inside the loop over a run's copies: XLA updates the running
  sums in place, where differentiating the whole chunk would first build the chunk's whole
  parameter gradient (the scan's stacked output) and then add it. Where ``plan`` keeps unit
  residuals (``"chunk"`` granularity) the recomputed forward keeps every unit's residuals (its
  VJP, less the unit's variables and the side inputs as they are, which the backward reads
  again, and less the casts
  of the variables the unit only casts, which it casts again: :mod:`tpipe.core.weight_casts`;
  what else is computed from them, such as an FSDP gather, stays a residual, as under
  autodiff), for the FLOPs of differentiating the chunk's checkpoint; finer, it keeps each
  unit's input and recomputes the unit under ``jax.vjp`` in the backward, for the FLOPs of
  ``remat_granularity="layer"``.
  """
  steps = chunkset.unit_steps(index)
  unroll = chunkset.spec.unroll
  keep_residuals = plan.unit_residuals

  def run(sums, staged, fresh, incoming, broadcast, per_example, rngs, microbatch, chunk,
          outputs, cotangent):
    side = (broadcast, per_example)
    staged_floats, side_floats = _floats(staged), _floats(side)

    def unit_vjp(k, read, apply, h_in, copy):
      """``(h_out, vjp, floats)``: the unit's variables read and applied to ``h_in``, and the
      VJP from its output's float leaves to ``floats`` (the unit's float leaves, those it only
      casts as cast: :mod:`tpipe.core.weight_casts`), ``h_in``'s and ``side``'s."""
      unit = read(staged, chunk, copy)

      def f(unit_floats, h_floats, side_floats):
        h_out = apply(_with_floats(unit, unit_floats), _with_floats(side, side_floats),
                      rngs, microbatch, _with_floats(h_in, h_floats))
        return _floats(h_out), h_out

      unit_floats = _floats(unit)
      dtypes[k] = [a.dtype for a in unit_floats]
      if keep_residuals and k not in casts:  # Traced once per segment.
        casts[k] = weight_casts.only_cast_dtypes(
            lambda floats, h_floats, side_floats: f(floats, h_floats, side_floats)[0],
            unit_floats, _floats(h_in), side_floats)
      unit_floats = weight_casts.cast(unit_floats, casts.get(k, [None] * len(unit_floats)))
      _, vjp, h_out = jax.vjp(f, unit_floats, _floats(h_in), side_floats, has_aux=True)
      return h_out, vjp, unit_floats

    def add_unit_grads(carry, k, vjp, read, copy):
      g_h, sums, g_side = carry
      d_unit, d_h, d_side = vjp(g_h)
      d_unit = weight_casts.uncast(d_unit, dtypes[k])
      _, read_vjp = jax.vjp(
          lambda floats: _floats(read(_with_floats(staged, floats), chunk, copy)),
          staged_floats)
      (d_staged,) = read_vjp(d_unit)
      add = lambda total, g: [t + d for t, d in zip(total, g)]
      return d_h, add(sums, d_staged), add(g_side, d_side)

    # A kept VJP's residuals without what the backward reads again (the unit's variables and
    # the side inputs, the same every copy): per residual, its (source, index) there or None.
    # The casts of the unit's variables (those it only casts) are cast again, not kept.
    reread: dict[int, list] = {}
    casts: dict[int, list] = {}
    dtypes: dict[int, list] = {}  # Per segment, its unit's float leaves' own dtypes.

    def keep(k, vjp, unit):  # ``unit``: the float leaves the VJP was taken in.
      leaves, treedef = jax_compat.vjp_residuals(vjp)
      in_unit = jax_compat.identical_positions(leaves, unit)
      in_side = jax_compat.identical_positions(leaves, side_floats)
      sources = [("unit", u) if u is not None else ("side", s) if s is not None else None
                 for u, s in zip(in_unit, in_side)]
      reread[k] = (treedef, sources)
      return [a for a, where in zip(leaves, sources) if where is None]

    def kept_vjp(k, read, kept, copy):
      treedef, sources = reread[k]
      unit_floats = weight_casts.cast(_floats(read(staged, chunk, copy)), casts[k])
      kept = iter(kept)
      leaves = [next(kept) if where is None else
                (unit_floats if where[0] == "unit" else side_floats)[where[1]]
                for where in sources]
      return jax_compat.vjp_with_residuals(treedef, leaves)

    # Forward: what each unit's backward starts from (its kept residuals, or its input).
    h = chunkset.input_of(index, chunk, fresh, incoming)
    records = []
    for k, (copies, read, apply) in enumerate(steps):
      if keep_residuals:
        def body(h, copy, k=k, read=read, apply=apply):
          h, vjp, unit = unit_vjp(k, read, apply, h, copy)
          return h, keep(k, vjp, unit)
      else:
        body = lambda h, copy, read=read, apply=apply: (
            apply(read(staged, chunk, copy), side, rngs, microbatch, h), h)
      if copies is None:
        h, record = body(h, 0)
      else:
        h, record = lax.scan(body, h, jnp.arange(copies), unroll=unroll)
      records.append(record)
    rows = jax.tree.leaves(fresh)[0].shape[0]
    tail = lambda hf: outputs(chunkset.results_of(index, _with_floats(h, hf), rows))
    out, tail_vjp = jax.vjp(tail, _floats(h))
    (g_h,) = tail_vjp(cotangent(out))

    def unit_backward(carry, k, record, copy):
      _, read, apply = steps[k]
      if keep_residuals:
        vjp = kept_vjp(k, read, record, copy)
      else:
        vjp = unit_vjp(k, read, apply, record, copy)[1]
      return add_unit_grads(carry, k, vjp, read, copy)

    carry = (g_h, list(sums), [spmd.zeros_like_varying(a) for a in side_floats])
    for k in reversed(range(len(steps))):
      if steps[k][0] is None:
        carry = unit_backward(carry, k, records[k], 0)
      else:
        body = lambda carry, xs, k=k: (unit_backward(carry, k, xs[1], xs[0]), None)
        carry, _ = lax.scan(body, carry, (jnp.arange(steps[k][0]), records[k]),
                            reverse=True, unroll=unroll)
    g_h, sums, g_side = carry
    _, input_vjp = jax.vjp(
        lambda f, i: _floats(chunkset.input_of(index, chunk, _with_floats(fresh, f),
                                               _with_floats(incoming, i))),
        _floats(fresh), _floats(incoming))
    g_fresh, g_incoming = input_vjp(g_h)
    return sums, g_fresh, g_incoming, g_side

  return run
