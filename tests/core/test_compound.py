"""Compound ticks run exactly: tables whose ticks hold a forward, a backward and weight work per
stage (:mod:`tpipe.schedules.compound`, ``tick_costs=``) give the sequential model's loss and
gradients (numerics rule: :mod:`tests.helpers.numerics`), float inputs' gradients included, for
every fused schedule, over plain and delayed links (two emulated slices), with data replicas;
each tick's steps run one after another and its messages leave once, after them.
"""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import tpipe
from tests.helpers import linen_models as lm
from tpipe.core.base import spmd
from tpipe.core.loops import streaming
from tpipe.core.loops import tick_rows
from tpipe.experimental import search
from tpipe.tools import analysis

# Per-action costs with the backward three forwards (a full-remat block): compound ticks pair
# a forward with a backward.
COSTS = {"F": 1.0, "B": 3.0, "BI": 2.0, "W": 1.0}


# (model, schedule, stages, micro-batches per replica, remat, slices, micro-batches overlapped):
# a covering set, not a cross product (each case compiles its own step): every fused schedule,
# S in {2, 4}, every remat policy, every model, plain and delayed links, with and without
# overlapped micro-batches (a forward and a backward of a tick in one conditional) at least once.
CASES = [
    ("blocks", "1f1b", 2, 8, "none", 2, True),
    ("mlp", "zb_h1", 4, 4, "dots", 2, False),
    ("blocks", "zbv", 2, 4, "none", 1, True),
    ("lm", "interleaved_1f1b", 2, 6, "full", 1, False),
]


@pytest.mark.unit
def test_the_cases_cover_every_fused_schedule():
  assert {case[1] for case in CASES} == set(tpipe.schedules.FUSED_SCHEDULE_NAMES)
  assert {case[-1] for case in CASES} == {True, False}


@pytest.mark.parametrize("name,schedule,stages,microbatches,remat,slices,overlap", CASES)
def test_compound_ticks_equal_sequential(name, schedule, stages, microbatches, remat, slices,
                                         overlap):
  mesh = lm.emulated_mesh(stages, slices)
  model = lm.loss_sequential(name, schedule, mesh, microbatches, remat, tick_costs=COSTS,
                             overlap_microbatches=overlap)
  table = model.spec.table
  assert table.is_compound and table.num_ticks < table.num_rows
  assert tick_rows.paired(table).any()  # Pairs to overlap, or to run in their lanes.
  assert any(model.spec.delays) == (slices == 2)
  lm.assert_loss_equals_sequential(model, name, microbatches * (8 // stages))


def test_held_and_settled_weights_equal_sequential():
  """A ZB-H1 table whose W the builder held (weight_hold) and then moved into slack
  (settle_weights) runs exactly: costs with BI 2.3 forwards build one at S = 4, M = 4, its W in
  ticks the packing rules alone never put them in."""
  compound = tpipe.schedules.compound
  weight_settling = tpipe.schedules.weight_settling
  costs = {"F": 1.0, "BI": 2.3, "W": 1.0}
  mesh = lm.emulated_mesh(4)
  model = lm.loss_sequential("mlp", "zb_h1", mesh, 4, "full", tick_costs=costs)
  table = model.spec.table
  packed = [compound.pack("zb_h1", 4, 4, 1, costs, **settings)
            for settings in compound.candidates("zb_h1", 4)]
  assert all(p.actions() != table.actions() for p in packed)  # Settled, not packed.
  assert any(settings.get("weight_hold") is not None
             and weight_settling.settle_weights(p, costs, 8).actions() == table.actions()
             for settings, p in zip(compound.candidates("zb_h1", 4), packed))
  lm.assert_loss_equals_sequential(model, "mlp", 4 * 2)


def test_searched_table_equals_sequential():
  """A ZB-H1 table the exact window search re-placed (tpipe.experimental.search.with_search)
  runs exactly: the measured remat-none costs at S = 4, M = 2, where the search finds a table
  2% shorter than the builder's (5073.1 against 5194.5), which no rule of the builder makes."""
  costs = {"F": 403.4, "BI": 528.9, "W": 407.5}
  mesh = lm.emulated_mesh(4)
  spec = search.with_search(tpipe.PipelineSpec(num_stages=4, num_microbatches=2,
                                               schedule="zb_h1", tick_costs=costs), 1)
  model = lm.loss_sequential("mlp", "zb_h1", mesh, 2, "full", spec=spec, tick_costs=costs)
  assert model.spec.tick_search == 1
  table = model.spec.table
  built = model.spec.replace(tick_search=0).table
  assert table.actions() != built.actions()
  assert table.simulate(costs).neighbour < 0.98 * built.simulate(costs).neighbour
  lm.assert_loss_equals_sequential(model, "mlp", 2 * 2)


def test_compound_tick_sends_once_per_tick():
  """The tick loop runs one switch per lane of the table (and a conditional of its own per
  backward adding into the sums by units where a lane holds several,
  tpipe.core.loops.tick_rows.lane_groups) and still exchanges one message each way per tick: two
  collective-permutes in the loop body, as with one action, and one more for the inputs'
  conveyors (every lane's carriage in one send), as with one action."""
  mesh = lm.emulated_mesh(4)
  model = lm.loss_sequential("mlp", "1f1b", mesh, 4, tick_costs=COSTS)
  table = model.spec.table
  _, x, targets, float_input = lm.loss_model("mlp")
  x, targets = jax.device_put((x, targets), tpipe.data_sharding(mesh))
  loss = jax.jit(lm.value_and_grad(lm.pipelined_loss(model), float_input))
  text = loss.lower(lm.random_params("mlp"), x, targets).compile().as_text()
  assert table.lanes == 2
  programs = model.pipeline_for(x, targets=targets).programs()
  count = max(programs) + 1
  groups = [tick_rows.lane_groups([n > 0 and (n - 1) // count == tpipe.schedules.Action.B
                                   for n in numbers])
            for numbers in tick_rows.lane_switches(table, programs)]
  assert all(len(apart) >= 2 for _, apart in groups), groups  # The programs' B run apart.
  # A switch left with idle alone is no conditional.
  conditionals = sum((len(together) > 1) + len(apart) for together, apart in groups)
  loops = [body for body in re.split(r"\n(?=\S)", text) if "conditional(" in body
           and body.count("conditional(") == conditionals]
  assert loops, f"no loop body runs {conditionals} conditionals"
  assert all(body.count("collective-permute(") + body.count("collective-permute-start(") == 3
             for body in loops)


# (model, schedule, stages, micro-batches per replica, slices, tick costs, what W recomputes,
# remat): "forward", W runs the chunk's forward again; "backward", its forward and backward (BI
# forms input gradients only). The batch is split over the stages, so the inputs stream (in
# compound ticks, a conveyor per lane that reads them), and W reads them too. A covering set:
# each recompute in one-action and in compound ticks, both split schedules, every remat policy,
# every model, plain and delayed links.
RECOMPUTE_CASES = [("blocks", "zbv", 2, 4, 2, None, "forward", "full"),
                   ("mlp", "zbv", 2, 6, 1, COSTS, "forward", "full"),
                   ("lm", "zb_h1", 4, 4, 1, None, "backward", "full"),
                   ("blocks", "zbv", 2, 4, 2, COSTS, "backward", "none"),
                   ("mlp", "zb_h1", 4, 4, 1, COSTS, "backward", "dots")]


@pytest.mark.parametrize(
    "name,schedule,stages,microbatches,slices,costs,recompute,remat", RECOMPUTE_CASES)
def test_weight_recompute_equals_sequential(name, schedule, stages, microbatches, slices, costs,
                                            recompute, remat):
  mesh = lm.emulated_mesh(stages, slices)
  _, x, _, _ = lm.loss_model(name)
  model = lm.loss_sequential(name, schedule, mesh, microbatches, remat, tick_costs=costs,
                             weight_recompute=recompute)
  assert model.spec.weight_recompute == recompute
  axes = spmd.Axes.of(mesh, model.spec.stage_axis, model.spec.data_axis)
  conveyor = streaming.plan(model.spec.table, axes, x.shape[0], True, reads_at_w=True)
  assert conveyor is not None
  assert model.spec.table.is_compound == (costs is not None)
  lm.assert_loss_equals_sequential(model, name, microbatches * (8 // stages))


# The residual MLP blocks of the memory checks below, on float activation inputs [rows, T, D]
# (what a pipeline gets when its embedding runs before it) with a per-example mean-square loss.
MEMORY_ROWS, MEMORY_SEQ, MEMORY_WIDTH = 4, 16, 64


class _Block(nn.Module):
  @nn.compact
  def __call__(self, h):
    return h + nn.Dense(h.shape[-1])(jax.nn.gelu(nn.Dense(2 * h.shape[-1])(h)))


class _MeanSquare(nn.Module):
  @nn.compact
  def __call__(self, h):
    return jnp.mean(jnp.square(h), axis=(1, 2))


def _compiled_step(schedule, microbatches, stages, data=1, tick_costs=None):
  """``(compiled, mesh, pipeline)``: the compiled gradient step, in the staged parameters (a
  train state's layout) and the activation inputs, of 4 residual blocks under ``remat="none"``
  in compound ticks for the costs derived from the blocks' FLOPs (the default)."""
  mesh = tpipe.make_mesh(stages=stages, data=data)
  model = tpipe.Sequential([_Block() for _ in range(4)] + [_MeanSquare()], num_stages=stages,
                           num_microbatches=microbatches, schedule=schedule,
                           num_repeats=2 if schedule in lm.TWO_CHUNKS else 1, remat="none",
                           mesh=mesh, tick_costs=tick_costs)
  shape = (MEMORY_ROWS * microbatches * data, MEMORY_SEQ, MEMORY_WIDTH)
  pipeline = model.pipeline_for(jnp.zeros(shape))
  params = jax.eval_shape(functools.partial(
      model.clone(num_stages=1, num_microbatches=1, mesh=None).init, method="initialize"),
                          jax.random.key(0), jnp.zeros(shape))["params"]
  staged, _ = jax.eval_shape(pipeline.stage, params)
  staged = jax.tree.map(lambda a, spec: jax.ShapeDtypeStruct(
      a.shape, a.dtype, sharding=jax.NamedSharding(mesh, spec)), staged,
      pipeline.layout.partition_specs(mesh=mesh))
  x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=tpipe.data_sharding(mesh))
  step = jax.jit(jax.grad(pipeline.loss, argnums=(0, 1)))
  return step.lower(staged, x).compile(), mesh, pipeline


@pytest.mark.parametrize("schedule", tpipe.schedules.FUSED_SCHEDULE_NAMES)
def test_compound_temporaries_grow_by_the_inputs_gradient_alone(schedule):
  """In compound ticks (the default layout) every fused schedule's temporaries stay flat in M:
  from M = 2 S to M = 16 S (where the compound table holds no more slots:
  tpipe.schedules.compound; ZB-V's grew until they were bounded at 2 S, not 4 S) they grow by
  the per-micro-batch gradient of the inputs (a buffer sized by M) and this stage's part of the
  streamed batch, not more. Each backward runs in a
  conditional of its own (tpipe.core.loops.tick_rows.lane_groups): with two backwards of a
  lane side by side in one switch, XLA:CPU copied every gradient sum in every branch, the
  inputs' gradient included, a second buffer sized by M."""
  stages, small, large = 2, 4, 32
  found = {}
  for microbatches in (small, large):
    compiled, _, pipeline = _compiled_step(schedule, microbatches, stages)
    assert pipeline.loss_table.is_compound
    found[microbatches] = compiled.memory_analysis().temp_size_in_bytes
  example = MEMORY_SEQ * MEMORY_WIDTH * 4 * MEMORY_ROWS  # One micro-batch's inputs, bytes.
  inputs_gradient = (large - small) * example
  held = (large - small) // stages * example  # This stage's part of the batch.
  assert found[large] <= 1.02 * found[small] + inputs_gradient + held, (found, inputs_gradient)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_compound_tables_stream_the_batch_without_a_gather_over_stage(schedule):
  """On 2 stages x 4 data with the batch split over both, a compound table whose stage 0 reads
  two micro-batches in one tick gets each over the conveyor of its lane, by neighbour sends
  inside the tick loop (tpipe.core.loops.streaming): the compiled step holds no all-gather
  over ``stage`` at all."""
  compiled, mesh, pipeline = _compiled_step(schedule, 8, stages=2, data=4)
  table = pipeline.loss_table
  assert table.is_compound and pipeline.spec.stream_inputs
  reads = tpipe.schedules.streaming.lane_reads(table)
  assert ((reads >= 0).sum(axis=0) >= 2).any()  # Two inputs for stage 0 in one tick.
  over_stage = [c for c in analysis.collectives(compiled, mesh) if c.axes == ("stage",)]
  assert not [c for c in over_stage if c.kind == "all-gather"], over_stage
  example = MEMORY_ROWS * MEMORY_SEQ * MEMORY_WIDTH * 4  # One micro-batch's inputs, bytes.
  assert any(c.kind == "collective-permute" and c.in_loop and c.bytes == example
             for c in over_stage), over_stage
