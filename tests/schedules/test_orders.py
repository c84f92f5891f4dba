"""tpipe.schedules.orders: the named fused schedules (1F1B, ZB-H1, interleaved 1F1B, ZB-V)
against tables written out by hand, and their properties over many sizes.

Tables are drawn as in :mod:`tests.helpers.schedule_tables`. Each table below was worked out by
hand from the paper's rules (warm-up counts, steady-state pattern, drain), one tick per action, a
message arriving the tick after it is sent.
"""

import numpy as np
import pytest

from tests.helpers import schedule_tables
from tests.helpers.schedule_tables import assert_table as _assert_table
from tpipe import schedules
from tpipe.schedules import orders

pytestmark = pytest.mark.unit

_ = schedules.IDLE


def test_1f1b_two_stages_three_microbatches_by_hand():
  # Stage 0: one warm-up forward, then F/B in turn; it waits at tick 2 for B0 from stage 1.
  s = schedules.build("1f1b", num_stages=2, num_microbatches=3)
  _assert_table(s, """
      F0 F1 .  B0 F2 B1 .  B2
      .  F0 B0 F1 B1 F2 B2 .
  """)
  np.testing.assert_array_equal(s.stash_slot.T, [
      [0, 1, _, 0, 0, 1, _, 0],
      [_, 0, 0, 0, 0, 0, 0, _],
  ])
  np.testing.assert_array_equal(s.peak_in_flight(), [2, 1])
  assert s.bubble_fraction == pytest.approx(1 / 4)  # (S-1) / (M+S-1), as GPipe.
  # Routing: activations go right (+1), gradients left (-1); the slot is the receiver's.
  np.testing.assert_array_equal(s.send_dir.T, [
      [1, 1, 0, 0, 1, 0, 0, 0],
      [0, 0, -1, 0, -1, 0, -1, 0],
  ])
  np.testing.assert_array_equal(s.recv_slot.T, [
      [_, _, _, 0, _, 0, _, 0],  # B0, B1, B2 read the gradients from stage 1.
      [_, 0, _, 0, _, 0, _, _],  # F1 arrives at tick 2 and waits a tick (B0 runs first).
  ])
  np.testing.assert_array_equal(s.mailbox_slots(), [1, 1])


def test_1f1b_three_stages_four_microbatches_by_hand():
  s = schedules.build("1f1b", num_stages=3, num_microbatches=4)
  _assert_table(s, """
      F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
      .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
      .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .
  """)
  np.testing.assert_array_equal(s.stash_slot.T, [
      [0, 1, 2, _, _, 0, 0, 1, _, 2, _, 0],
      [_, 0, 1, _, 0, 0, 1, 1, 0, _, 1, _],
      [_, _, 0, 0, 0, 0, 0, 0, 0, 0, _, _],
  ])
  np.testing.assert_array_equal(s.in_flight().T, [
      [1, 2, 3, 3, 3, 3, 3, 3, 2, 2, 1, 1],
      [0, 1, 2, 2, 2, 2, 2, 2, 2, 1, 1, 0],
      [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0],
  ])
  # Stage 1 gets F2 from stage 0 and B1 from stage 2 at tick 6 and runs B1 first: two slots.
  np.testing.assert_array_equal(s.mailbox_slots(), [1, 2, 1])


def test_zb_h1_two_stages_two_microbatches_by_hand():
  # Stage 1 (s = 1) defers one W: its BI go back as early as possible and W0 fills the tail.
  s = schedules.build("zb_h1", num_stages=2, num_microbatches=2)
  _assert_table(s, """
      F0 F1 .   BI0 W0  BI1 W1
      .  F0 BI0 F1  BI1 W0  W1
  """)
  np.testing.assert_array_equal(s.stash_slot.T, [
      [0, 1, _, 0, 0, 1, 1],
      [_, 0, 0, 1, 1, 0, 1],
  ])
  np.testing.assert_array_equal(s.peak_in_flight(), [2, 2])
  np.testing.assert_array_equal(s.awaiting_weight().max(axis=0), [1, 2])
  assert s.bubble_fraction == pytest.approx(1 / 7)  # (S-1) / (3M+S-1)


def test_zb_h1_three_stages_three_microbatches_by_hand():
  s = schedules.build("zb_h1", num_stages=3, num_microbatches=3)
  _assert_table(s, """
      F0 F1 F2 .   .   BI0 W0  BI1 W1  BI2 W2
      .  F0 F1 .   BI0 F2  BI1 W0  BI2 W1  W2
      .  .  F0 BI0 F1  BI1 F2  BI2 W0  W1  W2
  """)
  np.testing.assert_array_equal(s.peak_in_flight(), [3, 3, 3])
  assert (~s.busy).sum(axis=0).tolist() == [2, 2, 2]  # S - 1 idle ticks on every stage.


def test_interleaved_1f1b_two_stages_two_chunks_four_microbatches_by_hand():
  # Stage s holds model chunks s (chunk 0) and 2 + s (chunk 1). Groups of S = 2 micro-batches go
  # through chunk 0 then chunk 1; warm-up: 2 (S-1-s) + (R-1) S forwards (4 and 2).
  s = schedules.build("interleaved_1f1b", 2, 4, num_repeats=2)
  _assert_table(s, """
      F0/0 F1/0 F0/1 F1/1 F2/0 B0/1 F3/0 B1/1 F2/1 B0/0 F3/1 B1/0 .    B2/1 .    B3/1 B2/0 B3/0
      .    F0/0 F1/0 F0/1 B0/1 F1/1 B1/1 F2/0 B0/0 F3/0 B1/0 F2/1 B2/1 F3/1 B3/1 B2/0 B3/0 .
  """)
  np.testing.assert_array_equal(s.virtual_stage, [[0, 2], [1, 3]])
  np.testing.assert_array_equal(s.peak_in_flight(), [5, 3])
  assert s.bubble_fraction == pytest.approx(1 / 9)  # (S-1) / (R*M+S-1)


def test_zbv_two_stages_two_microbatches_by_hand():
  # V placement: stage 0 holds model chunks 0 and 3 (the loss), stage 1 chunks 1 and 2.
  s = schedules.build("zbv", num_stages=2, num_microbatches=2)
  _assert_table(s, """
      F0/0 F1/0 .    F0/1 BI0/1 W0/1 F1/1 BI1/1 W1/1 BI0/0 W0/0 .    BI1/0 W1/0
      .    F0/0 F0/1 F1/0 F1/1  BI0/1 W0/1 BI0/0 W0/0 BI1/1 W1/1 BI1/0 W1/0 .
  """)
  np.testing.assert_array_equal(s.virtual_stage, [[0, 3], [1, 2]])
  # Chunk 0 sends right, the turn at stage 1 stays local (0), chunk 1 sends left and its
  # gradients go right: stage 0's BI0/1 (tick 4) to stage 1.
  np.testing.assert_array_equal(s.send_dir[:6].T, [[1, 1, 0, 0, 1, 0], [0, 0, -1, 0, -1, 0]])
  assert s.send_slot[1, 1] == 0 and s.send_slot[0, 1] == _  # Tick 1 sends; tick 0 is idle.
  # At tick 2 stage 1 receives F1/0 from the left and its own F0/0 output: two arrivals.
  np.testing.assert_array_equal(s.arrival_slots()[2, 1], [1, _, 0])
  assert s.recv_slot[2, 1] == 0


def test_zbv_two_stages_three_microbatches_by_hand():
  # M = 2S - 1: the whole pattern; one idle tick per stage.
  s = schedules.build("zbv", num_stages=2, num_microbatches=3)
  _assert_table(s, """
      F0/0 F1/0 F2/0 F0/1 BI0/1 W0/1 F1/1 BI1/1 W1/1 BI0/0
      .    F0/0 F0/1 F1/0 F1/1  BI0/1 W0/1 F2/0  BI0/0 W0/0

      W0/0 F2/1  BI2/1 W2/1  BI1/0 W1/0  BI2/0 W2/0 .
      F2/1 BI1/1 W1/1  BI1/0 BI2/1 BI2/0 W1/0  W2/1 W2/0
  """)
  np.testing.assert_array_equal(s.peak_in_flight(), [4, 4])


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 5, 8, 12])
def test_1f1b_properties(stages, microbatches):
  s = schedules.build("1f1b", stages, microbatches)
  gpipe = schedules.build("gpipe", stages, microbatches)
  np.testing.assert_array_equal(s.peak_in_flight(),
                                [min(stages - i, microbatches) for i in range(stages)])
  np.testing.assert_array_equal(s.stash_slots(), s.peak_in_flight())
  # Unit ticks: GPipe's bubble. F = 1, B = 2, dependency-driven: GPipe's step time too.
  assert s.bubble_fraction == pytest.approx(gpipe.bubble_fraction)
  costs = {"F": 1, "B": 2}
  assert s.simulate(costs).natural == schedules.whole_step(gpipe).simulate(costs).natural
  assert s.simulate(costs).natural == 3 * (microbatches + stages - 1)
  # Lockstep: a tick with any B lasts 2, so 1F1B pays for its interleaving once S > 1.
  assert s.simulate(costs).lockstep >= s.simulate(costs).natural
  if stages > 1 and microbatches > 1:
    assert s.simulate(costs).lockstep > schedules.whole_step(gpipe).simulate(costs).lockstep


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 5, 8, 12])
def test_zb_h1_properties(stages, microbatches):
  s = schedules.build("zb_h1", stages, microbatches)
  np.testing.assert_array_equal(s.peak_in_flight(), [min(stages, microbatches)] * stages)
  if microbatches < stages:
    return
  # F = BI = W = 1 in lockstep: 3M + S - 1 ticks, so each stage idles S - 1 ticks against 3M of
  # work: (S-1)/(3M) of the busy time, a third of 1F1B's 3 (S-1) with F = 1, B = 2.
  timing = s.simulate({"F": 1, "BI": 1, "W": 1})
  assert timing.lockstep == timing.natural == 3 * microbatches + stages - 1
  idle = timing.lockstep - timing.busy
  np.testing.assert_allclose(idle / timing.busy, (stages - 1) / (3 * microbatches))
  one_f_one_b = schedules.build("1f1b", stages, microbatches).simulate({"F": 1, "B": 2})
  np.testing.assert_allclose(one_f_one_b.natural - one_f_one_b.busy, 3 * idle)
  assert s.bubble_fraction == pytest.approx((stages - 1) / (3 * microbatches + stages - 1))


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 5, 8, 12, 24])
def test_zbv_properties(stages, microbatches):
  s = schedules.build("zbv", stages, microbatches)
  assert s.num_chunks == 2
  if microbatches < 2 * stages:
    assert s.peak_in_flight().max() <= 2 * stages
    return
  # With M >= 2S, 6M chunk actions and S - 1 idle ticks per stage, whatever M: the bubble
  # fraction (S-1)/(6M+S-1) goes to zero, and each stage holds 2S chunk inputs (S stages' worth).
  assert s.num_ticks == 6 * microbatches + stages - 1
  np.testing.assert_array_equal((~s.busy).sum(axis=0), [stages - 1] * stages)
  np.testing.assert_array_equal(s.peak_in_flight(), [2 * stages] * stages)
  assert s.simulate({"F": 1, "BI": 1, "W": 1}).lockstep == s.num_ticks


@pytest.mark.parametrize("stages,microbatches,repeats", [
    (1, 1, 2), (1, 3, 3), (2, 1, 2), (2, 2, 2), (2, 4, 3), (3, 6, 2), (4, 8, 2), (4, 4, 4),
    (2, 3, 2), (3, 4, 2), (4, 6, 3)])
def test_interleaved_properties(stages, microbatches, repeats):
  s = schedules.build("interleaved_1f1b", stages, microbatches, repeats)
  total = repeats * microbatches
  warmup = [min(2 * (stages - 1 - i) + (repeats - 1) * stages + 1, total) for i in range(stages)]
  if microbatches % stages == 0:  # Megatron's condition for the bubble (S-1)/(R*M+S-1).
    np.testing.assert_array_equal(s.peak_in_flight(), warmup)
    assert s.num_ticks == 2 * (total + stages - 1)
  else:  # The last group is partial: its missing micro-batches' warm-up forwards are left out.
    assert np.all(s.peak_in_flight() <= warmup)
    assert s.num_ticks >= 2 * (total + stages - 1)


@pytest.mark.parametrize("stages", [4, 5, 6])
def test_interleaved_runs_microbatch_counts_that_are_not_multiples_of_the_stages(stages):
  # The docstring's promise: when S does not divide M the schedule still runs, a few ticks later.
  for microbatches in range(1, 13):
    for repeats in (2, 3, 4):
      s = schedules.build("interleaved_1f1b", stages, microbatches, repeats)
      assert s.num_ticks >= 2 * (repeats * microbatches + stages - 1)


@pytest.mark.parametrize("name", schedules.FUSED_SCHEDULE_NAMES)
@pytest.mark.parametrize("stages,microbatches", [(1, 1), (1, 4), (2, 1), (3, 2), (4, 4), (4, 9),
                                                 (8, 3), (8, 16)])
def test_every_message_is_read_once_from_the_slot_it_was_written_to(name, stages, microbatches):
  s = schedules.build(name, stages, microbatches,
                      num_repeats=2 if name == "interleaved_1f1b" else None)
  # Each micro-batch sends an activation and a gradient across each of the V - 1 chunk borders.
  assert schedule_tables.replay_mailboxes(s) == 2 * microbatches * (s.virtual_stage.size - 1)
  np.testing.assert_array_equal(s.stash_slots(), s.peak_in_flight())
  assert s.mailbox_slots().max() <= 4


@pytest.mark.parametrize("builder,args,error,match", [
    (orders.one_f_one_b, (0, 2), ValueError, "num_stages must be >= 1, got 0"),
    (orders.zb_h1, (2, 2.0), TypeError, "num_microbatches must be an int, got 2.0"),
    (orders.zbv, (2, 0), ValueError, "num_microbatches must be >= 1, got 0"),
    (orders.interleaved_1f1b, (2, 2, 1), ValueError,
     "schedule='interleaved_1f1b' needs num_repeats >= 2 chunks per stage, got 1; use "
     "schedule='1f1b' for one"),
    (orders.interleaved_1f1b, (2, 2, 2.5), TypeError, "num_repeats must be an int, got 2.5"),
])
def test_builders_check_their_counts(builder, args, error, match):
  with pytest.raises(error, match=match):
    builder(*args)


def test_names_are_the_fused_schedules():
  assert orders.NAMES == schedules.FUSED_SCHEDULE_NAMES == ("1f1b", "interleaved_1f1b", "zb_h1",
                                                            "zbv")
  for name, builder in (("1f1b", orders.one_f_one_b), ("zb_h1", orders.zb_h1),
                        ("zbv", orders.zbv)):
    table = builder(3, 4)
    assert table.name == name and table.placement == ("v" if name == "zbv" else "loop")
  assert orders.interleaved_1f1b(3, 4, 2).name == "interleaved_1f1b"
