"""The inputs' conveyor table: every micro-batch's inputs reach stage 0 in each tick that reads
them, sent from the stage that holds them, one stage per tick (two over a delayed link); tables
exist exactly where the data has time to travel."""

import numpy as np
import pytest

from tpipe import schedules
from tpipe.schedules import streaming

pytestmark = pytest.mark.unit

CHUNKS = {"gpipe": 1, "circular": 2, "1f1b": 1, "zb_h1": 1, "zbv": 2, "interleaved_1f1b": 2}
SIZES = [(2, 2), (2, 6), (4, 4), (4, 8), (4, 12), (8, 16)]
DELAYS = [0, 1, "crossing"]


def _delays(given, stages):
  # "crossing": the links two slices of S/2 stages each cross (the middle one and the closing).
  if given == "crossing":
    return tuple(int(link in (stages // 2 - 1, stages - 1)) for link in range(stages))
  return given


@pytest.mark.parametrize("name", CHUNKS)
@pytest.mark.parametrize("stages,microbatches", SIZES)
@pytest.mark.parametrize("given", DELAYS)
def test_every_read_gets_its_microbatch_from_its_holder(name, stages, microbatches, given):
  delays = _delays(given, stages)
  table = schedules.build(name, stages, microbatches, CHUNKS[name], delays)
  reads = streaming.first_stage_reads(table)
  stream = streaming.input_stream(reads, stages, microbatches, delays)
  travel = streaming.hop_ticks(schedules.actions.link_delays(delays, stages))
  # Feasible exactly where every read comes no sooner than its data can travel from its holder.
  per = microbatches // stages
  feasible = all(t >= travel[m // per] for t, m in enumerate(reads) if m >= 0)
  assert (stream is not None) == feasible
  if stream is None:
    return
  assert np.array_equal(stream.deliveries(), reads)
  # Every micro-batch stage 0 runs first-chunk work on is read at least once; a forward table
  # reads each once, a fused one twice (F, and the backward that recomputes it).
  counts = np.bincount(reads[reads >= 0], minlength=microbatches)
  assert counts.tolist() == [1 if isinstance(table, schedules.Schedule) else 2] * microbatches
  # A stage puts only micro-batches it holds on the conveyor, each at most once per read.
  held = stream.source[stream.source >= 0]
  assert held.max() < per and (stream.source >= 0).sum() == (reads >= 0).sum()


def test_a_fused_table_reads_inputs_at_forward_and_backward_of_the_first_chunk():
  table = schedules.build("1f1b", 2, 4)
  reads = streaming.first_stage_reads(table)
  actions = [table.action[t, 0] for t in range(table.num_ticks)]
  expected = [int(table.microbatch[t, 0]) if a >= 0 and a != schedules.Action.W else -1
              for t, a in enumerate(actions)]
  assert reads.tolist() == expected
  assert sorted(m for m in reads if m >= 0) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_the_conveyor_waits_an_extra_tick_over_a_delayed_link():
  table = schedules.build("gpipe", 2, 4, delays=1)
  stream = streaming.input_stream(streaming.first_stage_reads(table), 2, 4, 1)
  # Stage 1 holds micro-batches 2 and 3, read at ticks 2 and 3: they leave two ticks earlier.
  assert stream.source[:, 1].tolist()[:2] == [0, 1]
  assert streaming.input_stream(streaming.first_stage_reads(table), 2, 4, 0).source[
      :, 1].tolist()[:3] == [-1, 0, 1]


@pytest.mark.parametrize("stages,microbatches,delays", [
    (4, 6, 0),   # M not a multiple of S: a micro-batch's rows span two stages.
    (1, 4, 0),   # One stage: nothing to send.
    (4, 4, 1),   # M = S with every link delayed: micro-batch 3 needs 6 ticks, is read at 3.
])
def test_no_table_where_the_inputs_cannot_stream(stages, microbatches, delays):
  table = schedules.build("gpipe", stages, microbatches, delays=delays)
  assert streaming.input_stream(streaming.first_stage_reads(table), stages, microbatches,
                                delays) is None


def test_a_recomputing_w_reads_the_inputs_too():
  table = schedules.build("zb_h1", 2, 4)
  plain, with_w = streaming.first_stage_reads(table), streaming.first_stage_reads(table, True)
  w_ticks = np.nonzero((table.action[:, 0] == schedules.Action.W))[0]
  assert np.all(plain[w_ticks] == -1)
  np.testing.assert_array_equal(with_w[w_ticks], table.microbatch[w_ticks, 0])
  stream = streaming.input_stream(with_w, 2, 4, table.delays)
  assert stream is not None
  np.testing.assert_array_equal(stream.deliveries(), with_w)


def test_a_compound_tick_reads_two_microbatches_over_two_lanes():
  # 1F1B in compound ticks on 2 stages: stage 0 runs a forward beside a backward of chunk 0 in
  # one tick, so it reads two micro-batches' inputs there, one in each lane.
  table = schedules.build("1f1b", 2, 4, 1, None, {"F": 1.0, "B": 3.0})
  assert table.is_compound
  reads = streaming.lane_reads(table)
  assert reads.shape == (table.lanes, table.num_ticks)
  assert ((reads >= 0).sum(axis=0) == 2).any()
  # Every read of the table, row by row, is in exactly one lane at its tick.
  rows = streaming.first_stage_reads(table)
  assert sorted(reads[reads >= 0].tolist()) == sorted(rows[rows >= 0].tolist())
  for lane in range(table.lanes):
    stream = streaming.input_stream(reads[lane], 2, 4)
    np.testing.assert_array_equal(stream.deliveries(), reads[lane])
  # A table of one action per tick has one lane: its reads.
  plain = schedules.build("1f1b", 2, 4)
  np.testing.assert_array_equal(streaming.lane_reads(plain), [streaming.first_stage_reads(plain)])
