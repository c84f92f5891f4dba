"""Balancing: which consecutive layer units each chunk holds, so the costliest is cheapest.

:func:`balanced_split` gives each chunk a run of consecutive units so that the costliest chunk is
as cheap as possible (an exact search), :func:`check_balance` validates a split the user writes
out, and :func:`stage_costs` and :func:`describe_split` report on either. Pure Python and NumPy.

  >>> balanced_split([1, 2, 3, 4], num_stages=2)   # 1 + 2 + 3 | 4
  (3, 1)
"""

from __future__ import annotations

import bisect
import fractions
import math
import numbers

import numpy as np


def _exact_costs(costs) -> list[fractions.Fraction]:
  """``costs`` as exact rationals; raises unless it is a 1-D sequence of finite reals >= 0."""
  if isinstance(costs, (str, bytes)) or not hasattr(costs, "__iter__"):
    raise TypeError(f"costs must be a sequence of numbers, one per layer unit; got {costs!r}.")
  if isinstance(costs, np.ndarray) and costs.ndim != 1:
    raise TypeError(f"costs must be 1-D, one number per layer unit; got shape {costs.shape}.")
  exact = []
  for i, c in enumerate(costs):
    if isinstance(c, (bool, np.bool_)) or not isinstance(c, numbers.Real):
      raise TypeError(f"costs[{i}] = {c!r} is not a real number; give one number per layer unit.")
    if isinstance(c, numbers.Rational):
      value = fractions.Fraction(int(c.numerator), int(c.denominator))
    elif not math.isfinite(c):
      raise ValueError(f"costs[{i}] = {c!r} is not finite; every layer unit needs a finite cost.")
    else:
      value = fractions.Fraction(*c.as_integer_ratio())  # Exact for every binary float.
    if value < 0:
      raise ValueError(f"costs[{i}] = {c!r} is negative; costs must be >= 0.")
    exact.append(value)
  return exact


def balanced_split(costs, num_stages: int) -> tuple[int, ...]:
  """The optimal split of consecutive layer units into stages: the costliest stage is cheapest.

  Stage ``s`` gets the ``counts[s]`` units that follow those of stages ``0..s-1``; every stage
  gets at least one. Among all such splits, the returned one minimizes the largest stage cost
  (the sum of its units' costs), exactly: costs are turned into exact rationals (every float is
  one), the optimal bottleneck is found by binary search over integers with a greedy feasibility
  check, and no rounding decides anything.

  Ties: many splits can share the optimal bottleneck. The one returned puts every stage boundary
  as early as any optimal split allows, i.e. for each ``k`` the first ``k`` stages hold the fewest
  units (and so the least cost) possible; its counts are the lexicographically smallest optimal
  counts. Early stages keep more micro-batches in flight under 1F1B-like schedules, so this keeps
  them light. It is built from the back: each stage, last first, takes as many units as fit under
  the bottleneck while leaving one unit for each stage before it.

  Args:
    costs: a finite cost >= 0 per layer unit (parameters, FLOPs or seconds); zeros are allowed.
    num_stages: the number of stages S, an int in ``[1, len(costs)]``.

  Returns:
    ``S`` ints >= 1 that sum to ``len(costs)``: the number of units on each stage.

  Raises:
    TypeError: ``costs`` is not a 1-D sequence of real numbers, or ``num_stages`` not an int.
    ValueError: a cost is negative or not finite (the index is named), ``costs`` is empty, or
      ``num_stages`` is outside ``[1, len(costs)]``.

  Example::

    >>> balanced_split([4, 1, 1, 1, 1], num_stages=2)   # The big unit alone: 4 | 4.
    (1, 4)
    >>> balanced_split([1] * 7, num_stages=3)   # Bottleneck 3; earlier stages lighter.
    (1, 3, 3)
  """
  exact = _exact_costs(costs)
  n = len(exact)
  if isinstance(num_stages, bool) or not isinstance(num_stages, (int, np.integer)):
    raise TypeError(f"num_stages must be an int, got {num_stages!r}.")
  num_stages = int(num_stages)
  if n == 0:
    raise ValueError("costs is empty: give one cost per layer unit, at least one unit per stage.")
  if not 1 <= num_stages <= n:
    raise ValueError(
        f"num_stages={num_stages} but the model has {n} layer units and every stage needs at "
        f"least one; use between 1 and {n} stages or split the model into more units.")

  # Integers on a common denominator: prefix sums and comparisons are then exact.
  denominator = math.lcm(*(c.denominator for c in exact))
  units = [c.numerator * (denominator // c.denominator) for c in exact]
  prefix = [0]
  for u in units:
    prefix.append(prefix[-1] + u)

  def fits(bound: int) -> bool:
    """Whether ``num_stages`` stages of cost <= bound cover all units (front-to-back greedy)."""
    start = 0
    for _ in range(num_stages):
      start = bisect.bisect_right(prefix, prefix[start] + bound) - 1
      if start == n:
        return True
    return False

  # Fewer, non-empty stages can always be split further at no cost, so "fits" is exactly the
  # feasibility of S non-empty stages; it is monotone in the bound, and the optimum is an integer.
  low, high = max(max(units), -(-prefix[n] // num_stages)), prefix[n]
  while low < high:
    middle = (low + high) // 2
    if fits(middle):
      high = middle
    else:
      low = middle + 1
  bound = low

  counts = [0] * num_stages
  end = n
  for stage in range(num_stages - 1, 0, -1):
    start = max(bisect.bisect_left(prefix, prefix[end] - bound), stage)
    counts[stage] = end - start
    end = start
  counts[0] = end
  assert prefix[end] <= bound and min(counts) >= 1, (costs, num_stages, counts)
  return tuple(counts)


def _as_counts(balance) -> list[int]:
  """``balance`` as a list of Python ints; raises TypeError unless it is a sequence of ints."""
  not_a_list = (isinstance(balance, (str, bytes)) or not hasattr(balance, "__iter__")
                or (isinstance(balance, np.ndarray) and balance.ndim != 1))
  if not_a_list:
    raise TypeError(
        f"balance must be a list with one layer-unit count per stage, e.g. [3, 3, 2]; "
        f"got {balance!r}.")
  counts = []
  for i, count in enumerate(balance):
    if isinstance(count, (bool, np.bool_)) or not isinstance(count, (int, np.integer)):
      raise TypeError(
          f"balance[{i}] = {count!r} is not an int; give each stage a whole number of layer "
          f"units.")
    counts.append(int(count))
  return counts


def check_balance(balance, num_units: int, num_stages: int) -> tuple[int, ...]:
  """Validates an explicit split: how many consecutive layer units each stage gets.

  Args:
    balance: one int >= 1 per stage, e.g. ``[3, 3, 2]``, summing to ``num_units``.
    num_units: the number of layer units in the model.
    num_stages: the number of pipeline stages.

  Returns:
    ``balance`` as a tuple of Python ints.

  Raises:
    TypeError: ``balance`` is not a sequence of ints.
    ValueError: it has the wrong length, an entry below 1, or the wrong sum; the message names
      the value and the fix.

  Example::

    >>> check_balance([3, 3, 2], num_units=8, num_stages=3)
    (3, 3, 2)
    >>> check_balance([3, 3, 1], num_units=8, num_stages=3)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: balance=[3, 3, 1] sums to 7 layer units but the model has 8; change the counts ...
  """
  counts = _as_counts(balance)
  if len(counts) != num_stages:
    raise ValueError(
        f"balance={counts} has {len(counts)} entries but num_stages={num_stages}; give one "
        f"layer-unit count per stage.")
  for i, count in enumerate(counts):
    if count < 1:
      raise ValueError(f"balance[{i}] = {count}: every stage needs at least one layer unit.")
  if sum(counts) != num_units:
    raise ValueError(
        f"balance={counts} sums to {sum(counts)} layer units but the model has {num_units}; "
        f"change the counts so they add up to {num_units}.")
  return tuple(counts)


def _stage_sums(counts, costs) -> tuple[tuple[int, ...], list[fractions.Fraction]]:
  """The validated counts and each stage's exact cost."""
  exact = _exact_costs(costs)
  counts = _as_counts(counts)
  counts = check_balance(counts, num_units=len(exact), num_stages=len(counts))
  sums, start = [], 0
  for count in counts:
    sums.append(sum(exact[start:start + count], fractions.Fraction(0)))
    start += count
  return counts, sums


def stage_costs(counts, costs) -> tuple[float, ...]:
  """The cost of each stage: the sum of its units' costs, correctly rounded to a float.

  Args:
    counts: consecutive units per stage, as :func:`balanced_split` returns or
      :func:`check_balance` accepts.
    costs: a finite cost >= 0 per layer unit.

  Returns:
    One float per stage.

  Raises:
    TypeError, ValueError: as :func:`check_balance` for ``counts`` (with ``len(costs)`` units)
      and as :func:`balanced_split` for ``costs``.

  Example::

    >>> stage_costs((3, 1), [1, 2, 3, 4])
    (6.0, 4.0)
    >>> stage_costs((2, 1), [0.1, 0.2, 0.3])   # Summed exactly, then rounded once.
    (0.30000000000000004, 0.3)
  """
  return tuple(float(total) for total in _stage_sums(counts, costs)[1])


def _cost_formatter(values):
  """Whole numbers (parameter counts, FLOPs) with thousands separators, else 4 digits."""
  if all(v.denominator == 1 and abs(v) < 10**15 for v in values):
    return lambda value: f"{int(value):,}"
  return lambda value: f"{float(value):.4g}"


def describe_split(counts, costs, names=None) -> str:
  """A table of a split: each stage's units, cost and share of the total, and the imbalance.

  The imbalance is the largest stage cost over the mean stage cost: the pipeline runs at the pace
  of its slowest stage, so ``1.00`` is perfect balance and ``1.25`` means a quarter more time per
  tick than a perfect split of the same total would need (1.00 too when every cost is zero).

  Args:
    counts: consecutive units per stage.
    costs: a finite cost >= 0 per layer unit.
    names: optional name per layer unit, shown instead of its index.

  Returns:
    The table as text, one line per stage after a header, then the imbalance line.

  Example::

    >>> print(describe_split((2, 1, 1), [1, 2, 3, 4]))
    stage  units  cost  share
        0  0..1      3  30.0%
        1  2         3  30.0%
        2  3         4  40.0%
    imbalance (max / mean stage cost): 1.20
  """
  counts, sums = _stage_sums(counts, costs)
  num_units = sum(counts)
  if names is None:
    names = [str(i) for i in range(num_units)]
  else:
    if isinstance(names, (str, bytes)) or not hasattr(names, "__iter__"):
      raise TypeError(f"names must be a list with one name per layer unit; got {names!r}.")
    names = [str(name) for name in names]
    if len(names) != num_units:
      raise ValueError(
          f"names has {len(names)} entries but there are {num_units} layer units; give one name "
          f"per unit or leave names=None.")
  total = sum(sums, fractions.Fraction(0))
  rows = [("stage", "units", "cost", "share")]
  format_cost = _cost_formatter(sums)
  start = 0
  for stage, (count, cost) in enumerate(zip(counts, sums)):
    first, last = names[start], names[start + count - 1]
    units = first if count == 1 else f"{first}..{last}"
    share = f"{float(100 * cost / total):.1f}%" if total else "-"
    rows.append((str(stage), units, format_cost(cost), share))
    start += count
  widths = [max(len(row[k]) for row in rows) for k in range(4)]
  lines = [f"{row[0]:>{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:>{widths[2]}}  "
           f"{row[3]:>{widths[3]}}".rstrip() for row in rows]
  imbalance = float(max(sums) * len(sums) / total) if total else 1.0
  lines.append(f"imbalance (max / mean stage cost): {imbalance:.2f}")
  return "\n".join(lines)
