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

FSDP uses it too (:mod:`tpipe.core.fsdp`): a weight gathered whole and only cast (followed
through moves, ``through_moves=True``) is cast before the gather, so the gather moves the
bfloat16 weight and the backward holds the weight's whole gradient in bfloat16 until it is
reduce-scattered in float32 a piece at a time.

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


# Operations that move or cut a value without computing on it (operand 0 is the value; a
# dynamic slice's other operands are its indices). Casting their operand instead of their result
# gives the same values, and their transposes add nothing up, so the gradient is the same too
# (a broadcast is left out: its transpose sums).
MOVES = frozenset({"transpose", "reshape", "squeeze", "expand_dims", "slice", "dynamic_slice",
                   "copy", "copy_p"})


def only_cast_dtypes(fn: Callable[..., Any], leaves: Sequence[Any], *args,
                     through_moves: bool = False) -> list:
  """Per leaf of ``leaves``, the dtype ``fn(leaves, *args)`` casts it to where every use of the
  leaf in the traced program is ``convert_element_type`` to that one dtype, else None. Uses
  inside a checkpoint or jit count as the body's uses; any other use (an output, another
  operation or call) means the leaf is used as it is.

  Args:
    fn: ``fn(leaves, *args)``, any JAX function; traced once (nothing runs).
    leaves: a list of arrays (or abstract values).
    *args: the other arguments, as ``fn`` takes them.
    through_moves: also follow a leaf through the operations in :data:`MOVES` (a transpose, a
      reshape, a slice...) and into a ``lax.scan``'s body (as a constant or a scanned input,
      not as the carry), so that, for example, a kernel transposed, cut in slices and each
      slice cast inside a loop counts as only cast. Worth it where the leaf is whole anyway
      (gathered): cast before those moves, the program reads a cast copy of the whole leaf
      where it read one slice's cast at a time.
  """
  closed = jax.make_jaxpr(lambda leaves: fn(leaves, *args))(list(leaves))
  targets = _cast_targets(closed.jaxpr, len(leaves), through_moves)
  result = []
  for leaf, dtypes in zip(leaves, targets):
    if dtypes is not None and len(dtypes) == 1:
      (dtype,) = dtypes
      result.append(dtype if dtype != np.dtype(leaf.dtype) else None)
    else:
      result.append(None)
  return result


def _cast_targets(jaxpr, count: int, through_moves: bool, opaque: Sequence[int] = (),
                  returns_moves: bool = False):
  """Per one of ``jaxpr``'s first ``count`` inputs, the set of dtypes every use casts it to, or
  None where some use takes it as it is. ``opaque``: inputs whose uses are not followed (a
  scan's carry: the body also sees values the previous step made). ``returns_moves`` (a call's
  body, followed through moves): an output that is a move of an input is no use of it; the
  result is then ``(targets, per output the input it moves or None)``."""
  position = jax_compat.var_positions(jaxpr.invars[:count])
  moved: dict[int, int] = {}  # id(var) -> the input it is a move of.
  targets: list[set | None] = [None if i in opaque else set() for i in range(count)]

  def source(var):
    if not jax_compat.is_var(var):
      return None
    i = position(var)
    return moved.get(id(var)) if i is None else i

  def use(i, dtypes):
    if targets[i] is not None:
      targets[i] = None if dtypes is None else targets[i] | dtypes

  for eqn in jaxpr.eqns:
    used = [(k, source(v)) for k, v in enumerate(eqn.invars) if source(v) is not None]
    if not used:
      continue
    new_dtype = jax_compat.casts_to(eqn)
    if new_dtype is not None:
      for _, i in used:
        use(i, {np.dtype(new_dtype)})
      continue
    if (through_moves and eqn.primitive.name in MOVES and [k for k, _ in used] == [0]
            and len(eqn.outvars) == 1):
      moved[id(eqn.outvars[0])] = used[0][1]
      continue
    # A call whose body sees its operands as they are (a jit, a checkpoint: the calls the
    # split backward's taps follow): a leaf passed to one is only cast if the body only casts it
    # (or, followed through moves, returns a move of it, which is followed on).
    body, carry, scan = jax_compat.call_body(eqn), (), None
    if through_moves and body is None:
      scan = jax_compat.scan_body(eqn)
      if scan is not None:
        body, consts, carries = scan
        carry = range(consts, consts + carries)
    body = None if body is None else body.jaxpr
    if body is None or len(body.invars) != len(eqn.invars):
      for _, i in used:
        use(i, None)
      continue
    if through_moves and scan is None:
      inner, returned = _cast_targets(body, len(body.invars), True, returns_moves=True)
      for var, k in zip(eqn.outvars, returned):
        if k is not None and source(eqn.invars[k]) is not None:
          moved[id(var)] = source(eqn.invars[k])
    else:
      inner = _cast_targets(body, len(body.invars), through_moves, carry)
    for k, i in used:
      use(i, inner[k])
  if returns_moves:
    return targets, [source(var) for var in jaxpr.outvars]
  for var in jaxpr.outvars:
    if source(var) is not None:
      use(source(var), None)
  return targets


def cast(leaves: Sequence[Any], dtypes: Sequence[Any]) -> list:
  """``leaves`` with those that have a dtype in ``dtypes`` cast to it."""
  return [a if d is None else a.astype(d) for a, d in zip(leaves, dtypes)]


def uncast(grads: Sequence[Any], dtypes: Sequence[Any]) -> list:
  """Gradients of cast leaves back in the leaves' own ``dtypes`` (the transpose of
  :func:`cast`)."""
  return [g.astype(d) if g.dtype != d else g for g, d in zip(grads, dtypes)]
