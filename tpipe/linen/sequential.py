"""``tpipe.Sequential``: any sequence of Flax linen layers, pipelined, as a linen module.

GPipe pipelines "any network that can be expressed as a sequence of layers": layers may change
the activation's shape, dtype and pytree structure (an embedding turns token ids into vectors, a
convolutional cell halves the resolution, a head turns features into per-example losses). This
module is the linen shell over the engine (:mod:`tpipe.core.engine`): it holds the layers and a
:class:`tpipe.PipelineSpec`, initialises the layers' variables in the logical layout
(``{"layers_0": ..., "layers_1": ...}``, ``nn.Sequential``'s names; a :class:`Repeat`'s stacked
on a leading axis), and at each call plans, lays out and runs them.

Example::

  layers = [Embed(vocab, width), tpipe.Repeat(Block(width), 24), HeadLoss(vocab)]
  model = tpipe.Sequential(layers, num_stages=4, num_microbatches=16, balance="flops",
                           per_example=("targets",), mesh=tpipe.make_mesh(stages=4, data=2))
  variables = model.init({"params": key}, tokens, targets=targets)
  losses = model.apply(variables, tokens, targets=targets)               # [batch]
  loss = model.apply(variables, tokens, targets=targets, method="loss")  # their mean
  # With schedule="1f1b": the loss's gradient runs inside the schedule, memory bounded in S.
  grads = jax.grad(lambda p: model.clone(schedule="1f1b").apply(
      {"params": p}, tokens, targets=targets, method="loss"))(variables["params"])
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import flax.linen as nn
import jax

from tpipe import schedules
from tpipe import spec as spec_lib
from tpipe.core import adapter
from tpipe.core import engine
from tpipe.core.base import arguments
from tpipe.core.base import layers as layers_lib
from tpipe.core.layout import description as layout_lib
from tpipe.core.planning import plan as plan_lib
from tpipe.linen import layers as linen_layers

OWNER = "tpipe.Sequential"
# The key of staged variables: {"params": {"staged": tree}} (see stage_layout()).
STAGED = "staged"
STATS = linen_layers.STATS


@dataclasses.dataclass(frozen=True, eq=False)
class Repeat:
  """``n`` copies of ``module`` in a row, each with its own parameters.

  The copies' parameters are stacked on a leading axis of length ``n`` (``nn.scan``'s layout),
  and a stage applies its share of them with one ``lax.scan``, so compile time does not grow with
  ``n``. ``module`` must map its input to an output of the same structure, shapes and dtypes.
  A ``Repeat`` counts as ``n`` layer units for balancing and may be cut between stages.
  """

  module: nn.Module
  n: int

  def __post_init__(self):
    if not isinstance(self.module, nn.Module):
      raise TypeError(f"tpipe.Repeat takes a flax.linen.Module instance, got {self.module!r}; "
                      "write tpipe.Repeat(Block(width=...), n).")
    schedules.forward.check_count("Repeat n", self.n)


@dataclasses.dataclass(frozen=True, eq=False)
class _Held:
  """Holds a layer template out of Flax's sight, so it is not adopted as a bound submodule."""

  layer: Any


def _module_of(layer) -> nn.Module:
  return layer.module if isinstance(layer, Repeat) else layer


def _copies(layer) -> int | None:
  return layer.n if isinstance(layer, Repeat) else None


class _SequentialFields(nn.Module):
  """:class:`Sequential`'s fields (Flax makes its dataclass constructor from them)."""

  layers: Sequence[Any]
  spec: spec_lib.PipelineSpec = None


class Sequential(_SequentialFields):
  """Applies ``layers`` in order, pipelined over the ``stage`` axis of a device mesh.

  Construct it with a :class:`tpipe.PipelineSpec` (``Sequential(layers, spec)``) or with the
  spec's settings as keywords (``Sequential(layers, num_stages=4, num_microbatches=8,
  schedule="gpipe", balance="flops", per_example=("targets",), mesh=mesh)``); ``clone`` takes
  settings too (``model.clone(schedule="zb_h1")``).

  Calling it returns the last layer's outputs for the whole batch, under every schedule;
  ``apply(..., method="loss")`` returns the mean of the last layer's per-example losses over the
  global batch, differentiable under every schedule (with a fused schedule its backward runs
  inside the schedule, one call for forward and backward, memory bounded in S; differentiating
  the outputs of a fused schedule raises and names this fix).

  Attributes:
    layers: unbound ``flax.linen.Module`` instances and :class:`Repeat` entries, in order. Each
      maps the previous layer's output (any pytree of arrays with the batch as leading axis) to
      its own; the first gets ``x``.
    spec: the pipeline settings (:class:`tpipe.PipelineSpec`).

  Parameters are ``{"layers_i": ...}``, a Repeat's stacked; they do not depend on the spec. A
  training state can live in the engine's stage layout instead (:meth:`stage_layout`,
  ``{"params": {"staged": tpipe.staging.to_staged(layout, params)}}`` with :meth:`with_split`),
  so a step moves no parameter between stages.

  RNG: see :mod:`tpipe.core.base.layers` (one key per stream per call, ``K = self.make_rng(name)``;
  unit ``u`` on global micro-batch ``m`` gets ``fold_in(fold_in(K, u), m)``). Layer ``i`` is
  initialised from ``fold_in(self.make_rng("params"), i)`` (a Repeat: each copy from its own
  split of it).

  BatchNorm: call with ``train=True`` (or however the layers take it) and
  ``mutable=["batch_stats"]``; each micro-batch is normalized with its own statistics and the
  running averages are updated once per step from statistics pooled over every micro-batch and
  replica (:mod:`tpipe.core.planning.statistics`).
  """

  def __init__(self, layers, spec: spec_lib.PipelineSpec | None = None, **kwargs):
    # The spec's settings as keywords: Sequential(layers, num_stages=4, ...) and
    # model.clone(schedule="1f1b") (Flax's clone passes every field, then the changes).
    settings = {k: kwargs.pop(k) for k in list(kwargs) if k in spec_lib.field_names()}
    super().__init__(layers, spec_lib.make(OWNER, spec, **settings), **kwargs)

  def __post_init__(self):
    # Flax adopts Module instances found in fields as bound submodules named layers_0, ...;
    # the layers here are templates applied with their own variables, so hide them.
    held = tuple(layer if isinstance(layer, _Held) else _Held(layer)
                 for layer in (self.layers if isinstance(self.layers, (list, tuple)) else ()))
    if not isinstance(self.layers, (list, tuple)) or not held:
      raise TypeError(f"{OWNER} takes a non-empty list of layers, got {self.layers!r}.")
    object.__setattr__(self, "layers", held)
    for i, layer in enumerate(self.layer_list()):
      if not isinstance(layer, (nn.Module, Repeat)):
        raise TypeError(f"{OWNER}: layers[{i}] is {layer!r}; each layer must be a "
                        "flax.linen.Module instance or a tpipe.Repeat.")
    adapter.check_structure(self._core_layers(), self.spec, OWNER)
    super().__post_init__()

  def layer_list(self) -> list:
    """The layers as given (linen modules and :class:`Repeat` entries)."""
    return [h.layer for h in self.layers]

  def num_units(self) -> int:
    """Layer units: a plain layer is one, a ``Repeat`` of n is n."""
    return sum(layer.n if isinstance(layer, Repeat) else 1 for layer in self.layer_list())

  def _core_layers(self) -> tuple[layers_lib.Layer, ...]:
    return core_layers(self.layer_list(), OWNER)

  # ------------------------------------------------------------------------------------------
  # Planning (no values).

  def variable_shapes(self, x, rng_names: Sequence[str] = (), **kwargs) -> dict[str, Any]:
    """The abstract logical variables ``{"params": {...}, "batch_stats": {...}}`` for inputs like
    ``x`` (arrays or ``jax.ShapeDtypeStruct``s; keyword arguments as for ``apply``)."""
    return variable_shapes(self.layer_list(), self._core_layers(), self.spec, x, kwargs,
                           tuple(rng_names), OWNER)[0]

  def pipeline_for(self, x, rng_names: Sequence[str] = (), **kwargs) -> engine.PlannedPipeline:
    """The engine's :class:`tpipe.PlannedPipeline` for inputs like ``x``: the split, the stage
    layouts and the runs on staged variables (what the trainer trains)."""
    front = LinenLayers(tuple(self.layer_list()), self.spec, OWNER)
    return adapter.build(front.model(x, kwargs, rng_names), x, kwargs, rng_names)

  def stage_layout(self, x, **kwargs) -> layout_lib.StageLayout:
    """The stage layout of this stack's parameters for inputs like ``x``.

    A training state kept in it needs no re-layout in the step: pass
    ``{"params": {"staged": tpipe.staging.to_staged(layout, params)}}`` as the variables. The
    layout is tied to the split into chunks; with a balance computed from costs the split can
    depend on the input shapes and measurements, so use the model :meth:`with_split` makes with
    staged variables.
    """
    return self.pipeline_for(x, **kwargs).layout

  def stats_layout(self, x, **kwargs) -> layout_lib.StageLayout | None:
    """The stage layout of the layers' BatchNorm statistics for inputs like ``x``, or None when
    no layer has any; like :meth:`stage_layout`, tied to the split."""
    return self.pipeline_for(x, **kwargs).stats_layout

  def with_split(self, layout: layout_lib.StageLayout) -> "Sequential":
    """This stack with ``balance`` fixed to ``layout``'s unit counts per chunk."""
    return self.clone(balance=[sum(g.size for g in chunk) for chunk in layout.groups])

  def plan_for(self, x, **kwargs) -> plan_lib.Plan:
    """The :class:`~tpipe.core.planning.plan.Plan` for inputs like ``x``: unit names, each unit's
    cost under ``balance`` (its parameter count for explicit counts) and the split.

    ``model.clone(balance="flops").plan_for(x)`` gives every unit's forward-and-backward FLOPs on
    one micro-batch (``batch / M`` rows of ``x``) whatever split ``model`` uses.
    """
    return self.pipeline_for(x, **kwargs).plan

  def partition_summary(self, variables, x, **kwargs) -> str:
    """Which units each chunk holds, and its cost, for an input like ``x``."""
    del variables  # The split depends on the layers and the input, not on the values.
    return self.plan_for(x, **kwargs).describe()

  def chunk_program(self, layout: layout_lib.StageLayout, chunk: int, x,
                    rng_names: Sequence[str] = (), **kwargs):
    """Model chunk ``chunk`` alone, on one micro-batch like ``x``'s, to analyse it (see
    :meth:`tpipe.core.engine.PlannedPipeline.chunk_program`); ``layout`` must be this stack's."""
    pipeline = self.with_split(layout).pipeline_for(x, rng_names, **kwargs)
    return pipeline.chunk_program(chunk, x, kwargs, rng_names)

  # ------------------------------------------------------------------------------------------
  # Calls.

  def __call__(self, x, **kwargs):
    """The last layer's outputs for the whole batch (the layers applied in order)."""
    return self._run(x, kwargs, False)

  def loss(self, x, **kwargs):
    """The mean of the last layer's per-example losses over the global batch."""
    return self._run(x, kwargs, True)

  def loss_terms(self, x, **kwargs):
    """The loss's terms apart, for reporting: ``{"loss": mean per-example loss, "aux_loss/...":
    ..., "aux_metric/...": ...}`` (:meth:`tpipe.core.engine.PlannedPipeline.loss_terms`)."""
    return self._run(x, kwargs, False, terms=True)

  def initialize(self, x, **kwargs) -> None:
    """Creates the layers' variables for inputs like ``x``, without running the pipeline.

    ``model.init(rngs, x, method="initialize", **kwargs)`` returns the variables
    ``model.init(rngs, x, **kwargs)`` returns, equal leaf for leaf, without tracing (or, outside
    ``jax.jit``, compiling) the pipelined forward pass whose output ``init`` discards: the layers
    are initialised in order on one micro-batch, as ``init`` initialises them. Returns None.
    """
    self._create_variables(x, kwargs)

  @nn.compact
  def _create_variables(self, x, kwargs) -> tuple["LinenLayers", dict]:
    """``(front end, {stream: key})`` for a call; while initialising, the layers' variables
    created first (each layer in order on one micro-batch)."""
    self.spec.run_mesh(OWNER)  # Raises first where the spec's mesh does not fit the devices.
    front = LinenLayers(tuple(self.layer_list()), self.spec, OWNER, returned=self.scope.mutable)
    streams = tuple(sorted(name for name in self.scope.rngs if name != "params"))
    rngs = {name: self.make_rng(name) for name in streams}
    if self.is_initializing():
      for i, variables in enumerate(front.initial_variables(self, x, kwargs, rngs)):
        layer_params = variables.get("params", {})
        self.param(f"layers_{i}", lambda _key, value=layer_params: value, unbox=False)
        layer_stats = nn.meta.unbox(variables.get(STATS, {}))
        if jax.tree.leaves(layer_stats):
          self.put_variable(STATS, f"layers_{i}", layer_stats)
    return front, rngs

  def _run(self, x, kwargs, loss: bool, terms: bool = False):
    front, rngs = self._create_variables(x, kwargs)
    variables = self._call_variables()

    def store(new_stats):
      if isinstance(new_stats, adapter.Staged):
        self.put_variable(STATS, STAGED, new_stats.tree)
        return
      for name, tree in new_stats.items():
        if name in variables.stats:
          self.put_variable(STATS, name, tree)

    return front.run(self, variables, x, kwargs, loss=loss, terms=terms, rngs=rngs,
                     store_stats=store)

  def _call_variables(self) -> adapter.Variables:
    """The module's variables for a call: each collection logical, or staged where it holds
    ``{"staged": tree}`` alone (the one place that key is read)."""
    params = nn.meta.unbox(dict(self.variables.get("params", {})))
    stats = nn.meta.unbox(dict(self.variables.get(STATS, {})))
    if STAGED in stats:
      stats = adapter.Staged(stats[STAGED])
    if STAGED not in params:
      expected = {f"layers_{i}" for i in range(len(self.layers))}
      if set(params) != expected:
        raise ValueError(f"{OWNER} expects params {sorted(expected)}, got {sorted(params)}; "
                         "were these variables made for another list of layers?")
      return adapter.Variables(params, stats)
    if set(params) != {STAGED}:
      raise ValueError(f"{OWNER}: params hold {sorted(params)}; staged params are "
                       f"{{'{STAGED}': tree}} alone.")
    if isinstance(self.spec.balance, str):
      # The split decides what each staged element means; a balance computed from costs may
      # cut differently for other input shapes, and equal sizes would hide it.
      raise ValueError(f"{OWNER}: staged params need the split they were made with; build "
                       f"the model with model.with_split(layout) (balance="
                       f"{self.spec.balance!r} is computed from costs and could cut the layers "
                       "differently).")
    return adapter.Variables(adapter.Staged(params[STAGED]), stats)


def core_layers(given, owner: str, returned: Any = False) -> tuple[layers_lib.Layer, ...]:
  """The core layers of linen modules and :class:`Repeat` entries (``returned``: see
  :func:`tpipe.linen.layers.as_layer`)."""
  return tuple(linen_layers.as_layer(_module_of(layer), _copies(layer), owner, returned)
               for layer in given)


@dataclasses.dataclass(frozen=True)
class LinenLayers:
  """Linen modules and :class:`Repeat` entries as the adapter's layers
  (:mod:`tpipe.core.adapter`): what both linen front ends run a call through.

  Attributes:
    given: the linen modules and :class:`Repeat` entries.
    spec: the pipeline settings.
    owner: the API the user called, for messages.
    returned: the collections the calling module may write (its ``scope.mutable``): a layer that
      writes to one besides ``params`` and ``batch_stats`` raises, since the pipeline would drop
      what it wrote (:func:`tpipe.linen.layers.as_layer`).
  """

  given: tuple
  spec: spec_lib.PipelineSpec
  owner: str
  returned: Any = False

  def model(self, x, kwargs, rng_names: Sequence[str]) -> adapter.Model:
    """The layers, with their abstract logical variables for inputs like ``x``."""
    layers = core_layers(self.given, self.owner, self.returned)
    shapes, names = variable_shapes(self.given, layers, self.spec, x, kwargs,
                                    tuple(rng_names), self.owner)
    return adapter.Model(layers, self.spec, self.owner, param_axes=names,
                         param_shapes=shapes["params"], stats_shapes=shapes[STATS])

  def run(self, module: nn.Module, variables: adapter.Variables, x, kwargs, *, loss: bool,
          rngs, store_stats, terms: bool = False):
    """Runs a call inside ``module``'s call (:func:`tpipe.core.adapter.call`).

    Args:
      module: the calling module (is it initializing; may it write ``batch_stats``).
      variables: the parameters and statistics, each logical or staged.
      x: the input.
      kwargs: the keyword arguments.
      loss: return the mean loss (else the outputs).
      terms: return the loss's terms apart (:meth:`tpipe.core.engine.PlannedPipeline.loss_terms`).
      rngs: ``{stream: key}`` for the call.
      store_stats: called with the updated statistics (in ``variables.stats``' form) after a
        training step of BatchNorm layers.
    """
    model = self.model(x, kwargs, tuple(rngs))
    call = functools.partial(adapter.call, model, loss=loss, terms=terms,
                             mesh=self.spec.run_mesh(self.owner))
    if module.is_initializing():  # Like Flax: init does not update the statistics.
      # Fresh logical variables: the forward as one compiled program (eagerly, every operation
      # would compile on its own).
      return layers_lib.compiled_call(
          lambda params, stats, x, kwargs, rngs: call(
              adapter.Variables(params, stats), x, kwargs, rngs=rngs).value,
          variables.params, variables.stats, x, kwargs, rngs)
    result = call(variables, x, kwargs, rngs=rngs)
    if result.new_stats is None:
      return result.value
    if not module.is_mutable_collection(STATS):
      raise ValueError(f"{self.owner}: BatchNorm layers run in training mode update '{STATS}'; "
                       f"call apply(..., mutable=['{STATS}']) (or put them in evaluation mode, "
                       "use_running_average=True).")
    store_stats(result.stats())
    return result.value

  def initial_variables(self, module: nn.Module, x, kwargs, rngs) -> list[dict]:
    """Every layer's initial variables, the layers run in order on one micro-batch of ``x``:
    layer ``i`` from ``fold_in(module.make_rng("params"), i)``. Partitioning boxes are kept (a
    :class:`Repeat`'s copy axis named after the stage axis), so ``init`` returns them as
    ``nn.scan`` does."""
    spec, owner = self.spec, self.owner
    batch = layers_lib.batch_size(x, owner)
    micro = spec.microbatch_size(batch, spec.row_shards(spec.run_mesh(owner)))
    split = arguments.split_keywords(kwargs, per_example=spec.per_example, batch_size=batch,
                                     owner=owner)
    side = (split.broadcast, tuple(a[:micro] for a in split.per_example))
    h = jax.tree.map(lambda a: a[:micro], x)
    key = module.make_rng("params")
    other = layers_lib.unit_rngs(rngs, 0, 0)
    axis_names = (spec.data_axis, spec.stage_axis)
    layers = core_layers(self.given, owner)

    def apply_all(i, variables, h, kw):
      """Applies ``layers[i]`` (every copy of a repeated one, in order) to ``h``, as one
      compiled program."""
      layer = layers[i]
      apply = layers_lib.outside_mesh(layer.apply, axis_names)

      def run(params, stats, h, kw):
        if layer.copies is None:
          return apply(params, stats, h, kw, other)[0]
        one = lambda tree, j: jax.tree.map(lambda a: a[j], tree)
        out = apply(one(params, 0), one(stats, 0), h, kw, other)[0]
        plan_lib.check_repeated(layers, i, h, out, owner)
        rest = jax.tree.map(lambda a: a[1:], (params, stats))
        step = lambda h, copy: (apply(*copy, h, kw, other)[0], None)
        return jax.lax.scan(step, out, rest)[0]

      return layers_lib.compiled_call(run, variables.get("params", {}),
                                      variables.get(STATS, {}), h, kw)

    out = []
    for i, (layer_given, layer) in enumerate(zip(self.given, layers)):
      kw = layers_lib.layer_keywords(layer, split, *side)
      try:
        init = functools.partial(linen_layers.init_variables, _module_of(layer_given),
                                 _copies(layer_given))
        variables = layers_lib.compiled_call(
            lambda key, h, kw: init(key, h, kw, other, axis_names, spec.stage_axis),
            jax.random.fold_in(key, i), h, kw)
      except (TypeError, ValueError) as error:
        where = plan_lib.failure_message(layers, i, owner)
        raise plan_lib.located(error, where, h) from error
      extra = linen_layers.variable_collections(variables)
      if extra:
        raise ValueError(f"{owner}: layers[{i}] ({layer.kind}) creates variable collections "
                         f"{extra}; tpipe supports 'params' and BatchNorm's '{STATS}'.")
      out.append(variables)
      h = apply_all(i, nn.meta.unbox(variables), h, kw)
    return out


def variable_shapes(given, layers, spec, x, kwargs, rng_names,
                    owner: str) -> tuple[dict[str, Any], dict[str, Any]]:
  """Each layer's abstract logical variables ``{"params": ..., "batch_stats": ...}``, each layer
  initialised (abstractly) on the previous layer's output for inputs like ``x``; and the
  parameters' logical axis names ``{"layers_i": {keystr(path): names}}``
  (:func:`tpipe.core.base.layers.logical_names`)."""
  batch = layers_lib.batch_size(x, owner)
  split = arguments.split_keywords(dict(kwargs), per_example=spec.per_example,
                                   batch_size=batch, owner=owner)
  h, side = engine.micro_inputs(x, split, batch, spec)
  axis_names = (spec.data_axis, spec.stage_axis)
  params, stats, names = {}, {}, {}
  for i, (module, layer) in enumerate(zip(given, layers)):
    kw = layers_lib.layer_keywords(layer, split, *side)
    where = plan_lib.failure_message(layers, i, owner)
    try:
      variables, names[f"layers_{i}"] = linen_layers.abstract_variables(
          _module_of(module), _copies(module), h, kw, rng_names, axis_names)
    except (TypeError, ValueError) as error:
      raise plan_lib.located(error, where, h) from error
    params[f"layers_{i}"] = variables.get("params", {})
    stats[f"layers_{i}"] = variables.get(STATS, {})
    one = (lambda t: layers_lib.one_copy(t)) if layer.copies is not None else (lambda t: t)
    calls = plan_lib.Calls(split, side, tuple(rng_names), owner, axis_names)
    h = plan_lib.abstract_output(layer, one(params[f"layers_{i}"]), one(stats[f"layers_{i}"]),
                                 h, calls, where=where)
  return {"params": params, STATS: stats}, names
