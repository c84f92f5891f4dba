"""BatchNorm in a pipeline, with GPipe's semantics, against Flax's own ``nn.BatchNorm``.

* Training output: each micro-batch is normalized with its own statistics, so the pipeline equals
  the plain model applied to each micro-batch separately.
* Running statistics: one update per step and per BatchNorm, with statistics pooled over
  everything that layer saw in the step (every micro-batch of every replica). The reference is
  Flax's BatchNorm applied once to the concatenation of the inputs that layer received in the
  plain per-micro-batch run.
* Evaluation (``train=False``, nothing mutable) uses the running statistics unchanged.
"""

import functools

import flax.linen as nn
import jax
from jax.extend import core as extend_core
import jax.numpy as jnp
import numpy as np
import pytest

import optax

import tpipe
from tpipe.core.layout import staging
from tests.helpers import numerics

WIDTH, BATCH = 6, 16


class DenseBN(nn.Module):
  """Dense -> BatchNorm -> tanh; ``axis_name`` pools the statistics over data replicas."""

  width: int
  momentum: float = 0.9
  axis_name: str | None = None

  @nn.compact
  def __call__(self, x, *, train: bool = False):
    x = nn.Dense(self.width)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=self.momentum,
                     axis_name=self.axis_name)(x)
    return jnp.tanh(x)


class Head(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(x)


def _layers(axis_name=None):
  return [DenseBN(WIDTH, momentum=0.8, axis_name=axis_name),
          tpipe.Repeat(DenseBN(WIDTH, axis_name=axis_name), 5), Head()]


def _model(layers, stages=1, data=1, microbatches=1, schedule="gpipe", repeats=1, remat="full"):
  mesh = tpipe.make_mesh(stages=stages, data=data)
  return tpipe.Sequential(layers, num_stages=stages, num_microbatches=microbatches,
                          schedule=schedule, num_repeats=repeats, remat=remat, mesh=mesh)


def _inputs():
  return jax.random.normal(jax.random.key(0), (BATCH, 3)) * 2.0 + 0.5


@pytest.fixture(scope="module")
def variables():
  return jax.device_get(_model(_layers()).init({"params": jax.random.key(1)}, _inputs()))


def _groups(num_microbatches, data):
  """The example indices of each (replica, micro-batch), in that order."""
  per_replica = BATCH // data
  size = per_replica // num_microbatches
  return [np.arange(d * per_replica + j * size, d * per_replica + (j + 1) * size)
          for d in range(data) for j in range(num_microbatches)]


def _plain_training(variables, x, groups, layers):
  """The plain model (no pipeline, no collectives) on each group of examples separately: the
  outputs, and every BatchNorm's inputs per group, keyed by (layer, copy, module path)."""
  outputs, inputs = [None] * BATCH, {}
  for rows in groups:
    h = x[rows]
    for i, layer in enumerate(layers):
      module = layer.module if isinstance(layer, tpipe.Repeat) else layer
      copies = layer.n if isinstance(layer, tpipe.Repeat) else None
      for j in range(copies or 1):
        pick = (lambda a, j=j: a[j]) if copies else (lambda a: a)
        layer_vars = {"params": jax.tree.map(pick, variables["params"][f"layers_{i}"])}

        def record(next_fun, args, kwargs, context, label=(i, j)):
          if isinstance(context.module, nn.BatchNorm) and context.method_name == "__call__":
            inputs.setdefault(label + tuple(context.module.scope.path), []).append(args[0])
          return next_fun(*args, **kwargs)

        if isinstance(module, DenseBN):
          layer_vars["batch_stats"] = jax.tree.map(pick,
                                                   variables["batch_stats"][f"layers_{i}"])
          with nn.intercept_methods(record):
            h, _ = module.clone(axis_name=None).apply(layer_vars, h, train=True,
                                                      mutable=["batch_stats"])
        else:
          h = module.apply(layer_vars, h)
    for row, value in zip(rows, np.asarray(h)):
      outputs[row] = value
  return np.stack(outputs), inputs


def _expected_statistics(variables, inputs):
  """Flax's BatchNorm applied once to the concatenation of each BatchNorm's inputs."""
  expected = jax.tree.map(np.asarray, variables["batch_stats"])
  for (i, j, *path), values in inputs.items():
    stats = expected[f"layers_{i}"]
    for key in path:
      stats = stats[key]
    momentum = 0.8 if i == 0 else 0.9
    bn = nn.BatchNorm(use_running_average=False, momentum=momentum)
    old = {k: (v[j] if i == 1 else v) for k, v in stats.items()}
    dtype = np.asarray(values[0]).dtype
    params = {"scale": np.ones(WIDTH, dtype), "bias": np.zeros(WIDTH, dtype)}
    _, new = bn.apply({"params": params, "batch_stats": old}, np.concatenate(values),
                      mutable=["batch_stats"])
    for k in ("mean", "var"):
      if i == 1:
        stats[k] = stats[k].copy()
        stats[k][j] = new["batch_stats"][k]
      else:
        stats[k] = np.asarray(new["batch_stats"][k])
  return expected


@functools.cache
def _training_step(stages, data, microbatches, schedule="gpipe", repeats=1, remat="full"):
  """``(variables, x) -> (y, {"batch_stats": updated})``, jitted: one compile per pipeline."""
  model = _model(_layers(), stages, data, microbatches, schedule, repeats, remat)
  return jax.jit(lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]))


# Each schedule with both data sizes, both micro-batch counts and both remat policies; GPipe at 1
# and 4 stages, circular at 2. The S = 4, data = 2, M = 2 step is also the evaluation test's.
CASES = [
    # schedule, stages, data, microbatches, remat
    ("gpipe", 1, 1, 4, "full"),
    ("gpipe", 4, 2, 2, "none"),
    ("circular", 2, 1, 4, "full"),
    ("circular", 2, 2, 2, "none"),
]


@pytest.mark.parametrize("schedule, stages, data, microbatches, remat", CASES)
def test_training_normalizes_per_microbatch_and_pools_the_running_statistics(
        variables, schedule, stages, data, microbatches, remat):
  x = _inputs()
  layers = _layers()
  repeats = 2 if schedule == "circular" and stages * 2 <= 7 else 1
  y, updated = _training_step(stages, data, microbatches, schedule, repeats, remat)(variables, x)
  groups = _groups(microbatches, data)

  def plain(v, x):
    return _plain_training(v, x, groups, layers)

  want, inputs = plain(variables, np.asarray(x))
  exact, exact_inputs = numerics.float64_reference(lambda v, x: plain(v, np.asarray(x)),
                                                   variables, x)
  numerics.assert_as_close_as_plain(np.asarray(y), want, exact, what="outputs")
  expected = _expected_statistics(variables, inputs)
  exact_stats = numerics.float64_reference(lambda v: _expected_statistics(v, exact_inputs),
                                           variables)
  numerics.assert_as_close_as_plain(jax.device_get(updated["batch_stats"]), expected,
                                    exact_stats, what="running statistics")


def test_averaging_per_microbatch_variances_would_fail_this_test(variables):
  """The check above can tell the pooled variance from the mean of per-micro-batch ones."""
  x = _inputs()
  groups = _groups(4, 1)
  _, inputs = _plain_training(variables, np.asarray(x), groups, _layers())
  key = (0, 0, "BatchNorm_0")
  per_group = [np.asarray(v) for v in inputs[key]]
  pooled = np.concatenate(per_group).var(0)
  averaged = np.mean([g.var(0) for g in per_group], 0)
  assert np.abs(pooled - averaged).max() > 1e-2


def test_evaluation_uses_the_running_statistics(variables):
  x = _inputs()
  model = _model(_layers(), stages=4, data=2, microbatches=2, remat="none")
  # Training has no backward pass here: remat plays no part; the training test's step.
  _, updated = _training_step(4, 2, 2, "gpipe", 1, "none")(variables, x)
  trained = {"params": variables["params"], "batch_stats": jax.device_get(updated["batch_stats"])}
  evaluate = jax.jit(lambda v: model.apply(v, x))
  y = evaluate(trained)
  plain = _model(_layers())
  # Compiled, as the pipeline is (eagerly each operation would compile on its own).
  plain_apply = jax.jit(plain.apply)
  want = plain_apply(trained, x)
  exact = numerics.float64_reference(plain_apply, trained, x)
  numerics.assert_as_close_as_plain(np.asarray(y), np.asarray(want), exact, what="eval outputs")
  # With other running statistics, the output changes: they are really used.
  shifted = jax.tree.map(lambda a: a + 1.0, trained["batch_stats"])
  other = evaluate({"params": trained["params"], "batch_stats": shifted})  # The same program.
  assert np.abs(np.asarray(other) - np.asarray(y)).max() > 1e-3


def test_statistics_across_replicas_with_the_data_axis_name(variables):
  """BatchNorm(axis_name="data"): statistics over the micro-batch of every replica."""
  x = _inputs()
  model = _model(_layers("data"), stages=2, data=2, microbatches=2)
  y, _ = jax.jit(lambda v: model.apply(v, x, train=True, mutable=["batch_stats"]))(variables)
  # Micro-batch j of every replica together.
  per_replica, size = BATCH // 2, BATCH // 4
  groups = [np.concatenate([np.arange(d * per_replica + j * size, d * per_replica + (j + 1) * size)
                            for d in range(2)]) for j in range(2)]
  want, _ = _plain_training(variables, np.asarray(x), groups, _layers())
  exact, _ = numerics.float64_reference(
      lambda v, x: _plain_training(v, np.asarray(x), groups, _layers()), variables, x)
  numerics.assert_as_close_as_plain(np.asarray(y), want, exact, what="outputs")


def test_training_mode_without_mutable_statistics_raises(variables):
  model = _model(_layers(), stages=2, microbatches=2)
  # Traced abstractly: the refusal comes after the call is built, which eagerly would run it.
  with pytest.raises(ValueError, match="mutable=\\['batch_stats'\\]"):
    jax.eval_shape(lambda v: model.apply(v, _inputs(), train=True), variables)


def test_missing_statistics_raise(variables):
  model = _model(_layers(), stages=2, microbatches=2)
  with pytest.raises(ValueError, match="hold no 'batch_stats'"):
    model.apply({"params": variables["params"]}, _inputs())


def test_staged_statistics_round_trip(variables):
  x = _inputs()
  model = _model(_layers(), stages=2, data=2, microbatches=2)
  layout = model.stage_layout(x)
  fixed = model.with_split(layout)
  stats_layout = fixed.stats_layout(x)
  staged = {"params": {"staged": staging.to_staged(layout, variables["params"])},
            "batch_stats": {"staged": staging.to_staged(stats_layout, variables["batch_stats"])}}
  y, updated = jax.jit(lambda v: fixed.apply(v, x, train=True, mutable=["batch_stats"]))(staged)
  y_logical, updated_logical = jax.jit(
      lambda v: fixed.apply(v, x, train=True, mutable=["batch_stats"]))(variables)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_logical))
  back = staging.to_logical(stats_layout, updated["batch_stats"]["staged"])
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(updated_logical["batch_stats"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_train_step_carries_the_statistics(variables):
  x, y = _inputs(), jnp.zeros((BATCH, 2))
  model = _model(_layers(), stages=2, data=2, microbatches=2)
  optimizer = optax.sgd(0.1)

  def loss_fn(params, batch, rng, stats):
    del rng
    out, updated = model.apply({"params": params, "batch_stats": stats}, batch["x"], train=True,
                               mutable=["batch_stats"])
    return jnp.mean((out - batch["y"]) ** 2), updated["batch_stats"]

  state = tpipe.create_train_state(variables["params"], optimizer,
                                   model_state=variables["batch_stats"])
  step = tpipe.make_train_step(loss_fn, optimizer, donate=False)
  new_state, metrics = step(state, {"x": x, "y": y}, jax.random.key(0))
  (loss, stats), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
      variables["params"], {"x": x, "y": y}, None, variables["batch_stats"])
  np.testing.assert_array_equal(np.asarray(metrics["loss"]), np.asarray(loss))
  for a, b in zip(jax.tree.leaves(new_state.model_state), jax.tree.leaves(stats)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The same update as SGD on those gradients, as close to the float64 update as that is (a
  # bias before a BatchNorm has a gradient of exactly zero, computed as rounding noise).
  sgd = jax.jit(lambda params, grads: jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
  moved = sgd(variables["params"], grads)
  (_, _), grads64 = numerics.float64_reference(
      jax.jit(jax.value_and_grad(lambda p, b, s: loss_fn(p, b, None, s), has_aux=True)),
      variables["params"], {"x": x, "y": y}, variables["batch_stats"])
  moved64 = numerics.float64_reference(sgd, variables["params"], grads64)
  numerics.assert_as_close_as_plain(new_state.params, moved, moved64, what="updated params")
  # The statistics moved: training mode updated them once.
  before = variables["batch_stats"]["layers_0"]["BatchNorm_0"]["mean"]
  assert np.abs(np.asarray(new_state.model_state["layers_0"]["BatchNorm_0"]["mean"])
                - before).max() > 1e-3


def test_init_in_training_mode_leaves_the_statistics_at_their_initial_values():
  model = _model(_layers(), stages=2, microbatches=2)
  variables = model.init({"params": jax.random.key(1)}, _inputs(), train=True)
  plain = _model(_layers()).init({"params": jax.random.key(1)}, _inputs())
  for a, b in zip(jax.tree.leaves(variables["batch_stats"]), jax.tree.leaves(plain["batch_stats"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  means = [np.asarray(a) for a in jax.tree.leaves(variables["batch_stats"])]
  assert all(np.all(m == 0) or np.all(m == 1) for m in means)  # Flax's zeros and ones.


def _primitive_names(jaxpr) -> set[str]:
  """The names of every primitive in ``jaxpr`` and the jaxprs nested in it."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for sub in extend_core.jaxprs_in_params(eqn.params):
      names |= _primitive_names(sub)
  return names


def test_initialize_creates_inits_variables_without_running_the_pipeline():
  model = _model(_layers(), stages=2, microbatches=2)
  rngs = {"params": jax.random.key(1)}
  initialize = functools.partial(model.init, method="initialize", train=True)
  by_init = model.init(rngs, _inputs(), train=True)
  by_initialize = initialize(rngs, _inputs())
  assert jax.tree.structure(by_initialize) == jax.tree.structure(by_init)
  jax.tree.map(np.testing.assert_array_equal, by_initialize, by_init)
  # init runs the pipelined forward (its shard_map); initialize runs the layers alone.
  assert "shard_map" in _primitive_names(
      jax.make_jaxpr(functools.partial(model.init, train=True))(rngs, _inputs()).jaxpr)
  assert "shard_map" not in _primitive_names(jax.make_jaxpr(initialize)(rngs, _inputs()).jaxpr)


def test_pipeline_transform_runs_batchnorm_blocks_like_sequential():
  """tpipe.pipeline(Block) with BatchNorm: the same stack as Sequential([Repeat(Block, L)])."""
  mesh = tpipe.make_mesh(stages=2, data=2)
  stack = tpipe.pipeline(DenseBN, length=4, num_stages=2, num_microbatches=2, mesh=mesh)(WIDTH)
  x = jax.random.normal(jax.random.key(3), (BATCH, WIDTH))
  v = jax.device_get(stack.init({"params": jax.random.key(4)}, x))
  assert v["batch_stats"]["BatchNorm_0"]["mean"].shape == (4, WIDTH)
  assert v["params"]["Dense_0"]["kernel"].shape == (4, WIDTH, WIDTH)
  y, updated = jax.jit(lambda v: stack.apply(v, x, train=True, mutable=["batch_stats"]))(v)
  seq = _model([tpipe.Repeat(DenseBN(WIDTH), 4)], stages=2, data=2, microbatches=2)
  as_seq = {"params": {"layers_0": v["params"]}, "batch_stats": {"layers_0": v["batch_stats"]}}
  want, want_updated = jax.jit(
      lambda v: seq.apply(v, x, train=True, mutable=["batch_stats"]))(as_seq)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
  for a, b in zip(jax.tree.leaves(updated["batch_stats"]),
                  jax.tree.leaves(want_updated["batch_stats"]["layers_0"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # And the semantics: each micro-batch normalized with its own statistics.
  groups = _groups(2, 2)
  plain, _ = _plain_training(as_seq, np.asarray(x), groups, [tpipe.Repeat(DenseBN(WIDTH), 4)])
  exact, _ = numerics.float64_reference(
      lambda v, x: _plain_training(v, np.asarray(x), groups, [tpipe.Repeat(DenseBN(WIDTH), 4)]),
      as_seq, x)
  numerics.assert_as_close_as_plain(np.asarray(y), plain, exact, what="outputs")
  # Evaluation uses the running averages and needs nothing mutable.
  evaluated = stack.apply({"params": v["params"], "batch_stats": updated["batch_stats"]}, x)
  assert evaluated.shape == x.shape
  with pytest.raises(ValueError, match="mutable=\\['batch_stats'\\]"):
    jax.eval_shape(lambda v: stack.apply(v, x, train=True), v)  # Refused once traced.


class MaskedBN(nn.Module):
  """Dense -> BatchNorm given the mask ``mask`` (per example and feature)."""

  @nn.compact
  def __call__(self, x, mask, *, train: bool = False):
    return nn.BatchNorm(use_running_average=not train)(nn.Dense(WIDTH)(x), mask=mask)


def test_batchnorm_with_a_mask_is_refused_in_training_mode():
  """As in tpipe.nnx (tests/nnx/test_batchnorm.py): pooling masked statistics would need each
  micro-batch's count of values; the refusal comes from planning, before anything runs."""
  x = _inputs()
  mask = np.arange(BATCH * WIDTH).reshape(BATCH, WIDTH) % 3 > 0
  model = tpipe.Sequential([MaskedBN(), Head()], num_stages=2, num_microbatches=2,
                           per_example=("mask",), mesh=tpipe.make_mesh(stages=2))
  variables = model.init({"params": jax.random.key(1)}, x, mask=mask)
  with pytest.raises(ValueError, match=r"layers\[0\] \(MaskedBN\) failed .*BatchNorm with a mask "
                                       r"is not supported in training mode; the statistics pooled "
                                       r"over micro-batches would need the mask's counts"):
    model.apply(variables, x, mask=mask, train=True, mutable=["batch_stats"])
  # Evaluation normalizes with the running averages: the mask plays no part, nothing refused.
  assert model.apply(variables, x, mask=mask).shape == (BATCH, 2)
