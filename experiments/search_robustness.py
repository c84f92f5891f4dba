"""How reliably the exact window search (:mod:`tpipe.experimental.refine`) finds
the shorter ZB-H1 table, at S = 8, M = 8, under the remat-none costs measured by
``experiments/fused_schedules.py`` and under costs near them.

The search's windows take plateau moves that depend on the costs' last digits, so one search
can find a shorter step for some costs and miss it for costs a hair away; and the solver works
to fixed tolerances, so the costs' unit must not matter. Two tables:

* **The measured costs in several units**: the exact per-chunk FLOPs (``MEASURED_FLOPS``, from
  the compiled step of ``fused_schedules``), scaled to MFLOP, to seconds at 1 PFLOP/s and
  by an odd factor. Each row: the builder's table and the searched one, as the
  neighbour-synchronised bubble over the schedule's natural one (issue 19 asks <= 1.15x).
* **Costs drawn near them**: each of F, BI and W times a factor drawn in ``1 +- spread``.

Pure NumPy and SciPy (no compile); the search's seconds are wall time on this machine.
"""

from __future__ import annotations

import time

import numpy as np

from experiments import _common
import tpipe
from tpipe.experimental import refine

# ZB-H1's per-chunk costs in FLOPs, S = 8, M = 8, remat none, from the compiled step of
# experiments/fused_schedules.py (2026-11-27): BI is the measured BI less a forward (the
# backward from the forward's kept residuals), as its "FLOPs, remat none" cost set.
MEASURED_FLOPS = {"F": 403411077.75, "BI": 932269452.0 - 403411077.75, "W": 407525317.0}
SCALES = (("FLOPs", 1.0), ("MFLOP", 1e-6), ("seconds at 1 PFLOP/s", 1e-15),
          ("FLOPs x 3.7e-9", 3.7e-9))


def search(stages: int, microbatches: int, costs: dict) -> tuple[float, float, float, bool]:
  """(builder's bubble ratio, searched bubble ratio, seconds, memory no more than the builder's)
  of four sweeps of exact window search on ZB-H1 under ``costs``."""
  natural = tpipe.schedules.build("zb_h1", stages, microbatches).simulate(costs).natural_bubble
  built = tpipe.schedules.build("zb_h1", stages, microbatches, costs=costs)
  start = time.perf_counter()
  found = refine.refine(built, costs, sweeps=4)
  seconds = time.perf_counter() - start
  slots = lambda t: (t.peak_in_flight(), t.awaiting_weight().max(axis=0, initial=0))
  fits = all(np.all(now <= was) for now, was in zip(slots(found), slots(built)))
  ratio = lambda table: table.simulate(costs).neighbour_bubble / natural
  return ratio(built), ratio(found), seconds, fits


def main(argv=None) -> None:
  run = _common.start("search_robustness", __doc__, smoke="S = 4, M = 4, two draws", argv=argv,
                      arguments=lambda parser: (
                          parser.add_argument("--draws", type=int, default=16),
                          parser.add_argument("--spread", type=float, default=0.01),
                          parser.add_argument("--seed", type=int, default=0)))
  stages, microbatches = (4, 4) if run.smoke else (8, 8)
  draws = 2 if run.smoke else run.args.draws
  header = ["| costs | bubble ratio: builder | searched | slots no more | seconds |",
            "|---|---|---|---|---|"]
  row = lambda label, r: f"| {label} | {r[0]:.4f} | {r[1]:.4f} | {r[3]} | {r[2]:.0f} |"
  lines = [f"### The measured costs in several units (ZB-H1, S = {stages}, M = {microbatches})",
           "", *header]
  for label, scale in SCALES:
    costs = {kind: cost * scale for kind, cost in MEASURED_FLOPS.items()}
    lines.append(row(label, search(stages, microbatches, costs)))
    print(lines[-1], flush=True)
  spread = run.args.spread
  lines += ["", f"### {draws} cost sets drawn within +-{spread:.0%} of the measured ones (seed "
            f"{run.args.seed})", "", *header]
  rng = np.random.default_rng(run.args.seed)
  ratios = []
  for _ in range(draws):
    costs = {kind: cost * (1 + rng.uniform(-spread, spread))
             for kind, cost in MEASURED_FLOPS.items()}
    result = search(stages, microbatches, costs)
    ratios.append(result[1])
    label = ", ".join(f"{kind} {cost / 1e6:.2f}" for kind, cost in costs.items()) + " MFLOP"
    lines.append(row(label, result))
    print(lines[-1], flush=True)
  lines += ["", f"Searched bubble ratio over the draws: {min(ratios):.4f} to {max(ratios):.4f}; "
            f"{sum(r <= 1.15 for r in ratios)} of {draws} within 1.15x."]
  run.write("Exact window search: the measured ZB-H1 costs, in several units and perturbed",
            lines)


if __name__ == "__main__":
  main()
