"""A pipelined step priced tick by tick: each action of a fused schedule's compiled tick loop
priced as :func:`tpipe.tools.step_time.estimate` prices a program, then the table followed as the
neighbour-synchronised simulation follows it (:meth:`tpipe.schedules.FusedSchedule.simulate`),
so the bubble is counted.

Each tick a device runs one branch of a conditional: idle, or an action (``F``, ``B``, ``BI``,
``W``) of a chunk program, as :func:`tpipe.tools.flops.fused_flops` reads them. An action's
seconds are its branch's less the idle branch's; the program's time outside the actions (each
tick's routing, the sums after the loop, the optimizer) is added to the simulated step. Where
micro-batches overlap (``PipelineSpec.overlap_microbatches``), a forward and a backward a stage
runs in one tick run in one conditional: the pair is priced as one branch (its collectives
overlapped with both actions' work where the program overlaps them), in the ticks that pair.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from tpipe import schedules as schedules_lib
from tpipe.core.loops import tick_rows
from tpipe.experimental import links as links_lib
from tpipe.schedules import simulate as simulate_lib
from tpipe.tools import flops as flops_lib
from tpipe.tools import hlo as hlo_lib
from tpipe.tools import step_time
from tpipe.tools import tick_conditionals as conditionals_lib
from tpipe.tools.trip_counts import with_trip_counts

Action = schedules_lib.Action


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
    pairs: micro-batches overlapped: per pair of action kinds in the order a tick runs them
      (``"F+B"``, ``"BI+F"``), the mean seconds of the two run in one conditional; empty
      otherwise. ``exposed_by`` holds their waits under the same keys.
  """

  actions: dict[str, float]
  outside: float
  lockstep: float
  tick_loop: str
  exposed_by: dict = dataclasses.field(default_factory=dict)
  pairs: dict[str, float] = dataclasses.field(default_factory=dict)


def _pair_kind(first: int, second: int, count: int) -> str:
  """``"F+B"``: the action kinds of two branch numbers of ``count`` chunk programs."""
  numbers = tick_rows.BranchNumbers(count)
  return "+".join(Action(numbers.decode(n)[0]).name for n in (first, second))


def fused_action_seconds(hlo, schedule, chip_="v5p", *, programs=None, mesh=None,
                         axis_links: Mapping[str, str] | None = None,
                         overlap: bool | None = None) -> ActionSeconds:
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
    overlap: whether the step overlaps micro-batches (``PipelineSpec.overlap_microbatches``);
      None: whichever layout of conditionals the tick loop has
      (:func:`tpipe.tools.tick_conditionals.lane_layout`).

  Raises:
    ValueError: no tick loop matching the schedule.
  """

  module = with_trip_counts(hlo_lib.module_of(hlo))
  # Finds and checks the tick loop.
  found = flops_lib.fused_flops(module, schedule, programs, overlap=overlap)
  spec = step_time.chip(chip_)
  if mesh is not None and axis_links is None:
    axis_links = links_lib.axis_links(mesh)
  pricer = step_time._Pricer(module, spec, mesh, axis_links)  # pylint: disable=protected-access
  lockstep = pricer.computation(module.entry).seconds
  loop = next(lp for lp in module.loops() if lp.instruction.name == found.tick_loop)
  programs = (list(range(schedule.num_stages * schedule.num_chunks)) if programs is None
              else list(programs))
  count = max(programs) + 1
  conditionals = conditionals_lib.tick_conditionals(module, loop.body)
  layout = conditionals_lib.lane_layout(schedule, programs, conditionals, overlap)
  priced = conditionals_lib.branch_costs(schedule, programs, conditionals, layout,
                                         lambda name: pricer.computation(name).seconds)

  # Each action kind, and each pair of kinds: its mean over the chunk programs.
  def per_action(costs: conditionals_lib.BranchCosts):
    out = {}
    for k, kind in enumerate(("F", "B", "BI", "W")):
      per_chunk = costs.actions[1 + k * count + np.asarray(programs)]
      # The chunks that run it alone (all of them, unless some run it only in pairs).
      if np.any(np.isfinite(per_chunk)):
        out[kind] = float(np.mean(per_chunk[np.isfinite(per_chunk)]))
    return out

  def per_pair(costs: conditionals_lib.BranchCosts):
    kinds = {}
    for (first, second), seconds in costs.pairs.items():
      kinds.setdefault(_pair_kind(first, second, count), []).append(seconds)
    return {kind: float(np.mean(each)) for kind, each in kinds.items()}

  actions, pairs = per_action(priced), per_pair(priced)
  outside = lockstep - loop.outer * schedule.num_ticks * priced.busiest
  exposed_by = {kind: {} for kind in [*actions, *pairs]}
  for key in pricer.exposed_keys():
    wait = lambda name, key=key: pricer.computation(name).exposed_by.get(key, 0.0)
    waits = conditionals_lib.branch_costs(schedule, programs, conditionals, layout, wait)
    for kind, seconds in [*per_action(waits).items(), *per_pair(waits).items()]:
      if seconds:
        exposed_by[kind][key] = seconds
  return ActionSeconds(actions=actions, outside=outside, lockstep=lockstep,
                       tick_loop=found.tick_loop, exposed_by=exposed_by, pairs=pairs)


def row_seconds(schedule, priced: ActionSeconds) -> np.ndarray:
  """``[R, S]``: each table entry's seconds under ``priced``: its action kind's, or, micro-batches
  overlapped, a pair's (:func:`tpipe.core.loops.tick_rows.paired`) on its first row and none on
  its second."""
  seconds = simulate_lib.action_costs(schedule, priced.actions) if priced.actions else np.zeros(
      schedule.action.shape)
  if not priced.pairs:
    return seconds
  by_actions = {tuple(int(Action[name]) for name in kinds.split("+")): pair_seconds
                for kinds, pair_seconds in priced.pairs.items()}
  return conditionals_lib.pair_row_costs(schedule, schedule.action, seconds, by_actions)


def _kind_pair(schedule, r: int, s: int) -> str:
  return "+".join(Action(int(schedule.action[q, s])).name for q in (r, r + 1))


def _runs_per_stage(schedule, overlapped: bool) -> dict[str, float]:
  """Per action kind (and, micro-batches ``overlapped``, per pair of kinds), how many times the
  mean stage runs it alone (or paired) in a step."""
  in_pair = np.zeros(schedule.action.shape, bool)
  runs: dict[str, float] = {}
  if overlapped:
    in_pair = tick_rows.in_pairs(schedule)
    for r, s in zip(*np.nonzero(tick_rows.paired(schedule))):
      kind = _kind_pair(schedule, r, s)
      runs[kind] = runs.get(kind, 0.0) + 1.0 / schedule.num_stages
  for action in Action:
    alone = (schedule.action == action) & ~in_pair
    runs[action.name] = float(alone.sum()) / schedule.num_stages
  return runs


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
                       axis_links: Mapping[str, str] | None = None,
                       overlap: bool | None = None) -> PipelineTime:
  """A fused schedule's step time with its bubble: :func:`fused_action_seconds` fed to the
  schedule's neighbour-synchronised simulation (:meth:`tpipe.schedules.FusedSchedule.simulate`;
  with micro-batches overlapped, each entry's seconds from :func:`row_seconds`), plus the time
  outside the actions. Arguments as for :func:`fused_action_seconds`."""
  priced = fused_action_seconds(hlo, schedule, chip_, programs=programs, mesh=mesh,
                                axis_links=axis_links, overlap=overlap)
  if priced.pairs:
    per_tick = np.zeros((schedule.num_ticks, schedule.num_stages))
    np.add.at(per_tick, schedule.tick, row_seconds(schedule, priced))
    links = simulate_lib.ring_links(schedule.num_stages, schedule.num_chunks > 1)
    neighbour = simulate_lib.linked_time(per_tick, links, None, schedule.delays)
    busy = float(np.mean(per_tick.sum(axis=0)))
  else:
    timing = schedule.simulate(priced.actions)
    neighbour, busy = timing.neighbour, float(np.mean(timing.busy))
  runs = _runs_per_stage(schedule, bool(priced.pairs))
  exposed_by = {}
  for kind, waits in priced.exposed_by.items():
    for key, seconds in waits.items():
      exposed_by[key] = exposed_by.get(key, 0.0) + runs.get(kind, 0.0) * seconds
  return PipelineTime(seconds=neighbour + priced.outside, busy=busy,
                      bubble=neighbour - busy, outside=priced.outside,
                      lockstep=priced.lockstep, actions=dict(priced.actions, **priced.pairs),
                      exposed_by=exposed_by)
