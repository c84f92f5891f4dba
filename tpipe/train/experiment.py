"""An experiment built from a config: mesh, model, optimizer, jitted train and eval steps.

The trainer (``tpipe.train``) and the analysis tools share this module, so what they analyse is
exactly what trains. Nothing here allocates the model until :meth:`Experiment.init_state` is
called: :meth:`Experiment.abstract_state` and :meth:`Experiment.abstract_batch` describe shapes,
dtypes and shardings only, which is enough to compile the real step ahead of time::

  exp = experiment.build(config)
  compiled = exp.train_step.lower(
      exp.abstract_state(), exp.abstract_batch(), jax.random.key(0)).compile()
  print(compiled.memory_analysis())

A batch is a dict ``{"inputs": int32 [batch, seq], "targets": int32 [batch, seq]}`` of byte
values, the global batch, sharded over the mesh's ``data`` axis.

``config.dtype`` is the computation dtype (``"float32"`` or ``"bfloat16"``). Parameters, their
gradients and the optimizer state are float32 either way; with ``"bfloat16"`` the model computes
in bfloat16 (and the activations cross stage boundaries in it), and the logits and the loss are
float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpipe
from tpipe.train import models

# The top-level parameter collections that hold pipelined (stacked) layers.
STACKED = ("blocks",)

_REQUIRED_FIELDS = (
    "num_layers", "width", "num_heads", "mlp_dim", "seq_len", "dropout", "num_stages",
    "num_data", "num_microbatches", "schedule", "num_repeats", "remat", "seed", "batch_size",
    "learning_rate", "num_steps", "warmup_steps", "weight_decay", "grad_clip", "dtype")

# config.dtype values: the computation dtype. Parameters and optimizer state stay float32.
DTYPES = ("float32", "bfloat16")


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Checks the fields this module reads; raises ValueError/TypeError naming the fix.

  Args:
    config: the experiment config (see ``configs/lm.py``).
  """
  missing = [k for k in _REQUIRED_FIELDS if k not in config]
  if missing:
    raise ValueError(f"config is missing field(s) {missing}; see configs/lm.py for defaults.")
  for name in ("num_layers", "width", "num_heads", "mlp_dim", "seq_len", "num_stages",
               "num_data", "num_microbatches", "num_repeats", "batch_size", "num_steps"):
    value = config[name]
    if isinstance(value, bool) or not isinstance(value, int):
      raise TypeError(f"config.{name} must be an int, got {value!r}.")
    if value < 1:
      raise ValueError(f"config.{name} must be >= 1, got {value}.")
  if config.batch_size % config.num_data:
    raise ValueError(
        f"config.batch_size={config.batch_size} must be divisible by "
        f"config.num_data={config.num_data} (the batch is split over the 'data' axis).")
  per_shard = config.batch_size // config.num_data
  if per_shard % config.num_microbatches:
    raise ValueError(
        f"the per-data-shard batch {per_shard} (batch_size {config.batch_size} / num_data "
        f"{config.num_data}) must be divisible by config.num_microbatches="
        f"{config.num_microbatches}; change batch_size or num_microbatches.")
  if not isinstance(config.dtype, str) or config.dtype not in DTYPES:
    raise ValueError(
        f"config.dtype must be one of {DTYPES} (the computation dtype; parameters and optimizer "
        f"state stay float32), got {config.dtype!r}.")
  if config.learning_rate <= 0:
    raise ValueError(f"config.learning_rate must be > 0, got {config.learning_rate}.")
  needed = config.num_stages * config.num_data
  available = jax.device_count()
  if needed > available:
    raise ValueError(
        f"config.num_stages * config.num_data = {config.num_stages} * {config.num_data} = "
        f"{needed} devices, but JAX sees only {available}. Shrink the mesh, or on CPU set "
        f"JAX_NUM_CPU_DEVICES={needed} (tpipe.train does this by default).")


def make_model(config: ml_collections.ConfigDict, mesh) -> models.DecoderLM:
  """Returns the ``DecoderLM`` described by ``config``, pipelined over ``mesh``."""
  return models.DecoderLM(
      num_layers=config.num_layers,
      width=config.width,
      num_heads=config.num_heads,
      mlp_dim=config.mlp_dim,
      max_len=config.seq_len,
      dropout_rate=float(config.dropout),
      num_stages=config.num_stages,
      num_microbatches=config.num_microbatches,
      schedule=config.schedule,
      num_repeats=config.num_repeats,
      remat=config.remat,
      mesh=mesh,
      dtype=jnp.dtype(config.dtype),
      param_dtype=jnp.float32)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """AdamW with linear warm-up then cosine decay, after global-norm clipping.

  Weight decay applies to matrices and embeddings only (leaves named ``kernel``/``embedding``).
  """
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=config.learning_rate,
      warmup_steps=min(config.warmup_steps, config.num_steps),
      decay_steps=max(config.num_steps, config.warmup_steps + 1),
      end_value=config.learning_rate * 0.1)

  def decay_mask(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) in ("kernel", "embedding"), params)

  return optax.chain(
      optax.clip_by_global_norm(config.grad_clip),
      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=config.weight_decay,
                  mask=decay_mask))


def _is_stacked(path) -> bool:
  return any(getattr(k, "key", None) in STACKED for k in path)


def abstract_state_shardings(abstract_state, mesh):
  """NamedShardings for a TrainState: leaves under ``blocks`` split over 'stage' on axis 0.

  Parameters are placed by :func:`tpipe.param_shardings`. Optimizer statistics follow the same
  rule (optax keeps them in trees shaped like the parameters, under the same keys), so Adam's
  moments live on the same stage as their layers; scalars such as step counts are replicated.

  Args:
    abstract_state: a ``tpipe.TrainState`` of ``jax.ShapeDtypeStruct`` (from ``jax.eval_shape``).
    mesh: the device mesh.

  Returns:
    A ``tpipe.TrainState`` of ``NamedSharding``.
  """
  replicated = NamedSharding(mesh, P())
  stacked = NamedSharding(mesh, P("stage"))

  def one(path, leaf):
    return stacked if _is_stacked(path) and len(leaf.shape) >= 1 else replicated

  return abstract_state.replace(
      step=replicated,
      params=tpipe.param_shardings(abstract_state.params, mesh, stacked=STACKED),
      opt_state=jax.tree_util.tree_map_with_path(one, abstract_state.opt_state))


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-byte cross-entropy (nats) over every position of the global batch.

  Computed in float32 whatever the logits' dtype (the model's are float32 already).
  """
  logits = logits.astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@dataclasses.dataclass
class Experiment:
  """Everything needed to train or analyse one configuration.

  Attributes:
    config: the config it was built from.
    mesh: the device mesh, axes ``('data', 'stage')``.
    model: the ``DecoderLM``.
    optimizer: the optax transformation.
    train_step: jitted ``step(state, batch, rng) -> (state, {"loss", "grad_norm"})`` from
      :func:`tpipe.make_train_step`; donates ``state``.
    eval_step: jitted ``eval_step(params, batch) -> scalar mean loss`` (dropout off).
    loss_fn: ``loss_fn(params, batch, rng) -> scalar`` training loss (dropout on).
  """

  config: ml_collections.ConfigDict
  mesh: Any
  model: models.DecoderLM
  optimizer: optax.GradientTransformation
  train_step: Callable
  eval_step: Callable
  loss_fn: Callable

  def _init_fn(self, rng: jax.Array):
    tokens = jnp.zeros((self.config.batch_size, self.config.seq_len), jnp.int32)
    params = self.model.init({"params": rng}, tokens)["params"]
    return tpipe.TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=self.optimizer.init(params))

  @functools.cached_property
  def _abstract_state(self):
    shapes = jax.eval_shape(self._init_fn, jax.random.key(0))
    shardings = abstract_state_shardings(shapes, self.mesh)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)

  def state_shardings(self):
    """The TrainState's ``NamedSharding`` tree (stacked blocks over 'stage', rest replicated)."""
    return jax.tree.map(lambda s: s.sharding, self._abstract_state)

  def abstract_state(self):
    """The TrainState as ``jax.ShapeDtypeStruct`` leaves with shardings; allocates nothing."""
    return self._abstract_state

  def abstract_batch(self):
    """The global batch as sharded ``jax.ShapeDtypeStruct`` leaves."""
    shape = (self.config.batch_size, self.config.seq_len)
    sharding = tpipe.data_sharding(self.mesh)
    return {
        "inputs": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding),
        "targets": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding),
    }

  def init_state(self, rng: jax.Array):
    """Initialises a TrainState directly in its sharded layout (stacked blocks over 'stage').

    Args:
      rng: a JAX PRNG key for parameter initialisation.

    Returns:
      The sharded ``tpipe.TrainState`` at step 0.
    """
    init = jax.jit(self._init_fn, out_shardings=self.state_shardings())
    return init(rng)

  def num_params(self) -> int:
    """Number of trainable parameters."""
    params = self.abstract_state().params
    return sum(int(x.size) for x in jax.tree.leaves(params))


def build(config: ml_collections.ConfigDict) -> Experiment:
  """Builds the mesh, model, optimizer and jitted steps for ``config``.

  Args:
    config: an experiment config (``configs/lm.py``); validated before any tracing.

  Returns:
    An :class:`Experiment`.
  """
  validate_config(config)
  mesh = tpipe.make_mesh(stages=config.num_stages, data=config.num_data)
  model = make_model(config, mesh)
  optimizer = make_optimizer(config)

  def loss_fn(params, batch, rng):
    logits = model.apply({"params": params}, batch["inputs"], train=True,
                         rngs={"dropout": rng})
    return cross_entropy(logits, batch["targets"])

  @jax.jit
  def eval_step(params, batch):
    logits = model.apply({"params": params}, batch["inputs"], train=False)
    return cross_entropy(logits, batch["targets"])

  exp = Experiment(config=config, mesh=mesh, model=model, optimizer=optimizer,
                   train_step=None, eval_step=eval_step, loss_fn=loss_fn)
  exp.train_step = tpipe.make_train_step(loss_fn, optimizer, shardings=exp.state_shardings())
  return exp
