"""Schedules against tables written out by hand, and their analytics."""

import doctest

import numpy as np
import pytest

from tpipe import schedules

_ = schedules.IDLE


def test_gpipe_table_by_hand():
  s = schedules.gpipe(num_stages=3, num_microbatches=4)
  np.testing.assert_array_equal(s.microbatch, [
      [0, _, _],
      [1, 0, _],
      [2, 1, 0],
      [3, 2, 1],
      [_, 3, 2],
      [_, _, 3],
  ])
  np.testing.assert_array_equal(s.repeat, np.where(s.microbatch == _, _, 0))
  assert s.num_ticks == 6
  assert s.bubble_fraction == pytest.approx(2 / 6)  # (S-1) / (M+S-1)


def test_circular_table_by_hand():
  s = schedules.circular(num_stages=2, num_microbatches=2, num_repeats=2)
  np.testing.assert_array_equal(s.microbatch, [
      [0, _],
      [1, 0],
      [0, 1],
      [1, 0],
      [_, 1],
  ])
  np.testing.assert_array_equal(s.repeat, [
      [0, _],
      [0, 0],
      [1, 0],
      [1, 1],
      [_, 1],
  ])
  assert s.bubble_fraction == pytest.approx(1 / 5)  # (S-1) / (R*M+S-1)


def test_circular_pads_laps_when_fewer_microbatches_than_stages():
  s = schedules.circular(num_stages=3, num_microbatches=1, num_repeats=2)
  # A micro-batch needs 3 ticks per lap; it restarts on stage 0 only after the last stage is done.
  np.testing.assert_array_equal(s.microbatch, [
      [0, _, _],
      [_, 0, _],
      [_, _, 0],
      [0, _, _],
      [_, 0, _],
      [_, _, 0],
  ])
  np.testing.assert_array_equal(s.repeat[:, 0], [0, _, _, 1, _, _])


@pytest.mark.parametrize("stages,microbatches,repeats", [
    (1, 1, 1), (2, 8, 1), (4, 16, 1), (8, 32, 1), (4, 4, 2), (4, 8, 4), (8, 32, 2)])
def test_bubble_matches_formula_when_microbatches_cover_stages(stages, microbatches, repeats):
  s = schedules.circular(stages, microbatches, repeats)
  expected = (stages - 1) / (repeats * microbatches + stages - 1)
  assert s.bubble_fraction == pytest.approx(expected)
  assert s.efficiency == pytest.approx(1 - expected)


def test_every_stage_runs_every_microbatch_once_per_repeat():
  s = schedules.circular(num_stages=4, num_microbatches=3, num_repeats=3)
  for stage in range(4):
    busy = s.microbatch[:, stage] != _
    pairs = sorted(zip(s.microbatch[busy, stage], s.repeat[busy, stage]))
    assert pairs == sorted((m, r) for m in range(3) for r in range(3))


@pytest.mark.parametrize("schedule,slots,stashed", [
    # GPipe: M + S - 1 ticks, each stage stashes its input every tick; M of them are real.
    (schedules.gpipe(4, 8), 8 + 4 - 1, 8),
    (schedules.gpipe(4, 2), 2 + 4 - 1, 2),
    # Circular: laps of P = max(M, S) ticks, (R - 1) * P + M + S - 1 ticks; R * M real.
    (schedules.circular(2, 4, 3), 2 * 4 + 4 + 2 - 1, 12),
    # M < S: laps are padded to S ticks, so 2 of every lap's 4 ticks are bubbles on every stage.
    (schedules.circular(4, 2, 2), 1 * 4 + 2 + 4 - 1, 4),
    (schedules.circular(4, 3, 3), 2 * 4 + 3 + 4 - 1, 9),
])
def test_stash_slots_and_stashed_microbatches_per_stage(schedule, slots, stashed):
  stages = schedule.num_stages
  np.testing.assert_array_equal(schedule.stash_slots(), [slots] * stages)
  np.testing.assert_array_equal(schedule.stashed_microbatches(), [stashed] * stages)
  assert schedule.num_ticks == slots


def test_backward_tables_reverse_the_ticks():
  s = schedules.gpipe(2, 2)
  microbatch, repeat = s.backward_tables()
  np.testing.assert_array_equal(microbatch, [[_, 1], [1, 0], [0, _]])
  np.testing.assert_array_equal(repeat, [[_, 0], [0, 0], [0, _]])


def test_describe_draws_the_table():
  assert schedules.gpipe(2, 2).describe() == "stage 0:  0  1  .\nstage 1:  .  0  1"


def test_hand_written_table_with_broken_dataflow_is_rejected():
  with pytest.raises(ValueError, match="previous tick"):
    schedules.Schedule("bad", 2, 1, 1, microbatch=np.array([[0, 0]], np.int32),
                       repeat=np.array([[0, 0]], np.int32))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(name="1f1b", num_stages=2, num_microbatches=2), ValueError,
     "schedule='1f1b' is a fused schedule: make_fused_schedule"),
    (dict(name="zigzag", num_stages=2, num_microbatches=2), ValueError,
     "Unknown schedule 'zigzag'"),
    (dict(name="gpipe", num_stages=2, num_microbatches=2, num_repeats=2), ValueError,
     "schedule='circular'"),
    (dict(name="gpipe", num_stages=0, num_microbatches=2), ValueError, "num_stages must be >= 1"),
    (dict(name="circular", num_stages=2, num_microbatches=-1), ValueError,
     "num_microbatches must be >= 1"),
    (dict(name="gpipe", num_stages=2.0, num_microbatches=2), TypeError, "num_stages must be an int"),
])
def test_bad_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    schedules.make_schedule(**kwargs)


def test_module_doctests_pass():
  result = doctest.testmod(schedules)
  assert result.attempted >= 5 and result.failed == 0


# --------------------------------------------------------------------------------------------
# Fused schedules. Tables are written one row per stage, one column per tick: ``F3`` is the
# forward of micro-batch 3, ``B``/``BI``/``W`` the full, input and weight backward, ``/c`` the
# stage's local chunk c, ``.`` idle. Each table below was worked out by hand from the paper's
# rules (warm-up counts, steady-state pattern, drain), one tick per action, a message arriving
# the tick after it is sent.

A = schedules.Action


def _parse(text):
  """``(action, microbatch, chunk)`` ``[tick, stage]`` arrays from a hand-drawn table.

  A wide table may be drawn in blocks of ticks separated by a blank line.
  """
  blocks = [[line.split() for line in block.strip().splitlines()]
            for block in text.strip().split("\n\n")]
  rows = [sum((block[s] for block in blocks), []) for s in range(len(blocks[0]))]
  assert all(len(block) == len(rows) for block in blocks), "blocks with different stage counts"
  assert len({len(r) for r in rows}) == 1, "ragged table"
  tables = np.full((3, len(rows[0]), len(rows)), _, np.int64)
  for s, row in enumerate(rows):
    for t, cell in enumerate(row):
      if cell == ".":
        continue
      name = cell.rstrip("0123456789/")
      numbers = cell[len(name):].split("/")
      tables[:, t, s] = A[name], int(numbers[0]), int(numbers[1]) if len(numbers) > 1 else 0
  return tables


def _assert_table(schedule, text):
  action, microbatch, chunk = _parse(text)
  np.testing.assert_array_equal(schedule.action, action)
  np.testing.assert_array_equal(schedule.microbatch, microbatch)
  np.testing.assert_array_equal(schedule.chunk, chunk)


def test_parse_reads_the_drawing():
  action, microbatch, chunk = _parse("F0 BI1/1\n.  W2")
  np.testing.assert_array_equal(action, [[A.F, _], [A.BI, A.W]])
  np.testing.assert_array_equal(microbatch, [[0, _], [1, 2]])
  np.testing.assert_array_equal(chunk, [[0, _], [1, 0]])
  in_blocks = _parse("""
      F0
      .

      BI1/1
      W2
  """)
  np.testing.assert_array_equal(in_blocks, [action, microbatch, chunk])


def test_1f1b_two_stages_three_microbatches_by_hand():
  # Stage 0: one warm-up forward, then F/B in turn; it waits at tick 2 for B0 from stage 1.
  s = schedules.make_fused_schedule("1f1b", num_stages=2, num_microbatches=3)
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
  s = schedules.one_f_one_b(num_stages=3, num_microbatches=4)
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
  s = schedules.make_fused_schedule("zb_h1", num_stages=2, num_microbatches=2)
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
  s = schedules.zb_h1(num_stages=3, num_microbatches=3)
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
  s = schedules.make_fused_schedule("interleaved_1f1b", 2, 4, num_repeats=2)
  _assert_table(s, """
      F0/0 F1/0 F0/1 F1/1 F2/0 B0/1 F3/0 B1/1 F2/1 B0/0 F3/1 B1/0 .    B2/1 .    B3/1 B2/0 B3/0
      .    F0/0 F1/0 F0/1 B0/1 F1/1 B1/1 F2/0 B0/0 F3/0 B1/0 F2/1 B2/1 F3/1 B3/1 B2/0 B3/0 .
  """)
  np.testing.assert_array_equal(s.virtual_stage, [[0, 2], [1, 3]])
  np.testing.assert_array_equal(s.peak_in_flight(), [5, 3])
  assert s.bubble_fraction == pytest.approx(1 / 9)  # (S-1) / (R*M+S-1)


def test_zbv_two_stages_two_microbatches_by_hand():
  # V placement: stage 0 holds model chunks 0 and 3 (the loss), stage 1 chunks 1 and 2.
  s = schedules.make_fused_schedule("zbv", num_stages=2, num_microbatches=2)
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
  s = schedules.zbv(num_stages=2, num_microbatches=3)
  _assert_table(s, """
      F0/0 F1/0 F2/0 F0/1 BI0/1 W0/1 F1/1 BI1/1 W1/1 BI0/0
      .    F0/0 F0/1 F1/0 F1/1  BI0/1 W0/1 F2/0  BI0/0 W0/0

      W0/0 F2/1  BI2/1 W2/1  BI1/0 W1/0  BI2/0 W2/0 .
      F2/1 BI1/1 W1/1  BI1/0 BI2/1 BI2/0 W1/0  W2/1 W2/0
  """)
  np.testing.assert_array_equal(s.peak_in_flight(), [4, 4])


def test_fused_describe_draws_the_table():
  # Stage 0's BI0 waits for stage 1's (sent at tick 2, arrives at tick 3).
  assert schedules.zb_h1(2, 1).describe() == ("stage 0:  F0   .   . BI0  W0\n"
                                              "stage 1:   .  F0 BI0  W0   .")
  assert schedules.zbv(1, 1).describe() == "stage 0:  F0/0  F0/1 BI0/1  W0/1 BI0/0  W0/0"


def test_with_backward_is_the_step_autodiff_runs():
  s = schedules.gpipe(2, 2).with_backward()
  _assert_table(s, """
      F0 F1 .  .  B1 B0
      .  F0 F1 B1 B0 .
  """)
  np.testing.assert_array_equal(s.peak_in_flight(), [2, 2])
  c = schedules.circular(2, 2, 2)
  f = c.with_backward()
  assert f.name == "circular" and f.num_chunks == 2
  assert f.bubble_fraction == pytest.approx(c.bubble_fraction)
  np.testing.assert_array_equal(f.peak_in_flight(), [4, 4])  # R * M per stage.


def test_simulate_lockstep_and_natural_time_by_hand():
  s = schedules.one_f_one_b(2, 3)
  timing = s.simulate({"F": 1, "B": 2})
  # Per tick, the slowest stage: F F | B B B B B B (tick 2 onwards has a B somewhere).
  assert timing.lockstep == 1 + 1 + 6 * 2
  # Dependency-driven: F0 F1 on stage 0 (0-2), stage 1 F0 (1-2) B0 (2-4) F1 (4-5) B1 (5-7)
  # F2 (7-8) B2 (8-10); stage 0 B2 (10-12).
  assert timing.natural == 12 == 3 * (3 + 2 - 1)
  np.testing.assert_array_equal(timing.busy, [9, 9])
  assert timing.natural_bubble == pytest.approx(1 / 4)
  assert timing.lockstep_bubble == pytest.approx(1 - 18 / 28)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 5, 8, 12])
def test_1f1b_properties(stages, microbatches):
  s = schedules.one_f_one_b(stages, microbatches)
  gpipe = schedules.gpipe(stages, microbatches)
  np.testing.assert_array_equal(s.peak_in_flight(),
                                [min(stages - i, microbatches) for i in range(stages)])
  np.testing.assert_array_equal(s.stash_slots(), s.peak_in_flight())
  # Unit ticks: GPipe's bubble. F = 1, B = 2, dependency-driven: GPipe's step time too.
  assert s.bubble_fraction == pytest.approx(gpipe.bubble_fraction)
  costs = {"F": 1, "B": 2}
  assert s.simulate(costs).natural == gpipe.with_backward().simulate(costs).natural
  assert s.simulate(costs).natural == 3 * (microbatches + stages - 1)
  # Lockstep: a tick with any B lasts 2, so 1F1B pays for its interleaving once S > 1.
  assert s.simulate(costs).lockstep >= s.simulate(costs).natural
  if stages > 1 and microbatches > 1:
    assert s.simulate(costs).lockstep > gpipe.with_backward().simulate(costs).lockstep


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 5, 8, 12])
def test_zb_h1_properties(stages, microbatches):
  s = schedules.zb_h1(stages, microbatches)
  np.testing.assert_array_equal(s.peak_in_flight(), [min(stages, microbatches)] * stages)
  if microbatches < stages:
    return
  # F = BI = W = 1 in lockstep: 3M + S - 1 ticks, so each stage idles S - 1 ticks against 3M of
  # work: (S-1)/(3M) of the busy time, a third of 1F1B's 3 (S-1) with F = 1, B = 2.
  timing = s.simulate({"F": 1, "BI": 1, "W": 1})
  assert timing.lockstep == timing.natural == 3 * microbatches + stages - 1
  idle = timing.lockstep - timing.busy
  np.testing.assert_allclose(idle / timing.busy, (stages - 1) / (3 * microbatches))
  one_f_one_b = schedules.one_f_one_b(stages, microbatches).simulate({"F": 1, "B": 2})
  np.testing.assert_allclose(one_f_one_b.natural - one_f_one_b.busy, 3 * idle)
  assert s.bubble_fraction == pytest.approx((stages - 1) / (3 * microbatches + stages - 1))


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 5, 8, 12, 24])
def test_zbv_properties(stages, microbatches):
  s = schedules.zbv(stages, microbatches)
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
  s = schedules.interleaved_1f1b(stages, microbatches, repeats)
  total = repeats * microbatches
  warmup = [min(2 * (stages - 1 - i) + (repeats - 1) * stages + 1, total) for i in range(stages)]
  np.testing.assert_array_equal(s.peak_in_flight(), warmup)
  if microbatches % stages == 0:  # Megatron's condition for the bubble (S-1)/(R*M+S-1).
    assert s.num_ticks == 2 * (total + stages - 1)
  else:  # Partial groups run, a little later.
    assert s.num_ticks >= 2 * (total + stages - 1)


def _replay_mailboxes(s):
  """Runs the routing tables tick by tick; returns how many messages were delivered."""
  vstage = s.virtual_stage
  mailbox = [{} for _ in range(s.num_stages)]  # slot -> (kind, micro-batch, model chunk) held.
  sent = {}  # (tick, stage) -> what the action there sent.
  delivered = 0
  for t in range(s.num_ticks):
    arrivals = s.arrival_slots()[t]
    for dst in range(s.num_stages):
      for k, direction in enumerate((1, -1, 0)):
        slot = arrivals[dst, k]
        if slot != _:
          src = (dst - direction) % s.num_stages
          assert s.send_dir[t - 1, src] == direction and s.send_slot[t - 1, src] == slot
          assert slot not in mailbox[dst], "overwrote a message nobody read"
          mailbox[dst][slot] = sent[(t - 1, src)]
    for st in np.nonzero(s.busy[t])[0]:
      kind, m = A(s.action[t, st]), int(s.microbatch[t, st])
      v = int(vstage[st, s.chunk[t, st]])
      if kind == A.F:
        expect = ("act", m, v - 1) if v > 0 else None
        sent[(t, st)] = ("act", m, v) if v < vstage.size - 1 else None
      elif kind == A.W:
        expect = None
      else:
        expect = ("grad", m, v + 1) if v < vstage.size - 1 else None
        sent[(t, st)] = ("grad", m, v) if v > 0 else None
      assert (s.send_slot[t, st] != _) == (sent.get((t, st)) is not None and kind != A.W)
      if expect is None:
        assert s.recv_slot[t, st] == _
      else:
        assert mailbox[st].pop(s.recv_slot[t, st]) == expect
        delivered += 1
  assert all(not box for box in mailbox)
  assert all(len(box) <= n for box, n in zip(mailbox, s.mailbox_slots()))
  return delivered


@pytest.mark.parametrize("name", schedules.FUSED_SCHEDULE_NAMES)
@pytest.mark.parametrize("stages,microbatches", [(1, 1), (1, 4), (2, 1), (3, 2), (4, 4), (4, 9),
                                                 (8, 3), (8, 16)])
def test_every_message_is_read_once_from_the_slot_it_was_written_to(name, stages, microbatches):
  s = schedules.make_fused_schedule(name, stages, microbatches,
                                    num_repeats=2 if name == "interleaved_1f1b" else None)
  # Each micro-batch sends an activation and a gradient across each of the V - 1 chunk borders.
  assert _replay_mailboxes(s) == 2 * microbatches * (s.virtual_stage.size - 1)
  np.testing.assert_array_equal(s.stash_slots(), s.peak_in_flight())
  assert s.mailbox_slots().max() <= 4


def test_gpipe_and_circular_messages_too():
  assert _replay_mailboxes(schedules.gpipe(3, 4).with_backward()) == 2 * 4 * 2
  assert _replay_mailboxes(schedules.circular(2, 3, 2).with_backward()) == 2 * 3 * 3


def _fused(text, slots, stages, microbatches, chunks=1, placement="loop"):
  action, microbatch, chunk = _parse(text)
  return schedules.FusedSchedule("hand", stages, microbatches, chunks, placement, action=action,
                                 microbatch=microbatch, chunk=chunk,
                                 stash_slot=np.array(slots).T)


def test_hand_written_fused_table_is_accepted():
  s = _fused("F0 . . B0\n. F0 B0 .", [[0, _, _, 0], [_, 0, 0, _]], 2, 1)
  assert s.num_ticks == 4 and s.bubble_fraction == pytest.approx(0.5)
  np.testing.assert_array_equal(s.recv_slot.T, [[_, _, _, 0], [_, 0, _, _]])


@pytest.mark.parametrize("text,slots,stages,microbatches,match", [
    # Stage 1 runs F0 in the tick stage 0 does: the activation has not arrived.
    ("F0 . B0\nF0 B0 .", [[0, _, 0], [0, 0, _]], 2, 1,
     "tick 0, stage 1: F of micro-batch 0, chunk 0 needs F of chunk 0 on stage 0 done at an "
     "earlier tick, but it runs at tick 0"),
    # Stage 0's backward before stage 1's.
    ("F0 B0 .\n. F0 B0", [[0, 0, _], [_, 0, 0]], 2, 1,
     "tick 1, stage 0: BI/B of micro-batch 0, chunk 0 needs BI/B of chunk 0 on stage 1"),
    ("F0 . .\n. F0 B0", [[0, _, _], [_, 0, 0]], 2, 1,
     "stage 0, micro-batch 0, chunk 0: no backward"),
    ("F0 B0\n. .", [[0, 0], [_, _]], 2, 1, "stage 1, micro-batch 0, chunk 0: no forward"),
    ("F0 F0 B0", [[0, 0, 0]], 1, 1, "stage 0 runs F of micro-batch 0, chunk 0 twice"),
    ("F0 B0 BI0 W0", [[0, 0, 0, 0]], 1, 1, "both a full backward B and a split backward"),
    ("F0 BI0", [[0, 0]], 1, 1, "a split backward needs both BI and W"),
    ("F0 W0 BI0", [[0, 0, 0]], 1, 1, "W of micro-batch 0, chunk 0 needs BI/B of chunk 0"),
    ("F0 B0", [[0, 1]], 1, 1, "B reads stash slot 1 but the forward wrote slot 0"),
    ("F0 F1 B1 B0", [[0, 0, 0, 0]], 1, 2,
     "tick 1, stage 0: forward of micro-batch 1, chunk 0 writes stash slot 0, still held by "
     "micro-batch 0, chunk 0"),
    ("F0 B0 F1 B1", [[0, 0, 1, 1]], 1, 2, "stash slot 1 used but at most 1 micro-batch chunks"),
    ("F0 B0 F1 B1", [[0, 0, 0, 0]], 1, 3, "micro-batch 2, chunk 0: no forward"),
    ("F0 B0 F3 B3", [[0, 0, 0, 0]], 1, 2, "tick 2, stage 0: microbatch 3 out of range"),
])
def test_broken_fused_tables_are_rejected(text, slots, stages, microbatches, match):
  with pytest.raises(ValueError, match=match):
    _fused(text, slots, stages, microbatches)


def test_malformed_fused_tables_are_rejected():
  action, microbatch, chunk = _parse("F0 B0")
  good = dict(name="x", num_stages=1, num_microbatches=1, num_chunks=1, placement="loop",
              action=action, microbatch=microbatch, chunk=chunk, stash_slot=np.zeros((2, 1)))
  with pytest.raises(ValueError, match="stash_slot table has shape"):
    schedules.FusedSchedule(**{**good, "stash_slot": np.zeros((3, 1))})
  with pytest.raises(ValueError, match=r"tables must be \[ticks, 2\]"):
    schedules.FusedSchedule(**{**good, "num_stages": 2})
  with pytest.raises(ValueError, match="codes other than IDLE"):
    schedules.FusedSchedule(**{**good, "action": np.array([[0], [7]])})
  with pytest.raises(ValueError, match="tick 1, stage 0: idle slot with a microbatch index"):
    schedules.FusedSchedule(**{**good, "action": np.array([[0], [_]])})
  with pytest.raises(ValueError, match="Unknown placement 'w'"):
    schedules.FusedSchedule(**{**good, "placement": "w"})
  with pytest.raises(ValueError, match="exactly 2 chunks"):
    schedules.FusedSchedule(**{**good, "placement": "v"})
  with pytest.raises(TypeError, match="num_chunks must be an int"):
    schedules.FusedSchedule(**{**good, "num_chunks": 1.0})


@pytest.mark.parametrize("args,kwargs,error,match", [
    (("pipedream", 2, 2), {}, ValueError, "Unknown fused schedule 'pipedream'"),
    (("gpipe", 2, 2), {}, ValueError, "forward schedule: build it with make_schedule"),
    (("1f1b", 2, 2), dict(num_repeats=2), ValueError, "use schedule='interleaved_1f1b'"),
    (("zbv", 2, 2), dict(num_repeats=3), ValueError, "schedule='zbv' runs 2 chunk"),
    (("interleaved_1f1b", 2, 2), {}, ValueError, "needs num_repeats >= 2"),
    (("interleaved_1f1b", 2, 2), dict(num_repeats=1), ValueError, "use schedule='1f1b'"),
    (("interleaved_1f1b", 2, 2), dict(num_repeats=2.5), TypeError, "num_repeats must be an int"),
    (("zb_h1", 0, 2), {}, ValueError, "num_stages must be >= 1"),
    (("zbv", 2, 2.0), {}, TypeError, "num_microbatches must be an int"),
])
def test_make_fused_schedule_bad_arguments(args, kwargs, error, match):
  with pytest.raises(error, match=match):
    schedules.make_fused_schedule(*args, **kwargs)


def test_make_fused_schedule_defaults_and_explicit_chunks_agree():
  for name, chunks in (("1f1b", 1), ("zb_h1", 1), ("zbv", 2)):
    default = schedules.make_fused_schedule(name, 3, 4)
    explicit = schedules.make_fused_schedule(name, 3, 4, num_repeats=chunks)
    assert default.num_chunks == chunks
    np.testing.assert_array_equal(default.action, explicit.action)


@pytest.mark.parametrize("costs,match", [
    ({"F": 1, "X": 1}, r"unknown actions \['X'\]"),
    ({"F": 1, "B": 2}, "no entry for 'BI'"),
    ({"F": -1, "BI": 1, "W": 1}, r"costs\['F'\] must be >= 0"),
])
def test_simulate_bad_costs(costs, match):
  with pytest.raises(ValueError, match=match):
    schedules.zb_h1(2, 2).simulate(costs)


@pytest.mark.parametrize("name,stages,microbatches", [("zb_h1", 4, 8), ("zbv", 4, 6),
                                                      ("zb_h1", 3, 2)])
def test_weight_slots_are_never_shared_and_fit_the_peak_awaiting_w(name, stages, microbatches):
  from tpipe.core import fused  # pylint: disable=g-import-not-at-top

  table = schedules.make_fused_schedule(name, stages, microbatches)
  slots = fused.weight_slots(table)
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
