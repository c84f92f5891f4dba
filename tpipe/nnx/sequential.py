"""``tpipe.nnx.Sequential``: a sequence of Flax NNX layers, pipelined like ``tpipe.Sequential``.

The NNX front end owns no executor. At every call each layer is split into its graph definition
and its ``nnx.Param`` state (``nnx.split``); a small linen module per layer (:class:`_LayerAsLinen`)
holds that state as its linen parameters (one per top-level attribute, so the linen logical
layout ``layers_i`` has the NNX names) and, when applied, rebuilds the layer with ``nnx.merge``
and calls it. The linen :class:`tpipe.Sequential` then plans, packs and runs the
schedule on those linen layers exactly as it runs any other. Everything is a pure function of the
``Param`` values, so ``nnx.grad``/``nnx.value_and_grad`` of a function of ``model(x)`` give the
gradients of the layers' parameters, and ``nnx.Optimizer`` updates them in place.

Parameter state keeps the NNX layout whatever the pipeline: ``nnx.state(model, nnx.Param)`` holds
``layers[i]`` with the layer's own attribute names, a :class:`Repeat`'s copies stacked on a
leading axis (``layers[i].layer``), independent of stages, balance, schedule and repeats.

Example::

  rngs = nnx.Rngs(0)
  model = tpipe.nnx.Sequential(
      [Embed(vocab, width, rngs=rngs),
       tpipe.nnx.Repeat(lambda rngs: Block(width, rngs=rngs), 24, rngs=rngs),
       HeadLoss(vocab, width, rngs=rngs)],
      num_stages=4, num_microbatches=16, per_example=("targets",), mesh=mesh)
  losses = model(tokens, targets=targets)                       # [batch]
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh

from tpipe.linen import sequential as linen_sequential
from tpipe.linen import transform
from tpipe.nnx import placement
from tpipe.parallel import mesh as mesh_lib

_OWNER = "tpipe.nnx.Sequential"
# The linen RNG stream that carries the Sequential's per-call key to the layers' RNG streams
# (the stream the trainer passes to linen models too).
RNG_STREAM = "dropout"
# The linen collection the adapters expose nnx.BatchNorm's running averages (nnx.BatchStat) in.
STATS = linen_sequential.STATS


class Repeat(nnx.Module):
  """``n`` copies of the layer ``make_layer(rngs)`` makes, each with its own parameters.

  The copies are created with ``nnx.vmap`` over ``nnx.split_rngs(splits=n)`` (NNX's pattern for
  stacked layers), so every ``nnx.Param`` of ``self.layer`` has a leading axis of length ``n``.
  Called on its own, a ``Repeat`` applies the copies in order with one ``lax.scan``; in a
  :class:`Sequential` it counts as ``n`` layer units and may be cut between stages. The layer must
  map its input to an output of the same structure, shapes and dtypes.

  Args:
    make_layer: ``rngs -> nnx.Module``, e.g. ``lambda rngs: Block(width, rngs=rngs)``.
    n: the number of copies.
    rngs: the ``nnx.Rngs`` the copies are initialised from (split ``n`` ways).
  """

  def __init__(self, make_layer: Callable[[nnx.Rngs], nnx.Module], n: int, *, rngs: nnx.Rngs):
    if isinstance(make_layer, nnx.Module) or not callable(make_layer):
      raise TypeError(f"tpipe.nnx.Repeat takes a function rngs -> layer, got {make_layer!r}; "
                      "write tpipe.nnx.Repeat(lambda rngs: Block(width, rngs=rngs), n, "
                      "rngs=rngs).")
    transform.check_count("tpipe.nnx.Repeat n", n)
    if not isinstance(rngs, nnx.Rngs):
      raise TypeError(f"tpipe.nnx.Repeat needs rngs=nnx.Rngs(...), got {rngs!r}.")

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      layer = make_layer(rngs)
      if not isinstance(layer, nnx.Module):
        raise TypeError(f"tpipe.nnx.Repeat: make_layer returned {layer!r}; it must return an "
                        "nnx.Module.")
      return layer

    self.layer = create(rngs)
    self.n = n

  def __call__(self, x, **kwargs):
    graphdef, params, stats, rng_state = _split(self.layer, "tpipe.nnx.Repeat")
    if jax.tree.leaves(rng_state):
      raise ValueError("tpipe.nnx.Repeat: the repeated layer has RNG streams (e.g. nnx.Dropout); "
                       "a Repeat applies them only inside tpipe.nnx.Sequential, which draws "
                       "their keys from its own rngs.")

    def step(h, copy):
      layer = nnx.merge(graphdef, *copy)
      return layer(h, **kwargs), nnx.state(layer, nnx.BatchStat)

    y, new_stats = lax.scan(step, x, (params, stats))
    nnx.update(self.layer, new_stats)  # Each copy's BatchNorm updated once, as in plain NNX.
    return y


def _batch_norm_paths(layer: nnx.Module) -> tuple[tuple[Any, ...], ...]:
  """The graph paths of the ``nnx.BatchNorm`` modules in ``layer``, in graph order."""
  return tuple(tuple(path) for path, node in nnx.iter_graph(layer)
               if isinstance(node, nnx.BatchNorm))


def _split(layer: nnx.Module, where: str):
  """``layer``'s graph definition and its ``Param``, ``BatchStat`` (``nnx.BatchNorm``'s running
  averages) and RNG states (``nnx.RngKey``/``RngCount``, e.g. an ``nnx.Dropout``'s stream);
  raises for any other state, and for a ``BatchStat`` outside an ``nnx.BatchNorm``."""
  graphdef, params, stats, rng_state, rest = nnx.split(layer, nnx.Param, nnx.BatchStat,
                                                       nnx.RngState, ...)
  if jax.tree.leaves(rest):
    kinds = sorted({type(v).__name__ for v in
                    jax.tree.leaves(rest, is_leaf=lambda v: isinstance(v, nnx.Variable))})
    raise ValueError(
        f"{where}: {type(layer).__name__} holds NNX state other than nnx.Param, nnx.BatchNorm "
        f"statistics and RNG streams ({', '.join(kinds)}: "
        f"{[p for p, _ in nnx.to_flat_state(rest)][:4]}). tpipe.nnx cannot give other mutable "
        "nnx.Variables pipeline semantics; keep such state outside the pipelined layers.")
  expected = {path + (name,) for path in _batch_norm_paths(layer) for name in ("mean", "var")}
  stray = sorted(set(tuple(p) for p, _ in nnx.to_flat_state(stats)) - expected, key=str)
  if stray:
    raise ValueError(
        f"{where}: {type(layer).__name__} has nnx.BatchStat variables outside an nnx.BatchNorm "
        f"({stray[:4]}); tpipe.nnx pools the statistics of nnx.BatchNorm layers only.")
  return graphdef, params, stats, rng_state


def _split_params(layer: nnx.Module, where: str):
  """``layer``'s graph definition, ``Param`` state and RNG state as pure dicts (BatchNorm
  statistics are read and written through :func:`_batch_norms`)."""
  graphdef, params, _, rng_state = _split(layer, where)
  return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(rng_state)


def _stats_name(path: tuple[Any, ...]) -> str:
  """The linen name of the running averages of the BatchNorm at graph ``path``: ``"norm.stats"``,
  ``"blocks.0.norm.stats"``. The dot keeps it apart from the parameters' names (attributes)."""
  return ".".join(str(key) for key in path + ("stats",))


def _batch_norms(layer: nnx.Module) -> dict[str, nnx.BatchNorm]:
  """The ``nnx.BatchNorm`` modules of ``layer`` by linen name (:func:`_stats_name`)."""
  return {_stats_name(tuple(path)): node for path, node in nnx.iter_graph(layer)
          if isinstance(node, nnx.BatchNorm)}


def _rng_slots(rng_state) -> tuple[tuple[tuple[Any, ...], str], ...]:
  """The path and kind (``"key"`` or ``"count"``) of every RNG variable in a pure RNG state."""
  slots = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(rng_state):
    keys = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)
    is_key = jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)
    slots.append((keys, "key" if is_key else "count"))
  return tuple(slots)


def _nested(items) -> dict:
  out = {}
  for path, value in items:
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return out


class _RunningAverages(nn.BatchNorm):
  """The linen face of one ``nnx.BatchNorm``: its running averages as the ``batch_stats``
  variables ``mean`` and ``var`` of this scope.

  It is an ``nn.BatchNorm`` so that the linen engine's BatchNorm hook records its input (``E[x]``
  and ``E[x^2]`` per micro-batch) and momentum in training mode and applies the pooled update once
  per step (see :class:`tpipe.Sequential`); the normalisation itself is the NNX layer's own,
  which ``run(x, mean, var, use_running_average, mask)`` computes with these running averages.
  """

  shape: tuple[int, ...] = ()

  @nn.compact
  def __call__(self, x, use_running_average, *, mask=None, run=None):
    mean = self.variable(STATS, "mean", lambda: jnp.zeros(self.shape, self.param_dtype))
    var = self.variable(STATS, "var", lambda: jnp.ones(self.shape, self.param_dtype))
    return run(x, mean.value, var.value, use_running_average, mask)


class _RecordedBatchNorm(nnx.BatchNorm):
  """An ``nnx.BatchNorm`` (in a layer rebuilt inside an adapter) that takes its running averages
  from, and reports its input to, its :class:`_RunningAverages`; the arithmetic is unchanged."""

  def __call__(self, x, use_running_average=None, *, mask=None):
    mode = use_running_average if use_running_average is not None else self.use_running_average
    if mode is None:  # NNX's own error names the fixes.
      return nnx.BatchNorm.__call__(self, x, use_running_average, mask=mask)

    def run(x, mean, var, mode, mask):
      self.mean[...] = mean
      self.var[...] = var
      return nnx.BatchNorm.__call__(self, x, mode, mask=mask)

    return self.__dict__["_tpipe_running_averages"](x, bool(mode), mask=mask, run=run)


class _LayerAsLinen(nn.Module):
  """A linen view of one NNX layer: its ``Param`` state as linen parameters, one per top-level
  attribute (so the linen names are the NNX ones), and each ``nnx.BatchNorm``'s running averages
  as ``batch_stats`` (``{name: {"mean", "var"}}``, names from :func:`_stats_name`).

  ``graphdef`` is the layer's ``nnx.split`` graph definition (Param, BatchStat, RNG state) and
  ``shapes`` its ``Param`` and ``BatchStat`` states' tree definitions and leaf shapes (one
  copy's, for a Repeat), so ``init`` (which the linen engine runs abstractly, for shapes) returns
  zeros (BatchNorm: zeros and ones) of those shapes. Subclassed per NNX layer class
  (:func:`_linen_class`) so that the keyword arguments its ``__call__`` takes are the layer's.
  """

  graphdef: Any
  shapes: Any
  rng_slots: tuple = ()

  def _apply(self, x, kwargs):
    (param_def, param_leaves), (stats_def, stats_leaves) = self.shapes
    zeros = lambda leaves: [jnp.zeros(a.shape, a.dtype) for a in leaves]
    template = jax.tree.unflatten(param_def, zeros(param_leaves))
    params = {key: self.param(str(key), lambda _key, value=value: value)
              for key, value in template.items()}
    placeholder_stats = jax.tree.unflatten(stats_def, zeros(stats_leaves))
    if not self.rng_slots:
      rng_state = {}
    else:
      # The layer's RNG streams restart, for this unit and micro-batch, from the key the linen
      # engine folded by (unit, micro-batch): the j-th RngKey gets fold_in(key, j), counts 0.
      # Without the stream (the engine's shape and cost passes; deterministic evaluation) a fixed
      # placeholder key, as the linen engine uses for those passes.
      base = (self.make_rng(RNG_STREAM) if self.has_rng(RNG_STREAM) else jax.random.key(0))
      if not jnp.issubdtype(base.dtype, jax.dtypes.prng_key):
        base = jax.random.wrap_key_data(base)
      items, j = [], 0
      for path, kind in self.rng_slots:
        if kind == "key":
          items.append((path, jax.random.fold_in(base, j)))
          j += 1
        else:
          items.append((path, jnp.zeros((), jnp.uint32)))
      rng_state = _nested(items)
    layer = nnx.merge(self.graphdef, params, placeholder_stats, rng_state)
    for name, norm in _batch_norms(layer).items():
      probe = _RunningAverages(momentum=norm.momentum, axis=norm.axis,
                               shape=tuple(norm.mean[...].shape),
                               param_dtype=norm.mean[...].dtype, name=name)
      # The rebuilt layer is this call's own copy: its BatchNorms route through the probes.
      object.__setattr__(norm, "__class__", _RecordedBatchNorm)
      norm.__dict__["_tpipe_running_averages"] = probe
    return layer(x, **kwargs)


@functools.lru_cache(maxsize=None)
def _linen_class(layer_class: type) -> type:
  """A :class:`_LayerAsLinen` subclass whose ``__call__`` has ``layer_class.__call__``'s
  signature (the linen engine routes keyword arguments by it)."""

  def __call__(self, x, **kwargs):
    return self._apply(x, kwargs)

  __call__.__signature__ = inspect.signature(layer_class.__call__)
  return type(f"{layer_class.__name__}AsLinen", (_LayerAsLinen,),
              {"__call__": nn.compact(__call__), "__module__": __name__})


def _as_linen(layer: nnx.Module, where: str):
  """The linen layer (a ``tpipe.Repeat`` for a :class:`Repeat`), its logical linen params and
  its logical ``batch_stats`` (``{}`` without BatchNorm)."""
  target = layer.layer if isinstance(layer, Repeat) else layer
  graphdef, params, stats, rng_state = _split(target, where)
  params, rng_state = nnx.to_pure_dict(params), nnx.to_pure_dict(rng_state)
  drop = 1 if isinstance(layer, Repeat) else 0

  def shapes_of(tree):
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(jax.ShapeDtypeStruct(jnp.shape(a)[drop:], a.dtype) for a in leaves)

  module = _linen_class(type(target))(
      graphdef=graphdef, shapes=(shapes_of(params), shapes_of(nnx.to_pure_dict(stats))),
      rng_slots=_rng_slots(rng_state))
  if isinstance(layer, Repeat):
    module = linen_sequential.Repeat(module, layer.n)
  linen_params = {str(key): value for key, value in params.items()}
  linen_stats = {name: {"mean": norm.mean[...], "var": norm.var[...]}
                 for name, norm in _batch_norms(target).items()}
  return module, linen_params, linen_stats
class _Stack:
  """What :class:`Sequential` and the class :func:`tpipe.nnx.pipeline` makes share: the
  pipeline settings, the linen engine built from the layers (:meth:`_pipeline_layers`) and the
  call. Holds no state of its own."""

  _owner = _OWNER

  def _pipeline_layers(self) -> list[nnx.Module]:
    raise NotImplementedError

  def _configure(self, *, num_stages, num_microbatches, schedule, num_repeats, balance, remat,
                 remat_granularity="chunk",
                 per_example, mesh, stage_axis, data_axis, rngs) -> None:
    """Stores and validates the settings (every one, before any tracing)."""
    if isinstance(per_example, str):
      raise TypeError(f"per_example must be a sequence of keyword names, got the string "
                      f"{per_example!r}; write per_example=({per_example!r},).")
    self.num_stages = num_stages
    self.num_microbatches = num_microbatches
    self.schedule = schedule
    self.num_repeats = num_repeats
    self.balance = balance if isinstance(balance, str) else tuple(balance)
    self.remat = remat
    self.remat_granularity = remat_granularity
    self.per_example = tuple(per_example)
    self.mesh = mesh
    self.stage_axis = stage_axis
    self.data_axis = data_axis
    if rngs is not None and not isinstance(rngs, nnx.Rngs):
      raise TypeError(f"{self._owner}: rngs must be an nnx.Rngs or None, got {rngs!r}.")
    self.rngs = rngs
    engine, _ = self.as_linen()  # Validates every setting now, before any tracing.
    if rngs is None and self._has_rng_streams(engine):
      raise ValueError(f"{self._owner}: a layer has RNG streams (e.g. nnx.Dropout) but the stack "
                       "has no rngs; pass rngs=nnx.Rngs(dropout=...).")

  @staticmethod
  def _has_rng_streams(engine) -> bool:
    modules = [getattr(layer, "module", layer) for layer in engine._layer_list()]
    return any(module.rng_slots for module in modules)

  def as_linen(self) -> tuple[linen_sequential.Sequential, dict]:
    """The linen :class:`tpipe.Sequential` that runs this stack, and the stack's current state
    as its variables, in the linen logical layout.

    ``variables["params"]["layers_i"]`` is layer ``i``'s ``Param`` state as a pure dict with the
    NNX attribute names (a Repeat's stacked on a leading axis), so an NNX model whose attributes
    are named like a linen model's has that model's parameter tree. With BatchNorm layers,
    ``variables["batch_stats"]["layers_i"]`` holds ``{name: {"mean", "var"}}`` per
    ``nnx.BatchNorm`` (``name``: its graph path and ``stats`` joined with dots, ``norm.stats``).
    Use it to train with tpipe's linen tooling (staged layouts, :func:`tpipe.make_train_step`);
    :meth:`load_linen_variables` writes such variables back into the layers.
    """
    modules, params, stats = [], {}, {}
    for i, layer in enumerate(self._pipeline_layers()):
      module, params[f"layers_{i}"], stats[f"layers_{i}"] = _as_linen(
          layer, f"{self._owner} layers[{i}]")
      modules.append(module)
    engine = linen_sequential.Sequential(
        modules, num_stages=self.num_stages, num_microbatches=self.num_microbatches,
        schedule=self.schedule, num_repeats=self.num_repeats,
        balance=self.balance if isinstance(self.balance, str) else list(self.balance),
        remat=self.remat, remat_granularity=self.remat_granularity,
        per_example=self.per_example, mesh=self.mesh,
        stage_axis=self.stage_axis, data_axis=self.data_axis)
    variables = {"params": params}
    if jax.tree.leaves(stats):
      variables[STATS] = stats
    return engine, variables

  def load_linen_variables(self, variables) -> None:
    """Writes ``params`` and ``batch_stats`` in :meth:`as_linen`'s layout into the layers."""
    for i, layer in enumerate(self._pipeline_layers()):
      target = layer.layer if isinstance(layer, Repeat) else layer
      if "params" in variables:
        given = variables["params"][f"layers_{i}"]
        current = nnx.to_pure_dict(nnx.state(target, nnx.Param))
        nnx.update(target, nnx.State({key: given[str(key)] for key in current}))
      for name, norm in _batch_norms(target).items():
        new = variables.get(STATS, {}).get(f"layers_{i}", {}).get(name)
        if new is not None:
          norm.mean[...] = new["mean"]
          norm.var[...] = new["var"]

  def _run(self, x, kwargs):
    engine, variables = self.as_linen()
    resident = placement.resident_layers(self)
    if resident:  # Stage-resident Repeats (tpipe.nnx.shard): each stage packs its own buffer.
      staged = placement.staged_params(self, engine, variables["params"], resident, x, kwargs)
      variables = {**variables, "params": {linen_sequential.STAGED: staged}}
    rngs = {}
    if self._has_rng_streams(engine):
      stream = "dropout" if "dropout" in self.rngs else "default"
      rngs[RNG_STREAM] = self.rngs[stream]()
    if STATS not in variables:
      return engine.apply(variables, x, **kwargs, rngs=rngs)
    # BatchNorm in training mode: one update per call from statistics pooled over every
    # micro-batch and replica (the linen engine's rule), written back into the nnx.BatchNorms.
    y, updated = engine.apply(variables, x, **kwargs, rngs=rngs, mutable=[STATS])
    self.load_linen_variables({STATS: updated[STATS]})
    return y


class Sequential(_Stack, nnx.Module):
  """Applies ``layers`` (NNX modules) in order, pipelined over the ``stage`` axis of a mesh.

  ``model(x, **kwargs)`` equals ``x`` passed through the layers in order, each getting the
  keyword arguments its ``__call__`` names. The schedule, balance and keyword handling are those of
  the linen :class:`tpipe.Sequential`, which runs the layers (see its documentation).

  Args:
    layers: ``nnx.Module`` instances and :class:`Repeat` entries, in order. Each maps the
      previous layer's output (any pytree of arrays, batch first) to its own. Their only state
      may be ``nnx.Param``, ``nnx.BatchNorm`` statistics and RNG streams
      (``nnx.Dropout``).
    num_stages: pipeline stages S; must equal the size of the mesh's stage axis.
    num_microbatches: micro-batches M per data-parallel replica.
    schedule: ``"gpipe"``, ``"circular"`` (``num_repeats`` chunks per stage), or a fused
      schedule (``tpipe.linen.sequential.FUSED_SCHEDULES``, e.g. ``"1f1b"``): the last layer
      then returns per-example losses ``[batch]`` and the stack returns their mean over the
      global batch, a scalar; differentiate it with ``nnx.grad``/``nnx.value_and_grad``.
    num_repeats: chunks per stage R (``"circular"`` only).
    balance: ``"params"``, ``"flops"``, ``"time"`` or a list of unit counts per chunk.
    remat: ``"none"``, ``"full"``, ``"dots"`` or a ``jax.checkpoint`` policy, per chunk.
    remat_granularity: ``"chunk"``, ``"layer"`` or an int ``k``: what is checkpointed with the
      remat policy (see ``tpipe.Sequential``).
    per_example: names of keyword arguments split into micro-batches with ``x``.
    mesh: the device mesh; ``None`` means the ambient mesh, or one device.
    stage_axis: the mesh axis of stages.
    data_axis: the mesh axis of data-parallel replicas.
    rngs: where the layers' random keys come from (needed when a layer has RNG streams, e.g. an
      ``nnx.Dropout(rate, rngs=rngs)``): its ``dropout`` stream, else its default one.

  Randomness: layers' own RNG streams are not advanced inside the pipeline. Each call draws one
  key ``k`` from ``rngs`` (so successive calls differ); unit ``u`` (0-based over all units, a
  Repeat of n counting n) on global micro-batch ``m = replica * M + j`` runs with its ``i``-th
  ``nnx.RngKey`` (in the layer's state order) set to ``fold_in(fold_in(fold_in(k, u), m), i)`` and
  its counts to 0. Masks therefore do not depend on the stage count, balance, schedule or repeats
  (they do depend on M and the data size, which decide the micro-batches).

  Raises:
    TypeError, ValueError: at construction, for a bad layer or configuration value.
  """

  def __init__(self, layers: Sequence[nnx.Module], *, num_stages: int, num_microbatches: int,
               schedule: str = "gpipe", num_repeats: int = 1, balance: Any = "params",
               remat: Any = "full", remat_granularity: Any = "chunk",
               per_example: Sequence[str] = (), mesh: Mesh | None = None,
               stage_axis: str = mesh_lib.STAGE_AXIS, data_axis: str = mesh_lib.DATA_AXIS,
               rngs: nnx.Rngs | None = None):
    if not isinstance(layers, (list, tuple)) or not layers:
      raise TypeError(f"{_OWNER} takes a non-empty list of nnx.Module layers, got {layers!r}.")
    for i, layer in enumerate(layers):
      if not isinstance(layer, nnx.Module) or isinstance(layer, _Stack):
        raise TypeError(f"{_OWNER}: layers[{i}] is {layer!r}; each layer must be an nnx.Module "
                        "instance or a tpipe.nnx.Repeat (for a flax.linen module use "
                        "tpipe.Sequential).")
    self.layers = nnx.List(layers)
    self._configure(num_stages=num_stages, num_microbatches=num_microbatches,
                    schedule=schedule, num_repeats=num_repeats, balance=balance, remat=remat,
                    remat_granularity=remat_granularity,
                    per_example=per_example, mesh=mesh, stage_axis=stage_axis,
                    data_axis=data_axis, rngs=rngs)

  def _pipeline_layers(self) -> list[nnx.Module]:
    return list(self.layers)

  def __call__(self, x, **kwargs):
    return self._run(x, kwargs)
