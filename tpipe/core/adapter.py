"""The front-end adapter: one call of a front end's layers built, staged, run, statistics back.

Every front end (``tpipe.Sequential``, ``tpipe.pipeline``, ``tpipe.nnx``) runs a call the same
way, here: it plans the pipeline for the call's input (:func:`build`, over
:func:`tpipe.core.engine.build`), stages the variables
(:meth:`tpipe.core.engine.PlannedPipeline.stage`; a collection already staged, :class:`Staged`,
passes as it is), runs ``apply`` or ``loss``, and hands back the running statistics a training
step updated, in the form they came in (:meth:`Result.stats`). A front end turns its modules into
layers (:class:`~tpipe.core.base.layers.Layer`) and its variables into logical trees, and writes
the statistics back where it keeps them. :func:`check_structure` is what every front end checks of
its layers and settings when it is constructed.

Example::

  model = adapter.Model(layers, spec, owner="my front end", param_axes=axes)
  result = adapter.call(model, adapter.Variables(params, stats), x, kwargs, rngs=rngs)
  outputs, new_stats = result.value, result.stats()   # new_stats: None when nothing changed
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from tpipe import spec as spec_lib
from tpipe.core import engine
from tpipe.core.base import layers as layers_lib
from tpipe.core.layout import staging


@dataclasses.dataclass(frozen=True)
class Staged:
  """A collection already in the pipeline's stage layout: ``tree`` is what
  :meth:`tpipe.core.layout.description.StageLayout.to_staged` returns. A training state kept
  staged moves
  nothing between stages in a step; it needs the split it was made with."""

  tree: Any


@dataclasses.dataclass(frozen=True)
class Variables:
  """A call's variables, each collection logical (``{"layers_i": tree}``, a repeated layer's
  copies stacked on a leading axis) or :class:`Staged`.

  Attributes:
    params: the parameters.
    stats: the running statistics (BatchNorm's), or None (or empty trees) without.
  """

  params: Any
  stats: Any = None


@dataclasses.dataclass(frozen=True)
class Model:
  """A front end's layers, as the adapter builds pipelines of them.

  Attributes:
    layers: the :class:`~tpipe.core.base.layers.Layer` sequence.
    spec: the pipeline's settings.
    owner: the API the user called, for messages.
    param_axes: the parameters' logical axis names per layer
      (:attr:`tpipe.core.layout.description.StageLayout.axes`), or None.
    param_shapes: the abstract logical parameters, for a call whose parameters are
      :class:`Staged` (logical parameters give their own shapes).
    stats_shapes: the abstract logical statistics (``{}`` without); logical statistics a call
      gives replace the layers' they name (their dtypes decide the plan's).
  """

  layers: tuple[layers_lib.Layer, ...]
  spec: spec_lib.PipelineSpec
  owner: str
  param_axes: Mapping[str, Any] | None = None
  param_shapes: Mapping[str, Any] | None = None
  stats_shapes: Mapping[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class Result:
  """What a call returns.

  Attributes:
    value: the outputs (``apply``) or the mean loss (``loss``).
    new_stats: the updated running statistics, staged, or None when no normalization ran in
      training mode (or there are none).
    stats_layout: their layout.
    staged_form: whether the call's statistics were :class:`Staged`.
  """

  value: Any
  new_stats: Any = None
  stats_layout: Any = None
  staged_form: bool = False

  def stats(self):
    """The updated statistics in the form the call gave them (logical ``{"layers_i": tree}``
    or :class:`Staged`), or None when there is nothing to write back."""
    if self.new_stats is None:
      return None
    if self.staged_form:
      return Staged(self.new_stats)
    return staging.to_logical(self.stats_layout, self.new_stats)


def check_structure(layers: Sequence[layers_lib.Layer], spec: spec_lib.PipelineSpec,
                    owner: str) -> None:
  """What can be checked of a layer sequence and its spec before any call: enough units for the
  chunks, explicit counts that add up, and per-example names some layer takes."""
  num_units = sum(layer.units for layer in layers)
  if num_units < spec.num_chunks:
    raise ValueError(
        f"{owner} has {num_units} layer units but num_stages * num_repeats = "
        f"{spec.num_chunks} chunks need at least one each; use fewer stages or repeats, or "
        "more layers.")
  if not isinstance(spec.balance, str) and sum(spec.balance) != num_units:
    raise ValueError(
        f"{owner}: balance={list(spec.balance)} sums to {sum(spec.balance)} layer units but the "
        f"model has {num_units}; change the counts so they add up to {num_units}.")
  layers_lib.check_keywords(layers, spec.per_example, owner, what="per_example name")


def _plan_shapes(model: Model, variables: Variables | None):
  """The abstract logical ``(params, stats)`` to plan with."""
  params = model.param_shapes
  stats = dict(model.stats_shapes or {})
  if variables is not None and not isinstance(variables.params, Staged):
    params = layers_lib.abstract(variables.params)
  if variables is not None and variables.stats and not isinstance(variables.stats, Staged):
    for name, tree in variables.stats.items():
      stats[name] = layers_lib.abstract(tree)
  if params is None:
    raise ValueError(f"{model.owner}: staged parameters need the model's logical parameter "
                     "shapes to plan with (adapter.Model.param_shapes).")
  return params, stats


def build(model: Model, x, kwargs: dict | None = None, rng_names: Sequence[str] = (),
          variables: Variables | None = None) -> engine.PlannedPipeline:
  """The pipeline of ``model``'s layers for calls like ``x`` and ``kwargs`` (see
  :func:`tpipe.core.engine.build`), planned with ``variables``' shapes where they are logical,
  else with the model's."""
  params, stats = _plan_shapes(model, variables)
  return engine.build(model.layers, model.spec, param_shapes=params, stats_shapes=stats, x=x,
                      kwargs=dict(kwargs or {}), rng_names=tuple(rng_names), owner=model.owner,
                      param_axes=model.param_axes)


def _staged(pipeline: engine.PlannedPipeline, variables: Variables):
  """``variables`` staged: ``(params, stats)``, stats None where the layers have none."""
  params, stats = variables.params, variables.stats
  if pipeline.stats_layout is None and not isinstance(stats, Staged):
    stats = None  # Empty trees, or none given: the layers have no statistics.
  logical_params = None if isinstance(params, Staged) else params
  logical_stats = None if isinstance(stats, Staged) or stats is None else stats
  new_params, new_stats = pipeline.stage(logical_params, logical_stats)
  if isinstance(params, Staged):
    new_params = params.tree
  if isinstance(stats, Staged):
    new_stats = stats.tree
  return new_params, new_stats


def call(model: Model, variables: Variables, x, kwargs: dict | None = None, *,
         loss: bool = False, terms: bool = False, rngs: Mapping[str, Any] | None = None,
         mesh=None) -> Result:
  """Builds the pipeline for ``x``, stages ``variables``, and runs it.

  Args:
    model: the layers and settings.
    variables: the parameters and statistics, each logical or :class:`Staged`.
    x: the input, batch first.
    kwargs: the keyword arguments (see :meth:`tpipe.core.engine.PlannedPipeline.apply`).
    loss: run :meth:`~tpipe.core.engine.PlannedPipeline.loss` (the mean of the last layer's
      per-example losses), else :meth:`~tpipe.core.engine.PlannedPipeline.apply`.
    terms: run :meth:`~tpipe.core.engine.PlannedPipeline.loss_terms` instead (the loss's terms
      apart; running statistics are not updated).
    rngs: ``{stream: key}`` for the call.
    mesh: the mesh to run on; default the spec's.

  Returns:
    The :class:`Result`: the value, and the statistics a training step updated.
  """
  rngs = dict(rngs or {})
  pipeline = build(model, x, kwargs, tuple(rngs), variables)
  params, stats = _staged(pipeline, variables)
  if terms:
    return Result(pipeline.loss_terms(params, x, kwargs, stats=stats, rngs=rngs, mesh=mesh))
  run = pipeline.loss if loss else pipeline.apply
  result = run(params, x, kwargs, stats=stats, rngs=rngs, mesh=mesh)
  if stats is None:
    return Result(result)
  value, new = result
  return Result(value, new_stats=new, stats_layout=pipeline.stats_layout,
                staged_form=isinstance(variables.stats, Staged))
