"""What ``tpipe.nnx.Sequential`` and the classes ``tpipe.nnx.pipeline`` makes share: stacked
copies of one layer (:class:`Repeat`), and a pipelined stack (:class:`Stack`): its spec, the
engine it builds from its layers' state at each call, and the write-back of BatchNorm statistics.

State stays in the NNX layout whatever the pipeline: ``nnx.state(model, nnx.Param)`` holds one
entry per layer, a :class:`Repeat`'s copies stacked on a leading axis, so ``nnx.grad`` and
``nnx.Optimizer`` work as on any NNX model. At each call the layers' state becomes the engine's
logical variables (``{"layers_i": pure dict}``) and is staged: a reshape for a Repeat cut evenly
over the stages (local when its copies already live split over ``stage``, see
:func:`tpipe.nnx.shard`), packed buffers for the other layers.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from flax import nnx
from flax.core import meta
from jax import lax

from tpipe import schedules
from tpipe import spec as spec_lib
from tpipe.core import adapter
from tpipe.core import engine
from tpipe.core.base import layers as layers_lib
from tpipe.nnx import homes
from tpipe.nnx import layers as nnx_layers


class Repeat(nnx.Module):
  """``n`` copies of the layer ``make_layer(rngs)`` makes, each with its own parameters.

  The copies are created with ``nnx.vmap`` over ``nnx.split_rngs(splits=n)`` (NNX's pattern for
  stacked layers), so every ``nnx.Param`` of ``self.layer`` has a leading axis of length ``n``.
  Called on its own, a ``Repeat`` applies the copies in order with one ``lax.scan``; in a
  :class:`tpipe.nnx.Sequential` it counts as ``n`` layer units and may be cut between stages. The
  layer must map its input to an output of the same structure, shapes and dtypes.

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
    schedules.forward.check_count("tpipe.nnx.Repeat n", n)
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
    graphdef, params, stats, rng_state, _ = nnx_layers.split(
        self.layer, "tpipe.nnx.Repeat", repeated=True)
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


class Stack:
  """A pipelined stack of NNX layers (mixed into an ``nnx.Module``): the spec, the engine and
  the call. Subclasses give their layers (:meth:`pipeline_layers`) and their name
  (:attr:`owner`)."""

  owner = "tpipe.nnx"

  def pipeline_layers(self) -> list[nnx.Module]:
    """The stack's entries, in order: NNX modules and :class:`Repeat` s."""
    raise NotImplementedError

  def _configure(self, spec: spec_lib.PipelineSpec, rngs: nnx.Rngs | None) -> None:
    """Stores and checks the settings and rngs, before any tracing, and places the state at its
    homes (:mod:`tpipe.nnx.homes`)."""
    if rngs is not None and not isinstance(rngs, nnx.Rngs):
      raise TypeError(f"{self.owner}: rngs must be an nnx.Rngs or None, got {rngs!r}.")
    self.spec = spec
    self.rngs = rngs
    layers, _, _ = self.core_layers()
    adapter.check_structure(layers, spec, self.owner)
    if rngs is None and self._has_rng_streams():
      raise ValueError(f"{self.owner}: a layer has RNG streams (e.g. nnx.Dropout) but the stack "
                       "has no rngs; pass rngs=nnx.Rngs(dropout=...).")
    self._place_state()

  def _targets(self) -> list[tuple[nnx.Module, int | None]]:
    """Per layer, the module holding its state and its number of stacked copies (or None)."""
    return [(_target(layer), layer.n if isinstance(layer, Repeat) else None)
            for layer in self.pipeline_layers()]

  def _place_state(self, kinds=(nnx.Variable,)) -> None:
    """Moves the stack's variables of ``kinds`` (its layers' and its rngs') to their homes on
    the stack's mesh (:mod:`tpipe.nnx.homes`): when the stack is built, by
    :meth:`load_variables` and by :func:`tpipe.nnx.shard`."""
    homes.place(self._targets(), [self.rngs] if self.rngs is not None else [], self.spec, kinds)

  def _has_rng_streams(self) -> bool:
    return any(nnx_layers.has_rng_streams(_target(layer)) for layer in self.pipeline_layers())

  def core_layers(self):
    """The core layers, and the logical ``params`` and ``batch_stats`` (pure dicts by
    ``layers_i``; a Repeat's stacked) of the stack's current state."""
    layers, params, stats = [], {}, {}
    for i, layer in enumerate(self.pipeline_layers()):
      copies = layer.n if isinstance(layer, Repeat) else None
      core, params[f"layers_{i}"], stats[f"layers_{i}"] = nnx_layers.as_layer(
          _target(layer), copies, f"{self.owner} layers[{i}]")
      layers.append(core)
    return tuple(layers), params, stats

  def variables(self) -> dict[str, Any]:
    """The stack's state as the engine's logical variables: ``{"params": {"layers_i": ...},
    "batch_stats": {...}}`` (the latter only with BatchNorm layers). ``layers_i`` holds layer
    ``i``'s state as a pure dict with the NNX attribute names, so an NNX model named like a linen
    one has its variables (and checkpoints)."""
    _, params, stats = self.core_layers()
    out = {"params": params}
    if jax.tree.leaves(stats):
      out["batch_stats"] = stats
    return out

  def load_variables(self, variables) -> None:
    """Writes ``params`` and ``batch_stats`` in :meth:`variables`' layout into the layers (a
    linen model's variables as its ``init`` returns them, partitioning boxes and all), at their
    homes (:mod:`tpipe.nnx.homes`)."""
    variables = meta.unbox(variables)
    for i, layer in enumerate(self.pipeline_layers()):
      target = _target(layer)
      if "params" in variables:
        nnx.update(target, nnx.State(variables["params"][f"layers_{i}"]))
      stats = variables.get("batch_stats", {}).get(f"layers_{i}")
      if stats and jax.tree.leaves(stats):
        nnx.update(target, nnx.State(stats))
    kinds = (nnx.BatchStat,) + ((nnx.Param,) if "params" in variables else ())
    self._place_state(kinds)

  def pipeline_for(self, x, rng_names=(), **kwargs) -> engine.PlannedPipeline:
    """The engine's :class:`tpipe.PlannedPipeline` for inputs like ``x``: the split, the stage
    layouts and the runs on staged variables."""
    layers, params, stats = self.core_layers()
    return adapter.build(self._model(layers), x, kwargs, rng_names,
                         adapter.Variables(params, stats))

  def param_axes(self) -> dict[str, Any]:
    """The parameters' logical axis names per layer (:func:`tpipe.core.base.layers.logical_names`),
    which split them over a mesh's ``fsdp`` and ``tensor`` axes."""
    return {f"layers_{i}": layers_lib.logical_names(
        nnx_layers.annotations(_target(layer)), layer.n if isinstance(layer, Repeat) else None)
        for i, layer in enumerate(self.pipeline_layers())}

  def _model(self, layers) -> adapter.Model:
    return adapter.Model(layers, self.spec, self.owner, param_axes=self.param_axes())

  def _run(self, x, kwargs: dict, loss: bool, terms: bool = False):
    layers, params, stats = self.core_layers()
    # Read at home, so the gradients (and an optimizer's update) come back there too.
    params = {f"layers_{i}": homes.pinned(target, copies, nnx.Param, params[f"layers_{i}"],
                                          self.spec)
              for i, (target, copies) in enumerate(self._targets())}
    rngs = {}
    if self._has_rng_streams():
      stream = "dropout" if "dropout" in self.rngs else "default"
      rngs[nnx_layers.RNG_STREAM] = self.rngs[stream]()
      homes.place([], [self.rngs], self.spec)  # The stream's count, advanced, stays at home.
    result = adapter.call(self._model(layers), adapter.Variables(params, stats), x, kwargs,
                          loss=loss, terms=terms, rngs=rngs)
    new_stats = result.stats()
    if new_stats is not None:  # BatchNorm in training mode: one update per call, into the layers.
      self.load_variables({"batch_stats": new_stats})
    return result.value


def _target(layer: nnx.Module) -> nnx.Module:
  """The module holding a layer's state: a Repeat's stacked copies, else the layer."""
  return layer.layer if isinstance(layer, Repeat) else layer
