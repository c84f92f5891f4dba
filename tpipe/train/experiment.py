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

The model is a :class:`tpipe.Sequential` (embedding, blocks, head and loss; see
:func:`tpipe.train.models.decoder_lm`) whose split into stages is fixed when the experiment is
built (``config.balance``, by default by FLOPs). The train state keeps the parameters and the
optimizer's moments in the **stage layout** (``{"staged": {dtype: [R, S, n]}}``, split over
``stage``), so the step re-lays out nothing; checkpoints hold the **logical** layout
(``layers_i``, blocks stacked), so a run resumes on another mesh or split
(:meth:`Experiment.to_checkpoint`, :meth:`Experiment.from_checkpoint`).

``config.dtype`` is the computation dtype (``"float32"`` or ``"bfloat16"``). Parameters, their
gradients and the optimizer state are float32 either way; with ``"bfloat16"`` the model computes
in bfloat16 (and the activations cross stage boundaries in it), and the logits and the loss are
float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpipe
from tpipe import schedules as schedules_lib
from tpipe.core import packing
from tpipe.core import stage_layout as stage_layout_lib
from tpipe.linen import sequential
from tpipe.train import tasks as tasks_lib

# The fields every task's config has (each task adds its own: tasks_lib.*.fields).
_REQUIRED_FIELDS = (
    "num_stages", "num_data", "num_microbatches", "schedule", "num_repeats", "remat", "seed",
    "batch_size", "learning_rate", "num_steps", "warmup_steps", "weight_decay", "grad_clip",
    "dtype", "balance")

# config.dtype values: the computation dtype. Parameters and optimizer state stay float32.
DTYPES = ("float32", "bfloat16")


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Checks the fields this module reads; raises ValueError/TypeError naming the fix.

  Args:
    config: the experiment config (see ``configs/lm.py``).
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
  parse_balance(config.balance)
  tasks_lib.remat_granularity(config)  # Optional field ("chunk" when absent); raises if bad.
  task.validate(config)
  if config.schedule in schedules_lib.FUSED_SCHEDULE_NAMES and task.no_fused_schedules:
    raise ValueError(
        f"config.schedule={config.schedule!r} is a fused schedule, which cannot train "
        f"config.task={task.name!r}: {task.no_fused_schedules}. Use config.schedule='gpipe' "
        "(or 'circular' with config.num_repeats > 1).")
  if config.learning_rate <= 0:
    raise ValueError(f"config.learning_rate must be > 0, got {config.learning_rate}.")
  needed = config.num_stages * config.num_data
  available = jax.device_count()
  if needed > available:
    raise ValueError(
        f"config.num_stages * config.num_data = {config.num_stages} * {config.num_data} = "
        f"{needed} devices, but JAX sees only {available}. Shrink the mesh, or on CPU set "
        f"JAX_NUM_CPU_DEVICES={needed} (tpipe.train does this by default).")


def parse_balance(balance) -> Any:
  """``config.balance``: ``"params"``, ``"flops"``, ``"time"``, or unit counts per chunk as
  ``"3,4,4,3"``."""
  if not isinstance(balance, str):
    raise TypeError(f"config.balance must be a string, got {balance!r}; write 'flops', 'params', "
                    "'time' or unit counts per chunk such as '3,4,4,3'.")
  if balance in sequential.BALANCE_NAMES:
    return balance
  try:
    return [int(part) for part in balance.split(",")]
  except ValueError:
    raise ValueError(f"config.balance={balance!r} is neither one of {sequential.BALANCE_NAMES} "
                     "nor comma-separated unit counts such as '3,4,4,3'.") from None


def make_model(config: ml_collections.ConfigDict, mesh) -> tpipe.Sequential:
  """Returns the task's pipelined model for ``config`` over ``mesh`` (split not yet fixed)."""
  return tasks_lib.get_task(config).make_model(config, mesh, parse_balance(config.balance))


def forward_equivalent(model: tpipe.Sequential) -> tpipe.Sequential | None:
  """For a fused schedule, the same stack under a forward schedule that reads the same staged
  parameters (None when there is none); ``model`` itself otherwise.

  Both executors read chunk ``c``'s parameters from ``staged[c // S][c % S]`` of one
  :class:`~tpipe.core.stage_layout.StageLayout`, which depends on the split (fixed by
  :meth:`~tpipe.Sequential.with_split`), S and R, not on the schedule. So a fused schedule whose
  table places chunks as the forward executor does (``"loop"``: model chunk ``c * S + s`` on stage
  ``s``, as in 1F1B, ZB-H1 and interleaved 1F1B) runs the same model as ``"gpipe"`` (R = 1) or
  ``"circular"`` (R > 1) on the same staged parameters; the forward schedule returns per-example
  outputs, which evaluation needs (sums over real examples, logits). A table placed otherwise
  (ZB-V's ``"v"``) gets None.
  """
  if not model.is_fused():
    return model
  table = model.schedule_table()
  loop = schedules_lib.virtual_stages("loop", model.num_stages, table.num_chunks)
  if table.num_chunks != model.num_repeats or not np.array_equal(table.virtual_stage, loop):
    return None
  return model.clone(schedule="gpipe" if model.num_repeats == 1 else "circular")


def _decayed(path) -> bool:
  """Weight decay applies to matrices and embeddings only."""
  return getattr(path[-1], "key", None) in ("kernel", "embedding")


class DecayMaskState(NamedTuple):
  """Which elements of the staged parameters weight decay applies to."""
  mask: Any


def staged_weight_decay(weight_decay: float,
                        layout: stage_layout_lib.StageLayout) -> optax.GradientTransformation:
  """``optax.add_decayed_weights`` for staged parameters, decaying kernels and embeddings only.

  A staged buffer mixes kernels with biases and norm scales, so optax's per-leaf mask cannot
  say which elements decay; the per-element mask is made from the layout at ``init`` and kept in
  the state (one bool per parameter, split over stages like them).
  """
  flags = jax.tree_util.tree_map_with_path(lambda path, _: _decayed(path), layout.logical)

  def init(params):
    del params
    ones = jax.tree.map(lambda s, f: jnp.full(s.shape, f, s.dtype), layout.logical, flags)
    return DecayMaskState(mask={sequential.STAGED: jax.tree.map(
        lambda a: a.astype(jnp.bool_), layout.to_staged(ones))})

  def update(updates, state, params):
    updates = jax.tree.map(lambda u, p, m: u + weight_decay * jnp.where(m, p, 0).astype(u.dtype),
                           updates, params, state.mask)
    return updates, state

  return optax.GradientTransformation(init, update)


def make_optimizer(config: ml_collections.ConfigDict,
                   layout: stage_layout_lib.StageLayout) -> optax.GradientTransformation:
  """AdamW with linear warm-up then cosine decay, after global-norm clipping, on staged params.

  Weight decay applies to matrices and embeddings only (leaves named ``kernel``/``embedding``).
  Padding in the staged buffers has zero gradients, so it stays zero and changes no norm.
  """
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=config.learning_rate,
      warmup_steps=min(config.warmup_steps, config.num_steps),
      decay_steps=max(config.num_steps, config.warmup_steps + 1),
      end_value=config.learning_rate * 0.1)
  return optax.chain(
      optax.clip_by_global_norm(config.grad_clip),
      optax.scale_by_adam(b1=0.9, b2=0.95),
      staged_weight_decay(config.weight_decay, layout),
      optax.scale_by_learning_rate(schedule))


def _map_param_trees(fn, tree, treedef):
  """Applies ``fn`` to every subtree of ``tree`` with structure ``treedef`` (the parameters and
  the optimizer's parameter-shaped moments and masks)."""
  matches = lambda t: jax.tree.structure(t) == treedef
  return jax.tree.map(lambda t: fn(t) if matches(t) else t, tree, is_leaf=matches)


@dataclasses.dataclass
class Experiment:
  """Everything needed to train or analyse one configuration.

  Attributes:
    config: the config it was built from.
    task: what is trained (:mod:`tpipe.train.tasks`).
    mesh: the device mesh, axes ``('data', 'stage')``.
    model: the pipelined model, a :class:`tpipe.Sequential` with its split fixed.
    layout: where its parameters live in the stage layout.
    stats_layout: where its BatchNorm statistics live in the stage layout (None without any).
    optimizer: the optax transformation (on staged parameters).
    train_step: jitted ``step(state, batch, rng) -> (state, {"loss", "grad_norm"})`` from
      :func:`tpipe.make_train_step`; donates ``state``.
    eval_step: jitted ``eval_step(state, batch) -> {"loss", "correct", "count"}``: sums over
      the batch's real examples (dropout off, BatchNorm's running statistics); ``correct`` is
      absent for tasks without accuracy.
    loss_fn: the training loss (dropout on, BatchNorm in training mode), as
      :func:`tpipe.make_train_step` takes it.
  """

  config: ml_collections.ConfigDict
  task: Any
  mesh: Any
  model: tpipe.Sequential
  layout: stage_layout_lib.StageLayout
  stats_layout: stage_layout_lib.StageLayout | None
  optimizer: optax.GradientTransformation
  train_step: Callable = None
  eval_step: Callable = None
  loss_fn: Callable = None

  # --------------------------------------------------------------------------------------------
  # The train state, in the stage layout.

  def _init_fn(self, rng: jax.Array):
    batch = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                         self.task.batch_shapes(self.config))
    x, kwargs = self.task.model_inputs(batch)
    variables = self.task.init_variables(self.config, self.model, rng, x, kwargs)
    params = {sequential.STAGED: self.layout.to_staged(variables["params"])}
    model_state = None
    if self.stats_layout is not None:
      model_state = {sequential.STAGED: self.stats_layout.to_staged(variables["batch_stats"])}
    return tpipe.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                            opt_state=self.optimizer.init(params), model_state=model_state)

  def _placed(self, shapes, specs):
    return jax.tree.map(lambda s, spec: jax.ShapeDtypeStruct(
        s.shape, s.dtype, sharding=NamedSharding(self.mesh, spec)), shapes, specs)

  @functools.cached_property
  def _abstract_state(self):
    shapes = jax.eval_shape(self._init_fn, jax.random.key(0))
    layouts = [self.layout] + ([self.stats_layout] if self.stats_layout else [])
    staged = {tuple(s.shape) for layout in layouts for s in layout.staged_shapes().values()}
    # Parameters, optimizer leaves shaped like them (moments, the decay mask) and BatchNorm
    # statistics split over stages on their stage axis; scalars (the step, Adam's count)
    # replicated.
    specs = jax.tree.map(lambda s: P(None, "stage") if tuple(s.shape) in staged else P(),
                         shapes)
    return self._placed(shapes, specs)

  def state_shardings(self):
    """The TrainState's ``NamedSharding`` tree (staged buffers over 'stage', rest replicated)."""
    return jax.tree.map(lambda s: s.sharding, self._abstract_state)

  def abstract_state(self):
    """The TrainState as ``jax.ShapeDtypeStruct`` leaves with shardings; allocates nothing."""
    return self._abstract_state

  def abstract_batch(self):
    """The global training batch as sharded ``jax.ShapeDtypeStruct`` leaves."""
    sharding = tpipe.data_sharding(self.mesh)
    return {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
            for k, s in self.task.batch_shapes(self.config).items()}

  def init_state(self, rng: jax.Array):
    """Initialises a TrainState directly in its sharded stage layout.

    Args:
      rng: a JAX PRNG key for parameter initialisation.

    Returns:
      The sharded ``tpipe.TrainState`` at step 0.
    """
    init = jax.jit(self._init_fn, out_shardings=self.state_shardings())
    return init(rng)

  def num_params(self) -> int:
    """Number of trainable parameters (without the stage layout's padding)."""
    return sum(int(x.size) for x in jax.tree.leaves(self.layout.logical))

  # --------------------------------------------------------------------------------------------
  # Checkpoints, in the logical layout.

  def _to_logical(self, state):
    staged_def = jax.tree.structure(self._abstract_state.params)

    def convert(staged):
      buffers = staged[sequential.STAGED]
      kept = {k: v.dtype for k, v in buffers.items()}
      # The decay mask is bool: moved as the parameters' dtype, exactly (0 or 1).
      logical = self.layout.to_logical({k: v.astype(k) for k, v in buffers.items()})
      return jax.tree.map(lambda a: a.astype(kept[packing.dtype_key(a.dtype)]), logical)

    model_state = state.model_state
    if model_state is not None:
      model_state = {k: v for k, v in self.stats_layout.to_logical(
          model_state[sequential.STAGED]).items() if jax.tree.leaves(v)}  # As Flax names them.
    return _map_param_trees(convert, state.replace(model_state=None), staged_def).replace(
        model_state=model_state)

  def _to_staged(self, state):
    logical_def = jax.tree.structure(self.layout.logical)

    def convert(logical):
      is_bool = all(a.dtype == jnp.bool_ for a in jax.tree.leaves(logical))
      logical = jax.tree.map(lambda a, s: a.astype(s.dtype), logical, self.layout.logical)
      staged = self.layout.to_staged(logical)
      return {sequential.STAGED: jax.tree.map(lambda a: a.astype(jnp.bool_), staged)
              if is_bool else staged}

    model_state = state.model_state
    if model_state is not None:
      model_state = {sequential.STAGED: self.stats_layout.to_staged(model_state)}
    return _map_param_trees(convert, state.replace(model_state=None), logical_def).replace(
        model_state=model_state)

  @functools.cached_property
  def _abstract_checkpoint(self):
    # Replicated: converting between a stage-split and a layer-split layout makes XLA's
    # partitioner emit a permute per slice (tens of seconds to compile at 4 stages), while from
    # replicated buffers every slice is local. The cost is the logical state on every device
    # while a checkpoint is written or read.
    shapes = jax.eval_shape(self._to_logical, self._abstract_state)
    return self._placed(shapes, jax.tree.map(lambda _: P(), shapes))

  def abstract_checkpoint(self):
    """What :meth:`to_checkpoint` returns, as sharded ``jax.ShapeDtypeStruct`` leaves."""
    return self._abstract_checkpoint

  def to_checkpoint(self, state):
    """The train state in the logical layout (``layers_i``), which does not depend on the
    stages, split, schedule or repeats; exact."""
    shardings = jax.tree.map(lambda s: s.sharding, self._abstract_checkpoint)
    replicated = jax.tree.map(lambda a: NamedSharding(self.mesh, P()), state)
    state = jax.jit(lambda s: s, out_shardings=replicated)(state)  # One all-gather per leaf.
    return jax.jit(self._to_logical, out_shardings=shardings)(state)

  def from_checkpoint(self, logical_state):
    """The inverse of :meth:`to_checkpoint`, for this experiment's layout; exact."""
    return jax.jit(self._to_staged, out_shardings=self.state_shardings())(logical_state)

  # --------------------------------------------------------------------------------------------
  # Evaluation.

  def evaluate(self, state, batches) -> dict[str, float]:
    """Mean loss (and accuracy, where the task has one) over ``batches`` (global, sharded)."""
    sums = jax.device_get([self.eval_step(state, b) for b in batches])
    count = sum(float(s["count"]) for s in sums)
    metrics = {"eval_loss": sum(float(s["loss"]) for s in sums) / count}
    if "correct" in sums[0]:
      metrics["eval_accuracy"] = sum(float(s["correct"]) for s in sums) / count
    return metrics


def build(config: ml_collections.ConfigDict) -> Experiment:
  """Builds the mesh, model, optimizer and jitted steps for ``config``.

  Args:
    config: an experiment config (``configs/lm.py``, ``configs/convnet.py``); validated before
      any tracing.

  Returns:
    An :class:`Experiment`.
  """
  validate_config(config)
  task = tasks_lib.get_task(config)
  mesh = tpipe.make_mesh(stages=config.num_stages, data=config.num_data)
  x, kwargs = task.model_inputs(task.batch_shapes(config))
  model = make_model(config, mesh)
  layout = model.stage_layout(x, **kwargs)
  model = model.with_split(layout)  # The same split for training, evaluation and analysis.
  stats_layout = model.stats_layout(x, **kwargs)
  exp = Experiment(config=config, task=task, mesh=mesh, model=model, layout=layout,
                   stats_layout=stats_layout, optimizer=make_optimizer(config, layout))

  def variables(params, model_state):
    if model_state is None:
      return {"params": params}
    return {"params": params, "batch_stats": model_state}

  if stats_layout is None:

    def loss_fn(params, batch, rng):
      x, kwargs = task.model_inputs(batch)
      losses = model.apply({"params": params}, x, **kwargs, **task.train_keywords,
                           rngs={"dropout": rng})
      # A fused schedule's stack returns the mean over the global batch already (a scalar whose
      # gradient the fused executor computes); the others return per-example losses.
      return losses if model.is_fused() else losses.mean()

  else:

    def loss_fn(params, batch, rng, model_state):
      x, kwargs = task.model_inputs(batch)
      losses, updated = model.apply(variables(params, model_state), x, **kwargs,
                                    **task.train_keywords, rngs={"dropout": rng},
                                    mutable=["batch_stats"])
      return losses.mean(), updated["batch_stats"]

  # NNX layers' dropout streams are rebuilt from a key even where dropout is off; it is unused.
  eval_rngs = {"dropout": jax.random.key(0)} if tasks_lib.frontend(config) == "nnx" else {}

  # Evaluation needs per-example losses: with a fused schedule, the same stack under the forward
  # schedule that reads the same staged parameters (see forward_equivalent).
  eval_model = forward_equivalent(model)

  @jax.jit
  def eval_step(state, batch):
    x, kwargs = task.model_inputs(batch)
    rows = jax.tree.leaves(batch)[0].shape[0]
    # Padded evaluation batches mark their real examples; a batch without a mask is all real.
    mask = batch["mask"].astype(jnp.float32) if "mask" in batch else jnp.ones(rows, jnp.float32)
    state_vars = variables(state.params, state.model_state)
    if eval_model is None:
      # A fused schedule without a forward equivalent: its own forward-only mean over the batch,
      # which is the mean over real examples only when every example is real (NaN otherwise).
      mean = model.apply(state_vars, x, **kwargs, rngs=eval_rngs)
      loss = jnp.where(jnp.all(mask == 1), mean * rows, jnp.nan)
    else:
      loss = (eval_model.apply(state_vars, x, **kwargs, rngs=eval_rngs) * mask).sum()
    out = {"loss": loss, "count": mask.sum()}
    if task.measures_accuracy:  # Logits: the stack without the labels.
      out["correct"] = (task.correct(eval_model.apply(state_vars, x, rngs=eval_rngs), batch)
                        * mask).sum()
    return out

  exp.loss_fn, exp.eval_step = loss_fn, eval_step
  exp.train_step = tpipe.make_train_step(loss_fn, exp.optimizer,
                                         shardings=exp.state_shardings())
  return exp
