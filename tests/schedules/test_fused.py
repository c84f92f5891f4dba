"""tpipe.schedules.fused: the validation of hand-written fused tables, their derived routing,
``from_forward`` (a forward schedule's whole step) and ``FusedSchedule.forward_pass``.

Tables are drawn as in :mod:`tests.helpers.schedule_tables`; the named schedules' own tables are
in test_orders.py.
"""

import doctest
import importlib

import numpy as np
import pytest

from tests.helpers import schedule_tables
from tests.helpers.schedule_tables import A
from tests.helpers.schedule_tables import assert_table
from tests.helpers.schedule_tables import fused
from tests.helpers.schedule_tables import parse
from tpipe import schedules
from tpipe.schedules import fused as fused_lib

pytestmark = pytest.mark.unit

_ = schedules.IDLE


def test_parse_reads_the_drawing():
  action, microbatch, chunk = parse("F0 BI1/1\n.  W2")
  np.testing.assert_array_equal(action, [[A.F, _], [A.BI, A.W]])
  np.testing.assert_array_equal(microbatch, [[0, _], [1, 2]])
  np.testing.assert_array_equal(chunk, [[0, _], [1, 0]])
  in_blocks = parse("""
      F0
      .

      BI1/1
      W2
  """)
  np.testing.assert_array_equal(in_blocks, [action, microbatch, chunk])


def test_fused_describe_draws_the_table():
  # Stage 0's BI0 waits for stage 1's (sent at tick 2, arrives at tick 3).
  assert schedules.build("zb_h1", 2, 1).describe() == ("stage 0:  F0   .   . BI0  W0\n"
                                                       "stage 1:   .  F0 BI0  W0   .")
  assert schedules.build("zbv", 1, 1).describe() == "stage 0:  F0/0  F0/1 BI0/1  W0/1 BI0/0  W0/0"


def test_actions_list_the_work_by_tick_then_stage():
  assert schedules.build("zb_h1", 2, 1).actions() == [
      (0, 0, "F", 0, 0), (1, 1, "F", 0, 1), (2, 1, "BI", 0, 1), (3, 0, "BI", 0, 0),
      (3, 1, "W", 0, 1), (4, 0, "W", 0, 0)]
  # ZB-V on one stage: local chunk 1 is model chunk 1 here; on two stages stage 0 holds model
  # chunks 0 and 3 (the V).
  assert [a[4] for a in schedules.build("zbv", 1, 1).actions()] == [0, 1, 1, 1, 0, 0]
  table = schedules.build("zbv", 2, 2)
  listed = table.actions()
  assert len(listed) == int(table.busy.sum())
  assert {(s, v) for _, s, _, _, v in listed} == {(0, 0), (0, 3), (1, 1), (1, 2)}
  for t, s, kind, m, _ in listed:
    assert schedules.Action[kind] == table.action[t, s] and m == table.microbatch[t, s]


# --------------------------------------------------------------------------------------------
# from_forward: a forward schedule and autodiff's backward as one table.


def test_from_forward_is_the_step_autodiff_runs():
  s = schedules.whole_step(schedules.build("gpipe", 2, 2))
  assert_table(s, """
      F0 F1 .  .  B1 B0
      .  F0 F1 B1 B0 .
  """)
  np.testing.assert_array_equal(s.peak_in_flight(), [2, 2])
  assert not s.forward_only
  c = schedules.build("circular", 2, 2, 2)
  f = schedules.whole_step(c)
  assert f.name == "circular" and f.num_chunks == 2 and f.placement == "loop"
  assert f.bubble_fraction == pytest.approx(c.bubble_fraction)
  np.testing.assert_array_equal(f.peak_in_flight(), [4, 4])  # R * M per stage.


def test_gpipe_and_circular_messages_too():
  assert schedule_tables.replay_mailboxes(schedules.whole_step(schedules.build("gpipe", 3, 4))) == (
      2 * 4 * 2)
  assert schedule_tables.replay_mailboxes(
      schedules.whole_step(schedules.build("circular", 2, 3, 2))) == 2 * 3 * 3


# --------------------------------------------------------------------------------------------
# Hand-written tables: accepted when consistent, rejected with the broken rule named.


def test_hand_written_fused_table_is_accepted():
  s = fused("F0 . . B0\n. F0 B0 .", [[0, _, _, 0], [_, 0, 0, _]], 2, 1)
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
    fused(text, slots, stages, microbatches)


def test_malformed_fused_tables_are_rejected():
  action, microbatch, chunk = parse("F0 B0")
  good = dict(name="x", num_stages=1, num_microbatches=1, num_chunks=1, placement="loop",
              action=action, microbatch=microbatch, chunk=chunk, stash_slot=np.zeros((2, 1)))
  schedules.FusedSchedule(**good)
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


def test_fused_tables_are_read_only_copies():
  action, microbatch, chunk = parse("F0 B0")
  s = schedules.FusedSchedule("x", 1, 1, 1, "loop", action=action, microbatch=microbatch,
                              chunk=chunk, stash_slot=np.zeros((2, 1)))
  action[1, 0] = A.F  # The caller's array is not the table.
  assert s.action[1, 0] == A.B
  for name in ("action", "microbatch", "chunk", "stash_slot", "send_dir", "send_slot",
               "recv_slot"):
    with pytest.raises(ValueError, match="read-only"):
      getattr(s, name)[0, 0] = 1


def test_place_reports_orders_that_deadlock():
  # Stage 1 wants micro-batch 1 first; stage 0 sends micro-batch 0 first and then waits on a
  # backward that stage 1 cannot run before F1.
  orders = [[(A.F, 0, 0), (A.B, 0, 0), (A.F, 1, 0), (A.B, 1, 0)],
            [(A.F, 1, 0), (A.B, 1, 0), (A.F, 0, 0), (A.B, 0, 0)]]
  with pytest.raises(ValueError, match=r"hand: the action orders deadlock at tick 1; stages wait "
                                       r"on \{0: \(<Action.B: 1>, 0, 0\), 1: \(<Action.F: 0>, 1, "
                                       r"0\)\}"):
    schedules.fused.place("hand", 2, 2, 1, "loop", orders)


# --------------------------------------------------------------------------------------------
# forward_pass: the table's forward actions alone (what a call that is not differentiated runs).


def _every_table():
  """Every named fused table and every forward schedule's step, on a few sizes."""
  tables = []
  for stages, microbatches in ((1, 1), (1, 3), (2, 1), (2, 2), (3, 5), (4, 4), (4, 9)):
    tables += [schedules.build(name, stages, microbatches,
                               num_repeats=2 if name == "interleaved_1f1b" else None)
               for name in schedules.FUSED_SCHEDULE_NAMES]
    tables += [schedules.whole_step(schedules.build("gpipe", stages, microbatches)),
               schedules.whole_step(schedules.build("circular", stages, microbatches, 3))]
  tables += [schedules.build("interleaved_1f1b", 3, 5, 3),
             schedules.build("interleaved_1f1b", 4, 8, 3)]
  return tables


@pytest.mark.parametrize("table", _every_table(),
                         ids=lambda t: f"{t.name}-S{t.num_stages}-M{t.num_microbatches}-"
                                       f"C{t.num_chunks}")
def test_forward_pass_runs_each_forward_once_in_the_tables_order(table):
  f = table.forward_pass()
  assert f.forward_only and not table.forward_only
  assert (f.name, f.num_stages, f.num_microbatches, f.num_chunks, f.placement) == (
      table.name, table.num_stages, table.num_microbatches, table.num_chunks, table.placement)
  np.testing.assert_array_equal(f.virtual_stage, table.virtual_stage)
  assert set(np.unique(f.action)) <= {_, A.F}
  np.testing.assert_array_equal(f.stash_slot, np.full(f.action.shape, _))
  assert f.peak_in_flight().tolist() == [0] * f.num_stages
  every = sorted((m, c) for m in range(f.num_microbatches) for c in range(f.num_chunks))
  for s in range(f.num_stages):
    busy = np.nonzero(f.busy[:, s])[0]
    # Every micro-batch's forward on every chunk of the stage, exactly once ...
    assert sorted(zip(f.microbatch[busy, s].tolist(), f.chunk[busy, s].tolist())) == every
    # ... in the order the full table runs them, each no later than there.
    forwards = np.nonzero(table.action[:, s] == A.F)[0]
    assert list(zip(f.microbatch[busy, s], f.chunk[busy, s])) == list(
        zip(table.microbatch[forwards, s], table.chunk[forwards, s]))
    assert np.all(busy <= forwards)
  # Its routing is derived and validated like any table's: one activation per chunk border.
  assert schedule_tables.replay_mailboxes(f) == f.num_microbatches * (f.virtual_stage.size - 1)
  assert f.num_ticks <= table.num_ticks
  assert f.forward_pass().describe() == f.describe()  # Idempotent.


@pytest.mark.parametrize("stages,microbatches", [(1, 1), (2, 3), (3, 2), (4, 8)])
def test_forward_pass_of_gpipe_like_tables_is_gpipe(stages, microbatches):
  gpipe = schedules.build("gpipe", stages, microbatches)
  for name in ("1f1b", "zb_h1"):
    f = schedules.build(name, stages, microbatches).forward_pass()
    np.testing.assert_array_equal(f.microbatch, gpipe.microbatch)
    np.testing.assert_array_equal(f.chunk, gpipe.repeat)
  for forward in (gpipe, schedules.build("circular", stages, microbatches, 2)):
    f = schedules.whole_step(forward).forward_pass()
    np.testing.assert_array_equal(f.microbatch, forward.microbatch)
    np.testing.assert_array_equal(f.chunk, forward.repeat)


def test_forward_pass_of_zbv_by_hand():
  # V placement: stage 0 holds model chunks 0 and 3, stage 1 chunks 1 and 2. Stage 0 runs its
  # forwards in ZB-V's order F0/0 F1/0 F0/1 F1/1, each as soon as its input is there.
  f = schedules.build("zbv", num_stages=2, num_microbatches=2).forward_pass()
  assert_table(f, """
      F0/0 F1/0 .    F0/1 .    F1/1
      .    F0/0 F0/1 F1/0 F1/1 .
  """)
  # Chunk 0 sends right, the turn at stage 1 stays local, chunk 1 sends left; the last chunk
  # (stage 0's chunk 1) sends nothing.
  np.testing.assert_array_equal(f.send_dir.T, [[1, 1, 0, 0, 0, 0], [0, 0, -1, 0, -1, 0]])
  # Stage 1's mailbox: F1/0 from stage 0 arrives at tick 2 but is read at tick 3, after its own
  # F0/0 output (arrived at tick 2, read at tick 2) took slot 0: it goes to slot 1.
  np.testing.assert_array_equal(f.send_slot.T, [[0, 1, _, _, _, _], [_, 0, 0, 0, 0, _]])
  np.testing.assert_array_equal(f.mailbox_slots(), [1, 2])
  assert f.describe() == ("stage 0: F0/0 F1/0    . F0/1    . F1/1\n"
                          "stage 1:    . F0/0 F0/1 F1/0 F1/1    .")
  assert f.simulate({"F": 1}).lockstep == f.num_ticks == 6


@pytest.mark.parametrize("text,slots,stages,match", [
    ("F0 B0", [[_, _]], 1, "a forward-only table runs only F actions"),
    ("F0", [[0]], 1, "a forward-only table stashes nothing: stash_slot must be IDLE"),
    ("F0\nF0", [[_], [_]], 2, "tick 0, stage 1: F of micro-batch 0, chunk 0 needs F of chunk 0 "
                              "on stage 0 done at an earlier tick"),
    ("F0 .\n. .", [[_, _], [_, _]], 2, "stage 1, micro-batch 0, chunk 0: no forward"),
])
def test_broken_forward_only_tables_are_rejected(text, slots, stages, match):
  with pytest.raises(ValueError, match=match):
    fused(text, slots, stages, 1, forward_only=True)
  fused("F0 .\n. F0", [[_, _], [_, _]], 2, 1, forward_only=True)  # The right one is accepted.


def test_module_doctests_pass():
  result = doctest.testmod(importlib.import_module("tpipe.schedules.fused"))
  assert result.attempted >= 7 and result.failed == 0
  assert fused_lib.FusedSchedule is schedules.FusedSchedule
