"""Split backward for zero-bubble schedules: input gradients now, weight gradients later, no work
done twice.

A zero-bubble schedule splits a chunk's backward into ``BI`` (the gradient of the chunk's input,
which the previous stage is waiting for) and ``W`` (the gradients of its weights, which nobody
waits for and which fill the pipeline's bubbles). Running two plain VJPs (one for the input,
one for the weights) would redo the forward recomputation and most of the backward. Instead:

* In ``BI`` every call of a module that is linear in its parameters (``nn.Dense``,
  ``nn.DenseGeneral``, ``nn.Conv``, ``nn.Einsum``, ``nn.Embed``: :data:`TAPPED_MODULES`) is
  rewritten as ``y = module(stop_gradient(params), x) + tap`` with a zero ``tap``. Differentiating
  the chunk with respect to its input and the taps gives the input gradient and, as the taps'
  gradients, each such call's output gradient ``dy``; the weight-gradient products
  (``x^T dy``) are never formed, because nothing asks for them. The call's input ``x`` is recorded
  as an extra output.
* ``W`` gets the recorded inputs and output gradients and forms the weight gradients as the VJP of
  ``params -> module(params, x)`` at ``dy``. The module is linear in its parameters, so that VJP
  needs only ``x`` and ``dy`` (a matmul's weight gradient is ``x^T dy``); its primal output is
  unused and compiled away.

Everything else (a norm's scale, a parameter read directly by a layer, a module call inside a
layer's own ``nn.scan``/``nn.remat``, which runs under another trace) keeps its weight gradient in
``BI``, so the split is always exact and only the share of the backward that moves to ``W``
depends on the layers.

:class:`Tapper` does the rewriting for one layer application (a ``flax.linen.intercept_methods``
interceptor); :class:`TapCall` is what ``W`` needs to know about one call, fixed at trace time.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax.linen as nn
import jax
from flax.core import tracers
from jax import lax

# Modules whose ``__call__`` is linear in their parameters and pure (no RNG, no state): their
# weight gradients are formed in W from the recorded input and the output gradient.
TAPPED_MODULES = (nn.Dense, nn.DenseGeneral, nn.Conv, nn.Einsum, nn.Embed)


def _is_array(leaf) -> bool:
  return isinstance(leaf, jax.Array) or hasattr(leaf, "shape") and hasattr(leaf, "dtype")


@dataclasses.dataclass(frozen=True, eq=False)
class TapCall:
  """One tapped module call, as traced: enough to apply the module again to recorded inputs.

  Attributes:
    module: an unbound copy of the module.
    path: the path of the module's parameters inside its layer's ``params`` tree.
    treedef: the structure of the call's ``(args, kwargs)``.
    statics: per leaf of ``(args, kwargs)``, its value when it is not an array (a string, a
      flag), else None; the arrays are the recorded inputs.
  """

  module: nn.Module
  path: tuple[str, ...]
  treedef: Any
  statics: tuple

  def apply(self, params, arrays: Sequence[jax.Array]):
    """The module's output on its parameters ``params`` and the call's array arguments."""
    arrays = iter(arrays)
    leaves = [next(arrays) if s is None else s for s in self.statics]
    args, kwargs = jax.tree.unflatten(self.treedef, leaves)
    return self.module.apply({"params": params}, *args, **kwargs)

  def params_of(self, layer_params):
    """The module's parameters inside its layer's parameter tree."""
    for key in self.path:
      layer_params = layer_params[key]
    return layer_params


class Tapper:
  """Taps the calls of :data:`TAPPED_MODULES` inside one layer application.

  Use as a context manager around the layer's ``apply``. Each tapped call at the layer's own trace
  level gets its parameters through ``stop_gradient`` and, when ``taps`` is given, the next tap
  added to its output. Afterwards ``calls`` describes the tapped calls in order, ``inputs`` holds
  each one's array arguments and ``outputs`` its output (taps included).

  Args:
    taps: None (record only: used to learn the outputs' shapes), or one pytree per tapped call,
      shaped like its output.
  """

  def __init__(self, taps: Sequence[Any] | None = None):
    self.taps = taps
    self.calls: list[TapCall] = []
    self.inputs: list[list[jax.Array]] = []
    self.outputs: list[Any] = []
    self._busy = False
    self._trace = None
    self._context = None

  def __enter__(self):
    self._trace = tracers.current_trace()
    self._context = nn.intercept_methods(self._intercept)
    self._context.__enter__()
    return self

  def __exit__(self, *exc):
    return self._context.__exit__(*exc)

  def _intercept(self, next_fun, args, kwargs, context):
    module = context.module
    if (self._busy or context.method_name != "__call__"
        or not isinstance(module, TAPPED_MODULES)
        or tracers.current_trace() != self._trace):
      return next_fun(*args, **kwargs)
    params = module.variables.get("params")
    if not params:
      return next_fun(*args, **kwargs)
    leaves, treedef = jax.tree.flatten((args, kwargs))
    call = TapCall(module=module.clone(parent=None), path=tuple(module.scope.path),
                   treedef=treedef,
                   statics=tuple(None if _is_array(leaf) else leaf for leaf in leaves))
    arrays = [leaf for leaf in leaves if _is_array(leaf)]
    self._busy = True  # The copy's own submodules are not tapped again.
    try:
      y = call.apply(lax.stop_gradient(params), arrays)
    finally:
      self._busy = False
    if self.taps is not None:
      y = jax.tree.map(lambda a, t: a + t.astype(a.dtype), y, self.taps[len(self.calls)])
    self.calls.append(call)
    self.inputs.append(arrays)
    self.outputs.append(y)
    return y


def weight_outputs(calls: Sequence[TapCall], layer_params, inputs, stacked: bool) -> list:
  """The outputs of the tapped ``calls`` re-applied to their recorded ``inputs`` with
  ``layer_params``: the function whose VJP at the output gradients is the weight gradient.

  Args:
    calls: the layer's tapped calls.
    layer_params: the layer's parameter tree (a Repeat's slice: stacked on a leading axis).
    inputs: per call, its recorded array arguments (stacked like the parameters when
      ``stacked``).
    stacked: whether the parameters and inputs carry a leading axis of layer copies.
  """
  outputs = []
  for call, arrays in zip(calls, inputs):
    params = call.params_of(layer_params)
    apply = jax.vmap(call.apply) if stacked else call.apply
    outputs.append(apply(params, arrays))
  return outputs
