"""tpipe.schedules.forward: GPipe and circular tables against tables written out by hand, their
analytics, and the validation of hand-written tables."""

import doctest
import importlib

import numpy as np
import pytest

from tpipe import schedules
from tpipe.schedules import forward

pytestmark = pytest.mark.unit

_ = schedules.IDLE


def test_gpipe_table_by_hand():
  s = schedules.build("gpipe", num_stages=3, num_microbatches=4)
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
  assert (s.name, s.num_chunks, s.placement) == ("gpipe", 1, "loop")


def test_circular_table_by_hand():
  s = schedules.build("circular", num_stages=2, num_microbatches=2, num_repeats=2)
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
  # Chunk r of stage s is model chunk r * S + s: the "loop" placement the fused tables use too.
  assert (s.num_chunks, s.placement) == (2, "loop")
  np.testing.assert_array_equal(schedules.actions.virtual_stages(s.placement, 2, s.num_chunks),
                                [[0, 2], [1, 3]])


def test_circular_pads_laps_when_fewer_microbatches_than_stages():
  s = schedules.build("circular", num_stages=3, num_microbatches=1, num_repeats=2)
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
  s = schedules.build("circular", stages, microbatches, repeats)
  expected = (stages - 1) / (repeats * microbatches + stages - 1)
  assert s.bubble_fraction == pytest.approx(expected)
  assert s.efficiency == pytest.approx(1 - expected)


def test_every_stage_runs_every_microbatch_once_per_repeat():
  s = schedules.build("circular", num_stages=4, num_microbatches=3, num_repeats=3)
  for stage in range(4):
    busy = s.microbatch[:, stage] != _
    pairs = sorted(zip(s.microbatch[busy, stage], s.repeat[busy, stage]))
    assert pairs == sorted((m, r) for m in range(3) for r in range(3))


@pytest.mark.parametrize("schedule,slots,stashed", [
    # GPipe: M + S - 1 ticks, each stage stashes its input every tick; M of them are real.
    (schedules.build("gpipe", 4, 8), 8 + 4 - 1, 8),
    (schedules.build("gpipe", 4, 2), 2 + 4 - 1, 2),
    # Circular: laps of P = max(M, S) ticks, (R - 1) * P + M + S - 1 ticks; R * M real.
    (schedules.build("circular", 2, 4, 3), 2 * 4 + 4 + 2 - 1, 12),
    # M < S: laps are padded to S ticks, so 2 of every lap's 4 ticks are bubbles on every stage.
    (schedules.build("circular", 4, 2, 2), 1 * 4 + 2 + 4 - 1, 4),
    (schedules.build("circular", 4, 3, 3), 2 * 4 + 3 + 4 - 1, 9),
])
def test_stash_slots_and_stashed_microbatches_per_stage(schedule, slots, stashed):
  stages = schedule.num_stages
  np.testing.assert_array_equal(schedule.stash_slots(), [slots] * stages)
  np.testing.assert_array_equal(schedule.stashed_microbatches(), [stashed] * stages)
  assert schedule.num_ticks == slots


def test_backward_tables_reverse_the_ticks():
  s = schedules.build("gpipe", 2, 2)
  microbatch, repeat = s.backward_tables()
  np.testing.assert_array_equal(microbatch, [[_, 1], [1, 0], [0, _]])
  np.testing.assert_array_equal(repeat, [[_, 0], [0, 0], [0, _]])


def test_describe_draws_the_table():
  assert schedules.build("gpipe", 2, 2).describe() == "stage 0:  0  1  .\nstage 1:  .  0  1"
  assert schedules.build("circular", 2, 1, 2).describe() == ("stage 0: 0:0   . 0:1   .\n"
                                                             "stage 1:   . 0:0   . 0:1")


def test_tables_are_read_only_copies():
  microbatch = np.array([[0]], np.int32)
  s = schedules.Schedule("hand", 1, 1, 1, microbatch=microbatch,
                         repeat=np.array([[0]], np.int32))
  microbatch[0, 0] = 5  # The caller's array is not the table.
  assert s.microbatch[0, 0] == 0
  for table in (s.microbatch, s.repeat):
    with pytest.raises(ValueError, match="read-only"):
      table[0, 0] = 1


@pytest.mark.parametrize("microbatch,repeat,match", [
    ([[0, 0]], [[0, 0]], "tick 0, stage 1: input was not produced by stage 0 at tick -1 "
                         r"\(the value arrives 1 tick\(s\) after it is sent\)"),
    ([[0, _], [_, 1]], [[0, _], [_, 0]], "tick 1, stage 1: input was not produced"),
    ([[0], [_]], [[0], [0]], "tick 1, stage 0: idle slot with a repeat index"),
    ([[0], [0]], [[0], [0]], r"stage 0 does not run every \(micro-batch, repeat\) exactly once"),
    ([[0, _], [0, 0], [_, 0]], [[0, _], [1, 0], [_, 1]],
     "tick 1: stage 0 starts repeat 1 of micro-batch 0 before the last stage.s repeat 0 of it "
     "arrived"),
    ([[0, _]], [[0, _]], r"tables must be \[ticks, 1\]"),
])
def test_hand_written_table_with_broken_dataflow_is_rejected(microbatch, repeat, match):
  stages = np.shape(microbatch)[1] if "tables must" not in match else 1
  repeats = 1 + int(np.max(repeat))
  with pytest.raises(ValueError, match=match):
    schedules.Schedule("bad", stages, 1, repeats, microbatch=np.array(microbatch, np.int32),
                       repeat=np.array(repeat, np.int32))


def test_tables_of_different_shapes_are_rejected():
  with pytest.raises(ValueError, match="microbatch and repeat tables must have the same shape"):
    schedules.Schedule("bad", 1, 1, 1, microbatch=np.zeros((1, 1)), repeat=np.zeros((2, 1)))


@pytest.mark.parametrize("builder,args,error,match", [
    (forward.gpipe, (0, 2), ValueError, "num_stages must be >= 1, got 0"),
    (forward.gpipe, (2, 2.0), TypeError, "num_microbatches must be an int, got 2.0"),
    (forward.circular, (2, 2, 0), ValueError, "num_repeats must be >= 1, got 0"),
    (forward.circular, (True, 2, 1), TypeError, "num_stages must be an int, got True"),
])
def test_builders_check_their_counts(builder, args, error, match):
  with pytest.raises(error, match=match):
    builder(*args)


def test_module_doctests_pass():
  result = doctest.testmod(importlib.import_module("tpipe.schedules.forward"))
  assert result.attempted >= 4 and result.failed == 0
