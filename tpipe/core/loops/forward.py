"""The forward tick loop: a forward schedule (GPipe, circular) run inside ``jax.shard_map``.

Every device runs the same program. A ``lax.scan`` walks the schedule's ticks; at each tick a
device looks up in the table which (micro-batch, repeat) it works on, chooses its input (a fresh
micro-batch, one coming back for another lap on stage 0, or what its left neighbour sent last
tick), runs the chunk's branch (:class:`tpipe.core.programs.chunks.ChunkSet`) through a gated
``lax.switch`` (:mod:`tpipe.core.loops.gated`: idle ticks compute nothing, forward or backward), and
sends the result to its right neighbour with one ``lax.ppermute`` on the ring of stages (over a
delayed link, during the next tick: the transfer overlaps that tick's compute and the value is
read a tick later, as the table says). The last stage files finished micro-batches into an
output buffer.

Autodiff through the scan gives the backward pass (forward ticks replayed in reverse), which
accumulates parameter gradients over micro-batches in the scan's carry.

Data parallelism: the batch is split over the ``data`` mesh axis and parameters are replicated
on it. Parameters and broadcast arrays are cast to vary over ``data`` once, at entry; the
transpose of that cast is the one all-reduce of the step (a ``psum`` over ``data`` of each
replica's share of the gradient), outside the tick loop. In the same way everything is cast to
vary over ``stage`` at entry, so no gradient is summed over stages inside the loop.

The batch enters and leaves split over ``stage`` as well as over the row axes, where each row
shard's batch divides among the stages (:meth:`tpipe.core.base.spmd.Axes.io_spec`). The inputs reach
stage 0 one micro-batch per tick over a conveyor of sends from the stages that hold them
(:mod:`tpipe.core.loops.streaming`; where M is a multiple of S and ``stream_inputs`` is on), else
one all-gather over ``stage`` at entry gives every stage its row shard's whole batch; per-example
side inputs, which every stage reads, are gathered once. One reduce-scatter at exit leaves each
stage its part of the last stage's outputs, so no stage holds the whole batch outside the loop
and whatever runs after the pipeline runs once, not once per stage.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpipe import schedules
from tpipe.core.base import spmd
from tpipe.core.layout import device_view as view_lib
from tpipe.core.loops import gated
from tpipe.core.loops import streaming
from tpipe.core.planning import remat as remat_lib
from tpipe.core.programs import chunks as chunks_lib
from tpipe.core.programs import ring as ring_lib


def _tick_rows(schedule: schedules.Schedule, chunkset: chunks_lib.ChunkSet) -> dict:
  """The per-tick rows the scan consumes: the table, what arrives from the last stage (what it
  ran one tick ago, two over a delayed closing link), and each (tick, stage)'s model chunk and
  branch (``-1`` when idle)."""
  lag = 1 + schedule.delays[-1]
  idle = np.full(lag, schedules.IDLE)
  last_mb = np.concatenate([idle, schedule.microbatch[:-lag, -1]])
  last_rep = np.concatenate([idle, schedule.repeat[:-lag, -1]])
  layout = chunkset.layout
  chunk_at = np.array([[layout.chunk_at(r, s) for s in range(schedule.num_stages)]
                       for r in range(schedule.num_repeats)], np.int32)
  rep = np.maximum(schedule.repeat, 0)
  chunk = chunk_at[rep, np.arange(schedule.num_stages)[None, :]]
  branch = np.asarray(chunkset.branch_of_chunk, np.int32)[chunk]
  return {
      "microbatch": np.maximum(schedule.microbatch, 0).astype(np.int32),
      "repeat": rep.astype(np.int32),
      "chunk": chunk,
      "branch": np.where(schedule.busy, branch, -1).astype(np.int32),
      "arriving_microbatch": last_mb.astype(np.int32),
      "arriving_repeat": last_rep.astype(np.int32),
  }


def run(chunkset: chunks_lib.ChunkSet, staged: dict, x: Any, broadcast: tuple,
        per_example: tuple, rngs: dict, *, schedule: schedules.Schedule,
        axes: spmd.Axes) -> Any:
  """Runs a forward schedule's ticks on every device at once.

  Callers validate arguments first; this function assumes the batch splits into ``M``
  micro-batches per data replica.

  Args:
    chunkset: the chunk programs.
    staged: ``{"params": staged tree[, "stats": staged tree]}``, every leaf ``[R, S, ...]``,
      split over the stage axis.
    x: pytree of arrays ``[N, ...]``, the global batch.
    broadcast: arrays every layer sees whole.
    per_example: arrays ``[N, ...]`` split into micro-batches like ``x``.
    rngs: ``{stream: key}``, one key per stream for the whole call.
    schedule: the forward schedule.
    axes: the mesh and its manual axes.

  Returns:
    The last chunk's outputs for the whole batch; with running statistics, also their sums over
    every busy tick and data replica, staged like them (``[R, S, ...]``).
  """
  global_batch = jax.tree.leaves(x)[0].shape[0]
  loop = _Loop(chunkset, schedule, axes, global_batch)
  io = axes.io_spec(global_batch)
  in_specs = (chunkset.staged_specs(staged), io, io, jax.sharding.PartitionSpec(),
              jax.sharding.PartitionSpec())
  out_specs = io if not loop.with_stats else (io, axes.staged_spec)
  mapped = axes.shard_map(loop.per_device, in_specs, out_specs)
  return mapped(staged, x, tuple(per_example), tuple(broadcast), rngs)


class _Loop:
  """A forward schedule's tick loop for one call (a batch of ``global_batch`` rows):
  :meth:`per_device` is what ``shard_map`` runs on each device."""

  def __init__(self, chunkset: chunks_lib.ChunkSet, schedule: schedules.Schedule,
               axes: spmd.Axes, global_batch: int):
    self.chunkset, self.schedule, self.axes = chunkset, schedule, axes
    self.global_batch = global_batch
    self.num_microbatches, self.num_repeats = schedule.num_microbatches, schedule.num_repeats
    self.with_stats = chunkset.stats_layout is not None
    self.over_stages = axes.splits_over_stages(global_batch)
    self.now_pairs, self.late_pairs = spmd.split_by_delay(
        spmd.neighbour_pairs(schedule.num_stages, 1, wrap=self.num_repeats > 1),
        schedule.delays, 1, schedule.num_stages)
    self.rows_table = _tick_rows(schedule, chunkset)
    self.conveyor = streaming.plan(schedule, axes, global_batch, chunkset.spec.stream_inputs)
    if self.conveyor is not None:
      self.rows_table.update(self.conveyor.row())
    policy = remat_lib.tick_policy(chunkset.spec)
    self.branches = [chunkset.branch(i, policy, tie_to_tick=True)
                     for i in range(chunkset.num_branches)]

  def per_device(self, staged, x, per_example, broadcast, rngs):
    axes, conveyor = self.axes, self.conveyor
    staged = view_lib.device_view(staged)  # [R, ...]; packed parameters [R, 1, n]
    # Once per step, outside the tick loop: the transposes of these casts are the gradient sums
    # over row shards (parameters, broadcast arrays; a parameter split over fsdp already varies
    # over it, and its gathers' transposes sum over fsdp) and over stages (inputs, side inputs).
    if axes.rows:
      staged = jax.tree.map(lambda a: spmd.cast_to(a, frozenset(axes.rows)), staged)
    held = None
    if conveyor is not None:  # The inputs reach stage 0 one micro-batch per tick.
      held = conveyor.hold(x)
      per_example = axes.gather_stages(per_example)
    elif self.over_stages:  # Each stage holds part of the batch: the row shard's whole, once.
      x, per_example = axes.gather_stages((x, per_example))
    else:
      x, per_example = lax.pcast((x, per_example), (axes.stage,), to="varying")
    device = _Device(
        staged=staged, broadcast=lax.pcast(broadcast, axes.manual, to="varying"), rngs=rngs,
        microbatches=(None if conveyor is not None
                      else spmd.split_microbatches(x, self.num_microbatches)),
        per_example=spmd.split_microbatches(per_example, self.num_microbatches), held=held,
        stage=axes.stage_index(), data_index=axes.data_index())
    carry, _ = lax.scan(lambda carry, row: self.tick(device, carry, row),
                        self.initial_carry(held), self.rows_table)
    return self.finish(carry)

  def initial_carry(self, held) -> dict:
    """The loop's carry before the first tick. The buffers are made under named scopes so a
    memory breakdown (:mod:`tpipe.tools.peak`) can tell what each one is."""
    axes, chunkset = self.axes, self.chunkset
    rows = chunkset.spec.microbatch_size(self.global_batch, axes.row_shards)
    with jax.named_scope(spmd.MAILBOX_SCOPE):
      ring_zero = ring_lib.zeros_with_rows(chunkset.ring.example, rows)
      carry = {"incoming": axes.vary(ring_zero)}
      if self.late_pairs:  # Last tick's output, sent during this tick over the delayed links.
        carry["pending"] = axes.vary(ring_zero)
    with jax.named_scope(spmd.BOUNDARY_SCOPE):
      carry["outputs"] = axes.vary(spmd.stacked_zeros(
          ring_lib.zeros_with_rows(chunkset.output_example, rows), self.num_microbatches))
      if self.with_stats:
        slot = chunkset.stats_layout.local_shapes()
        carry["sums"] = axes.vary(spmd.stacked_zeros(slot, self.num_repeats))
      if self.num_repeats > 1:
        carry["loop_back"] = axes.vary(spmd.stacked_zeros(ring_zero, self.num_microbatches))
    if self.conveyor is not None:
      carry["conveyor"] = self.conveyor.start(held)
    return carry

  def tick(self, device: "_Device", carry: dict, row: dict):
    """One tick on one device: its chunk (or nothing) on one micro-batch, the output sent on."""
    carry = dict(carry)
    stage = device.stage
    row = {k: (v[stage] if v.ndim == 1 else v) for k, v in row.items()}
    mb, rep = row["microbatch"], row["repeat"]
    incoming = carry["incoming"]
    if self.num_repeats > 1:
      # Stage 0 parks what the last stage finished last tick until its next lap starts.
      arriving_mb, arriving_rep = row["arriving_microbatch"], row["arriving_repeat"]
      park = (stage == 0) & (arriving_mb >= 0) & (arriving_rep < self.num_repeats - 1)
      carry["loop_back"] = spmd.write_slot(carry["loop_back"], jnp.maximum(arriving_mb, 0),
                                           incoming, park)
      incoming = spmd.select((stage == 0) & (rep > 0), spmd.read_slot(carry["loop_back"], mb),
                             incoming)
    if self.conveyor is not None:
      values, carry["conveyor"] = self.conveyor.tick(device.held, carry["conveyor"],
                                                     row[streaming.ROW][stage])
      fresh = self.conveyor.value_for(values, 0)  # One lane: a tick is one step.
    else:
      fresh = spmd.read_slot(device.microbatches, mb)
    results = gated.switch_call(
        row["branch"], self.branches, device.staged, fresh, incoming, device.broadcast,
        spmd.read_slot(device.per_example, mb), device.rngs,
        device.data_index * self.num_microbatches + mb, row["chunk"])
    to_next, output = results[:2]
    if self.with_stats:  # An idle tick's contribution is zeros.
      carry["sums"] = spmd.add_to_slot(carry["sums"], rep, results[2])
    finished = ((row["branch"] >= 0) & (stage == self.schedule.num_stages - 1)
                & (rep == self.num_repeats - 1))
    with jax.named_scope(spmd.BOUNDARY_SCOPE):
      carry["outputs"] = spmd.write_slot(carry["outputs"], mb, output, finished)
    with jax.named_scope(spmd.MAILBOX_SCOPE):
      if self.now_pairs or self.late_pairs:
        carry["incoming"] = spmd.permute_parts(to_next, self.axes.stage, self.now_pairs,
                                               self.late_pairs, carry.get("pending"))
      else:
        carry["incoming"] = to_next
      if self.late_pairs:
        carry["pending"] = to_next
    return carry, None

  def finish(self, carry: dict):
    """After the loop: the outputs where they belong (and the statistics' sums)."""
    axes = self.axes
    # Only the last stage wrote outputs (the others hold zeros): the sum hands each stage its
    # part of them (or, where the batch does not split over the stages, all of them).
    outputs = spmd.join_microbatches(carry["outputs"])
    outputs = (axes.scatter_stages(outputs) if self.over_stages
               else lax.psum(outputs, axes.stage))
    if not self.with_stats:
      return outputs
    sums = lax.psum(carry["sums"], axes.rows) if axes.rows else carry["sums"]
    return outputs, jax.tree.map(lambda a: a[:, None], sums)


class _Device(NamedTuple):
  """One device's operands of the tick loop: its stage's variables, the side inputs and keys,
  the micro-batches (or the conveyor's held inputs), its stage and data index."""

  staged: Any
  broadcast: Any
  rngs: Any
  microbatches: Any
  per_example: Any
  held: Any
  stage: Any
  data_index: Any
