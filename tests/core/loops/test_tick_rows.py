"""tpipe.core.loops.tick_rows: the rows the fused tick loop scans over, checked against small tables
drawn by hand (a 2-stage 1F1B and ZB-H1 on 2 micro-batches, and a compound 1F1B), and the weight
slots and lane switches of the named tables. Pure NumPy.
"""

import numpy as np
import pytest

from tests.helpers.schedule_tables import assert_table
from tests.helpers.schedule_tables import fused
from tpipe import schedules
from tpipe.core.loops import tick_rows

pytestmark = pytest.mark.unit

_ = schedules.IDLE

ONE_F_ONE_B = """
F0 F1 .  B0 .  B1
.  F0 B0 F1 B1 .
"""
ONE_F_ONE_B_SLOTS = [[0, 1, _, 0, _, 1], [_, 0, 0, 0, 0, _]]
ZB_H1 = """
F0 F1 .   BI0 W0  BI1 W1
.  F0 BI0 F1  BI1 W0  W1
"""
ZB_H1_SLOTS = [[0, 1, _, 0, 0, 1, 1], [_, 0, 0, 1, 1, 0, 1]]
TWO_PROGRAMS = [0, 1]  # Model chunk c runs chunk program c.
ONE_PROGRAM = [0, 0]  # Both model chunks share one program.


def _one_f_one_b():
  return fused(ONE_F_ONE_B, ONE_F_ONE_B_SLOTS, 2, 2)


def _zb_h1():
  return fused(ZB_H1, ZB_H1_SLOTS, 2, 2)


def test_the_drawn_tables_are_the_named_schedules():
  assert_table(schedules.build("1f1b", 2, 2), ONE_F_ONE_B)
  assert_table(schedules.build("zb_h1", 2, 2), ZB_H1)


def test_tick_branches_of_1f1b():
  # 1 + action * programs + program: F of program p is 1 + p, B is 3 + p.
  branch, chunk = tick_rows.tick_branches(_one_f_one_b(), TWO_PROGRAMS)
  np.testing.assert_array_equal(branch.T, [[1, 1, 0, 3, 0, 3], [0, 2, 4, 2, 4, 0]])
  np.testing.assert_array_equal(chunk.T, [[0] * 6, [1] * 6])
  branch, _ = tick_rows.tick_branches(_one_f_one_b(), ONE_PROGRAM)
  np.testing.assert_array_equal(branch.T, [[1, 1, 0, 2, 0, 2], [0, 1, 2, 1, 2, 0]])


def test_tick_branches_of_zb_h1():
  # BI of program p is 5 + p, W is 7 + p; no B.
  branch, _ = tick_rows.tick_branches(_zb_h1(), TWO_PROGRAMS)
  np.testing.assert_array_equal(branch.T, [[1, 1, 0, 5, 7, 5, 7], [0, 2, 6, 2, 6, 8, 8]])


def test_branch_numbers_decode_to_each_entrys_action_and_program():
  table = _zb_h1()
  numbers = tick_rows.BranchNumbers(num_programs=2)
  assert numbers.size == 9  # Idle, then 4 actions x 2 programs.
  branch, chunk = tick_rows.tick_branches(table, TWO_PROGRAMS)
  for (r, s), number in np.ndenumerate(branch):
    if table.action[r, s] < 0:
      assert number == tick_rows.IDLE and numbers.decode(number) is None
      assert numbers.is_forward_or_idle(number)
    else:
      assert numbers.decode(number) == (table.action[r, s], TWO_PROGRAMS[chunk[r, s]])
      assert numbers.is_forward_or_idle(number) == (table.action[r, s] == schedules.Action.F)
  assert sorted({numbers.number(a, p) for a in schedules.Action for p in (0, 1)}) == list(
      range(1, numbers.size))  # Every number once.


def test_lane_switches_hold_idle_and_the_branches_run():
  assert tick_rows.lane_switches(_one_f_one_b(), TWO_PROGRAMS) == [(0, 1, 2, 3, 4)]
  assert tick_rows.lane_switches(_one_f_one_b(), ONE_PROGRAM) == [(0, 1, 2)]
  assert tick_rows.lane_switches(_zb_h1(), TWO_PROGRAMS) == [(0, 1, 2, 5, 6, 7, 8)]
  assert tick_rows.lane_switches(_zb_h1(), ONE_PROGRAM) == [(0, 1, 3, 4)]


def test_weight_slots_of_zb_h1():
  # Stage 1 holds micro-batch 0's slot from BI0 (tick 2) to W0 (tick 5), so BI1 takes slot 1.
  np.testing.assert_array_equal(tick_rows.weight_slots(_zb_h1()).T,
                                [[0] * 7, [0, 0, 0, 0, 1, 0, 1]])
  assert not np.any(tick_rows.weight_slots(_one_f_one_b()))


def test_tick_rows_of_1f1b():
  rows = tick_rows.tick_rows(_one_f_one_b(), TWO_PROGRAMS)
  lanes = rows["lanes"]
  assert set(lanes) == {"chunk", "microbatch", "stash", "forward", "send_dir", "sends",
                        "send_slot", "recv_slot", "weight_slot", "branch"}
  assert all(value.shape == (6, 1, 2) for value in lanes.values())
  row = lambda key: lanes[key][:, 0].T.tolist()
  assert row("branch") == [[1, 1, 0, 3, 0, 3], [0, 2, 4, 2, 4, 0]]  # Positions in (0, 1, 2, 3, 4).
  assert row("chunk") == [[0] * 6, [1] * 6]
  assert row("microbatch") == [[0, 1, 0, 0, 0, 1], [0, 0, 0, 1, 1, 0]]  # Idle reads 0.
  assert row("stash") == [[0, 1, 0, 0, 0, 1], [0] * 6]
  assert row("forward") == [[True, True, False, False, False, False],
                            [False, True, False, True, False, False]]
  assert row("send_dir") == [[1, 1, 0, 0, 0, 0], [0, 0, -1, 0, -1, 0]]
  assert row("sends") == [[True, True, False, False, False, False],
                          [False, False, True, False, True, False]]
  assert row("weight_slot") == [[0] * 6, [0] * 6]
  assert rows["arrival"].shape == (6, 2, 3)
  # Stage 1 gets F0's and F1's activations at ticks 1 and 2, stage 0 the gradients at 3 and 5.
  arrived = np.argwhere(rows["arrival"] >= 0).tolist()
  assert arrived == [[1, 1, 0], [2, 1, 0], [3, 0, 1], [5, 0, 1]]


def test_tick_rows_of_zb_h1_positions_and_weight_slots():
  lanes = tick_rows.tick_rows(_zb_h1(), TWO_PROGRAMS)["lanes"]
  # Positions in the switch (0, 1, 2, 5, 6, 7, 8).
  assert lanes["branch"][:, 0].T.tolist() == [[1, 1, 0, 3, 5, 3, 5], [0, 2, 4, 2, 4, 6, 6]]
  assert lanes["weight_slot"][:, 0].T.tolist() == [[0] * 7, [0, 0, 0, 0, 1, 0, 1]]
  assert lanes["stash"][:, 0].T.tolist() == [[0, 1, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 0, 1]]


def test_a_compound_table_in_lanes():
  table = schedules.build("1f1b", 2, 2, costs={"F": 1, "B": 2})
  np.testing.assert_array_equal(table.tick, [0, 1, 1, 2, 2, 3])
  assert table.lanes == 2
  by_lane = tick_rows.by_lanes(table, table.action, fill=-1)
  assert by_lane.shape == (4, 2, 2)
  assert by_lane.transpose(2, 0, 1).tolist() == [
      [[0, -1], [0, -1], [1, -1], [1, -1]],  # Stage 0: one row in each tick.
      [[-1, -1], [0, 1], [0, 1], [-1, -1]]]  # Stage 1: F then B in ticks 1 and 2.
  # Lane 1 runs stage 1's B of program 1 only.
  assert tick_rows.lane_switches(table, TWO_PROGRAMS) == [(0, 1, 2, 3), (0, 4)]
  branch = tick_rows.tick_rows(table, TWO_PROGRAMS)["lanes"]["branch"]
  assert branch[:, 1].T.tolist() == [[0, 0, 0, 0], [0, 1, 1, 0]]


def test_a_compound_table_in_pairs():
  """With micro-batches overlapped, stage 1's F and B of ticks 1 and 2 run as pairs: idle in
  their lanes' switches (lane 1 then holds idle alone), the pair's number on lane 0."""
  table = schedules.build("1f1b", 2, 2, costs={"F": 1, "B": 2})
  first = tick_rows.paired(table)
  assert first.T.tolist() == [[False] * 6, [False, True, False, True, False, False]]
  # Lanes 0 and 1 pair F of program 1 (number 2) with B of program 1 (number 4).
  assert tick_rows.pair_switches(table, TWO_PROGRAMS) == [((2, 4),), ()]
  assert tick_rows.lane_switches(table, TWO_PROGRAMS, overlap=True) == [(0, 1, 3), (0,)]
  lanes = tick_rows.tick_rows(table, TWO_PROGRAMS, overlap=True)["lanes"]
  assert lanes["pair"][:, 0].T.tolist() == [[0, 0, 0, 0], [0, 1, 1, 0]]
  assert not lanes["pair"][:, 1].any()
  # The rows of pairs are idle in the lanes' switches (1 + 2 = 3, and 0 for idle in lane 1).
  assert lanes["branch"][:, 0].T.tolist() == [[1, 1, 2, 2], [0, 0, 0, 0]]
  assert not lanes["branch"][:, 1].any()
  # What is not the branch is the table's, as without pairs.
  plain = tick_rows.tick_rows(table, TWO_PROGRAMS)["lanes"]
  for key in set(plain) - {"branch"}:
    np.testing.assert_array_equal(lanes[key], plain[key])


@pytest.mark.parametrize("name,stages,microbatches,repeats", [
    ("1f1b", 4, 8, 1), ("zb_h1", 4, 8, 1), ("zbv", 4, 8, 2), ("interleaved_1f1b", 4, 8, 2)])
def test_pairs_join_a_forward_and_a_backward_of_one_tick(name, stages, microbatches, repeats):
  """Every pair is a forward beside a backward (B or BI) of the same stage and tick, in adjacent
  rows; no row is in two pairs; every adjacent F and backward of a tick whose first row is not
  already taken pairs; and the pairs' rows leave their lanes' switches."""
  costs = {"F": 1, "B": 3, "BI": 2, "W": 1}
  table = schedules.build(name, stages, microbatches, repeats, costs=costs)
  first = tick_rows.paired(table)
  assert first.any()
  action, tick = table.action, table.tick
  kinds = {schedules.Action.F, schedules.Action.B, schedules.Action.BI}
  taken = np.zeros_like(first)
  for r, s in zip(*np.nonzero(first)):
    assert tick[r] == tick[r + 1]
    assert {int(action[r, s]), int(action[r + 1, s])} <= {int(k) for k in kinds}
    assert (action[r, s] == schedules.Action.F) != (action[r + 1, s] == schedules.Action.F)
    assert not taken[r, s] and not taken[r + 1, s]
    taken[r, s] = taken[r + 1, s] = True
  for r in range(table.num_rows - 1):
    for s in range(stages):
      forward = [action[q, s] == schedules.Action.F for q in (r, r + 1)]
      backward = [action[q, s] in (schedules.Action.B, schedules.Action.BI) for q in (r, r + 1)]
      if (tick[r] == tick[r + 1] and not taken[r, s]
              and ((forward[0] and backward[1]) or (backward[0] and forward[1]))):
        raise AssertionError(f"row {r}, stage {s} pairs with the next row but is not paired")
  programs = list(range(stages * repeats))
  numbers = tick_rows.by_lanes(table, tick_rows.tick_branches(table, programs)[0])
  lanes = tick_rows.tick_rows(table, programs, overlap=True)["lanes"]
  pairs = tick_rows.pair_switches(table, programs)
  for lane, switch in enumerate(tick_rows.lane_switches(table, programs, overlap=True)):
    # Each row runs once: in its lane's switch, or in the pair its lane's "pair" names.
    in_lane = np.asarray(switch)[lanes["branch"][:, lane]]
    paired_here = lanes["pair"][:, lane] > 0
    paired_before = lanes["pair"][:, lane - 1] > 0 if lane else np.zeros_like(paired_here)
    np.testing.assert_array_equal(np.where(paired_here | paired_before, 0, numbers[:, lane]),
                                  in_lane)
    for t, s in zip(*np.nonzero(paired_here)):
      assert pairs[lane][lanes["pair"][t, lane, s] - 1] == (numbers[t, lane, s],
                                                            numbers[t, lane + 1, s])


@pytest.mark.parametrize("writes_sums,together,apart", [
    ([False, False, False], [0, 1, 2], []),
    ([False, True, False], [0, 2], [1]),  # One backward runs apart too.
    ([False, True, False, True], [0, 2], [1, 3]),
    ([0, 1, 1], [0], [1, 2]),
])
def test_lane_groups(writes_sums, together, apart):
  assert tick_rows.lane_groups(writes_sums) == (together, apart)


# --------------------------------------------------------------------------------------------
# Weight slots (the split backward's W buffers, tpipe.core.loops.tick_rows) on the named tables.


@pytest.mark.parametrize("name,stages,microbatches", [("zb_h1", 4, 8), ("zbv", 4, 6),
                                                      ("zb_h1", 3, 2)])
def test_weight_slots_are_never_shared_and_fit_the_peak_awaiting_w(name, stages, microbatches):
  table = schedules.build(name, stages, microbatches)
  slots = tick_rows.weight_slots(table)
  awaiting = table.awaiting_weight()
  for s in range(stages):
    held = {}
    for t in range(table.num_ticks):
      key = (table.microbatch[t, s], table.chunk[t, s])
      if table.action[t, s] == schedules.Action.BI:
        assert slots[t, s] not in held.values(), (t, s)
        held[key] = slots[t, s]
      elif table.action[t, s] == schedules.Action.W:
        assert held.pop(key) == slots[t, s], (t, s)
      assert len(held) <= awaiting[t, s]
    assert not held
    assert slots[:, s].max() + 1 == awaiting[:, s].max()


@pytest.mark.parametrize("name,costs", [("1f1b", None), ("zb_h1", None), ("zbv", None),
                                        ("1f1b", {"F": 1, "B": 3}),
                                        ("zbv", {"F": 1, "BI": 2, "W": 1})])
def test_each_lane_switches_over_the_branches_it_runs_only(name, costs):
  """The tick loop's switch of each lane holds idle and exactly the branches the table runs in
  that lane (a split table no B), and a row's position in it names the table's branch."""
  table = schedules.build(name, 3, 4, costs=costs)
  programs = list(range(table.num_stages * table.num_chunks))
  numbers, _ = tick_rows.tick_branches(table, programs)
  by_lane = tick_rows.by_lanes(table, numbers)
  switches = tick_rows.lane_switches(table, programs)
  positions = tick_rows.tick_rows(table, programs)["lanes"]["branch"]
  assert len(switches) == table.lanes
  assert (table.lanes > 1) == bool(costs)  # Compound ticks: a lane per action of a stage's tick.
  for lane, switch in enumerate(switches):
    assert switch == tuple(sorted({0} | set(by_lane[:, lane].ravel().tolist())))
    np.testing.assert_array_equal(np.asarray(switch)[positions[:, lane]], by_lane[:, lane])
  count = len(programs)
  kinds = {schedules.Action((n - 1) // count).name for switch in switches for n in switch if n}
  assert kinds == ({"F", "BI", "W"} if name != "1f1b" else {"F", "B"})
  if costs:  # A compound table's later lanes run fewer kinds: their switches hold a part.
    assert all(len(switch) < 1 + len(kinds) * count for switch in switches[1:]), switches
