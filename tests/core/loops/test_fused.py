"""Fused schedules: the loss and its gradients equal the layers in order.

With a fused schedule (1F1B, interleaved 1F1B, ZB-H1, ZB-V) ``model.apply(..., method="loss")``
returns the mean over the global batch of the last layer's per-example losses, its backward
running inside the schedule, and ``jax.grad`` of any function of that scalar must give the
sequential model's gradients, for parameters and float inputs (numerics rule:
:mod:`tests.helpers.numerics`). Cases cover every fused schedule with S in {1, 2, 4, 8}, M in
{1, 2, S, 4S} (below S, equal to it, above it, not a multiple of it), data in {1, 2}, every remat
policy, and three models (:func:`tests.helpers.linen_models.loss_model`): an MLP whose width
changes, ending in a per-example regression loss; an LM (embedding, blocks, head with
per-example targets); and a homogeneous stack of residual blocks with a loss at the end.

Calling the model (no method) returns the per-example outputs under every schedule: a fused
schedule runs its table's forward pass, whose outputs equal GPipe's; differentiating them raises
and names ``method="loss"``.

Memory is checked with compile-time quantities: the compiled step's temporaries grow with M under
GPipe (one stashed stage input per tick) and stay bounded under 1F1B (``min(S, M)`` stash slots).
The compiled program issues two neighbour sends per tick, none inside a branch, and reduces the
gradients over data replicas once, after the tick loop.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpipe
from tests.helpers import linen_models as lm
from tests.helpers import numerics
from tpipe.core.base import spmd
from tpipe.tools import analysis
from tpipe.tools import hlo as hlo_lib

BATCH = lm.BATCH


# (model, schedule, stages, micro-batches per replica, data, remat): a covering set, not a cross
# product (each compiles its own pipelined step): every fused schedule, S in {1, 2, 4, 8}, M < S,
# M = S, M > S (4S) and M not a multiple of S, data in {1, 2}, every remat policy and every model
# at least once. Interleaved 1F1B and ZB-V hold 2 chunks per stage. The remat policy decides what
# a backward tick keeps between its recomputed forward and its backward, except "none" with an
# unsplit backward: there F keeps the chunk's residuals for B across ticks
# (tpipe.core.programs.residuals), kept here with one chunk (1F1B) and two (interleaved 1F1B);
# "none" with a split backward with one chunk (ZB-H1) and two (ZB-V).
CASES = [
    ("lm", "1f1b", 4, 3, 1, "none"),  # M < S, not a multiple of S
    ("blocks", "1f1b", 8, 32, 1, "full"),  # S = 8, M = 4S
    ("lm", "interleaved_1f1b", 2, 1, 1, "dots"),  # M = 1
    ("blocks", "interleaved_1f1b", 4, 8, 1, "none"),
    ("mlp", "zb_h1", 1, 2, 2, "none"),  # S = 1, data 2
    ("mlp", "zbv", 2, 2, 2, "none"),  # M = S, data 2
]
CHUNKS_PER_STAGE = {"1f1b": 1, "zb_h1": 1, "interleaved_1f1b": 2, "zbv": 2}


@pytest.mark.unit
def test_the_cases_cover_every_fused_schedule():
  assert {case[1] for case in CASES} == set(tpipe.schedules.FUSED_SCHEDULE_NAMES)


def _model(name, schedule, stages, microbatches, data=1, remat="full", **settings):
  mesh = tpipe.make_mesh(stages=stages, data=data)
  layers, _, _, _ = lm.loss_model(name)
  model = tpipe.Sequential(layers, num_stages=stages, num_microbatches=microbatches,
                           schedule=schedule, num_repeats=CHUNKS_PER_STAGE.get(schedule, 1),
                           remat=remat, per_example=("targets",), mesh=mesh, **settings)
  return model, mesh


def _inputs(name, mesh):
  _, x, targets, _ = lm.loss_model(name)
  return jax.device_put((x, targets), tpipe.data_sharding(mesh))


@functools.lru_cache(maxsize=None)
def _gradient_step(name, schedule, stages, microbatches, remat="full"):
  """``(model, compiled, pipeline)``: the compiled gradient step of the loss of ``_model(name,
  schedule, stages, microbatches, remat=remat)``, compiled once for the tests that read it (the
  split backward's FLOPs, remat none's, the weight slots)."""
  model, mesh = _model(name, schedule, stages, microbatches, remat=remat)
  x, targets = _inputs(name, mesh)
  step = jax.jit(jax.grad(lm.pipelined_loss(model)))
  compiled = step.lower(lm.random_params(name), x, targets).compile()
  return model, compiled, model.pipeline_for(x, targets=targets)


@functools.lru_cache(maxsize=None)
def _value_and_grads(name, schedule, stages, microbatches, data, remat):
  """The objective of the loss and its gradients for a case of ``CASES``, computed once for the
  tests that check them (the loss with gradients of a loss evaluated alone, below)."""
  model, mesh = _model(name, schedule, stages, microbatches, data, remat)
  x, targets = _inputs(name, mesh)
  float_input = lm.loss_model(name)[3]
  return jax.jit(lm.value_and_grad(lm.pipelined_loss(model), float_input))(
      lm.random_params(name), x, targets)


@pytest.mark.parametrize("name,schedule,stages,microbatches,data,remat", CASES)
def test_loss_and_gradients_equal_sequential(name, schedule, stages, microbatches, data, remat):
  value, grads = _value_and_grads(name, schedule, stages, microbatches, data, remat)
  plain_value, plain_grads = lm.plain(name, microbatches * data)
  ref_value, ref_grads = lm.reference(name)
  assert value.shape == ()
  numerics.assert_as_close_as_plain(value, plain_value, ref_value, what="loss")
  numerics.assert_as_close_as_plain(grads, plain_grads, ref_grads, what="gradients")


def _outputs(model, params, x, targets):
  return jax.jit(lambda p, x, t: model.apply({"params": p}, x, targets=t))(params, x, targets)


@pytest.fixture(scope="module")
def gpipe_outputs():
  """GPipe's per-example outputs of the MLP on S = 2 stages, M = 3 micro-batches, 2 replicas."""
  model, mesh = _model("mlp", "gpipe", 2, 3, 2)
  return _outputs(model, lm.random_params("mlp"), *_inputs("mlp", mesh))


@pytest.mark.parametrize("schedule", tpipe.schedules.FUSED_SCHEDULE_NAMES)
def test_outputs_are_the_per_example_outputs_of_gpipe(schedule, gpipe_outputs):
  """Calling the model returns the last layer's outputs (the per-example losses here) under a
  fused schedule too, by its table's forward pass: GPipe's, and the layers' in order."""
  model, mesh = _model("mlp", schedule, 2, 3, 2)
  y = _outputs(model, lm.random_params("mlp"), *_inputs("mlp", mesh))
  assert y.shape == gpipe_outputs.shape == (BATCH,)
  plain, reference = lm.plain_losses("mlp", 3 * 2), lm.reference_losses("mlp")
  numerics.assert_as_close_as_plain(gpipe_outputs, plain, reference, what="gpipe outputs")
  numerics.assert_as_close_as_plain(y, plain, reference, what=f"{schedule} outputs")


def test_differentiating_a_fused_models_outputs_names_the_loss_method():
  model, mesh = _model("mlp", "zb_h1", 2, 3)
  x, targets = _inputs("mlp", mesh)
  outputs = lambda p: jnp.sum(model.apply({"params": p}, x, targets=targets))
  with pytest.raises(ValueError, match=r"tpipe.Sequential with schedule='zb_h1': the outputs are "
                                       r"the schedule's forward pass.*method='loss'"):
    jax.grad(outputs)(lm.random_params("mlp"))
  # The same model's loss method is differentiable.
  grads = jax.eval_shape(jax.grad(lm.pipelined_loss(model)), lm.random_params("mlp"), x, targets)
  assert jax.tree.structure(grads) == jax.tree.structure(lm.random_params("mlp"))


# The cases of CASES whose loss a test also evaluates without gradients.
FORWARD_ONLY_CASES = {"1f1b": ("lm", "1f1b", 4, 3, 1, "none"),
                      "zbv": ("mlp", "zbv", 2, 2, 2, "none")}


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_loss_without_gradients_runs_the_forward_ticks_only(schedule):
  """Evaluating the loss takes the custom_vjp's primal path: the table's forward pass alone
  (:meth:`~tpipe.schedules.FusedSchedule.forward_pass`), one conditional per tick with only the
  idle and forward branches (no backward), and the same loss as the loss with its gradients
  (the case's of :func:`test_loss_and_gradients_equal_sequential`, computed once for both)."""
  name, _, stages, microbatches, data, remat = case = FORWARD_ONLY_CASES[schedule]
  model, mesh = _model(name, schedule, stages, microbatches, data, remat)
  x, targets = _inputs(name, mesh)
  params = lm.random_params(name)
  loss_fn = lm.pipelined_loss(model)
  evaluate = jax.jit(loss_fn).lower(params, x, targets).compile()
  module = hlo_lib.parse_hlo(evaluate.as_text())
  table = model.pipeline_for(x, targets=targets).loss_table
  forward = table.forward_pass()
  loops = [loop for loop in module.loops() if loop.trip_count == forward.num_ticks]
  assert loops, [loop.trip_count for loop in module.loops()]
  assert table.num_ticks not in {loop.trip_count for loop in module.loops()}
  programs = model.pipeline_for(x, targets=targets).programs()
  branches = [len(ins.called) for loop in loops
              for ins in module.computations[loop.body].instructions
              if ins.opcode == "conditional"]
  assert branches == [1 + max(programs) + 1], branches  # idle, then F of each chunk program
  value, _ = _value_and_grads(*case)  # The objective of the loss, with its gradients.
  plain = lm.plain_losses(name, microbatches * data).mean()
  reference = lm.reference_losses(name).mean()
  numerics.assert_as_close_as_plain(evaluate(params, x, targets), plain, reference,
                                    what=f"{schedule} loss, forward ticks only")
  numerics.assert_as_close_as_plain(value, lm.plain(name, microbatches * data)[0],
                                    lm.reference(name)[0], what=f"{schedule} loss with grads")


def test_the_check_fails_for_a_dropped_microbatch():
  """The comparison is sharp: the mean over all but the last micro-batch is far outside it."""
  layers, x, targets, float_input = lm.loss_model("mlp")
  loss_fn = lambda p, x, t: jnp.mean(lm.losses_in_order(layers, p, x, t, 6)[:-BATCH // 6])
  value_and_grad = jax.jit(lm.value_and_grad(loss_fn, float_input))
  _, grads = value_and_grad(lm.random_params("mlp"), x, targets)
  _, plain_grads = lm.plain("mlp", 6)
  _, ref_grads = lm.reference("mlp")
  with pytest.raises(AssertionError):
    numerics.assert_as_close_as_plain(grads, plain_grads, ref_grads, what="gradients")


ROWS, MEMORY_SEQ, MEMORY_WIDTH = 4, 16, 32
# One micro-batch's activation between two blocks, in bytes.
ACTIVATION = ROWS * MEMORY_SEQ * MEMORY_WIDTH * 4


def _temporaries(schedule, microbatches, stages=2):
  """Per-device temporary bytes of the compiled gradient step of the loss, ``ROWS`` examples per
  micro-batch (the batch grows with M). The parameters' shapes come from ``init``'s
  ``method="initialize"`` (the layers alone, the same variables as ``init``): only the gradient
  step traces the pipeline."""
  layers, x, targets, _ = lm.loss_model("lm", ROWS * microbatches, MEMORY_SEQ, MEMORY_WIDTH)
  mesh = tpipe.make_mesh(stages=stages)
  model = tpipe.Sequential(layers, num_stages=stages, num_microbatches=microbatches,
                           schedule=schedule, per_example=("targets",), mesh=mesh)
  params = jax.eval_shape(functools.partial(model.init, method="initialize"),
                          {"params": jax.random.key(0)}, x, targets=targets)["params"]
  compiled = jax.jit(jax.grad(lm.pipelined_loss(model))).lower(params, x, targets).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_fused_temporaries_stay_bounded_in_the_number_of_microbatches():
  gpipe = {m: _temporaries("gpipe", m) for m in (4, 16)}
  one_f_one_b = {m: _temporaries("1f1b", m) for m in (4, 16)}
  zb_h1 = {m: _temporaries("zb_h1", m) for m in (4, 16)}
  # GPipe stashes a stage input per tick: 12 more micro-batches, at least 12 more activations.
  assert gpipe[16] - gpipe[4] >= 12 * ACTIVATION, gpipe
  # 1F1B holds min(S, M) = 2 micro-batches on stage 0 whatever M; ZB-H1 as many, plus the
  # weight slots of the micro-batches awaiting W (at most 2 at S = 2).
  assert one_f_one_b[16] <= 1.05 * one_f_one_b[4], one_f_one_b
  assert zb_h1[16] <= 1.05 * zb_h1[4], zb_h1
  assert one_f_one_b[16] < gpipe[16], (one_f_one_b, gpipe)


@pytest.mark.parametrize("tick_costs", ["plain", {"F": 1.0, "B": 3.0}])
def test_backwards_by_units_add_into_the_sums_without_copying_them(tick_costs):
  """Under remat="full" B adds each unit's parameter gradients into the running sums inside a
  loop over units. Here two chunk programs run B by units (the last stage's program holds the
  loss), in one lane (one action per tick) or in both lanes of compound ticks, one B beside
  forwards; each runs in a conditional of its own (tpipe.core.loops.tick_rows.lane_groups) and the
  forwards' switch never holds the sums, so XLA updates them where they lie: no copy of a
  gradient sum anywhere inside the step's computations but the entry. (Two loops in one switch
  were copied in and out of every iteration; one B beside forwards, in every forward.)"""
  model, mesh = _model("blocks", "1f1b", 4, 4, tick_costs=tick_costs)
  assert model.spec.table.is_compound == (tick_costs != "plain")
  x, targets = _inputs("blocks", mesh)
  pipeline = model.pipeline_for(x, targets=targets)
  assert len(set(pipeline.programs())) == 2
  step = jax.jit(jax.grad(lm.pipelined_loss(model)))
  module = hlo_lib.module_of(step.lower(lm.random_params("blocks"), x, targets).compile())
  strip = lambda dims: tuple(dims[next((i for i, d in enumerate(dims) if d != 1), len(dims)):])
  sums = {strip(tuple(a.shape)) for a in jax.tree.leaves(pipeline.layout.local_shapes())
          if jnp.issubdtype(a.dtype, jnp.floating) and a.size > 1}
  copied = [(name, ins.shape) for name, computation in module.computations.items()
            if name != module.entry for ins in computation.instructions
            if ins.opcode == "copy" and ins.shape.startswith("f32[")
            and strip(hlo_lib.parse_shape(ins.shape)[0].dims) in sums]
  assert sums and not copied, (sums, copied)


def test_the_split_backward_does_the_work_of_one_backward():
  """ZB-H1's BI and W together execute the FLOPs of 1F1B's fused backward B, and BI alone saves
  the weight-gradient products W then forms; its program compiles no B (the table runs none)."""
  found = {}
  for schedule in ("zb_h1", "1f1b"):  # M = 4: the steps of remat full below
    _, compiled, pipeline = _gradient_step("blocks", schedule, 2, 4)
    found[schedule] = analysis.fused_flops(compiled, pipeline.loss_table, pipeline.programs())
  split, fused_backward = found["zb_h1"].actions, found["1f1b"].actions["B"]
  assert np.isnan(split["B"]).all() and np.isnan(found["1f1b"].actions["BI"]).all()
  np.testing.assert_allclose(split["F"], found["1f1b"].actions["F"], rtol=0.05)
  np.testing.assert_allclose(split["BI"] + split["W"], fused_backward, rtol=0.05)
  assert np.all(split["W"] > 0.2 * fused_backward), split
  assert found["zb_h1"].lockstep >= found["zb_h1"].executed >= found["zb_h1"].useful > 0


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zb_h1", "zbv"])
def test_under_remat_none_b_differentiates_without_running_the_forward_again(schedule):
  """Under remat="none" F keeps its VJP's residuals for B or BI (tpipe.core.programs.residuals): the
  backward executes remat full's less about one forward (F itself under remat none: the
  linearized forward, which also computes what the backward needs of each nonlinearity). A
  split table's F files its weight operations' inputs too, so W runs no forward either."""
  found = {}
  for remat in ("none", "full"):
    _, compiled, pipeline = _gradient_step("blocks", schedule, 2, 4, remat)
    found[remat] = analysis.fused_flops(compiled, pipeline.loss_table,
                                        pipeline.programs()).actions
  none, full = found["none"], found["full"]
  backward = "BI" if schedule in tpipe.spec.SPLIT_BACKWARD else "B"
  assert np.all(none[backward] + 0.7 * none["F"] < full[backward]), (none, full)
  if backward == "BI":  # W runs no forward: within a few index operations of remat full's.
    assert np.all(none["W"] < full["W"] + 0.1 * none["F"]), (none, full)


@pytest.mark.parametrize("schedule", ["zb_h1", "zbv"])
def test_bi_files_its_weight_slot_without_copying_the_slots_buffer(schedule):
  """The weight slots (what BI hands to W, the largest buffer of the stash scope) are updated one
  slot at a time: no copy of the whole buffer in the compiled step. (Going into the tick's
  switch, the buffer was copied whole in every BI branch, in XLA's copies for updating a
  conditional's operand in place: 131.7 instead of 98.0 MiB for ZB-H1 in fused_schedules.)"""
  # 2 and 3 slots: one slot is the buffer. The step of remat full above.
  _, compiled, pipeline = _gradient_step("blocks", schedule, 2, 4)
  module = hlo_lib.module_of(compiled)
  dims = lambda ins: [(a.dtype, a.dims) for a in hlo_lib.parse_shape(ins.shape)]
  stash = [ins for _, ins in module.instructions() if spmd.STASH_SCOPE in ins.attrs]
  slots = max(stash, key=lambda ins: hlo_lib.shape_bytes(ins.shape))
  table = pipeline.loss_table
  assert dims(slots)[0][1][0] == table.awaiting_weight().max(), slots.shape
  copies = [ins.shape for _, ins in module.instructions()
            if ins.opcode == "copy" and dims(ins) == dims(slots)]
  assert not copies, (slots.shape, copies)


@pytest.mark.parametrize("name", ["blocks", "lm"])
def test_weight_recompute_trades_weight_slots_for_flops(name):
  """What a micro-batch awaiting W holds: its tapped operations' inputs and output gradients
  (nothing recomputed), their output gradients ("forward"), or the chunk's output gradient
  alone ("backward"): ZB-H1's temporaries fall in that order, the last within 1.25x of
  1F1B's (at the granularity that keeps each unit's residuals, "chunk": "nested" makes B
  recompute each unit again, where W's rerun has no slot to save)."""
  x, targets = _inputs(name, _model(name, "1f1b", 2, 4)[1])
  temporaries = {}
  for schedule, recompute in [("1f1b", False), ("zb_h1", False), ("zb_h1", "forward"),
                              ("zb_h1", "backward")]:
    settings = dict(remat_granularity="chunk")
    if recompute:
      settings["weight_recompute"] = recompute
    model, _ = _model(name, schedule, 2, 4, **settings)
    step = jax.jit(jax.grad(lm.pipelined_loss(model)))
    compiled = step.lower(lm.random_params(name), x, targets).compile()
    temporaries[schedule, recompute] = compiled.memory_analysis().temp_size_in_bytes
  kept, forward, backward = (temporaries["zb_h1", r] for r in (False, "forward", "backward"))
  assert kept > forward > backward, temporaries
  assert backward <= 1.25 * temporaries["1f1b", False], temporaries


@pytest.mark.parametrize("schedule,stages", [("1f1b", 4), ("zbv", 2)])
def test_collectives_are_neighbour_sends_every_tick_and_one_reduction_after_the_loop(
        schedule, stages):
  """One action per tick (tick_costs="plain"), whose stage 0 reads one micro-batch's inputs a
  tick, so they stream; compound tables gather them (tpipe.core.loops.streaming.plan) and send
  two."""
  model, mesh = _model("mlp", schedule, stages, 4, data=2, tick_costs="plain")
  x, targets = _inputs("mlp", mesh)
  step = jax.jit(jax.grad(lm.pipelined_loss(model)))
  compiled = step.lower(lm.random_params("mlp"), x, targets).compile()
  ticks = model.pipeline_for(x, targets=targets).loss_table.num_ticks
  found = analysis.collectives(compiled, mesh)
  in_loop = [c for c in found if c.in_loop]
  # Activations right, gradients left, and the inputs' conveyor left to stage 0 (the batch is
  # split over the stages and M is a multiple of S): three neighbour sends per tick, nothing
  # else in the loop.
  assert sorted(c.kind for c in in_loop) == ["collective-permute"] * 3, in_loop
  assert all(c.count == ticks and c.axes == ("stage",) for c in in_loop), in_loop
  assert any(c.kind == "all-reduce" and not c.in_loop and "data" in (c.axes or ())
             for c in found), found
  # No collective inside a branch of the tick's conditional.
  module = hlo_lib.parse_hlo(compiled.as_text())
  branches = [c for _, ins in module.instructions() if ins.opcode == "conditional"
              for c in ins.called]
  assert branches
  seen, todo = set(), list(branches)
  while todo:
    name = todo.pop()
    if name in seen or name not in module.computations:
      continue
    seen.add(name)
    for ins in module.computations[name].instructions:
      assert not ins.opcode.lstrip("ragged-").startswith(analysis.COLLECTIVE_KINDS), (
          name, ins.opcode)
      todo += ins.called


class Logits(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(x)


def test_the_loss_of_layers_without_per_example_losses_is_rejected():
  """A fused model's outputs can be anything; its loss needs one float loss per example."""
  model = tpipe.Sequential([lm.DenseAct(8), Logits()], num_stages=2, num_microbatches=2,
                           schedule="1f1b", mesh=tpipe.make_mesh(stages=2))
  x = jnp.ones((4, 5))
  variables = jax.eval_shape(model.init, {"params": jax.random.key(0)}, x)
  assert jax.eval_shape(model.apply, variables, x).shape == (4, 3)
  with pytest.raises(ValueError, match=r"^tpipe.Sequential: the loss is the mean of the last "
                                       r"layer's per-example losses.*End the layers with one "
                                       r"that computes each example's loss"):
    jax.eval_shape(lambda v: model.apply(v, x, method="loss"), variables)


@pytest.mark.unit
def test_a_chunk_count_the_schedule_does_not_use_is_rejected_at_construction():
  with pytest.raises(ValueError, match=r"^tpipe.Sequential: schedule='zbv' runs 2 chunk.*pass "
                                       r"num_repeats=2"):
    tpipe.Sequential([nn.Dense(4)] * 4, num_stages=2, num_microbatches=2, schedule="zbv")
  with pytest.raises(ValueError, match="runs 1 chunk"):
    tpipe.Sequential([nn.Dense(4)] * 4, num_stages=2, num_microbatches=2, schedule="1f1b",
                     num_repeats=2)
  with pytest.raises(ValueError, match="interleaved_1f1b' needs num_repeats >= 2"):
    tpipe.Sequential([nn.Dense(4)] * 4, num_stages=2, num_microbatches=2,
                     schedule="interleaved_1f1b")


def test_overlapped_micro_batches_run_each_pair_in_one_conditional():
  """With ``overlap_microbatches``, a stage's F and B of one tick run in a two-way conditional of
  their own: the tick loop's conditionals are the lanes' switches and the pairs' (as
  tpipe.tools.tick_conditionals reads them), a pair executes F's and B's FLOPs, and the
  step is priced with the pair as one action in the ticks that pair."""
  from tpipe.core.loops import tick_rows  # pylint: disable=g-import-not-at-top
  from tpipe.tools import pipeline_time  # pylint: disable=g-import-not-at-top

  costs = {"F": 1.0, "B": 3.0}
  model, mesh = _model("blocks", "1f1b", 2, 4, tick_costs=costs, overlap_microbatches=True)
  x, targets = _inputs("blocks", mesh)
  pipeline = model.pipeline_for(x, targets=targets)
  table, programs = pipeline.loss_table, pipeline.programs()
  first = tick_rows.paired(table)
  assert first.sum() == 6  # Stage 1's ticks 1-3 and ticks 4-6 of a 2-stage, 4-micro-batch 1F1B.
  compiled = jax.jit(jax.grad(lm.pipelined_loss(model))).lower(
      lm.random_params("blocks"), x, targets).compile()
  found = analysis.fused_flops(compiled, table, programs, overlap=True)
  with pytest.raises(ValueError, match="No tick loop"):  # Not the layout without pairs.
    analysis.fused_flops(compiled, table, programs, overlap=False)
  # Stage 0 runs F0 F1 F2+B0 F3+B1 B2 B3: two pairs of its program beside two F and two B
  # alone, and a pair executes what its F and B do alone. Stage 1 runs pairs only.
  assert [table.describe().splitlines()[0].split()[2:]] == [["F0", "F1", "F2+B0", "F3+B1", "B2",
                                                             "B3"]]
  forward, backward = found.actions["F"][0], found.actions["B"][0]
  assert np.isnan(found.actions["F"][1]) and np.isnan(found.actions["B"][1])
  pair = (found.per_stage[0] - 2 * (forward + backward)) / 2
  assert pair == pytest.approx(forward + backward, rel=0.02)
  step = pipeline_time.pipeline_step_time(compiled, table, "v5p", programs=programs,
                                          overlap=True)
  assert set(step.actions) == {"F", "B", "F+B"}
  assert 0 < step.actions["F+B"] <= step.actions["F"] + step.actions["B"]
  seconds = pipeline_time.row_seconds(table, pipeline_time.fused_action_seconds(
      compiled, table, "v5p", programs=programs, overlap=True))
  per_tick = np.zeros((table.num_ticks, table.num_stages))
  np.add.at(per_tick, table.tick, seconds)
  assert step.busy == pytest.approx(float(per_tick.sum(axis=0).mean()))
  assert step.bubble == pytest.approx(step.seconds - step.outside - step.busy)
