"""Streamed inputs: each micro-batch's inputs ride a conveyor of one-stage sends to stage 0 in the
ticks that read them, from the stage that holds them, instead of one all-gather of the batch
before the first tick. Forward schedules (their gradients by autodiff through the conveyor) and
fused ones (inputs read at F and again at the backward of chunk 0), over plain and delayed links
(two emulated slices), give the sequential model's loss and gradients, float inputs' gradients
included (numerics rule: :mod:`tests.helpers.numerics`); the step holds no gather of the inputs.
"""

import re

import jax
import pytest

import tpipe
from tests.helpers import linen_models as lm
from tpipe.core.base import spmd
from tpipe.core.loops import streaming


# Per-action costs whose tables are compound at every size here: stage 0 can read two
# micro-batches in one tick, each over the conveyor of its lane.
COMPOUND = {"F": 1.0, "B": 3.0, "BI": 2.0, "W": 1.0}


def _model(name, schedule, mesh, microbatches, remat, stream=True, tick_costs=COMPOUND):
  # Fused schedules in compound ticks or one action per tick ("plain").
  costs = {"tick_costs": tick_costs} if tpipe.schedules.is_fused(schedule) else {}
  return lm.loss_sequential(name, schedule, mesh, microbatches, remat, stream_inputs=stream,
                            **costs)


# (model, schedule, stages, micro-batches per replica, remat, slices, fused tables' tick costs):
# on two slices the links between them are delayed (with two stages, both links). "mlp" and
# "blocks" take float inputs, whose gradients come back along the conveyor; "lm" takes tokens.
CASES = [
    ("mlp", "gpipe", 4, 4, "none", 1, None),
    ("lm", "gpipe", 2, 6, "full", 2, None),
    ("blocks", "circular", 4, 4, "dots", 1, None),
    ("mlp", "1f1b", 2, 6, "full", 2, COMPOUND),
    ("lm", "1f1b", 2, 6, "none", 1, "plain"),
    ("blocks", "zbv", 2, 4, "none", 2, COMPOUND),
    ("lm", "zb_h1", 4, 4, "full", 1, "plain"),
    ("mlp", "zb_h1", 2, 6, "none", 1, COMPOUND),
    ("mlp", "interleaved_1f1b", 2, 6, "dots", 2, COMPOUND),
]


def test_some_case_reads_two_microbatches_in_one_tick():
  reads = [tpipe.schedules.streaming.lane_reads(tpipe.schedules.build(
      schedule, stages, microbatches, 2 if schedule in lm.TWO_CHUNKS else 1,
      1 if slices == 2 else None, costs)) for _, schedule, stages, microbatches, _, slices, costs
      in CASES if costs is COMPOUND]
  assert any(((r >= 0).sum(axis=0) >= 2).any() for r in reads)


@pytest.mark.parametrize("name,schedule,stages,microbatches,remat,slices,tick_costs", CASES)
def test_streamed_inputs_equal_sequential(name, schedule, stages, microbatches, remat, slices,
                                          tick_costs):
  mesh = lm.emulated_mesh(stages, slices)
  model = _model(name, schedule, mesh, microbatches, remat, tick_costs=tick_costs)
  _, x, _, _ = lm.loss_model(name)
  axes = spmd.Axes.of(mesh, model.spec.stage_axis, model.spec.data_axis)
  conveyor = streaming.plan(model.spec.table, axes, x.shape[0], True)
  assert conveyor is not None
  assert any(model.spec.delays) == (slices == 2)
  # Where stage 0 reads two micro-batches in one tick (lanes of a compound tick), each comes
  # over a conveyor of its own.
  reads = tpipe.schedules.streaming.lane_reads(model.spec.table)
  assert len(conveyor.lanes) >= (reads >= 0).sum(axis=0).max()
  lm.assert_loss_equals_sequential(model, name, microbatches * (8 // stages))


def _collectives(model, name):
  _, x, targets, float_input = lm.loss_model(name)
  mesh = model.spec.mesh
  x, targets = jax.device_put((x, targets), tpipe.data_sharding(mesh))
  text = jax.jit(lm.value_and_grad(lm.pipelined_loss(model), float_input)).lower(
      lm.random_params(name), x, targets).as_text()
  return (len(re.findall(r"stablehlo\.all_gather", text)),
          len(re.findall(r"stablehlo\.collective_permute", text)))


@pytest.mark.parametrize("schedule,name", [("gpipe", "mlp"), ("1f1b", "mlp"), ("zbv", "blocks")])
def test_streaming_replaces_the_gather_of_the_inputs_with_sends(schedule, name):
  mesh = lm.emulated_mesh(4, 1)
  gathers, sends = _collectives(_model(name, schedule, mesh, 4, "full"), name)
  gathers_off, sends_off = _collectives(_model(name, schedule, mesh, 4, "full", False), name)
  # One all-gather fewer (the inputs'; the per-example targets every stage reads are still
  # gathered once), and one more send per tick: the conveyor's, one stage left (its transpose,
  # by autodiff, sends gradients back right).
  assert gathers == gathers_off - 1
  assert sends > sends_off


def test_stream_inputs_must_be_a_bool():
  with pytest.raises(TypeError, match=r"stream_inputs must be True or False, got 'yes'"):
    tpipe.PipelineSpec(num_stages=2, num_microbatches=2, stream_inputs="yes")


@pytest.mark.parametrize("microbatches,delays,batch,stream,expected", [
    (8, 0, 48, True, "streamed to stage 0 one micro-batch per tick (each stage holds 2 of 8)"),
    (6, 0, 48, True, "gathered onto every stage once per step (M=6 is not a multiple of S=4)"),
    (4, 1, 48, True, "before its inputs could travel over the delayed links"),
    (8, 0, 48, False, "gathered onto every stage once per step (stream_inputs=False)"),
    (8, 0, 36, True, "replicated over the stages"),
])
def test_describe_says_how_the_inputs_arrive(microbatches, delays, batch, stream, expected):
  axes = spmd.Axes.of(lm.emulated_mesh(4, 1), "stage", "data")
  table = tpipe.schedules.build("gpipe", 4, microbatches, delays=delays)
  assert expected in streaming.describe(table, axes, batch, stream)
