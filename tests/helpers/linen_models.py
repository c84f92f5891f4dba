"""Small Flax linen layers and loss models that several test modules pipeline.

Layers (for ``tpipe.Sequential``): :class:`DenseAct` (changes the width), :class:`Residual`,
:class:`Embed` (token ids to vectors), :class:`Block` (a pre-LayerNorm residual MLP),
:class:`HeadLoss` (per-example cross-entropy with per-example targets) and
:class:`SquaredError` (per-example regression loss).

Loss models (:func:`loss_model`): sequences ending in a per-example loss, with their plain
sequential run (:func:`losses_in_order`), random parameters (:func:`random_params`) and the plain
model's value and gradients in float64 (:func:`reference`) and float32 on the pipeline's
micro-batches (:func:`plain`), for the numerics rule (:mod:`tests.helpers.numerics`). The
objective differentiated is a nonlinear function of the mean loss (:func:`objective`), so the
cotangent reaching a fused schedule's run is not 1.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import tpipe
from tests.helpers import numerics

VOCAB = 11
GPT_VOCAB = 32


class DenseAct(nn.Module):
  features: int

  @nn.compact
  def __call__(self, x):
    return nn.gelu(nn.Dense(self.features)(x))


class Residual(nn.Module):

  @nn.compact
  def __call__(self, x):
    return x + jnp.tanh(nn.Dense(x.shape[-1])(x))


class Embed(nn.Module):
  width: int = 8

  @nn.compact
  def __call__(self, tokens):
    return nn.Embed(VOCAB, self.width)(tokens)


class Block(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(2 * x.shape[-1])(h)))


class HeadLoss(nn.Module):
  """Per-example mean cross-entropy over the sequence: ``[batch]``."""

  @nn.compact
  def __call__(self, x, targets):
    logits = nn.Dense(VOCAB)(nn.LayerNorm()(x))
    logp = jax.nn.log_softmax(logits)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return -jnp.mean(picked, axis=-1)


class SquaredError(nn.Module):
  """Per-example mean squared error of a linear read-out: ``[batch]``."""

  @nn.compact
  def __call__(self, x, targets):
    return jnp.mean((nn.Dense(targets.shape[-1])(x) - targets) ** 2, axis=-1)


def _named(names, init=nn.initializers.lecun_normal()):
  return nn.with_logical_partitioning(init, names)


class AnnotatedEmbed(nn.Module):
  """Token embedding whose table names its axes ``("vocab", "embed")``."""
  width: int = 8

  @nn.compact
  def __call__(self, tokens):
    table = self.param("embedding", _named(("vocab", "embed"), nn.initializers.normal(1.0)),
                       (VOCAB, self.width))
    return table[tokens]


class AnnotatedBlock(nn.Module):
  """Pre-LayerNorm self-attention and MLP, every matrix with logical axis names: ``query``,
  ``key``, ``value`` ``[embed, heads, kv]``, ``out`` ``[heads, kv, embed]``, ``mlp_in``
  ``[embed, mlp]``, ``mlp_out`` ``[mlp, embed]`` (the LayerNorms' vectors unannotated; a
  scalar ``gate`` that no axis can split)."""
  heads: int = 2

  @nn.compact
  def __call__(self, x):
    width = x.shape[-1]
    head_dim = width // self.heads
    qkv = lambda name: self.param(name, _named(("embed", "heads", "kv")),
                                  (width, self.heads, head_dim))
    h = nn.LayerNorm()(x)
    q, k, v = (jnp.einsum("bsd,dhk->bshk", h, qkv(n)) for n in ("query", "key", "value"))
    weights = jax.nn.softmax(jnp.einsum("bshk,bthk->bhst", q, k) / np.sqrt(head_dim), axis=-1)
    out = self.param("out", _named(("heads", "kv", "embed")), (self.heads, head_dim, width))
    x = x + jnp.einsum("bhst,bthk,hkd->bsd", weights, v, out)
    w_in = self.param("mlp_in", _named(("embed", "mlp")), (width, 2 * width))
    w_out = self.param("mlp_out", _named(("mlp", "embed")), (2 * width, width))
    # A scalar: no dimension to split, so every device keeps it whole.
    gate = self.param("gate", nn.initializers.ones, ())
    return x + gate * nn.gelu(nn.LayerNorm()(x) @ w_in) @ w_out


class DenseGPTBlock(nn.Module):
  """A pre-LayerNorm causal GPT block of ``nn.Dense`` layers whose kernels carry logical names
  (``query``/``key``/``value`` ``[embed, heads]``, ``out`` ``[heads, embed]``, the MLP ``[embed,
  mlp]`` and ``[mlp, embed]``); the biases and LayerNorms unannotated, as in a plain annotated
  Flax model."""
  heads: int = 4

  @nn.compact
  def __call__(self, x):
    b, t, width = x.shape
    h = nn.LayerNorm()(x)
    project = lambda name: nn.Dense(width, use_bias=False, kernel_init=_named(("embed", "heads")),
                                    name=name)(h).reshape(b, t, self.heads, width // self.heads)
    q, k, v = project("query"), project("key"), project("value")
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(width // self.heads)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, width)
    x = x + nn.Dense(width, kernel_init=_named(("heads", "embed")), name="out")(o)
    h = nn.gelu(nn.Dense(2 * width, kernel_init=_named(("embed", "mlp")), name="mlp_up")(
        nn.LayerNorm()(x)))
    return x + nn.Dense(width, kernel_init=_named(("mlp", "embed")), name="mlp_down")(h)


class DenseEmbed(nn.Module):
  """``nn.Embed`` with its table named ``[vocab, embed]``."""
  vocab: int
  width: int

  @nn.compact
  def __call__(self, tokens):
    init = _named(("vocab", "embed"), nn.initializers.normal(1.0))
    return nn.Embed(self.vocab, self.width, embedding_init=init)(tokens)


class DenseHeadLoss(nn.Module):
  """:class:`HeadLoss` of ``vocab`` classes, its kernel named ``[embed, vocab]``."""
  vocab: int

  @nn.compact
  def __call__(self, x, targets):
    logits = nn.Dense(self.vocab, kernel_init=_named(("embed", "vocab")))(nn.LayerNorm()(x))
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], axis=-1)


# --------------------------------------------------------------------------------------------
# Loss models.

BATCH = 24
SEQ = 4
LOSS_MODELS = ("mlp", "lm", "blocks", "annotated", "gpt")


def loss_model(name, batch=BATCH, seq=SEQ, width=8):
  """``(layers, x, targets, float input?)`` of a model ending in a per-example loss.

  * ``"mlp"``: an MLP whose width changes, a Repeat of 3 residual layers, a regression loss
    (8 units).
  * ``"lm"``: embedding, a Repeat of 3 blocks, a head with per-example targets (5 units); int
    token inputs.
  * ``"blocks"``: 15 residual layers and a loss (16 units: ZB-V's 2 chunks on each of 8
    stages), batch 32 (M up to 32).
  * ``"annotated"``: an LM whose weights carry logical axis names (:class:`AnnotatedEmbed`, a
    Repeat of 4 :class:`AnnotatedBlock`, :class:`HeadLoss`; 6 units), for fsdp and tensor
    meshes.
  * ``"gpt"``: a GPT of Flax's own layers with named kernels and unnamed biases and norms
    (:class:`DenseEmbed`, a Repeat of 4 :class:`DenseGPTBlock`, :class:`DenseHeadLoss`), width
    and vocabulary 32, so that every named dimension splits over a tensor axis of 2.
  """
  k1, k2 = jax.random.split(jax.random.key(42))
  if name == "blocks":
    return ([tpipe.Repeat(Residual(), 15), SquaredError()],
            jax.random.normal(k1, (32, 6)), jax.random.normal(k2, (32, 2)), True)
  if name == "mlp":
    layers = [DenseAct(16), tpipe.Repeat(Residual(), 3), DenseAct(12), DenseAct(6),
              SquaredError()]
    return (layers, jax.random.normal(k1, (batch, 5)), jax.random.normal(k2, (batch, 3)),
            True)
  if name == "gpt":
    layers = [DenseEmbed(GPT_VOCAB, 32), tpipe.Repeat(DenseGPTBlock(), 4),
              DenseHeadLoss(GPT_VOCAB)]
    return (layers, jax.random.randint(k1, (batch, seq), 0, GPT_VOCAB),
            jax.random.randint(k2, (batch, seq), 0, GPT_VOCAB), False)
  if name == "annotated":
    layers = [AnnotatedEmbed(width), tpipe.Repeat(AnnotatedBlock(), 4), HeadLoss()]
    return (layers, jax.random.randint(k1, (batch, seq), 0, VOCAB),
            jax.random.randint(k2, (batch, seq), 0, VOCAB), False)
  assert name == "lm", name
  layers = [Embed(width), tpipe.Repeat(Block(), 3), HeadLoss()]
  return (layers, jax.random.randint(k1, (batch, seq), 0, VOCAB),
          jax.random.randint(k2, (batch, seq), 0, VOCAB), False)


def losses_in_order(layers, params, x, targets, microbatches):
  """The plain model: every layer in order on ``microbatches`` contiguous micro-batches; the
  last layer's per-example outputs (the losses), ``[batch]``."""

  def run(xt):
    h, t = xt
    for i, layer in enumerate(layers):
      p = params[f"layers_{i}"]
      if isinstance(layer, tpipe.Repeat):
        for j in range(layer.n):
          h = layer.module.apply({"params": jax.tree.map(lambda a, j=j: a[j], p)}, h)
      elif i == len(layers) - 1:
        h = layer.apply({"params": p}, h, t)
      else:
        h = layer.apply({"params": p}, h)
    return h

  split = lambda a: a.reshape(microbatches, -1, *a.shape[1:])
  return jax.lax.map(run, (split(x), split(targets))).reshape(-1)


def objective(loss):
  """A nonlinear function of the loss, so the cotangent reaching the fused run is not 1."""
  return loss + 0.5 * loss ** 2


def value_and_grad(loss_fn, float_input):
  """``loss_fn(params, x, targets)``'s objective and its gradients by params, and with float
  inputs also by ``x`` and the per-example targets."""
  return jax.value_and_grad(lambda p, x, t: objective(loss_fn(p, x, t)),
                            argnums=(0, 1, 2) if float_input else 0)


def pipelined_loss(model):
  """``(params, x, targets) -> mean loss`` of a ``tpipe.Sequential`` (``method="loss"``)."""
  return lambda p, x, t: model.apply({"params": p}, x, targets=t, method="loss")


@functools.cache
def random_params(name):
  """Logical params of loss model ``name``, every element its own random value: shapes from an
  abstract init, values from NumPy (an eager init would run op by op)."""
  layers, x, targets, _ = loss_model(name)
  model = tpipe.Sequential(layers, num_stages=1, num_microbatches=1, per_example=("targets",))
  shapes = nn.meta.unbox(jax.eval_shape(functools.partial(model.init, method="initialize"),
                                        {"params": jax.random.key(0)}, x, targets=targets))
  rng = np.random.default_rng(7)
  return jax.tree.map(lambda a: jnp.asarray(0.3 * rng.standard_normal(a.shape), a.dtype),
                      shapes["params"])


@functools.cache
def reference(name):
  """The float64 plain model's (objective, gradients)."""
  layers, x, targets, float_input = loss_model(name)
  loss = lambda p, x, t: jnp.mean(losses_in_order(layers, p, x, t, 1))
  return numerics.float64_reference(jax.jit(value_and_grad(loss, float_input)),
                                    random_params(name), x, targets)


@functools.cache
def plain(name, microbatches):
  """The float32 plain model's (objective, gradients) on the pipeline's micro-batches."""
  layers, x, targets, float_input = loss_model(name)
  loss = lambda p, x, t: jnp.mean(losses_in_order(layers, p, x, t, microbatches))
  return jax.jit(value_and_grad(loss, float_input))(random_params(name), x, targets)


@functools.cache
def plain_losses(name, microbatches):
  """The float32 plain model's per-example losses on the pipeline's micro-batches."""
  layers, x, targets, _ = loss_model(name)
  run = lambda p, x, t: losses_in_order(layers, p, x, t, microbatches)
  return jax.jit(run)(random_params(name), x, targets)


@functools.cache
def reference_losses(name):
  """The float64 plain model's per-example losses."""
  layers, x, targets, _ = loss_model(name)
  run = lambda p, x, t: losses_in_order(layers, p, x, t, 1)
  return numerics.float64_reference(jax.jit(run), random_params(name), x, targets)


# Chunks per stage the tests give schedules that hold more than one (circular, interleaved 1F1B
# and ZB-V run two).
TWO_CHUNKS = ("circular", "interleaved_1f1b", "zbv")


def emulated_mesh(stages, slices=1):
  """A mesh of the 8 devices, ``stages`` x data ``8 // stages``; over two emulated slices of 4
  devices (the stage axis across them) when ``slices == 2``."""
  devices = jax.devices()[:8]
  if slices == 1:
    return tpipe.make_mesh(stages=stages, data=8 // stages)
  return tpipe.make_mesh(stages=stages, data=8 // stages, dcn={"stage": 2},
                         slices=[devices[:4], devices[4:]])


def loss_sequential(name, schedule, mesh, microbatches, remat="full", **settings):
  """Loss model ``name``'s layers in a ``tpipe.Sequential`` on ``mesh`` (its stages), with
  ``targets`` per example, two chunks per stage for :data:`TWO_CHUNKS`, and ``settings``."""
  layers, _, _, _ = loss_model(name)
  return tpipe.Sequential(layers, num_stages=dict(mesh.shape)["stage"],
                          num_microbatches=microbatches, schedule=schedule,
                          num_repeats=2 if schedule in TWO_CHUNKS else 1, remat=remat,
                          per_example=("targets",), mesh=mesh, **settings)


def assert_loss_equals_sequential(model, name, microbatches):
  """Runs ``model``'s mean loss (``method="loss"``) and its gradients on loss model ``name``'s
  batch, placed as :func:`tpipe.data_sharding` says on ``model.spec.mesh``, and asserts them as
  close to the sequential model's as the plain float32 model is on the same ``microbatches``
  (micro-batches of the whole batch, over every replica)."""
  _, x, targets, float_input = loss_model(name)
  x, targets = jax.device_put((x, targets), tpipe.data_sharding(model.spec.mesh))
  value, grads = jax.jit(value_and_grad(pipelined_loss(model), float_input))(
      random_params(name), x, targets)
  plain_value, plain_grads = plain(name, microbatches)
  ref_value, ref_grads = reference(name)
  numerics.assert_as_close_as_plain(value, plain_value, ref_value, what="loss")
  numerics.assert_as_close_as_plain(grads, plain_grads, ref_grads, what="gradients")
