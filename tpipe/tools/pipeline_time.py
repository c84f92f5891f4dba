"""A pipelined step priced tick by tick: each action of a fused schedule's compiled tick loop
priced as :func:`tpipe.tools.step_time.estimate` prices a program, then the table followed as the
neighbour-synchronised simulation follows it (:meth:`tpipe.schedules.FusedSchedule.simulate`),
so the bubble is counted.

Each tick a device runs one branch of a conditional: idle, or an action (``F``, ``B``, ``BI``,
``W``) of a chunk program, as :func:`tpipe.tools.flops.fused_flops` reads them. An action's
seconds are its branch's less the idle branch's; the program's time outside the actions (each
tick's routing, the sums after the loop, the optimizer) is added to the simulated step.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping

import numpy as np

from tpipe.experimental import links as links_lib
from tpipe.tools import flops as flops_lib
from tpipe.tools import hlo as hlo_lib
from tpipe.tools import step_time
from tpipe.tools.trip_counts import with_trip_counts


@dataclasses.dataclass(frozen=True)
class ActionSeconds:
  """Seconds of a fused schedule's actions, read from the branches of its compiled tick loop.

  Attributes:
    actions: per action kind (``F``, ``B``, ``BI``, ``W``), the mean seconds of one such action
      over the model chunks (what :meth:`tpipe.schedules.FusedSchedule.simulate` takes).
    outside: seconds per step outside the actions (each tick's routing, the sums after the
      loop, the optimizer).
    lockstep: the program's own time (:func:`tpipe.tools.step_time.estimate`: each tick as
      long as its slowest branch).
    tick_loop: the tick loop's ``while`` instruction.
  """

  actions: dict[str, float]
  outside: float
  lockstep: float
  tick_loop: str


def fused_action_seconds(hlo, schedule, chip_="v5p", *, programs=None, mesh=None,
                         axis_links: Mapping[str, str] | None = None) -> ActionSeconds:
  """Each action of a fused schedule's step priced as :func:`tpipe.tools.step_time.estimate`
  prices a program.

  The tick loop's conditionals hold one branch per action the table runs (idle first), as
  :func:`tpipe.tools.flops.fused_flops` reads them; an action's seconds are its branch's less
  the idle branch's (for an action run apart in a two-way conditional: less the branch passing
  the sums through).

  Args:
    hlo: the compiled step (or its HLO text) of a stack run with ``schedule``.
    schedule: the :class:`tpipe.schedules.FusedSchedule` it runs.
    chip_, mesh, axis_links: as for :func:`tpipe.tools.step_time.estimate`.
    programs: per model chunk, its chunk program (default one per model chunk).

  Raises:
    ValueError: no tick loop matching the schedule.
  """
  from tpipe import schedules as schedules_lib  # pylint: disable=g-import-not-at-top
  from tpipe.core import tick_rows  # pylint: disable=g-import-not-at-top

  module = with_trip_counts(hlo_lib.module_of(hlo))
  found = flops_lib.fused_flops(module, schedule, programs)  # Finds and checks the tick loop.
  spec = step_time.chip(chip_)
  if mesh is not None and axis_links is None:
    axis_links = links_lib.axis_links(mesh)
  pricer = step_time._Pricer(module, spec, mesh, axis_links)  # pylint: disable=protected-access
  lockstep = pricer.computation(module.entry).seconds
  loop = next(lp for lp in module.loops() if lp.instruction.name == found.tick_loop)
  programs = (list(range(schedule.num_stages * schedule.num_chunks)) if programs is None
              else list(programs))
  count = max(programs) + 1
  switches = tick_rows.lane_switches(schedule, programs)
  adding = lambda n: n > 0 and (n - 1) // count in (schedules_lib.Action.B,
                                                    schedules_lib.Action.W)
  conditionals = [flops_lib._branch_names(ins)  # pylint: disable=protected-access
                  for ins in _in_creation_order(
                      [i for i in module.computations[loop.body].instructions
                       if i.opcode == "conditional"])]
  sizes = lambda layout: [size for together, apart in layout
                          for size in [len(together)] * (len(together) > 1) + [2] * len(apart)]
  layout = None
  for flag in (lambda n: False, adding):
    candidate = [tick_rows.lane_groups([flag(n) for n in numbers]) for numbers in switches]
    if layout is None and [len(c) for c in conditionals] == sizes(candidate):
      layout = candidate
  seconds = lambda n: pricer.computation(n).seconds
  cost = np.full(1 + 4 * count, np.nan)
  busiest = 0.0
  branches = iter(conditionals)
  for numbers, (together, apart) in zip(switches, layout):
    if len(together) > 1:
      each = np.array([seconds(n) for n in next(branches)])
      busiest += float(each.max() - each[0])
      cost[[numbers[p] for p in together]] = each - each[0]
    for p in apart:
      passing, running = (seconds(n) for n in next(branches))
      busiest += max(running, passing) - passing
      cost[numbers[p]] = running - passing
  actions = {}
  for k, kind in enumerate(("F", "B", "BI", "W")):
    per_chunk = cost[1 + k * count + np.asarray(programs)]
    if np.all(np.isfinite(per_chunk)):
      actions[kind] = float(np.mean(per_chunk))
  outside = lockstep - loop.outer * schedule.num_ticks * busiest
  return ActionSeconds(actions=actions, outside=outside, lockstep=lockstep,
                       tick_loop=found.tick_loop)


def _in_creation_order(instructions):
  """Instructions in the order the program made them: by their names' numbers (``conditional.8``
  before ``conditional.9``) where every name has one, else as printed. A scheduled module prints
  the order they run in, and the TPU compiler runs independent lanes' conditionals in any order
  (a one-stage table's backward before its forward), while the lanes are matched to the
  conditionals in the order the tick body makes them."""
  numbers = [re.search(r"\.(\d+)$", ins.name) for ins in instructions]
  if not all(numbers):
    return instructions
  return [ins for _, ins in sorted(zip((int(n.group(1)) for n in numbers), instructions),
                                   key=lambda pair: pair[0])]


@dataclasses.dataclass(frozen=True)
class PipelineTime:
  """A pipelined step followed tick by tick (:func:`pipeline_step_time`).

  Attributes:
    seconds: the step: the table's neighbour-synchronised time under the actions' seconds, plus
      what runs outside them.
    busy: the mean stage's actions' seconds.
    bubble: ``seconds - outside - busy``: the mean stage's idle and waiting time.
    outside: seconds outside the actions.
    lockstep: the program's time with every tick as long as its slowest branch.
    actions: the per-action seconds used.
  """

  seconds: float
  busy: float
  bubble: float
  outside: float
  lockstep: float
  actions: dict


def pipeline_step_time(hlo, schedule, chip_="v5p", *, programs=None, mesh=None,
                       axis_links: Mapping[str, str] | None = None) -> PipelineTime:
  """A fused schedule's step time with its bubble: :func:`fused_action_seconds` fed to the
  schedule's neighbour-synchronised simulation (:meth:`tpipe.schedules.FusedSchedule.simulate`),
  plus the time outside the actions. Arguments as for :func:`fused_action_seconds`."""
  priced = fused_action_seconds(hlo, schedule, chip_, programs=programs, mesh=mesh,
                                axis_links=axis_links)
  timing = schedule.simulate(priced.actions)
  busy = float(np.mean(timing.busy))
  return PipelineTime(seconds=timing.neighbour + priced.outside, busy=busy,
                      bubble=timing.neighbour - busy, outside=priced.outside,
                      lockstep=priced.lockstep, actions=dict(priced.actions))
