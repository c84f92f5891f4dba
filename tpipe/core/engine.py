"""The one pipeline engine: a layer sequence planned for one input type, and how to run it.

:func:`build` plans a sequence of :class:`~tpipe.core.base.layers.Layer` for a
:class:`~tpipe.PipelineSpec` and an input type (the type of every unit's input, the cut into
chunks, :mod:`tpipe.core.planning.plan`), and lays out its variables on the stages
(:mod:`tpipe.core.layout.description`). The :class:`PlannedPipeline` it returns runs them:

* :meth:`PlannedPipeline.apply`: the last layer's outputs for the whole batch, the same kind under
  every schedule. Forward schedules run the forward tick loop (:mod:`tpipe.core.loops.forward`) and
  differentiate through it; fused schedules run their table's forward pass
  (:func:`tpipe.core.loops.fused.forward_outputs`), which is not meant to be differentiated (their
  backward runs inside the schedule: differentiate :meth:`PlannedPipeline.loss`).
* :meth:`PlannedPipeline.loss`: the mean over the global batch of the last layer's per-example
  losses, differentiable under every schedule; with a fused schedule one differentiated call runs
  forward and backward together (:func:`tpipe.core.loops.fused.mean_loss`). So does a forward
  schedule where its backward plan says so (:attr:`PlannedPipeline.backward_plan`, under
  ``remat="full"`` with ``remat_granularity`` ``"chunk"`` or ``"nested"``): its forward ticks and
  autodiff's backward ticks run as one fused table (:func:`tpipe.schedules.whole_step`), whose
  backward sums the parameter gradients in place.

Front ends (``tpipe.Sequential``, ``tpipe.pipeline``, ``tpipe.nnx``) build one per call; the
trainer keeps one for its whole run.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tpipe import schedules
from tpipe import spec as spec_lib
from tpipe.core.base import arguments
from tpipe.core.base import layers as layers_lib
from tpipe.core.base import spmd
from tpipe.core.layout import description as layout_lib
from tpipe.core.layout import device_view
from tpipe.core.layout import pack as layout_pack
from tpipe.core.layout import staging
from tpipe.core.loops import forward
from tpipe.core.loops import fused
from tpipe.core.loops import streaming
from tpipe.core.planning import aux_losses
from tpipe.core.planning import backward_plan as backward_plan_lib
from tpipe.core.planning import plan as plan_lib
from tpipe.core.planning import remat as remat_lib
from tpipe.core.planning import statistics
from tpipe.core.programs import chunks as chunks_lib
from tpipe.core.programs import signatures as signatures_lib


@dataclasses.dataclass(frozen=True, eq=False)
class PlannedPipeline:
  """A layer sequence planned and laid out for one input type.

  Attributes:
    layers: the :class:`~tpipe.core.base.layers.Layer` sequence it runs (where layers sow auxiliary
      losses or metrics, rewritten to carry them: :func:`tpipe.core.planning.aux_losses.carry`).
    spec: the pipeline's settings.
    plan: the cut into chunks (:class:`~tpipe.core.planning.plan.Plan`).
    layout: where the parameters live (:class:`~tpipe.core.layout.description.StageLayout`).
    stats_layout: where running statistics live, or None when no layer has any.
    owner: the API the user called, for messages.
    given_layers: the layers as given (:meth:`rebuild` plans them again).
    aux_names: the names of the auxiliary losses and metrics the layers sow, sorted (``()``
      when none does).
    terms: the last layer returns its per-example losses and the auxiliary sums apart (what
      :meth:`loss_terms` runs), not their sum.
  """

  layers: tuple[layers_lib.Layer, ...]
  spec: spec_lib.PipelineSpec
  plan: plan_lib.Plan
  layout: layout_lib.StageLayout
  stats_layout: layout_lib.StageLayout | None
  owner: str
  given_layers: tuple[layers_lib.Layer, ...] = ()
  aux_names: tuple[str, ...] = ()
  terms: bool = False

  @property
  def backward_plan(self) -> backward_plan_lib.BackwardPlan:
    """How the loss's backward actions run (:func:`tpipe.core.planning.backward_plan.resolve`)."""
    return backward_plan_lib.resolve(self.spec, has_stats=self.stats_layout is not None,
                                     owner=self.owner)

  @property
  def loss_table(self):
    """The table :meth:`loss` runs (what a training step runs): a fused schedule's own; a
    forward schedule's forward ticks and autodiff's backward ticks as one fused table
    (:func:`tpipe.schedules.whole_step`) where the backward plan says so; else the forward
    schedule, differentiated through its tick loop."""
    table = self.spec.table
    if self.backward_plan.fused_loss_table:
      return schedules.whole_step(table)
    return table

  @property
  def output(self):
    """The abstract output of the last layer on one micro-batch (planning's micro-batch)."""
    return self.plan.layer_inputs[-1]

  def stage(self, params, stats=None):
    """Logical variables (``{"layers_i": tree}``) to the staged ones :meth:`apply` and
    :meth:`loss` run on: ``(params, stats)``, each None where given None. Every front end stages
    through here (:meth:`~tpipe.core.layout.description.StageLayout.to_staged`)."""
    staged = None if params is None else staging.to_staged(self.layout, params)
    if stats is None:
      return staged, None
    if self.stats_layout is None:
      raise ValueError(f"{self.owner}: no layer has running statistics, but some were passed.")
    needed = sorted(k for k, v in self.stats_layout.logical.items() if jax.tree.leaves(v))
    missing = sorted(set(needed) - set(stats))
    if missing:
      raise ValueError(f"{self.owner}: layers {missing} have BatchNorm statistics but the "
                       "variables hold no 'batch_stats' for them; pass the 'batch_stats' that "
                       "init returned.")
    return staged, staging.to_staged(self.stats_layout, stats)

  def _axes(self, mesh) -> spmd.Axes:
    mesh = self.spec.run_mesh(self.owner) if mesh is None else mesh
    return spmd.Axes.of(mesh, self.spec.stage_axis, self.spec.data_axis)

  def describe_inputs(self, global_batch: int, mesh=None) -> str:
    """How a training step's table (:attr:`loss_table`) gets a batch of ``global_batch``
    examples: streamed one micro-batch per tick, or gathered onto every stage once per step, and
    why (:func:`tpipe.core.loops.streaming.describe`)."""
    return streaming.describe(self.loss_table, self._axes(mesh), global_batch,
                              self.spec.stream_inputs, self.backward_plan.w_recomputes)

  def _call(self, x, kwargs, axes: spmd.Axes):
    """Checks a call's input and keywords; returns the keywords split by kind."""
    kwargs = dict(kwargs or {})
    layers_lib.check_keywords(self.layers, kwargs, self.owner)
    batch = layers_lib.batch_size(x, self.owner)
    parts = self.spec.num_microbatches * axes.row_shards
    if batch % parts:
      raise ValueError(
          f"{self.owner}: batch size {batch} is not divisible by num_microbatches * row shards "
          f"(data x fsdp devices) = {self.spec.num_microbatches} * {axes.row_shards} = {parts}; "
          f"use a batch that is a multiple of {parts} or change num_microbatches.")
    return arguments.split_keywords(kwargs, per_example=self.spec.per_example,
                                    batch_size=batch, owner=self.owner)

  def apply(self, params, x, kwargs: dict | None = None, *, stats=None, rngs=None, mesh=None):
    """The last layer's outputs for the whole batch (the layers applied in order).

    Args:
      params: the staged parameters (:meth:`~tpipe.core.layout.description.StageLayout.to_staged`).
      x: the input, a pytree of arrays with the batch as leading axis.
      kwargs: keyword arguments; those named in ``spec.per_example`` are split into
        micro-batches with ``x``, other arrays are broadcast, the rest passed as they are.
      stats: the staged running statistics (with ``stats_layout`` only).
      rngs: ``{stream: key}``, one key per random stream for the whole call.
      mesh: the mesh to run on; default the spec's (:meth:`~tpipe.PipelineSpec.run_mesh`).

    Returns:
      The outputs; with ``stats``, ``(outputs, new_stats)``: the running statistics updated once
      from the statistics pooled over the step (:mod:`tpipe.core.planning.statistics`), staged, or
      None when no normalization ran in training mode (nothing to update).
    """
    axes = self._axes(mesh)
    split = self._call(x, kwargs, axes)
    chunkset = self._chunkset(split, stats, axes)
    staged = self._staged(params, stats)
    rngs = dict(rngs or {})
    if self.spec.is_fused:
      run = lambda staged, x, broadcast, per_example, rngs: fused.forward_outputs(
          chunkset, staged, x, broadcast, per_example, rngs, schedule=self.spec.table,
          axes=axes)
      return _not_differentiable(run, self._differentiated_message())(
          staged, x, split.broadcast, split.per_example, rngs)
    result = forward.run(chunkset, staged, x, split.broadcast, split.per_example, rngs,
                         schedule=self.spec.table, axes=axes)
    if stats is None:
      return result
    outputs, sums = result
    momenta = self._momenta(x, split, rngs)
    if not momenta:
      return outputs, None
    count = self.spec.num_microbatches * axes.row_shards
    layout = self.stats_layout
    pooled = staging.to_logical(layout, jax.tree.map(lambda a: a / count, sums))
    new = statistics.update(staging.to_logical(layout, stats), pooled, momenta)
    return outputs, staging.to_staged(layout, new)

  def loss(self, params, x, kwargs: dict | None = None, *, stats=None, rngs=None, mesh=None):
    """The mean over the global batch of the last layer's per-example losses.

    Differentiable under every schedule: a forward schedule differentiates through its tick
    loop; a fused schedule's backward runs inside the schedule (one differentiated call runs
    forward and backward together), as does a forward schedule's under ``remat="full"`` with
    ``"chunk"`` or ``"nested"`` granularity (its table as :func:`tpipe.schedules.whole_step`
    writes it).
    Arguments as for :meth:`apply`; the last layer must return one float loss per example
    (``[batch]``).

    Returns:
      The scalar loss; with ``stats`` (forward schedules only), ``(loss, new_stats)`` as
      :meth:`apply` returns them.
    """
    self._check_losses()
    # A forward schedule's ticks, then autodiff's backward ticks, as one fused table where its
    # backward runs one unit at a time with the gradients summed in place (autodiff through the
    # tick loop would first build each tick's whole parameter gradient).
    table = self.loss_table
    if not isinstance(table, schedules.FusedSchedule):
      result = self.apply(params, x, kwargs, stats=stats, rngs=rngs, mesh=mesh)
      if stats is None:
        return jnp.mean(result)
      return jnp.mean(result[0]), result[1]
    axes = self._axes(mesh)
    split = self._call(x, kwargs, axes)
    chunkset = self._chunkset(split, stats, axes)
    return fused.mean_loss(chunkset, self._staged(params, None), x, split.broadcast,
                           split.per_example, dict(rngs or {}), schedule=table, axes=axes,
                           plan=self.backward_plan)

  def loss_terms(self, params, x, kwargs: dict | None = None, *, stats=None, rngs=None,
                 mesh=None) -> dict[str, jax.Array]:
    """The loss's terms over the global batch, for reporting (not differentiable under fused
    schedules): ``{"loss": mean of the last layer's per-example losses}`` and, per auxiliary
    loss or metric the layers sow, ``{"aux_loss/<path>" or "aux_metric/<path>": its mean over
    micro-batches}`` (values of one name summed over the layers that sow it). :meth:`loss` is
    ``"loss"`` plus every ``aux_loss/...``. A forward pass; arguments as for :meth:`apply`
    (with ``stats``, the running statistics are not updated).
    """
    self._check_losses()
    terms = self
    if self.aux_names and not self.terms:
      terms = self.rebuild(x, kwargs, tuple(rngs or {}), terms=True)
    out = terms.apply(params, x, kwargs, stats=stats, rngs=rngs, mesh=mesh)
    if stats is not None:
      out = out[0]
    if not terms.aux_names:
      return {"loss": jnp.mean(jnp.asarray(out, jnp.float32))}
    return aux_losses.means(terms.aux_names, *out)

  def _momenta(self, x, split, rngs) -> dict:
    """``{(layer index, path): momentum}`` of the normalizations this call runs in training mode
    (its keywords decide): the layers traced abstractly on one micro-batch like it
    (:func:`tpipe.core.planning.plan.trace_inputs`)."""
    batch = layers_lib.batch_size(x, self.owner)
    x_micro, side = micro_inputs(x, split, batch, self.spec)
    calls = plan_lib.Calls(split, side, tuple(rngs), self.owner,
                           (self.spec.data_axis, self.spec.stage_axis))
    return plan_lib.trace_inputs(self.layers, self.layout.logical, self.stats_layout.logical,
                                 x_micro, calls).momenta

  def _chunkset(self, split, stats, axes: spmd.Axes) -> chunks_lib.ChunkSet:
    if (stats is None) != (self.stats_layout is None):
      if stats is None:
        raise ValueError(f"{self.owner}: layers have running statistics (BatchNorm's "
                         "batch_stats); pass them.")
      raise ValueError(f"{self.owner}: no layer has running statistics, but some were passed.")
    # Statistics under a fused schedule: no table runs them (raises).
    backward_plan_lib.resolve(self.spec, has_stats=stats is not None, owner=self.owner)
    return chunks_lib.ChunkSet(self.layers, self.plan, self.layout, self.stats_layout,
                               self.spec, split, axes)

  def _staged(self, params, stats):
    self.layout.check_staged(params, what=f"{self.owner}'s staged parameters")
    staged = {device_view.PARAMS: params}
    if stats is not None:
      self.stats_layout.check_staged(stats, what=f"{self.owner}'s staged statistics")
      staged[device_view.STATS] = stats
    return staged

  def _check_losses(self) -> None:
    if self.terms:
      raise ValueError(f"{self.owner}: this pipeline returns the loss's terms apart "
                       "(loss_terms); differentiate the pipeline built without terms.")
    if not layers_lib.is_per_example_loss(self.output):
      raise ValueError(
          f"{self.owner}: the loss is the mean of the last layer's per-example losses, so the "
          "last layer must return one float array [batch]; it returns "
          f"{layers_lib.types(self.output)} per micro-batch. End the layers with one that "
          "computes each example's loss (targets passed with per_example=('targets',)).")

  def _differentiated_message(self) -> str:
    return (f"{self.owner} with schedule={self.spec.schedule!r}: the outputs are the schedule's "
            "forward pass, whose backward runs inside the schedule; differentiate the loss "
            "instead (the model's loss method, e.g. model.apply(..., method='loss') in linen, "
            "model.loss(...) in NNX), or use schedule='gpipe'/'circular' to differentiate the "
            "outputs.")

  def rebuild(self, x, kwargs: dict | None = None, rng_names: Sequence[str] = (), *,
              terms: bool = False) -> "PlannedPipeline":
    """The same layers and split, planned for calls like ``x`` and ``kwargs`` (other keywords,
    another batch): the parameters' layout is the same. ``terms``: the pipeline
    :meth:`loss_terms` runs."""
    spec = self.spec.replace(balance=list(self.plan.counts))
    stats = self.stats_layout.logical if self.stats_layout is not None else {}
    return build(self.given_layers or self.layers, spec, param_shapes=self.layout.logical,
                 stats_shapes=stats, x=x, kwargs=kwargs, rng_names=rng_names, owner=self.owner,
                 param_axes=self.layout.axes, terms=terms)

  # ------------------------------------------------------------------------------------------
  # For analysis.

  def costs(self, kind: str, x, kwargs: dict | None = None,
            rng_names: Sequence[str] = ()) -> tuple[float, ...]:
    """Every unit's cost under ``kind`` (``"params"``, ``"flops"``, ``"time"``) on one
    micro-batch of inputs like ``x`` (``batch / M`` rows), whatever split this pipeline uses."""
    spec = self.spec.replace(balance=kind)
    stats = self.stats_layout.logical if self.stats_layout is not None else {}
    return build(self.layers, spec, param_shapes=self.layout.logical, stats_shapes=stats, x=x,
                 kwargs=kwargs, rng_names=rng_names, owner=self.owner).plan.costs

  def chunk_program(self, chunk: int, x, kwargs: dict | None = None,
                    rng_names: Sequence[str] = ()):
    """Model chunk ``chunk`` alone, on one micro-batch of inputs like ``x``, to analyse it.

    Args:
      chunk: the model chunk.
      x: an input like :meth:`apply`'s (arrays or ``jax.ShapeDtypeStruct``); a micro-batch is
        ``batch / M`` of its rows.
      kwargs: keyword arguments as for :meth:`apply`.
      rng_names: random streams the layers draw; they get a fixed key.

    Returns:
      ``(fn, args)``: ``fn(*args)`` applies the chunk's layers in order, as a tick does but
      without the checkpoint around the whole chunk (finer remat pieces are checkpointed as in
      a tick); ``args`` are abstract: the chunk's variables (one tree per segment), its input on
      one micro-batch, and the side inputs.
    """
    batch = layers_lib.batch_size(x, self.owner)
    split = arguments.split_keywords(dict(kwargs or {}), per_example=self.spec.per_example,
                                     batch_size=batch, owner=self.owner)
    _, side = micro_inputs(x, split, batch, self.spec)
    local = self.layout.chunk_shapes(chunk)
    trees = jax.eval_shape(lambda local: layout_pack.chunk_trees(self.layout, local, chunk), local)
    rngs = {name: jax.random.key(0) for name in rng_names}
    segments = self.layout.segments[chunk]
    h = self.plan.chunk_input(chunk)

    def fn(trees, h, side):
      runs = []
      for seg, tree in zip(segments, trees):
        layer = self.layers[seg.layer]

        def step(h, params, layer=layer):
          kwargs = layers_lib.layer_keywords(layer, split, *side)
          return layer.apply(params, {}, h, kwargs, rngs)[0], None

        runs.append((step, tree, seg.copies))
      return remat_lib.apply_units(h, runs, self.spec.remat, self.spec.remat_granularity,
                                   self.spec.unroll)[0]

    return fn, (trees, h, side)

  def programs(self) -> list[int]:
    """Per model chunk, which of the distinct chunk programs (``lax.switch`` branches) runs it
    (see :mod:`tpipe.core.programs.chunks`)."""
    return signatures_lib.signatures(self.plan, self.layout, self.stats_layout)[1]

  def describe(self) -> str:
    """The split (each chunk's units, cost and share:
    :meth:`tpipe.core.planning.plan.Plan.describe`)
    and the backward plan (:meth:`tpipe.core.planning.backward_plan.BackwardPlan.describe`)."""
    return f"{self.plan.describe()}\n{self.backward_plan.describe()}"


def _not_differentiable(fn, message: str):
  """``fn`` that raises ``ValueError(message)`` when differentiated (before anything runs)."""

  @jax.custom_vjp
  def run(*args):
    return fn(*args)

  def forward_rule(*args):
    del args
    raise ValueError(message)

  def backward_rule(residuals, cotangent):
    del residuals, cotangent
    raise ValueError(message)

  run.defvjp(forward_rule, backward_rule)
  return run


def micro_inputs(x, split, batch: int, spec: spec_lib.PipelineSpec):
  """Abstract ``(x, (broadcast, per_example))`` of one planning micro-batch:
  ``spec.microbatch_size(batch)`` rows (one replica's micro-batch when ``x`` is one replica's
  batch)."""
  rows = spec.microbatch_size(batch)
  row = lambda a: jax.ShapeDtypeStruct((rows,) + tuple(np.shape(a)[1:]), a.dtype)
  side = (layers_lib.abstract(split.broadcast), tuple(row(a) for a in split.per_example))
  return jax.tree.map(row, x), side


def build(layers: Sequence[layers_lib.Layer], spec: spec_lib.PipelineSpec, *, param_shapes,
          stats_shapes, x, kwargs: dict | None = None, rng_names: Sequence[str] = (),
          owner: str = "tpipe", param_axes=None,
          terms: bool = False) -> PlannedPipeline:  # Keyword-only, each named.
  """Plans and lays out ``layers`` for ``spec`` and inputs like ``x`` (before any tracing of the
  pipeline: every check raises here).

  Args:
    layers: the sequence.
    spec: the pipeline's settings.
    param_shapes: ``{"layers_i": tree}``, the logical parameters (arrays or abstract), a
      repeated layer's stacked on a leading copy axis.
    stats_shapes: the same for running statistics (``{}`` or empty trees without).
    x: an input (arrays or ``jax.ShapeDtypeStruct``), batch first.
    kwargs: keyword arguments as the call will get them (arrays or abstract).
    rng_names: the random streams the call will pass.
    owner: the API the user called, for messages.
    param_axes: the parameters' logical axis names, as
      :attr:`tpipe.core.layout.description.StageLayout.axes` holds them (from the layers'
      annotations).
    terms: where layers sow auxiliary losses or metrics, the last layer returns its own losses
      and the auxiliary sums apart (what :meth:`PlannedPipeline.loss_terms` runs).

  Returns:
    The :class:`PlannedPipeline`.
  """
  layers = tuple(layers)
  kwargs = dict(kwargs or {})
  layers_lib.check_keywords(layers, kwargs, owner)
  batch = layers_lib.batch_size(x, owner)
  split = arguments.split_keywords(kwargs, per_example=spec.per_example, batch_size=batch,
                                   owner=owner)
  x_micro, side = micro_inputs(x, split, batch, spec)
  stats_shapes = {f"layers_{i}": stats_shapes.get(f"layers_{i}", {}) for i in range(len(layers))}
  calls = plan_lib.Calls(split, side, tuple(rng_names), owner,
                         (spec.data_axis, spec.stage_axis))
  traced = plan_lib.trace_inputs(layers, param_shapes, stats_shapes, x_micro, calls)
  given, aux_names = layers, aux_losses.carried(traced.aux_names, traced.layer_inputs[-1])
  if aux_names:  # Layers sow auxiliary values: they travel to the loss with the activations.
    with_stats = frozenset(i for i in range(len(layers))
                           if jax.tree.leaves(stats_shapes[f"layers_{i}"]))
    layers = aux_losses.carry(layers, traced.adding, traced.aux_names, owner, with_stats,
                              terms=terms)
    traced = plan_lib.trace_inputs(layers, param_shapes, stats_shapes, x_micro, calls)
  plan = plan_lib.make_plan(layers, spec, param_shapes, stats_shapes, traced, calls)
  if plan.tick_costs is not None:  # A fused table in compound ticks for the measured costs.
    spec = spec.replace(tick_costs=plan.tick_costs)
  # Packed buffers cut into one block per device of the fsdp axis of the mesh the spec names.
  layout = layout_lib.StageLayout.build(plan.groups, param_shapes, spec.num_stages,
                                        spec.num_repeats, spec.placement, axes=param_axes,
                                        mesh=spec.mesh)
  stats_layout = None
  if jax.tree.leaves(stats_shapes):
    stats_layout = layout_lib.StageLayout.build(plan.groups, stats_shapes, spec.num_stages,
                                                spec.num_repeats, spec.placement,
                                                stacked=layout.stacked, packing="slot")
  return PlannedPipeline(layers=layers, spec=spec, plan=plan, layout=layout,
                         stats_layout=stats_layout, owner=owner, given_layers=given,
                         aux_names=aux_names, terms=terms and bool(aux_names))
