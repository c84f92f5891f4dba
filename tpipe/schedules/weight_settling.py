"""Settled weights: a split-backward table's ``W`` moved, after packing, to where they cost the
step least.

Where ``W`` goes sets most of what a split backward loses to neighbour synchronisation
(:mod:`tpipe.schedules.compound`). Two ways, both keeping every ``F`` and ``BI`` where it is:

* :func:`settle_weights` moves each ``W`` on the chain of ticks that sets the
  neighbour-synchronised step to the tick of its stage with the most slack
  (:func:`tpipe.schedules.simulate.tick_slack`), which never lengthens the step (ZB-H1, S = 8,
  M = 8: bubble 1.24x -> 1.12x its natural one). NumPy; :func:`tpipe.schedules.compound.build`
  settles its fastest tables so.
* :func:`place_weights` places all of them at once by a mixed-integer program: how many ``W``
  each stage runs in each tick, for the shortest neighbour-synchronised step. Where shortening
  the step takes several stages' ``W`` moved together (the last tick emptied on every stage),
  no move of one ``W`` gains and settling stops; the program sees it (ZB-H1, S = 4, M = 4,
  ``B / F`` 2, ``W / F`` 1.5: 16.5 -> 15.5 forwards, 1.36x -> 1.13x its natural bubble).
  :func:`~tpipe.schedules.compound.build` places a loop's (ZB-H1's) shortest table so where its
  step is longer than the schedule's natural one. HiGHS (``scipy.optimize.milp``) within
  :data:`PLACEMENT_NODES` branch-and-bound nodes, never a time limit, so every host builds the
  same table.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
from scipy import optimize
from scipy import sparse

from tpipe.schedules import actions as actions_lib
from tpipe.schedules import fused as fused_lib
from tpipe.schedules.simulate import ring_links
from tpipe.schedules.simulate import tick_costs
from tpipe.schedules.simulate import tick_slack

Action = actions_lib.Action

# Branch-and-bound nodes place_weights' program may take: a bound on the work, not the time, so
# the table is the same on every host (ZB-H1, S = 8, M = 32: a few hundred where it closes).
PLACEMENT_NODES = 2000


def settle_weights(table: fused_lib.FusedSchedule, costs: Mapping[str, float],
                   weight_slots: int | None = None, transfer=None) -> fused_lib.FusedSchedule:
  """``table`` with its ``W`` moved where they cost the step nothing: one at a time, from an
  entry that sets the neighbour-synchronised step (no slack) to the entry of the same stage
  with the most slack that fits it (:func:`tpipe.schedules.simulate.tick_slack`), never before
  its ``BI``, and never so late that a stage would hold more micro-batch chunks awaiting ``W``
  than ``weight_slots`` or the table's busiest stage does (nor more in flight than the table's
  peak and those extra slots); a tick after the last is free to take them. Each move leaves
  the step as long or shorter (the ``W`` fits its new entry's slack, and taking work off an
  entry lengthens nothing), so the result is never slower. Each ``W`` moves once at most (the
  costliest entries' first); it stops when no ``W`` on the chain can move.

  Args:
    table: a split-backward :class:`~tpipe.schedules.FusedSchedule` (``BI`` and ``W``).
    costs: per-action costs (:func:`~tpipe.schedules.actions.check_costs`).
    weight_slots: how many micro-batch chunks awaiting ``W`` a stage may hold where the
      table's busiest stage holds fewer (else as many as it does); None: as many as it does.
    transfer: per link (or one number): the exchange time, as in
      :func:`~tpipe.schedules.simulate.linked_time`; None: instant.
  """
  costs = actions_lib.check_costs(costs, split=True)
  num_stages, num_ticks = table.num_stages, table.num_ticks + 1
  _, chunk_of = actions_lib.placement_of(table.virtual_stage)
  ticks = [[[] for _ in range(num_stages)] for _ in range(num_ticks)]
  first, back, at = {}, {}, {}  # (s, m, c) -> the tick of its F, its BI, its W.
  for t, s, kind, m, v in table.actions():
    key = (s, m, int(chunk_of[v]))
    ticks[t][s].append((Action[kind], m, key[2]))
    {"F": first, "BI": back, "W": at}[kind][key] = t
  weights = list(at)
  held = np.zeros((num_ticks, num_stages), np.int64)  # In flight (F .. W), ticks included.
  waiting = np.zeros((num_ticks, num_stages), np.int64)  # Awaiting W (BI .. W).
  for key, t in at.items():
    held[first[key]:t + 1, key[0]] += 1
    waiting[back[key]:t + 1, key[0]] += 1
  waiting_cap = max(int(waiting.max()), weight_slots or 0)
  held_cap = held.max() + waiting_cap - waiting.max()
  cost = tick_costs(table, costs)
  cost = np.concatenate([cost, np.zeros((1, num_stages))])
  links = ring_links(num_stages, table.num_chunks > 1)
  weight, moved = costs["W"], set()
  while True:
    slack = tick_slack(cost, links, transfer, table.delays)
    on_chain = [key for key in weights  # Not moved yet, in an entry with no slack.
                if key not in moved and slack[at[key], key[0]] <= 1e-9 * weight]
    move = None
    for key in sorted(on_chain, key=lambda k: (-cost[at[k], k[0]], at[k], k)):
      s, t = key[0], at[key]
      fits = []
      for u in range(back[key], num_ticks):
        if u == t or slack[u, s] < weight * (1 - 1e-9):
          continue
        later = slice(t + 1, u + 1)  # Moved later, the chunk stays held through tick u.
        if u < t or (held[later, s].max() < held_cap and waiting[later, s].max() < waiting_cap):
          fits.append((slack[u, s], -u))
      if fits:
        move = key, t, -max(fits)[1]
        break
    if move is None:
      break
    key, t, u = move
    s, entry = key[0], (Action.W,) + key[1:]
    ticks[t][s].remove(entry)
    ticks[u][s].append(entry)
    ticks[u][s].sort(key=lambda action: action[0] == Action.W)  # W after the tick's BI.
    cost[t, s] -= weight
    cost[u, s] += weight
    step, span = (1, slice(t + 1, u + 1)) if u > t else (-1, slice(u + 1, t + 1))
    held[span, s] += step
    waiting[span, s] += step
    at[key] = u
    moved.add(key)
  while not any(ticks[-1]):
    ticks.pop()
  return fused_lib.from_ticks(table.name, num_stages, table.num_microbatches, table.num_chunks,
                              table.placement, ticks, delays=table.delays)


def place_weights(table: fused_lib.FusedSchedule, costs: Mapping[str, float],
                  node_limit: int = PLACEMENT_NODES) -> fused_lib.FusedSchedule:
  """``table`` with its ``W`` placed by a mixed-integer program for the shortest
  neighbour-synchronised step (instant transfers), every ``F`` and ``BI`` kept in its tick.

  The program's integers are how many ``W`` stage ``s`` runs in tick ``t``; its times are each
  tick's start on each stage, after its own tick before and its neighbours' (their start over a
  delayed link), as :func:`tpipe.schedules.simulate.linked_time` follows them. By each tick a
  stage has run no more ``W`` than ``BI``, and holds no more micro-batch chunks awaiting ``W``,
  or in flight, than the table's busiest stage does, nor runs more actions in one tick than
  the table's busiest tick (its lanes), so the placed table needs no more memory.
  The ``W`` a stage runs take its pending micro-batch chunks in the order of their ``BI``.

  Returns:
    The placed table where its step is shorter than ``table``'s; else ``table`` itself (the
    program found nothing shorter within ``node_limit`` nodes).
  """
  costs = actions_lib.check_costs(costs, split=True)
  num_stages, num_ticks = table.num_stages, table.num_ticks
  _, chunk_of = actions_lib.placement_of(table.virtual_stage)
  ticks = [[[] for _ in range(num_stages)] for _ in range(num_ticks)]
  base = np.zeros((num_ticks, num_stages))  # Each entry's cost without its W.
  counts = {kind: np.zeros((num_ticks, num_stages)) for kind in ("F", "BI", "W")}
  pending = [[] for _ in range(num_stages)]  # (tick of BI, m, c) per stage.
  for t, s, kind, m, v in table.actions():
    counts[kind][t, s] += 1
    if kind != "W":
      ticks[t][s].append((Action[kind], m, int(chunk_of[v])))
      base[t, s] += costs[kind]
    if kind == "BI":
      pending[s].append((t, m, int(chunk_of[v])))
  done = {kind: np.cumsum(c, axis=0) for kind, c in counts.items()}  # By the end of tick t.
  before = lambda c: np.concatenate([np.zeros((1, num_stages)), c[:-1]])  # Before tick t.
  waiting_cap = (done["BI"] - before(done["W"])).max()  # table.awaiting_weight()'s peak.
  held_cap = (done["F"] - before(done["W"])).max()  # table.peak_in_flight()'s.
  lanes = sum(counts.values()).max()  # Actions a stage runs in one tick, at most.
  program = _Program(num_ticks, num_stages)
  weight = costs["W"]
  delays = actions_lib.link_delays(table.delays, num_stages)
  for t in range(1, num_ticks):
    for s in range(num_stages):  # A stage's tick starts after its own tick before.
      program.add({program.start(t, s): 1, program.start(t - 1, s): -1,
                   program.count(t - 1, s): -weight}, base[t - 1, s])
    for link in ring_links(num_stages, table.num_chunks > 1):
      ends = link, (link + 1) % num_stages
      for me, other in (ends, ends[::-1]):  # And after its neighbour's end (start, delayed).
        terms = {program.start(t, me): 1, program.start(t - 1, other): -1}
        if not delays[link]:
          terms[program.count(t - 1, other)] = -weight
        program.add(terms, 0.0 if delays[link] else base[t - 1, other])
  last = num_ticks - 1
  for s in range(num_stages):
    program.add({program.step: 1, program.start(last, s): -1, program.count(last, s): -weight},
                base[last, s])
    for t in range(num_ticks):
      program.add({program.count(t, s): 1}, 0.0, lanes - counts["F"][t, s] - counts["BI"][t, s])
      by_now = {program.count(u, s): 1 for u in range(t + 1)}
      program.add(by_now, 0.0, done["BI"][t, s])  # No W before its BI.
      if t:
        earlier = {program.count(u, s): 1 for u in range(t)}
        program.add(earlier, max(done["BI"][t, s] - waiting_cap, done["F"][t, s] - held_cap))
    total = done["BI"][last, s]
    program.add({program.count(u, s): 1 for u in range(num_ticks)}, total, total)
  placed = program.solve(node_limit)
  if placed is None:
    return table
  for s in range(num_stages):
    queue = sorted(pending[s])
    for t in range(num_ticks):
      for _ in range(placed[t, s]):
        _, m, c = queue.pop(0)
        ticks[t][s].append((Action.W, m, c))
  new = fused_lib.from_ticks(table.name, num_stages, table.num_microbatches, table.num_chunks,
                             table.placement, ticks, delays=table.delays)
  old_step, new_step = (x.simulate(costs).neighbour for x in (table, new))
  return new if new_step < old_step * (1 - 1e-9) else table


class _Program:
  """:func:`place_weights`' mixed-integer program: ``[T, S]`` integer ``W`` counts, ``[T, S]``
  tick starts and the step, each constraint a lower (and upper) bound on a sum of terms."""

  def __init__(self, num_ticks: int, num_stages: int):
    self.shape = num_ticks, num_stages
    self.size = num_ticks * num_stages
    self.step = 2 * self.size
    self.rows, self.cols, self.values, self.lower, self.upper = [], [], [], [], []

  def count(self, t: int, s: int) -> int:
    return t * self.shape[1] + s

  def start(self, t: int, s: int) -> int:
    return self.size + t * self.shape[1] + s

  def add(self, terms: dict, lower: float, upper: float = np.inf) -> None:
    row = len(self.lower)
    for col, value in terms.items():
      self.rows.append(row)
      self.cols.append(col)
      self.values.append(value)
    self.lower.append(lower)
    self.upper.append(upper)

  def solve(self, node_limit: int) -> np.ndarray | None:
    """The ``[T, S]`` counts of the best solution found, or None where none was."""
    num_vars = self.step + 1
    matrix = sparse.csr_matrix((self.values, (self.rows, self.cols)),
                               shape=(len(self.lower), num_vars))
    objective = np.zeros(num_vars)
    objective[self.step] = 1.0
    integrality = np.zeros(num_vars)
    integrality[:self.size] = 1
    result = optimize.milp(objective, integrality=integrality,
                           constraints=optimize.LinearConstraint(matrix, self.lower, self.upper),
                           bounds=optimize.Bounds(0, np.inf),
                           options={"node_limit": int(node_limit)})
    if result.x is None:
      return None
    return np.rint(result.x[:self.size]).astype(np.int64).reshape(self.shape)
