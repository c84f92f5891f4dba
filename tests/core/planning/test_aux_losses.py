"""Auxiliary losses and metrics from inside the stages: carried to the loss through every
schedule, equal to the layers run in sequence on each micro-batch (each replica's rows),
gradients included; the loss's terms reported apart."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpipe
from tests.helpers import core_layers as cl
from tests.helpers import numerics
from tpipe.core import engine
from tpipe.core.base import layers as layers_lib
from tpipe.core.layout import staging
from tpipe.core.planning import aux_losses

MICROBATCHES = 4


def _aux(h, y):
  """Nonlinear in the micro-batch's rows (a square of a mean), so pooling over the wrong rows
  would show."""
  return 0.3 * jnp.mean(jnp.tanh(h)) ** 2 + 0.1 * jnp.mean(y ** 2)


def _metric(y):
  """Reported only: a loss that counted it would differ."""
  return jnp.mean(jnp.abs(y))


def _block_with_aux(params, stats, h, kwargs, rngs):
  y, stats = cl.LAYERS[1].apply(params, stats, h, kwargs, rngs)
  return y, stats, {"aux_loss/block": _aux(h, y), "aux_metric/size": _metric(y)}


def _project_with_aux(params, stats, x, kwargs, rngs):
  y, stats = cl.LAYERS[0].apply(params, stats, x, kwargs, rngs)
  return y, stats, {"aux_loss/project": 0.5 * jnp.mean(y) ** 2}


LAYERS = (dataclasses.replace(cl.LAYERS[0], apply_with_aux_values=_project_with_aux),
          dataclasses.replace(cl.LAYERS[1], apply_with_aux_values=_block_with_aux),
          dataclasses.replace(cl.LAYERS[2],
                              apply_with_aux_values=lambda *a: (*cl._loss(*a), None)))
NAMES = ("aux_loss/block", "aux_loss/project", "aux_metric/size")


def _sequential_terms(params, x, targets, groups):
  """The layers in order on each of ``groups`` contiguous row groups: the mean per-example loss
  and the mean over groups of each auxiliary value (summed over the layers that sow it)."""
  terms = dict.fromkeys(("loss",) + NAMES, 0.0)
  for xg, tg in zip(jnp.split(x, groups), jnp.split(targets, groups)):
    h = cl.LAYERS[0].apply(params["layers_0"], {}, xg, {}, {})[0]
    terms["aux_loss/project"] += 0.5 * jnp.mean(h) ** 2 / groups
    for j in range(cl.COPIES):
      y = cl.LAYERS[1].apply(jax.tree.map(lambda a, j=j: a[j], params["layers_1"]), {}, h, {},
                             {})[0]
      terms["aux_loss/block"] += _aux(h, y) / groups
      terms["aux_metric/size"] += _metric(y) / groups
      h = y
    losses = cl.LAYERS[2].apply(params["layers_2"], {}, h, {"targets": tg}, {})[0]
    terms["loss"] += jnp.mean(losses) / groups
  return terms


def _sequential_loss(params, x, targets, groups):
  """The loss: the mean per-example loss plus every auxiliary loss (no metric)."""
  terms = _sequential_terms(params, x, targets, groups)
  return terms["loss"] + terms["aux_loss/block"] + terms["aux_loss/project"]


def _build(spec, layers=LAYERS):
  x, targets = cl.inputs()
  return engine.build(layers, spec, param_shapes=layers_lib.abstract(cl.params()),
                      stats_shapes={}, x=layers_lib.abstract(x),
                      kwargs={"targets": layers_lib.abstract(targets)}, owner="test")


CASES = [("gpipe", 1), ("circular", 1), ("1f1b", 2), ("interleaved_1f1b", 1), ("zb_h1", 1),
         ("zbv", 1)]


@pytest.mark.parametrize("schedule,data", CASES)
def test_aux_losses_reach_the_loss_and_gradients_under_every_schedule(schedule, data):
  repeats = 2 if schedule in ("circular", "interleaved_1f1b", "zbv") else 1
  spec = tpipe.PipelineSpec(num_stages=2, num_microbatches=MICROBATCHES, schedule=schedule,
                            num_repeats=repeats, per_example=("targets",))
  pipeline = _build(spec)
  # The first layer starts the running sums, the last adds them to its per-example losses.
  assert all(layer.apply_with_aux_values is None for layer in pipeline.layers)
  assert pipeline.aux_names == NAMES
  x, targets = cl.inputs()
  mesh = tpipe.make_mesh(stages=2, data=data)
  staged, _ = pipeline.stage(cl.params())
  loss = lambda p: pipeline.loss(p, x, {"targets": targets}, mesh=mesh)
  value, grads = jax.jit(jax.value_and_grad(loss))(staged)
  groups = MICROBATCHES * data
  sequential = jax.jit(jax.value_and_grad(_sequential_loss), static_argnums=3)
  plain = sequential(cl.params(), x, targets, groups)
  reference = numerics.float64_reference(sequential, cl.params(), x, targets, groups)
  numerics.assert_as_close_as_plain(value, plain[0], reference[0], what="loss")
  numerics.assert_as_close_as_plain(staging.to_logical(pipeline.layout, grads), plain[1],
                                    reference[1], what="gradients")
  # Without the auxiliary losses the value differs: they were counted.
  assert abs(float(value) - float(jnp.mean(cl.plain_loss(cl.params(), x, targets)))) > 1e-3


def test_outputs_are_the_per_example_losses_with_their_micro_batch_aux_losses():
  spec = tpipe.PipelineSpec(num_stages=2, num_microbatches=2, per_example=("targets",))
  pipeline = _build(spec)
  x, targets = cl.inputs()
  staged, _ = pipeline.stage(cl.params())
  got = pipeline.apply(staged, x, {"targets": targets}, mesh=tpipe.make_mesh(stages=2))
  halves = [_sequential_loss(cl.params(), x[s], targets[s], 1)
            - jnp.mean(cl.LAYERS[2].apply(
                cl.params()["layers_2"], {},
                cl.apply_layers(cl.params(), x[s], 0, 2), {"targets": targets[s]}, {})[0])
            for s in (slice(0, 4), slice(4, 8))]
  plain = cl.apply_layers(cl.params(), x, 0, 3, targets)
  want = plain + jnp.repeat(jnp.stack(halves), 4)
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.unit
def test_layers_without_aux_losses_are_left_as_they_are():
  pipeline = _build(tpipe.PipelineSpec(num_stages=2, num_microbatches=2,
                                       per_example=("targets",)), layers=cl.LAYERS)
  assert pipeline.layers == cl.LAYERS
  assert aux_losses.carry(cl.LAYERS, (), (), "test") == cl.LAYERS
  assert pipeline.aux_names == ()


@pytest.mark.unit
def test_bad_sequences_are_refused_before_tracing():
  repeated_first = (LAYERS[1], LAYERS[2])
  with pytest.raises(ValueError, match=r"layers\[0\] repeats Block; start the sequence with a "
                     "plain layer"):
    aux_losses.carry(repeated_first, (0,), NAMES, "test")
  with pytest.raises(ValueError, match=r"layers\[1\] \(Block\) keeps running statistics"):
    aux_losses.carry(LAYERS, (1,), NAMES, "test", with_stats=frozenset({1}))
  no_per_example = dataclasses.replace(
      cl.LAYERS[2], apply=lambda p, s, h, k, r: (h @ p["kernel"], s))
  spec = tpipe.PipelineSpec(num_stages=2, num_microbatches=2, per_example=("targets",))
  with pytest.raises(ValueError, match=r"the last layer \(Loss\) returns \(\(4, 2\), "
                     "'float32'\\) per micro-batch of 4 rows"):
    _build(spec, layers=(LAYERS[0], LAYERS[1], no_per_example))


@pytest.mark.unit
def test_named_values_sum_per_name_and_refuse_other_shapes():
  assert aux_losses.named({"aux_loss": {}, "aux_metric": {}}, "test", "layers[1]") is None
  sown = {"aux_loss": {"moe": {"balance": (1.5, jnp.float32(2.0))}},
          "aux_metric": {"load": (jnp.float32(0.25),)}}
  named = aux_losses.named(sown, "test", "layers[1]")
  assert {k: float(v) for k, v in named.items()} == {"aux_loss/moe/balance": 3.5,
                                                     "aux_metric/load": 0.25}
  assert aux_losses.is_loss("aux_loss/moe/balance")
  assert not aux_losses.is_loss("aux_metric/load")
  with pytest.raises(ValueError, match=r"layers\[1\] sowed an auxiliary value \(aux_loss\) of "
                     r"shape \(3,\).*reduce over the tokens first"):
    aux_losses.named({"aux_loss": {"a": (jnp.ones(3),)}}, "test", "layers[1]")


@pytest.mark.parametrize("schedule,data", [("gpipe", 2), ("zbv", 1)])
def test_loss_terms_report_each_value_apart_and_add_up_to_the_loss(schedule, data):
  repeats = 2 if schedule == "zbv" else 1
  spec = tpipe.PipelineSpec(num_stages=2, num_microbatches=MICROBATCHES, schedule=schedule,
                            num_repeats=repeats, per_example=("targets",))
  pipeline = _build(spec)
  x, targets = cl.inputs()
  mesh = tpipe.make_mesh(stages=2, data=data)
  staged, _ = pipeline.stage(cl.params())
  kwargs = {"targets": targets}
  terms = jax.jit(lambda p: pipeline.loss_terms(p, x, kwargs, mesh=mesh))(staged)
  assert sorted(terms) == sorted(("loss",) + NAMES)
  groups = MICROBATCHES * data
  run = jax.jit(_sequential_terms, static_argnums=3)
  plain = run(cl.params(), x, targets, groups)
  reference = numerics.float64_reference(run, cl.params(), x, targets, groups)
  for name in terms:
    numerics.assert_as_close_as_plain(terms[name], plain[name], reference[name], what=name)
  # The loss is its own term plus the auxiliary losses, not the metric.
  loss = jax.jit(lambda p: pipeline.loss(p, x, kwargs, mesh=mesh))(staged)
  np.testing.assert_allclose(
      loss, terms["loss"] + terms["aux_loss/block"] + terms["aux_loss/project"], rtol=1e-6)
  assert float(terms["aux_metric/size"]) > 1e-2


@pytest.mark.unit
def test_loss_terms_of_layers_without_aux_values_is_the_loss_alone():
  pipeline = _build(tpipe.PipelineSpec(num_stages=2, num_microbatches=2,
                                       per_example=("targets",)), layers=cl.LAYERS)
  x, targets = cl.inputs()
  staged, _ = pipeline.stage(cl.params())
  mesh = tpipe.make_mesh(stages=2)
  terms = pipeline.loss_terms(staged, x, {"targets": targets}, mesh=mesh)
  assert list(terms) == ["loss"]
  np.testing.assert_allclose(terms["loss"], jnp.mean(cl.plain_loss(cl.params(), x, targets)),
                             rtol=2e-6)


@pytest.mark.unit
def test_metrics_alone_are_dropped_where_the_last_layer_returns_no_loss():
  loss = jax.ShapeDtypeStruct((4,), jnp.float32)
  logits = jax.ShapeDtypeStruct((4, 2), jnp.float32)
  assert aux_losses.carried(("aux_metric/size",), loss) == ("aux_metric/size",)
  assert aux_losses.carried(("aux_metric/size",), logits) == ()
  # An auxiliary loss needs a loss to join: carried, so that carry refuses the layers by name.
  assert aux_losses.carried(NAMES, logits) == NAMES

  def block_with_metric(params, stats, h, kwargs, rngs):
    y, stats = cl.LAYERS[1].apply(params, stats, h, kwargs, rngs)
    return y, stats, {"aux_metric/size": _metric(y)}

  logits_layer = dataclasses.replace(
      cl.LAYERS[2], apply=lambda p, s, h, k, r: (h @ p["kernel"], s))
  reporting = dataclasses.replace(cl.LAYERS[1], apply_with_aux_values=block_with_metric)
  layers = (cl.LAYERS[0], reporting, logits_layer)
  pipeline = _build(tpipe.PipelineSpec(num_stages=2, num_microbatches=2,
                                       per_example=("targets",)), layers=layers)
  assert pipeline.aux_names == () and pipeline.layers == layers
