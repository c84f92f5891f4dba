"""tpipe.partition (balancing only): balanced splits of layer-unit costs into stages against
brute force, hand-written cases, explicit splits, reports and errors."""

import fractions
import itertools
import math
import random

import numpy as np
import pytest

from tpipe import partition

pytestmark = pytest.mark.unit


def _all_splits(n, num_stages):
  """Every split of n units into num_stages non-empty consecutive runs, as counts."""
  for cuts in itertools.combinations(range(1, n), num_stages - 1):
    bounds = (0,) + cuts + (n,)
    yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _exact_max(counts, costs):
  """The largest stage cost, summed exactly."""
  bounds = np.cumsum((0,) + tuple(counts))
  return max(sum(map(fractions.Fraction, costs[a:b]), fractions.Fraction(0))
             for a, b in zip(bounds, bounds[1:]))


def _random_costs(rng, n, kind):
  if kind == "int":
    return [rng.choice([0, 0, 1, 2, 3, 5, 8, 20]) for _ in range(n)]
  if kind == "float":
    return [rng.choice([0.0, rng.random(), 10 * rng.random(), 0.1, 0.2, 0.3]) for _ in range(n)]
  return [rng.choice([0, 1, 2, 0.5, 0.25, 1e-3]) for _ in range(n)]  # Mixed int and float.


@pytest.mark.parametrize("kind", ["int", "float", "mixed"])
def test_against_brute_force(kind):
  rng = random.Random(1234 + len(kind))
  checked = 0
  for _ in range(150):
    n = rng.randint(1, 9)
    costs = _random_costs(rng, n, kind)
    for num_stages in range(1, n + 1):
      counts = partition.balanced_split(costs, num_stages)
      assert len(counts) == num_stages and min(counts) >= 1 and sum(counts) == n
      assert all(isinstance(c, int) for c in counts)
      splits = list(_all_splits(n, num_stages))
      best = min(_exact_max(s, costs) for s in splits)
      assert _exact_max(counts, costs) == best  # Exactly optimal, floats included.
      got = max(math.fsum(costs[sum(counts[:s]):sum(counts[:s + 1])])
                for s in range(num_stages))
      assert got == pytest.approx(float(best), rel=1e-12, abs=0)
      # The tie rule: every boundary as early as in any optimal split.
      optimal = [s for s in splits if _exact_max(s, costs) == best]
      assert counts == min(optimal)
      ours = np.cumsum(counts)
      assert all((ours <= np.cumsum(s)).all() for s in optimal)
      checked += 1
  assert checked > 500


def test_uniform_costs_split_evenly():
  assert partition.balanced_split([1] * 8, 4) == (2, 2, 2, 2)
  assert partition.balanced_split([2.5] * 12, 3) == (4, 4, 4)
  assert partition.balanced_split(np.ones(6, np.float32), 2) == (3, 3)


def test_one_huge_unit_gets_a_stage_of_its_own():
  assert partition.balanced_split([1, 1, 100, 1, 1, 1], 3) == (2, 1, 3)
  assert partition.balanced_split([100, 1, 1, 1], 2) == (1, 3)
  assert partition.balanced_split([1, 1, 1, 100], 2) == (3, 1)


def test_one_stage_and_one_unit_per_stage():
  assert partition.balanced_split([3, 0, 2.5], 1) == (3,)
  assert partition.balanced_split([3, 0, 2.5], 3) == (1, 1, 1)
  assert partition.balanced_split([7], 1) == (1,)


def test_ties_put_every_boundary_as_early_as_possible():
  assert partition.balanced_split([1] * 7, 3) == (1, 3, 3)  # Not (3, 3, 1) nor (2, 2, 3).
  assert partition.balanced_split([1] * 10, 4) == (1, 3, 3, 3)
  # Zero-cost units join the later stage: both (1, 3) and (3, 1) have a bottleneck of 5.
  assert partition.balanced_split([5, 0, 0, 5], 2) == (1, 3)
  assert partition.balanced_split([0, 0, 0, 0], 2) == (1, 3)


def test_float_sums_are_exact():
  # 0.1 + 0.2 > 0.3 in binary floating point: {0.1, 0.2} | {0.3} costs 0.30000000000000004 and
  # {0.1} | {0.2, 0.3} costs 0.5, so the first split is the optimum, though not by rounding.
  assert partition.balanced_split([0.1, 0.2, 0.3], 2) == (2, 1)
  # Exactly equal halves, whatever order a prefix sum would add them in.
  assert partition.balanced_split([0.1, 0.7, 0.7, 0.1], 2) == (2, 2)
  # A tie between 1e300 + 1e-300 and itself, which float addition would not see.
  assert partition.balanced_split([1e-300, 1e300, 1e-300], 2) == (1, 2)
  assert partition.balanced_split([fractions.Fraction(1, 3)] * 3, 3) == (1, 1, 1)


def test_large_inputs_are_fast():
  rng = np.random.default_rng(0)
  costs = rng.random(5000) * 1e6
  counts = partition.balanced_split(costs, 16)
  assert sum(counts) == 5000 and len(counts) == 16


@pytest.mark.parametrize("costs, num_stages, error, match", [
    ([1, -2, 3], 2, ValueError, r"costs\[1\] = -2 is negative"),
    ([1, 2, float("nan")], 2, ValueError, r"costs\[2\] = nan is not finite"),
    ([float("inf"), 1], 1, ValueError, r"costs\[0\] = inf is not finite"),
    (np.array([1.0, -0.5]), 1, ValueError, r"costs\[1\] = .*-0.5.* is negative"),
    ([1, "2"], 1, TypeError, r"costs\[1\] = '2' is not a real number"),
    ([1, True], 1, TypeError, r"costs\[1\] = True is not a real number"),
    ([1, 2j], 1, TypeError, r"costs\[1\] = 2j is not a real number"),
    ("12", 1, TypeError, r"costs must be a sequence of numbers"),
    (5, 1, TypeError, r"costs must be a sequence of numbers"),
    (np.ones((2, 2)), 1, TypeError, r"costs must be 1-D.*shape \(2, 2\)"),
    ([], 1, ValueError, r"costs is empty"),
    ([1, 2, 3], 4, ValueError,
     r"num_stages=4 but the model has 3 layer units.*use between 1 and 3 stages or split the "
     r"model into more units"),
    ([1, 2, 3], 0, ValueError, r"num_stages=0 .*use between 1 and 3 stages"),
    ([1, 2, 3], 2.0, TypeError, r"num_stages must be an int, got 2.0"),
    ([1, 2, 3], True, TypeError, r"num_stages must be an int, got True"),
])
def test_balanced_split_errors(costs, num_stages, error, match):
  with pytest.raises(error, match=match):
    partition.balanced_split(costs, num_stages)


def test_check_balance_accepts_a_valid_list():
  assert partition.check_balance([3, 3, 2], num_units=8, num_stages=3) == (3, 3, 2)
  counts = partition.check_balance(np.array([1, 7]), num_units=8, num_stages=2)
  assert counts == (1, 7) and all(type(c) is int for c in counts)
  assert partition.check_balance((5,), num_units=5, num_stages=1) == (5,)


@pytest.mark.parametrize("balance, num_units, num_stages, error, match", [
    ([3, 3, 1], 8, 3, ValueError,
     r"^balance=\[3, 3, 1\] sums to 7 layer units but the model has 8; change the counts so "
     r"they add up to 8\.$"),
    ([3, 3, 3], 8, 3, ValueError, r"sums to 9 layer units but the model has 8"),
    ([4, 3, 0], 7, 3, ValueError,
     r"^balance\[2\] = 0: every stage needs at least one layer unit\.$"),
    ([4, -1, 4], 7, 3, ValueError, r"^balance\[1\] = -1: every stage needs"),
    ([4, 4], 8, 4, ValueError,
     r"^balance=\[4, 4\] has 2 entries but num_stages=4; give one layer-unit count per stage\.$"),
    ([4, 2.5, 1.5], 8, 3, TypeError,
     r"^balance\[1\] = 2.5 is not an int; give each stage a whole number of layer units\.$"),
    ([4, True], 5, 2, TypeError, r"balance\[1\] = True is not an int"),
    (8, 8, 1, TypeError,
     r"^balance must be a list with one layer-unit count per stage, e\.g\. \[3, 3, 2\]; got 8\.$"),
    ("44", 8, 2, TypeError, r"balance must be a list .*got '44'"),
    (np.ones((2, 2), int), 4, 2, TypeError, r"balance must be a list"),
])
def test_check_balance_errors(balance, num_units, num_stages, error, match):
  with pytest.raises(error, match=match):
    partition.check_balance(balance, num_units, num_stages)


def test_stage_costs():
  assert partition.stage_costs((3, 1), [1, 2, 3, 4]) == (6.0, 4.0)
  assert partition.stage_costs([1, 1, 1], np.array([0.5, 0, 2])) == (0.5, 0.0, 2.0)
  # Summed exactly and rounded once: math.fsum's answer, not the left-to-right float sum.
  costs = [1e16, 1.0, 1.0, -0.0]
  assert partition.stage_costs((3, 1), costs) == (math.fsum(costs[:3]), 0.0)
  assert partition.stage_costs((3, 1), costs)[0] != (1e16 + 1.0) + 1.0
  with pytest.raises(ValueError, match=r"sums to 3 layer units but the model has 4"):
    partition.stage_costs((2, 1), [1, 2, 3, 4])
  with pytest.raises(ValueError, match=r"costs\[0\] = -1 is negative"):
    partition.stage_costs((1,), [-1])


def test_describe_split_exact_text():
  assert partition.describe_split((2, 1, 1), [1, 2, 3, 4]) == (
      "stage  units  cost  share\n"
      "    0  0..1      3  30.0%\n"
      "    1  2         3  30.0%\n"
      "    2  3         4  40.0%\n"
      "imbalance (max / mean stage cost): 1.20")


def test_describe_split_with_names_and_float_costs():
  names = ["embed", "block_0", "block_1", "block_2", "head"]
  costs = [0.5, 1.25, 1.25, 1.25, 2.0]
  counts = partition.balanced_split(costs, 3)
  assert counts == (2, 2, 1)
  assert partition.describe_split(counts, costs, names=names) == (
      "stage  units             cost  share\n"
      "    0  embed..block_0    1.75  28.0%\n"
      "    1  block_1..block_2   2.5  40.0%\n"
      "    2  head                 2  32.0%\n"
      "imbalance (max / mean stage cost): 1.20")


def test_describe_split_whole_costs_and_zero_total():
  assert partition.describe_split((1, 1), [1_000_000, 2_500_000]) == (
      "stage  units       cost  share\n"
      "    0  0      1,000,000  28.6%\n"
      "    1  1      2,500,000  71.4%\n"
      "imbalance (max / mean stage cost): 1.43")
  assert partition.describe_split((1, 2), [0, 0, 0]) == (
      "stage  units  cost  share\n"
      "    0  0         0      -\n"
      "    1  1..2      0      -\n"
      "imbalance (max / mean stage cost): 1.00")


def test_describe_split_errors():
  with pytest.raises(ValueError, match=r"names has 2 entries but there are 3 layer units"):
    partition.describe_split((1, 2), [1, 2, 3], names=["a", "b"])
  with pytest.raises(TypeError, match=r"names must be a list with one name per layer unit"):
    partition.describe_split((1, 2), [1, 2, 3], names="abc")
  with pytest.raises(ValueError, match=r"balance\[1\] = 0: every stage needs"):
    partition.describe_split((3, 0), [1, 2, 3])


def test_module_doctests_pass():
  import doctest  # pylint: disable=import-outside-toplevel
  result = doctest.testmod(partition)
  assert result.failed == 0
  # The module's example and those of balanced_split (2), check_balance (2), stage_costs (2)
  # and describe_split (1).
  assert result.attempted >= 8
