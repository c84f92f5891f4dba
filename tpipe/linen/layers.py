"""Flax linen modules as the core's layers: pure functions of their variables.

:func:`as_layer` turns a linen module (or ``n`` stacked copies of one) into a
:class:`tpipe.core.base.layers.Layer` whose ``apply(params, stats, x, kwargs, rngs)`` is
``module.apply`` on those variables. A ``nn.BatchNorm`` that runs in training mode inside it
reports ``E[x]`` and ``E[x^2]`` of its input in the place of its mean and var (the engine pools
them over the step, :mod:`tpipe.core.planning.statistics`) and records its momentum in the layer's
``momenta`` at trace time. A layer that writes to a collection its caller asked for (one the
caller made mutable, other than ``params`` and ``batch_stats``: ``self.sow("intermediates",
...)`` under ``apply(..., mutable=["intermediates"])``) raises while planning traces it: the
pipeline would drop what it wrote (:func:`tpipe.core.base.layers.check_unsown`; NNX refuses a
sown ``nnx.Intermediate`` alike). :func:`init_variables` initialises a layer's variables, each
copy of a repeated layer from its own key.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import scope as flax_scope

from tpipe.core.base import arguments
from tpipe.core.base import layers as layers_lib
from tpipe.core.planning import aux_losses

# The variable collection of BatchNorm's running statistics.
STATS = "batch_stats"
# The collection a layer sows auxiliary losses into (``self.sow(AUX_LOSS, name, value)``): each a
# float scalar, which the pipeline adds to the training loss
# (:mod:`tpipe.core.planning.aux_losses`).
AUX_LOSS = aux_losses.LOSS
# The collection a layer sows auxiliary metrics into (``self.sow(AUX_METRIC, name, value)``):
# float scalars the pipeline carries like auxiliary losses but only reports (``loss_terms``).
AUX_METRIC = aux_losses.METRIC
# What a layer sows on a call (its auxiliary values, ``intermediates``): outputs of that call,
# not variables; an initialisation drops them.
SOWN = (AUX_LOSS, AUX_METRIC, "intermediates")


def _init(template, axis_names):
  """``template.init`` with the mesh's axis names bound, its sown values dropped."""
  init = layers_lib.outside_mesh(template.init, axis_names)

  def run(*args, **kwargs):
    return {k: v for k, v in init(*args, **kwargs).items() if k not in SOWN}

  return run


def as_layer(module: nn.Module, copies: int | None, owner: str,
             returned: Any = False) -> layers_lib.Layer:
  """The core layer of a linen module.

  Args:
    module: an unbound linen module (a template: applied with the variables given).
    copies: ``None`` for a plain layer, ``n`` for ``n`` stacked copies.
    owner: the API the user called, for messages.
    returned: the collections the caller made mutable (its ``scope.mutable``, a Flax collection
      filter), whose writes it would receive outside a pipeline: the layer raises where it
      writes to one besides ``params`` and ``batch_stats``.
  """
  template = module.clone(parent=None)
  kind = type(template).__name__
  return layers_lib.from_measure(
      kind, copies,
      lambda *args: _apply_measuring(template, *args, owner=owner, returned=returned),
      keywords=arguments.keyword_names(type(template).__call__), identity=template,
      aux_values=lambda sown: aux_losses.named(sown, owner, kind))


def _apply_measuring(template, params, stats, h, kwargs, rngs, *, owner: str, returned):
  """Applies a layer to one micro-batch; returns its output; shaped like ``stats``, each
  training-mode BatchNorm's ``E[x]`` (in the place of ``mean``) and ``E[x^2]`` (of ``var``),
  zeros elsewhere; ``{path: momentum}`` of those BatchNorms; and the auxiliary values it sowed
  (``{AUX_LOSS: tree, AUX_METRIC: tree}``). Statistics the layer would update are dropped;
  missing ones (shape and cost passes) are created. Raises where it writes to a collection in
  ``returned`` (see :func:`as_layer`)."""
  seen, momenta = {}, {}

  def interceptor(next_fun, args, call_kwargs, context):
    module = context.module
    if isinstance(module, nn.BatchNorm) and context.method_name == "__call__":
      use_running = args[1] if len(args) > 1 else call_kwargs.get("use_running_average")
      use_running = nn.merge_param("use_running_average", module.use_running_average,
                                   use_running)
      if not use_running:
        layers_lib.check_unmasked(call_kwargs.get("mask"), owner)
        x = args[0]
        x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        feature = {a % x.ndim for a in ((module.axis,) if isinstance(module.axis, int)
                                        else module.axis)}
        reduce = tuple(a for a in range(x.ndim) if a not in feature)
        path = tuple(module.scope.path)
        seen[path] = (x.mean(reduce), (x * x).mean(reduce))
        momenta[path] = float(module.momentum)
    return next_fun(*args, **call_kwargs)

  variables = {"params": params, **({STATS: stats} if jax.tree.leaves(stats) else {})}
  carried = [STATS, AUX_LOSS, AUX_METRIC]
  with nn.intercept_methods(interceptor):
    out, mutated = template.apply(variables, h, **kwargs, rngs=rngs,
                                  mutable=flax_scope.union_filters(returned, carried))
  written = sorted(c for c, tree in mutated.items()
                   if c not in ["params", *carried] and jax.tree.leaves(tree))
  layers_lib.check_unsown(written, f"{owner}: {type(template).__name__} writes to the variable "
                          "collection(s)", f"call apply without mutable={written}")

  def contribution(path, value):
    keys = tuple(getattr(k, "key", None) for k in path)
    if keys[:-1] not in seen:
      return jnp.zeros_like(value)
    mean, mean_of_squares = seen[keys[:-1]]
    return (mean if keys[-1] == "mean" else mean_of_squares).astype(value.dtype)

  return (out, jax.tree_util.tree_map_with_path(contribution, stats), momenta,
          {kind: mutated.get(kind, {}) for kind in (AUX_LOSS, AUX_METRIC)})


# The module, its key and inputs, and the axes to name.
def init_variables(module: nn.Module, copies: int | None, key, h, kwargs, rngs,
                   axis_names: tuple[str, ...], copy_axis: str) -> dict:
  """A layer's initial variables, its partitioning boxes kept: each copy of a repeated layer
  from its own key (``jax.random.split(key, n)``), stacked on a leading axis that boxed leaves
  name ``copy_axis`` (as ``nn.scan``'s ``metadata_params`` name a scan's)."""
  template = module.clone(parent=None)

  def init_one(k):
    return _init(template, axis_names)({"params": k, **rngs}, h, **kwargs)

  if copies is None:
    return init_one(key)
  # A loop over the copies, not a vmap: a layer may use operations without a batching rule
  # for its weights (jax.lax.ragged_dot's grouped matmul).
  stacked = jax.lax.map(init_one, jax.random.split(key, copies))
  return nn.meta.add_axis(stacked, 0, {nn.PARTITION_NAME: copy_axis})


def abstract_variables(module: nn.Module, copies: int | None, h, kwargs, rng_names,
                       axis_names: tuple[str, ...]) -> tuple[dict, dict]:
  """The abstract shapes of a layer's variables (nothing allocated), and its parameters'
  logical axis names (:func:`tpipe.core.base.layers.logical_names`)."""
  rngs = {name: jax.random.key(0) for name in rng_names}
  template = module.clone(parent=None)

  def init_one(k, h, kw):
    return _init(template, axis_names)({"params": k, **rngs}, h, **kw)

  def init(k, h, kw):
    if copies is None:
      return init_one(k, h, kw)
    return jax.lax.map(lambda k: init_one(k, h, kw), jax.random.split(k, copies))

  boxed = layers_lib.eval_shape(init, jax.random.key(0), h, kwargs)
  return nn.meta.unbox(boxed), layers_lib.logical_names(
      _annotations(boxed.get("params", {})), copies)


def _annotations(boxed_params):
  """``(keystr(path), names, ndim)`` of each parameter, for
  :func:`tpipe.core.base.layers.logical_names`: ``nn.with_logical_partitioning`` gives logical
  names, ``nn.with_partitioning`` mesh axis names (kept as they are: a name that is a mesh axis
  maps to itself); a leaf without annotation None. A repeated layer's copy axis carries the name
  ``nn.scan``'s ``metadata_params`` or ``nn.meta.add_axis`` gave it."""
  is_box = lambda a: isinstance(a, nn.Partitioned)
  for path, leaf in jax.tree_util.tree_flatten_with_path(boxed_params, is_leaf=is_box)[0]:
    names = tuple(leaf.names) if is_box(leaf) else None
    value = leaf.value if is_box(leaf) else leaf
    yield jax.tree_util.keystr(path), names, len(value.shape)


def variable_collections(variables: Any) -> list[str]:
  """Collections other than ``params`` and ``batch_stats`` (unsupported)."""
  return sorted(set(variables) - {"params", STATS})
