"""tpipe.core.engine: what :func:`build` refuses before anything is traced, what a
:class:`PlannedPipeline` reports (its split and backward plan, the table its loss runs) and that its
loss and gradients are the plain layers', on the tiny core-layer pipeline
(:mod:`tests.helpers.core_layers`)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpipe
from tests.helpers import core_layers as cl
from tpipe import schedules
from tpipe.core import engine
from tpipe.core.base import layers as layers_lib
from tpipe.core.layout import staging
from tpipe.linen import layers as linen_layers

SPEC = tpipe.PipelineSpec(num_stages=2, num_microbatches=2, per_example=("targets",))


def _build(spec=SPEC, kwargs=None, layers=cl.LAYERS, params=None):
  x, targets = cl.inputs()
  params = cl.params() if params is None else params
  kwargs = {"targets": targets} if kwargs is None else kwargs
  return engine.build(layers, spec, param_shapes=layers_lib.abstract(params), stats_shapes={},
                      x=x, kwargs=kwargs, owner="Owner")


@pytest.mark.parametrize("change,error,match", [
    (dict(kwargs={"targets": cl.inputs()[1], "mask": jnp.ones(2)}), TypeError,
     r"Owner: no layer's call takes the keyword argument\(s\) \['mask'\]"),
    (dict(kwargs={"targets": cl.inputs()[1][:5]}), ValueError,
     r"per-example argument 'targets' of Owner has an array of shape \(5, 2\)"),
    (dict(spec=SPEC.replace(balance=[1, 1])), ValueError,
     "balance=.1, 1. sums to 2 layer units but the model has 6"),
    (dict(spec=SPEC.replace(num_stages=8)), ValueError,
     "the layers have 6 units but num_stages \\* num_repeats = 8 chunks"),
    (dict(params=cl.params() | {"layers_2": {"kernel": jnp.zeros((3, 2))}}), TypeError,
     r"Owner: layers\[2\] \(Loss\) failed on the output of layers\[1\] \(Block\)"),
])
def test_build_refuses_before_tracing(change, error, match):
  with pytest.raises(error, match=match):
    _build(**change)


def test_calls_are_checked_before_tracing():
  pipeline = _build()
  x, targets = cl.inputs()
  staged, _ = pipeline.stage(cl.params())
  mesh = tpipe.make_mesh(stages=2)
  with pytest.raises(ValueError, match=r"Owner: batch size 7 is not divisible by "
                     r"num_microbatches \* row shards \(data x fsdp devices\) = 2 \* 1 = 2"):
    pipeline.loss(staged, x[:7], {"targets": targets[:7]}, mesh=mesh)
  with pytest.raises(ValueError, match="Owner: no layer has running statistics, but some"):
    pipeline.stage(cl.params(), {"layers_0": {}})
  params = {k: v for k, v in cl.params().items() if k != "layers_2"}
  no_loss = _build(layers=cl.LAYERS[:2], params=params, kwargs={})
  with pytest.raises(ValueError, match=r"the last layer must return one float array \[batch\]; "
                     r"it returns \(\(4, 4\), 'float32'\)"):
    no_loss.loss(None, x, mesh=mesh)


def test_describe_shows_the_split_and_the_backward_plan():
  pipeline = _build(SPEC.replace(balance=[3, 3]))
  text = pipeline.describe()
  lines = text.splitlines()
  assert "layers_0 Project..layers_1[1] Block" in lines[1]
  assert "layers_1[2] Block..layers_2 Loss" in lines[2]
  assert lines[-1] == pipeline.backward_plan.describe()
  assert lines[-1].startswith("backward: each chunk's forward recomputed, its units run")
  assert pipeline.plan.counts == (3, 3) and pipeline.programs() == [0, 1]


@pytest.mark.parametrize("schedule,remat,granularity,fused_table", [
    ("gpipe", "full", "nested", True),
    ("gpipe", "full", "chunk", True),
    ("gpipe", "full", "layer", False),
    ("gpipe", "none", "nested", False),
    ("1f1b", "full", "nested", False),  # A fused schedule runs its own table.
])
def test_loss_table_is_fused_exactly_when_the_plan_says(schedule, remat, granularity,
                                                        fused_table):
  pipeline = _build(SPEC.replace(schedule=schedule, remat=remat, remat_granularity=granularity))
  plan = pipeline.backward_plan
  assert plan.fused_loss_table == fused_table
  table = pipeline.loss_table
  assert isinstance(table, schedules.FusedSchedule) == (fused_table or schedule == "1f1b")
  if fused_table:
    whole = schedules.whole_step(pipeline.spec.table)  # Forward ticks, then backward ticks.
    np.testing.assert_array_equal(table.action, whole.action)
    assert {int(a) for a in np.unique(table.action)} == {-1, schedules.Action.F,
                                                         schedules.Action.B}
  else:
    assert table is pipeline.spec.table


def test_staged_shapes_and_chunk_program():
  pipeline = _build(SPEC.replace(balance=[3, 3]))
  assert pipeline.stats_layout is None
  params = pipeline.layout.staged_shapes()
  assert params["stacked"]["layers_1"]["kernel"].shape == (1, 2, 2, cl.WIDTH, cl.WIDTH)
  x, targets = cl.inputs()
  fn, args = pipeline.chunk_program(0, x, {"targets": targets})
  out = jax.eval_shape(fn, *args)
  assert out == jax.ShapeDtypeStruct((cl.BATCH // 2, cl.WIDTH), jnp.float32)


def test_fused_outputs_refuse_to_be_differentiated():
  pipeline = _build(SPEC.replace(schedule="1f1b"))
  x, targets = cl.inputs()
  staged, _ = pipeline.stage(cl.params())
  mesh = tpipe.make_mesh(stages=2)
  outputs = lambda p: jnp.sum(pipeline.apply(p, x, {"targets": targets}, mesh=mesh))
  with pytest.raises(ValueError, match="differentiate the loss instead"):
    jax.grad(outputs)(staged)


# (schedule, remat, granularity, weight_recompute) -> the backward plan it resolves to: every
# plan a table runs, each checked against the plain layers' gradients below.
PLANS = {
    ("gpipe", "full", "layer", False): ("autodiff", "with input grads"),
    ("gpipe", "full", "nested", False): ("units", "with input grads"),
    ("gpipe", "full", "chunk", False): ("units", "with input grads"),  # Unit residuals kept.
    ("1f1b", "dots", "nested", False): ("vjp", "with input grads"),
    ("1f1b", "none", "nested", False): ("kept residuals", "with input grads"),
    ("zb_h1", "full", "nested", False): ("units", "filed taps"),
    ("zb_h1", "full", "chunk", True): ("units", "recomputed operands"),
    ("zb_h1", "none", "nested", False): ("kept residuals", "operands from F"),
    ("zb_h1", "full", "nested", "backward"): ("units", "rerun backward"),
    ("zb_h1", "dots", "nested", "backward"): ("vjp", "rerun backward"),
}


@pytest.mark.parametrize("settings", list(PLANS), ids=lambda s: "-".join(map(str, s)))
def test_loss_and_gradients_equal_the_plain_layers(settings):
  schedule, remat, granularity, recompute = settings
  pipeline = _build(SPEC.replace(schedule=schedule, remat=remat, remat_granularity=granularity,
                                 weight_recompute=recompute))
  plan = pipeline.backward_plan
  assert (plan.input_grads, plan.weight_grads) == PLANS[settings]
  x, targets = cl.inputs()
  mesh = tpipe.make_mesh(stages=2)
  staged, _ = pipeline.stage(cl.params())
  loss = lambda p: pipeline.loss(p, x, {"targets": targets}, mesh=mesh)
  value, grads = jax.jit(jax.value_and_grad(loss))(staged)
  want, want_grads = jax.value_and_grad(cl.plain_loss)(cl.params(), x, targets)
  np.testing.assert_allclose(value, want, rtol=1e-5)
  got = staging.to_logical(pipeline.layout, grads)
  for name, tree in want_grads.items():
    for key, leaf in tree.items():
      np.testing.assert_allclose(got[name][key], leaf, rtol=1e-4, atol=1e-6,
                                 err_msg=f"{name}/{key}")


@pytest.mark.unit
def test_the_plans_cover_every_way_a_backward_runs():
  assert {p[0] for p in PLANS.values()} == {"autodiff", "units", "vjp", "kept residuals"}
  assert {p[1] for p in PLANS.values()} == {"with input grads", "filed taps",
                                            "recomputed operands", "operands from F",
                                            "rerun backward"}


def test_running_statistics_follow_the_calls_keywords_not_the_planned_ones():
  """A pipeline planned with ``train=False`` (as the trainer plans from its model inputs) and
  called with ``train=True`` updates the BatchNorm statistics with the call's momentum; called
  with ``train=False`` it updates nothing."""
  class Normed(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
      return nn.BatchNorm(use_running_average=not train, momentum=0.75, name="norm")(x)

  layer = linen_layers.as_layer(Normed(), 2, "Owner")
  x = jax.random.normal(jax.random.key(0), (8, 3)) * 2 + 1
  variables = jax.vmap(lambda k: Normed().init(k, x[:4], train=False))(
      jax.random.split(jax.random.key(1), 2))
  params, stats = {"layers_0": variables["params"]}, {"layers_0": variables["batch_stats"]}
  spec = tpipe.PipelineSpec(num_stages=2, num_microbatches=2)
  pipeline = engine.build([layer], spec, param_shapes=layers_lib.abstract(params),
                          stats_shapes=layers_lib.abstract(stats), x=x,
                          kwargs={"train": False}, owner="Owner")
  staged_params, staged_stats = pipeline.stage(params, stats)
  mesh = tpipe.make_mesh(stages=2)
  _, new = jax.jit(lambda p, s, x: pipeline.apply(p, x, {"train": True}, stats=s, mesh=mesh))(
      staged_params, staged_stats, x)
  new = staging.to_logical(pipeline.stats_layout, new)["layers_0"]["norm"]
  # Copy 0 normalises x: the new mean is 0.75 * 0 + 0.25 * mean(x) over the batch.
  np.testing.assert_allclose(new["mean"][0], 0.25 * np.asarray(x).mean(0), rtol=1e-5)
  assert np.all(np.asarray(new["var"]) != 1.0)
  _, none = jax.jit(lambda p, s, x: pipeline.apply(p, x, {"train": False}, stats=s, mesh=mesh))(
      staged_params, staged_stats, x)
  assert none is None
