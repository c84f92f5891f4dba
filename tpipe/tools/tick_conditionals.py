"""Which branch of a compiled fused tick loop runs which action: the tick loop's conditionals
read against the table (NumPy over HLO text).

The fused tick loop (:mod:`tpipe.core.loops.fused`) runs each lane of a tick as a switch of the
forwards and idle, then each backward in a two-way conditional of its own; with micro-batches
overlapped, each pair of a forward and a backward in a two-way conditional after its second
lane. :func:`lane_layout` matches a loop's conditionals (:func:`tick_conditionals`) to that
layout, and :func:`branch_costs` reads each action's (and pair's) cost from them, for any cost
of a branch computation: FLOPs (:func:`tpipe.tools.flops.fused_flops`) or seconds
(:func:`tpipe.tools.pipeline_time.fused_action_seconds`).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from tpipe import schedules as schedules_lib
from tpipe.core.loops import tick_rows
from tpipe.tools import hlo as hlo_lib


def _branch_names(conditional) -> list[str]:
  """A ``conditional``'s branch computations by index (a predicated one's: false, then true)."""
  listed = conditional.attr("branch_computations")
  if listed is None:
    listed = ",".join(conditional.attr(k) or "" for k in ("false_computation", "true_computation"))
  return [n.strip().lstrip("%") for n in listed.strip("{}").split(",") if n.strip()]


def tick_conditionals(module: hlo_lib.HloModule, body: str) -> list[list[str]]:
  """The branch computations of each conditional in a tick loop's ``body``, the conditionals in
  the order the program made them: by their names' numbers (``conditional.8`` before
  ``conditional.9``) where every name has one, else as printed. A scheduled module prints the
  order they run in, and the TPU compiler runs independent lanes' conditionals in any order (a
  one-stage table's backward before its forward), while the lanes meet the conditionals in the
  order the tick body makes them."""
  instructions = [i for i in module.computations[body].instructions if i.opcode == "conditional"]
  numbers = [re.search(r"\.(\d+)$", ins.name) for ins in instructions]
  if all(numbers):
    instructions = [ins for _, ins in sorted(zip((int(n.group(1)) for n in numbers),
                                                 instructions), key=lambda pair: pair[0])]
  return [_branch_names(ins) for ins in instructions]


class LaneConditionals(NamedTuple):
  """How one lane of a tick loop runs its branches (:func:`lane_layout`): ``numbers``, the
  branch numbers of its switch (:func:`tpipe.core.loops.tick_rows.lane_switches`); ``together``
  and ``apart``, positions in it run in one switch and each in a two-way conditional of its own
  (:func:`tpipe.core.loops.tick_rows.lane_groups`); ``pairs``, the ``(first, second)`` branch
  numbers of the pairs run with the lane before it, each in a two-way conditional of its own
  after the lane's (micro-batches overlapped, :func:`tpipe.core.loops.tick_rows.pair_switches`)."""

  numbers: tuple
  together: list
  apart: list
  pairs: tuple = ()


def _lane_layouts(schedule, programs, overlap: bool | None = None) -> list:
  """The ways the lanes of ``schedule``'s compound ticks may split into conditionals (a list of
  :class:`LaneConditionals` per lane): every branch in one switch (a tick program written as one
  ``lax.switch``); the fused loop's, where idle and the forwards share a switch and each
  backward (``B``, ``BI``, ``W``) runs in a two-way conditional of its own after it; and, where
  ``overlap`` is not False and the table pairs actions, the fused loop's with micro-batches
  overlapped. ``overlap`` True keeps only that one."""
  count = max(programs) + 1
  backward = lambda n: n > 0 and (n - 1) // count != schedules_lib.Action.F
  layouts = []
  if not overlap:
    switches = tick_rows.lane_switches(schedule, programs)
    layouts += [[LaneConditionals(numbers, *tick_rows.lane_groups([flag(n) for n in numbers]))
                 for numbers in switches] for flag in (lambda n: False, backward)]
  pairs = tick_rows.pair_switches(schedule, programs)
  if overlap is not False and any(pairs):
    switches = tick_rows.lane_switches(schedule, programs, overlap=True)
    layouts.append([LaneConditionals(numbers,
                                     *tick_rows.lane_groups([backward(n) for n in numbers]),
                                     pairs[lane - 1] if lane else ())
                    for lane, numbers in enumerate(switches)])
  return layouts


def _branch_counts(layout) -> list[int]:
  """The branches of each conditional ``layout`` makes, in order (a switch left with idle alone
  is no conditional: ``lax.switch`` calls a lone branch)."""
  return [size for lane in layout
          for size in ([len(lane.together)] * (len(lane.together) > 1)
                       + [2] * (len(lane.apart) + len(lane.pairs)))]


def expected_counts(schedule, programs, overlap: bool | None = None) -> list[int]:
  """The branches of each conditional of the first layout :func:`lane_layout` tries (for an
  error message: what a tick loop of ``schedule`` would hold)."""
  return _branch_counts(_lane_layouts(schedule, programs, overlap)[0])


def lane_layout(schedule, programs, conditionals, overlap: bool | None = None):
  """How the lanes of ``schedule``'s compound ticks split into ``conditionals`` (the branch
  names of each, :func:`tick_conditionals`), of the ways they may (:func:`_lane_layouts`), or
  None when none fits."""
  counts = [len(names) for names in conditionals]
  return next((layout for layout in _lane_layouts(schedule, programs, overlap)
               if _branch_counts(layout) == counts), None)


class BranchCosts(NamedTuple):
  """What :func:`branch_costs` reads: ``actions``, each branch number's cost (NaN for a branch
  no lane holds); ``pairs``, each pair's ``(first, second)`` numbers to its cost (micro-batches
  overlapped); ``busiest``, the busiest tick's cost above the idle branches."""

  actions: np.ndarray
  pairs: dict
  busiest: float


def branch_costs(schedule, programs, conditionals, layout, cost) -> BranchCosts:
  """Each branch number's cost (:class:`tpipe.core.loops.tick_rows.BranchNumbers`), ``cost(branch
  computation name)`` less its lane's idle branch (for a conditional run apart, less its other
  branch, which passes the sums through), and each pair's likewise. And the busiest tick's cost
  above the idle branches: what a conditional's costliest branch adds on every trip."""
  action_cost, busiest = np.full(tick_rows.BranchNumbers(max(programs) + 1).size, np.nan), 0.0
  pair_cost = {}
  conditionals = iter(conditionals)
  for lane in layout:
    numbers = lane.numbers
    if len(lane.together) > 1:
      each = np.array([cost(n) for n in next(conditionals)])
      busiest += float(each.max() - each[0])
      action_cost[[numbers[p] for p in lane.together]] = each - each[0]
    for p in lane.apart:  # lax.cond's branches: false (pass through), then true.
      passing, running = (cost(n) for n in next(conditionals))
      busiest += max(running, passing) - passing
      action_cost[numbers[p]] = running - passing
    for pair in lane.pairs:
      passing, running = (cost(n) for n in next(conditionals))
      busiest += max(running, passing) - passing
      pair_cost[pair] = running - passing
  return BranchCosts(action_cost, pair_cost, busiest)


def pair_row_costs(schedule, table, row_costs, pairs: dict) -> np.ndarray:
  """``row_costs`` (``[R, S]``) with each pair of :func:`tpipe.core.loops.tick_rows.paired`
  costing ``pairs[(first, second)]`` (its rows' ``table`` numbers) on its first row and nothing
  on its second: the per-row costs of a tick loop whose micro-batches overlap."""
  first = tick_rows.paired(schedule)
  out = np.array(row_costs, np.float64)
  for r, s in zip(*np.nonzero(first)):
    out[r, s] = pairs[(int(table[r, s]), int(table[r + 1, s]))]
    out[r + 1, s] = 0.0
  return out
