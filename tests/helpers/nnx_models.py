"""Small Flax NNX layers and models that several NNX test modules pipeline.

Layers (for ``tpipe.nnx.Sequential``): :class:`DenseAct` (changes the width), :class:`Residual`,
:class:`Block` (a pre-LayerNorm residual MLP), :class:`Embed` (token ids to vectors) and
:class:`HeadLoss` (per-example cross-entropy with per-example targets).

Two models (:func:`layers`): ``"mlp"`` (an MLP whose width changes, a Repeat of 6 residual
layers; 10 units) and ``"lm"`` (embedding -> Repeat of 6 blocks -> head with targets and loss;
8 units), with their inputs (:func:`inputs`), their plain run (the same NNX layers called in
order, :func:`in_order`), and the plain model's value and gradients in float64
(:func:`reference`, :func:`plain_loss` with ``precision="float64"``) and in float32 on the
pipeline's micro-batches (:func:`plain`, :func:`plain_loss`), for the numerics rule
(:mod:`tests.helpers.numerics`).
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from tests.helpers import numerics
from tpipe import nnx as tnnx

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


def layers(name, seed=0):
  """The layers of model ``name`` (``"mlp"`` or ``"lm"``), freshly initialised from ``seed``."""
  rngs = nnx.Rngs(seed)
  if name == "mlp":
    return [DenseAct(5, 16, rngs=rngs), tnnx.Repeat(lambda r: Residual(16, rngs=r), 6, rngs=rngs),
            DenseAct(16, 32, rngs=rngs), DenseAct(32, 8, rngs=rngs), nnx.Linear(8, 4, rngs=rngs)]
  assert name == "lm", name
  return [Embed(VOCAB, WIDTH, rngs=rngs),
          tnnx.Repeat(lambda r: Block(WIDTH, rngs=r), 6, rngs=rngs),
          HeadLoss(WIDTH, VOCAB, rngs=rngs)]


def inputs(name):
  """``(x, keyword arguments, per_example names)`` of model ``name``."""
  k1, k2 = jax.random.split(jax.random.key(42))
  if name == "mlp":
    return jax.random.normal(k1, (BATCH, 5)), {}, ()
  tokens = jax.random.randint(k1, (BATCH, SEQ), 0, VOCAB)
  targets = jax.random.randint(k2, (BATCH, SEQ), 0, VOCAB)
  return tokens, {"targets": targets}, ("targets",)


def in_order(model_layers, x, kwargs, microbatches=1):
  """The plain model: the layers called in order (a Repeat scans its copies), on
  ``microbatches`` contiguous micro-batches of the batch, as the pipeline splits it."""

  def run(chunk):
    h, kw = chunk
    for layer in model_layers:
      h = layer(h, **kw) if isinstance(layer, HeadLoss) else layer(h)
    return h

  split = lambda a: a.reshape(microbatches, -1, *a.shape[1:])
  y = jax.lax.map(run, (split(x), jax.tree.map(split, kwargs)))
  return y.reshape(-1, *y.shape[2:])


def weighted(y):
  """A fixed linear functional of ``y`` whose gradient differs for every element."""
  return jnp.vdot(y, jnp.cos(jnp.arange(y.size, dtype=y.dtype)).reshape(y.shape))


def params(name):
  """The plain model's Param state as a pure dict (``[i]`` per layer)."""
  return nnx.to_pure_dict(nnx.state(nnx.List(layers(name)), nnx.Param))


def _plain_fn(name, microbatches=1):
  """``(params, x, kwargs) -> ((weighted(y), y), grads)`` of the plain model."""
  graphdef, _ = nnx.split(nnx.List(layers(name)), nnx.Param)

  def loss(params, x, kwargs):
    y = in_order(nnx.merge(graphdef, params), x, kwargs, microbatches)
    return weighted(y), y

  return jax.jit(jax.value_and_grad(loss, has_aux=True))


@functools.cache
def reference(name):
  """The float64 plain model's ``((weighted(y), y), grads)``."""
  x, kwargs, _ = inputs(name)
  return numerics.float64_reference(_plain_fn(name), params(name), x, kwargs)


@functools.cache
def plain(name, microbatches):
  """The float32 plain model's ``((weighted(y), y), grads)`` on ``microbatches`` micro-batches."""
  x, kwargs, _ = inputs(name)
  return _plain_fn(name, microbatches)(params(name), x, kwargs)


def pipelined(name, **config):
  """``(tpipe.nnx.Sequential of model name, x, kwargs)``; ``config``: pipeline settings."""
  x, kwargs, per_example = inputs(name)
  return tnnx.Sequential(layers(name), per_example=per_example, **config), x, kwargs


@nnx.jit
def value_and_grad(model, x, kwargs):
  """``((weighted(model(x)), model(x)), grads)`` of a pipelined model, under ``nnx.jit``."""

  def loss(model):
    y = model(x, **kwargs)
    return weighted(y), y

  return nnx.value_and_grad(loss, has_aux=True)(model)


def fused_repeats(schedule):
  """Chunks per stage a fused schedule runs (interleaved and V schedules hold two or more)."""
  return 2 if schedule in ("interleaved_1f1b", "zbv") else 1


def objective(loss):
  """A nonlinear function of the loss, so the cotangent reaching the fused run is not 1."""
  return loss + 0.5 * loss ** 2


@functools.cache
def plain_loss(microbatches, precision="float32"):
  """The plain LM's ``(objective(mean loss), grads)`` on ``microbatches`` micro-batches; with
  ``precision="float64"`` the float64 reference."""
  graphdef, _ = nnx.split(nnx.List(layers("lm")), nnx.Param)

  def run(params, x, kwargs):
    return objective(in_order(nnx.merge(graphdef, params), x, kwargs, microbatches).mean())

  fn = jax.jit(jax.value_and_grad(run))
  x, kwargs, _ = inputs("lm")
  if precision == "float64":
    return numerics.float64_reference(fn, params("lm"), x, kwargs)
  return fn(params("lm"), x, kwargs)


@functools.cache
def plain_losses(microbatches, precision="float32"):
  """The plain LM's per-example losses on ``microbatches`` micro-batches (float64 reference with
  ``precision="float64"``)."""
  graphdef, _ = nnx.split(nnx.List(layers("lm")), nnx.Param)
  fn = jax.jit(lambda p, x, kw: in_order(nnx.merge(graphdef, p), x, kw, microbatches))
  x, kwargs, _ = inputs("lm")
  if precision == "float64":
    return numerics.float64_reference(fn, params("lm"), x, kwargs)
  return fn(params("lm"), x, kwargs)
