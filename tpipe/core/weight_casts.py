"""Which of a unit's weights it only ever casts, so a backward can cast them again instead of
keeping the casts.

A mixed-precision layer stores float32 weights and computes in bfloat16: Flax's ``Dense`` casts
its kernel on every call. Differentiated whole, a unit keeps those casts for its backward (the
matmul's transpose reads the bfloat16 kernel): one bfloat16 copy of every weight per unit whose
residuals are kept, which under ``remat_granularity="chunk"`` is every unit of the chunk at once.
The cast is recomputed from the float32 weight for the price of reading it.

:func:`only_cast_dtypes` reads a unit's program (its jaxpr, traced once) and names, per float
leaf, the one dtype the program converts it to where every use of the leaf is such a cast, else
None. :func:`tpipe.core.unit_backward.backward_into` then casts those leaves itself before the
unit's VJP, so the VJP's residuals hold the cast as an input, which the backward casts again
from the weight instead of keeping. The gradient is the same: a cast's transpose casts the
cotangent back, the same operation whether the layer or tpipe does the cast.

Example::

  def unit(w, x):                     # w float32, used only as bfloat16
    return x @ w.astype(jnp.bfloat16)
  only_cast_dtypes(unit, [w], x)      # [dtype('bfloat16')]
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np

from tpipe.core import jax_compat


def only_cast_dtypes(fn: Callable[..., Any], leaves: Sequence[Any], *args) -> list:
  """Per leaf of ``leaves``, the dtype ``fn(leaves, *args)`` casts it to where every use of the
  leaf in the traced program is ``convert_element_type`` to that one dtype, else None. Uses
  inside a checkpoint or jit count as the body's uses; any other use (an output, another
  operation or call) means the leaf is used as it is.

  Args:
    fn: ``fn(leaves, *args)``, any JAX function; traced once (nothing runs).
    leaves: a list of arrays (or abstract values).
    *args: the other arguments, as ``fn`` takes them.
  """
  closed = jax.make_jaxpr(lambda leaves: fn(leaves, *args))(list(leaves))
  targets = _cast_targets(closed.jaxpr, len(leaves))
  result = []
  for leaf, dtypes in zip(leaves, targets):
    if dtypes is not None and len(dtypes) == 1:
      (dtype,) = dtypes
      result.append(dtype if dtype != np.dtype(leaf.dtype) else None)
    else:
      result.append(None)
  return result


def _cast_targets(jaxpr, count: int) -> list:
  """Per one of ``jaxpr``'s first ``count`` inputs, the set of dtypes every use casts it to, or
  None where some use takes it as it is."""
  position = jax_compat.var_positions(jaxpr.invars[:count])
  targets: list[set | None] = [set() for _ in range(count)]

  def use(i, dtypes):
    if targets[i] is not None:
      targets[i] = None if dtypes is None else targets[i] | dtypes

  for eqn in jaxpr.eqns:
    used = [(k, position(v)) for k, v in enumerate(eqn.invars) if position(v) is not None]
    if not used:
      continue
    new_dtype = jax_compat.casts_to(eqn)
    if new_dtype is not None:
      for _, i in used:
        use(i, {np.dtype(new_dtype)})
      continue
    # A call whose body sees its operands as they are (a jit, a checkpoint: the calls the
    # split backward's taps follow): a leaf passed to one is only cast if the body only casts it.
    body = jax_compat.call_body(eqn)
    body = None if body is None else body.jaxpr
    if body is None or len(body.invars) != len(eqn.invars):
      for _, i in used:
        use(i, None)
      continue
    inner = _cast_targets(body, len(body.invars))
    for k, i in used:
      use(i, inner[k])
  for var in jaxpr.outvars:
    if position(var) is not None:
      use(position(var), None)
  return targets


def cast(leaves: Sequence[Any], dtypes: Sequence[Any]) -> list:
  """``leaves`` with those that have a dtype in ``dtypes`` cast to it."""
  return [a if d is None else a.astype(d) for a, d in zip(leaves, dtypes)]


def uncast(grads: Sequence[Any], dtypes: Sequence[Any]) -> list:
  """Gradients of cast leaves back in the leaves' own ``dtypes`` (the transpose of
  :func:`cast`)."""
  return [g.astype(d) if g.dtype != d else g for g, d in zip(grads, dtypes)]
