"""Flax NNX modules as the core's layers: pure functions of their state, via ``nnx.split`` and
``nnx.merge``.

:func:`as_layer` splits an NNX layer (or the stacked copies of a :class:`tpipe.nnx.Repeat`) into
its graph definition and its ``nnx.Param``, ``nnx.BatchStat`` and RNG states, and returns a
:class:`tpipe.core.base.layers.Layer` whose ``apply(params, stats, x, kwargs, rngs)`` merges a fresh
copy of the layer from those values and calls it. Nothing of the user's module is touched.

* RNG streams (an ``nnx.Dropout``'s): the copy's ``j``-th ``nnx.RngKey`` (in ``nnx.split``
  order) restarts from ``fold_in(k, j)``, ``k`` being the key the engine gives the unit for the
  stream :data:`RNG_STREAM`, with its count at 0.
* ``nnx.BatchNorm``: the fresh copy's momentum is set to 0, so a training-mode call leaves its
  running averages equal to the micro-batch's own statistics; they are reported as ``E[x]`` (the
  mean) and ``E[x^2]`` (var + mean^2) for the engine to pool over the step, and the layer's own
  momentum is recorded for the one update per step (:mod:`tpipe.core.planning.statistics`). A
  BatchNorm called with a mask in training mode raises, as in linen
  (:func:`tpipe.core.base.layers.check_unmasked`).
* Sown values: ``tpipe.nnx.AuxLoss`` and ``tpipe.nnx.AuxMetric`` are carried to the loss and its
  terms; any other ``nnx.Intermediate`` a layer sows raises while planning traces it, as linen's
  front ends raise for a collection the caller made mutable
  (:func:`tpipe.core.base.layers.check_unsown`): the pipeline would drop it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tpipe.core.base import arguments
from tpipe.core.base import layers as layers_lib
from tpipe.core.planning import aux_losses

# The engine's stream whose key seeds the layers' own RNG streams.
RNG_STREAM = "dropout"


class AuxLoss(nnx.Intermediate):
  """An auxiliary loss a layer adds to the training loss: ``self.sow(tpipe.nnx.AuxLoss, name,
  value)`` with a float scalar (a router's load-balancing loss, a z-loss). The pipeline adds
  every one a call sows to the loss (:mod:`tpipe.core.planning.aux_losses`); values sown by an
  earlier
  call outside the pipeline are not state and are left out."""


class AuxMetric(nnx.Intermediate):
  """An auxiliary metric a layer reports beside the loss: ``self.sow(tpipe.nnx.AuxMetric, name,
  value)`` with a float scalar (a router's expert load). Carried through the pipeline as
  auxiliary losses are, never added to the loss; ``Sequential.loss_terms`` returns its mean over
  micro-batches (:mod:`tpipe.core.planning.aux_losses`)."""


_SOWN = {aux_losses.LOSS: AuxLoss, aux_losses.METRIC: AuxMetric}


def split(layer: nnx.Module, where: str, repeated: bool = False):
  """``layer``'s graph definition, its ``Param``, ``BatchStat`` and RNG states, and its constant
  arrays (array attributes that are no ``nnx.Variable``: a layer's fixed table); raises for any
  other state, for a ``BatchStat`` outside an ``nnx.BatchNorm``, and for constants in the copies
  of a repeated layer (``repeated``)."""
  if jax.tree.leaves(nnx.state(layer, AuxLoss, AuxMetric)):  # Sown by an eager call: not state.
    layer = nnx.clone(layer)
    nnx.pop(layer, AuxLoss, AuxMetric)
  graphdef, params, stats, rng_state, rest = nnx.split(layer, nnx.Param, nnx.BatchStat,
                                                       nnx.RngState, ...)
  flat = nnx.to_flat_state(rest)
  variables = [(path, v) for path, v in flat if isinstance(v, nnx.Variable)]
  if variables:
    kinds = sorted({type(v).__name__ for _, v in variables})
    raise ValueError(
        f"{where}: {type(layer).__name__} holds NNX variables other than nnx.Param, nnx.BatchNorm "
        f"statistics and RNG streams ({', '.join(kinds)}: {[p for p, _ in variables][:4]}). "
        "tpipe.nnx cannot give other mutable nnx.Variables pipeline semantics; keep such state "
        "outside the pipelined layers.")
  if flat and repeated:
    raise ValueError(
        f"{where}: the copies of {type(layer).__name__} hold constant arrays "
        f"({[p for p, _ in flat][:4]}), one per copy; tpipe.nnx.Repeat stacks parameters only. "
        "Compute the constant in __call__, or make the layer a plain one.")
  norms = set(batch_norms(layer))
  expected = {path + (name,) for path in norms for name in ("mean", "var")}
  stray = sorted(set(tuple(p) for p, _ in nnx.to_flat_state(stats)) - expected, key=str)
  if stray:
    raise ValueError(
        f"{where}: {type(layer).__name__} has nnx.BatchStat variables outside an nnx.BatchNorm "
        f"({stray[:4]}); tpipe.nnx pools the statistics of nnx.BatchNorm layers only.")
  return graphdef, params, stats, rng_state, rest


def batch_norms(layer: nnx.Module) -> dict[tuple, nnx.BatchNorm]:
  """The ``nnx.BatchNorm`` modules of ``layer`` by graph path, in graph order."""
  return {tuple(path): node for path, node in nnx.iter_graph(layer)
          if isinstance(node, nnx.BatchNorm)}


def _rng_state(template, key):
  """The RNG state with its ``j``-th key ``fold_in(key, j)`` and its counts 0."""
  leaves, tree = jax.tree_util.tree_flatten(template)
  out, j = [], 0
  for leaf in leaves:
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      out.append(jax.random.fold_in(key, j))
      j += 1
    else:
      out.append(jnp.zeros(leaf.shape, leaf.dtype))
  return jax.tree_util.tree_unflatten(tree, out)


def annotations(layer: nnx.Module):
  """``(key, names, ndim)`` of each of ``layer``'s parameters, for
  :func:`tpipe.core.base.layers.logical_names`: ``names`` its ``out_sharding`` metadata (what
  ``nnx.with_partitioning`` and ``nnx.Param(..., out_sharding=...)`` set: mesh axis or logical
  names, see :mod:`tpipe.axis_rules`) or None, ``key`` its path in the layer's pure-dict state."""
  for path, variable in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
    yield ("".join(f"[{k!r}]" for k in path), variable.get_metadata().get("out_sharding"),
           len(variable.get_value().shape))


def as_layer(layer: nnx.Module, copies: int | None,
             where: str) -> tuple[layers_lib.Layer, Any, Any]:
  """The core layer of an NNX module, and its logical ``Param`` and ``BatchStat`` states.

  Args:
    layer: the module; for a repeated layer, the module holding the stacked copies.
    copies: ``None`` for a plain layer, ``n`` for ``n`` stacked copies.
    where: the layer's name for messages (``tpipe.nnx.Sequential layers[2]``).

  Returns:
    ``(layer, params, stats)``: the core layer; its ``Param`` and ``BatchStat`` states as pure
    dicts (a repeated layer's stacked).
  """
  graphdef, params, stats, rng_state, constants = split(layer, where, copies is not None)
  rng_template = nnx.to_pure_dict(rng_state)
  has_rngs = bool(jax.tree.leaves(rng_template))
  own_momenta = {path: float(norm.momentum) for path, norm in batch_norms(layer).items()}

  def apply_measuring(params, stats, h, kwargs, rngs):
    rng = {}
    if has_rngs:
      key = rngs.get(RNG_STREAM)
      if key is None:  # Shape and cost passes, deterministic calls: a placeholder key.
        key = jax.random.key(0)
      rng = _rng_state(one_copy_rng(rng_template, copies), key)
    module = nnx.merge(graphdef, params, stats, rng, constants)
    before = {}
    for path, norm in batch_norms(module).items():
      norm.momentum = 0.0  # This copy's running averages become the micro-batch's statistics.
      norm.__class__ = _refusing_mask(type(norm), where)
      before[path] = norm.mean.get_value()
    y = module(h, **kwargs)
    contributions, momenta = jax.tree.map(jnp.zeros_like, stats), {}
    for path, norm in batch_norms(module).items():
      if norm.mean.get_value() is before[path]:
        continue  # Evaluation mode: nothing measured.
      momenta[path] = own_momenta[path]
      mean, var = norm.mean.get_value(), norm.var.get_value()
      node = contributions
      for key in path:
        node = node[key]
      node["mean"], node["var"] = mean, var + mean * mean
    sown = {kind: nnx.to_pure_dict(nnx.pop(module, variable)) for kind, variable in _SOWN.items()}
    others = nnx.to_flat_state(nnx.state(module, nnx.Intermediate))
    layers_lib.check_unsown(
        ["/".join(map(str, path)) for path, _ in others],
        f"{where}: {type(layer).__name__} sows the nnx.Intermediate value(s)",
        "sow them outside the pipelined layers (tpipe.nnx.AuxLoss and tpipe.nnx.AuxMetric are "
        "carried)")
    return y, contributions, momenta, sown

  layer_class = type(layer)
  identity = graphdef  # Equal graphs compute the same: they share one cost measurement.
  try:
    hash(identity)
  except TypeError:
    identity = None
  core = layers_lib.from_measure(
      layer_class.__name__, copies, apply_measuring,
      keywords=arguments.keyword_names(layer_class.__call__), identity=identity,
      aux_values=lambda sown: aux_losses.named(sown, where, layer_class.__name__))
  return core, nnx.to_pure_dict(params), nnx.to_pure_dict(stats)


@functools.lru_cache(maxsize=None)
def _refusing_mask(norm_class: type, where: str) -> type:
  """``norm_class`` (an ``nnx.BatchNorm`` class) whose call refuses a mask in training mode
  (:func:`tpipe.core.base.layers.check_unmasked`): the class of the fresh copies :func:`as_layer`
  merges, so the user's modules keep theirs."""

  def __call__(self, x, *args, **kwargs):
    use_running = args[0] if args else kwargs.get("use_running_average")
    if use_running is None:
      use_running = self.use_running_average
    if use_running is False:
      layers_lib.check_unmasked(kwargs.get("mask"), where)
    return norm_class.__call__(self, x, *args, **kwargs)

  return type(norm_class.__name__, (norm_class,),
              {"__call__": __call__, "__module__": norm_class.__module__,
               "__qualname__": norm_class.__qualname__})


def one_copy_rng(template, copies):
  """A repeated layer's RNG state is stacked like its parameters: one copy's."""
  if copies is None:
    return template
  return jax.tree.map(
      lambda a: (jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
                 if isinstance(a, jax.ShapeDtypeStruct) else a[0]), template)


def has_rng_streams(layer: nnx.Module) -> bool:
  """Whether ``layer`` holds RNG streams (an ``nnx.Dropout``'s)."""
  return bool(jax.tree.leaves(nnx.state(layer, nnx.RngState)))
