"""Streamed inputs in a tick loop: the conveyor of :mod:`tpipe.schedules.streaming` on devices.

Where a row shard's batch is split over the stages, each stage holds ``M/S`` of its micro-batches.
Instead of an all-gather over ``stage`` before the first tick (the whole batch onto every stage,
blocking the step's start), each tick every stage puts the value its table says on the conveyor,
one of its own micro-batches or what arrived from its right neighbour, and a ``lax.ppermute``
over ``stage`` sends it one stage left (over a delayed link, during the next tick, beside its
compute). Stage 0 reads its input from the same choice. Autodiff transposes the sends, so the
gradient of a float input flows back along the conveyor to the stage that holds it.

Both tick loops use it (:mod:`tpipe.core.loops.forward`, :mod:`tpipe.core.loops.fused`);
:func:`plan` says
whether a call streams (``PipelineSpec.stream_inputs``, the batch split over stages, a feasible
table) or gathers once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tpipe.core.base import spmd
from tpipe.schedules import streaming as conveyor_tables

# The scan row with each (tick, stage)'s conveyor slot.
ROW = "conveyor_slot"


def plan(table, axes: spmd.Axes, global_batch: int, enabled: bool, reads_at_w: bool = False):
  """The :class:`Conveyor` for a call, or None where the batch is gathered once instead
  (streaming off, the batch not split over the stages, or no feasible table:
  :func:`tpipe.schedules.streaming.input_stream`). A compound tick's lanes each get a conveyor
  of their own (:func:`tpipe.schedules.streaming.lane_reads`). ``reads_at_w``: ``W`` of chunk 0
  reads the inputs too (``weight_recompute``)."""
  if not enabled or not axes.splits_over_stages(global_batch):
    return None
  streams = {}
  for lane, reads in enumerate(conveyor_tables.lane_reads(table, reads_at_w)):
    if np.any(reads >= 0):
      streams[lane] = conveyor_tables.input_stream(reads, table.num_stages,
                                                   table.num_microbatches, table.delays)
      if streams[lane] is None:
        return None
  return Conveyor(streams, axes) if streams else None


class Conveyor:
  """One call's conveyors, one per lane in which stage 0 reads inputs: their tables as a scan
  row, their carry, and one tick's step (every lane's sends at once)."""

  def __init__(self, streams: dict[int, conveyor_tables.InputStream], axes: spmd.Axes):
    self.streams, self.axes = streams, axes
    self.lanes = tuple(sorted(streams))  # The lanes that read, in the order the carry has.
    stream = streams[self.lanes[0]]
    self.per_stage, num_stages = stream.per_stage, stream.num_stages
    self.now, self.late = spmd.split_by_delay(
        spmd.neighbour_pairs(num_stages, -1, wrap=False), stream.delays, -1, num_stages)

  def row(self) -> dict:
    """``{ROW: [T, S, K]}``: the scan's per-tick slots of the ``K`` conveyors
    (:attr:`InputStream.source`)."""
    sources = [self.streams[lane].source for lane in self.lanes]
    return {ROW: np.stack(sources, axis=-1).astype(np.int32)}

  def hold(self, local):
    """This stage's part of the inputs, ``[M/S, rows, ...]`` per leaf."""
    return spmd.split_microbatches(local, self.per_stage)

  def start(self, held) -> dict:
    """The carry before the first tick: an empty carriage per conveyor (and an empty pending
    send over delayed links)."""
    empty = self.axes.vary(jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), held))
    carry = {"carriage": (empty,) * len(self.lanes)}
    if self.late:
      carry["carriage_pending"] = carry["carriage"]
    return carry

  def tick(self, held, carry: dict, slots):
    """``(values, carry)``: what this stage puts on each conveyor at this tick, given its
    slots ``[K]`` (on stage 0, the micro-batches its lanes read: :meth:`value_for`), and the
    carry for the next tick."""
    values = tuple(
        spmd.select(slots[k] >= 0, spmd.read_slot(held, jnp.maximum(slots[k], 0)), passing)
        for k, passing in enumerate(carry["carriage"]))
    arrived = spmd.permute_parts(values, self.axes.stage, self.now, self.late,
                                 carry.get("carriage_pending"))
    carry = {"carriage": arrived}
    if self.late:
      carry["carriage_pending"] = values
    return values, carry

  def value_for(self, values, lane: int):
    """What lane ``lane`` reads of one tick's :meth:`tick` values (stage 0's micro-batch there);
    None for a lane that never reads inputs."""
    if lane not in self.lanes:
      return None
    return values[self.lanes.index(lane)]


def describe(table, axes: spmd.Axes, global_batch: int, enabled: bool,
             reads_at_w: bool = False) -> str:
  """How a call's inputs reach stage 0, in words (for logs and reports)."""
  if not axes.splits_over_stages(global_batch):
    return "inputs replicated over the stages (the batch does not split among them)"
  conveyor = plan(table, axes, global_batch, enabled, reads_at_w)
  if conveyor is not None:
    lanes = len(conveyor.lanes)
    per_tick = "one micro-batch per tick" if lanes == 1 else f"up to {lanes} micro-batches per tick"
    return (f"inputs streamed to stage 0 {per_tick} (each stage holds "
            f"{conveyor.per_stage} of {table.num_microbatches})")
  why = ("stream_inputs=False" if not enabled
         else f"M={table.num_microbatches} is not a multiple of S={table.num_stages}"
         if table.num_microbatches % table.num_stages
         else "a read comes before its inputs could travel over the delayed links")
  return f"inputs gathered onto every stage once per step ({why})"
