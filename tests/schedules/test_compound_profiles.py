"""Compound tables under cost profiles they were not fitted to (issue 61).

The contract: for per-action costs with ``B / F`` in [2, 4] and ``W / F`` in [0.5, 1.5], the
table ``schedules.build(name, S, M, costs=)`` gives has a neighbour-synchronised bubble at most
1.15x the *natural bubble* of the schedule's one-action table under the same costs (its
dependency-driven step, ``simulate(costs).natural_bubble``), and ZB-V's step at most 0.90x
GPipe's. Seeded profiles here, at S = 4 and small M to keep within the suite's budget; the
whole sweep (S = 4 and 8, M = S .. 4 S, the measured costs) is ``experiments/compound_profiles.py``
(results/compound_profiles.md). 1F1B, interleaved 1F1B and here ZB-H1 keep it; ZB-V does not
yet (the xfail below, strict: it fails the day the builder meets the contract, so the marker
comes off then).
"""

import numpy as np
import pytest

from tpipe import schedules

pytestmark = pytest.mark.unit

BUBBLE_BOUND, ZBV_STEP_BOUND = 1.15, 0.90
SPLIT = ("zb_h1", "zbv")


def _profiles(draws: int, seed: int = 0) -> list[tuple[float, float]]:
  """``(B / F, W / F)``: the box's corners and ``draws`` seeded uniform draws in it."""
  rng = np.random.default_rng(seed)
  corners = [(b, w) for b in (2.0, 4.0) for w in (0.5, 1.5)]
  return corners + [(float(rng.uniform(2, 4)), float(rng.uniform(0.5, 1.5)))
                    for _ in range(draws)]


def _costs(name: str, profile: tuple[float, float]) -> dict[str, float]:
  b, w = profile
  return {"F": 1.0, "BI": b - w, "W": w} if name in SPLIT else {"F": 1.0, "B": b}


def _measure(name: str, repeats: int, stages: int, micro: int, costs) -> tuple[float, float]:
  """(the compound table's neighbour-synchronised bubble over the one-action table's natural
  bubble, its step over GPipe's ``(M + S - 1)`` stage steps of ``F + B``)."""
  table = schedules.build(name, stages, micro, repeats, costs=costs)
  natural = schedules.build(name, stages, micro, repeats).simulate(costs).natural_bubble
  timing = table.simulate(costs)
  gpipe = (micro + stages - 1) * repeats * sum(costs.values())
  return timing.neighbour_bubble / natural, timing.neighbour / gpipe


def _worst(cases) -> list[tuple[float, float, tuple]]:
  """Each case's ``(bubble ratio, step over GPipe's, case)``, the worst ratio first."""
  out = [(*_measure(name, repeats, stages, micro, _costs(name, profile)),
          (name, stages, micro, profile)) for name, repeats, stages, micro, profile in cases]
  return sorted(out, key=lambda r: -r[0])


def test_the_profiles_are_seeded_and_span_the_box():
  assert _profiles(3) == _profiles(3)
  points = np.array(_profiles(16))
  assert points[:, 0].min() == 2 and points[:, 0].max() == 4
  assert points[:, 1].min() == 0.5 and points[:, 1].max() == 1.5


def test_one_f_one_b_tables_keep_the_natural_bubble_under_every_profile():
  # One forward and one backward per tick in the steady state: 1F1B takes GPipe's step, its
  # natural one; interleaved 1F1B stays within the bound (S = 4, up to 1.13x at M = 14 - 16).
  schedule_names = (("1f1b", 1), ("interleaved_1f1b", 2))
  cases = [(name, repeats, 4, micro, profile) for name, repeats in schedule_names
           for micro in (4, 8) for profile in _profiles(4)]
  results = _worst(cases)
  assert results[0][0] <= BUBBLE_BOUND + 1e-9, results[0]
  assert all(abs(r - 1.0) < 1e-9 for r, _, case in results if case[0] == "1f1b")


def test_zb_h1_tables_keep_within_1_15x_of_the_natural_bubble_under_every_profile():
  # The W of a table still longer than the natural step are placed by a mixed-integer program
  # (weight_settling.place_weights): at S = 4, M = 4, B / F 2, W / F 1.5, 1.36x -> 1.13x.
  results = _worst([("zb_h1", 1, 4, micro, profile) for micro in (4, 8)
                    for profile in _profiles(4)])
  assert results[0][0] <= BUBBLE_BOUND + 1e-9, results[0]


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "issue 61: ZB-V's compound tables are not yet robust to the cost profile: at W / F = 1.5, "
    "S = 4, M = 4 it reaches 1.27x its natural bubble (experiments/results/compound_profiles.md: "
    "up to about 3x at M = 4 S)"))
def test_zbv_tables_keep_within_1_15x_of_the_natural_bubble_under_every_profile():
  for profile in _profiles(4):  # One case at a time: it stops at the first outside the bound.
    ratio, step, case = _worst([("zbv", 2, 4, 4, profile)])[0]
    assert ratio <= BUBBLE_BOUND + 1e-9 and step <= ZBV_STEP_BOUND + 1e-9, (ratio, step, case)
