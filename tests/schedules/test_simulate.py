"""tpipe.schedules.simulate: a fused table's step time under per-action costs, lockstep (SPMD),
neighbour-synchronised and dependency-driven, worked out by hand."""

import numpy as np
import pytest

from tpipe import schedules
from tpipe.schedules import simulate as simulate_lib
from tpipe.schedules.simulate import action_costs

pytestmark = pytest.mark.unit


def test_simulate_lockstep_and_natural_time_by_hand():
  s = schedules.build("1f1b", 2, 3)
  timing = s.simulate({"F": 1, "B": 2})
  # Per tick, the slowest stage: F F | B B B B B B (tick 2 onwards has a B somewhere).
  assert timing.lockstep == 1 + 1 + 6 * 2
  # Dependency-driven: F0 F1 on stage 0 (0-2), stage 1 F0 (1-2) B0 (2-4) F1 (4-5) B1 (5-7)
  # F2 (7-8) B2 (8-10); stage 0 B2 (10-12).
  assert timing.natural == 12 == 3 * (3 + 2 - 1)
  np.testing.assert_array_equal(timing.busy, [9, 9])
  assert timing.natural_bubble == pytest.approx(1 / 4)
  assert timing.lockstep_bubble == pytest.approx(1 - 18 / 28)


def test_default_costs_and_the_function_agree_with_the_method():
  s = schedules.build("zb_h1", 2, 2)
  assert schedules.DEFAULT_COSTS == {"F": 1.0, "B": 2.0, "BI": 1.0, "W": 1.0}
  default = s.simulate()
  explicit = simulate_lib.simulate(s, {"F": 1, "BI": 1, "W": 1})
  assert (default.lockstep, default.natural) == (explicit.lockstep, explicit.natural) == (7, 7)
  np.testing.assert_array_equal(default.busy, explicit.busy)
  # Unequal costs. The table: stage 0  F0 F1 .   BI0 W0  BI1 W1
  #                          stage 1  .  F0 BI0 F1  BI1 W0  W1
  slow = s.simulate({"F": 3, "BI": 1, "W": 1})
  # Lockstep: the costliest action of each tick.
  assert slow.lockstep == 3 + 3 + 1 + 3 + 1 + 1 + 1
  # Natural: stage 0 F0 (0-3) F1 (3-6); stage 1 F0 (3-6) BI0 (6-7) F1 (7-10) BI1 (10-11)
  # W0 (11-12) W1 (12-13); stage 0 BI0 (7-8) W0 (8-9) BI1 (11-12) W1 (12-13).
  assert slow.natural == 13
  np.testing.assert_array_equal(slow.busy, [10, 10])


def test_a_forward_only_table_costs_its_forwards():
  f = schedules.build("1f1b", 3, 4).forward_pass()
  timing = f.simulate({"F": 2})
  assert timing.lockstep == timing.natural == 2 * (4 + 3 - 1)
  np.testing.assert_array_equal(timing.busy, [8, 8, 8])


@pytest.mark.parametrize("costs,match", [
    ({"F": 1, "X": 1}, r"unknown actions \['X'\]"),
    ({"F": 1, "B": 2}, "no entry for 'BI'"),
    ({"F": -1, "BI": 1, "W": 1}, r"costs\['F'\] must be >= 0"),
])
def test_simulate_bad_costs(costs, match):
  with pytest.raises(ValueError, match=match):
    schedules.build("zb_h1", 2, 2).simulate(costs)


def test_neighbour_synchronised_time_by_hand():
  # Three stages, two ticks; stage 2 exchanges with stage 1 only, unless the chunks wrap.
  cost = np.array([[3.0, 0.0, 1.0],
                   [1.0, 1.0, 3.0]])
  straight = simulate_lib.exchange_partners(3, wrap=False)
  assert straight == [(1,), (0, 2), (1,)]
  # Tick 0 ends at [3, 0, 1]. Tick 1: stage 0 waits for itself and stage 1 (3), stage 1 for all
  # three (3), stage 2 for itself and stage 1 (1): ends [4, 4, 4].
  assert simulate_lib.neighbour_time(cost, straight) == 4
  # Round the ring stage 2 also waits for stage 0 (3) and ends at 6: the lockstep time here.
  ring = simulate_lib.exchange_partners(3, wrap=True)
  assert ring == [(1, 2), (0, 2), (0, 1)]
  assert simulate_lib.neighbour_time(cost, ring) == 6 == cost.max(axis=1).sum()


def test_one_f_one_b_on_three_stages_by_hand():
  s = schedules.build("1f1b", 3, 2)
  # stage 0: F0 F1  .  .  . B0  . B1
  # stage 1:  . F0 F1  . B0  . B1  .
  # stage 2:  .  . F0 B0 F1 B1  .  .
  timing = s.simulate({"F": 1, "B": 2})
  # Neighbour ends per tick: [1,0,0] [2,2,0] [2,3,3] [3,3,5] [3,7,6] [9,7,9] [9,11,9] -> 13:
  # stage 1's B0 (tick 4, ending at 7) holds up both neighbours' tick 5, so nothing is gained
  # over lockstep.
  assert timing.neighbour == timing.lockstep == 13
  assert timing.natural == 12
  assert timing.neighbour_bubble == pytest.approx(1 - 18 / 39)


@pytest.mark.parametrize("name,stages,microbatches,repeats", [
    ("1f1b", 4, 8, 1), ("zb_h1", 8, 32, 1), ("zbv", 4, 8, 2), ("interleaved_1f1b", 4, 8, 2),
    ("gpipe", 4, 8, 1), ("circular", 4, 8, 2),
])
@pytest.mark.parametrize("costs", [None, {"F": 1.0, "B": 3.3, "BI": 2.3, "W": 1.0}])
def test_the_three_time_models_are_ordered(name, stages, microbatches, repeats, costs):
  table = schedules.build(name, stages, microbatches, repeats)
  timing = schedules.whole_step(table).simulate(costs)
  assert timing.natural <= timing.neighbour + 1e-9
  assert timing.neighbour <= timing.lockstep + 1e-9
  assert 0 <= timing.natural_bubble <= timing.neighbour_bubble <= timing.lockstep_bubble < 1


@pytest.mark.parametrize("cost,partners,match", [
    (np.zeros(3), [(1,), (0, 2), (1,)], r"cost must be \[ticks, stages\]"),
    (np.zeros((2, 3)), [(1,), (0,)], "for each of the 3 stages"),
    (np.zeros((2, 3)), [(1,), (0, 3), (1,)], r"stages in range\(3\)"),
])
def test_neighbour_time_rejects_mismatched_costs_and_partners(cost, partners, match):
  with pytest.raises(ValueError, match=match):
    simulate_lib.neighbour_time(cost, partners)


def test_whole_step_is_a_fused_table_itself_or_a_forward_schedules_from_forward():
  fused = schedules.build("1f1b", 2, 3)
  assert schedules.whole_step(fused) is fused
  gpipe = schedules.build("gpipe", 2, 3)
  np.testing.assert_array_equal(schedules.whole_step(gpipe).action,
                                schedules.whole_step(gpipe).action)


# ------------------------------------------------------------------------------------------
# Transfer times per link, and delayed links.

@pytest.mark.parametrize("name,repeats", [("gpipe", 1), ("1f1b", 1), ("zbv", 2),
                                          ("circular", 2)])
def test_instant_transfers_without_delays_are_the_neighbour_model(name, repeats):
  step = schedules.whole_step(schedules.build(name, 4, 8, repeats))
  cost = action_costs(step)
  wrap = step.num_chunks > 1
  linked = simulate_lib.linked_time(cost, simulate_lib.ring_links(4, wrap))
  assert linked == simulate_lib.neighbour_time(cost, simulate_lib.exchange_partners(4, wrap))
  assert step.simulate().exposed_transfer == 0


def test_transfer_time_by_hand():
  # Two stages over link 0: tick 0 costs [1, 0], tick 1 [0, 1].
  cost = np.array([[1.0, 0.0], [0.0, 1.0]])
  # Without delay the exchange starts when both ended tick 0 (at 1) and takes 0.5: tick 1 starts
  # at 1.5 on both, stage 1 ends at 2.5.
  assert simulate_lib.linked_time(cost, [0], transfer=[0.5, 0.0]) == 2.5
  # Delayed, it starts with tick 0 (at 0) and is done at 0.5, before stage 0 finishes tick 0:
  # tick 1 starts at 1 on stage 0 and at 0.5 on stage 1, which ends at 1.5.
  assert simulate_lib.linked_time(cost, [0], transfer=[0.5, 0.0], delays=(1, 0)) == 1.5
  # A send longer than the tick shows only by what exceeds it: 1.2 - 0 on stage 1.
  assert simulate_lib.linked_time(cost, [0], transfer=[1.2, 0.0], delays=(1, 0)) == 2.2
  assert simulate_lib.ring_links(4, wrap=False) == (0, 1, 2)
  assert simulate_lib.ring_links(4, wrap=True) == (0, 1, 2, 3)
  assert simulate_lib.ring_links(1, wrap=True) == ()


@pytest.mark.parametrize("name,repeats", [("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("zbv", 2)])
def test_delaying_the_slow_links_hides_their_sends_behind_a_tick_of_compute(name, repeats):
  slow = [0.0, 0.5, 0.0, 0.5]  # Links 1 and 3 cross slices; a send takes half a forward.
  plain = schedules.whole_step(schedules.build(name, 4, 8, repeats)).simulate(transfer=slow)
  delayed = schedules.whole_step(
      schedules.build(name, 4, 8, repeats, delays=(0, 1, 0, 1))).simulate(transfer=slow)
  assert plain.exposed_transfer > 4 * delayed.exposed_transfer > 0
  assert delayed.neighbour < plain.neighbour


@pytest.mark.parametrize("links,transfer,match", [
    ([0, 2], None, r"links must be in range\(2\)"),
    ([0], [-1.0, 0.0], "transfer times must be finite and >= 0"),
])
def test_linked_time_rejects_bad_links_and_transfers(links, transfer, match):
  with pytest.raises(ValueError, match=match):
    simulate_lib.linked_time(np.zeros((2, 2)), links, transfer)


# ------------------------------------------------------------------------------------------
# The chain of ticks that sets the neighbour-synchronised step.

def test_critical_path_by_hand():
  # Three stages, links 0 and 1. Tick 0 costs [1, 0, 3]; tick 1 [2, 1, 0]; tick 2 [0, 0, 1].
  cost = np.array([[1.0, 0.0, 3.0], [2.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
  # Tick 1 starts at 1 on stage 0 (it and stage 1 are done at 1) and at 3 on stages 1 and 2
  # (stage 2 ends tick 0 at 3); tick 2 starts at max(3, 4) = 4 on stage 2 (stage 1 ends tick 1
  # at 4) and ends at 5: the chain is stage 2's tick 0, stage 1's tick 1, stage 2's tick 2.
  assert simulate_lib.linked_time(cost, [0, 1]) == 5
  assert simulate_lib.critical_path(cost, [0, 1]) == [(0, 2), (1, 1), (2, 2)]
  # With a transfer of 0.5 on link 1 the chain is the same and crosses link 1 twice: 5 + 1.
  assert simulate_lib.linked_time(cost, [0, 1], transfer=[0.0, 0.5, 0.0]) == 6
  assert simulate_lib.critical_path(cost, [0, 1], transfer=[0.0, 0.5, 0.0]) == [
      (0, 2), (1, 1), (2, 2)]
  # Link 1 delayed: tick 1 on stage 1 waits only for stage 2 to *start* tick 0 (at 0), so it
  # runs 1-2 beside stage 2's tick 0; stage 2 starts tick 2 at max(3, start of stage 1's tick
  # 1 = 1) = 3: its own ticks alone set the step, 3 + 1.
  assert simulate_lib.linked_time(cost, [0, 1], delays=(0, 1, 0)) == 4
  assert simulate_lib.critical_path(cost, [0, 1], delays=(0, 1, 0)) == [(0, 2), (2, 2)]
  assert simulate_lib.critical_path(np.zeros((0, 3)), [0, 1]) == []
  # Over a delayed link a tick waits for the neighbour's *start* of the tick before, so that
  # tick's cost is not on the chain. Stage 0 runs 0-5 (tick 1) and 5-9 (tick 2); stage 1 starts
  # tick 3 when stage 0 started tick 2, at 5, and ends at 11: stage 0's tick 1, stage 1's tick 3.
  cost = np.array([[0.0, 1.0], [5.0, 0.0], [4.0, 0.0], [0.0, 6.0]])
  assert simulate_lib.linked_time(cost, [0], delays=(1, 0)) == 11
  assert simulate_lib.critical_path(cost, [0], delays=(1, 0)) == [(1, 0), (3, 1)]


@pytest.mark.parametrize("name,repeats,delays,transfer", [
    ("1f1b", 1, None, None), ("zb_h1", 1, None, 0.3), ("zbv", 2, None, None),
    ("zbv", 2, (0, 1, 0, 1), 0.5), ("interleaved_1f1b", 2, None, 0.2)])
def test_the_critical_path_adds_up_to_the_step(name, repeats, delays, transfer):
  costs = {"F": 1.0, "B": 3.1, "BI": 2.3, "W": 0.9}
  table = schedules.build(name, 4, 8, repeats, delays=delays,
                          costs={k: costs[k] for k in (("F", "BI", "W") if name in ("zb_h1", "zbv")
                                                       else ("F", "B"))})
  per_tick = table.tick_costs(costs)
  chain = table.critical_path(costs, transfer)
  timing = table.simulate(costs, transfer)
  ticks = [t for t, _ in chain]
  assert ticks == sorted(set(ticks))  # One entry per tick at most, in tick order.
  assert all(per_tick[t, s] > 0 for t, s in chain)
  # A tick waits only for its neighbours: over k ticks the chain moves k stages at most.
  for (t, a), (u, b) in zip(chain, chain[1:]):
    apart = abs(a - b) if table.num_chunks == 1 else min(abs(a - b), 4 - abs(a - b))
    assert apart <= u - t
  compute = sum(per_tick[t, s] for t, s in chain)
  if transfer is None:
    assert compute == pytest.approx(timing.neighbour)
  else:  # The rest of the step is whole transfers, one per link the chain crosses.
    crossings = (timing.neighbour - compute) / transfer
    assert crossings == pytest.approx(round(crossings), abs=1e-6)
    assert 0 <= round(crossings) <= len(chain)


def test_tick_slack_by_hand():
  # Two stages, one link. Tick 0 costs [1, 3], tick 1 [2, 1]: both start tick 1 at 3 and the
  # step is 5 (stage 0). Stage 0's tick 0 could end at 3, when tick 1 starts anyway (2 to
  # spare); stage 1's tick 1 ends at 4 (1 to spare); the other two set the step.
  cost = np.array([[1.0, 3.0], [2.0, 1.0]])
  np.testing.assert_allclose(simulate_lib.tick_slack(cost, [0]), [[2.0, 0.0], [0.0, 1.0]])
  # A transfer on the link delays both ticks 1 alike: the same slack.
  np.testing.assert_allclose(simulate_lib.tick_slack(cost, [0], transfer=0.5),
                             [[2.0, 0.0], [0.0, 1.0]])
  # Delayed link: tick 1 waits for the neighbour's *start* of tick 0. Stage 0 runs 1-3, stage 1
  # 3-4 (its own tick 0 ends at 3): step 4. Stage 0 has 1 to spare in each tick: its tick 0 may
  # end at 2, so its tick 1 still ends at 4.
  np.testing.assert_allclose(simulate_lib.tick_slack(cost, [0], delays=(1, 0)),
                             [[1.0, 0.0], [1.0, 0.0]])
  assert simulate_lib.tick_slack(np.zeros((0, 2)), [0]).shape == (0, 2)
  with pytest.raises(ValueError, match="links must be in range"):
    simulate_lib.tick_slack(cost, [2])


@pytest.mark.parametrize("seed", range(12))
def test_tick_slack_is_exactly_what_an_entry_may_add(seed):
  # Adding an entry's slack to its cost leaves the step; adding a little more lengthens it; the
  # critical path has none. Random tables, rings and lines, transfers and delayed links.
  rng = np.random.default_rng(seed)
  for _ in range(8):
    ticks, stages = int(rng.integers(1, 7)), int(rng.integers(2, 6))
    cost = rng.integers(0, 5, (ticks, stages)).astype(float)
    links = simulate_lib.ring_links(stages, bool(rng.integers(2)) and stages > 2)
    delays = tuple(int(d) for d in rng.integers(0, 2, stages)) if rng.integers(2) else None
    transfer = rng.random(stages) if rng.integers(2) else None
    step = simulate_lib.linked_time(cost, links, transfer, delays)
    slack = simulate_lib.tick_slack(cost, links, transfer, delays)
    assert (slack >= -1e-12).all()
    for t, s in np.ndindex(cost.shape):
      more = cost.copy()
      more[t, s] += slack[t, s]
      assert simulate_lib.linked_time(more, links, transfer, delays) == pytest.approx(step)
      more[t, s] += 0.01
      assert simulate_lib.linked_time(more, links, transfer, delays) > step
    for t, s in simulate_lib.critical_path(cost, links, transfer, delays):
      assert slack[t, s] == pytest.approx(0.0, abs=1e-12)
