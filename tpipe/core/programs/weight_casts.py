"""Which of a unit's weights it only ever casts, so a backward can cast them again instead of
keeping the casts.

A mixed-precision layer stores float32 weights and computes in bfloat16: Flax's ``Dense`` casts
its kernel on every call. Differentiated whole, a unit keeps those casts for its backward (the
matmul's transpose reads the bfloat16 kernel): one bfloat16 copy of every weight per unit whose
residuals are kept, which under ``remat_granularity="chunk"`` is every unit of the chunk at once.
The cast is recomputed from the float32 weight for the price of reading it.

:func:`only_cast_dtypes` reads a unit's program (its jaxpr, traced once) and names, per float
leaf, the dtype the program converts it to where the leaf's one use is such a cast, else None.
:func:`tpipe.core.programs.unit_backward.backward_into` then casts those leaves itself before the
unit's
VJP, so the VJP's residuals hold the cast as an input, which the backward casts again from the
weight instead of keeping. The gradient is the same: a cast's transpose casts the
cotangent back, the same operation whether the layer or tpipe does the cast.

FSDP uses it too (:mod:`tpipe.core.programs.fsdp`): a weight gathered whole and only cast (followed
through moves, ``through_moves=True``) is cast before the gather, so the gather moves the
bfloat16 weight and the backward holds the weight's whole gradient in bfloat16 until it is
reduce-scattered in float32 a piece at a time. That cast is tied to the loops' step
(:func:`tie_to_steps`), so XLA computes it where the gather needs it instead of hoisting it out
of the loops, where a bfloat16 copy of every weight shard of the stage would stay live for the
whole step.

Example::

  def unit(w, x):                     # w float32, used only as bfloat16
    return x @ w.astype(jnp.bfloat16)
  only_cast_dtypes(unit, [w], x)      # [dtype('bfloat16')]
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpipe.core.base import jax_compat


# Operations that move or cut a value without computing on it (operand 0 is the value; a
# dynamic slice's other operands are its indices). Casting their operand instead of their
# result gives the same values, and their transposes add nothing up (a broadcast is left out:
# its transpose sums).
MOVES = frozenset({"transpose", "reshape", "squeeze", "slice", "dynamic_slice", "copy"})


def only_cast_dtypes(fn: Callable[..., Any], leaves: Sequence[Any], *args,
                     through_moves: bool = False) -> list:
  """Per leaf of ``leaves``, the dtype ``fn(leaves, *args)`` casts it to where the leaf's one use
  in the traced program is ``convert_element_type`` to that dtype, else None. Uses inside a
  checkpoint or jit count as the body's uses; any other use (an output, another operation or
  call) means the leaf is used as it is, and a leaf cast twice is not named either: cast once
  before both uses, its gradient would be summed in the cast dtype, where the two casts'
  gradients are summed in the leaf's own.

  Args:
    fn: ``fn(leaves, *args)``, any JAX function; traced once (nothing runs).
    leaves: a list of arrays (or abstract values).
    *args: the other arguments, as ``fn`` takes them.
    through_moves: name a leaf only if each of its elements reaches one cast, once, followed
      through the operations in :data:`MOVES` (a transpose, a reshape, a slice), calls and
      loops: a ``lax.scan``'s scanned inputs (one slice per step), and its constants where each
      step reads its own slice of one (a ``dynamic_slice`` at the step's index, from a scanned
      ``iota``), never its carry. For example, a kernel transposed, cut into vocabulary slices
      and each slice cast inside a loop counts, where a leaf cast in every step of a loop does
      not: each element reaches one cast once.
  """
  closed = jax.make_jaxpr(lambda leaves: fn(leaves, *args))(list(leaves))
  targets = _cast_targets(closed.jaxpr, len(leaves), through_moves)
  result = []
  for leaf, dtypes in zip(leaves, targets):
    one = dtypes is not None and len(dtypes) == 1
    result.append(dtypes[0] if one and dtypes[0] != np.dtype(leaf.dtype) else None)
  return result


def _cast_targets(jaxpr, count: int, through_moves: bool, used_as_is: Sequence[int] = (),
                  per_step: Sequence[int] = (), step_indices: dict[int, int] | None = None,
                  returns_moves: bool = False):
  """Per one of ``jaxpr``'s first ``count`` inputs, the list of the casts' dtypes its uses
  reach, one entry per cast, or None where some use takes it as it is.

  Followed through moves (``through_moves``, see :func:`only_cast_dtypes`): ``used_as_is`` are
  inputs taken as they are (a scan's carry); ``per_step`` inputs a loop's constants, read every
  step, so only a slice at the step's index counts; ``step_indices`` ``{input: n}``: the loop's
  step index, distinct every step and in ``[0, n)``. With ``returns_moves`` (a call's body) an
  output that is a move of an input is no use of it, and the result is ``(targets, per output
  (the input it moves or None, whether it is still read whole every step))``.
  """
  position = jax_compat.var_positions(jaxpr.invars[:count])
  moved: dict[int, int] = {}  # id(var) -> the input it is a move of.
  every_step = {id(jaxpr.invars[i]) for i in per_step}  # Read whole every step of a loop.
  # id(var) -> n: the loop's step index, in [0, n).
  index = {id(jaxpr.invars[i]): n for i, n in (step_indices or {}).items()}
  zeros: set[int] = set()  # Integer zeros made inside this jaxpr.
  negative: dict[int, int] = {}  # id(``index < 0``) -> id(index).
  iotas: dict[int, int] = {}  # id -> n of 1-D ``iota`` outputs ([0, n): a loop's step index).
  targets: list[list | None] = [None if i in used_as_is else [] for i in range(count)]

  def source(var):
    if not jax_compat.is_var(var):
      return None
    i = position(var)
    return moved.get(id(var)) if i is None else i

  def use(i, dtypes):
    if targets[i] is not None:
      targets[i] = None if dtypes is None else targets[i] + dtypes

  for eqn in jaxpr.eqns:
    if through_moves:
      _step_index(eqn, index, zeros, negative, iotas)
    used = [(k, source(v)) for k, v in enumerate(eqn.invars) if source(v) is not None]
    if not used:
      continue
    stepped = [id(eqn.invars[k]) in every_step for k, _ in used]
    new_dtype = jax_compat.casts_to(eqn)
    if new_dtype is not None:
      for (_, i), whole in zip(used, stepped):
        use(i, None if whole else [np.dtype(new_dtype)])
      continue
    if (through_moves and eqn.primitive.name in MOVES and [k for k, _ in used] == [0]
            and len(eqn.outvars) == 1):
      out = id(eqn.outvars[0])
      moved[out] = used[0][1]
      if stepped[0] and not _slice_at(eqn, index, zeros):
        every_step.add(out)  # Still the whole constant (or a slice every step reads).
      continue
    # A call whose body sees its operands as they are (a jit, a checkpoint: the calls the
    # split backward's taps follow): a leaf passed to one is only cast if the body only casts it
    # (or, followed through moves, returns a move of it, which is followed on).
    body, carry, scan = jax_compat.call_body(eqn), (), None
    if through_moves and body is None:
      scan = jax_compat.scan_body(eqn)
    operands = [id(v) if jax_compat.is_var(v) else None for v in eqn.invars]
    if scan is not None:
      body, consts, carries = scan
      carry = range(consts, consts + carries)
      if any(stepped):  # A loop inside a loop reading a whole constant every step: not followed.
        body = None
    body = None if body is None else body.jaxpr
    if body is None or len(body.invars) != len(eqn.invars):
      for _, i in used:
        use(i, None)
      continue
    if scan is not None:
      inner = _cast_targets(
          body, len(body.invars), True, used_as_is=carry, per_step=range(consts),
          step_indices={k: iotas[operands[k]] for k in range(consts + carries, len(operands))
                        if operands[k] in iotas})
    elif through_moves:
      inner, returned = _cast_targets(
          body, len(body.invars), True,
          per_step=[k for k, o in enumerate(operands) if o in every_step],
          step_indices={k: index[o] for k, o in enumerate(operands) if o in index},
          returns_moves=True)
      for var, (k, whole) in zip(eqn.outvars, returned):
        if k is not None and source(eqn.invars[k]) is not None:
          moved[id(var)] = source(eqn.invars[k])
          if whole:
            every_step.add(id(var))
    else:
      inner = _cast_targets(body, len(body.invars), False)
    for k, i in used:
      use(i, inner[k])
  if returns_moves:
    return targets, [(source(var), jax_compat.is_var(var) and id(var) in every_step)
                     for var in jaxpr.outvars]
  for var in jaxpr.outvars:
    if source(var) is not None:
      use(source(var), None)
  return targets


# Operations that pass an integer on as it is: a conversion, and marking it varying over mesh
# axes inside ``shard_map`` (operand ``k`` to output ``k``).
_SAME_INTEGER = frozenset({"convert_element_type", "pvary", "pcast"})


def _step_index(eqn, index: dict, zeros: set, negative: dict, iotas: dict):
  """Notes what ``eqn`` makes of a loop's step index (a non-negative int distinct every step)
  and of zeros: the index or a zero passed on as it is (:data:`_SAME_INTEGER`) stays one;
  ``index < 0`` is noted, and ``select_n(index < 0, index, ...)`` (how ``lax.dynamic_slice``
  wraps negative indices) is the index, which is never negative. Also notes 1-D ``iota``
  outputs and their lengths."""
  name, ins, outs = eqn.primitive.name, eqn.invars, eqn.outvars
  ids = [id(v) if jax_compat.is_var(v) else None for v in ins]
  is_zero = lambda k: (ids[k] in zeros if ids[k] is not None
                       else np.ndim(jax_compat.literal_value(ins[k])) == 0
                       and jax_compat.literal_value(ins[k]) == 0)
  if name == "iota" and len(outs[0].aval.shape) == 1:
    iotas[id(outs[0])] = outs[0].aval.shape[0]
  elif name in _SAME_INTEGER and len(ins) == len(outs):
    for k, out in enumerate(outs):
      if ids[k] in index:
        index[id(out)] = index[ids[k]]
      elif is_zero(k):
        zeros.add(id(out))
  elif name == "lt" and ids[0] in index and is_zero(1):
    negative[id(outs[0])] = ids[0]
  elif name == "select_n" and len(ins) == 3 and ids[0] in negative and (
          negative[ids[0]] == ids[1]):
    index[id(outs[0])] = index[ids[1]]


def _slice_at(eqn, index: dict, zeros: set) -> bool:
  """Whether ``eqn`` is a ``dynamic_slice`` of size 1 at the step index along one dimension (at
  least as long as the index's range: never clamped, so no two steps read one slice) and at 0
  along the others: each step of the loop reads its own slice."""
  if eqn.primitive.name != "dynamic_slice":
    return False
  starts, sizes = eqn.invars[1:], eqn.params["slice_sizes"]
  at = [d for d, v in enumerate(starts) if jax_compat.is_var(v) and id(v) in index]
  zero = lambda v: (id(v) in zeros if jax_compat.is_var(v)
                    else jax_compat.literal_value(v) == 0)
  return (len(at) == 1 and sizes[at[0]] == 1
          and eqn.invars[0].aval.shape[at[0]] >= index[id(starts[at[0]])]
          and all(zero(v) for d, v in enumerate(starts) if d != at[0]))


def cast(leaves: Sequence[Any], dtypes: Sequence[Any], tie=None) -> list:
  """``leaves`` with those that have a dtype in ``dtypes`` cast to it, each passed through
  ``tie`` (:func:`tie_to_steps`) first where given."""
  tie = tie or (lambda a: a)
  return [a if d is None else tie(a).astype(d) for a, d in zip(leaves, dtypes)]


def uncast(grads: Sequence[Any], dtypes: Sequence[Any]) -> list:
  """Gradients of cast leaves back in the leaves' own ``dtypes`` (the transpose of
  :func:`cast`)."""
  return [g.astype(d) if g.dtype != d else g for g, d in zip(grads, dtypes)]


def cast_by_path(tree, casts, tie=None):
  """``tree`` with each leaf whose key path (``jax.tree_util.keystr``) ``casts`` names cast to
  that dtype, passed through ``tie`` (:func:`tie_to_steps`) first where given: a stacked unit's
  weights on a stage that holds them whole (no fsdp), cast where the unit runs rather than
  hoisted out of the loops by XLA.

  Example::

    >>> import jax.numpy as jnp
    >>> out = cast_by_path({"w": jnp.ones(2), "b": jnp.ones(2)}, {"['w']": jnp.bfloat16})
    >>> out["w"].dtype, out["b"].dtype
    (dtype(bfloat16), dtype('float32'))
  """
  def one(path, leaf):
    dtype = casts.get(jax.tree_util.keystr(path))
    if dtype is None or leaf.dtype == dtype:  # Not cast, or cast already.
      return leaf
    return (tie(leaf) if tie is not None else leaf).astype(dtype)

  return jax.tree_util.tree_map_with_path(one, tree)


_UNTIED = [0]  # Inside :func:`untied`: tie_to_steps leaves values as they are.


@contextlib.contextmanager
def untied():
  """While tracing a program only to read which weights it only casts
  (:func:`only_cast_dtypes`): :func:`tie_to_steps` returns its tree as it is, so a weight
  tied and then cast reads as a weight cast."""
  _UNTIED[0] += 1
  try:
    yield
  finally:
    _UNTIED[0] -= 1


def tie_to_steps(tree, steps: Sequence[Any]):
  """``tree`` with each float leaf ``a`` as ``a - z``: ``z`` is a float32 +0.0 computed from the
  integer loop indices ``steps`` (a unit's number in a scanned run, the tick's micro-batch), so
  the leaves vary with every loop the indices vary with. Values are unchanged bit for bit
  (``a - (+0.0)`` is ``a``, signed zeros, infinities and NaNs included; a subnormal value
  becomes a zero of its sign on a device that flushes subnormals in arithmetic, as TPUs and
  XLA:CPU's bfloat16 do), and so are gradients.

  A weight the loops only read is loop-invariant, and XLA's loop-invariant code motion hoists
  what is computed from it alone (its bfloat16 cast; for a run of stacked weights, the cast of
  the whole stack) out of the loops, where it stays live for the whole step. Tied, the cast is
  computed where it is used (``a - z`` fuses into it). XLA does not fold ``x * 0.0`` for floats
  (it is NaN for an infinite ``x``), so ``z`` stays a value of the loop; an optimization barrier
  does not keep the cast inside on the TPU compiler (measured: the cast was hoisted all the
  same).
  """
  if _UNTIED[0]:
    return tree
  zero = jnp.zeros((), jnp.float32)
  for step in steps:
    zero = zero + jnp.abs(jnp.asarray(step).astype(jnp.float32)) * 0.0
  zero = lax.stop_gradient(zero)
  tie = lambda a: a - zero.astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a
  return jax.tree.map(tie, tree)


def casts_read_by(program, tree) -> dict:
  """``{keystr(path): dtype}`` of the leaves of ``tree`` (a unit's variables as stored) that the
  traced ``program`` (:func:`tpipe.core.programs.taps.trace`) read in another dtype: gathered cast,
  so a
  pass over the same program (the weight pass of a split backward) casts the same leaves."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  avals = program.closed.in_avals[:program.num_params]
  assert len(flat) == len(avals), (len(flat), len(avals))
  return {jax.tree_util.keystr(path): aval.dtype for (path, leaf), aval in zip(flat, avals)
          if aval.dtype != leaf.dtype}
