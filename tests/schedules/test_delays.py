"""Delayed links in schedule tables: what crosses a delayed link arrives two ticks after it is
sent. Normalization of ``delays``, the forward schedules' stage offsets and lap period, the fused
tables' routing (every message over a delayed link read no earlier than two ticks after its
send, mailboxes sized for the wait), the warm-up 1F1B adds per delayed link, validation of
hand-written tables, and the tick counts each delayed link adds."""

import numpy as np
import pytest

from tpipe import schedules
from tpipe.schedules import actions

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("given,stages,expected", [
    (None, 4, (0, 0, 0, 0)), (0, 4, (0, 0, 0, 0)), (1, 4, (1, 1, 1, 1)), (1, 1, (0,)),
    ((0, 1, 0, 1), 4, (0, 1, 0, 1)), (np.array([1, 0]), 2, (1, 0)),
])
def test_link_delays_normalize_to_one_per_link(given, stages, expected):
  assert schedules.actions.link_delays(given, stages) == expected


@pytest.mark.parametrize("given,stages,error,match", [
    (2, 4, ValueError, r"transfer_delay=2: a transfer is delayed by 0 or 1 tick"),
    (True, 4, TypeError, r"must be 0, 1 or one 0/1 per link, got True"),
    ((0, 1), 4, ValueError, r"give one 0 or 1 per link of the ring of 4 stages .* "
                            r"e\.g\. \(0, 0, 0, 1\)"),
    ((0, 2), 2, ValueError, r"give one 0 or 1 per link"),
    ((1,), 1, ValueError, r"a one-stage pipeline sends nothing to delay"),
    ("1", 2, ValueError, r"give one 0 or 1 per link"),
    (1.0, 2, TypeError, r"must be 0, 1 or one 0/1 per link"),
])
def test_bad_delays_name_the_fix(given, stages, error, match):
  with pytest.raises(error, match=match):
    schedules.actions.link_delays(given, stages)


def test_the_link_of_a_message_and_the_delay_of_each_hop():
  assert [actions.link_of(s, 1, 4) for s in range(4)] == [0, 1, 2, 3]
  assert [actions.link_of(s, -1, 4) for s in range(4)] == [3, 0, 1, 2]
  # Loop placement, 2 chunks on 4 stages: hops 0-1, 1-2, 2-3, 3-0 (the closing link), 0-1, ...
  assert actions.hop_delays("loop", 4, 2, (0, 1, 0, 1)).tolist() == [0, 1, 0, 1, 0, 1, 0]
  # V placement: down links 0..2, the turn on stage 3 (no link), back up over links 2..0.
  assert actions.hop_delays("v", 4, 2, (1, 0, 1, 0)).tolist() == [1, 0, 1, 0, 1, 0, 1]


@pytest.mark.parametrize("delays", [(0, 1, 0, 1), (1, 1, 1, 1), (1, 0, 0, 0)])
def test_gpipe_stages_start_one_tick_later_per_delayed_link(delays):
  table = schedules.build("gpipe", 4, 3, delays=delays)
  start = [int(np.argmax(table.microbatch[:, s] == 0)) for s in range(4)]
  assert start == [s + sum(delays[:s]) for s in range(4)]
  assert table.num_ticks == 3 + 3 + sum(delays[:3])
  assert table.delays == delays


def test_circular_laps_wait_for_the_closing_link():
  table = schedules.build("circular", 4, 4, 2, delays=(0, 0, 0, 1))
  # Micro-batch 0 leaves stage 3 at tick 3; over the delayed closing link it reaches stage 0 for
  # its second lap at tick 5, so the lap period is max(M, S + sum(delays)) = 5.
  assert table.microbatch[5, 0] == 0 and table.repeat[5, 0] == 1
  assert table.microbatch[4, 0] == schedules.IDLE
  assert table.num_ticks == 5 + 4 + 3


def _messages(table):
  """``(send tick, read tick, sender, receiver, link)`` of every message between stages."""
  step = schedules.whole_step(table)
  vstage = step.virtual_stage
  stage_of, _ = actions.placement_of(vstage)
  done = {(kind, m, v): t for t, s, kind, m, v in step.actions()}
  out = []
  num_virtual = step.num_stages * step.num_chunks
  directions = actions.link_directions(step.placement, step.num_stages, step.num_chunks)
  for (kind, m, v), t in done.items():
    back = kind in ("B", "BI")
    nxt = v - 1 if back else v + 1
    if not 0 <= nxt < num_virtual or (kind == "W"):
      continue
    hop = min(v, nxt)
    if directions[hop] == 0:
      continue
    read = done.get(("B", m, nxt), done.get(("BI", m, nxt))) if back else done[("F", m, nxt)]
    sender, direction = int(stage_of[v]), int(directions[hop]) * (-1 if back else 1)
    out.append((t, read, sender, int(stage_of[nxt]),
                actions.link_of(sender, direction, step.num_stages)))
  return out


@pytest.mark.parametrize("name,repeats", [("gpipe", 1), ("circular", 2), ("1f1b", 1),
                                          ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2)])
@pytest.mark.parametrize("delays", [(0, 1, 0, 1), (1, 1, 1, 1)])
def test_every_message_over_a_delayed_link_is_read_two_ticks_after_its_send(name, repeats,
                                                                            delays):
  plain = schedules.whole_step(schedules.build(name, 4, 8, repeats))
  table = schedules.build(name, 4, 8, repeats, delays=delays)
  step = schedules.whole_step(table)
  assert step.delays == delays
  messages = _messages(table)
  assert messages
  assert all(read >= sent + 1 + delays[link] for sent, read, _, _, link in messages)
  # The mailbox holds each message from its arrival: written at sent + 1 + delay.
  arrivals = step.arrival_slots()
  for sent, _, sender, receiver, link in messages:
    origin = 0 if (sender + 1) % 4 == receiver and link == sender else 1
    assert arrivals[sent + 1 + delays[link], receiver, origin] >= 0
  # Delays cost ticks: at least one per delayed link a micro-batch crosses each way.
  assert step.num_ticks > plain.num_ticks


def test_1f1b_warms_up_one_more_forward_per_delayed_link_ahead():
  plain = schedules.build("1f1b", 4, 8)
  table = schedules.build("1f1b", 4, 8, delays=(0, 1, 0, 0))
  assert table.peak_in_flight().tolist() == [5, 4, 2, 1]
  assert plain.peak_in_flight().tolist() == [4, 3, 2, 1]
  # Two ticks per delayed link between stages, one each way: nothing more.
  assert table.num_ticks == plain.num_ticks + 2


def test_a_hand_written_table_that_reads_a_delayed_message_too_early_is_rejected():
  good = schedules.build("1f1b", 2, 1, delays=(1, 0))
  # F0 leaves stage 0 at tick 0 and arrives at 2; its gradient leaves stage 1 at 3, arrives 5.
  assert good.describe().split("\n") == ["stage 0: F0  .  .  .  . B0",
                                         "stage 1:  .  . F0 B0  .  ."]
  with pytest.raises(ValueError, match=r"tick 1, stage 1: F of micro-batch 0, chunk 0 needs F "
                                       r"of chunk 0 on stage 0 done at tick -1 or earlier "
                                       r"\(delayed link\)"):
    schedules.FusedSchedule("bad", 2, 1, 1, "loop",
                            action=[[0, -1], [-1, 0], [-1, 1], [-1, -1], [1, -1]],
                            microbatch=[[0, -1], [-1, 0], [-1, 0], [-1, -1], [0, -1]],
                            chunk=[[0, -1], [-1, 0], [-1, 0], [-1, -1], [0, -1]],
                            stash_slot=[[0, -1], [-1, 0], [-1, 0], [-1, -1], [0, -1]],
                            delays=(1, 0))


def test_build_caches_per_delays():
  plain = schedules.build("1f1b", 4, 8)
  assert schedules.build("1f1b", 4, 8, delays=0) is plain
  assert schedules.build("1f1b", 4, 8, delays=(0, 0, 0, 0)) is plain
  delayed = schedules.build("1f1b", 4, 8, delays=(0, 1, 0, 1))
  assert delayed is not plain and schedules.build("1f1b", 4, 8, delays=[0, 1, 0, 1]) is delayed


# S = 4, M = 8: ticks with no delay and with every link delayed, as the README quotes them.
README_TICKS = {"gpipe": (1, 11, 14), "circular": (2, 19, 22), "1f1b": (1, 22, 28),
                "zb_h1": (1, 27, 33), "interleaved_1f1b": (2, 38, 52), "zbv": (2, 51, 65)}


@pytest.mark.parametrize("name", sorted(README_TICKS))
def test_each_delayed_link_adds_a_tick_per_crossing_of_the_critical_path(name):
  """One tick per delayed link for the forward schedules; two for 1F1B and ZB-H1 (forward and
  backward both cross it); at least two for interleaved 1F1B and ZB-V, which cross it more."""
  repeats, plain, delayed = README_TICKS[name]
  ticks = lambda delays: schedules.build(name, 4, 8, repeats, delays=delays).num_ticks
  assert (ticks(0), ticks(1)) == (plain, delayed)
  per_link = {"gpipe": 1, "circular": 1, "1f1b": 2, "zb_h1": 2}
  for links in ((1, 0, 0, 0), (0, 1, 0, 0), (1, 1, 1, 0)):
    added = ticks(links) - plain
    if name in per_link:
      assert added == per_link[name] * sum(links), (links, added)
    else:
      assert added >= 2 * sum(links), (links, added)
