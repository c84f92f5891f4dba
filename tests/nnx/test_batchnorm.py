"""``nnx.BatchNorm`` in ``tpipe.nnx.Sequential``, with GPipe's semantics, against plain NNX.

* Training (``model.train()``, NNX's default): each micro-batch is normalized with its own
  statistics, so outputs and parameter gradients equal the plain NNX layers called on each
  micro-batch separately.
* Running averages: one update per call and per BatchNorm, from statistics pooled over every
  micro-batch of every replica. The reference is one ``nnx.BatchNorm`` update on the
  concatenation of the inputs that BatchNorm received in the plain per-micro-batch run.
* Evaluation (``model.eval()``) normalizes with the running averages and leaves them unchanged.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tpipe
from tests.helpers import numerics
from tpipe import nnx as tnnx

WIDTH, BATCH = 6, 16
MOMENTA = (0.8, 0.9)  # layers[0]'s BatchNorm, the Repeat's.


class DenseBN(nnx.Module):
  """Linear -> BatchNorm -> tanh."""

  def __init__(self, d_in, d_out, momentum, *, rngs):
    self.linear = nnx.Linear(d_in, d_out, rngs=rngs)
    self.norm = nnx.BatchNorm(d_out, momentum=momentum, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.norm(self.linear(x)))


def _layers():
  rngs = nnx.Rngs(3)
  return [DenseBN(3, WIDTH, MOMENTA[0], rngs=rngs),
          tnnx.Repeat(lambda r: DenseBN(WIDTH, WIDTH, MOMENTA[1], rngs=r), 3, rngs=rngs),
          nnx.Linear(WIDTH, 2, rngs=rngs)]


def _inputs():
  return jax.random.normal(jax.random.key(0), (BATCH, 3)) * 2.0 + 0.5


def _groups(num_microbatches, data):
  """The example indices of each (replica, micro-batch), in that order."""
  per_replica = BATCH // data
  size = per_replica // num_microbatches
  return [np.arange(d * per_replica + j * size, d * per_replica + (j + 1) * size,
                    dtype=np.int32) for d in range(data) for j in range(num_microbatches)]


def _units(layers):
  """(layer index, copy index or None, module) for every unit, in order."""
  units = []
  for i, layer in enumerate(layers):
    if isinstance(layer, tnnx.Repeat):
      graphdef, state = nnx.split(layer.layer)
      units += [(i, j, nnx.merge(graphdef, jax.tree.map(lambda a, j=j: a[j], state)))
                for j in range(layer.n)]
    else:
      units.append((i, None, layer))
  return units


def _weighted(y):
  return jnp.vdot(y, jnp.cos(jnp.arange(y.size, dtype=y.dtype)).reshape(y.shape))


def _plain_training(state, x, groups):
  """The plain NNX layers in training mode on each group of examples separately: the weighted
  output (for gradients), the outputs, and each BatchNorm's inputs per group keyed by (layer,
  copy)."""
  graphdef = nnx.graphdef(nnx.List(_layers()))
  units = _units(nnx.merge(graphdef, state))
  outputs, inputs = [], {}
  for rows in groups:
    h = x[rows]
    for i, j, unit in units:
      if isinstance(unit, DenseBN):
        z = unit.linear(h)
        inputs.setdefault((i, j), []).append(z)
        h = jnp.tanh(unit.norm(z))
      else:
        h = unit(h)
    outputs.append(h)
  order = np.argsort(np.concatenate(groups))
  y = jnp.concatenate(outputs)[order]
  return _weighted(y), (y, inputs)


def _expected_statistics(stats, inputs):
  """``stats`` (the layers' BatchStat state) after one nnx.BatchNorm update per BatchNorm on the
  concatenation of its inputs."""
  stats = jax.tree.map(np.array, stats)
  for (i, j), values in inputs.items():
    values = jnp.concatenate(values)
    old = stats[i]["layer"]["norm"] if j is not None else stats[i]["norm"]
    norm = nnx.BatchNorm(WIDTH, momentum=MOMENTA[0 if j is None else 1], rngs=nnx.Rngs(0))
    pick = (lambda a: a[j]) if j is not None else (lambda a: a)
    # New variables, in the inputs' dtype (float64 for the reference).
    norm.mean = nnx.BatchStat(jnp.asarray(pick(old["mean"]), values.dtype))
    norm.var = nnx.BatchStat(jnp.asarray(pick(old["var"]), values.dtype))
    norm(values)
    for name in ("mean", "var"):
      if j is None:
        old[name] = np.asarray(getattr(norm, name)[...])
      else:
        old[name][j] = np.asarray(getattr(norm, name)[...])
  return stats


def _split_state(layers):
  return (nnx.to_pure_dict(nnx.state(nnx.List(layers), nnx.Param)),
          nnx.to_pure_dict(nnx.state(nnx.List(layers), nnx.BatchStat)))


@nnx.jit
def _value_and_grad(model, x):
  def loss(model):
    y = model(x)
    return _weighted(y), y

  return nnx.value_and_grad(loss, has_aux=True)(model)


CASES = [
    # schedule, stages, data, microbatches
    ("gpipe", 1, 1, 2),
    ("gpipe", 2, 2, 2),
    ("circular", 2, 1, 4),
    ("circular", 1, 2, 2),
]


@pytest.mark.parametrize("schedule, stages, data, microbatches", CASES)
def test_training_normalizes_per_microbatch_and_pools_the_running_averages(schedule, stages, data,
                                                                           microbatches):
  mesh = tpipe.make_mesh(stages=stages, data=data)
  model = tnnx.Sequential(_layers(), num_stages=stages, num_microbatches=microbatches,
                          schedule=schedule, num_repeats=2 if schedule == "circular" else 1,
                          mesh=mesh)
  x = _inputs()
  params, stats = _split_state(_layers())
  (_, y), grads = _value_and_grad(model, jax.device_put(x, tpipe.data_sharding(mesh)))

  groups = _groups(microbatches, data)

  def plain(params, x):
    # The statistics in the run's dtype: the plain run's own (discarded) update writes into them.
    return _plain_training(_merge(params, jax.tree.map(lambda a: a.astype(x.dtype), stats)), x,
                           groups)

  # Compiled, as the pipeline is: XLA fuses BatchNorm's reductions, whose float32 error on
  # 4-example groups, op by op, is a quarter of the compiled one on some CPUs (the plain error
  # must come from the same kind of float32 work as the result under test).
  plain_value_and_grad = jax.jit(jax.value_and_grad(plain, has_aux=True))
  (_, (want, inputs)), want_grads = plain_value_and_grad(params, x)
  (_, (exact, exact_inputs)), exact_grads = numerics.float64_reference(plain_value_and_grad,
                                                                       params, x)
  numerics.assert_as_close_as_plain(y, want, exact, what="outputs")
  numerics.assert_as_close_as_plain(nnx.to_pure_dict(grads)["layers"], want_grads, exact_grads,
                                    what="gradients")

  got = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))["layers"]
  expected = _expected_statistics(stats, inputs)
  exact_stats = numerics.float64_reference(lambda s: _expected_statistics(s, exact_inputs), stats)
  numerics.assert_as_close_as_plain(got, expected, exact_stats, what="running averages")
  assert np.abs(got[0]["norm"]["mean"] - stats[0]["norm"]["mean"]).max() > 1e-3


def _merge(params, stats):
  """One pure state dict from the Param and BatchStat pure dicts of an nnx.List of layers."""
  out = jax.tree.map(lambda a: a, params)

  def put(tree, extra):
    for key, value in extra.items():
      if isinstance(value, dict):
        put(tree.setdefault(key, {}), value)
      else:
        tree[key] = value

  put(out, stats)
  return out


def test_averaging_per_microbatch_variances_would_fail_this_test():
  """The check above can tell the pooled variance from the mean of per-micro-batch ones."""
  params, stats = _split_state(_layers())
  _, (_, inputs) = _plain_training(_merge(params, stats), _inputs(), _groups(4, 1))
  per_group = [np.asarray(v) for v in inputs[(0, None)]]
  pooled = np.concatenate(per_group).var(0)
  averaged = np.mean([g.var(0) for g in per_group], 0)
  assert np.abs(pooled - averaged).max() > 1e-2


def test_eval_mode_uses_the_running_averages_and_keeps_them():
  mesh = tpipe.make_mesh(stages=2, data=2)
  model = tnnx.Sequential(_layers(), num_stages=2, num_microbatches=2, mesh=mesh)
  x = _inputs()
  apply = nnx.jit(lambda model, x: model(x))
  apply(model, x)  # Training mode: the running averages move.
  trained = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
  model.eval()
  y = apply(model, x)
  after = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
  jax.tree.map(np.testing.assert_array_equal, after, trained)

  plain = nnx.List(_layers())
  nnx.update(plain, nnx.State(trained["layers"]))
  plain.eval()

  def run(state, x):
    layers = nnx.merge(nnx.graphdef(plain), state)
    for layer in layers:
      x = layer(x)
    return x

  state = nnx.to_pure_dict(nnx.state(plain))
  want = jax.jit(run)(state, x)
  exact = numerics.float64_reference(jax.jit(run), state, x)
  numerics.assert_as_close_as_plain(y, want, exact, what="eval outputs")
  model.train()
  y_train = apply(model, x)
  assert np.abs(np.asarray(y_train) - np.asarray(y)).max() > 1e-3


class _Counter(nnx.Module):

  def __init__(self, *, rngs):
    self.linear = nnx.Linear(4, 4, rngs=rngs)
    self.calls = nnx.BatchStat(jnp.zeros(()))

  def __call__(self, x):
    return self.linear(x)


class _Cache(nnx.Module):

  def __init__(self, *, rngs):
    self.linear = nnx.Linear(4, 4, rngs=rngs)
    self.cache = nnx.Cache(jnp.zeros(4))

  def __call__(self, x):
    return self.linear(x)


def test_other_mutable_state_is_rejected():
  rngs = nnx.Rngs(0)
  with pytest.raises(ValueError, match="outside an nnx.BatchNorm"):
    tnnx.Sequential([_Counter(rngs=rngs)], num_stages=1, num_microbatches=1)
  with pytest.raises(ValueError, match="other than nnx.Param"):
    tnnx.Sequential([_Cache(rngs=rngs)], num_stages=1, num_microbatches=1)


class _MaskedBN(nnx.Module):
  """Linear -> BatchNorm given the mask ``mask`` (per example and feature)."""

  def __init__(self, *, rngs):
    self.linear = nnx.Linear(3, WIDTH, rngs=rngs)
    self.norm = nnx.BatchNorm(WIDTH, rngs=rngs)

  def __call__(self, x, mask):
    return self.norm(self.linear(x), mask=mask)


def test_batchnorm_with_a_mask_is_refused_in_training_mode():
  """As in linen (tests/linen/test_batchnorm.py): pooling masked statistics would need each
  micro-batch's count of values; the refusal comes from planning, before anything runs."""
  rngs = nnx.Rngs(0)
  model = tnnx.Sequential([_MaskedBN(rngs=rngs), nnx.Linear(WIDTH, 2, rngs=rngs)], num_stages=2,
                          num_microbatches=2, per_example=("mask",),
                          mesh=tpipe.make_mesh(stages=2))
  x = _inputs()
  mask = np.arange(BATCH * WIDTH).reshape(BATCH, WIDTH) % 3 > 0
  before = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
  with pytest.raises(ValueError, match=r"layers\[0\] \(_MaskedBN\) failed .*BatchNorm with a "
                                       r"mask is not supported in training mode; the statistics "
                                       r"pooled over micro-batches would need the mask's counts"):
    model(x, mask=mask)
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)),
               before)
  # The user's BatchNorm keeps its own class and still takes a mask outside the pipeline.
  assert type(model.layers[0].norm) is nnx.BatchNorm
  # Evaluation normalizes with the running averages: the mask plays no part, nothing refused.
  model.eval()
  assert model(x, mask=mask).shape == (BATCH, 2)
