"""Split backward for zero-bubble schedules: input gradients now, weight gradients later, no work
done twice, for any layer written in any front end.

A zero-bubble schedule splits a chunk's backward into ``BI`` (the gradient of the chunk's input,
which the previous stage is waiting for) and ``W`` (the gradients of its weights, which nobody
waits for and which fill the pipeline's bubbles). Two plain VJPs (one for the input, one for the
weights) would redo the forward recomputation and most of the backward. Instead, the layer's
function is traced to a jaxpr, and every operation that is linear in one parameter is tapped:

* a ``dot_general`` or ``conv_general_dilated`` one of whose operands is a parameter (possibly
  cast, reshaped, transposed or broadcast on the way: :data:`PASS_THROUGH`) and the other not,
  and a ``gather`` from a parameter (an embedding lookup). That covers ``nn.Dense``,
  ``nn.DenseGeneral``, ``nn.Einsum``, ``nn.Conv``, ``nn.Embed`` and attention's projections in
  linen, ``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``, ``nnx.Conv`` and ``nnx.Embed`` in
  NNX, and a parameter a layer multiplies by directly.
* In ``BI`` the layer runs with each tapped operation rewritten as ``op(stop_gradient(w), x) +
  tap`` with a zero ``tap``. Differentiating with respect to the input and the taps gives the input
  gradient and, as the taps' gradients, each operation's output gradient ``dy``; the
  weight-gradient products are never formed. The operation's other operands ``x`` are recorded.
* ``W`` forms the weight gradients as the VJP of ``params -> op(w(params), x)`` at ``dy``: linear
  in the parameters, so it needs only ``x`` and ``dy`` (a matmul's weight gradient is
  ``x^T dy``); its primal output is unused and compiled away.

Everything else (a norm's scale, an addition of a bias, an operation inside a layer's own
``lax.scan``, which the jaxpr holds as one equation) keeps its weight gradient in ``BI``, so the
split is always exact and only the share of the backward that moves to ``W`` depends on the
layers. Nested ``jit`` calls and ``jax.checkpoint`` bodies are followed (a checkpoint's body then
keeps its intermediates for the tapped VJP instead of recomputing them).

:func:`trace` builds a :class:`Program` for one function and argument types; its
:meth:`Program.forward` runs the tapped forward and :meth:`Program.weight_outputs` the function
``W`` differentiates.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
from jax import lax

from tpipe.core.base import jax_compat

# Operations that pass a parameter on unchanged up to a linear map of one operand: a chain of
# them from a parameter to a tapped operation is re-applied in W.
PASS_THROUGH = frozenset({"convert_element_type", "reshape", "transpose", "broadcast_in_dim",
                          "squeeze", "expand_dims", "rev", "copy", "copy_p"})
# Operations linear in a parameter operand at these positions, the others being data.
TAPPABLE = {"dot_general": (0, 1), "conv_general_dilated": (0, 1), "gather": (0,)}
# Nested calls (jax_compat.INLINED) have their body inlined so that its operations can be tapped.
# A checkpoint's body inlined keeps its intermediates for the tapped VJP instead of recomputing
# them: a weight a layer multiplies inside its own checkpoint (a recomputed activation, say) still
# moves to W.


@dataclasses.dataclass(frozen=True, eq=False)
class Tap:
  """One tapped operation.

  Attributes:
    equation: the jaxpr equation of the operation.
    position: which operand is the parameter.
    parameter: the index of that parameter leaf.
    chain: the :data:`PASS_THROUGH` equations from the parameter leaf to the operand, in order.
  """

  equation: Any
  position: int
  parameter: int
  chain: tuple


class _Interpreter:
  """Evaluates a jaxpr, tracking which values pass a parameter leaf on unchanged, tapping the
  operations linear in one (see the module documentation)."""

  def __init__(self, taps: Sequence[Any] | None, tapping: bool):
    self.taps, self.tapping = taps, tapping
    self.found: list[Tap] = []
    self.records: list[list[Any]] = []
    self.outputs: list[Any] = []

  def run(self, closed, values, derived):
    """``closed``'s outputs on ``values``; ``derived[i]`` is ``(parameter, chain)`` when input
    ``i`` passes a parameter on, else None. Returns the outputs and their derivations."""
    jaxpr = closed.jaxpr
    env, origin = {}, {}
    read = lambda v: jax_compat.literal_value(v) if jax_compat.is_literal(v) else env[v]
    for var, value in zip(jaxpr.constvars, closed.consts):
      env[var] = value
    for var, value, how in zip(jaxpr.invars, values, derived):
      env[var] = value
      if how is not None:
        origin[var] = how
    for equation in jaxpr.eqns:
      invals = [read(v) for v in equation.invars]
      how = [origin.get(v) if jax_compat.is_var(v) else None for v in equation.invars]
      outvals, out_how = self.equation(equation, invals, how)
      for var, value, h in zip(equation.outvars, outvals, out_how):
        env[var] = value
        if h is not None:
          origin[var] = h
    outs = [read(v) for v in jaxpr.outvars]
    return outs, [origin.get(v) if jax_compat.is_var(v) else None for v in jaxpr.outvars]

  def equation(self, equation, invals, how):
    name = equation.primitive.name
    inner = jax_compat.call_body(equation)
    if inner is not None:
      return self.run(inner, invals, how)
    if name in PASS_THROUGH and len(invals) == 1 and how[0] is not None:
      parameter, chain = how[0]
      return jax_compat.bind(equation, invals), [(parameter, chain + (equation,))]
    positions = [i for i, h in enumerate(how) if h is not None]
    if self.tapping and len(positions) == 1 and positions[0] in TAPPABLE.get(name, ()):
      return self.tap(equation, invals, positions[0], how[positions[0]]), [None]
    return jax_compat.bind(equation, invals), [None] * len(equation.outvars)

  def tap(self, equation, invals, position, how):
    invals = list(invals)
    invals[position] = lax.stop_gradient(invals[position])
    (out,) = jax_compat.bind(equation, invals)
    if self.taps is not None:
      out = out + self.taps[len(self.found)].astype(out.dtype)
    self.found.append(Tap(equation, position, how[0], how[1]))
    self.records.append([v for i, v in enumerate(invals) if i != position])
    self.outputs.append(out)
    return [out]


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
  """One function traced for the split backward (see :func:`trace`).

  Attributes:
    closed: the function's jaxpr over ``(parameter leaves, other array leaves)``.
    num_params: how many of its inputs are parameter leaves.
    out_tree: the structure of the function's output.
    taps: the tapped operations, in the order the forward meets them.
  """

  closed: Any
  num_params: int
  out_tree: Any
  taps: tuple[Tap, ...]

  def forward(self, param_leaves, other_leaves, taps=None):
    """The function with its tapped operations' weights behind ``stop_gradient`` and ``taps``
    (one array per tap, shaped like its output; ``None``: none added) added to their outputs.

    Returns:
      ``(output, records, tap_outputs)``: the function's output, per tap its other operands
      (what ``W`` needs), and per tap its output.
    """
    interpreter = _Interpreter(taps, tapping=True)
    derived = [(i, ()) for i in range(self.num_params)] + [None] * len(other_leaves)
    outs, _ = interpreter.run(self.closed, list(param_leaves) + list(other_leaves), derived)
    return (jax.tree.unflatten(self.out_tree, outs), interpreter.records,
            interpreter.outputs)

  def weight_outputs(self, param_leaves, records) -> list:
    """Each tapped operation applied again to its recorded operands and the parameters: the
    function whose VJP at the taps' gradients is the tapped part of the weight gradients."""
    outputs = []
    for tap, others in zip(self.taps, records):
      weight = param_leaves[tap.parameter]
      for equation in tap.chain:
        (weight,) = jax_compat.bind(equation, [weight])
      operands = list(others)
      operands.insert(tap.position, weight)
      outputs.extend(jax_compat.bind(tap.equation, operands))
    return outputs


def trace(fn: Callable, params, *args) -> Program:
  """Traces ``fn(params, *args)`` for the split backward.

  Args:
    fn: a pure function; ``params`` is a pytree of arrays (the weights), ``args`` anything
      (non-array leaves are closed over as static values).
    params: its parameters (arrays or tracers; their types are what is traced).
    *args: its other arguments.

  Returns:
    A :class:`Program` whose ``forward`` takes ``(param leaves, other array leaves)`` in the
    order :func:`split_leaves` gives them.
  """
  param_leaves, other_leaves, rebuild = split_leaves(params, args)
  num_params = len(param_leaves)

  def flat(*leaves):
    p, a = rebuild(leaves[:num_params], leaves[num_params:])
    return fn(p, *a)

  closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*param_leaves, *other_leaves)
  out_tree = jax.tree.structure(out_shape)
  interpreter = _Interpreter(None, tapping=True)
  derived = [(i, ()) for i in range(num_params)] + [None] * len(other_leaves)
  jax.eval_shape(lambda *leaves: interpreter.run(closed, list(leaves), derived)[0],
                 *param_leaves, *other_leaves)
  return Program(closed=closed, num_params=num_params, out_tree=out_tree,
                 taps=tuple(interpreter.found))


def _is_array(leaf) -> bool:
  return isinstance(leaf, jax.Array) or (hasattr(leaf, "shape") and hasattr(leaf, "dtype"))


def split_leaves(params, args):
  """``(param leaves, other array leaves, rebuild)``: ``rebuild(param_leaves, array_leaves)``
  returns ``(params, args)`` with non-array leaves of ``args`` as they were."""
  param_leaves, param_tree = jax.tree.flatten(params)
  arg_leaves, arg_tree = jax.tree.flatten(args, is_leaf=lambda v: v is None)
  is_array = [_is_array(leaf) for leaf in arg_leaves]
  arrays = [leaf for leaf, a in zip(arg_leaves, is_array) if a]

  def rebuild(p_leaves, a_leaves):
    a_leaves = iter(a_leaves)
    merged = [next(a_leaves) if a else leaf for leaf, a in zip(arg_leaves, is_array)]
    return (jax.tree.unflatten(param_tree, list(p_leaves)),
            jax.tree.unflatten(arg_tree, merged))

  return param_leaves, arrays, rebuild
