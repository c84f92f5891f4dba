"""tpipe.nnx: NNX layers, pipelined, equal the layers applied in order.

Outputs and parameter gradients (through ``nnx.value_and_grad`` inside ``nnx.jit``) against a
float64 run of the plain model (the same NNX layers called one after another), for an MLP whose
width changes and an LM (embedding -> Repeat(block) -> head with per-example targets and loss),
over a handful of (schedule, stages, micro-batches, data) combinations. With every fused schedule
the linen stack runs (``FUSED_SCHEDULES``, e.g. ``"1f1b"``) the LM returns its mean loss, whose
value and gradients equal the plain model's for S in {1, 2, 4} and data in {1, 2}; a fused stack
whose last layer returns no per-example losses is rejected. Also: the Param state's
names do not depend on the pipeline, an ``nnx.Optimizer`` step runs under ``nnx.jit`` and equals
the plain model's step, bad arguments raise clear errors, and dropout masks come from the stack's
rngs, not from the layout.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import tpipe
from tests import numerics
from tpipe import nnx as tnnx
from tpipe.linen import sequential as linen_sequential

BATCH = 16
VOCAB = 11
SEQ = 4
WIDTH = 8


class DenseAct(nnx.Module):

  def __init__(self, d_in, d_out, *, rngs):
    self.linear = nnx.Linear(d_in, d_out, rngs=rngs)

  def __call__(self, x):
    return nnx.gelu(self.linear(x))


class Residual(nnx.Module):

  def __init__(self, width, *, rngs):
    self.linear = nnx.Linear(width, width, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.linear(x))


class Block(nnx.Module):

  def __init__(self, width, *, rngs):
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, 2 * width, rngs=rngs)
    self.down = nnx.Linear(2 * width, width, rngs=rngs)

  def __call__(self, x):
    return x + self.down(nnx.gelu(self.up(self.norm(x))))


class Embed(nnx.Module):
  """Token ids -> vectors, in the table's dtype (nnx.Embed computes in float32 by default)."""

  def __init__(self, vocab, width, *, rngs):
    self.table = nnx.Param(jax.random.normal(rngs.params(), (vocab, width)))

  def __call__(self, tokens):
    return self.table[...][tokens]


class HeadLoss(nnx.Module):
  """Per-example mean cross-entropy over the sequence: ``[batch]``."""

  def __init__(self, width, vocab, *, rngs):
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.out = nnx.Linear(width, vocab, rngs=rngs)

  def __call__(self, x, targets):
    logp = jax.nn.log_softmax(self.out(self.norm(x)))
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return -jnp.mean(picked, axis=-1)


def _layers(name, seed=0):
  rngs = nnx.Rngs(seed)
  if name == "mlp":
    return [DenseAct(5, 16, rngs=rngs), tnnx.Repeat(lambda r: Residual(16, rngs=r), 6, rngs=rngs),
            DenseAct(16, 32, rngs=rngs), DenseAct(32, 8, rngs=rngs), nnx.Linear(8, 4, rngs=rngs)]
  return [Embed(VOCAB, WIDTH, rngs=rngs),
          tnnx.Repeat(lambda r: Block(WIDTH, rngs=r), 6, rngs=rngs),
          HeadLoss(WIDTH, VOCAB, rngs=rngs)]


def _inputs(name):
  """(x, keyword arguments, per_example names)"""
  k1, k2 = jax.random.split(jax.random.key(42))
  if name == "mlp":
    return jax.random.normal(k1, (BATCH, 5)), {}, ()
  tokens = jax.random.randint(k1, (BATCH, SEQ), 0, VOCAB)
  targets = jax.random.randint(k2, (BATCH, SEQ), 0, VOCAB)
  return tokens, {"targets": targets}, ("targets",)


def _in_order(layers, x, kwargs, microbatches=1):
  """The plain model: the layers called in order (a Repeat scans its copies), on
  ``microbatches`` contiguous micro-batches of the batch, as the pipeline splits it."""

  def run(chunk):
    h, kw = chunk
    for layer in layers:
      h = layer(h, **kw) if isinstance(layer, HeadLoss) else layer(h)
    return h

  split = lambda a: a.reshape(microbatches, -1, *a.shape[1:])
  y = jax.lax.map(run, (split(x), jax.tree.map(split, kwargs)))
  return y.reshape(-1, *y.shape[2:])


def _weighted(y):
  return jnp.vdot(y, jnp.cos(jnp.arange(y.size, dtype=y.dtype)).reshape(y.shape))


def _plain_fn(name, microbatches=1):
  """``(params, x, kwargs) -> ((loss, y), grads)`` of the plain model, params as a pure dict."""
  graphdef, _ = nnx.split(nnx.List(_layers(name)), nnx.Param)

  def loss(params, x, kwargs):
    y = _in_order(nnx.merge(graphdef, params), x, kwargs, microbatches)
    return _weighted(y), y

  return jax.jit(jax.value_and_grad(loss, has_aux=True))


@functools.cache
def _reference(name):
  params = nnx.to_pure_dict(nnx.state(nnx.List(_layers(name)), nnx.Param))
  x, kwargs, _ = _inputs(name)
  return numerics.float64_reference(_plain_fn(name), params, x, kwargs)


@functools.cache
def _plain(name, microbatches):
  params = nnx.to_pure_dict(nnx.state(nnx.List(_layers(name)), nnx.Param))
  x, kwargs, _ = _inputs(name)
  return _plain_fn(name, microbatches)(params, x, kwargs)


def _pipelined(name, **config):
  x, kwargs, per_example = _inputs(name)
  return tnnx.Sequential(_layers(name), per_example=per_example, **config), x, kwargs


@nnx.jit
def _value_and_grad(model, x, kwargs):
  def loss(model):
    y = model(x, **kwargs)
    return _weighted(y), y

  return nnx.value_and_grad(loss, has_aux=True)(model)


CASES = [("mlp", "gpipe", 1, 1, 1), ("mlp", "gpipe", 2, 4, 2), ("lm", "gpipe", 4, 8, 1),
         ("lm", "circular", 2, 4, 2), ("mlp", "circular", 4, 4, 1), ("lm", "gpipe", 2, 2, 1)]


@pytest.mark.parametrize("name,schedule,stages,microbatches,data", CASES)
def test_outputs_and_gradients_equal_the_layers_in_order(name, schedule, stages, microbatches,
                                                        data):
  mesh = tpipe.make_mesh(stages=stages, data=data)
  model, x, kwargs = _pipelined(
      name, num_stages=stages, num_microbatches=microbatches, schedule=schedule,
      num_repeats=2 if schedule == "circular" else 1, mesh=mesh)
  x, kwargs = jax.device_put((x, kwargs), tpipe.data_sharding(mesh))
  (_, y), grads = _value_and_grad(model, x, kwargs)
  (_, y64), grads64 = _reference(name)
  (_, plain_y), plain_grads = _plain(name, microbatches * data)
  # The Sequential's Param state is layers[i]; the plain model's, a List of the layers, is [i].
  grads = nnx.to_pure_dict(grads)["layers"]
  numerics.assert_as_close_as_plain(y, plain_y, y64, what="outputs")
  numerics.assert_as_close_as_plain(grads, plain_grads, grads64, what="gradients")


def _fused_repeats(schedule):
  """Chunks per stage a fused schedule runs (interleaved and V schedules hold two or more)."""
  return 2 if schedule in ("interleaved_1f1b", "zbv") else 1


def _objective(loss):
  """A nonlinear function of the loss, so the cotangent reaching the fused run is not 1."""
  return loss + 0.5 * loss ** 2


@functools.cache
def _plain_loss(microbatches, precision="float32"):
  """The plain LM's ``(objective(mean loss), grads)`` on ``microbatches`` micro-batches; with
  ``precision="float64"`` the float64 reference."""
  graphdef, _ = nnx.split(nnx.List(_layers("lm")), nnx.Param)

  def objective(params, x, kwargs):
    return _objective(_in_order(nnx.merge(graphdef, params), x, kwargs, microbatches).mean())

  fn = jax.jit(jax.value_and_grad(objective))
  params = nnx.to_pure_dict(nnx.state(nnx.List(_layers("lm")), nnx.Param))
  x, kwargs, _ = _inputs("lm")
  if precision == "float64":
    return numerics.float64_reference(fn, params, x, kwargs)
  return fn(params, x, kwargs)


# (schedule, stages, micro-batches per replica, data): every fused schedule once (the schedules
# themselves are checked on linen stacks in test_fused.py; here the NNX plumbing), M < S, M = S,
# M > S, S in {1, 2, 4}, data in {1, 2}.
FUSED_CASES = [("1f1b", 1, 2, 2), ("interleaved_1f1b", 2, 4, 2), ("zb_h1", 4, 2, 1),
               ("zbv", 2, 2, 2)]


def test_the_fused_cases_cover_every_fused_schedule():
  assert {case[0] for case in FUSED_CASES} == set(linen_sequential.FUSED_SCHEDULES)


@pytest.mark.parametrize("schedule,stages,microbatches,data", FUSED_CASES)
def test_fused_schedules_give_the_mean_loss_and_its_gradients(schedule, stages, microbatches,
                                                              data):
  mesh = tpipe.make_mesh(stages=stages, data=data)
  model, x, kwargs = _pipelined("lm", num_stages=stages, num_microbatches=microbatches,
                                schedule=schedule, num_repeats=_fused_repeats(schedule),
                                mesh=mesh)
  x, kwargs = jax.device_put((x, kwargs), tpipe.data_sharding(mesh))

  @nnx.jit
  def value_and_grad(model, x, kwargs):
    return nnx.value_and_grad(lambda m: _objective(m(x, **kwargs)))(model)

  value, grads = value_and_grad(model, x, kwargs)
  assert value.shape == ()
  plain_value, plain_grads = _plain_loss(microbatches * data)
  ref_value, ref_grads = _plain_loss(1, "float64")
  numerics.assert_as_close_as_plain(value, plain_value, ref_value, what="loss")
  numerics.assert_as_close_as_plain(nnx.to_pure_dict(grads)["layers"], plain_grads, ref_grads,
                                    what="gradients")


@pytest.mark.parametrize("schedule", linen_sequential.FUSED_SCHEDULES)
def test_a_fused_stack_whose_last_layer_is_no_loss_is_rejected(schedule):
  model, x, _ = _pipelined("mlp", num_stages=2, num_microbatches=2, schedule=schedule,
                           num_repeats=_fused_repeats(schedule), mesh=tpipe.make_mesh(stages=2))
  with pytest.raises(ValueError, match=rf"schedule='{schedule}' returns the mean loss.*"
                                       r"per-example losses.*End the stack with a layer"):
    nnx.eval_shape(lambda m: nnx.grad(lambda m: m(x))(m), model)


def test_the_check_fails_for_layers_out_of_order():
  model, x, kwargs = _pipelined("mlp", num_stages=2, num_microbatches=2,
                                mesh=tpipe.make_mesh(stages=2))
  kernel = model.layers[1].layer.linear.kernel
  kernel[...] = kernel[...][::-1]
  (_, y), _ = _value_and_grad(model, x, kwargs)
  (_, y64), _ = _reference("mlp")
  (_, plain_y), _ = _plain("mlp", 2)
  with pytest.raises(AssertionError):
    numerics.assert_as_close_as_plain(y, plain_y, y64, what="outputs")


def test_param_state_has_one_entry_per_layer_whatever_the_pipeline():
  trees = []
  for stages, schedule, repeats, balance in ((1, "gpipe", 1, "params"), (4, "gpipe", 1, "params"),
                                             (2, "circular", 2, [1, 3, 3, 1])):
    model, _, _ = _pipelined("lm", num_stages=stages, num_microbatches=4, schedule=schedule,
                             num_repeats=repeats, balance=balance,
                             mesh=tpipe.make_mesh(stages=stages))
    trees.append(nnx.state(model, nnx.Param))
  paths = [path for path, _ in nnx.to_flat_state(trees[0])]
  assert {path[:2] for path in paths} == {("layers", 0), ("layers", 1), ("layers", 2)}
  assert ("layers", 1, "layer", "up", "kernel") in paths
  assert trees[0]["layers"][1]["layer"]["up"]["kernel"][...].shape == (6, WIDTH, 2 * WIDTH)
  for tree in trees[1:]:
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(tree),
                 nnx.to_pure_dict(trees[0]))
  kernels = trees[0]["layers"][1]["layer"]["up"]["kernel"][...]
  assert not np.allclose(kernels[0], kernels[1]), "each copy needs its own initial values"


def _train_step(tx):

  @nnx.jit
  def step(model, optimizer, x, kwargs):
    loss, grads = nnx.value_and_grad(lambda m: m(x, **kwargs).mean())(model)
    optimizer.update(model, grads)
    return loss

  return step


def test_an_optimizer_step_under_nnx_jit_equals_the_plain_models():
  mesh = tpipe.make_mesh(stages=2, data=2)
  model, x, kwargs = _pipelined("lm", num_stages=2, num_microbatches=2, mesh=mesh)
  x, kwargs = jax.device_put((x, kwargs), tpipe.data_sharding(mesh))
  plain = nnx.List(_layers("lm"))
  tx = optax.sgd(0.5)
  step = _train_step(tx)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  losses = [float(step(model, optimizer, x, kwargs)) for _ in range(2)]

  plain_params = nnx.to_pure_dict(nnx.state(plain, nnx.Param))
  graphdef = nnx.graphdef(plain)
  plain_loss = lambda p: _in_order(nnx.merge(graphdef, p), x, kwargs, microbatches=4).mean()
  for _ in range(2):
    grads = jax.jit(jax.grad(plain_loss))(plain_params)
    plain_params = jax.tree.map(lambda p, g: p - 0.5 * g, plain_params, grads)
  assert losses[1] < losses[0]
  got = nnx.to_pure_dict(nnx.state(model, nnx.Param))["layers"]
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6), got,
               plain_params)

  # Adam through nnx.Optimizer: its state follows the model's Param names, and the loss falls.
  adam_model, _, _ = _pipelined("lm", num_stages=2, num_microbatches=2, mesh=mesh)
  adam = nnx.Optimizer(adam_model, optax.adam(1e-2), wrt=nnx.Param)
  adam_step = _train_step(None)
  adam_losses = [float(adam_step(adam_model, adam, x, kwargs)) for _ in range(3)]
  assert adam_losses[-1] < adam_losses[0]
  moment = adam.opt_state[0].mu["layers"][1]["layer"]["up"]["kernel"]
  assert moment[...].shape == (6, WIDTH, 2 * WIDTH)


def test_bad_arguments_raise_clear_errors():
  rngs = nnx.Rngs(0)
  block = Residual(4, rngs=rngs)
  with pytest.raises(TypeError, match="function rngs -> layer"):
    tnnx.Repeat(block, 3, rngs=rngs)
  with pytest.raises(TypeError, match="must be an int"):
    tnnx.Repeat(lambda r: Residual(4, rngs=r), 2.0, rngs=rngs)
  with pytest.raises(TypeError, match="rngs=nnx.Rngs"):
    tnnx.Repeat(lambda r: Residual(4, rngs=r), 2, rngs=0)
  with pytest.raises(TypeError, match="nnx.Module"):
    tnnx.Sequential([block, lambda x: x], num_stages=1, num_microbatches=1)
  with pytest.raises(TypeError, match="per_example"):
    tnnx.Sequential(_layers("lm"), num_stages=1, num_microbatches=1, per_example="targets")
  with pytest.raises(ValueError, match="no layer's __call__ takes"):
    tnnx.Sequential(_layers("lm"), num_stages=1, num_microbatches=1, per_example=("labels",))
  with pytest.raises(ValueError, match="chunks need at least one"):
    tnnx.Sequential([block, Residual(4, rngs=rngs)], num_stages=4, num_microbatches=4)
  model = tnnx.Sequential(_layers("lm"), num_stages=1, num_microbatches=1,
                          per_example=("targets",))
  x, kwargs, _ = _inputs("lm")
  with pytest.raises(TypeError, match="no layer's __call__ takes"):
    model(x, labels=kwargs["targets"])


class DropoutResidual(nnx.Module):

  def __init__(self, width, *, rngs):
    self.linear = nnx.Linear(width, width, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return x + self.dropout(self.linear(x))


def _dropout_model(stages, schedule="gpipe", **kwargs):
  rngs = nnx.Rngs(0)
  layers = [nnx.Linear(5, 8, rngs=rngs),
            tnnx.Repeat(lambda r: DropoutResidual(8, rngs=r), 4, rngs=rngs),
            nnx.Linear(8, 3, rngs=rngs)]
  return tnnx.Sequential(layers, num_stages=stages, num_microbatches=4, schedule=schedule,
                         num_repeats=2 if schedule == "circular" else 1,
                         mesh=tpipe.make_mesh(stages=stages), **kwargs)


def test_dropout_keys_come_from_the_stacks_rngs_and_not_from_the_layout():
  x = jax.random.normal(jax.random.key(1), (BATCH, 5))
  apply = nnx.jit(lambda model, x: model(x))
  models = [_dropout_model(1, rngs=nnx.Rngs(dropout=7)),
            _dropout_model(2, rngs=nnx.Rngs(dropout=7)),
            _dropout_model(2, "circular", rngs=nnx.Rngs(dropout=7))]
  first = [np.asarray(apply(model, x)) for model in models]
  for y in first[1:]:
    np.testing.assert_array_equal(y, first[0])
  second = np.asarray(apply(models[0], x))
  assert not np.allclose(second, first[0]), "each call draws a new key"
  models[0].eval()
  evaluated = [np.asarray(apply(models[0], x)) for _ in range(2)]
  np.testing.assert_array_equal(evaluated[0], evaluated[1])
  assert not np.allclose(evaluated[0], first[0])
  with pytest.raises(ValueError, match="no rngs"):
    _dropout_model(1)
