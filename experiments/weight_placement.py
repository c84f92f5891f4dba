"""Where a split backward's W could run: the compound tables' steps with every W placed exactly.

Run from the repository root (pure NumPy and SciPy; nothing compiles)::

  python -m experiments.weight_placement           # writes experiments/results/weight_placement.md
  python -m experiments.weight_placement --smoke   # S = 4, M = 4: checks the script

Issue 19 asks that, at S = 8 and M in {8, 32}, the neighbour-synchronised bubble of every fused
schedule's table built for measured per-action costs come within 1.15x of the schedule's
dependency-driven (natural) bubble. The builder (:mod:`tpipe.schedules.compound`) lays forwards
and backwards out tick by tick, fills ``W`` where a stage's tick stays within the costliest
stage's (or holds them until every stage can run one each tick), and then moves the ``W`` on
the step's chain into slack. This script asks how much is left in where the ``W`` run: for each
table the builder
considers (its one-action table and its distinct compound packings, the three with the shortest
step), it keeps every ``F`` and ``BI`` at its tick, drops the ticks left without one, and places
every ``W`` anew by a mixed-integer program (``scipy.optimize.milp``, HiGHS): each ``W`` at or
after its ``BI``'s tick, at most :data:`WEIGHT_SLOTS` awaiting ``W`` per stage, minimising the
neighbour-synchronised step (a stage starts a tick when it and its neighbours finished the last:
:func:`tpipe.schedules.simulate.neighbour_time`, written as linear constraints). A solve stops
at :data:`TIME_LIMIT` seconds with the best placement found (marked "time limit"); a placement is
kept only where it beats the builder's own.

The costs are the per-chunk FLOPs ``experiments/fused_schedules.py`` measures on its S = 8 LM
(results/fused_schedules.md: ``F``, ``BI``, ``W`` per chunk, MFLOP), under remat full and, with
one forward less in ``BI``, under remat none (as that script's compound table does).
"""

from __future__ import annotations

import time

import numpy as np
import scipy.sparse as sparse
from scipy import optimize

import tpipe
from experiments import _common
from tpipe.schedules import actions as actions_lib
from tpipe.schedules import compound
from tpipe.schedules import fused as fused_lib

Action = actions_lib.Action

# Per-chunk MFLOP measured by experiments/fused_schedules.py at S = 8 (one chunk per stage for
# ZB-H1, two for ZB-V), remat full; remat none takes one forward off BI.
MEASURED = {"zb_h1": {"F": 403.4, "BI": 932.3, "W": 407.5},
            "zbv": {"F": 215.6, "BI": 442.8, "W": 204.1}}
# Most W a stage may leave waiting (memory: a weight slot holds a micro-batch's activations).
WEIGHT_SLOTS = 16
TIME_LIMIT = 60.0
TOP = 3


def cost_sets():
  full = {name: dict(c) for name, c in MEASURED.items()}
  none = {name: dict(c, BI=c["BI"] - c["F"]) for name, c in MEASURED.items()}
  return [("FLOPs, remat full", full), ("FLOPs, remat none", none)]


def skeletons(name, stages, microbatches, costs, top):
  """The builder's tables (one action per tick, and each distinct compound packing), the
  ``top`` with the shortest neighbour-synchronised step."""
  repeats = 2 if name == "zbv" else 1
  tables = [tpipe.schedules.build(name, stages, microbatches, repeats)]
  tables += [compound.pack(name, stages, microbatches, repeats, costs, **settings)
             for settings in compound.candidates(name, stages)]
  distinct = {}
  for table in tables:
    key = tuple(a for a in table.actions() if a[2] != "W")
    step = table.simulate(costs).neighbour
    if key not in distinct or step < distinct[key][0]:
      distinct[key] = (step, table)
  return [table for _, table in sorted(distinct.values(), key=lambda x: x[0])[:top]]


def place_weights(table, costs, *, slots=WEIGHT_SLOTS, time_limit=TIME_LIMIT, extra_ticks=2):
  """``(table with every W placed by the MILP, whether the solve proved it optimal)``."""
  num_stages, num_chunks = table.num_stages, table.num_chunks
  stage_of, chunk_of = actions_lib.placement_of(table.virtual_stage)
  work, back_tick, weights = {}, {}, []
  for t, s, kind, m, v in table.actions():
    if kind == "W":
      weights.append((m, v, int(stage_of[v])))
    else:
      work.setdefault(t, {}).setdefault(s, []).append((Action[kind], m, int(chunk_of[v])))
      if kind == "BI":
        back_tick[(m, v)] = t
  kept = {t: i for i, t in enumerate(sorted(work))}  # Ticks with an F or a BI somewhere.
  back_tick = {key: kept[t] for key, t in back_tick.items()}
  num_ticks = len(kept) + extra_ticks
  base = np.zeros((num_ticks, num_stages))
  for t, per_stage in work.items():
    for s, acts in per_stage.items():
      base[kept[t], s] = sum(costs[a.name] for a, _, _ in acts)

  # Variables: x[w, t] (W number w at tick t); start[t, s]; done[t, s], the W stage s has run
  # by the end of tick t; the step.
  x = {}
  for w, (m, v, _) in enumerate(weights):
    for t in range(back_tick[(m, v)], num_ticks):
      x[(w, t)] = len(x)
  grid = num_ticks * num_stages
  start = lambda t, s: len(x) + t * num_stages + s
  done = lambda t, s: len(x) + grid + t * num_stages + s
  step = len(x) + 2 * grid
  entries, lower, upper = [], [], []

  def constrain(terms, lo, hi):
    entries.extend((len(lower), i, value) for i, value in terms)
    lower.append(lo)
    upper.append(hi)

  at, ticks_of = {}, {}  # (tick, stage) -> the x placing a W there; W -> its x.
  for (w, t), i in x.items():
    at.setdefault((t, weights[w][2]), []).append(i)
    ticks_of.setdefault(w, []).append(i)
  for placements in ticks_of.values():  # Every W runs once.
    constrain([(i, 1.0) for i in placements], 1, 1)
  partners = tpipe.schedules.simulate.exchange_partners(num_stages, num_chunks > 1)
  cost = lambda t, s: [(i, -costs["W"]) for i in at.get((t, s), [])]
  for t in range(1, num_ticks):
    for s in range(num_stages):
      for q in (s,) + partners[s]:  # start[t, s] >= start[t - 1, q] + cost(t - 1, q)
        constrain([(start(t, s), 1.0), (start(t - 1, q), -1.0)] + cost(t - 1, q),
                  base[t - 1, q], np.inf)
  for s in range(num_stages):
    constrain([(step, 1.0), (start(num_ticks - 1, s), -1.0)] + cost(num_ticks - 1, s),
              base[num_ticks - 1, s], np.inf)
  backs = np.zeros((num_ticks, num_stages), np.int64)  # BI run by the end of each tick.
  for (m, v), t in back_tick.items():
    backs[t:, stage_of[v]] += 1
  for s in range(num_stages):
    for t in range(num_ticks):
      placed_now = [(i, -1.0) for i in at.get((t, s), [])]
      earlier = [(done(t - 1, s), -1.0)] if t else []
      constrain([(done(t, s), 1.0)] + earlier + placed_now, 0, 0)
      constrain([(done(t, s), -1.0)], -np.inf, slots - backs[t, s])  # backs - done <= slots

  num_vars = step + 1
  r, c, values = zip(*entries)
  matrix = sparse.csr_matrix((values, (r, c)), shape=(len(lower), num_vars))
  objective = np.zeros(num_vars)
  objective[step] = 1.0
  integer = np.zeros(num_vars)
  integer[:len(x)] = 1
  upper_bound = np.full(num_vars, np.inf)
  upper_bound[:len(x)] = 1
  result = optimize.milp(objective, integrality=integer,
                         bounds=optimize.Bounds(np.zeros(num_vars), upper_bound),
                         constraints=optimize.LinearConstraint(matrix, lower, upper),
                         options={"time_limit": time_limit})
  if result.x is None:
    return None, False
  ticks = [[[] for _ in range(num_stages)] for _ in range(num_ticks)]
  for t, per_stage in work.items():
    for s, acts in per_stage.items():
      ticks[kept[t]][s] += acts
  for (w, t), i in x.items():
    if result.x[i] > 0.5:
      m, v, s = weights[w]
      ticks[t][s].append((Action.W, m, int(chunk_of[v])))
  while not any(ticks[-1]):
    ticks.pop()
  placed = fused_lib.from_ticks(table.name, num_stages, table.num_microbatches, num_chunks,
                                table.placement, ticks, delays=table.delays)
  return placed, result.status == 0


def main(argv=None) -> None:
  run = _common.start("weight_placement", __doc__, smoke="S = 4, M = 4, 5 s per solve",
                      argv=argv)
  stages, ms, limit = (4, (4,), 5.0) if run.smoke else (8, (8, 32), TIME_LIMIT)
  lines = [f"S = {stages}; bubble ratio: the neighbour-synchronised bubble over the schedule's "
           "natural one (its one-action table's, as in results/fused_schedules.md); weight "
           f"slots at most {WEIGHT_SLOTS}; each solve stops at {limit:.0f} s.", "",
           "| costs | schedule | M | builder: bubble | ratio | weight slots | W placed exactly: "
           "bubble | ratio | weight slots | solve | seconds |", "|---|" + "---|" * 10]
  for label, per_schedule in cost_sets():
    for name in ("zb_h1", "zbv"):
      costs = per_schedule[name]
      repeats = 2 if name == "zbv" else 1
      for m in ms:
        natural = tpipe.schedules.build(name, stages, m, repeats).simulate(costs).natural_bubble
        built = tpipe.schedules.build(name, stages, m, repeats, costs=costs)
        own = built.simulate(costs)
        best, optimal, began = None, False, time.time()
        for table in skeletons(name, stages, m, costs, TOP):
          placed, proved = place_weights(table, costs, time_limit=limit)
          if placed is None:
            continue
          timing = placed.simulate(costs)
          if best is None or timing.neighbour < best[0].neighbour:
            best, optimal = (timing, placed), proved
        row = (f"| {label} | {name} | {m} | {own.neighbour_bubble:.3f} | "
               f"{own.neighbour_bubble / natural:.2f} | {int(built.awaiting_weight().max())} | ")
        if best is None or best[0].neighbour >= own.neighbour:
          row += "- | - | - | no better placement | "
        else:
          timing, placed = best
          row += (f"{timing.neighbour_bubble:.3f} | {timing.neighbour_bubble / natural:.2f} | "
                  f"{int(placed.awaiting_weight().max())} | "
                  f"{'optimal' if optimal else 'time limit'} | ")
        lines.append(row + f"{time.time() - began:.0f} |")
        print(lines[-1], flush=True)
  run.write("Exact W placement on the builder's compound tables", lines)


if __name__ == "__main__":
  main()
