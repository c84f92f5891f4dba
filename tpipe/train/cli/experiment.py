"""An experiment built from a config: mesh, model, optimizer, jitted train and eval steps.

The config's fields are checked and translated into the spec, model and optimizer by
:mod:`tpipe.train.cli.translate`; this module builds them on a mesh and runs them.

The trainer (``tpipe.train``) and the analysis tools share this module, so what they analyse is
exactly what trains. Nothing here allocates the model until :meth:`Experiment.init_state` is
called: :meth:`Experiment.abstract_state` and :meth:`Experiment.abstract_batch` describe shapes,
dtypes and shardings only, which is enough to compile the real step ahead of time::

  exp = experiment.build(config)
  compiled = exp.train_step.lower(
      exp.abstract_state(), exp.abstract_batch(), jax.random.key(0)).compile()
  print(compiled.memory_analysis())

A batch is the task's dict of global arrays (the LM's ``{"inputs", "targets"}`` of byte values),
sharded over the mesh's ``data`` axis.

The model's engine pipeline (:class:`tpipe.PlannedPipeline`, from the task's
``tpipe.Sequential`` or ``tpipe.nnx.Sequential``) is planned once, so its split into stages
(``config.balance``, by default by FLOPs) is fixed for the run. The train state keeps the
parameters, the optimizer's moments and BatchNorm's statistics in the **stage layout** (split over
``stage``), so the step re-lays out nothing; checkpoints hold the **logical** layout
(``layers_i``, a repeated layer's copies stacked), so a run resumes on another mesh or split
(:meth:`Experiment.to_checkpoint`, :meth:`Experiment.from_checkpoint`). The training loss and the
evaluation are the same calls under every schedule.

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
from tpipe import staging
from tpipe.train import architecture
from tpipe.train import compact_moments
from tpipe.train.cli import startup
from tpipe.train.cli import tasks as tasks_lib
from tpipe.train.cli import translate


def _map_param_trees(fn, tree, treedef):
  """Applies ``fn`` to every subtree of ``tree`` with structure ``treedef`` (the parameters and
  the optimizer's parameter-shaped moments)."""
  matches = lambda t: jax.tree.structure(t) == treedef
  return jax.tree.map(lambda t: fn(t) if matches(t) else t, tree, is_leaf=matches)


def _map_param_trees_together(fn, tree, treedef):
  """Like :func:`_map_param_trees`, with ``fn`` taking and returning the list of all of those
  subtrees at once (converted in one program, one leaf at a time)."""
  matches = lambda t: jax.tree.structure(t) == treedef
  parts, outer = jax.tree.flatten(tree, is_leaf=matches)
  chosen = [i for i, t in enumerate(parts) if matches(t)]
  converted = fn([parts[i] for i in chosen])
  for i, new in zip(chosen, converted):
    parts[i] = new
  return jax.tree.unflatten(outer, parts)


@dataclasses.dataclass
class Experiment:
  """Everything needed to train or analyse one configuration.

  Attributes:
    config: the config it was built from.
    task: what is trained (:mod:`tpipe.train.cli.tasks`).
    mesh: the device mesh, axes ``('data', 'fsdp', 'stage', 'expert', 'tensor')``.
    model: the task's front-end model (``tpipe.Sequential`` or ``tpipe.nnx.Sequential``).
    pipeline: the model's engine pipeline with its split fixed, for training batches.
    optimizer: the optax transformation (on staged parameters).
    train_step: jitted ``step(state, batch, rng) -> (state, {"loss", "grad_norm"})`` from
      :func:`tpipe.make_train_step`; donates ``state``'s optimizer state, not its parameters.
    eval_step: jitted ``eval_step(state, batch) -> {"loss", "correct", "count"}``: sums over
      the batch's real examples (dropout off, BatchNorm's running statistics); ``correct`` is
      absent for tasks without accuracy.
    loss_fn: the training loss (dropout on, BatchNorm in training mode), as
      :func:`tpipe.make_train_step` takes it.
    loss_terms_step: where the model's layers sow auxiliary losses or metrics (a mixture of
      experts' router), jitted ``loss_terms_step(state, batch, rng) -> {"loss", "aux_loss/...",
      "aux_metric/..."}``: the training loss's terms apart on a batch, a forward pass
      (:meth:`tpipe.PlannedPipeline.loss_terms`); else None.
  """

  config: ml_collections.ConfigDict
  task: Any
  mesh: Any
  model: Any
  pipeline: tpipe.PlannedPipeline
  optimizer: optax.GradientTransformation
  train_step: Callable = None
  eval_step: Callable = None
  loss_fn: Callable = None
  loss_terms_step: Callable = None

  @property
  def layout(self) -> staging.StageLayout:
    """Where the parameters live in the stage layout."""
    return self.pipeline.layout

  @functools.cached_property
  def compact_leaves(self) -> dict[str, compact_moments.CompactLeaf]:
    """The shared leaves whose optimizer moments keep their real entries only
    (:mod:`tpipe.train.compact_moments`)."""
    return translate.compact_leaves_for(self.config, self.layout, self.mesh)

  @property
  def stats_layout(self) -> staging.StageLayout | None:
    """Where BatchNorm's statistics live (None without any)."""
    return self.pipeline.stats_layout

  # --------------------------------------------------------------------------------------------
  # The train state, in the stage layout.

  def _init_fn(self, rng: jax.Array):
    batch = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                         self.task.batch_shapes(self.config))
    x, kwargs = self.task.model_inputs(batch)
    variables = self.task.init_variables(self.config, self.model, rng, x, kwargs)
    params = staging.to_staged(self.layout, variables["params"])
    model_state = None
    if self.stats_layout is not None:
      model_state = staging.to_staged(self.stats_layout, variables["batch_stats"])
    return tpipe.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                            opt_state=self.optimizer.init(params), model_state=model_state)

  def _placed(self, shapes, specs):
    return jax.tree.map(lambda s, spec: jax.ShapeDtypeStruct(
        s.shape, s.dtype, sharding=NamedSharding(self.mesh, spec)), shapes, specs)

  @functools.cached_property
  def _abstract_state(self):
    shapes = jax.eval_shape(self._init_fn, jax.random.key(0))
    staged_def = jax.tree.structure(shapes.params)
    # Over stages; inside a stage over fsdp and tensor as the layers' annotations say.
    param_specs = self.layout.partition_specs(mesh=self.mesh)
    # Parameters, the optimizer leaves shaped like them (moments) and BatchNorm statistics split
    # over stages on their stage axis; scalars (the step, Adam's count) replicated.
    unplaced = lambda tree: jax.tree.map(
        lambda a: P() if isinstance(a, jax.ShapeDtypeStruct) else a, tree)
    moment_specs = compact_moments.partition_specs(param_specs, self.compact_leaves)
    specs_of = lambda t: (moment_specs if compact_moments.is_compact(t, self.compact_leaves)
                          else param_specs)
    specs = shapes.replace(
        step=P(), params=param_specs,
        opt_state=unplaced(_map_param_trees(specs_of, shapes.opt_state, staged_def)),
        model_state=(self.stats_layout.partition_specs() if self.stats_layout else None))
    return self._placed(shapes, specs)

  def state_shardings(self):
    """The TrainState's ``NamedSharding`` tree: staged leaves over 'stage' (and inside a stage
    over 'fsdp' and 'tensor'), the rest replicated."""
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
  # Checkpoints, in the logical layout, split over the whole mesh.

  def _collections(self):
    """``(layout, staged specs)`` of the parameters and of BatchNorm's statistics (or None)."""
    specs = staging.staged_specs_of(self._abstract_state)
    stats = None
    if self.stats_layout is not None:
      stats = (self.stats_layout, specs.model_state)
    return (self.layout, specs.params), stats

  def _to_logical(self, state):
    (layout, specs), stats = self._collections()
    staged_def = jax.tree.structure(self._abstract_state.params)
    leaves = self.compact_leaves
    is_compact = lambda t: compact_moments.is_compact(t, leaves)

    def convert(trees):
      # The compact moments' weights straight from their entries (tpipe.train.compact_moments);
      # the staged form handed to the conversion holds zeros there.
      logical = staging.to_checkpoint(
          layout, [compact_moments.staged_zeros(t, leaves) if is_compact(t) else t
                   for t in trees], specs, self.mesh)
      return [compact_moments.to_logical(out, t, leaves) if is_compact(t) else out
              for out, t in zip(logical, trees)]

    model_state = None
    if stats is not None:
      model_state = staging.to_checkpoint(*stats[:1], state.model_state, stats[1], self.mesh)
      model_state = {k: v for k, v in model_state.items() if jax.tree.leaves(v)}  # As Flax.
    return _map_param_trees_together(convert, state.replace(model_state=None),
                                     staged_def).replace(model_state=model_state)

  def _to_staged(self, state):
    (layout, specs), stats = self._collections()
    logical_def = jax.tree.structure(layout.logical)
    convert = lambda trees: staging.from_checkpoint(
        layout, [jax.tree.map(lambda a, s: a.astype(s.dtype), t, layout.logical) for t in trees],
        specs, self.mesh)
    model_state = None
    if stats is not None:
      # Flax leaves out the layers without statistics; the conversion takes every layer.
      missing = [k for k, v in stats[0].logical.items()
                 if jax.tree.leaves(v) and k not in state.model_state]
      if missing:
        raise ValueError(f"the checkpoint's model_state has no statistics for {missing}, which "
                         "this model's BatchNorm layers need; was it written by another model?")
      everything = {k: state.model_state.get(k, {}) for k in stats[0].logical}
      model_state = staging.from_checkpoint(stats[0], everything, stats[1], self.mesh)
    staged = _map_param_trees_together(convert, state.replace(model_state=None), logical_def)
    # The moments the optimizer keeps compact (tpipe.train.compact_moments), as it keeps them:
    # their entries straight from the logical weights.
    leaves = self.compact_leaves
    staged_def = jax.tree.structure(self._abstract_state.params)
    opt_state = jax.tree.map(
        lambda t, logical, target: (compact_moments.from_logical(logical, t, leaves)
                                    if compact_moments.is_compact(target, leaves) else t),
        staged.opt_state, state.opt_state, self._abstract_state.opt_state,
        is_leaf=lambda t: jax.tree.structure(t) == staged_def)
    return staged.replace(opt_state=opt_state, model_state=model_state)

  @functools.cached_property
  def _abstract_checkpoint(self):
    # Every logical leaf split over the mesh (tpipe.core.layout.relayout): a device holds about its
    # own share of the state while a checkpoint is written or read, never the whole model.
    shapes = jax.eval_shape(self._to_logical, self._abstract_state)
    (layout, specs), stats = self._collections()
    logical_specs = staging.checkpoint_specs(layout, specs, self.mesh)
    logical_def = jax.tree.structure(layout.logical)
    placed = _map_param_trees(lambda _: logical_specs, shapes.replace(model_state=None),
                              logical_def)
    placed = jax.tree.map(lambda a: P() if isinstance(a, jax.ShapeDtypeStruct) else a, placed,
                          is_leaf=lambda a: isinstance(a, (P, jax.ShapeDtypeStruct)))
    model_state = None
    if stats is not None:
      stats_specs = staging.checkpoint_specs(stats[0], stats[1], self.mesh)
      model_state = {k: stats_specs[k] for k in shapes.model_state}
    return self._placed(shapes, placed.replace(model_state=model_state))

  def abstract_checkpoint(self):
    """What :meth:`to_checkpoint` returns, as sharded ``jax.ShapeDtypeStruct`` leaves."""
    return self._abstract_checkpoint

  def checkpoint_shardings(self):
    """The ``NamedSharding`` tree of :meth:`to_checkpoint`'s result."""
    return jax.tree.map(lambda s: s.sharding, self._abstract_checkpoint)

  @functools.cached_property
  def save_program(self):
    """:meth:`to_checkpoint`'s jitted conversion (``.lower(abstract_state())`` compiles it)."""
    return jax.jit(self._to_logical, out_shardings=self.checkpoint_shardings())

  @functools.cached_property
  def restore_program(self):
    """:meth:`from_checkpoint`'s jitted conversion."""
    return jax.jit(self._to_staged, in_shardings=(self.checkpoint_shardings(),),
                   out_shardings=self.state_shardings())

  def to_checkpoint(self, state):
    """The train state in the logical layout (``layers_i``, a repeated layer's copies stacked),
    which does not depend on the stages, split, schedule, repeats or mesh; exact. Each leaf is
    split over the whole mesh (:mod:`tpipe.core.layout.relayout`), so no device gathers the
    model."""
    return self.save_program(state)

  def from_checkpoint(self, logical_state):
    """The inverse of :meth:`to_checkpoint`, for this experiment's layout; exact. Takes the
    logical state as :meth:`abstract_checkpoint` places it (what ``Checkpointer.restore``
    returns for it) or as host arrays."""
    return self.restore_program(logical_state)

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


def build(config: ml_collections.ConfigDict, devices=None) -> Experiment:
  """Builds the mesh, model, optimizer and jitted steps for ``config``.

  Args:
    config: an experiment config (``configs/lm.py``, ``configs/convnet.py``); validated before
      any tracing.
    devices: the devices of the mesh; default ``jax.devices()``. Devices of a TPU topology
      description (``jax.experimental.topologies``) compile the steps for that target from any
      machine (:mod:`tpipe.train.cli.report`'s ``--topology``).

  Returns:
    An :class:`Experiment`, whose ``config`` is ``config`` with the LM's architecture filled
    in (:func:`tpipe.train.architecture.resolve`: ``init_from``'s model, the tokenizer's
    vocabulary).
  """
  if tasks_lib.get_task(config).name == "lm":
    config = architecture.resolve(config)
  translate.validate_config(config, devices)
  task = tasks_lib.get_task(config)
  devices = jax.devices() if devices is None else devices
  try:
    mesh = tpipe.make_mesh(stages=config.num_stages, data=config.num_data,
                           **startup.mesh_sizes(config), devices=devices,
                           dcn=startup.mesh_dcn(config),
                           slices=startup.slice_groups(config, devices))
  except ValueError as error:
    if "slice" not in str(error):
      raise
    raise ValueError(f"{error} In a config: set config.mesh.dcn to the slices each axis spans; "
                     "to try a multislice layout on this machine's devices, "
                     "config.mesh.emulate_slices=True.") from None
  x, kwargs = task.model_inputs(task.batch_shapes(config))
  model = translate.make_model(config, mesh)
  pipeline = model.pipeline_for(x, rng_names=("dropout",), **kwargs)
  exp = Experiment(config=config, task=task, mesh=mesh, model=model, pipeline=pipeline,
                   optimizer=translate.make_optimizer(
                       config, pipeline.layout,
                       translate.compact_leaves_for(config, pipeline.layout, mesh)))

  def loss_fn(params, batch, rng, model_state=None):
    x, kwargs = task.model_inputs(batch)
    kwargs = {**kwargs, **task.train_keywords}
    if model_state is None:
      return pipeline.loss(params, x, kwargs, rngs={"dropout": rng})
    loss, new = pipeline.loss(params, x, kwargs, stats=model_state, rngs={"dropout": rng})
    return loss, model_state if new is None else new

  # Accuracy needs the logits: the model without the labels (the same split and layout).
  logits = pipeline.rebuild(x) if task.measures_accuracy else None
  # Evaluation reports the task's loss without the auxiliary losses layers sow: a pipeline that
  # returns them apart.
  evaluated = pipeline.rebuild(x, kwargs, terms=True) if pipeline.aux_names else pipeline

  @jax.jit
  def eval_step(state, batch):
    x, kwargs = task.model_inputs(batch)
    rows = jax.tree.leaves(batch)[0].shape[0]
    # Padded evaluation batches mark their real examples; a batch without a mask is all real.
    mask = batch["mask"].astype(jnp.float32) if "mask" in batch else jnp.ones(rows, jnp.float32)
    run = lambda p, x, kw: p.apply(state.params, x, kw, stats=state.model_state)
    losses = run(evaluated, x, kwargs)
    losses = losses[0] if state.model_state is not None else losses
    losses = losses[0] if evaluated.terms else losses
    out = {"loss": (losses * mask).sum(), "count": mask.sum()}
    if logits is not None:
      result = run(logits, x, {})
      result = result[0] if state.model_state is not None else result
      out["correct"] = (task.correct(result, batch) * mask).sum()
    return out

  @jax.jit
  def loss_terms_step(state, batch, rng):
    x, kwargs = task.model_inputs(batch)
    kwargs = {**kwargs, **task.train_keywords}
    return pipeline.loss_terms(state.params, x, kwargs, stats=state.model_state,
                               rngs={"dropout": rng})

  exp.loss_fn, exp.eval_step = loss_fn, eval_step
  exp.loss_terms_step = loss_terms_step if pipeline.aux_names else None
  exp.train_step = tpipe.make_train_step(loss_fn, exp.optimizer,
                                         shardings=exp.state_shardings())
  return exp
