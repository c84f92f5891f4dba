"""How long a fused schedule's step takes under per-action costs: lockstep and dependency-driven.

Two time models of one table:

* **lockstep** (SPMD): every stage waits for the slowest action of each tick, so the step is the
  sum over ticks of the most expensive action in the tick; this is what one SPMD program whose
  ticks end together takes.
* **natural** (dependency-driven): each stage runs its actions in the table's order, each as soon
  as the stage is free and its inputs are done (no tick barrier, no transfer time).

Pure NumPy. :meth:`tpipe.schedules.FusedSchedule.simulate` calls :func:`simulate`.
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
  """

  lockstep: float
  natural: float
  busy: np.ndarray

  @property
  def lockstep_bubble(self) -> float:
    """Share of the stages' lockstep time spent idle or waiting for a slower stage."""
    return 1.0 - float(self.busy.sum()) / (self.busy.size * self.lockstep)

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


def simulate(schedule, costs: Mapping[str, float] | None = None) -> Timing:
  """Step time of ``schedule`` under per-action ``costs``, lockstep and natural.

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
  return Timing(lockstep=lockstep, natural=float(stage_free.max()), busy=cost.sum(axis=0))
