"""A fused table as the rows the tick loop scans over (NumPy).

Per tick and lane (one step of a compound tick, :attr:`tpipe.schedules.FusedSchedule.lanes`),
per stage: the ``lax.switch`` branch (:func:`tick_branches`, :func:`lane_switches`), the
micro-batch, the stash, weight (:func:`weight_slots`) and mailbox slots, and where the step
sends; per tick, where arriving messages go. :mod:`tpipe.core.loops.fused` runs them.

With micro-batches overlapped (``PipelineSpec.overlap_microbatches``), a forward and a backward
of two micro-batches that a stage runs in adjacent lanes of one tick (:func:`paired`) run
together, in one conditional of their own (:func:`pair_switches`), rather than each in its lane.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tpipe import schedules

Action = schedules.Action
# The branch number of an idle entry (every lane's switch holds it).
IDLE = 0


@dataclasses.dataclass(frozen=True)
class BranchNumbers:
  """How a tick's ``lax.switch`` branches are numbered for ``num_programs`` chunk programs:
  :data:`IDLE`, then one number per action (``F``, ``B``, ``BI``, ``W``) and program,
  ``1 + action * num_programs + program``. :func:`tick_branches` makes them, the fused loop's
  branches (:mod:`tpipe.core.loops.branches`) and the FLOP reader (:mod:`tpipe.tools.flops`)
  read them.

    >>> numbers = BranchNumbers(num_programs=2)
    >>> numbers.number(Action.B, 1), numbers.decode(4), numbers.decode(IDLE)
    (4, (1, 1), None)
  """

  num_programs: int

  @property
  def size(self) -> int:
    """How many numbers there are, :data:`IDLE` included."""
    return 1 + len(Action) * self.num_programs

  def number(self, action, program):
    """The number of ``action`` of chunk program ``program`` (NumPy arrays too)."""
    return 1 + action * self.num_programs + program

  def decode(self, number: int) -> tuple[int, int] | None:
    """``(action, program)`` of ``number``, or None for :data:`IDLE`."""
    return None if number == IDLE else divmod(int(number) - 1, self.num_programs)

  def is_forward_or_idle(self, number: int) -> bool:
    """Whether ``number`` is :data:`IDLE` or an ``F``: a step that writes no gradient sum, only
    the loss (or a forward-only table's outputs). The others (``B``, ``BI``, ``W``) each run in
    a conditional of their own (:func:`lane_groups`)."""
    decoded = self.decode(number)
    return decoded is None or decoded[0] == Action.F


def paired(schedule: schedules.FusedSchedule) -> np.ndarray:
  """``[R, S]`` bool: where a row and the next row of its tick are, on that stage, a forward
  (``F``) and a backward (``B`` or ``BI``), in either order: a pair that an overlapping tick
  loop runs together, marked on its first row. A row is in one pair at most (a stage's rows pair
  from its first lane on); ``W`` and two forwards never pair.

    >>> from tpipe.schedules import compound
    >>> table = compound.build("1f1b", 2, 2, costs={"F": 1, "B": 3})
    >>> print(table.describe())
    stage 0:    F0    F1    B0    B1
    stage 1:     . F0+B0 F1+B1     .
    >>> paired(table)[table.first_rows()[1]].tolist()
    [False, True]
  """
  action, tick = schedule.action, schedule.tick
  forward = action == Action.F
  backward = np.isin(action, [Action.B, Action.BI])
  out = np.zeros(action.shape, bool)
  for r in range(schedule.num_rows - 1):
    if tick[r + 1] != tick[r]:
      continue
    taken = out[r - 1] if r > 0 and tick[r - 1] == tick[r] else np.zeros_like(out[r])
    out[r] = ((forward[r] & backward[r + 1]) | (backward[r] & forward[r + 1])) & ~taken
  return out


def in_pairs(schedule: schedules.FusedSchedule) -> np.ndarray:
  """``[R, S]`` bool: the rows of :func:`paired` pairs, first and second."""
  first = paired(schedule)
  second = np.zeros_like(first)
  second[1:] = first[:-1]
  return first | second


def pair_switches(schedule: schedules.FusedSchedule, programs) -> list[tuple[tuple[int, int], ...]]:
  """Per lane ``k``, the ``(first, second)`` :func:`tick_branches` numbers of the pairs the table
  runs in lanes ``k`` and ``k + 1`` (:func:`paired`), ascending: the conditionals an overlapping
  tick loop runs after lane ``k + 1`` (none for the last lane)."""
  branch = by_lanes(schedule, tick_branches(schedule, programs)[0])
  first = by_lanes(schedule, paired(schedule), fill=False)
  out = []
  for lane in range(schedule.lanes):
    if lane + 1 == schedule.lanes:
      out.append(())
      continue
    on = first[:, lane]
    out.append(tuple(sorted({(int(a), int(b)) for a, b in
                             zip(branch[:, lane][on], branch[:, lane + 1][on])})))
  return out


def weight_slots(schedule: schedules.FusedSchedule) -> np.ndarray:
  """``[R, S]``: the weight slot each ``BI`` fills and its ``W`` empties (0 elsewhere).

  A slot is taken from ``BI`` to ``W``, both ticks included, and reused from the next tick; each
  stage uses as many slots as its most micro-batches awaiting ``W``
  (:meth:`~tpipe.schedules.FusedSchedule.awaiting_weight`).
  """
  slots = np.zeros(schedule.action.shape, np.int32)
  for s in range(schedule.num_stages):
    held: dict[tuple[int, int], int] = {}
    for t in range(schedule.num_rows):
      key = (int(schedule.microbatch[t, s]), int(schedule.chunk[t, s]))
      if schedule.action[t, s] == Action.BI:
        busy = set(held.values())
        slots[t, s] = held[key] = min(k for k in range(len(busy) + 1) if k not in busy)
      elif schedule.action[t, s] == Action.W:
        slots[t, s] = held.pop(key)
  return slots


def tick_branches(schedule: schedules.FusedSchedule, programs) -> tuple[np.ndarray, np.ndarray]:
  """``([R, S] branch, [R, S] model chunk)``: the ``lax.switch`` branch of every table entry
  (its :class:`BranchNumbers` number, ``programs[v]`` being model chunk ``v``'s program) and
  its model chunk."""
  vstage = schedule.virtual_stage
  v = vstage[np.arange(schedule.num_stages)[None, :], np.maximum(schedule.chunk, 0)]
  program = np.asarray(programs, np.int64)[v]
  numbers = BranchNumbers(int(max(programs)) + 1)
  branch = np.where(schedule.action >= 0,
                    numbers.number(schedule.action.astype(np.int64), program), IDLE)
  return branch.astype(np.int32), v.astype(np.int32)


def lane_switches(schedule: schedules.FusedSchedule, programs,
                  overlap: bool = False) -> list[tuple[int, ...]]:
  """Per lane (:func:`by_lanes`), the :func:`tick_branches` numbers its ``lax.switch`` holds,
  ascending: :data:`IDLE` and the branches the table runs in that lane, on any tick and stage. A
  branch no entry of the lane runs is left out of its switch (a split backward's table never
  runs ``B``; a compound tick's lanes each run a few kinds), so the program compiles only what
  the table runs. With ``overlap``, the rows of pairs (:func:`paired`) run in the pairs'
  conditionals (:func:`pair_switches`), not in their lanes' switches."""
  return _switches(by_lanes(schedule, _lone_branches(schedule, programs, overlap)))


def _lone_branches(schedule, programs, overlap: bool) -> np.ndarray:
  """``[R, S]``: the :func:`tick_branches` numbers each lane's switch runs: :data:`IDLE` for the
  rows of pairs where ``overlap``."""
  branch, _ = tick_branches(schedule, programs)
  return np.where(in_pairs(schedule), IDLE, branch).astype(np.int32) if overlap else branch


def lane_groups(writes_sums) -> tuple[list[int], list[int]]:
  """``(together, apart)``: how a lane runs the branches of its switch (:func:`lane_switches`),
  given per position whether the branch writes the running gradient sums (a backward: ``B``,
  ``BI`` or ``W``). ``together`` (idle, position 0, and the forwards) share one
  ``lax.switch``, which never holds the sums; each of ``apart`` runs in a two-way conditional
  of its own after it (false: pass through; true: the branch), in order. XLA copies the sums
  wherever a conditional holds them in more than one branch: in every forward that passes them
  through beside a backward, in and out of every iteration of two backwards' loops over units,
  and in every branch of two backwards side by side (the per-micro-batch gradient of the
  inputs, sized by M, included)."""
  writes_sums = [bool(flag) for flag in writes_sums]
  apart = [p for p, flag in enumerate(writes_sums) if flag]
  return [p for p in range(len(writes_sums)) if p not in apart], apart


def _switches(branch: np.ndarray) -> list[tuple[int, ...]]:
  """:func:`lane_switches` of the ``[T, L, S]`` branch numbers :func:`by_lanes` gives."""
  return [tuple(int(b) for b in np.union1d([IDLE], branch[:, lane]))
          for lane in range(branch.shape[1])]


def by_lanes(schedule: schedules.FusedSchedule, table: np.ndarray, fill=0) -> np.ndarray:
  """A per-row table ``[R, S, ...]`` as ``[T, L, S, ...]``: each tick's rows in its lanes (the
  steps the loop runs in a tick), a tick with fewer rows than :attr:`lanes` padded with
  ``fill`` (an idle step)."""
  table = np.asarray(table)
  lane = np.arange(schedule.num_rows) - schedule.first_rows()[schedule.tick]
  out = np.full((schedule.num_ticks, schedule.lanes) + table.shape[1:], fill, table.dtype)
  out[schedule.tick, lane] = table
  return out


def tick_rows(schedule: schedules.FusedSchedule, branch_of_chunk, overlap: bool = False) -> dict:
  """The per-tick rows the scan consumes: ``lanes``, each ``[T, L, S]`` (one step of a tick per
  lane, see :func:`by_lanes`; ``branch`` is the position in the lane's switch of the
  :func:`tick_branches` number, :func:`lane_switches`; ``branch_of_chunk`` is the chunk program
  of each model chunk; with ``overlap``, ``pair`` is 0, or on the first lane of a pair 1 + its
  position in that lane's :func:`pair_switches`), and ``arrival``, ``[T, S, 3]``."""
  every, v = tick_branches(schedule, branch_of_chunk)
  branch = by_lanes(schedule, _lone_branches(schedule, branch_of_chunk, overlap))
  for lane, numbers in enumerate(_switches(branch)):  # Each lane's position in its switch.
    branch[:, lane] = np.searchsorted(numbers, branch[:, lane])
  lanes = {
      "chunk": v,
      "microbatch": np.maximum(schedule.microbatch, 0),
      "stash": np.maximum(schedule.stash_slot, 0),
      "forward": (schedule.action == Action.F),
      "send_dir": schedule.send_dir,
      "sends": schedule.send_slot != schedules.IDLE,
      "send_slot": np.maximum(schedule.send_slot, 0),
      "recv_slot": np.maximum(schedule.recv_slot, 0),
      "weight_slot": weight_slots(schedule),
  }
  lanes = {key: by_lanes(schedule, value) for key, value in lanes.items()}
  lanes["branch"] = branch
  if overlap:
    pair = np.zeros(branch.shape, np.int32)
    first = by_lanes(schedule, paired(schedule), fill=False)
    every = by_lanes(schedule, every)
    for lane, pairs in enumerate(pair_switches(schedule, branch_of_chunk)):
      for position, (a, b) in enumerate(pairs):
        here = first[:, lane] & (every[:, lane] == a) & (every[:, lane + 1] == b)
        pair[:, lane][here] = 1 + position
    lanes["pair"] = pair
  return {"lanes": lanes, "arrival": schedule.arrival_slots()[schedule.first_rows()]}
