"""Tests for tpipe.train.convnet: the ResNet-style layers of the digits task and BatchNorm."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tpipe.train import convnet


def _key(seed: int) -> jax.Array:
  # XLA's RngBitGenerator: initializing the convolutions with threefry keys takes seconds to
  # compile on CPU, with "rbg" keys well under one.
  return jax.random.key(seed, impl="rbg")


def _normal(seed: int, shape: tuple[int, ...]) -> np.ndarray:
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _shapes(layer, x, *args):
  """``(output, variables)`` of ``layer.init_with_output`` as shapes only: nothing compiles."""
  return jax.eval_shape(functools.partial(layer.init_with_output, _key(0)), x, *args)


def test_layer_shapes_and_shortcuts():
  x = jax.ShapeDtypeStruct((2, 8, 8, 1), jnp.float32)
  y, variables = _shapes(convnet.Stem(16), x)
  assert y.shape == (2, 8, 8, 16)
  assert variables["batch_stats"]["norm"]["mean"].shape == (16,)
  z, same = _shapes(convnet.ResidualCell(16), y)
  assert z.shape == (2, 8, 8, 16)
  assert set(same["params"]) == {"conv1", "norm1", "conv2", "norm2"}  # Identity shortcut.
  z, down = _shapes(convnet.ResidualCell(32, stride=2), y)
  assert z.shape == (2, 4, 4, 32)  # Half the resolution, twice the channels.
  assert down["params"]["proj_conv"]["kernel"].shape == (1, 1, 16, 32)
  assert down["params"]["conv1"]["kernel"].shape == (3, 3, 16, 32)
  odd, _ = _shapes(convnet.ResidualCell(8, stride=2), jax.ShapeDtypeStruct((2, 5, 5, 4),
                                                                           jnp.float32))
  assert odd.shape == (2, 3, 3, 8)  # SAME padding: ceil(5 / 2).
  logits, _ = _shapes(convnet.PoolHead(), z)
  assert logits.shape == (2, 10) and logits.dtype == jnp.float32
  losses, _ = _shapes(convnet.PoolHead(), z, jax.ShapeDtypeStruct((2,), jnp.int32))
  assert losses.shape == (2,)


def test_resnet_layers_double_channels_per_group():
  layers = convnet.resnet_layers(width=8, stage_sizes=(2, 1, 1))
  kinds = [(type(layer).__name__, getattr(layer, "features", None),
            getattr(layer, "stride", None)) for layer in layers]
  assert kinds == [("Stem", 8, None), ("ResidualCell", 8, 1), ("ResidualCell", 8, 1),
                   ("ResidualCell", 16, 2), ("ResidualCell", 32, 2), ("PoolHead", None, None)]
  with pytest.raises(ValueError, match="stage_sizes"):
    convnet.resnet_layers(width=8, stage_sizes=())


def test_dtypes_follow_the_layer_settings():
  x = jax.ShapeDtypeStruct((2, 8, 8, 1), jnp.float32)
  layers = convnet.resnet_layers(width=8, stage_sizes=(1, 1), dtype=jnp.bfloat16)
  for layer in layers[:-1]:
    x, variables = _shapes(layer, x)
    assert x.dtype == jnp.bfloat16
    assert {p.dtype for p in jax.tree.leaves(variables)} == {jnp.dtype(jnp.float32)}
  losses, _ = _shapes(layers[-1], x, jax.ShapeDtypeStruct((2,), jnp.int32))
  assert losses.dtype == jnp.float32
  with pytest.raises(ValueError, match="stride"):
    convnet.ResidualCell(8, stride=3)
  with pytest.raises(ValueError, match="dtype"):
    convnet.Stem(8, dtype=jnp.int32)


def test_head_pools_then_classifies_and_losses_are_cross_entropy():
  x = _normal(1, (5, 4, 4, 6))
  labels = jnp.array([0, 3, 9, 3, 1])
  head = convnet.PoolHead()

  @jax.jit
  def run(x, labels):
    variables = head.init(_key(2), x)
    return variables, head.apply(variables, x), head.apply(variables, x, labels)

  variables, logits, losses = run(x, labels)
  p = variables["params"]["dense"]
  np.testing.assert_allclose(logits, x.mean(axis=(1, 2)) @ p["kernel"] + p["bias"], rtol=1e-5,
                             atol=1e-6)
  assert losses.shape == (5,)
  want = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)[:, 0]
  np.testing.assert_allclose(losses, want, rtol=1e-6)
  np.testing.assert_allclose(
      losses, optax.softmax_cross_entropy_with_integer_labels(logits, labels), rtol=1e-6)


@pytest.fixture(scope="module")
def stem_run():
  """A Stem initialized, applied in training (stats updated), then evaluated with those stats."""
  x = np.abs(_normal(3, (6, 8, 8, 1)))
  stem = convnet.Stem(16, bn_momentum=0.9)

  @jax.jit
  def run(x):
    variables = stem.init(_key(0), x)
    y_train, updates = stem.apply(variables, x, train=True, mutable=["batch_stats"])
    trained = {"params": variables["params"], **updates}
    # Evaluation: train=False, nothing mutable. Also on one example and in training on two.
    y_eval, y_eval_one = stem.apply(trained, x), stem.apply(trained, x[:1])
    y_train_two, _ = stem.apply(trained, x[:2], train=True, mutable=["batch_stats"])
    conv = nn.Conv(16, (3, 3), padding="SAME", use_bias=False)
    c = conv.apply({"params": variables["params"]["conv"]}, x)  # The stem's pre-norm output.
    return dict(c=c, y_train=y_train, stats=updates["batch_stats"]["norm"], y_eval=y_eval,
                y_eval_one=y_eval_one, y_train_two=y_train_two)

  return run(x)


def test_batchnorm_train_uses_batch_statistics_and_updates_running_averages(stem_run):
  c = stem_run["c"]
  mean, var = c.mean(axis=(0, 1, 2)), c.var(axis=(0, 1, 2))
  np.testing.assert_allclose(stem_run["y_train"], jax.nn.relu((c - mean) / jnp.sqrt(var + 1e-5)),
                             atol=1e-5)
  # Running averages start at mean 0, var 1; one step with momentum 0.9.
  np.testing.assert_allclose(stem_run["stats"]["mean"], 0.1 * mean, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(stem_run["stats"]["var"], 0.9 + 0.1 * var, rtol=1e-5)


def test_batchnorm_eval_uses_the_running_averages(stem_run):
  c, stats, y = stem_run["c"], stem_run["stats"], stem_run["y_eval"]
  np.testing.assert_allclose(
      y, jax.nn.relu((c - stats["mean"]) / jnp.sqrt(stats["var"] + 1e-5)), atol=1e-5)
  # Evaluation treats examples independently; training normalizes over the batch.
  np.testing.assert_allclose(stem_run["y_eval_one"], y[:1], atol=1e-6)
  assert not np.allclose(stem_run["y_train_two"][:1], y[:1], atol=1e-3)


def test_residual_cell_updates_every_batchnorm_in_train_only():
  x = _normal(5, (4, 8, 8, 8))
  cell = convnet.ResidualCell(16, stride=2)

  @jax.jit
  def run(x):
    variables = cell.init(_key(0), x)
    _, trained = cell.apply(variables, x, train=True, mutable=["batch_stats"])
    _, evaluated = cell.apply(variables, x, mutable=["batch_stats"])  # train=False.
    return variables["batch_stats"], trained["batch_stats"], evaluated["batch_stats"]

  initial, trained, evaluated = run(x)
  assert set(trained) == {"norm1", "norm2", "proj_norm"}
  for name, stats in trained.items():
    assert not np.allclose(stats["var"], initial[name]["var"]), name
    assert not np.allclose(stats["mean"], initial[name]["mean"]), name
  jax.tree.map(np.testing.assert_array_equal, evaluated, initial)


def test_bn_axis_name_pools_statistics_over_the_mapped_axis():
  x = _normal(6, (2, 3, 8, 8, 4))  # [replicas, batch, h, w, c].
  local, pooled = convnet.Stem(8), convnet.Stem(8, bn_axis_name="replica")

  @jax.jit
  def run(x):
    variables = local.init(_key(0), x[0])

    def train(layer, xs):
      return layer.apply(variables, xs, train=True, mutable=["batch_stats"])

    mapped = jax.vmap(lambda xs: train(pooled, xs), axis_name="replica")(x)
    return mapped, train(local, x.reshape(6, 8, 8, 4))

  (y, updates), (y_all, updates_all) = run(x)
  np.testing.assert_allclose(y.reshape(y_all.shape), y_all, atol=1e-5)
  np.testing.assert_allclose(updates["batch_stats"]["norm"]["mean"][0],
                             updates_all["batch_stats"]["norm"]["mean"], atol=1e-6)
