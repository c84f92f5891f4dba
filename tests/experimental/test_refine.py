"""Exact window search (:mod:`tpipe.experimental.refine`; SciPy's HiGHS, no JAX): it finds a
ZB-H1 table shorter than the compound builder's under neighbour synchronisation, in no more
memory, for costs in any unit, and the same on every call; over every fused schedule, with
delayed links too, it never lengthens the step or grows a stage's memory; bad input raises;
the factory and the spec run it only when asked, and cache it. Only the bad-input test is in
the unit tier: a search takes seconds. The modules' doctests run as the suite's doctest items
(setup.cfg's ``--doctest-modules``), not again here.
"""

import numpy as np
import pytest

import tpipe
from tpipe import schedules
from tpipe.experimental import refine
from tpipe.experimental import search
from tpipe.schedules import compound

# ZB-H1's per-chunk MFLOP from experiments/fused_schedules.py, remat none: BI about 1.3 F, so a
# stage's F, BI and W nearly tie and neither one action per tick nor compound ticks fit well.
MEASURED = {"F": 403.4, "BI": 528.9, "W": 407.5}


def _memory(table):
  return table.peak_in_flight(), table.awaiting_weight().max(axis=0, initial=0)


@pytest.mark.parametrize("scale", [1e6, 1e-9], ids=["flops", "seconds"])
def test_finds_a_shorter_zb_h1_table_than_the_builder(scale):
  """S = 3, M = 3, the measured costs in FLOPs or in (sub-microsecond) seconds: the builder's
  best table takes 5320 MFLOP; the search finds 5198.6 (the last backward right behind the one
  before on every stage), 2.3% shorter, in the same stash and weight slots. (Its programs take
  the costs relative to the largest: given raw FLOPs or seconds, HiGHS's windows kept the
  table as it was.)"""
  costs = {kind: cost * scale for kind, cost in MEASURED.items()}
  built = compound.build("zb_h1", 3, 3, costs)
  found = refine.refine(built, costs, sweeps=1)
  before, after = built.simulate(costs), found.simulate(costs)
  assert after.neighbour < 0.98 * before.neighbour, (before.neighbour, after.neighbour)
  assert after.natural <= after.neighbour
  for was, now in zip(_memory(built), _memory(found)):
    np.testing.assert_array_less(now - 1, was)  # now <= was, stage by stage.


@pytest.mark.parametrize("name, stages, microbatches, delays", [
    ("1f1b", 3, 4, None), ("zb_h1", 3, 3, None), ("zb_h1", 3, 4, (0, 1, 0)),
    ("zbv", 2, 3, None), ("interleaved_1f1b", 2, 4, None)])
def test_never_longer_and_never_more_memory(name, stages, microbatches, delays):
  """Random costs, the builder's compound table and the one-action table: the search's table is
  valid (it is constructed, so it passed the table checks), runs every action once, and its
  step and each stage's stash and weight slots are at most the source's."""
  rng = np.random.default_rng(len(name) + stages + microbatches)
  repeats = 2 if name in ("zbv", "interleaved_1f1b") else 1
  split = name in ("zb_h1", "zbv")
  costs = {k: float(v) for k, v in zip(("F", "BI", "W") if split else ("F", "B"),
                                       rng.uniform(0.5, 3.0, 3 if split else 2))}
  plain = schedules.build(name, stages, microbatches, repeats, delays)
  built = schedules.build(name, stages, microbatches, repeats, delays, costs)
  for source in (plain, built):
    found = refine.refine(source, costs, windows=(4,), sweeps=2)
    assert sorted(a[2:] for a in found.actions()) == sorted(a[2:] for a in source.actions())
    assert found.delays == source.delays
    step = found.simulate(costs).neighbour
    assert step <= source.simulate(costs).neighbour * (1 + 1e-9)
    for was, now in zip(_memory(source), _memory(found)):
      assert np.all(now <= was), (now, was)


@pytest.mark.unit  # The search itself takes seconds: the other tests run in the full suite.
def test_bad_input_raises():
  table = schedules.build("zb_h1", 2, 2)
  with pytest.raises(TypeError, match="takes a FusedSchedule"):
    refine.refine(schedules.build("gpipe", 2, 2), MEASURED)
  with pytest.raises(ValueError, match="forward-only"):
    refine.refine(_forward_only(), MEASURED)
  with pytest.raises(ValueError, match=r"windows must be ints >= 2, got \(1,\)"):
    refine.refine(table, MEASURED, windows=(1,))
  with pytest.raises(ValueError, match="sweeps must be an int >= 1, got 0"):
    refine.refine(table, MEASURED, sweeps=0)
  with pytest.raises(ValueError, match="node_limit must be an int >= 1"):
    refine.refine(table, MEASURED, node_limit=True)
  with pytest.raises(ValueError, match=r"needs \['F', 'BI', 'W'\]"):
    refine.refine(table, {"F": 1.0, "B": 2.0})


def _forward_only():
  """A forward-only fused table (the forward of GPipe as one)."""
  rows = [[(schedules.Action.F, 0, 0)], [(schedules.Action.F, 1, 0)]]
  return schedules.fused.from_ticks("gpipe", 1, 2, 1, "loop", [[row] for row in rows],
                                    forward_only=True)


def test_a_searched_spec_runs_the_search_only_when_asked():
  """S = 3, M = 3: the search shortens the builder's table (5320 -> 5199); the spec variant
  caches it, and a second search gives the same table (no time limit: the same on every
  host). The stable spec and factory know nothing of the search."""
  costs = MEASURED
  built = schedules.build("zb_h1", 3, 3, 1, None, costs)
  plain = tpipe.PipelineSpec(num_stages=3, num_microbatches=3, schedule="zb_h1",
                             tick_costs=costs)
  assert "tick_search" not in tpipe.spec.field_names()
  with pytest.raises(TypeError, match="unexpected keyword argument 'search'"):
    schedules.build("zb_h1", 3, 3, 1, None, costs, search=1)
  spec = search.with_search(plain, 1)
  searched = spec.table
  assert isinstance(spec, tpipe.PipelineSpec) and spec.tick_search == 1
  assert search.with_search(plain, 1).table is searched  # Cached.
  assert searched.actions() == refine.refine(built, costs, sweeps=1).actions()  # Deterministic.
  assert searched.simulate(costs).neighbour < built.simulate(costs).neighbour
  assert plain.table is built and spec.replace(tick_search=0).table is built
  assert spec.replace(num_microbatches=4).tick_search == 1  # replace keeps the variant.
  with pytest.raises(ValueError, match=r"search=1 re-places .* pass costs \(tick_costs\)"):
    spec.replace(tick_costs=None)
  with pytest.raises(ValueError, match=r"search=1 re-places .* pass costs \(tick_costs\)"):
    search.with_search(plain.replace(tick_costs="plain"), 1)
  with pytest.raises(ValueError, match="must be >= 0 sweeps, got -1"):
    spec.replace(tick_search=-1)
  with pytest.raises(TypeError, match="must be an int >= 0"):
    spec.replace(tick_search=True)
  with pytest.raises(TypeError, match="must be an int >= 0"):
    search.with_search(plain, 1.0)
  with pytest.raises(TypeError, match="spec must be a tpipe.PipelineSpec"):
    search.with_search({"schedule": "zb_h1"}, 1)
