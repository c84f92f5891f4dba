"""A layer as the core runs it: pure functions of arrays, whatever front end wrote it.

The linen and NNX front ends turn each entry of a layer sequence into a :class:`Layer`: a plain
layer (one unit) or ``n`` stacked copies of one (``n`` units, parameters with a leading copy
axis, as ``nn.scan`` stacks them), each from one measuring call of its module
(:func:`from_measure`). The core plans, lays out and runs sequences of them.

Also here, because every front end and schedule shares them:

* the **RNG rule** (:func:`unit_rngs`): for each random stream the pipeline gets one key ``K``
  per call; unit ``u`` (0-based over all units) on global micro-batch ``m`` runs with
  ``fold_in(fold_in(K, u), m)``, so random numbers do not depend on the stages, balance,
  schedule, repeats or remat;
* keyword routing (:func:`layer_keywords`): a keyword reaches every layer whose call takes it;
* a repeated layer's parameters named as one copy's (:func:`logical_names`), and the refusals
  of a masked normalization in training mode (:func:`check_unmasked`) and of values a layer sows
  that the pipeline would drop (:func:`check_unsown`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np

# apply(params, stats, x, kwargs, rngs) -> (y, statistics): one copy of a layer on one
# micro-batch. ``params`` and ``stats`` are one copy's trees (``stats``: running statistics such
# as BatchNorm's mean and var, ``{}`` without); ``kwargs`` the keyword arguments the layer takes;
# ``rngs`` ``{stream: key}`` for this unit and micro-batch (``{}`` without streams). ``statistics``
# is shaped like ``stats``: what this micro-batch contributes to the pooled statistics (``E[x]``
# in place of each mean, ``E[x^2]`` of each var; zeros where nothing was measured).
ApplyFn = Callable[[Any, Any, Any, dict, dict], tuple[Any, Any]]

# apply_with_momenta(params, stats, x, kwargs, rngs) -> (y, statistics, momenta): ``apply``'s
# results and, as a Python value known once the call is traced, ``{path: momentum}`` of each
# normalization (BatchNorm) that ran in training mode, ``path`` being the keys of its
# ``mean``/``var`` in ``stats``.
ApplyWithMomentaFn = Callable[[Any, Any, Any, dict, dict], tuple[Any, Any, dict]]

# apply_with_aux_values(params, stats, x, kwargs, rngs) -> (y, statistics, values): ``apply``'s
# results and the auxiliary losses and metrics the layer sowed on this call,
# ``{"<kind>/<path>": float32 scalar}``, or None when it sowed none (see
# :mod:`tpipe.core.planning.aux_losses`).
ApplyWithAuxValuesFn = Callable[[Any, Any, Any, dict, dict], tuple[Any, Any, Any]]


@dataclasses.dataclass(frozen=True, eq=False)
class Layer:
  """One entry of a layer sequence, as pure functions.

  Attributes:
    kind: what the layer is, for messages and summaries (its class name).
    copies: ``None`` for a plain layer (one unit); ``n`` for ``n`` stacked copies (``n`` units),
      whose parameters carry a leading copy axis of length ``n``. A repeated layer must map its
      input to an output of the same structure, shapes and dtypes.
    apply: see :data:`ApplyFn`.
    keywords: the keyword argument names its call takes after the input; ``None`` if it takes
      any (``**kwargs``).
    identity: a hashable description of what ``apply`` computes besides the shapes of its
      arguments (for a Flax module: its class and fields), so equal layers share one cost
      measurement; ``None`` when there is none.
    apply_with_momenta: see :data:`ApplyWithMomentaFn`; None for a layer without running
      statistics. Planning traces it once (:func:`tpipe.core.planning.plan.trace_inputs`) and the
      engine updates the running statistics with the momenta it returned.
    apply_with_aux_values: see :data:`ApplyWithAuxValuesFn`; None for a layer that never sows
      auxiliary losses or metrics. Planning traces it once; where a layer sows some, the engine
      carries them to the loss (:func:`tpipe.core.planning.aux_losses.carry`).
  """

  kind: str
  copies: int | None
  apply: ApplyFn
  keywords: tuple[str, ...] | None = None
  identity: Hashable | None = None
  apply_with_momenta: ApplyWithMomentaFn | None = None
  apply_with_aux_values: ApplyWithAuxValuesFn | None = None

  @property
  def units(self) -> int:
    """Layer units: 1 for a plain layer, ``copies`` for a repeated one."""
    return 1 if self.copies is None else self.copies


# measure(params, stats, x, kwargs, rngs) -> (y, statistics, momenta, sown): one call of a layer
# with everything its front end reads off it, ``apply_with_momenta``'s results and what it sowed
# in the front end's own form (:func:`from_measure` names it).
MeasureFn = Callable[[Any, Any, Any, dict, dict], tuple[Any, Any, dict, Any]]


def from_measure(kind: str, copies: int | None, measure: MeasureFn, *,
                 keywords: tuple[str, ...] | None, identity: Hashable | None,
                 aux_values: Callable[[Any], Any]) -> Layer:
  """The :class:`Layer` whose apply functions are one front end's measuring call, each keeping
  what it returns: ``apply`` the output and statistics, ``apply_with_momenta`` the momenta too,
  ``apply_with_aux_values`` the sown values as ``aux_values(sown)`` names them
  (:func:`tpipe.core.planning.aux_losses.named`). Both front ends build their layers so."""

  def apply(params, stats, h, kwargs, rngs):
    return measure(params, stats, h, kwargs, rngs)[:2]

  def apply_with_momenta(params, stats, h, kwargs, rngs):
    return measure(params, stats, h, kwargs, rngs)[:3]

  def apply_with_aux_values(params, stats, h, kwargs, rngs):
    y, statistics, _, sown = measure(params, stats, h, kwargs, rngs)
    return y, statistics, aux_values(sown)

  return Layer(kind=kind, copies=copies, apply=apply, keywords=keywords, identity=identity,
               apply_with_momenta=apply_with_momenta, apply_with_aux_values=apply_with_aux_values)


def unit_names(layers) -> tuple[str, ...]:
  """A name per unit: ``layers_3[7] Block`` for copy 7 of repeated layer 3, ``layers_0 Embed``."""
  names = []
  for i, layer in enumerate(layers):
    if layer.copies is None:
      names.append(f"layers_{i} {layer.kind}")
    else:
      names += [f"layers_{i}[{j}] {layer.kind}" for j in range(layer.copies)]
  return tuple(names)


def unit_rngs(rngs: dict, unit, microbatch) -> dict:
  """Per-unit, per-micro-batch keys: ``{name: fold_in(fold_in(K, unit), microbatch)}``."""
  return {name: jax.random.fold_in(jax.random.fold_in(key, unit), microbatch)
          for name, key in rngs.items()}


def layer_keywords(layer: Layer, split, broadcast, per_example) -> dict:
  """The keyword arguments ``layer`` takes, rebuilt from ``split`` (a
  :class:`tpipe.core.base.arguments.SplitArguments`) with the given arrays."""
  kwargs = split.rebuild(broadcast, per_example)
  if layer.keywords is None:
    return kwargs
  return {k: v for k, v in kwargs.items() if k in layer.keywords}


def abstract(tree):
  """``tree`` with every array leaf as a ``jax.ShapeDtypeStruct``."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def types(tree):
  """``(shape, dtype name)`` of every leaf: what a pytree's type is for messages and checks."""
  return jax.tree.map(lambda a: (tuple(np.shape(a)), str(np.dtype(a.dtype))), tree)


def same_type(a, b) -> bool:
  """Whether two pytrees have the same structure, shapes and dtypes."""
  return jax.tree.structure(a) == jax.tree.structure(b) and types(a) == types(b)


def is_per_example_loss(tree) -> bool:
  """Whether ``tree`` (a layer's output on a micro-batch) is one float loss per example: a
  single floating ``[rows]`` array, what a pipeline's loss averages."""
  leaves = jax.tree.leaves(tree)
  return (len(leaves) == 1 and len(leaves[0].shape) == 1
          and jnp.issubdtype(leaves[0].dtype, jnp.floating))


def one_copy(tree):
  """The abstract tree of one copy of stacked leaves ``[n, ...]``."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(a.shape[1:]), a.dtype), tree)


def _arrays_traced(transform: Callable, fn: Callable, args):
  """``transform(call)(*arrays)``: ``fn(*args)`` with only the array leaves of ``args`` passed
  through ``transform``; Python values (a ``train=True`` flag, a string) reach ``fn`` as they
  are, as they do in a real call."""
  leaves, treedef = jax.tree.flatten(args)
  traced = [isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) for leaf in leaves]

  def call(*arrays):
    it = iter(arrays)
    full = [next(it) if is_traced else leaf for leaf, is_traced in zip(leaves, traced)]
    return fn(*jax.tree.unflatten(treedef, full))

  return transform(call)(*[leaf for leaf, t in zip(leaves, traced) if t])


def eval_shape(fn: Callable, *args):
  """``jax.eval_shape(fn, *args)`` with only the array leaves of ``args`` traced."""
  return _arrays_traced(lambda call: functools.partial(jax.eval_shape, call), fn, args)


def compiled_call(fn: Callable, *args):
  """``fn(*args)`` as one compiled program (``jax.jit``), only the array leaves of ``args``
  traced: where a front end runs layers on concrete arrays (initialisation), one compilation
  instead of one per operation."""
  return _arrays_traced(jax.jit, fn, args)


def outside_mesh(fn, axis_names: tuple[str, ...]):
  """``fn`` with the mesh's axis names bound (to size-1 ``vmap`` axes), for the passes that run
  outside the pipeline's ``shard_map`` (init, shapes, costs): a layer that reduces over ``data``
  (a BatchNorm with ``axis_name="data"``) then sees a group of one."""

  def bound(*args, **kwargs):
    run = lambda *a: fn(*a, **kwargs)
    for name in axis_names:
      run = jax.vmap(run, in_axes=None, axis_size=1, axis_name=name)
    index = (0,) * len(axis_names)
    return jax.tree.map(lambda a: a[index], run(*args))

  return bound


def logical_names(annotations, copies: int | None) -> dict[str, tuple | None]:
  """``{key: names}`` of a layer's parameters from ``(key, names, ndim)`` for each (``names``
  the axis names its front end annotated, logical or mesh axes, None without annotation). For a
  repeated layer the names are one copy's: a name given to the leading copy axis (``names`` as
  long as the stacked leaf has dimensions) is dropped."""
  out = {}
  for key, names, ndim in annotations:
    if names is not None:
      names = tuple(names)
      if copies is not None and len(names) == ndim:
        names = names[1:]
    out[key] = names
  return out


def check_unmasked(mask, owner: str) -> None:
  """Raises for a normalization called with a mask in training mode: the engine pools each
  micro-batch's ``E[x]`` and ``E[x^2]`` with equal weights (:mod:`tpipe.core.planning.statistics`),
  which
  is exact when every micro-batch counts as many values; masked statistics would need the mask's
  counts. A front end calls it while planning traces its layers, before anything runs."""
  if mask is not None:
    raise ValueError(f"{owner}: BatchNorm with a mask is not supported in training mode; the "
                     "statistics pooled over micro-batches would need the mask's counts. Call "
                     "it without mask= (or in evaluation mode, with the running averages).")


def check_unsown(sown, what: str, fix: str) -> None:
  """Raises for values a layer sowed that its caller would receive outside a pipeline (in linen,
  a collection the caller made mutable; in NNX, an ``nnx.Intermediate``, which the module
  keeps): a pipeline returns its layers' outputs and carries their auxiliary losses and metrics
  (:mod:`tpipe.core.planning.aux_losses`), nothing else they sow, so the values would be lost
  without a word. ``what`` says who wrote what kind of value; ``fix`` the front end's way out."""
  if sown:
    raise ValueError(f"{what} {list(sown)} (with self.sow), which its caller would receive "
                     "outside a pipeline, but a pipeline returns its layers' outputs and carries "
                     "their auxiliary losses and metrics, nothing else they sow. Take what you "
                     f"need from the output instead, or {fix}.")


def check_keywords(layers, names, owner: str, what: str = "keyword argument") -> None:
  """Raises unless some layer takes each of ``names`` (or one takes ``**kwargs``).

  Raises:
    TypeError: for keyword arguments of a call (``what`` names them).
    ValueError: for ``per_example`` names (``what="per_example name"``).
  """
  if any(layer.keywords is None for layer in layers):
    return
  known = set().union(*[set(layer.keywords) for layer in layers])
  unknown = sorted(set(names) - known)
  if not unknown:
    return
  if what == "per_example name":
    raise ValueError(f"{owner}: per_example names {unknown[0]!r}, which no layer's call takes; "
                     f"the layers take {sorted(known)}.")
  raise TypeError(f"{owner}: no layer's call takes the {what}(s) {unknown}; the layers take "
                  f"{sorted(known)}.")


def batch_size(x, owner: str) -> int:
  """The common leading (batch) size of every array in ``x``; ValueError otherwise."""
  leaves = jax.tree.leaves(x)
  if not leaves:
    raise ValueError(f"{owner}: the input x has no arrays; pass an array or a pytree of arrays "
                     "with a leading batch axis.")
  sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
  if None in sizes or len(sizes) != 1:
    raise ValueError(f"{owner}: every array in the input x needs the same leading batch axis; "
                     f"got shapes {[np.shape(leaf) for leaf in leaves]}.")
  return sizes.pop()
