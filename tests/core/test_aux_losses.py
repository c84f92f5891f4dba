"""Auxiliary losses from inside the stages: carried to the loss through every schedule, equal to
the layers run in sequence on each micro-batch (each replica's rows), gradients included."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpipe
from tests.helpers import core_layers as cl
from tests.helpers import numerics
from tpipe.core import aux_losses
from tpipe.core import engine
from tpipe.core import layers as layers_lib

MICROBATCHES = 4


def _aux(h, y):
  """Nonlinear in the micro-batch's rows (a square of a mean), so pooling over the wrong rows
  would show."""
  return 0.3 * jnp.mean(jnp.tanh(h)) ** 2 + 0.1 * jnp.mean(y ** 2)


def _block_with_aux(params, stats, h, kwargs, rngs):
  y, stats = cl.LAYERS[1].apply(params, stats, h, kwargs, rngs)
  return y, stats, _aux(h, y)


def _project_with_aux(params, stats, x, kwargs, rngs):
  y, stats = cl.LAYERS[0].apply(params, stats, x, kwargs, rngs)
  return y, stats, 0.5 * jnp.mean(y) ** 2


LAYERS = (dataclasses.replace(cl.LAYERS[0], apply_with_aux_loss=_project_with_aux),
          dataclasses.replace(cl.LAYERS[1], apply_with_aux_loss=_block_with_aux),
          dataclasses.replace(cl.LAYERS[2], apply_with_aux_loss=lambda *a: (*cl._loss(*a), None)))


def _sequential_loss(params, x, targets, groups):
  """The layers in order on each of ``groups`` contiguous row groups: the mean per-example loss
  plus the mean over groups of every auxiliary loss."""
  total = 0.0
  for xg, tg in zip(jnp.split(x, groups), jnp.split(targets, groups)):
    h = cl.LAYERS[0].apply(params["layers_0"], {}, xg, {}, {})[0]
    aux = 0.5 * jnp.mean(h) ** 2
    for j in range(cl.COPIES):
      y = cl.LAYERS[1].apply(jax.tree.map(lambda a, j=j: a[j], params["layers_1"]), {}, h, {},
                             {})[0]
      aux, h = aux + _aux(h, y), y
    losses = cl.LAYERS[2].apply(params["layers_2"], {}, h, {"targets": tg}, {})[0]
    total = total + jnp.mean(losses) + aux
  return total / groups


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
  assert all(layer.apply_with_aux_loss is None for layer in pipeline.layers)
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
  numerics.assert_as_close_as_plain(pipeline.layout.to_logical(grads), plain[1], reference[1],
                                    what="gradients")
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
  assert aux_losses.carry(cl.LAYERS, (), "test") == cl.LAYERS


@pytest.mark.unit
def test_bad_sequences_are_refused_before_tracing():
  repeated_first = (LAYERS[1], LAYERS[2])
  with pytest.raises(ValueError, match=r"layers\[0\] repeats Block; start the sequence with a "
                     "plain layer"):
    aux_losses.carry(repeated_first, (0,), "test")
  with pytest.raises(ValueError, match=r"layers\[1\] \(Block\) keeps running statistics"):
    aux_losses.carry(LAYERS, (1,), "test", with_stats=frozenset({1}))
  no_per_example = dataclasses.replace(
      cl.LAYERS[2], apply=lambda p, s, h, k, r: (h @ p["kernel"], s))
  spec = tpipe.PipelineSpec(num_stages=2, num_microbatches=2, per_example=("targets",))
  with pytest.raises(ValueError, match=r"the last layer \(Loss\) returns \(\(4, 2\), "
                     "'float32'\\) per micro-batch of 4 rows"):
    _build(spec, layers=(LAYERS[0], LAYERS[1], no_per_example))


@pytest.mark.unit
def test_total_sums_scalars_and_refuses_other_shapes():
  assert aux_losses.total({}, "test", "layers[1]") is None
  assert float(aux_losses.total({"a": (1.5, jnp.float32(2.0))}, "test", "layers[1]")) == 3.5
  with pytest.raises(ValueError, match=r"layers\[1\] added an auxiliary loss of shape \(3,\).*"
                     "reduce it over the tokens first"):
    aux_losses.total({"a": (jnp.ones(3),)}, "test", "layers[1]")
