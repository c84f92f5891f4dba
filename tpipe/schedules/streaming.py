"""Streamed inputs: each micro-batch's data reaches stage 0 in the tick that reads it (pure NumPy).

Where a row shard's batch is split over the stages as well (the data loader's layout, see
:meth:`tpipe.core.base.spmd.Axes.io_spec`), stage ``s`` holds micro-batches ``s * M/S ... (s + 1) *
M/S - 1`` whole when ``M`` is a multiple of ``S``. Only stage 0 reads them (the first model chunk
lives there). Rather than gathering the whole batch onto every stage before the first tick (one
blocking transfer), the inputs ride a **conveyor**: every tick each stage ``s > 0`` sends one
micro-batch's data one stage to the left, either one it holds (it puts it on the conveyor) or
the one that arrived from its right neighbour (it passes it on). A value sent over link
``l`` (stages ``l`` and ``l + 1``) arrives after ``1 + delays[l]`` ticks, so the data of a
micro-batch held by stage ``o`` and read by stage 0 at tick ``t`` leaves stage ``o`` at tick
``t - D(o)``, where ``D(o)`` is the sum of the hop times from ``o`` down to 0. Stage 0 reads
each tick at most one micro-batch, so no two reads want the same stage in the same tick: the
table is conflict-free by construction, and :meth:`InputStream.deliveries` replays it to check.

A stage then holds ``M/S`` micro-batches of inputs instead of ``M``, and each transfer is one
micro-batch that overlaps a tick's compute like the activations' sends. A compound tick (several
rows, :mod:`tpipe.schedules.compound`) can read two micro-batches on stage 0: each of its lanes
(a tick's first row, its second, ...) gets a conveyor of its own (:func:`lane_reads`).

Example::

  >>> from tpipe import schedules
  >>> table = schedules.build("gpipe", num_stages=2, num_microbatches=4)
  >>> stream = input_stream(first_stage_reads(table), num_stages=2, num_microbatches=4)
  >>> stream.source.T.tolist()   # per stage, per tick: local slot put on the conveyor, or -1
  [[0, 1, -1, -1, -1], [-1, 0, 1, -1, -1]]
  >>> stream.deliveries().tolist() == stream.reads.tolist()
  True
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tpipe.schedules import actions as actions_lib
from tpipe.schedules import forward as forward_lib

# What a stage's conveyor slot holds when it passes on what arrived (or, on stage 0, reads it).
PASS_ON = -1


def first_stage_reads(table, reads_at_w: bool = False) -> np.ndarray:
  """``[T]``: the micro-batch whose inputs stage 0 reads at each tick of ``table``, or -1.

  A forward schedule (:class:`tpipe.schedules.Schedule`) reads them where stage 0 runs a
  micro-batch's first repeat; a fused one (:class:`tpipe.schedules.FusedSchedule`) where it runs
  ``F``, ``B`` or ``BI`` of model chunk 0 (a backward recomputes the chunk's forward from the
  inputs), and ``W`` too with ``reads_at_w`` (a ``W`` that recomputes the forward).
  """
  if isinstance(table, forward_lib.Schedule):
    reads = np.where(table.busy[:, 0] & (table.repeat[:, 0] == 0), table.microbatch[:, 0], -1)
    return reads.astype(np.int64)
  Action = actions_lib.Action
  kinds = table.action[:, 0]
  readers = (Action.F, Action.B, Action.BI) + ((Action.W,) if reads_at_w else ())
  uses_inputs = np.isin(kinds, readers) & (table.chunk[:, 0] == 0)
  return np.where(uses_inputs, table.microbatch[:, 0], -1).astype(np.int64)


def lane_reads(table, reads_at_w: bool = False) -> np.ndarray:
  """``[L, T]``: per lane (one step of a compound tick: a tick's ``k``-th row is in lane ``k``)
  and tick, the micro-batch whose inputs stage 0 reads there, or -1 (:func:`first_stage_reads`
  row by row). A table without compound ticks has one lane: ``first_stage_reads`` itself.

  Each lane reads at most one micro-batch per tick, so each lane's reads travel on a conveyor
  of their own (:func:`input_stream`), and a tick whose stage 0 reads two micro-batches gets
  them by two sends.
  """
  reads = first_stage_reads(table, reads_at_w)
  if not getattr(table, "is_compound", False):
    return reads[None]
  lanes = np.arange(table.num_rows) - table.first_rows()[table.tick]
  out = np.full((table.lanes, table.num_ticks), -1, np.int64)
  out[lanes, table.tick] = reads
  return out


def hop_ticks(delays) -> np.ndarray:
  """``[S]``: ``D(s)``, the ticks a value takes from stage ``s`` to stage 0 when every stage on
  the way passes it on (one tick per link, two over a delayed one)."""
  delays = np.asarray(delays, np.int64)
  return np.concatenate([[0], np.cumsum(1 + delays[:-1])]) if len(delays) else np.zeros(1, int)


@dataclasses.dataclass(frozen=True)
class InputStream:
  """A conveyor table: which micro-batch each stage puts on the conveyor at each tick.

  Attributes:
    num_stages: S.
    num_microbatches: M, a multiple of S; stage ``s`` holds micro-batches ``s * M/S`` onward.
    delays: per link of the ring of stages, 0 or 1 extra tick (the last link, which closes the
      ring, carries nothing here).
    reads: ``[T]``: the micro-batch stage 0 reads at each tick, or -1.
    source: ``[T, S]``: the local slot (``0 .. M/S - 1``) of the micro-batch a stage puts on the
      conveyor at a tick (stage 0: reads itself), or :data:`PASS_ON` (send on, or on stage 0
      read, what arrived from the right).
  """

  num_stages: int
  num_microbatches: int
  delays: tuple[int, ...]
  reads: np.ndarray
  source: np.ndarray

  @property
  def per_stage(self) -> int:
    """Micro-batches each stage holds: ``M / S``."""
    return self.num_microbatches // self.num_stages

  def owner(self, microbatch: int) -> int:
    """The stage that holds ``microbatch``'s inputs."""
    return microbatch // self.per_stage

  def deliveries(self) -> np.ndarray:
    """``[T]``: replays the conveyor (sends arrive ``1 + delay`` ticks later) and returns the
    micro-batch stage 0 has in hand at each tick where it reads (-1 elsewhere); equal to
    :attr:`reads` for a correct table."""
    num_ticks, num_stages = self.source.shape
    arriving = np.full((num_ticks + 3, num_stages), -1)  # What reaches each stage at a tick.
    got = np.full(num_ticks, -1)
    for t in range(num_ticks):
      for s in range(num_stages):
        slot = self.source[t, s]
        value = s * self.per_stage + slot if slot != PASS_ON else arriving[t, s]
        if s == 0:
          got[t] = value if self.reads[t] >= 0 else -1
        else:
          arriving[t + 1 + self.delays[s - 1], s - 1] = value
    return got


def input_stream(reads, num_stages: int, num_microbatches: int,
                 delays=None) -> InputStream | None:
  """The conveyor that brings each read micro-batch to stage 0 just in time, or None where
  none can: ``M`` is not a multiple of ``S`` (a micro-batch's rows would span stages), or a read
  comes before its data could travel from the stage that holds it (e.g. ``M = S`` with delayed
  links); a caller then gathers the batch once instead.

  Args:
    reads: ``[T]``: the micro-batch stage 0 reads at each tick, or -1 (:func:`first_stage_reads`).
    num_stages: S.
    num_microbatches: M.
    delays: per link of the ring of stages, 0 or 1 extra tick (see
      :func:`tpipe.schedules.actions.link_delays`).
  """
  delays = actions_lib.link_delays(delays, num_stages)
  reads = np.asarray(reads, np.int64)
  if num_stages < 2 or num_microbatches % num_stages:
    return None
  per_stage = num_microbatches // num_stages
  travel = hop_ticks(delays)
  source = np.full((len(reads), num_stages), PASS_ON, np.int64)
  for t, m in enumerate(reads):
    if m < 0:
      continue
    owner = int(m) // per_stage
    start = t - int(travel[owner])
    if start < 0:
      return None
    source[start, owner] = int(m) % per_stage
  stream = InputStream(num_stages, num_microbatches, delays, reads, source)
  if not np.array_equal(stream.deliveries(), np.where(reads >= 0, reads, -1)):
    raise AssertionError("the conveyor table does not deliver what stage 0 reads.")
  return stream
