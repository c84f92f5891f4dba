"""``tpipe.nnx.Sequential``: a sequence of Flax NNX layers, pipelined like ``tpipe.Sequential``.

The NNX front end owns no executor. At every call each layer is split into its graph definition
and its ``nnx.Param`` state (``nnx.split``); a small linen module per layer (:class:`_LayerAsLinen`)
holds that state as its one linen parameter and, when applied, rebuilds the layer with
``nnx.merge`` and calls it. The linen :class:`tpipe.Sequential` then plans, packs and runs the
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
from tpipe.parallel import mesh as mesh_lib

_OWNER = "tpipe.nnx.Sequential"
# The name of the one linen parameter of a layer's adapter: the layer's Param state.
_STATE = "state"
# The linen RNG stream that carries the Sequential's per-call key to the layers' RNG streams.
RNG_STREAM = "nnx"


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
    graphdef, params, rng_state = _split_params(self.layer, "tpipe.nnx.Repeat")
    if jax.tree.leaves(rng_state):
      raise ValueError("tpipe.nnx.Repeat: the repeated layer has RNG streams (e.g. nnx.Dropout); "
                       "a Repeat applies them only inside tpipe.nnx.Sequential, which draws "
                       "their keys from its own rngs.")
    step = lambda h, p: (nnx.merge(graphdef, p)(h, **kwargs), None)
    return lax.scan(step, x, params)[0]


def _split_params(layer: nnx.Module, where: str):
  """``layer``'s graph definition, ``Param`` state and RNG state (``nnx.RngKey``/``RngCount``,
  e.g. an ``nnx.Dropout``'s stream) as pure dicts; raises for any other state."""
  graphdef, params, rng_state, rest = nnx.split(layer, nnx.Param, nnx.RngState, ...)
  if jax.tree.leaves(rest):
    kinds = sorted({type(v).__name__ for v in
                    jax.tree.leaves(rest, is_leaf=lambda v: isinstance(v, nnx.Variable))})
    raise ValueError(
        f"{where}: {type(layer).__name__} holds NNX state other than nnx.Param and RNG streams "
        f"({', '.join(kinds)}: {[p for p, _ in nnx.to_flat_state(rest)][:4]}). tpipe.nnx "
        "pipelines layers whose state is parameters (and dropout streams) for now; BatchNorm "
        "statistics and other mutable nnx.Variables are not supported yet.")
  return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(rng_state)


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


class _LayerAsLinen(nn.Module):
  """A linen view of one NNX layer: its ``Param`` state is the linen parameter ``state``.

  ``graphdef`` is the layer's ``nnx.split`` graph definition and ``shapes`` its ``Param`` state's
  tree definition and leaf shapes (one copy's, for a Repeat), so ``init`` (which the linen engine
  runs abstractly, for shapes) returns zeros of those shapes. Subclassed per NNX layer class
  (:func:`_linen_class`) so that the keyword arguments its ``__call__`` takes are the layer's.
  """

  graphdef: Any
  shapes: Any
  rng_slots: tuple = ()

  def _apply(self, x, kwargs):
    treedef, leaves = self.shapes
    state = self.param(_STATE, lambda _key: jax.tree.unflatten(
        treedef, [jnp.zeros(s.shape, s.dtype) for s in leaves]))
    if not self.rng_slots:
      return nnx.merge(self.graphdef, state)(x, **kwargs)
    # The layer's RNG streams restart, for this unit and micro-batch, from the key the linen
    # engine folded by (unit, micro-batch): the j-th RngKey gets fold_in(key, j), counts 0.
    base = self.make_rng(RNG_STREAM)
    if not jnp.issubdtype(base.dtype, jax.dtypes.prng_key):
      base = jax.random.wrap_key_data(base)
    items, j = [], 0
    for path, kind in self.rng_slots:
      if kind == "key":
        items.append((path, jax.random.fold_in(base, j)))
        j += 1
      else:
        items.append((path, jnp.zeros((), jnp.uint32)))
    return nnx.merge(self.graphdef, state, _nested(items))(x, **kwargs)


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
  """The linen layer (a ``tpipe.Repeat`` for a :class:`Repeat`) and its logical linen params."""
  target = layer.layer if isinstance(layer, Repeat) else layer
  graphdef, params, rng_state = _split_params(target, where)
  leaves, treedef = jax.tree.flatten(params)
  drop = 1 if isinstance(layer, Repeat) else 0
  shapes = (treedef, tuple(jax.ShapeDtypeStruct(jnp.shape(a)[drop:], a.dtype) for a in leaves))
  module = _linen_class(type(target))(graphdef=graphdef, shapes=shapes,
                                      rng_slots=_rng_slots(rng_state))
  if isinstance(layer, Repeat):
    module = linen_sequential.Repeat(module, layer.n)
  return module, {_STATE: params}


class Sequential(nnx.Module):
  """Applies ``layers`` (NNX modules) in order, pipelined over the ``stage`` axis of a mesh.

  ``model(x, **kwargs)`` equals ``x`` passed through the layers in order, each getting the
  keyword arguments its ``__call__`` names. The schedule, balance and keyword handling are those of
  the linen :class:`tpipe.Sequential`, which runs the layers (see its documentation).

  Args:
    layers: ``nnx.Module`` instances and :class:`Repeat` entries, in order. Each maps the
      previous layer's output (any pytree of arrays, batch first) to its own. Their only state
      must be ``nnx.Param`` for now.
    num_stages: pipeline stages S; must equal the size of the mesh's stage axis.
    num_microbatches: micro-batches M per data-parallel replica.
    schedule: ``"gpipe"`` or ``"circular"`` (``num_repeats`` chunks per stage).
    num_repeats: chunks per stage R (``"circular"`` only).
    balance: ``"params"``, ``"flops"``, ``"time"`` or a list of unit counts per chunk.
    remat: ``"none"``, ``"full"``, ``"dots"`` or a ``jax.checkpoint`` policy, per chunk.
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
               remat: Any = "full", per_example: Sequence[str] = (), mesh: Mesh | None = None,
               stage_axis: str = mesh_lib.STAGE_AXIS, data_axis: str = mesh_lib.DATA_AXIS,
               rngs: nnx.Rngs | None = None):
    if not isinstance(layers, (list, tuple)) or not layers:
      raise TypeError(f"{_OWNER} takes a non-empty list of nnx.Module layers, got {layers!r}.")
    for i, layer in enumerate(layers):
      if not isinstance(layer, nnx.Module) or isinstance(layer, Sequential):
        raise TypeError(f"{_OWNER}: layers[{i}] is {layer!r}; each layer must be an nnx.Module "
                        "instance or a tpipe.nnx.Repeat (for a flax.linen module use "
                        "tpipe.Sequential).")
    if isinstance(per_example, str):
      raise TypeError(f"per_example must be a sequence of keyword names, got the string "
                      f"{per_example!r}; write per_example=({per_example!r},).")
    self.layers = nnx.List(layers)
    self.num_stages = num_stages
    self.num_microbatches = num_microbatches
    self.schedule = schedule
    self.num_repeats = num_repeats
    self.balance = balance if isinstance(balance, str) else tuple(balance)
    self.remat = remat
    self.per_example = tuple(per_example)
    self.mesh = mesh
    self.stage_axis = stage_axis
    self.data_axis = data_axis
    if rngs is not None and not isinstance(rngs, nnx.Rngs):
      raise TypeError(f"{_OWNER}: rngs must be an nnx.Rngs or None, got {rngs!r}.")
    self.rngs = rngs
    engine, _ = self._engine()  # Validates every setting now, before any tracing.
    if rngs is None and self._has_rng_streams(engine):
      raise ValueError(f"{_OWNER}: a layer has RNG streams (e.g. nnx.Dropout) but the stack has "
                       "no rngs; pass rngs=nnx.Rngs(dropout=...) to tpipe.nnx.Sequential.")

  @staticmethod
  def _has_rng_streams(engine) -> bool:
    modules = [getattr(layer, "module", layer) for layer in engine._layer_list()]
    return any(module.rng_slots for module in modules)

  def _engine(self) -> tuple[linen_sequential.Sequential, dict]:
    """The linen ``tpipe.Sequential`` over this stack's layers, and its logical params (the
    layers' current ``Param`` values)."""
    modules, params = [], {}
    for i, layer in enumerate(self.layers):
      module, params[f"layers_{i}"] = _as_linen(layer, f"{_OWNER} layers[{i}]")
      modules.append(module)
    engine = linen_sequential.Sequential(
        modules, num_stages=self.num_stages, num_microbatches=self.num_microbatches,
        schedule=self.schedule, num_repeats=self.num_repeats,
        balance=self.balance if isinstance(self.balance, str) else list(self.balance),
        remat=self.remat, per_example=self.per_example, mesh=self.mesh,
        stage_axis=self.stage_axis, data_axis=self.data_axis)
    return engine, params

  def __call__(self, x, **kwargs):
    engine, params = self._engine()
    rngs = {}
    if self._has_rng_streams(engine):
      stream = "dropout" if "dropout" in self.rngs else "default"
      rngs[RNG_STREAM] = self.rngs[stream]()
    return engine.apply({"params": params}, x, **kwargs, rngs=rngs)
