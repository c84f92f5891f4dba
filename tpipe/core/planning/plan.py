"""Planning a layer sequence: the type of every unit's input, each unit's cost, and the cut into
chunks.

A sequence of :class:`~tpipe.core.base.layers.Layer` is expanded into **units** (a layer repeated
``n`` times counts ``n``) and cut into ``S * R`` contiguous **chunks** balanced by cost
(:func:`tpipe.partition.balanced_split`) or as the spec's explicit counts say. Model chunk ``c``
runs on the stage the schedule's placement gives it, so the layers are met in order. A
:class:`Plan` holds the result for one input type: unit names and costs, units per chunk, and per
chunk its units grouped by layer (:class:`Group`).

Shapes are found by evaluating each layer abstractly on one micro-batch
(:func:`trace_inputs`); a layer that fails on the previous one's output is reported with both.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tpipe import partition
from tpipe import schedules
from tpipe import spec as spec_lib
from tpipe.core.base import layers as layers_lib
from tpipe.core.planning import unit_cost
from tpipe.schedules import derived_costs


@dataclasses.dataclass(frozen=True)
class Group:
  """Consecutive units of one layer inside one chunk: a plain layer, or a slice of a repeated one.

  Attributes:
    layer: the layer's index in the sequence (its variables are ``layers_{layer}``).
    first_unit: the global index of the group's first unit (RNG streams are folded by it).
    start: the first copy of a repeated layer in this group (0 for a plain layer).
    stop: one past the last copy (1 for a plain layer).
    repeated: whether the layer is repeated (its variables have a leading copy axis).
  """

  layer: int
  first_unit: int
  start: int
  stop: int
  repeated: bool

  @property
  def size(self) -> int:
    return self.stop - self.start


def group_units(copies: Sequence[int | None],
                counts: Sequence[int]) -> tuple[tuple[Group, ...], ...]:
  """Cuts a layer sequence into chunks of ``counts`` units, grouped by layer.

  Args:
    copies: per layer, its number of copies, or None for a plain layer (one unit).
    counts: units per chunk, in order; they sum to the number of units.

  Returns:
    Per chunk, its groups in order.

  Example::

    >>> [[(g.layer, g.start, g.stop) for g in chunk] for chunk in group_units([None, 4, None],
    ...                                                                       [2, 2, 2])]
    [[(0, 0, 1), (1, 0, 1)], [(1, 1, 3)], [(1, 3, 4), (2, 0, 1)]]
  """
  unit_layer = []
  for i, n in enumerate(copies):
    unit_layer += [(i, j) for j in range(1 if n is None else n)]
  if sum(counts) != len(unit_layer):
    raise ValueError(f"counts {tuple(counts)} sum to {sum(counts)}, not the {len(unit_layer)} "
                     "units of the layers.")
  groups, start = [], 0
  for count in counts:
    chunk = []
    for u in range(start, start + count):
      i, j = unit_layer[u]
      if chunk and chunk[-1].layer == i:
        chunk[-1] = dataclasses.replace(chunk[-1], stop=j + 1)
      else:
        chunk.append(Group(layer=i, first_unit=u, start=j, stop=j + 1,
                           repeated=copies[i] is not None))
    groups.append(tuple(chunk))
    start += count
  return tuple(groups)


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """How a layer sequence is cut into chunks for one input type.

  Attributes:
    unit_names: a name per unit (``layers_3[7] Block`` for copy 7 of layer 3).
    costs: the cost of every unit under the balance used (parameter counts for explicit counts).
    counts: units per model chunk, in model-chunk order.
    groups: per model chunk, its units grouped by layer.
    layer_inputs: the abstract input of every layer on one micro-batch, and last the sequence's
      output.
    num_stages: S.
    placement: where model chunks live (see :func:`tpipe.schedules.actions.virtual_stages`).
    tick_costs: a fused schedule's per-action costs derived from the units' measured FLOPs
      (:mod:`tpipe.schedules.derived_costs`), for its compound ticks; None where the spec gives
      them (or ``"plain"``) or the schedule is a forward one.
  """

  unit_names: tuple[str, ...]
  costs: tuple[float, ...]
  counts: tuple[int, ...]
  groups: tuple[tuple[Group, ...], ...]
  layer_inputs: tuple[Any, ...]
  num_stages: int
  placement: str = "loop"
  tick_costs: tuple[tuple[str, float], ...] | None = None

  @property
  def num_chunks(self) -> int:
    return len(self.counts)

  def chunk_input(self, chunk: int):
    """The abstract input of model chunk ``chunk`` (one micro-batch)."""
    return self.layer_inputs[self.groups[chunk][0].layer]

  def chunk_output(self, chunk: int):
    """The abstract output of model chunk ``chunk``: the next chunk's input, or the output."""
    if chunk == self.num_chunks - 1:
      return self.layer_inputs[-1]
    return self.chunk_input(chunk + 1)

  def stage_of(self, chunk: int) -> int:
    """The stage model chunk ``chunk`` runs on."""
    num_repeats = self.num_chunks // self.num_stages
    vstage = schedules.actions.virtual_stages(self.placement, self.num_stages, num_repeats)
    return int(np.argwhere(vstage == chunk)[0][0])

  def describe(self) -> str:
    """A table of the chunks: units, cost and share; with several chunks per stage, where each
    chunk runs."""
    text = partition.describe_split(self.counts, self.costs, names=self.unit_names)
    if self.num_chunks != self.num_stages:
      where = ", ".join(f"chunk {c} -> stage {self.stage_of(c)}" for c in range(self.num_chunks))
      text = f"{text}\n({self.placement} placement: {where})"
    if self.tick_costs is not None:
      text = f"{text}\n{derived_costs.describe(self.tick_costs, derived=True)}"
    return text


class Calls(NamedTuple):
  """How the layers are called while a sequence is planned.

  Attributes:
    split: the keyword arguments (:class:`tpipe.core.base.arguments.SplitArguments`).
    side: ``(broadcast, per_example)`` abstract arrays (a micro-batch of the per-example ones).
    rng_names: the random streams the layers get (a placeholder key each).
    owner: the API the user called, for messages.
    axis_names: the mesh axes to bind outside the pipeline (see
      :func:`tpipe.core.base.layers.outside_mesh`).
  """

  split: Any
  side: tuple = ((), ())
  rng_names: tuple = ()
  owner: str = "tpipe"
  axis_names: tuple = ()


class Traced(NamedTuple):
  """What tracing a sequence on one micro-batch found (:func:`trace_inputs`).

  Attributes:
    layer_inputs: the abstract input of every layer, and last the sequence's output.
    momenta: ``{(layer index, path): momentum}`` of every normalization that ran in training
      mode (:attr:`tpipe.core.base.layers.Layer.apply_with_momenta`) on the keywords traced; the
      engine traces each call that updates running statistics for them (a layer's mode
      follows the call's keywords, e.g. ``train=True``).
    adding: the indices of the layers that sowed auxiliary losses or metrics on the call traced
      (:attr:`tpipe.core.base.layers.Layer.apply_with_aux_values`;
      :mod:`tpipe.core.planning.aux_losses`).
    aux_names: every name they sowed, sorted.
  """

  layer_inputs: tuple[Any, ...]
  momenta: dict
  adding: tuple[int, ...] = ()
  aux_names: tuple[str, ...] = ()


def trace_inputs(layers, param_shapes, stats_shapes, x_micro, calls: Calls) -> Traced:
  """The abstract input of every layer on one micro-batch, the sequence's output, and the
  normalizations' momenta (:class:`Traced`).

  Args:
    layers: the :class:`~tpipe.core.base.layers.Layer` sequence.
    param_shapes: ``{"layers_i": tree}``, abstract, a repeated layer's stacked.
    stats_shapes: the same for running statistics (``{}`` entries without).
    x_micro: the abstract input on one micro-batch.
    calls: how the layers are called (:class:`Calls`).

  Raises:
    ValueError: a repeated layer changes its input's type, or a layer fails on the previous
      layer's output (the message names both layers and the type that did not fit).
  """
  inputs, momenta, adding, names, h = [], {}, [], set(), x_micro
  for i, layer in enumerate(layers):
    inputs.append(h)
    params, stats = param_shapes[f"layers_{i}"], stats_shapes.get(f"layers_{i}", {})
    if layer.copies is not None:
      params, stats = layers_lib.one_copy(params), layers_lib.one_copy(stats)
    out, found, sown = _abstract_call(layer, params, stats, h, calls,
                                      where=failure_message(layers, i, calls.owner))
    momenta.update({(i, path): m for path, m in found.items()})
    adding += [i] if sown else []
    names.update(sown)
    check_repeated(layers, i, h, out, calls.owner)
    h = out
  inputs.append(h)
  return Traced(tuple(inputs), momenta, tuple(adding), tuple(sorted(names)))


def check_repeated(layers, i: int, h, out, owner: str) -> None:
  """Raises when ``layers[i]`` is repeated but maps its input ``h`` to ``out`` of another type
  (the copies could not be chained)."""
  layer = layers[i]
  if layer.copies is not None and not layers_lib.same_type(h, out):
    raise ValueError(
        f"{owner}: layers[{i}] repeats {layer.kind}, which maps {layers_lib.types(h)} to "
        f"{layers_lib.types(out)}; a repeated layer must keep its input's structure, shapes "
        "and dtypes.")


def failure_message(layers, i: int, owner: str) -> str:
  """The start of the message when layer ``i`` fails on its input: it names both layers."""
  source = (f"the output of layers[{i - 1}] ({layers[i - 1].kind})" if i else
            "the pipeline's input")
  return f"{owner}: layers[{i}] ({layers[i].kind}) failed on {source}"


def located(error: Exception, where: str, h) -> Exception:
  """``error`` again, its message prefixed with ``where`` (see :func:`failure_message`) and the
  shapes of the input ``h`` the layer failed on."""
  return type(error)(f"{where}, {layers_lib.types(h)}: {type(error).__name__}: {error}")


def abstract_output(layer, params, stats, h, calls: Calls, where: str = ""):
  """``layer``'s abstract output on one copy's ``params``/``stats`` and input ``h``, called as
  ``calls`` says; ``where`` names the layer in a failure's message."""
  return _abstract_call(layer, params, stats, h, calls, where)[0]


def _abstract_call(layer, params, stats, h, calls: Calls, where: str = ""):
  """``(abstract output, {path: momentum}, names)``: :func:`abstract_output`, the momenta its
  trace found (empty for a layer without running statistics), and the names of the auxiliary
  losses and metrics the layer sowed on it (empty when none). One trace, except for a layer with
  running statistics that may sow auxiliary values (its momenta and its values come from two
  apply functions)."""
  rngs = {name: jax.random.key(0) for name in calls.rng_names}
  found, sown = [], []  # Static: they leave the abstract traces as Python values.

  def measuring(params, stats, h, kwargs, rngs):
    y, contributions, momenta = layer.apply_with_momenta(params, stats, h, kwargs, rngs)
    found.append(momenta)
    return y, contributions

  def adding(params, stats, h, kwargs, rngs):
    y, contributions, added = layer.apply_with_aux_values(params, stats, h, kwargs, rngs)
    sown.append(tuple(added or ()))
    return y, contributions

  has_stats = layer.apply_with_momenta is not None and bool(jax.tree.leaves(stats))
  may_add = layer.apply_with_aux_values is not None
  passes = [measuring] if has_stats else []
  passes += [adding] if may_add else []

  def run(apply):
    apply = layers_lib.outside_mesh(apply, calls.axis_names)

    def call(params, stats, h, broadcast, per_example):
      kwargs = layers_lib.layer_keywords(layer, calls.split, broadcast, per_example)
      return apply(params, stats, h, kwargs, rngs)[0]

    return jax.eval_shape(call, params, stats, h, *calls.side)

  try:
    out = [run(apply) for apply in passes or [layer.apply]][0]
  except (TypeError, ValueError) as error:
    if not where:
      raise
    raise located(error, where, h) from error
  return out, found[0] if found else {}, frozenset().union(*sown)


def unit_costs(layers, kind: str, param_shapes, stats_shapes, layer_inputs,
               calls: Calls) -> tuple[float, ...]:
  """The cost of every unit under ``kind`` (``"params"``, ``"flops"`` or ``"time"``).

  A repeated layer's copies are measured once, as one copy, and count that cost each. FLOPs and
  times are cached per distinct layer, input and keywords
  (:func:`tpipe.core.planning.unit_cost.cost`).
  """
  costs = []
  for i, layer in enumerate(layers):
    if kind == "params":
      params = param_shapes[f"layers_{i}"]
      if layer.copies is not None:
        params = layers_lib.one_copy(params)
      cost = float(sum(np.prod(a.shape) for a in jax.tree.leaves(params)))
    else:
      apply, params, identity = _unit_program(layers, i, param_shapes, stats_shapes, calls)
      cost = unit_cost.cost(kind, apply, params, layer_inputs[i], calls.side,
                            identity=identity)
    costs += [cost] * layer.units
  return tuple(costs)


def action_flops(layers, param_shapes, stats_shapes, layer_inputs,
                 calls: Calls) -> dict[str, float]:
  """The model's FLOPs on one micro-batch split by action part (forward, input gradients,
  weight gradients; :func:`tpipe.core.planning.unit_cost.action_flops`), summed over its units."""
  total = dict.fromkeys(unit_cost.PARTS, 0.0)
  for i, layer in enumerate(layers):
    apply, params, identity = _unit_program(layers, i, param_shapes, stats_shapes, calls)
    parts = unit_cost.action_flops(apply, params, layer_inputs[i], calls.side,
                                   identity=identity)
    for name in total:
      total[name] += parts[name] * layer.units
  return total


def _unit_program(layers, i: int, param_shapes, stats_shapes, calls: Calls):
  """``(apply, params, identity)``: unit ``i``'s ``apply(params, h, broadcast, per_example)``
  on one copy's abstract parameters, and its identity for the cost cache (None: uncached)."""
  layer = layers[i]
  params, stats = param_shapes[f"layers_{i}"], stats_shapes.get(f"layers_{i}", {})
  if layer.copies is not None:
    params, stats = layers_lib.one_copy(params), layers_lib.one_copy(stats)
  split, side, rng_names = calls.split, calls.side, calls.rng_names
  rngs = {name: jax.random.key(0) for name in rng_names}
  bound = layers_lib.outside_mesh(layer.apply, calls.axis_names)

  def apply(params, h, broadcast, per_example):
    kwargs = layers_lib.layer_keywords(layer, split, broadcast, per_example)
    # Statistics are shapes here; zeros of those shapes cost what the real ones do.
    values = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), stats)
    return bound(params, values, h, kwargs, rngs)[0]

  keywords = layers_lib.layer_keywords(layer, split, *side)
  identity = (None if layer.identity is None else
              (layer.identity, unit_cost.abstract_key(keywords), tuple(rng_names),
               unit_cost.abstract_key(stats)))
  return apply, params, identity


def make_plan(layers, spec: spec_lib.PipelineSpec, param_shapes, stats_shapes, traced: Traced,
              calls: Calls) -> Plan:
  """Chooses the chunks for ``spec`` (see :class:`Plan`) from what :func:`trace_inputs`
  found; with an explicit balance the costs shown are parameter counts.

  Raises:
    ValueError: fewer units than chunks, or explicit counts that do not sum to the units.
  """
  num_units = sum(layer.units for layer in layers)
  if num_units < spec.num_chunks:
    raise ValueError(
        f"the layers have {num_units} units but num_stages * num_repeats = {spec.num_chunks} "
        "chunks need at least one each; use fewer stages or repeats, or more layers.")
  kind = spec.balance if isinstance(spec.balance, str) else "params"
  layer_inputs = traced.layer_inputs
  costs = unit_costs(layers, kind, param_shapes, stats_shapes, layer_inputs, calls)
  if isinstance(spec.balance, str):
    counts = partition.balanced_split(costs, spec.num_chunks)
  else:
    counts = partition.check_balance(spec.balance, num_units, spec.num_chunks)
  groups = group_units([layer.copies for layer in layers], counts)
  derived = None
  if spec.is_fused and spec.tick_costs is None:  # Compound ticks for the measured costs.
    flops = action_flops(layers, param_shapes, stats_shapes, layer_inputs, calls)
    derived = derived_costs.from_flops(flops, spec.remat, spec.remat_granularity,
                                       spec.weight_recompute)
  return Plan(unit_names=layers_lib.unit_names(layers), costs=costs, counts=tuple(counts),
              groups=groups, layer_inputs=tuple(layer_inputs), num_stages=spec.num_stages,
              placement=spec.placement, tick_costs=derived)
