"""A tiny mixture-of-experts LM in both front ends, for the pipelined MoE tests.

``embed -> Repeat(block, 4) -> head``: each block a residual mixture of 4 SwiGLU experts, top-2,
on its LayerNorm'd input, adding the router's balance and z-losses to the training loss. The
linen model (:func:`linen_layers`) and the NNX one (:func:`nnx_layers`) have the same parameter
tree, so one set of parameters (:func:`random_params`) and one plain run
(:func:`sequential_value_and_grad`) serve both.

The plain run is the model in sequence on each group of rows one device pools its auxiliary
losses over (``groups``: data-parallel replicas x micro-batches, contiguous, as the pipeline
splits a batch): the mean per-example loss plus the mean over groups of the auxiliary losses.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import tpipe
from tests.helpers import numerics
from tpipe import nnx as tnnx
from tpipe.train import models_nnx
from tpipe.train import moe

BATCH = 16
SEQ = 4
VOCAB = 11
WIDTH = 8
HIDDEN = 8
EXPERTS = 4
TOP_K = 2
COPIES = 4
AUX, Z = 0.1, 0.01


def _moe(capacity_factor, dispatch="partitioner", exchange_chunks=1):
  return dict(num_experts=EXPERTS, experts_per_token=TOP_K, capacity_factor=capacity_factor,
              router_aux_loss_coef=AUX, router_z_loss_coef=Z, dispatch=dispatch,
              exchange_chunks=exchange_chunks)


class Embed(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    init = nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed"))
    return self.param("table", init, (VOCAB, WIDTH))[tokens]


class Block(nn.Module):
  capacity_factor: float = 0.0
  dispatch: str = "partitioner"
  exchange_chunks: int = 1

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="norm")(x)
    settings = _moe(self.capacity_factor, self.dispatch, self.exchange_chunks)
    return x + moe.MixtureOfExperts(hidden=HIDDEN, name="moe", **settings)(h)


class Head(nn.Module):
  @nn.compact
  def __call__(self, x, targets):
    logits = nn.Dense(VOCAB, name="out")(nn.LayerNorm(name="norm")(x))
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], axis=-1)


def linen_layers(capacity_factor=0.0, dispatch="partitioner", exchange_chunks=1):
  return [Embed(), tpipe.Repeat(Block(capacity_factor, dispatch, exchange_chunks), COPIES),
          Head()]


class NNXEmbed(nnx.Module):
  def __init__(self, *, rngs):
    self.table = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, WIDTH)),
                           out_sharding=("vocab", "embed"), eager_sharding=False)

  def __call__(self, tokens):
    return self.table[...][tokens]


class NNXBlock(nnx.Module):
  def __init__(self, capacity_factor, dispatch="partitioner", exchange_chunks=1, *, rngs):
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.moe = models_nnx.MixtureOfExperts(
        WIDTH, HIDDEN, **_moe(capacity_factor, dispatch, exchange_chunks), rngs=rngs)

  def __call__(self, x):
    return x + self.moe(self.norm(x))


class NNXHead(nnx.Module):
  def __init__(self, *, rngs):
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.out = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

  def __call__(self, x, targets):
    logp = jax.nn.log_softmax(self.out(self.norm(x)))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], axis=-1)


def nnx_layers(capacity_factor=0.0, seed=0, dispatch="partitioner", exchange_chunks=1):
  rngs = nnx.Rngs(seed)
  block = lambda r: NNXBlock(capacity_factor, dispatch, exchange_chunks, rngs=r)
  return [NNXEmbed(rngs=rngs), tnnx.Repeat(block, COPIES, rngs=rngs),
          NNXHead(rngs=rngs)]


def each_pair_in_turn(x, experts, w_gate, w_up, w_down):
  """Every token ``x [N, D]`` through each of its experts ``experts [N, k]`` one choice at a
  time, by gathered weights: the experts' definition; ``[N, k, D]``, not yet mixed."""
  outs = []
  for j in range(experts.shape[1]):
    e = experts[:, j]
    hidden = (jax.nn.silu(jnp.einsum("nd,ndh->nh", x, w_gate[e]))
              * jnp.einsum("nd,ndh->nh", x, w_up[e]))
    outs.append(jnp.einsum("nh,nhd->nd", hidden, w_down[e]))
  return jnp.stack(outs, axis=1)


def inputs():
  """``(tokens, targets)``, ``[BATCH, SEQ]`` each."""
  k1, k2 = jax.random.split(jax.random.key(3))
  return (jax.random.randint(k1, (BATCH, SEQ), 0, VOCAB),
          jax.random.randint(k2, (BATCH, SEQ), 0, VOCAB))


@functools.cache
def random_params():
  """Logical parameters (``{"layers_i": tree}``), every element its own random value."""
  model = tpipe.Sequential(linen_layers(), num_stages=1, num_microbatches=1,
                           per_example=("targets",))
  tokens, targets = inputs()
  shapes = nn.meta.unbox(jax.eval_shape(functools.partial(model.init, method="initialize"),
                                        {"params": jax.random.key(0)}, tokens,
                                        targets=targets))["params"]
  rng = np.random.default_rng(11)
  return jax.tree.map(lambda a: jnp.asarray(0.5 * rng.standard_normal(a.shape), a.dtype), shapes)


def _sequential_loss(params, tokens, targets, groups, capacity_factor, with_aux):
  """The model in sequence, group after group and copy after copy: two ``lax.scan`` loops (one
  body each to trace and compile, where unrolled loops compiled ``groups x COPIES`` blocks)."""
  embed, head = Embed(), Head()
  block = Block(capacity_factor)

  def one_copy(carry, copy):
    h, aux = carry
    h, sown = block.apply({"params": copy}, h, mutable=[tpipe.AUX_LOSS])
    return (h, aux + sum(jax.tree.leaves(sown))), None

  def one_group(total, rows):
    tg, yg = rows
    h = embed.apply({"params": params["layers_0"]}, tg)
    (h, aux), _ = jax.lax.scan(one_copy, (h, jnp.zeros((), h.dtype)), params["layers_1"])
    total = total + jnp.mean(head.apply({"params": params["layers_2"]}, h, yg))
    return total + (aux if with_aux else 0.0), None

  split = lambda a: a.reshape(groups, a.shape[0] // groups, *a.shape[1:])
  dtype = params["layers_0"]["table"].dtype
  total, _ = jax.lax.scan(one_group, jnp.zeros((), dtype), (split(tokens), split(targets)))
  return total / groups


@functools.cache
def sequential_value_and_grad(groups, capacity_factor=0.0, precision="float32"):
  """The plain model's ``(mean loss, gradients)`` on ``groups`` row groups (float64 with
  ``precision="float64"``)."""
  fn = jax.jit(jax.value_and_grad(_sequential_loss), static_argnums=(3, 4, 5))
  args = (random_params(), *inputs(), groups, capacity_factor, True)
  if precision == "float64":
    return numerics.float64_reference(fn, *args)
  return fn(*args)


@functools.cache
def sequential_loss_without_aux(groups, capacity_factor=0.0):
  """The plain model's mean loss on ``groups`` row groups without the auxiliary losses (float32;
  no gradients)."""
  fn = jax.jit(_sequential_loss, static_argnums=(3, 4, 5))
  return fn(random_params(), *inputs(), groups, capacity_factor, False)
