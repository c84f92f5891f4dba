"""Streamed inputs in a tick loop: the conveyor of :mod:`tpipe.schedules.streaming` on devices.

Where a row shard's batch is split over the stages, each stage holds ``M/S`` of its micro-batches.
Instead of an all-gather over ``stage`` before the first tick (the whole batch onto every stage,
blocking the step's start), each tick every stage puts the value its table says on the conveyor,
one of its own micro-batches or what arrived from its right neighbour, and a ``lax.ppermute``
over ``stage`` sends it one stage left (over a delayed link, during the next tick, beside its
compute). Stage 0 reads its input from the same choice. Autodiff transposes the sends, so the
gradient of a float input flows back along the conveyor to the stage that holds it.

Both tick loops use it (:mod:`tpipe.core.forward`, :mod:`tpipe.core.fused`); :func:`plan` says
whether a call streams (``PipelineSpec.stream_inputs``, the batch split over stages, a feasible
table) or gathers once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tpipe import schedules
from tpipe.core import spmd

# The scan row with each (tick, stage)'s conveyor slot.
ROW = "conveyor_slot"


def plan(table, axes: spmd.Axes, global_batch: int, enabled: bool, reads_at_w: bool = False):
  """The :class:`Conveyor` for a call, or None where the batch is gathered once instead
  (streaming off, the batch not split over the stages, a table with compound ticks, whose stage
  0 can read two micro-batches' inputs in one tick, or no feasible table:
  :func:`tpipe.schedules.input_stream`). ``reads_at_w``: ``W`` of chunk 0 reads the inputs
  too (``weight_recompute``)."""
  compound = getattr(table, "is_compound", False)
  if not enabled or compound or not axes.splits_over_stages(global_batch):
    return None
  stream = schedules.input_stream(schedules.first_stage_reads(table, reads_at_w),
                                  table.num_stages,
                                  table.num_microbatches, table.delays)
  return None if stream is None else Conveyor(stream, axes)


class Conveyor:
  """One call's conveyor: its table as a scan row, its carry, and one tick's step."""

  def __init__(self, stream: schedules.InputStream, axes: spmd.Axes):
    self.stream, self.axes = stream, axes
    num_stages = stream.num_stages
    self.now, self.late = spmd.split_by_delay(
        spmd.neighbour_pairs(num_stages, -1, wrap=False), stream.delays, -1, num_stages)

  def row(self) -> dict:
    """``{ROW: [T, S]}``: the scan's per-tick slots (:attr:`InputStream.source`)."""
    return {ROW: np.asarray(self.stream.source, np.int32)}

  def hold(self, local):
    """This stage's part of the inputs, ``[M/S, rows, ...]`` per leaf."""
    return spmd.split_microbatches(local, self.stream.per_stage)

  def start(self, held) -> dict:
    """The carry before the first tick: an empty carriage (and an empty pending send over
    delayed links)."""
    empty = self.axes.vary(jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), held))
    carry = {"carriage": empty}
    if self.late:
      carry["carriage_pending"] = empty
    return carry

  def tick(self, held, carry: dict, slot):
    """``(value, carry)``: what this stage puts on the conveyor at this tick (on stage 0, the
    micro-batch it reads), and the carry for the next tick."""
    value = spmd.select(slot >= 0, spmd.read_slot(held, jnp.maximum(slot, 0)), carry["carriage"])
    arrived = spmd.permute_parts(value, self.axes.stage, self.now, self.late,
                                 carry.get("carriage_pending"))
    carry = {"carriage": arrived}
    if self.late:
      carry["carriage_pending"] = value
    return value, carry


def describe(table, axes: spmd.Axes, global_batch: int, enabled: bool,
             reads_at_w: bool = False) -> str:
  """How a call's inputs reach stage 0, in words (for logs and reports)."""
  if not axes.splits_over_stages(global_batch):
    return "inputs replicated over the stages (the batch does not split among them)"
  conveyor = plan(table, axes, global_batch, enabled, reads_at_w)
  if conveyor is not None:
    return (f"inputs streamed to stage 0 one micro-batch per tick (each stage holds "
            f"{conveyor.stream.per_stage} of {table.num_microbatches})")
  why = ("stream_inputs=False" if not enabled
         else "compound ticks: stage 0 can read two micro-batches in one tick"
         if getattr(table, "is_compound", False)
         else f"M={table.num_microbatches} is not a multiple of S={table.num_stages}"
         if table.num_microbatches % table.num_stages
         else "a read comes before its inputs could travel over the delayed links")
  return f"inputs gathered onto every stage once per step ({why})"
