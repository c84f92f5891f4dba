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
    exposed_by: per action kind, the part of its seconds spent waiting for collectives, by
      ``(kind, mesh axes)`` as :attr:`tpipe.tools.step_time.StepTime.exposed_by` keys it (the
      mean over the model chunks, as ``actions``).
  """

  actions: dict[str, float]
  outside: float
  lockstep: float
  tick_loop: str
  exposed_by: dict = dataclasses.field(default_factory=dict)


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
  conditionals = flops_lib.tick_conditionals(module, loop.body)
  layout = flops_lib.lane_layout(schedule, programs, conditionals)
  cost, busiest = flops_lib.branch_costs(schedule, programs, conditionals, layout,
                                         lambda name: pricer.computation(name).seconds)

  def per_action(branch_cost):  # Each action kind the table runs: its mean over the chunks.
    out = {}
    for k, kind in enumerate(("F", "B", "BI", "W")):
      per_chunk = branch_cost[1 + k * count + np.asarray(programs)]
      if np.all(np.isfinite(per_chunk)):
        out[kind] = float(np.mean(per_chunk))
    return out

  actions = per_action(cost)
  outside = lockstep - loop.outer * schedule.num_ticks * busiest
  exposed_by = {kind: {} for kind in actions}
  for key in pricer.exposed_keys():
    wait = lambda name, key=key: pricer.computation(name).exposed_by.get(key, 0.0)
    waits, _ = flops_lib.branch_costs(schedule, programs, conditionals, layout, wait)
    for kind, seconds in per_action(waits).items():
      if seconds:
        exposed_by[kind][key] = seconds
  return ActionSeconds(actions=actions, outside=outside, lockstep=lockstep,
                       tick_loop=found.tick_loop, exposed_by=exposed_by)


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
    exposed_by: the mean stage's actions' collective waits per step, by ``(kind, mesh axes)``:
      each action kind's (:attr:`ActionSeconds.exposed_by`) times the micro-batches and chunks
      per stage that run it (for example a mixture of experts' exchange,
      ``exposed_by[("all-to-all", ("expert",))]``); waits outside the actions are not in it.
  """

  seconds: float
  busy: float
  bubble: float
  outside: float
  lockstep: float
  actions: dict
  exposed_by: dict = dataclasses.field(default_factory=dict)


def pipeline_step_time(hlo, schedule, chip_="v5p", *, programs=None, mesh=None,
                       axis_links: Mapping[str, str] | None = None) -> PipelineTime:
  """A fused schedule's step time with its bubble: :func:`fused_action_seconds` fed to the
  schedule's neighbour-synchronised simulation (:meth:`tpipe.schedules.FusedSchedule.simulate`),
  plus the time outside the actions. Arguments as for :func:`fused_action_seconds`."""
  priced = fused_action_seconds(hlo, schedule, chip_, programs=programs, mesh=mesh,
                                axis_links=axis_links)
  timing = schedule.simulate(priced.actions)
  busy = float(np.mean(timing.busy))
  runs = schedule.num_microbatches * schedule.num_chunks  # Each action kind's, per stage.
  exposed_by = {}
  for waits in priced.exposed_by.values():
    for key, seconds in waits.items():
      exposed_by[key] = exposed_by.get(key, 0.0) + runs * seconds
  return PipelineTime(seconds=timing.neighbour + priced.outside, busy=busy,
                      bubble=timing.neighbour - busy, outside=priced.outside,
                      lockstep=priced.lockstep, actions=dict(priced.actions),
                      exposed_by=exposed_by)
