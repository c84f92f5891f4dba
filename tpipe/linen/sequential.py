"""``tpipe.Sequential``: any sequence of Flax layers, split into stages balanced by cost.

GPipe pipelines "any network that can be expressed as a sequence of layers": layers may change the
activation's shape, dtype and pytree structure (an embedding turns token ids into vectors, a
convolutional cell halves the resolution, a head turns features into per-example losses).

How it runs, in one SPMD program:

* The layers are expanded into **units** (a :class:`Repeat` of ``n`` counts ``n``) and cut into
  ``S * R`` contiguous **chunks** balanced by cost (:func:`tpipe.partition.balanced_split`);
  chunk ``c = r * S + s`` runs on stage ``s`` as its ``r``-th chunk, so the layers are met in order.
* What crosses a chunk boundary, and each chunk's parameters, differ per chunk; they travel
  **packed** into one buffer per dtype, padded to the largest (:mod:`tpipe.core.packing`).
  Every chunk is then a function of the same types, and each tick a device runs its chunk as one
  branch of a ``lax.switch`` (:func:`tpipe.core.gated.switch_call`; idle ticks run none).
* The packed parameters are stacked ``[R, S, n]`` and split over the ``stage`` axis, so each
  device holds its own chunks' parameters only. At the API boundary parameters keep the logical
  layout ``{"layers_0": ..., "layers_1": ...}`` (``nn.Sequential``'s names; a ``Repeat``'s
  parameters stacked on a leading axis of length ``n``, ``nn.scan``'s layout), which does not
  depend on the stage count, balance, schedule or repeats. A training state can live in the
  executor's own layout instead (:meth:`Sequential.stage_layout`, ``{"staged": ...}``), so the
  step moves no parameter between stages.
* Three formats meet in the executor: the input (read by the first chunk only), the packed ring
  between chunks (one micro-batch) and the last layer's own output format. With the loss in the
  last layer, what leaves the pipeline is one number per example.
* Fused schedules (``"1f1b"``, ``"interleaved_1f1b"``, ``"zb_h1"``, ``"zbv"``): the executor
  interleaves each chunk's forward and backward (:mod:`tpipe.core.fused`), keeps a number of
  chunk inputs per stage bounded by the stages instead of one per tick, and the stack returns the
  mean of the last layer's per-example losses. The zero-bubble schedules split each backward
  into input and weight gradients without computing anything twice (:mod:`tpipe.core.taps`).
* BatchNorm (``batch_stats``): each micro-batch is normalized with its own statistics; the
  running averages are updated once per step from ``E[x]`` and ``E[x^2]`` pooled over every
  micro-batch and data replica (GPipe's rule), summed by the executor over busy ticks only.

Example::

  layers = [Embed(vocab, width), tpipe.Repeat(Block(width), 24), HeadLoss(vocab)]
  model = tpipe.Sequential(layers, num_stages=4, num_microbatches=16, balance="flops",
                           per_example=("targets",), mesh=tpipe.make_mesh(stages=4, data=2))
  variables = model.init({"params": key}, tokens, targets=targets)
  losses = model.apply(variables, tokens, targets=targets)      # [batch]
  # With schedule="1f1b": the mean loss, a scalar, and memory bounded in S instead of M.
  loss, grads = jax.value_and_grad(lambda p: model.clone(schedule="1f1b").apply(
      {"params": p}, tokens, targets=targets))(variables["params"])
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh

from tpipe import partition
from tpipe import schedules as schedules_lib
from tpipe.core import arguments as arguments_lib
from tpipe.core import executor
from tpipe.core import fused
from tpipe.core import gated
from tpipe.core import packing
from tpipe.core import stage as stage_lib
from tpipe.core import stage_layout as stage_layout_lib
from tpipe.core import taps as taps_lib
from tpipe.core import unit_cost
from tpipe.linen import transform
from tpipe.parallel import mesh as mesh_lib

BALANCE_NAMES = ("params", "flops", "time")
# Fused schedules (forward and backward interleaved) the stack runs; its output is then the loss.
FUSED_SCHEDULES = schedules_lib.FUSED_SCHEDULE_NAMES
_OWNER = "tpipe.Sequential"
# The params key of staged parameters: {"staged": {dtype: [R, S, n]}} (see stage_layout()).
STAGED = "staged"
# The variable collection of BatchNorm's running statistics.
STATS = "batch_stats"


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
    transform.check_count("Repeat n", self.n)


@dataclasses.dataclass(frozen=True, eq=False)
class _Held:
  """Holds a layer template out of Flax's sight, so it is not adopted as a bound submodule."""

  layer: Any


@dataclasses.dataclass(frozen=True)
class Plan:
  """How a :class:`Sequential` is cut into chunks for one input shape.

  Attributes:
    unit_names: a name per unit (``layers_3[7]`` for copy 7 of a Repeat at position 3).
    costs: the cost of every unit under the balance used.
    counts: units per chunk, chunk ``c = r * S + s`` in order.
    groups: per chunk, its units grouped by layer.
  """

  unit_names: tuple[str, ...]
  costs: tuple[float, ...]
  counts: tuple[int, ...]
  groups: tuple[tuple[stage_layout_lib.Group, ...], ...]

  def describe(self, num_stages: int) -> str:
    """A table of the chunks: stage, units, cost and share."""
    text = partition.describe_split(self.counts, self.costs, names=self.unit_names)
    if len(self.counts) == num_stages:
      return text
    chunks = ", ".join(f"chunk {c} -> stage {c % num_stages}" for c in range(len(self.counts)))
    return f"{text}\n(circular: {chunks})"


def _module_of(layer) -> nn.Module:
  return layer.module if isinstance(layer, Repeat) else layer


@functools.lru_cache(maxsize=None)
def _keywords_of_class(cls) -> tuple[str, ...] | None:
  params = list(inspect.signature(cls.__call__).parameters.values())[2:]
  if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
    return None
  return arguments_lib.extra_parameter_names(cls.__call__)


def _accepted_keywords(layer) -> tuple[str, ...] | None:
  """Keyword names a layer's ``__call__`` takes after its input; None if it takes ``**kwargs``."""
  return _keywords_of_class(type(_module_of(layer)))


def _template(layer) -> nn.Module:
  return _module_of(layer).clone(parent=None)


class Sequential(nn.Module):
  """Applies ``layers`` in order, pipelined over the ``stage`` axis of a device mesh.

  Attributes:
    layers: unbound ``flax.linen.Module`` instances and :class:`Repeat` entries, in order. Each
      maps the previous layer's output (any pytree of arrays with the batch as leading axis) to
      its own; the first gets ``x``.
    num_stages: pipeline stages S; must equal the size of the mesh's stage axis.
    num_microbatches: micro-batches M per data-parallel replica.
    schedule: ``"gpipe"`` or ``"circular"`` (``num_repeats`` chunks per stage), or a fused
      schedule (:data:`FUSED_SCHEDULES`): ``"1f1b"`` (one forward, one backward in turn; at most
      ``min(S - s, M)`` micro-batches in flight on stage ``s``), ``"interleaved_1f1b"``
      (``num_repeats >= 2`` chunks per stage, placed as the circular schedule places them),
      ``"zb_h1"`` (zero-bubble H1: 1F1B's memory, the backward split into input gradients
      ``BI`` and weight gradients ``W`` that fill the bubble) or ``"zbv"`` (zero-bubble V: two
      chunks per stage, ``num_repeats=2``, the second running back up the stages).
      With a fused schedule the last layer must return per-example losses ``[batch]`` and the
      stack returns their **mean over the global batch** (all micro-batches and data replicas),
      a scalar; ``jax.grad`` of any function of it gives the sequential model's gradients
      (params and float inputs). One differentiated call runs forward and backward together
      (:mod:`tpipe.core.fused`); a call that is not differentiated runs the forward ticks of
      GPipe (or of the circular schedule, for two or more chunks per stage) only. A chunk's
      backward recomputes its forward from the stashed chunk input (``remat="full"`` across
      ticks; ``remat`` decides what the recomputation keeps within the tick). The zero-bubble
      split moves the weight gradients of ``nn.Dense``, ``nn.DenseGeneral``, ``nn.Conv``,
      ``nn.Einsum`` and ``nn.Embed`` calls to ``W`` without computing anything twice; other
      weights get their gradients in ``BI`` (:mod:`tpipe.core.taps`). BatchNorm statistics are
      not supported with fused schedules.
    num_repeats: chunks per stage R (``"circular"``, ``"interleaved_1f1b"``; 2 for ``"zbv"``).
    balance: how the ``S * R`` chunks are chosen: ``"params"`` (parameter count per unit),
      ``"flops"`` (XLA's cost analysis of each unit's forward and backward on one micro-batch;
      it counts a loop body once and a conditional as its costliest branch), ``"time"`` (the
      measured wall time of that forward and backward: the median of several runs after a
      warm-up; meant for real accelerators, and noisy where other work shares the device, as on
      CPUs, so the split may differ between runs), or an explicit list of how many units each
      chunk gets (a ``Repeat`` of n is n units). A Repeat's FLOPs or time are measured once, for
      one copy, and count for each of its n units; both are cached per distinct layer and shapes
      (:mod:`tpipe.core.unit_cost`), so tracing again neither compiles nor measures again. The
      split is the optimal contiguous min-max partition of the costs
      (:func:`tpipe.partition.balanced_split`).
    remat: ``"none"``, ``"full"``, ``"dots"`` or a ``jax.checkpoint`` policy, per chunk.
    remat_granularity: what is checkpointed with ``remat``'s policy: ``"chunk"`` (the whole
      chunk; its backward holds every layer's intermediates of one micro-batch at once),
      ``"layer"`` (each layer unit: the chunk keeps each unit's input and its backward
      recomputes one unit at a time, with the same recompute FLOPs), or an int ``k`` (every
      ``k`` consecutive units; ``"layer"`` is 1). A ``Repeat`` is scanned over pieces of ``k``
      units (its ``n % k`` remaining units are one shorter piece); no piece spans a Repeat's
      boundary. Finer pieces lower a chunk's backward peak; under ``"gpipe"``/``"circular"``
      each micro-batch in flight then keeps one input per piece instead of one per chunk (the
      fused ``"1f1b"`` still stashes one chunk input and recomputes the chunk in its ``B`` tick,
      where the granularity decides what that tick holds at once; see
      :func:`tpipe.core.stage.apply_units`).
    per_example: names of keyword arguments whose arrays carry the batch as leading axis; they
      are split into micro-batches with ``x``. Other keyword arrays are broadcast; non-array
      keywords are passed untraced. A keyword reaches every layer whose ``__call__`` has a
      parameter of that name.
    mesh: the device mesh; ``None`` means the ambient mesh (``jax.set_mesh``), or one device.
    stage_axis: the mesh axis of stages.
    data_axis: the mesh axis of data-parallel replicas (the batch is split over it).

  RNG: a stream ``k = self.make_rng(name)`` (other than ``params``) reaches unit ``u`` (0-based
  over all units) on global micro-batch ``m = replica * M + j`` as ``fold_in(fold_in(k, u), m)``;
  layer ``i`` (a Repeat: each copy from its own key) is initialised from
  ``fold_in(self.make_rng("params"), i)``. Neither depends on the stage count, balance or schedule.

  BatchNorm: call with ``train=True`` (or however the layers take it) and
  ``mutable=["batch_stats"]`` to train; the returned statistics are in the layout the variables
  came in (logical ``layers_i``, or ``{"staged": ...}`` from :meth:`stats_layout`).
  """

  layers: Sequence[Any]
  num_stages: int
  num_microbatches: int
  schedule: str = "gpipe"
  num_repeats: int = 1
  balance: Any = "params"
  remat: Any = "full"
  remat_granularity: Any = "chunk"
  per_example: Sequence[str] = ()
  mesh: Mesh | None = None
  stage_axis: str = mesh_lib.STAGE_AXIS
  data_axis: str = mesh_lib.DATA_AXIS

  def __post_init__(self):
    # Flax adopts Module instances found in fields as bound submodules named layers_0, ...;
    # the layers here are templates applied with their own variables, so hide them.
    held = tuple(layer if isinstance(layer, _Held) else _Held(layer)
                 for layer in (self.layers if isinstance(self.layers, (list, tuple)) else ()))
    if not isinstance(self.layers, (list, tuple)) or not held:
      raise TypeError(f"{_OWNER} takes a non-empty list of layers, got {self.layers!r}.")
    object.__setattr__(self, "layers", held)
    object.__setattr__(self, "per_example", tuple(self.per_example)
                       if not isinstance(self.per_example, str) else self.per_example)
    self._validate()
    super().__post_init__()

  # ------------------------------------------------------------------------------------------
  # Validation and structure (no tracing).

  def _layer_list(self) -> list:
    return [h.layer for h in self.layers]

  def _validate(self) -> None:
    for i, layer in enumerate(self._layer_list()):
      if not isinstance(layer, (nn.Module, Repeat)):
        raise TypeError(f"{_OWNER}: layers[{i}] is {layer!r}; each layer must be a "
                        "flax.linen.Module instance or a tpipe.Repeat.")
    for name in ("num_stages", "num_microbatches", "num_repeats"):
      transform.check_count(name, getattr(self, name))
    self.schedule_table()  # Raises for unknown names or bad repeats.
    stage_lib.resolve_remat(self.remat)
    stage_lib.check_remat_granularity(self.remat_granularity)
    num_chunks, num_units = self.num_stages * self.num_repeats, self.num_units()
    if num_units < num_chunks:
      raise ValueError(
          f"{_OWNER} has {num_units} layer units but num_stages * num_repeats = {num_chunks} "
          "chunks need at least one each; use fewer stages or repeats, or more layers.")
    if isinstance(self.balance, str):
      if self.balance not in BALANCE_NAMES:
        raise ValueError(f"Unknown balance {self.balance!r}; choose one of {BALANCE_NAMES} or "
                         f"pass a list of {num_chunks} unit counts summing to {num_units}.")
    else:
      partition.check_balance(self.balance, num_units, num_chunks)
    if isinstance(self.per_example, str):
      raise TypeError(f"per_example must be a sequence of keyword names, got the string "
                      f"{self.per_example!r}; write per_example=({self.per_example!r},).")
    known, takes_all = self._keyword_names()
    for name in self.per_example:
      if name not in known and not takes_all:
        raise ValueError(f"per_example names {name!r}, which no layer's __call__ takes; the "
                         f"layers take {sorted(known)}.")
    if self.mesh is not None:
      if not isinstance(self.mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got "
                        f"{type(self.mesh).__name__}.")
      transform.resolve_mesh(self.mesh, self.num_stages, self.stage_axis)

  def _keyword_names(self) -> tuple[set, bool]:
    """The keyword names some layer's ``__call__`` takes, and whether one takes ``**kwargs``."""
    accepted = [_accepted_keywords(layer) for layer in self._layer_list()]
    return set().union(*[a for a in accepted if a is not None]), None in accepted

  def is_fused(self) -> bool:
    """Whether the schedule interleaves forward and backward (then the output is the loss)."""
    return self.schedule in FUSED_SCHEDULES

  def schedule_table(self) -> schedules_lib.Schedule | schedules_lib.FusedSchedule:
    """The schedule this stack runs: a forward :class:`~tpipe.schedules.Schedule`, or a
    :class:`~tpipe.schedules.FusedSchedule` for a fused schedule."""
    if self.schedule in FUSED_SCHEDULES:
      return schedules_lib.make_fused_schedule(self.schedule, self.num_stages,
                                               self.num_microbatches, self.num_repeats)
    return schedules_lib.make_schedule(self.schedule, self.num_stages, self.num_microbatches,
                                       self.num_repeats)

  def num_units(self) -> int:
    """Layer units: a plain layer is one, a ``Repeat`` of n is n."""
    return sum(l.n if isinstance(l, Repeat) else 1 for l in self._layer_list())

  def _unit_names(self) -> tuple[str, ...]:
    names = []
    for i, layer in enumerate(self._layer_list()):
      kind = type(layer.module if isinstance(layer, Repeat) else layer).__name__
      if isinstance(layer, Repeat):
        names += [f"layers_{i}[{j}] {kind}" for j in range(layer.n)]
      else:
        names.append(f"layers_{i} {kind}")
    return tuple(names)

  # ------------------------------------------------------------------------------------------
  # Planning: unit costs and the split into chunks.

  def _unit_costs(self, kind, params_shapes, in_shapes, split, side,
                  rng_names) -> tuple[float, ...]:
    """The cost of every unit under ``kind`` (``"params"``, ``"flops"`` or ``"time"``).

    A Repeat's copies are measured once, as one copy, and count that cost each. FLOPs and times
    are cached per distinct layer, input and keywords (:func:`tpipe.core.unit_cost.cost`), so
    tracing again (init, then apply) neither compiles nor measures again.
    """
    costs = []
    for i, layer in enumerate(self._layer_list()):
      n = layer.n if isinstance(layer, Repeat) else 1
      one = params_shapes[f"layers_{i}"]
      if isinstance(layer, Repeat):
        one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), one)
      if kind == "params":
        cost = float(sum(np.prod(a.shape) for a in jax.tree.leaves(one)))
      else:
        # What the layer's program depends on besides the shapes of its params and input.
        keywords = unit_cost.abstract_key(self._keywords_for(i, split, *side))
        identity = (_template(layer), keywords, tuple(rng_names))
        cost = unit_cost.cost(kind, self._layer_apply(i, split, rng_names), one, in_shapes[i],
                              side, identity=identity)
      costs += [cost] * n
    return tuple(costs)

  def plan(self, params_shapes, in_shapes, split, side, rng_names=()) -> Plan:
    """Chooses the chunks (see :class:`Plan`); ``in_shapes[i]`` is layer i's abstract input and
    ``side`` the abstract (broadcast, per-example micro-batch) arrays. With an explicit list
    balance the costs shown are parameter counts."""
    num_chunks = self.num_stages * self.num_repeats
    if isinstance(self.balance, str):
      costs = self._unit_costs(self.balance, params_shapes, in_shapes, split, side, rng_names)
      counts = partition.balanced_split(costs, num_chunks)
    else:
      costs = self._unit_costs("params", params_shapes, in_shapes, split, side, rng_names)
      counts = partition.check_balance(self.balance, self.num_units(), num_chunks)
    copies = [l.n if isinstance(l, Repeat) else None for l in self._layer_list()]
    groups = stage_layout_lib.group_units(copies, counts)
    return Plan(unit_names=self._unit_names(), costs=costs, counts=tuple(counts),
                groups=tuple(groups))

  def _abstract_call(self, x, kwargs):
    """Abstract micro-batch input, keyword split and side inputs for an input like ``x``."""
    batch = transform.batch_size(x)
    micro = max(1, batch // self.num_microbatches)
    row = lambda a: jax.ShapeDtypeStruct((micro,) + tuple(np.shape(a)[1:]), a.dtype)
    split = arguments_lib.split_keywords(kwargs, per_example=self.per_example, batch_size=batch,
                                         owner=_OWNER)
    side = (_shapes(split.broadcast), tuple(row(a) for a in split.per_example))
    return jax.tree.map(row, x), split, side

  def _logical_shapes(self, x_micro, split, side, rng_names=(), collection: str = "params"
                      ) -> dict[str, Any]:
    """The abstract shapes of ``collection``'s logical variables (``params`` or BatchNorm's
    statistics), from each layer's own ``init`` (no values); layers without any get ``{}``."""
    shapes, h = {}, x_micro
    for i, layer in enumerate(self._layer_list()):
      template = _template(layer)

      def init_one(key, h, side, template=template, i=i):
        kwargs = self._keywords_for(i, split, *side)
        rngs = {name: key for name in (*rng_names, "params")}
        return nn.meta.unbox(self._outside_mesh(template.init)(rngs, h, **kwargs))

      variables = jax.eval_shape(init_one, jax.random.key(0), h, side)
      one = variables.get("params", {})
      stack = ((lambda a: jax.ShapeDtypeStruct((layer.n,) + tuple(a.shape), a.dtype))
               if isinstance(layer, Repeat) else (lambda a: a))
      shapes[f"layers_{i}"] = jax.tree.map(stack, variables.get(collection, {}))
      h = jax.eval_shape(self._layer_apply(i, split, rng_names), one, h, *side)
    return shapes

  def _layout(self, plan: Plan, param_shapes) -> stage_layout_lib.StageLayout:
    placement = "v" if self.schedule == "zbv" else "loop"
    return stage_layout_lib.StageLayout.build(plan.groups, param_shapes, self.num_stages,
                                              self.num_repeats, placement=placement)

  def stage_layout(self, x, **kwargs) -> stage_layout_lib.StageLayout:
    """The stage layout of this stack's parameters for inputs like ``x`` (arrays or
    ``jax.ShapeDtypeStruct``s; keyword arguments as for ``apply``).

    A training state kept in it needs no re-layout in the step: pass
    ``{"params": {"staged": layout.to_staged(params)}}`` as the variables. The layout is tied to
    the split into chunks; with ``balance="params"``/``"flops"`` the split can depend on the input
    shapes, and with ``"time"`` on the measurement (the same within a process, where costs are
    cached, but not between runs), so build the model that uses staged params with
    :meth:`with_split` (the explicit unit counts of this layout).
    """
    x_micro, split, side = self._abstract_call(x, kwargs)
    param_shapes = self._logical_shapes(x_micro, split, side)
    in_shapes = self._layer_inputs(param_shapes, x_micro, split, *side)
    return self._layout(self.plan(param_shapes, in_shapes, split, side), param_shapes)

  def stats_layout(self, x, **kwargs) -> stage_layout_lib.StageLayout | None:
    """The stage layout of the layers' BatchNorm statistics (``batch_stats``) for inputs like
    ``x``, or None when no layer has any; pass ``{"batch_stats": {"staged": ...}}`` with staged
    params. Like :meth:`stage_layout`, it is tied to the split (use :meth:`with_split`)."""
    x_micro, split, side = self._abstract_call(x, kwargs)
    param_shapes = self._logical_shapes(x_micro, split, side)
    stats_shapes = self._logical_shapes(x_micro, split, side, collection=STATS)
    if not jax.tree.leaves(stats_shapes):
      return None
    in_shapes = self._layer_inputs(param_shapes, x_micro, split, *side)
    return self._layout(self.plan(param_shapes, in_shapes, split, side), stats_shapes)

  def with_split(self, layout: stage_layout_lib.StageLayout) -> "Sequential":
    """This stack with ``balance`` fixed to ``layout``'s unit counts per chunk."""
    counts = [sum(g.stop - g.start for g in chunk) for chunk in layout.groups]
    return self.clone(balance=counts)

  def partition_summary(self, variables, x, **kwargs) -> str:
    """Which units each chunk holds and its cost, for ``variables`` and an input like ``x``.

    The cost is what ``balance`` names; for an explicit list it is the parameter count."""
    x_micro, split, side = self._abstract_call(x, kwargs)
    params = nn.meta.unbox(variables["params"])
    param_shapes = (self._logical_shapes(x_micro, split, side) if STAGED in params
                    else _shapes(params))
    in_shapes = self._layer_inputs(param_shapes, x_micro, split, *side)
    return self.plan(param_shapes, in_shapes, split, side).describe(self.num_stages)

  def plan_for(self, x, **kwargs) -> Plan:
    """The :class:`Plan` for inputs like ``x`` (keyword arguments as for ``apply``): unit names,
    each unit's cost under ``balance`` (its parameter count for an explicit list) and the split.

    ``model.clone(balance="flops").plan_for(x)`` gives every unit's forward-and-backward FLOPs on
    one micro-batch whatever split ``model`` uses. A micro-batch is ``batch / M`` rows of ``x``:
    pass one data replica's batch to get a device's micro-batch.
    """
    x_micro, split, side = self._abstract_call(x, kwargs)
    param_shapes = self._logical_shapes(x_micro, split, side)
    in_shapes = self._layer_inputs(param_shapes, x_micro, split, *side)
    return self.plan(param_shapes, in_shapes, split, side)

  def chunk_program(self, layout: stage_layout_lib.StageLayout, chunk: int, x,
                    rng_names: Sequence[str] = (), **kwargs):
    """Chunk ``chunk`` of ``layout`` alone, on one micro-batch of inputs like ``x``, to analyse it.

    Args:
      layout: this stack's stage layout (:meth:`stage_layout`).
      chunk: the chunk index ``c = r * S + s``.
      x: an input like ``apply``'s (arrays or ``jax.ShapeDtypeStruct``); a micro-batch is
        ``batch / M`` of its rows.
      rng_names: random streams the layers draw (e.g. ``("dropout",)``); they get a fixed key.
      **kwargs: keyword arguments as for ``apply``.

    Returns:
      ``(fn, args)``: ``fn(*args)`` applies the chunk's layers in order, as a pipeline tick does
      but without the checkpoint around the whole chunk (with a finer ``remat_granularity``, its
      pieces are checkpointed with the remat policy, as in a tick); ``args`` are abstract: the
      chunk's parameter trees (one per layer group), its input on one micro-batch, and the side
      inputs.
    """
    rng_names = tuple(rng_names)
    x_micro, split, side = self._abstract_call(x, kwargs)
    param_shapes = self._logical_shapes(x_micro, split, side, rng_names)
    in_shapes = self._layer_inputs(param_shapes, x_micro, split, *side, rng_names=rng_names)
    groups = layout.groups[chunk]
    h = _unit_inputs(self._layer_list(), in_shapes)[groups[0].first_unit]
    buffers = {k: jax.ShapeDtypeStruct((n,), jnp.dtype(k)) for k, n in layout.sizes.items()}
    trees = jax.eval_shape(lambda b: layout.chunk_params(b, chunk), buffers)
    applies = [self._layer_apply(g.layer, split, rng_names) for g in groups]

    def fn(trees, h, side):
      runs = [((lambda h, p, apply=apply: (apply(p, h, *side), None)), p,
               g.stop - g.start if g.repeated else None)
              for g, p, apply in zip(groups, trees, applies)]
      return stage_lib.apply_units(h, runs, self.remat, self.remat_granularity)[0]

    return fn, (trees, h, side)

  # ------------------------------------------------------------------------------------------
  # Applying layers.

  def _keywords_for(self, i: int, split, broadcast, per_example) -> dict:
    """The keyword arguments layer ``i`` takes, rebuilt from the given arrays."""
    _, kwargs = split.rebuild(broadcast, per_example)
    accepted = _accepted_keywords(self._layer_list()[i])
    if accepted is None:
      return kwargs
    return {k: v for k, v in kwargs.items() if k in accepted}

  def _layer_inputs(self, params_shapes, x_micro, split, broadcast, per_example, rng_names=()):
    """Abstract input of every layer on one micro-batch (and, last, the stack's output)."""
    in_shapes, h = [], x_micro
    for i, layer in enumerate(self._layer_list()):
      in_shapes.append(h)
      one = params_shapes[f"layers_{i}"]
      if isinstance(layer, Repeat):
        one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), one)
      out = jax.eval_shape(self._layer_apply(i, split, rng_names), one, h, broadcast,
                           per_example)
      if isinstance(layer, Repeat) and not _same_type(h, out):
        raise ValueError(
            f"layers[{i}] is a Repeat of {type(layer.module).__name__}, which maps "
            f"{_types(h)} to {_types(out)}; a repeated module must keep its input's structure, "
            "shapes and dtypes.")
      h = out
    in_shapes.append(h)
    return in_shapes

  def _layer_apply(self, i: int, split, rng_names=()):
    """``f(params, h, broadcast, per_example, rngs=None)``: layer ``i`` on one micro-batch, with
    its keyword arguments rebuilt from the arrays (static ones stay Python values). Without
    ``rngs`` (shape and cost passes) the streams ``rng_names`` get a placeholder key."""
    template = _template(self._layer_list()[i])

    def apply(params, h, broadcast, per_example, rngs=None):
      kwargs = self._keywords_for(i, split, broadcast, per_example)
      if rngs is None:
        rngs = {name: jax.random.key(0) for name in rng_names}
      return self._outside_mesh(_apply_layer)(template, {"params": params}, h, kwargs, rngs)

    return apply

  @nn.compact
  def __call__(self, x, **kwargs):
    run_mesh = transform.resolve_mesh(self.mesh, self.num_stages, self.stage_axis)
    batch, micro = transform.microbatch_size(x, self.num_microbatches, run_mesh, self.data_axis)
    known, takes_all = self._keyword_names()
    unknown = sorted(set(kwargs) - known)
    if unknown and not takes_all:
      raise TypeError(f"{_OWNER}: no layer's __call__ takes the keyword argument(s) {unknown}; "
                      f"the layers take {sorted(known)}.")
    split = arguments_lib.split_keywords(kwargs, per_example=self.per_example, batch_size=batch,
                                         owner=_OWNER)
    streams = sorted(name for name in self.scope.rngs if name != "params")
    rngs = {name: self.make_rng(name) for name in streams}
    x_micro = jax.tree.map(lambda a: a[:micro], x)
    per_example_micro = tuple(a[:micro] for a in split.per_example)

    if self.is_initializing():
      self._init_layers(x_micro, split, per_example_micro, rngs)

    params = nn.meta.unbox(dict(self.variables.get("params", {})))
    abstract_side = (_shapes(split.broadcast), _shapes(per_example_micro))
    staged = params.get(STAGED)
    if staged is not None:
      if set(params) != {STAGED}:
        raise ValueError(f"{_OWNER}: params hold {sorted(params)}; staged params are "
                         f"{{'{STAGED}': {{dtype: [R, S, n]}}}} alone.")
      if isinstance(self.balance, str):
        # The split decides what each buffer element means; a balance computed from costs may
        # cut differently for other input shapes, and equal buffer sizes would hide it.
        raise ValueError(f"{_OWNER}: staged params need the split they were made with; build "
                         f"the model with model.with_split(layout) (balance={self.balance!r} "
                         "is computed from costs and could cut the layers differently).")
      param_shapes = self._logical_shapes(_shapes(x_micro), split, abstract_side, streams)
    else:
      self._check_params(params)
      param_shapes = _shapes(params)
    in_shapes = self._layer_inputs(param_shapes, _shapes(x_micro), split, *abstract_side,
                                   rng_names=streams)
    plan = self.plan(param_shapes, in_shapes, split, abstract_side, streams)
    layout = self._layout(plan, param_shapes)
    if staged is None:
      staged = layout.to_staged(params)
    else:
      layout.check_staged(staged, what=f"{_OWNER}'s staged params")

    # BatchNorm statistics, in the same layout as the params (logical or staged).
    stats = nn.meta.unbox(dict(self.variables.get(STATS, {})))
    stats_staged = stats.get(STAGED)
    stats_shapes = self._logical_shapes(_shapes(x_micro), split, abstract_side, streams,
                                        collection=STATS)
    if stats_staged is None:  # Given logical statistics fix the dtypes (float64 references).
      stats_shapes = {k: _shapes(stats[k]) if k in stats else v for k, v in stats_shapes.items()}
    with_stats = sorted(k for k, v in stats_shapes.items() if jax.tree.leaves(v))
    stats_layout = self._layout(plan, stats_shapes) if with_stats else None
    if stats_layout is not None and stats_staged is None:
      missing = sorted(set(with_stats) - set(stats))
      if missing:
        raise ValueError(f"{_OWNER}: layers {missing} have BatchNorm statistics but the variables "
                         f"hold no '{STATS}' for them; pass the '{STATS}' that init returned.")
      stats_staged = stats_layout.to_staged({k: stats.get(k, {}) for k in stats_shapes})
    elif stats_layout is not None:
      stats_layout.check_staged(stats_staged, what=f"{_OWNER}'s staged {STATS}")

    y, pooled, momenta = self._run(plan, layout, staged, stats_layout, stats_staged, x, split,
                                   rngs, in_shapes, run_mesh)
    if momenta and not self.is_initializing():  # Like Flax: init does not update them.
      self._update_statistics(stats, stats_layout, stats_staged, pooled, momenta)
    return y

  def _update_statistics(self, stats, stats_layout, stats_staged, pooled, momenta) -> None:
    """One running-average update per BatchNorm layer, from the statistics pooled over every
    micro-batch and replica of the step: ``E[x]`` and ``E[x^2]``, so the variance is the pooled
    one, ``E[x^2] - E[x]^2``, not a mean of per-micro-batch variances."""
    if not self.is_mutable_collection(STATS):
      raise ValueError(f"{_OWNER}: BatchNorm layers run in training mode update '{STATS}'; call "
                       f"apply(..., mutable=['{STATS}']) (or put them in evaluation mode, "
                       "use_running_average=True).")
    old = stats_layout.to_logical(stats_staged)
    pooled = stats_layout.to_logical(pooled)
    new = {}
    for name, tree in old.items():
      layer = int(name.split("_")[1])

      def update(path, old_value, pooled_value, layer=layer):
        keys = tuple(getattr(k, "key", None) for k in path)
        momentum = momenta.get((layer, keys[:-1]))
        if momentum is None:
          return old_value
        if keys[-1] == "mean":
          return momentum * old_value + (1 - momentum) * pooled_value
        mean = _sibling(pooled[name], keys[:-1], "mean")
        variance = jnp.maximum(pooled_value - mean * mean, 0)
        return momentum * old_value + (1 - momentum) * variance

      new[name] = jax.tree_util.tree_map_with_path(update, tree, pooled[name])
    if STAGED in stats:
      self.put_variable(STATS, STAGED, stats_layout.to_staged(new))
    else:
      for name, tree in new.items():
        if name in stats:
          self.put_variable(STATS, name, tree)

  def _outside_mesh(self, fn):
    """``fn`` with the mesh's axis names bound (to a size-1 ``vmap`` axis), for the passes that
    run outside the pipeline's ``shard_map`` (init, shapes, costs): a layer whose BatchNorm
    pools statistics over ``data`` (``axis_name``) then sees a group of one."""

    def bound(*args, **kwargs):
      run = lambda *a: fn(*a, **kwargs)
      for name in (self.data_axis, self.stage_axis):
        run = jax.vmap(run, in_axes=None, axis_size=1, axis_name=name)
      return jax.tree.map(lambda a: a[0, 0], run(*args))

    return bound

  def _init_layers(self, x_micro, split, per_example_micro, rngs) -> None:
    key = self.make_rng("params")
    apply_outside = self._outside_mesh(_apply_layer)
    h = x_micro
    for i, layer in enumerate(self._layer_list()):
      template = _template(layer)
      kwargs = self._keywords_for(i, split, split.broadcast, per_example_micro)
      layer_key = jax.random.fold_in(key, i)
      other = stage_lib.fold_rngs(rngs, 0, 0)

      def init_one(k, h=h, kwargs=kwargs, template=template):
        return self._outside_mesh(template.init)({"params": k, **other}, h, **kwargs)

      if isinstance(layer, Repeat):
        variables = jax.vmap(init_one)(jax.random.split(layer_key, layer.n))
      else:
        variables = init_one(layer_key)
      extra = sorted(set(variables) - {"params", STATS})
      if extra:
        raise ValueError(f"layers[{i}] ({type(template).__name__}) creates variable "
                         f"collections {extra}; {_OWNER} supports 'params' and BatchNorm's "
                         f"'{STATS}'.")
      layer_params = nn.meta.unbox(variables.get("params", {}))
      self.param(f"layers_{i}", lambda _key, value=layer_params: value)
      if variables.get(STATS):
        self.put_variable(STATS, f"layers_{i}", nn.meta.unbox(variables[STATS]))
      # The next layer's input: this layer applied (every copy of a Repeat) to one micro-batch.
      if isinstance(layer, Repeat):
        one = jax.tree.map(lambda a: a[0], layer_params)
        out = jax.eval_shape(lambda p, h: apply_outside(template, {"params": p}, h, kwargs,
                                                        other), one, h)
        if not _same_type(h, out):
          raise ValueError(
              f"layers[{i}] is a Repeat of {type(template).__name__}, which maps {_types(h)} to "
              f"{_types(out)}; a repeated module must keep its input's structure, shapes and "
              "dtypes.")
        for j in range(layer.n):
          one = jax.tree.map(lambda a, j=j: a[j], layer_params)
          h = apply_outside(template, {"params": one}, h, kwargs, other)
      else:
        h = apply_outside(template, {"params": layer_params}, h, kwargs, other)

  def _check_params(self, params) -> None:
    expected = {f"layers_{i}" for i in range(len(self.layers))}
    if set(params) != expected:
      raise ValueError(f"{_OWNER} expects params {sorted(expected)}, got {sorted(params)}; were "
                       "these variables made for another list of layers?")
    for i, layer in enumerate(self._layer_list()):
      if isinstance(layer, Repeat):
        shapes = [np.shape(a) for a in jax.tree.leaves(params[f"layers_{i}"])]
        if any(s[:1] != (layer.n,) for s in shapes):
          raise ValueError(f"layers_{i} is a Repeat of {layer.n} but its params have shapes "
                           f"{shapes}; expected a leading axis of {layer.n}.")

  def _run(self, plan: Plan, layout, staged, stats_layout, stats_staged, x, split, rngs,
           in_shapes, run_mesh):
    """Runs the schedule. Returns the output, BatchNorm statistics pooled over the step (staged
    ``E[x]`` and ``E[x^2]`` in the place of each mean and var; None without statistics) and the
    momentum of every BatchNorm that ran in training mode, keyed by (layer, module path)."""
    layers = self._layer_list()
    momenta: dict[tuple[int, tuple[str, ...]], float] = {}  # Filled while tracing the chunks.
    num_stages, num_chunks = self.num_stages, layout.num_chunks
    policy = stage_lib.chunk_policy(self.remat, self.remat_granularity)

    # Three formats: the input x (chunk 0 reads it), the ring that crosses the chunk boundaries
    # 1..C-1 (packed per dtype to the largest), and the output (the last chunk's, unpacked).
    bounds = np.concatenate([[0], np.cumsum(plan.counts)])
    unit_input = _unit_inputs(layers, in_shapes)  # abstract input of every unit, and the end.
    ring_layouts = [packing.layout_of(unit_input[b], batch_dims=1) for b in bounds[1:-1]]
    ring_sizes = packing.buffer_sizes(ring_layouts)
    ring_example = {k: jax.ShapeDtypeStruct((n,), jnp.dtype(k)) for k, n in ring_sizes.items()}
    output_example = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                                  unit_input[-1])

    # The tapped module calls of each (chunk, group), recorded while tracing the split chunks
    # (see tpipe.core.taps); the weight-gradient pass W re-applies them.
    tap_calls: dict[tuple[int, int], tuple[taps_lib.TapCall, ...]] = {}

    def make_chunk(c, tapping=False, policy=policy):
      """Chunk ``c`` as the executors call it, under ``jax.checkpoint`` with ``policy`` (none
      when ``policy`` is None); with ``tapping``, the split-backward form ``(..., taps) ->
      (results, records)``, ``records`` per group the tapped calls' inputs and outputs (see
      :class:`tpipe.core.fused.SplitChunk`)."""
      r = c // num_stages

      def chunk(staged, fresh, incoming, broadcast, per_example, rngs, microbatch, taps=None):
        trees = layout.chunk_params({k: v[r] for k, v in staged["params"].items()}, c)
        # Cheap to take again: never saved for the backward pass (see tpipe.core.stage).
        trees = checkpoint_name(trees, stage_lib.CHUNK_PARAMS_NAME)
        if stats_layout is None:
          stats = [{} for _ in trees]
        else:
          stats = stats_layout.chunk_params({k: v[r] for k, v in staged["stats"].items()}, c)
        h = fresh if c == 0 else packing.unpack(incoming, ring_layouts[c - 1])
        runs = []
        for gi, (g, p, s) in enumerate(zip(layout.groups[c], trees, stats)):
          template = _template(layers[g.layer])

          def apply(p, s, h, unit, t, g=g, gi=gi, template=template):
            kwargs = self._keywords_for(g.layer, split, broadcast, per_example)
            unit_rngs = stage_lib.fold_rngs(rngs, unit, microbatch)
            if not tapping:
              return _apply_recording(template, p, s, h, kwargs, unit_rngs, g.layer, momenta), ()
            with taps_lib.Tapper(t) as tapper:
              out = _apply_recording(template, p, s, h, kwargs, unit_rngs, g.layer, momenta)
            tap_calls[(c, gi)] = tuple(tapper.calls)
            return out, (tapper.inputs, tapper.outputs)

          group_taps = None if taps is None else taps[gi]

          def step(h, xs, apply=apply):
            (h, unit_sums), unit_records = apply(xs[0], xs[1], h, xs[2], xs[3])
            return h, (unit_sums, unit_records)

          if g.repeated:
            units = g.first_unit + jnp.arange(g.stop - g.start)
            runs.append((step, (p, s, units, group_taps), g.stop - g.start))
          else:
            runs.append((step, (p, s, g.first_unit, group_taps), None))
        # Checkpoints pieces of the chunk as remat_granularity says (none for "chunk").
        h, outs = stage_lib.apply_units(h, runs, self.remat, self.remat_granularity)
        sums = [out[0] for out in outs]
        records = [out[1] for out in outs]
        rows = jax.tree.leaves(fresh)[0].shape[0]
        if c == num_chunks - 1:
          results = (packing.empty(ring_sizes, rows), h)
        else:
          zeros = jax.tree.map(lambda s: jnp.zeros((rows,) + s.shape, s.dtype), output_example)
          results = (packing.pack(h, ring_layouts[c], ring_sizes), zeros)
        if tapping:
          inputs = [rec[0] if rec else [] for rec in records]
          outputs = [rec[1] if rec else [] for rec in records]
          return results, (inputs, outputs)
        if stats_layout is None:
          return results
        sums = lax.stop_gradient(sums)
        return results + (packing.pack(sums, stats_layout.chunk_layouts[c],
                                       stats_layout.sizes),)

      if policy is None:
        return chunk
      return jax.checkpoint(chunk, policy=None if policy is _FULL else policy, prevent_cse=False)

    def make_weight_grads(c):
      """``W`` of chunk ``c``: the tapped calls' weight gradients, as staged buffers."""
      r = c // num_stages

      def weight_grads(staged, inputs, output_grads):

        def outputs(staged):
          trees = layout.chunk_params({k: v[r] for k, v in staged["params"].items()}, c)
          return [taps_lib.weight_outputs(tap_calls.get((c, gi), ()), tree, inputs[gi],
                                          stacked=g.repeated)
                  for gi, (g, tree) in enumerate(zip(layout.groups[c], trees))]

        _, vjp = jax.vjp(outputs, staged)
        return vjp(output_grads)[0]

      return weight_grads

    # remat="full" (policy None) checkpoints each chunk, saving only its input.
    chunks = [make_chunk(c, policy=_FULL if policy is None else policy)
              for c in range(num_chunks)]

    def apply_chunk(busy, stage, repeat, staged, fresh, incoming, broadcast, per_example, rngs,
                    microbatch):
      index = jnp.where(busy, repeat * num_stages + stage, -1)
      return gated.switch_call(index, chunks, staged, fresh, incoming, broadcast, per_example,
                               rngs, microbatch)

    if self.is_fused():
      if stats_layout is not None:
        raise ValueError(f"{_OWNER}: schedule={self.schedule!r} does not support BatchNorm "
                         f"statistics ('{STATS}'); use schedule='gpipe' or 'circular'.")
      _check_per_example_losses(self.schedule, unit_input[-1])
      schedule = self.schedule_table()
      if self.schedule == "zbv":
        # ZB-V's second chunks run back up the stages; the forward executor's ring wants them in
        # loop order (chunk S + s on stage s), one permutation of the second repeat away.
        to_loop = lambda staged: {"params": {k: jnp.concatenate([a[:1], a[1:, ::-1]], axis=0)
                                             for k, a in staged["params"].items()}}
      else:
        to_loop = lambda staged: staged
      forward = (schedules_lib.gpipe(self.num_stages, self.num_microbatches)
                 if schedule.num_chunks == 1 else
                 schedules_lib.circular(self.num_stages, self.num_microbatches,
                                        schedule.num_chunks))

      def loss_only(staged, x, broadcast, per_example, rngs):
        """Without gradients: the forward ticks of GPipe (or the circular schedule), no stash,
        the same mean."""
        losses = executor.run_schedule(
            apply_chunk, to_loop(staged), x, broadcast, per_example, rngs,
            ring_example=ring_example, output_example=output_example, schedule=forward,
            mesh=run_mesh, stage_axis=self.stage_axis, data_axis=self.data_axis)
        return jnp.mean(losses)

      # A backward tick recomputes its chunk's forward from the stashed input under jax.vjp:
      # that is remat="full" already, and checkpointing the chunk again inside the tick would
      # run the forward twice for the same peak. Other policies decide what the tick keeps.
      tick_chunks = [make_chunk(c, policy=policy) for c in range(num_chunks)]
      split_chunks = None
      if fused.is_split(schedule):
        split_chunks = [fused.SplitChunk(forward=make_chunk(c, tapping=True, policy=policy),
                                         weight_grads=make_weight_grads(c))
                        for c in range(num_chunks)]
      loss = fused.fused_loss(
          tick_chunks, {"params": staged}, x, split.broadcast, split.per_example, rngs,
          ring_example=ring_example, schedule=schedule, mesh=run_mesh,
          stage_axis=self.stage_axis, data_axis=self.data_axis, loss_only=loss_only,
          split_chunks=split_chunks)
      return loss, None, {}

    staged = {"params": staged}
    sum_example = None
    if stats_layout is not None:
      staged["stats"] = stats_staged
      sum_example = {k: jax.ShapeDtypeStruct((n,), jnp.dtype(k))
                     for k, n in stats_layout.sizes.items()}
    results = executor.run_schedule(
        apply_chunk, staged, x, split.broadcast, split.per_example, rngs,
        ring_example=ring_example, output_example=output_example,
        schedule=self.schedule_table(), mesh=run_mesh, stage_axis=self.stage_axis,
        data_axis=self.data_axis, sum_example=sum_example)
    if stats_layout is None:
      return results, None, {}
    y, sums = results
    replicas = dict(run_mesh.shape).get(self.data_axis, 1)
    count = self.num_microbatches * replicas
    return y, jax.tree.map(lambda a: a / count, sums), momenta


# jax.checkpoint's policy for remat="full" is None; this sentinel asks make_chunk for that
# checkpoint, where None means no checkpoint at all.
_FULL = object()


def _apply_recording(template, params, stats, h, kwargs, rngs, layer: int, momenta: dict):
  """Applies a layer to one micro-batch; returns its output and, shaped like its BatchNorm
  statistics ``stats``, each training-mode BatchNorm's ``E[x]`` (in the place of ``mean``) and
  ``E[x^2]`` (of ``var``) over the micro-batch, zeros elsewhere. Records those BatchNorms'
  momenta in ``momenta`` (at trace time)."""
  seen = {}

  def interceptor(next_fun, args, call_kwargs, context):
    module = context.module
    if isinstance(module, nn.BatchNorm) and context.method_name == "__call__":
      use_running = args[1] if len(args) > 1 else call_kwargs.get("use_running_average")
      use_running = nn.merge_param("use_running_average", module.use_running_average,
                                   use_running)
      if not use_running:
        if call_kwargs.get("mask") is not None:
          raise ValueError(f"{_OWNER}: BatchNorm with a mask is not supported; the statistics "
                           "pooled over micro-batches would need the mask's counts.")
        x = args[0]
        x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        feature = {a % x.ndim for a in ((module.axis,) if isinstance(module.axis, int)
                                        else module.axis)}
        reduce = tuple(a for a in range(x.ndim) if a not in feature)
        path = tuple(module.scope.path)
        seen[path] = (x.mean(reduce), (x * x).mean(reduce))
        momenta[(layer, path)] = float(module.momentum)
    return next_fun(*args, **call_kwargs)

  variables = {"params": params, **({STATS: stats} if jax.tree.leaves(stats) else {})}
  with nn.intercept_methods(interceptor):
    out = _apply_layer(template, variables, h, kwargs, rngs)

  def contribution(path, value):
    keys = tuple(getattr(k, "key", None) for k in path)
    if keys[:-1] not in seen:
      return jnp.zeros_like(value)
    mean, mean_of_squares = seen[keys[:-1]]
    return (mean if keys[-1] == "mean" else mean_of_squares).astype(value.dtype)

  return out, jax.tree_util.tree_map_with_path(contribution, stats)


def _check_per_example_losses(schedule: str, output) -> None:
  """A fused schedule needs the last layer to return one float loss per example."""
  leaves = jax.tree.leaves(output)
  if (len(leaves) != 1 or len(leaves[0].shape) != 1
      or not jnp.issubdtype(leaves[0].dtype, jnp.floating)):
    raise ValueError(
        f"{_OWNER} with schedule={schedule!r} returns the mean loss, so its last layer must "
        f"return per-example losses, one float array [batch]; it returns {_types(output)} per "
        "micro-batch. End the stack with a layer that computes each example's loss (targets "
        "passed with per_example=('targets',)), or use schedule='gpipe' for other outputs.")


def _sibling(tree, keys, name):
  for key in keys:
    tree = tree[key]
  return tree[name]


def _apply_layer(template, variables, h, kwargs, rngs):
  """A layer's output; BatchNorm statistics it would update (training mode) are dropped, and
  missing ones are created (shape and cost passes run without them)."""
  return template.apply(variables, h, **kwargs, rngs=rngs, mutable=[STATS])[0]


def _shapes(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def _unit_inputs(layers, in_shapes) -> list:
  """The abstract input of every unit (and, last, the stack's output): a Repeat's copies all take
  the same type."""
  out = []
  for layer, shape in zip(layers, in_shapes[:-1]):
    out += [shape] * (layer.n if isinstance(layer, Repeat) else 1)
  return out + [in_shapes[-1]]


def _types(tree):
  return jax.tree.map(lambda a: (tuple(np.shape(a)), str(np.dtype(a.dtype))), tree)


def _same_type(a, b) -> bool:
  return jax.tree.structure(a) == jax.tree.structure(b) and _types(a) == _types(b)

