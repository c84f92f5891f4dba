"""A config translated: its checks, and the pipeline spec, model and optimizer it describes.

:func:`validate_config` checks every field the experiment reads and names the fix;
:func:`spec_from_config` gives the pipeline settings, :func:`make_model` the task's pipelined
model and :func:`make_optimizer` AdamW on staged parameters (weight decay on matrices and
embeddings only, compact moments where ``config.compact_moments`` says). The experiment
(:mod:`tpipe.train.cli.experiment`) builds and runs what these describe.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

import tpipe
from tpipe import spec as spec_lib
from tpipe import staging
from tpipe.experimental import search
from tpipe.train import architecture
from tpipe.train import compact_moments
from tpipe.train import tied
from tpipe.train.cli import startup
from tpipe.train.cli import tasks as tasks_lib

# The fields every task's config has (each task adds its own: tasks_lib.*.fields).
_REQUIRED_FIELDS = (
    "num_stages", "num_data", "num_microbatches", "schedule", "num_repeats", "remat", "seed",
    "batch_size", "learning_rate", "num_steps", "warmup_steps", "weight_decay", "grad_clip",
    "dtype", "balance")

# config.dtype values: the computation dtype. Parameters and optimizer state stay float32.
DTYPES = ("float32", "bfloat16")


def spec_from_config(config: ml_collections.ConfigDict, mesh=None) -> tpipe.PipelineSpec:
  """The pipeline settings ``config`` gives (errors name the config). ``config.tick_search``
  (research) > 0: the spec :func:`tpipe.experimental.search.with_search` returns."""
  spec = spec_lib.make(
      "config", num_stages=config.num_stages, num_microbatches=config.num_microbatches,
      schedule=config.schedule, num_repeats=config.num_repeats,
      balance=parse_balance(config.balance), remat=config.remat,
      remat_granularity=tasks_lib.remat_granularity(config), mesh=mesh,
      transfer_delay=startup.parse_transfer_delay(config.get("transfer_delay", "auto")),
      stream_inputs=config.get("stream_inputs", True),
      tick_costs=startup.parse_tick_costs(config.get("tick_costs", "")),
      weight_recompute=config.get("weight_recompute", False),
      overlap_microbatches=config.get("overlap_microbatches", False))
  sweeps = config.get("tick_search", 0)
  if isinstance(sweeps, bool) or sweeps != 0:
    try:
      spec = search.with_search(spec, sweeps)
    except (TypeError, ValueError) as error:
      raise type(error)(f"config: {error}") from None
  return spec


def validate_config(config: ml_collections.ConfigDict, devices=None) -> None:
  """Checks the fields this module reads; raises ValueError/TypeError naming the fix.

  Args:
    config: the experiment config (see ``configs/lm.py``).
    devices: the devices the mesh will use; default ``jax.devices()``.
  """
  task = tasks_lib.get_task(config)
  missing = [k for k in _REQUIRED_FIELDS + task.fields if k not in config]
  if missing:
    raise ValueError(f"config is missing field(s) {missing}; see configs/lm.py or "
                     "configs/convnet.py for defaults.")
  for name in ("num_stages", "num_data", "num_microbatches", "num_repeats", "batch_size",
               "num_steps"):
    value = config[name]
    if isinstance(value, bool) or not isinstance(value, int):
      raise TypeError(f"config.{name} must be an int, got {value!r}.")
    if value < 1:
      raise ValueError(f"config.{name} must be >= 1, got {value}.")
  sizes = startup.mesh_sizes(config)
  fsdp = sizes["fsdp"]
  shards = config.num_data * fsdp  # A batch's rows split over data and fsdp.
  if config.batch_size % shards:
    raise ValueError(
        f"config.batch_size={config.batch_size} must be divisible by config.num_data * "
        f"config.mesh.fsdp = {config.num_data} * {fsdp} (the batch's rows are split over the "
        "'data' and 'fsdp' axes).")
  experts = architecture.value(config, "num_experts")
  moe_block = architecture.value(config, "block") == "moe"
  if moe_block and isinstance(experts, int) and experts % sizes["expert"]:
    raise ValueError(
        f"config.num_experts={experts} must be divisible by config.mesh.expert="
        f"{sizes['expert']} (each device of the expert axis holds an equal share of the "
        "experts); change one of them.")
  if sizes["expert"] > 1 and not moe_block:
    raise ValueError(
        f"config.mesh.expert={sizes['expert']} splits a mixture's experts, but "
        f"config.block={architecture.value(config, 'block')!r} has none; use block='moe' or "
        "mesh.expert=1.")
  per_shard = config.batch_size // shards
  if per_shard % config.num_microbatches:
    raise ValueError(
        f"the per-shard batch {per_shard} (batch_size {config.batch_size} / (num_data * "
        f"mesh.fsdp = {shards})) must be divisible by config.num_microbatches="
        f"{config.num_microbatches}; change batch_size or num_microbatches.")
  if not isinstance(config.dtype, str) or config.dtype not in DTYPES:
    raise ValueError(
        f"config.dtype must be one of {DTYPES} (the computation dtype; parameters and optimizer "
        f"state stay float32), got {config.dtype!r}.")
  tasks_lib.remat_granularity(config)  # Optional field ("chunk" when absent); raises if bad.
  compact_moments.check_setting(config.get("compact_moments", "auto"))
  spec = spec_from_config(config)
  task.validate(config)
  if spec.is_fused and task.no_fused_schedules:
    raise ValueError(
        f"config.schedule={config.schedule!r} is a fused schedule, which cannot train "
        f"config.task={task.name!r}: {task.no_fused_schedules}. Use config.schedule='gpipe' "
        "(or 'circular' with config.num_repeats > 1).")
  if config.learning_rate <= 0:
    raise ValueError(f"config.learning_rate must be > 0, got {config.learning_rate}.")
  needed = startup.num_devices(config)
  available = jax.device_count() if devices is None else len(devices)
  if needed > available:
    where = "JAX sees only" if devices is None else "the devices given are"
    raise ValueError(
        "config.num_stages * config.num_data * config.mesh.fsdp * config.mesh.expert * "
        f"config.mesh.tensor = {config.num_stages} * {config.num_data} * {fsdp} * "
        f"{sizes['expert']} * {sizes['tensor']} = {needed} devices, but "
        f"{where} {available}. Shrink the mesh, or on CPU set JAX_NUM_CPU_DEVICES={needed} "
        "(tpipe.train does this by default).")


def parse_balance(balance) -> Any:
  """``config.balance``: ``"params"``, ``"flops"``, ``"time"``, or unit counts per chunk as
  ``"3,4,4,3"``."""
  if not isinstance(balance, str):
    raise TypeError(f"config.balance must be a string, got {balance!r}; write 'flops', 'params', "
                    "'time' or unit counts per chunk such as '3,4,4,3'.")
  if balance in spec_lib.BALANCE_NAMES:
    return balance
  try:
    return [int(part) for part in balance.split(",")]
  except ValueError:
    raise ValueError(f"config.balance={balance!r} is neither one of {spec_lib.BALANCE_NAMES} "
                     "nor comma-separated unit counts such as '3,4,4,3'.") from None


def make_model(config: ml_collections.ConfigDict, mesh):
  """The task's pipelined model for ``config`` over ``mesh`` (split not yet fixed)."""
  return tasks_lib.get_task(config).make_model(config, spec_from_config(config, mesh))


# The parameters weight decay applies to, by name: Flax's matrices and embedding tables, and the
# projection matrices LlamaBlock names after their role (not norms' scales, biases or position
# tables).
DECAYED_NAMES = ("kernel", "embedding", "query", "key", "value", "out", "gate", "up", "down")


def _decayed(path) -> bool:
  """Weight decay applies to matrices and embeddings only (:data:`DECAYED_NAMES`)."""
  return getattr(path[-1], "key", None) in DECAYED_NAMES


def staged_weight_decay(weight_decay: float,
                        layout: staging.StageLayout) -> optax.GradientTransformation:
  """``optax.add_decayed_weights`` for staged parameters, decaying matrices and embeddings only
  (:data:`DECAYED_NAMES`).

  Per-leaf parameters decay by their names, as optax's mask would; in the packed buffers the
  decayed elements are ranges the layout knows
  (:meth:`~tpipe.core.layout.description.StageLayout.packed_mask`),
  so the mask is computed in the update, never stored; a shared leaf's entries decay by the
  names of the weights they hold (:meth:`~tpipe.core.layout.description.StageLayout.shared_mask`).
  """
  masks = staging.packed_mask(layout, _decayed)
  shared_masks = staging.shared_mask(layout, _decayed)

  def init(params):
    del params
    return optax.EmptyState()

  def update(updates, state, params):
    decay = lambda u, p, m: u + weight_decay * jnp.where(m, p, 0).astype(u.dtype)
    stacked = jax.tree_util.tree_map_with_path(
        lambda path, u, p: decay(u, p, _decayed(path)), updates[staging.STACKED],
        params[staging.STACKED])
    packed = {k: decay(u, params[staging.PACKED][k], masks[k](u.shape))
              for k, u in updates[staging.PACKED].items()}
    shared = {k: decay(u, params[staging.SHARED][k], shared_masks[k])
              for k, u in updates[staging.SHARED].items()}
    return {staging.STACKED: stacked, staging.PACKED: packed,
            staging.SHARED: shared}, state

  return optax.GradientTransformation(init, update)


def make_optimizer(config: ml_collections.ConfigDict, layout: staging.StageLayout,
                   compact_leaves=None) -> optax.GradientTransformation:
  """AdamW with linear warm-up then cosine decay, after global-norm clipping, on staged params.

  Weight decay applies to matrices and embeddings only (leaves named as :data:`DECAYED_NAMES`
  says: ``kernel``, ``embedding`` and LlamaBlock's projections).
  With ``config.tie_embeddings`` the embedding's and the head's gradients are summed and
  counted once by the clipping (:mod:`tpipe.train.tied`).
  Padding in the staged buffers has zero gradients, so it stays zero and changes no norm.
  Adam's moments of the shared leaves in ``compact_leaves``
  (:func:`tpipe.train.compact_moments.plan`) keep their real entries only.
  """
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=config.learning_rate,
      warmup_steps=min(config.warmup_steps, config.num_steps),
      decay_steps=max(config.num_steps, config.warmup_steps + 1),
      end_value=config.learning_rate * 0.1)
  clip = optax.clip_by_global_norm(config.grad_clip)
  if config.get("tie_embeddings", False):  # Two copies of one matrix (tpipe.train.tied).
    clip = tied.tied_clip_by_global_norm(config.grad_clip, layout)
  return optax.chain(
      clip,
      compact_moments.without_padding(optax.scale_by_adam(b1=0.9, b2=0.95),
                                      compact_leaves or {}),
      staged_weight_decay(config.weight_decay, layout),
      optax.scale_by_learning_rate(schedule))


def compact_leaves_for(config: ml_collections.ConfigDict, layout: staging.StageLayout,
                       mesh) -> dict[str, compact_moments.CompactLeaf]:
  """The shared leaves whose Adam moments keep their real entries only, as
  ``config.compact_moments`` says (:func:`tpipe.train.compact_moments.chosen_plan`: by default
  all that qualify, none where the stage axis spans slices)."""
  return compact_moments.chosen_plan(config.get("compact_moments", "auto"), layout, mesh)
