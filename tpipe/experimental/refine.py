"""Exact window search: a fused table's actions re-placed a window of ticks at a time.

Experimental (research): its interface and results may change without notice; the stable
compound builder is :mod:`tpipe.schedules.compound`.

The compound builder (:mod:`tpipe.schedules.compound`) lays tables out by rules, tick by tick,
and the best of its rules can still miss a table that is shorter under neighbour
synchronisation: where stages must move together (the last backward travelling one tick
earlier on every stage, a stage's weight work deferred so its neighbour's backward can run
beside its own), no rule that looks at one tick sees it. :func:`refine` searches for such
tables exactly, a window at a time: it frees every action in a window of consecutive ticks,
keeps every other action at its tick, and places the freed ones anew by a mixed-integer
program that minimises the neighbour-synchronised step (the model of
:func:`tpipe.schedules.simulate.linked_time`, with instant transfers: a stage starts a tick when
it and the stages it exchanges with have finished the last, or, over a delayed link, started
it). The program keeps what the table must (:class:`~tpipe.schedules.FusedSchedule`'s checks):
every action after what it needs (an earlier tick for a message, two over a delayed link; the
same tick, after it, for the stage's own stash), one message each way per stage and tick; and
it holds each stage's micro-batch chunks in flight and awaiting ``W`` to the table's own peaks,
so the refined table needs no more memory.

The windows slide over the table in sweeps, half a window apart, forward then backward. A
window is solved twice: for the shortest step, then, holding that step, for the smallest sum of
every tick's end, so that among equal steps it takes the table whose ticks end earliest (one
program with the sum as a small second term leaves the sum inside the solver's optimality gap:
which of the equal steps came back then turned on rounding). A re-placement is kept when the
step is shorter, or as long with that sum smaller (a move along a plateau, from which a later
window can gain); a search stops after a sweep that keeps none, or after ``sweeps``. Which
plateau moves a window takes decides what later windows can reach, so one search from one
table finds a shorter step for some costs and misses it for costs a hair away. The search
therefore also starts from the table re-timed with the last one, two and three micro-batches'
backward of the last model chunk in their forward's tick (:data:`KICKS`): that moves the last
backwards' trips a tick earlier on every stage, which no window shorter than a trip can, and
the windows mend what it breaks. The shortest table found wins; the step never grows.

Each solve runs HiGHS (``scipy.optimize.milp``; SciPy comes with JAX) within a limit of
branch-and-bound nodes, never of time, so every host builds the same table. Its programs take
the costs relative to the largest: HiGHS works to fixed tolerances, and given costs in FLOPs
(1e9 beside 0/1 placement variables) its windows returned placements no better than the
table's where the same costs in MFLOP found a shorter step.

It costs tens of seconds for a ZB-H1 table at S = 8, M = 8 and minutes for a ZB-V one (two
chunks per stage: twice the actions per window), so it runs only when asked: on a table, or in
a pipeline through a spec :func:`tpipe.experimental.search.with_search` returns. ZB-H1 at
S = 8, M = 8 under the measured remat-none costs of ``experiments/fused_schedules.py`` (BI about
1.3 F, W about F): the neighbour-synchronised bubble goes from 1.16x the schedule's natural
bubble to 1.14x, in the same memory, whatever the costs' unit; so it does for each of sixteen
cost sets drawn within 1% of those (``experiments/search_robustness.py``).

Example::

  >>> from tpipe.experimental import refine
  >>> from tpipe.schedules import orders
  >>> costs = {"F": 1.0, "BI": 1.3, "W": 1.0}
  >>> table = orders.zb_h1(3, 3)
  >>> better = refine.refine(table, costs, sweeps=1)
  >>> better.simulate(costs).neighbour < table.simulate(costs).neighbour
  True
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from tpipe.schedules import actions as actions_lib
from tpipe.schedules import fused as fused_lib
from tpipe.schedules.simulate import ring_links
from tpipe.schedules.simulate import tick_starts

Action = actions_lib.Action

# Branch-and-bound nodes one window's solve may take: a bound on the work, not on the time, so
# the result is the same on every host (a window of S = 8, M = 8 closes in a few hundred).
NODE_LIMIT = 20000
# The searches' second and later starts (Problem.kicked): the last one, two and three
# micro-batches' backwards of the last model chunk moved into their forwards' ticks.
KICKS = (1, 2, 3)
# Window lengths in ticks, a pass of each per sweep: six re-places a ZB-H1 table at S = 8,
# M = 8 in seconds and finds what ten finds there (which takes minutes; eight finds less at
# S = 4, M = 4).
WINDOWS = (6,)
# Relative tolerance when comparing steps.
_TOLERANCE = 1e-9
# Relative optimality gap of each of a window's two solves.
MIP_GAP = 1e-4
# Order of a stage's actions inside one tick: a backward reads its own forward's stash, W its
# backward's.
_ORDER = {Action.F: 0, Action.B: 1, Action.BI: 1, Action.W: 2}


def refine(table: fused_lib.FusedSchedule, costs: Mapping[str, float], *,
           windows: Sequence[int] = WINDOWS, sweeps: int = 4,
           node_limit: int = NODE_LIMIT) -> fused_lib.FusedSchedule:
  """``table`` with its actions re-placed, a window of ticks at a time, for a shorter
  neighbour-synchronised step under ``costs`` (see the module docstring); never longer, and
  never more micro-batch chunks in flight or awaiting ``W`` on any stage than ``table`` has.

  Args:
    table: a :class:`~tpipe.schedules.FusedSchedule` with a backward (not forward-only).
    costs: per-action costs of one chunk, for the actions the table runs (``F`` and ``B``, or
      ``F``, ``BI`` and ``W``).
    windows: the window lengths in ticks (each >= 2), a pass of each per sweep: a short window
      moves little and solves fast, a long one finds moves a short one cannot make.
    sweeps: most sweeps over the table (>= 1); it stops after one that keeps nothing.
    node_limit: branch-and-bound nodes per window solve (>= 1): with fewer, a window may stop
      short of its best placement.

  Raises:
    TypeError: ``table`` is not a FusedSchedule.
    ValueError: a forward-only table, a cost missing or not > 0, or a bad count.
  """
  if not isinstance(table, fused_lib.FusedSchedule):
    raise TypeError(f"refine takes a FusedSchedule (tpipe.schedules.build of a fused name), got "
                    f"{type(table).__name__}.")
  if table.forward_only:
    raise ValueError("refine re-places forward and backward actions; this table is forward-only.")
  windows = tuple(windows) if isinstance(windows, (tuple, list)) else (windows,)
  for name, values, low in (("windows", windows, 2), ("sweeps", (sweeps,), 1),
                            ("node_limit", (node_limit,), 1)):
    if not values or any(isinstance(value, bool) or not isinstance(value, (int, np.integer))
                         or value < low for value in values):
      raise ValueError(f"{name} must be {'ints' if name == 'windows' else 'an int'} >= {low}, "
                       f"got {values if name == 'windows' else values[0]!r}.")
  problem = _Problem(table, _checked_costs(table, costs))
  best_placed, best = problem.initial, problem.score(problem.initial)
  for seed in [problem.initial] + [problem.kicked(count) for count in KICKS]:
    placed, score = _search(problem, seed, windows, sweeps, node_limit)
    if score is not None and score[0] < best[0] * (1 - _TOLERANCE):
      best_placed, best = placed, score
  return table if best_placed is problem.initial else problem.table(best_placed)


def _search(problem, placed, windows, sweeps, node_limit):
  """Sweeps of window searches from ``placed``: ``(placed, score)`` of the best found, or
  ``(placed, None)`` where ``placed`` is None or holds more memory than the source."""
  best = None if placed is None else problem.score(placed)
  for sweep in range(sweeps if best is not None else 0):
    kept = False
    for window in windows:
      last = max(0, problem.num_ticks(placed) + 1 - window)  # Windows reach one tick past.
      starts = sorted(set(range(0, last + 1, max(1, window // 2))) | {last})
      for start in starts if sweep % 2 == 0 else starts[::-1]:
        found = problem.solve(placed, start, start + window, node_limit)
        score = None if found is None else problem.score(found)
        if score is not None and _better(score, best):
          placed, best, kept = found, score, True
    if not kept:
      break
  return placed, best


def _checked_costs(table, costs) -> dict[str, float]:
  kinds = {Action(int(a)).name for a in np.unique(table.action) if a >= 0}
  return actions_lib.check_costs(costs, split="BI" in kinds or "W" in kinds)


def _better(score, best) -> bool:
  step, spread = score
  best_step, best_spread = best
  if step < best_step * (1 - _TOLERANCE):
    return True
  return step <= best_step * (1 + _TOLERANCE) and spread < best_spread * (1 - _TOLERANCE)


class _Program:
  """One window's mixed-integer program: ``num_x`` 0/1 placement variables, then a start per
  (tick, stage), then the step; rows added by :meth:`constrain`, solved by :meth:`solve`."""

  def __init__(self, num_x: int, num_starts: int):
    self.num_x = num_x
    self.step = num_x + num_starts
    self.num_vars = self.step + 1
    self.entries, self.lower, self.upper = [], [], []

  def start(self, num_stages: int):
    """``start(t, s)``: the variable of stage ``s``'s start of tick ``t``."""
    return lambda t, s: self.num_x + t * num_stages + s

  def constrain(self, terms, low, high) -> None:
    """A row: ``low <= sum(value * x[i] for i, value in terms) <= high``."""
    self.entries.extend((len(self.lower), i, value) for i, value in terms)
    self.lower.append(low)
    self.upper.append(high)

  def solve(self, node_limit: int):
    """The variables' values: the shortest step, then, no longer than it, the ticks ending
    earliest; None where HiGHS found nothing."""
    import scipy.sparse as sparse  # SciPy comes with JAX; only this search needs it.
    from scipy import optimize

    num_vars, num_x, step = self.num_vars, self.num_x, self.step
    rows, cols, values = zip(*self.entries)
    matrix = sparse.csr_matrix((values, (rows, cols)), shape=(len(self.lower), num_vars))
    integrality = np.zeros(num_vars)
    integrality[:num_x] = 1
    upper_bound = np.full(num_vars, np.inf)
    upper_bound[:num_x] = 1
    constraints = optimize.LinearConstraint(matrix, self.lower, self.upper)
    options = {"node_limit": int(node_limit), "mip_rel_gap": MIP_GAP}
    solve = lambda objective: optimize.milp(
        objective, integrality=integrality, constraints=constraints, options=options,
        bounds=optimize.Bounds(np.zeros(num_vars), upper_bound))
    shortest = np.zeros(num_vars)
    shortest[step] = 1.0
    result = solve(shortest)
    if result.x is None:
      return None
    # Then, no longer than that, the ticks ending earliest.
    upper_bound[step] = result.x[step] * (1 + _TOLERANCE)
    earliest = np.zeros(num_vars)
    earliest[num_x:step] = 1.0 / (step - num_x)
    settled = solve(earliest)
    return (settled if settled.x is not None else result).x


class _Problem:
  """One table's actions, what each needs, and the window programs over them."""

  def __init__(self, table: fused_lib.FusedSchedule, costs: dict[str, float]):
    self.source, self.costs = table, costs
    # The window programs' costs, the largest 1 (HiGHS's tolerances are fixed: module doc).
    largest = max(costs.values())
    self.solver_costs = {kind: cost / largest for kind, cost in costs.items()}
    self.num_stages, self.num_chunks = table.num_stages, table.num_chunks
    self.num_virtual = self.num_stages * self.num_chunks
    self.stage_of, self.chunk_of = actions_lib.placement_of(table.virtual_stage)
    self.hops = table.hop_delays
    self.links = actions_lib.link_directions(table.placement, self.num_stages, self.num_chunks)
    self.ring = ring_links(self.num_stages, self.num_chunks > 1)
    self.delays = actions_lib.link_delays(table.delays, self.num_stages)
    self.initial = {}  # (Action, m, v) -> tick.
    for t, _, kind, m, v in table.actions():
      self.initial[(Action[kind], m, v)] = t
    backward = {key[1:]: key[0] for key in self.initial if key[0] in (Action.B, Action.BI)}
    self.needs = {}  # action -> [(action it needs, ticks after it: 0 in the same tick)].
    for key in self.initial:
      kind, m, v = key
      needs = []
      for name, dm, dv in actions_lib.dependencies(kind, m, v, self.num_virtual):
        dep = (Action.F, dm, dv) if name == "F" else (
            (Action.W, dm, dv) if name == "W" else (backward[(dm, dv)], dm, dv))
        gap = 0 if dv == v else 1 + int(self.hops[min(dv, v)])
        needs.append((dep, gap))
      self.needs[key] = needs
    self.users = {}
    for key, needs in self.needs.items():
      for dep, gap in needs:
        self.users.setdefault(dep, []).append((key, gap))
    # Memory: (opening action, closing action) of each micro-batch chunk's stash, and of its
    # wait for W; each stage's caps are the table's own most per tick.
    self.held = [(key, self._release(key)) for key in self.initial if key[0] == Action.F]
    self.waiting = [(key, (Action.W,) + key[1:]) for key in self.initial if key[0] == Action.BI]
    self.held_cap = self._peaks(self.initial, self.held)
    self.waiting_cap = self._peaks(self.initial, self.waiting)

  def kicked(self, count: int):
    """The source's actions in the same order on each stage, each as early as that order and
    what it needs allow, with the backward of the last model chunk in the tick of its forward
    for the last ``count`` micro-batches; None where that is no table or the source itself. A
    start for the search: it brings the last backwards' trips a tick earlier, which windows
    shorter than a trip cannot do alone (ZB-H1, S = 8, M = 8 under near-equal costs), and the
    windows mend the rest."""
    last = self.num_virtual - 1
    first = self.source.num_microbatches - count
    together = {key for key in self.initial  # Backwards run in their forward's tick.
                if key[2] == last and key[1] >= first and key[0] in (Action.B, Action.BI)}
    order = sorted(self.initial, key=lambda key: (self.initial[key], _ORDER[key[0]]))
    placed, previous = {}, {}  # previous: per stage, (its last action's tick, that tick).
    for key in order:
      s = self.stage(key)
      same_tick = key in together or (s in previous and previous[s][1] == self.initial[key])
      tick = previous[s][0] + (0 if same_tick else 1) if s in previous else 0
      for dep, gap in self.needs[key]:
        tick = max(tick, placed[dep] + gap)
      placed[key] = tick
      previous[s] = (tick, self.initial[key])
    if placed == self.initial:
      return None
    try:
      self.table(placed)
    except ValueError:  # Two messages one way in a tick: no table.
      return None
    return placed

  def _release(self, forward):
    m, v = forward[1:]
    return (Action.W, m, v) if (Action.W, m, v) in self.initial else (Action.B, m, v)

  def stage(self, key) -> int:
    return int(self.stage_of[key[2]])

  def way(self, key):
    """The direction ``key`` sends its message (+1, -1, 0 to itself), or None."""
    kind, _, v = key
    if kind == Action.F:
      return int(self.links[v]) if v < self.num_virtual - 1 else None
    if kind in (Action.B, Action.BI):
      return -int(self.links[v - 1]) if v > 0 else None
    return None

  @staticmethod
  def num_ticks(placed) -> int:
    return max(placed.values()) + 1

  def _peaks(self, placed, spans) -> np.ndarray:
    count = np.zeros((self.num_ticks(placed) + 1, self.num_stages), np.int64)
    for opening, closing in spans:
      s = self.stage(opening)
      count[placed[opening]:placed[closing] + 1, s] += 1
    return count.max(axis=0)

  def score(self, placed):
    """``(step, the sum of every tick's end)`` of ``placed`` as a table, or None where
    a stage would hold more micro-batch chunks in flight or awaiting ``W`` than the source."""
    table = self.table(placed)
    source = self.source
    waiting = lambda t: t.awaiting_weight().max(axis=0, initial=0)
    grew = np.any(table.peak_in_flight() > source.peak_in_flight()) or np.any(
        waiting(table) > waiting(source))
    if grew:
      return None
    grid = table.tick_costs(self.costs)
    ends = tick_starts(grid, self.ring, None, self.delays) + grid
    return float(ends.max(initial=0.0)), float(ends.sum())  # The step: Timing.neighbour.

  def solve(self, placed, first: int, stop: int, node_limit: int):
    """``placed`` with the actions in ticks ``[first, stop)`` re-placed there optimally, or None
    where the program found nothing."""
    num_ticks = self.num_ticks(placed) + 1  # One free tick after the last.
    stop = min(stop, num_ticks)
    window = self._window(placed, first, stop)
    if window is None:
      return None
    fixed, column = window
    ticks_of = {}  # A freed action's (tick, variable) pairs.
    for (key, t), i in column.items():
      ticks_of.setdefault(key, []).append((t, i))
    program = _Program(num_x=len(column), num_starts=num_ticks * self.num_stages)
    self._placement(program, fixed, column, ticks_of)
    self._timing(program, fixed, column, num_ticks)
    for spans, caps in ((self.held, self.held_cap), (self.waiting, self.waiting_cap)):
      self._memory(spans, caps, placed, fixed, ticks_of, first, stop, program.constrain)
    x = program.solve(node_limit)
    if x is None:
      return None
    out = dict(fixed)
    for (key, t), i in column.items():
      if x[i] > 0.5:
        out[key] = t
    return self._compact(out)

  def _window(self, placed, first: int, stop: int):
    """``(fixed, column)``: the actions outside ticks ``[first, stop)`` at their ticks, and a
    0/1 variable per (freed action, tick it may take) between what bounds it outside the
    window; None where the window frees nothing or an action has no tick left."""
    placed = dict(sorted(placed.items(), key=lambda item: (item[1], item[0])))  # One order.
    free = [key for key, t in placed.items() if first <= t < stop]
    if not free:
      return None
    fixed = {key: t for key, t in placed.items() if not first <= t < stop}
    freed = set(free)
    column = {}  # (action, tick) -> variable.
    for key in free:
      low, high = first, stop - 1
      for dep, gap in self.needs[key]:
        if dep not in freed:
          low = max(low, fixed[dep] + gap)
      for user, gap in self.users.get(key, ()):
        if user not in freed:
          high = min(high, fixed[user] - gap)
      if low > high:
        return None
      for t in range(low, high + 1):
        column[(key, t)] = len(column)
    return fixed, column

  def _placement(self, program: "_Program", fixed, column, ticks_of) -> None:
    """Each freed action once, after what it needs, and one message each way per stage and
    tick."""
    constrain = program.constrain
    for key in ticks_of:  # Each freed action runs once.
      constrain([(i, 1.0) for _, i in ticks_of[key]], 1, 1)
    tick_of = lambda key, sign=1.0: [(i, sign * t) for t, i in ticks_of[key]]
    for key in ticks_of:  # After what it needs (freed on both sides; the rest bounded the ticks).
      for dep, gap in self.needs[key]:
        if dep in ticks_of:
          constrain(tick_of(key) + tick_of(dep, -1.0), gap, np.inf)
    sent = {}
    for key, t in fixed.items():
      way = self.way(key)
      if way is not None:
        sent[(t, self.stage(key), way)] = sent.get((t, self.stage(key), way), 0) + 1
    at = {}  # (tick, stage) -> [(variable, action)], grouped as _timing groups them.
    for (key, t), i in column.items():
      at.setdefault((t, self.stage(key)), []).append((i, key))
    ways = {}
    for (t, s), items in at.items():
      for i, key in items:
        way = self.way(key)
        if way is not None:
          ways.setdefault((t, s, way), []).append(i)
    for where, variables in ways.items():  # One message each way per stage and tick.
      constrain([(i, 1.0) for i in variables], 0, 1 - sent.get(where, 0))

  def _timing(self, program: "_Program", fixed, column, num_ticks: int) -> None:
    """The neighbour-synchronised start of every (tick, stage) and the step after the last."""
    num_stages, constrain = self.num_stages, program.constrain
    start, step = program.start(num_stages), program.step
    at = {}  # (tick, stage) -> [(variable, action)].
    for (key, t), i in column.items():
      at.setdefault((t, self.stage(key)), []).append((i, key))
    base = np.zeros((num_ticks, num_stages))
    for key, t in fixed.items():
      base[t, self.stage(key)] += self.solver_costs[key[0].name]
    cost = lambda t, s: [(i, -self.solver_costs[key[0].name]) for i, key in at.get((t, s), ())]
    for t in range(1, num_ticks):  # The neighbour-synchronised starts.
      for s in range(num_stages):
        constrain([(start(t, s), 1.0), (start(t - 1, s), -1.0)] + cost(t - 1, s),
                  base[t - 1, s], np.inf)
      for link in self.ring:
        a, b = link, (link + 1) % num_stages
        for me, other in ((a, b), (b, a)):
          if self.delays[link]:
            constrain([(start(t, me), 1.0), (start(t - 1, other), -1.0)], 0, np.inf)
          else:
            constrain([(start(t, me), 1.0), (start(t - 1, other), -1.0)] + cost(t - 1, other),
                      base[t - 1, other], np.inf)
    for s in range(num_stages):  # The step.
      constrain([(step, 1.0), (start(num_ticks - 1, s), -1.0)] + cost(num_ticks - 1, s),
                base[num_ticks - 1, s], np.inf)

  def _memory(self, spans, caps, placed, fixed, ticks_of, first, stop, constrain):
    """Per stage and freed tick: chunks opened by then less those closed before, at most the
    cap."""
    for s in range(self.num_stages):
      mine = [(o, c) for o, c in spans if self.stage(o) == s]
      if not any(o in ticks_of or c in ticks_of for o, c in mine):
        continue
      for t in range(first, stop):
        terms, constant = [], 0
        for opening, closing in mine:
          if opening in ticks_of:
            terms += [(i, 1.0) for u, i in ticks_of[opening] if u <= t]
          elif fixed[opening] <= t:
            constant += 1
          if closing in ticks_of:
            terms += [(i, -1.0) for u, i in ticks_of[closing] if u < t]
          elif fixed[closing] < t:
            constant -= 1
        if terms:
          constrain(terms, -np.inf, int(caps[s]) - constant)

  def _compact(self, placed):
    """``placed`` without its empty ticks, save those a message over a delayed link needs
    between its send and its read (dropping one never lengthens the step: costs are >= 0)."""
    used = set(placed.values())
    empty = [t for t in range(max(used) + 1) if t not in used]
    spans = [(placed[dep], placed[key], gap) for key, needs in self.needs.items()
             for dep, gap in needs if gap > 1]
    dropped = []
    for t in empty:
      if all(not lo < t < hi or hi - lo - 1 - sum(lo < d < hi for d in dropped) >= gap
             for lo, hi, gap in spans):  # Each span still as long as its message needs.
        dropped.append(t)
    shift = np.cumsum([t in dropped for t in range(max(used) + 1)])
    return {key: t - int(shift[t]) for key, t in placed.items()}

  def table(self, placed) -> fused_lib.FusedSchedule:
    ticks = [[[] for _ in range(self.num_stages)] for _ in range(self.num_ticks(placed))]
    for key, t in sorted(placed.items(), key=lambda item: (_ORDER[item[0][0]], item[0][1:])):
      kind, m, v = key
      ticks[t][self.stage(key)].append((kind, m, int(self.chunk_of[v])))
    source = self.source
    return fused_lib.from_ticks(source.name, source.num_stages, source.num_microbatches,
                                source.num_chunks, source.placement, ticks, delays=source.delays)
