"""How long a fused schedule's step takes under per-action costs: three time models of one table.

* **lockstep** (SPMD): every stage waits for the slowest action of each tick, so the step is the
  sum over ticks of the most expensive action in the tick; a program whose ticks all end
  together (a barrier every tick) takes this long.
* **neighbour-synchronised**: the constraint of one SPMD program with a send to each neighbour
  per tick (:mod:`tpipe.core.fused`), as a model: a stage starts tick ``t`` when it and the
  stages it exchanges messages with (the stage before and after it, around the ring when chunks
  wrap) have finished tick ``t - 1``; no other barrier. A slow action delays its neighbours one
  tick later, theirs the tick after, so a tick's cost spreads only as far as the table lets it.
* **natural** (dependency-driven): each stage runs its actions in the table's order, each as soon
  as the stage is free and its inputs are done (no tick barrier, no transfer time); what an
  MPMD runtime could reach.

For every table ``natural <= neighbour <= lockstep``. Pure NumPy.
:meth:`tpipe.schedules.FusedSchedule.simulate` calls :func:`simulate`.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from tpipe.schedules import actions as actions_lib

Action = actions_lib.Action


@dataclasses.dataclass(frozen=True, eq=False)
class Timing:
  """Step time of a fused schedule under per-action costs (:func:`simulate`).

  Attributes:
    lockstep: SPMD step time: every stage waits for the slowest action of each tick, so it is the
      sum over ticks of the most expensive action in the tick.
    natural: dependency-driven step time: each stage runs its actions in the table's order, each
      as soon as the stage is free and its inputs are done (no tick barrier, no transfer time).
    busy: ``[S]`` total cost of the actions of each stage.
    neighbour: neighbour-synchronised step time: a stage starts each tick when it and the stages
      it exchanges messages with have finished the previous one (:func:`exchange_partners`).
  """

  lockstep: float
  natural: float
  busy: np.ndarray
  neighbour: float

  @property
  def lockstep_bubble(self) -> float:
    """Share of the stages' lockstep time spent idle or waiting for a slower stage."""
    return 1.0 - float(self.busy.sum()) / (self.busy.size * self.lockstep)

  @property
  def neighbour_bubble(self) -> float:
    """Share of the stages' neighbour-synchronised time spent idle or waiting for a neighbour."""
    return 1.0 - float(self.busy.sum()) / (self.busy.size * self.neighbour)

  @property
  def natural_bubble(self) -> float:
    """Share of the stages' natural time spent idle."""
    return 1.0 - float(self.busy.sum()) / (self.busy.size * self.natural)


def action_costs(schedule, costs: Mapping[str, float] | None = None) -> np.ndarray:
  """``[T, S]``: the cost of each table entry (0 where idle).

  Args:
    schedule: a :class:`~tpipe.schedules.FusedSchedule`.
    costs: cost of each action kind that occurs, keyed by :class:`Action` name; defaults to
      :data:`~tpipe.schedules.actions.DEFAULT_COSTS` (a backward costs two forwards, split
      evenly between ``BI`` and ``W``).

  Raises:
    ValueError: an unknown action name, a missing or negative cost.
  """
  costs = dict(actions_lib.DEFAULT_COSTS if costs is None else costs)
  unknown = set(costs) - {a.name for a in Action}
  if unknown:
    raise ValueError(f"costs has unknown actions {sorted(unknown)}; use "
                     f"{[a.name for a in Action]}.")
  per_code = np.zeros(len(Action) + 1)  # index -1 (IDLE) stays 0.
  for a in Action:
    if np.any(schedule.action == a):
      if a.name not in costs:
        raise ValueError(f"costs has no entry for {a.name!r}, which {schedule.name!r} runs.")
      if not costs[a.name] >= 0:
        raise ValueError(f"costs[{a.name!r}] must be >= 0, got {costs[a.name]!r}.")
      per_code[a] = float(costs[a.name])
  return per_code[schedule.action]


def exchange_partners(num_stages: int, wrap: bool) -> list[tuple[int, ...]]:
  """Per stage, the stages it exchanges a message with every tick: the one before and the one
  after it (the fused tick loop's two sends), around the ring when ``wrap`` (the model chunks
  wrap from the last stage to the first: more than one chunk per stage)."""
  out = []
  for s in range(num_stages):
    near = {s - 1, s + 1}
    near = {n % num_stages for n in near} if wrap else {n for n in near if 0 <= n < num_stages}
    out.append(tuple(sorted(near - {s})))
  return out


def neighbour_time(cost: np.ndarray, partners) -> float:
  """The neighbour-synchronised step time of per-entry costs ``[T, S]``: stage ``s`` starts tick
  ``t`` when it and ``partners[s]`` have finished tick ``t - 1``.

  Raises:
    ValueError: ``cost`` is not ``[T, S]``, or ``partners`` does not list one tuple of stages
      in ``range(S)`` per stage (:func:`exchange_partners` gives them).
  """
  cost = np.asarray(cost, np.float64)
  if cost.ndim != 2:
    raise ValueError(f"cost must be [ticks, stages], got shape {cost.shape}.")
  num_stages = cost.shape[1]
  if len(partners) != num_stages or any(not 0 <= p < num_stages for ps in partners for p in ps):
    raise ValueError(f"partners must list, for each of the {num_stages} stages, stages in "
                     f"range({num_stages}); got {partners!r}. Use exchange_partners(S, wrap).")
  end = np.zeros(num_stages)
  for row in cost:
    start = np.array([max([end[s]] + [end[p] for p in partners[s]]) for s in range(len(end))])
    end = start + row
  return float(end.max(initial=0.0))


def simulate(schedule, costs: Mapping[str, float] | None = None) -> Timing:
  """Step time of ``schedule`` under per-action ``costs``: lockstep, neighbour-synchronised and
  natural.

  Args:
    schedule: a :class:`~tpipe.schedules.FusedSchedule`.
    costs: see :func:`action_costs`.

  Returns:
    A :class:`Timing`.
  """
  cost = action_costs(schedule, costs)
  lockstep = float(cost.max(axis=1).sum())
  finish, stage_free = {}, np.zeros(schedule.num_stages)
  vstage = schedule.virtual_stage
  num_virtual = schedule.num_stages * schedule.num_chunks
  for t in range(schedule.num_ticks):
    for s in np.nonzero(schedule.busy[t])[0]:
      kind, m = Action(schedule.action[t, s]), int(schedule.microbatch[t, s])
      v = int(vstage[s, schedule.chunk[t, s]])
      ready = max([finish[key] for key in actions_lib.dependencies(kind, m, v, num_virtual)],
                  default=0.0)
      start = max(stage_free[s], ready)
      stage_free[s] = finish[(actions_lib.EVENT[kind], m, v)] = start + cost[t, s]
  partners = exchange_partners(schedule.num_stages, schedule.num_chunks > 1)
  return Timing(lockstep=lockstep, natural=float(stage_free.max()), busy=cost.sum(axis=0),
                neighbour=neighbour_time(cost, partners))
