"""How long a fused schedule's step takes under per-action costs: three time models of one table.

* **lockstep** (SPMD): every stage waits for the slowest stage of each tick, so the step is the
  sum over ticks of the costliest stage's work in the tick (its one action, or a compound
  tick's actions together); a program whose ticks all end together (a barrier every tick) takes
  this long.
* **neighbour-synchronised**: the constraint of one SPMD program with a send to each neighbour
  per tick (:mod:`tpipe.core.loops.fused`), as a model: a stage starts tick ``t`` when it and the
  stages it exchanges messages with (the stage before and after it, around the ring when chunks
  wrap) have finished tick ``t - 1``; no other barrier. A slow action delays its neighbours one
  tick later, theirs the tick after, so a tick's cost spreads only as far as the table lets it.
  With transfer times per link (:func:`linked_time`), the exchange after tick ``t - 1`` also
  takes its link's transfer time; over a delayed link the exchange runs during tick ``t - 1``
  (it carries the tick before's message), from when both stages started that tick, so it
  overlaps their compute and only what exceeds the tick shows.
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
      it exchanges messages with have finished the previous one (:func:`exchange_partners`),
      and the messages have crossed their links (:func:`linked_time`; instant unless
      :func:`simulate` is given transfer times).
    exposed_transfer: how much of ``neighbour`` is transfer time: ``neighbour`` less the same
      model with instant transfers (0 without transfer times).
  """

  lockstep: float
  natural: float
  busy: np.ndarray
  neighbour: float
  exposed_transfer: float = 0.0

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
  """``[R, S]``: the cost of each table entry (0 where idle).

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


def tick_costs(schedule, costs: Mapping[str, float] | None = None) -> np.ndarray:
  """``[T, S]``: each stage's cost in each tick: its rows' :func:`action_costs` summed (the
  same thing where no tick is compound)."""
  per_row = action_costs(schedule, costs)
  out = np.zeros((schedule.num_ticks, schedule.num_stages))
  np.add.at(out, schedule.tick, per_row)
  return out


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


def ring_links(num_stages: int, wrap: bool) -> tuple[int, ...]:
  """The links of the ring of stages a tick loop sends over: ``0 .. S - 2`` (link ``l`` joins
  stage ``l`` to ``l + 1``), and the closing link ``S - 1`` when chunks wrap round."""
  if num_stages == 1:
    return ()
  return tuple(range(num_stages if wrap else num_stages - 1))


def linked_time(cost: np.ndarray, links, transfer=None, delays=None) -> float:
  """Neighbour-synchronised step time of per-entry costs ``[T, S]`` with a transfer time per link.

  Stage ``s`` starts tick ``t`` when it finished tick ``t - 1`` and, for each of its ``links``,
  the exchange that tick ``t`` reads is done: after tick ``t - 1`` ends on both sides plus the
  link's transfer time; over a delayed link, from when both sides *started* tick ``t - 1`` plus
  the transfer time (the send runs beside that tick's compute). Without transfer times and
  delays this is :func:`neighbour_time` with :func:`exchange_partners`.

  Args:
    cost: ``[T, S]`` cost of each table entry, in the units of ``transfer``.
    links: the link indices in use (:func:`ring_links`).
    transfer: per link ``[S]`` (or one number for all): the time one tick's exchange over it
      takes; None: instant.
    delays: per link, 0 or 1 (:func:`~tpipe.schedules.actions.link_delays`); None: none.

  Raises:
    ValueError: ``cost`` is not ``[T, S]``, a link is out of range, or a transfer time is
      negative.
  """
  cost = np.asarray(cost, np.float64)
  start = tick_starts(cost, links, transfer, delays)
  return float((start + cost).max(initial=0.0))


def tick_starts(cost: np.ndarray, links, transfer=None, delays=None) -> np.ndarray:
  """``[T, S]``: when each stage starts each tick in the neighbour-synchronised model of
  :func:`linked_time` (same arguments and errors); a timeline draws the ticks there."""
  return _timeline(*_checked(cost, links, transfer, delays))[0]


def critical_path(cost: np.ndarray, links, transfer=None, delays=None) -> list[tuple[int, int]]:
  """One chain of ``(tick, stage)`` entries that sets the step time of :func:`linked_time` (same
  arguments and errors), in tick order: their costs, with the transfer times of the links the
  chain crosses, add up to the step. It ends at the entry that finishes last and walks back, at
  each tick start, to what it waited for: the stage's own previous tick, or the neighbour's
  (the neighbour's start, over a delayed link, whose cost then is not on the chain); zero-cost
  entries are left out. Where a step is longer than the work of any one stage, the chain shows
  what adds up: which ticks, on which stages, the step waits for."""
  cost, links, transfer, delays = _checked(cost, links, transfer, delays)
  starts, waited = _timeline(cost, links, transfer, delays, record=True)
  if cost.size == 0:
    return []
  t, s = cost.shape[0] - 1, int(np.argmax(starts[-1] + cost[-1]))
  chain, counted = [], True
  while True:
    if counted and cost[t, s] > 0:
      chain.append((t, s))
    if t == 0:
      return chain[::-1]
    s, counted = int(waited[t, s, 0]), bool(waited[t, s, 1])
    t -= 1


def tick_slack(cost: np.ndarray, links, transfer=None, delays=None) -> np.ndarray:
  """``[T, S]``: how much longer each entry could take without lengthening the step of
  :func:`linked_time` (same arguments and errors): its latest end less its end, the latest ends
  and starts walked back from the step through the same waits. Entries on a
  :func:`critical_path` have none; adding at most its slack to one entry's cost leaves the step
  as it is (where a scheduler can put movable work, such as ``W``, for free)."""
  cost, links, transfer, delays = _checked(cost, links, transfer, delays)
  starts = _timeline(cost, links, transfer, delays)[0]
  if cost.size == 0:
    return np.zeros(cost.shape)
  num_stages = cost.shape[1]
  latest_end = np.empty(cost.shape)  # The latest each entry may end, and start (below).
  latest_end[-1] = (starts + cost).max()  # The step (the last tick's end, costs being >= 0).
  latest_start = latest_end[-1] - cost[-1]
  for t in range(cost.shape[0] - 2, -1, -1):
    end_by = latest_start.copy()  # Each stage's own next tick waits for this one's end.
    start_by = np.full(num_stages, np.inf)  # A delayed link's exchange, for its start.
    for link in links:
      a, b = link, (link + 1) % num_stages
      bound = min(latest_start[a], latest_start[b]) - transfer[link]
      side = start_by if delays[link] else end_by
      side[[a, b]] = np.minimum(side[[a, b]], bound)
    latest_end[t] = end_by
    latest_start = np.minimum(end_by - cost[t], start_by)
  return latest_end - (starts + cost)


def _checked(cost, links, transfer, delays):
  """The arguments of :func:`linked_time` as arrays, checked."""
  cost = np.asarray(cost, np.float64)
  if cost.ndim != 2:
    raise ValueError(f"cost must be [ticks, stages], got shape {cost.shape}.")
  num_stages = cost.shape[1]
  links = tuple(int(link) for link in links)
  if any(not 0 <= link < num_stages for link in links):
    raise ValueError(f"links must be in range({num_stages}), got {links}; use "
                     f"ring_links({num_stages}, wrap).")
  transfer = np.broadcast_to(np.asarray(0.0 if transfer is None else transfer, np.float64),
                             (num_stages,))
  if np.any(transfer < 0) or not np.all(np.isfinite(transfer)):
    raise ValueError(f"transfer times must be finite and >= 0, got {transfer.tolist()}.")
  return cost, links, transfer, actions_lib.link_delays(delays, num_stages)


def _timeline(cost, links, transfer, delays, record: bool = False):
  """``(starts [T, S], waited)``: :func:`tick_starts` of arguments :func:`_checked` gave, and
  with ``record`` what each start waited for, ``[T, S, 2]``: the stage whose tick before set it
  (the stage itself on a tie) and 1 where that tick's end set it, 0 where its start did (a
  delayed link); else None."""
  num_stages = cost.shape[1]
  starts = np.zeros(cost.shape)
  waited = np.zeros(cost.shape + (2,), np.int64) if record else None
  start, end = np.zeros(num_stages), np.zeros(num_stages)
  for t, row in enumerate(cost):
    if t:
      ready = end.copy()
      if record:
        waited[t, :, 0], waited[t, :, 1] = np.arange(num_stages), 1
      for link in links:
        a, b = link, (link + 1) % num_stages
        side = start if delays[link] else end
        arrive = max(side[a], side[b]) + transfer[link]
        for me in (a, b):
          if arrive > ready[me]:
            ready[me] = arrive
            if record:
              other = b if me == a else a
              waited[t, me] = (other if side[other] > side[me] else me, not delays[link])
      start = ready
    starts[t] = start
    end = start + row
  return starts, waited


def simulate(schedule, costs: Mapping[str, float] | None = None, transfer=None) -> Timing:
  """Step time of ``schedule`` under per-action ``costs``: lockstep, neighbour-synchronised and
  natural.

  Args:
    schedule: a :class:`~tpipe.schedules.FusedSchedule`.
    costs: see :func:`action_costs`.
    transfer: per link (or one number): the time one tick's exchange over it takes, in the
      units of ``costs`` (see :func:`linked_time`); None: instant.

  Returns:
    A :class:`Timing`.
  """
  cost = action_costs(schedule, costs)
  per_tick = tick_costs(schedule, costs)
  lockstep = float(per_tick.max(axis=1).sum())
  finish, stage_free = {}, np.zeros(schedule.num_stages)
  vstage = schedule.virtual_stage
  num_virtual = schedule.num_stages * schedule.num_chunks
  for t in range(schedule.num_rows):  # Rows in order: each stage's actions in its order.
    for s in np.nonzero(schedule.busy[t])[0]:
      kind, m = actions_lib.ACTION_OF[schedule.action[t, s]], int(schedule.microbatch[t, s])
      v = int(vstage[s, schedule.chunk[t, s]])
      ready = max([finish[key] for key in actions_lib.dependencies(kind, m, v, num_virtual)],
                  default=0.0)
      start = max(stage_free[s], ready)
      stage_free[s] = finish[(actions_lib.EVENT[kind], m, v)] = start + cost[t, s]
  links = ring_links(schedule.num_stages, schedule.num_chunks > 1)
  instant = linked_time(per_tick, links, None, schedule.delays)
  neighbour = linked_time(per_tick, links, transfer, schedule.delays) if transfer is not None else (
      instant)
  return Timing(lockstep=lockstep, natural=float(stage_free.max()), busy=per_tick.sum(axis=0),
                neighbour=neighbour, exposed_transfer=neighbour - instant)
