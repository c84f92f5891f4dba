"""Compound tables across cost profiles: the worst neighbour-synchronised bubble, over the
one-action table's natural one, of every fused schedule's compound table, and ZB-V's step over
GPipe's, under seeded random per-action costs and the costs the project measured.

Issue 61's contract: for any costs with ``B / F`` in [2, 4] and ``W / F`` in [0.5, 1.5] (and the
measured ones), at S = 4 and 8 and M = S .. 4 S, the table ``tpipe.schedules.build(name, S, M,
costs=)`` gives has a neighbour-synchronised bubble at most 1.15x the *natural bubble* of the
schedule's one-action table under the same costs (its dependency-driven step, no tick barrier:
``FusedSchedule.simulate(costs).natural_bubble``, the share of the stages' time spent idle), and
ZB-V's neighbour-synchronised step is at most 0.90x GPipe's, ``(M + S - 1)(F + B)`` for the
costs of a stage (two chunks of the V).

A profile is ``(B / F, W / F)`` with ``F = 1``: 1F1B and interleaved 1F1B (two chunks per stage)
run ``F`` and ``B``; ZB-H1 and ZB-V run ``F``, ``BI = B - W`` and ``W``. The draws are uniform in
the box (seeded), plus its four corners and the measured costs (per chunk, as
``experiments/fused_schedules.py`` and ``experiments/gpu_action_costs.py`` measured them; under
remat none every backward keeps its forward's residuals, so ``B / F`` falls below 2 there).
Each row is the worst over M of one schedule and profile; the summary is the worst per schedule.
Pure NumPy (no compile).
"""

from __future__ import annotations

import multiprocessing
import time

import numpy as np

from experiments import _common
import tpipe

SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2))
SPLIT = ("zb_h1", "zbv")
BOX = {"B": (2.0, 4.0), "W": (0.5, 1.5)}  # Per forward.
BUBBLE_BOUND, ZBV_STEP_BOUND = 1.15, 0.90
# Per-chunk costs the project measured (one chunk per stage; the V's and interleaved 1F1B's
# chunks are half a stage, about half the cost each, so the same ratios): FLOPs of
# experiments/fused_schedules.py's LM at S = 8 (MFLOP; remat none takes a forward off B and BI)
# and an H200's timed wall times (ms; experiments/gpu_action_costs.py).
MEASURED = {
    "FLOPs, remat full": {"F": 403.4, "B": 1341.9, "BI": 932.3, "W": 407.5},
    "FLOPs, remat none": {"F": 403.4, "B": 938.5, "BI": 528.9, "W": 407.5},
    "FLOPs of a V chunk, remat full": {"F": 215.6, "B": 646.6, "BI": 442.8, "W": 204.1},
    "H200, remat full": {"F": 4.3143, "B": 13.5065, "BI": 9.0592, "W": 4.4473},
    "H200, remat none": {"F": 6.7852, "B": 10.0734, "BI": 5.6441, "W": 4.4293},
}


def profiles(draws: int, seed: int) -> list[tuple[str, dict]]:
  """``(label, costs)``: the box's corners, ``draws`` seeded uniform draws in it, the measured
  costs. ``costs`` has ``F``, ``B``, ``BI`` and ``W`` (each schedule reads its own)."""
  rng = np.random.default_rng(seed)
  points = [(b, w) for b in BOX["B"] for w in BOX["W"]]
  points += [(rng.uniform(*BOX["B"]), rng.uniform(*BOX["W"])) for _ in range(draws)]
  out = [(f"B/F {b:.3f}, W/F {w:.3f}", {"F": 1.0, "B": b, "BI": b - w, "W": w})
         for b, w in points]
  return out + list(MEASURED.items())


def schedule_costs(name: str, costs: dict) -> dict:
  """The costs a schedule's table runs: ``F``, ``BI`` and ``W`` split, else ``F`` and ``B``."""
  keys = ("F", "BI", "W") if name in SPLIT else ("F", "B")
  return {key: float(costs[key]) for key in keys}


def measure(name: str, repeats: int, stages: int, micro: int, costs: dict) -> dict:
  """The compound table of ``name`` for ``costs`` against its one-action table and GPipe."""
  costs = schedule_costs(name, costs)
  table = tpipe.schedules.build(name, stages, micro, repeats, costs=costs)
  plain = tpipe.schedules.build(name, stages, micro, repeats)
  timing, natural = table.simulate(costs), plain.simulate(costs).natural_bubble
  gpipe = (micro + stages - 1) * repeats * sum(costs.values())  # Its stage: repeats chunks.
  return {"ratio": timing.neighbour_bubble / natural if natural > 1e-12 else 1.0,
          "step": timing.neighbour / gpipe,
          "in_flight": (int(table.peak_in_flight().max()), int(plain.peak_in_flight().max())),
          "weight_slots": int(table.awaiting_weight().max())}


def _case(args):
  name, repeats, stages, micro, label, costs = args
  start = time.perf_counter()
  result = measure(name, repeats, stages, micro, costs)
  return dict(result, name=name, stages=stages, micro=micro, label=label,
              seconds=time.perf_counter() - start)


def main(argv=None) -> None:
  run = _common.start("compound_profiles", __doc__, smoke="S = 4, M = 4 and 8, two draws",
                      argv=argv, arguments=lambda parser: (
                          parser.add_argument("--draws", type=int, default=12),
                          parser.add_argument("--seed", type=int, default=0),
                          parser.add_argument("--stages", default="4,8"),
                          parser.add_argument("--multiples", default="1,2,3,4",
                                              help="M as multiples of S, or 'all': every M in "
                                              "S .. 4 S"),
                          parser.add_argument("--jobs", type=int, default=1)))
  stage_counts = (4,) if run.smoke else tuple(int(s) for s in run.args.stages.split(","))
  cases = []
  for label, costs in profiles(2 if run.smoke else run.args.draws, run.args.seed):
    for stages in stage_counts:
      micros = ((4, 8) if run.smoke else range(stages, 4 * stages + 1)
                if run.args.multiples == "all"
                else [int(k) * stages for k in run.args.multiples.split(",")])
      for micro in micros:
        for name, repeats in SCHEDULES:
          cases.append((name, repeats, stages, micro, label, costs))
  results = []
  with multiprocessing.Pool(run.args.jobs) as pool:
    for result in pool.imap_unordered(_case, sorted(cases, key=lambda c: -c[2] * c[3])):
      results.append(result)
      print(f"{result['name']} S={result['stages']} M={result['micro']} {result['label']}: "
            f"bubble ratio {result['ratio']:.3f}, step / GPipe's {result['step']:.3f} "
            f"({result['seconds']:.1f} s)", flush=True)

  lines = ["Bubble ratio: the compound table's neighbour-synchronised bubble over its one-action "
           "table's natural bubble (bound 1.15); step: the neighbour-synchronised step over "
           "GPipe's `(M + S - 1)(F + B)` (ZB-V's bound 0.90). In flight: the compound table's "
           "peak micro-batch chunks held per stage, and the one-action table's.", "",
           "### The worst case per schedule and S", "",
           "| schedule | S | worst bubble ratio | at (M, costs) | worst step / GPipe's | "
           "at (M, costs) | in flight, compound / one-action (most) | cases | within bounds |",
           "|---|---|---|---|---|---|---|---|---|"]
  worst_all = {}
  for name, _ in SCHEDULES:
    for stages in stage_counts:
      rows = [r for r in results if (r["name"], r["stages"]) == (name, stages)]
      by_ratio, by_step = max(rows, key=lambda r: r["ratio"]), max(rows, key=lambda r: r["step"])
      ok = sum(r["ratio"] <= BUBBLE_BOUND + 1e-9
               and (name != "zbv" or r["step"] <= ZBV_STEP_BOUND + 1e-9) for r in rows)
      held = max(rows, key=lambda r: r["in_flight"][0] - r["in_flight"][1])["in_flight"]
      worst_all[name] = max(worst_all.get(name, 0.0), by_ratio["ratio"])
      lines.append(f"| {name} | {stages} | {by_ratio['ratio']:.3f} | {by_ratio['micro']}, "
                   f"{by_ratio['label']} | {by_step['step']:.3f} | {by_step['micro']}, "
                   f"{by_step['label']} | {held[0]} / {held[1]} | {len(rows)} | {ok} |")
  lines += ["", "### Every profile: the worst over M per schedule and S", "",
            "| costs | S | " + " | ".join(f"{n}: ratio" for n, _ in SCHEDULES) +
            " | zbv: step / GPipe's |", "|---|---|" + "---|" * (len(SCHEDULES) + 1)]
  for label, _ in profiles(2 if run.smoke else run.args.draws, run.args.seed):
    for stages in stage_counts:
      rows = [r for r in results if (r["label"], r["stages"]) == (label, stages)]
      worst = lambda name, key: max(r[key] for r in rows if r["name"] == name)
      lines.append(f"| {label} | {stages} | " + " | ".join(
          f"{worst(n, 'ratio'):.3f}" for n, _ in SCHEDULES) + f" | {worst('zbv', 'step'):.3f} |")
  lines += ["", "Worst bubble ratio per schedule over everything: " + ", ".join(
      f"{name} {ratio:.3f}" for name, ratio in worst_all.items()) + "."]
  run.write("Compound tables across cost profiles", lines)


if __name__ == "__main__":
  main()
