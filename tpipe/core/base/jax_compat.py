"""The JAX internals tpipe relies on, behind one boundary.

Four things tpipe does need more of JAX than its public API promises: reading what a VJP keeps
(its residuals, and which of them are its inputs as they were), reading jaxprs (which inputs an
output is computed from; which operands a call's body receives), evaluating a jaxpr equation
by equation (the split backward's taps, :mod:`tpipe.core.programs.taps`), and lowering a call
whose body holds a ``shard_map`` inline (:func:`inline_calls_of_shard_maps`: the TPU compiler
aborts on the other form). Every use goes through this module, and
``tests/core/base/test_jax_compat.py`` pins each behaviour it relies on with a small test, so a
JAX upgrade that changes one fails there, by name, rather than as a wrong gradient elsewhere.
Nothing else in tpipe imports ``jax._src`` or compares values by ``id()``.

>>> import jax.numpy as jnp
>>> w, x = jnp.ones((2, 3)), jnp.ones((4, 2))
>>> _, vjp = jax.vjp(lambda w: x @ w, w)
>>> leaves, _ = vjp_residuals(vjp)
>>> identical_positions(leaves, [x])  # The VJP keeps x itself as a residual.
[0]
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax._src import core as jax_core
from jax._src.interpreters import mlir
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as jex_core

ClosedJaxpr = jex_core.ClosedJaxpr
Var = jex_core.Var

# Nested calls whose body sees the call's operands as they are, so an equation of one can be
# followed into its body: jit, closed calls and checkpoints.
INLINED = frozenset({"pjit", "jit", "closed_call", "core_call", "remat2", "checkpoint"})

_CALL_LOWERING = mlir._lowerings[jax_core.closed_call_p].rule  # JAX's own: a called function.


# ------------------------------------------------------------------------------------------------
# Lowering.

def _has_shard_map(jaxpr) -> bool:
  """Whether ``jaxpr`` holds a ``shard_map``, at any depth of the jaxprs its equations call."""
  return any(eqn.primitive.name == "shard_map"
             or any(_has_shard_map(sub) for sub in jax_core.jaxprs_in_params(eqn.params))
             for eqn in jaxpr.eqns)


def _closed_call_lowering(ctx, *args, call_jaxpr):
  """JAX's lowering of a ``closed_call``, inline where its body holds a ``shard_map``."""
  if isinstance(call_jaxpr, jex_core.Jaxpr):
    call_jaxpr = pe.close_jaxpr(call_jaxpr)
  if not _has_shard_map(call_jaxpr.jaxpr):
    return _CALL_LOWERING(ctx, *args, call_jaxpr=call_jaxpr)
  inline = mlir.lower_fun(jax_core.jaxpr_as_fun(call_jaxpr), multiple_results=True)
  return inline(ctx, *args)


def inline_calls_of_shard_maps() -> None:
  """Lowers a closed call (what JAX's partial evaluation of a scan or a ``custom_vjp`` makes)
  whose body holds a ``shard_map`` inline, not as a called function. A ``shard_map`` nested in
  another (manual over more axes: :meth:`tpipe.core.programs.fsdp.Split.gather_unit`'s gather
  over ``expert``) inside a called function loses the outer ``shard_map``'s manual axes when
  Shardy exports it to HLO shardings, and the TPU compiler's SPMD partitioner aborts the
  process (``spmd_partitioner.cc: Check failed: target.IsManualSubgroup() ==
  sharding().IsManualSubgroup()``; XLA:CPU compiles it). Inlined, the manual computation sits
  inside the outer one and keeps them. Idempotent."""
  if mlir._lowerings[jax_core.closed_call_p].rule is not _closed_call_lowering:
    mlir.register_lowering(jax_core.closed_call_p, _closed_call_lowering, cacheable=False)


# ------------------------------------------------------------------------------------------------
# VJPs.

def vjp_residuals(vjp) -> tuple[list, Any]:
  """``(leaves, treedef)`` of the function ``jax.vjp`` returned: its leaves are the residuals the
  backward reads (a ``jax.tree_util.Partial``)."""
  return jax.tree.flatten(vjp)


def vjp_with_residuals(treedef, leaves: Sequence):
  """The VJP function of ``treedef`` (from :func:`vjp_residuals`) reading ``leaves`` instead."""
  return jax.tree.unflatten(treedef, list(leaves))


def identical_positions(values: Sequence, candidates: Sequence) -> list[int | None]:
  """Per value, the position in ``candidates`` of the very same object (not an equal one), or
  None: which of a VJP's residuals are its inputs as they were passed (JAX keeps an input a
  backward reads as the input's own tracer)."""
  position = {id(c): i for i, c in enumerate(candidates)}
  return [position.get(id(v)) for v in values]


# ------------------------------------------------------------------------------------------------
# Reading jaxprs.

def inputs_needed(closed: ClosedJaxpr) -> Callable[[int], list[bool]]:
  """``needs(output)``: per input of ``closed`` (its constants first, then its arguments),
  whether output ``output`` is computed from it (dead-code elimination of the rest)."""
  jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)

  def needs(output: int) -> list[bool]:
    used_outputs = [i == output for i in range(len(jaxpr.outvars))]
    _, used_inputs = pe.dce_jaxpr(jaxpr, used_outputs)
    return list(used_inputs)

  return needs


def is_literal(var) -> bool:
  """Whether a jaxpr operand is a literal (a constant written into the equation)."""
  return isinstance(var, jex_core.Literal)


def is_var(var) -> bool:
  """Whether a jaxpr operand is a variable (not a literal)."""
  return isinstance(var, jex_core.Var)


def literal_value(var):
  """The value of a literal operand."""
  return var.val


def var_positions(variables: Sequence) -> Callable[[Any], int | None]:
  """``position(var)``: where ``var`` (that very variable) is in ``variables``, or None. Jaxpr
  operands include literals, which are not hashable, so variables are told apart by identity."""
  index = {id(v): i for i, v in enumerate(variables)}
  return lambda var: index.get(id(var))


def call_body(equation) -> ClosedJaxpr | None:
  """The body of a call equation whose body sees its operands as they are (:data:`INLINED`),
  as a ``ClosedJaxpr`` whose inputs are the equation's operands; None for any other equation."""
  if equation.primitive.name not in INLINED:
    return None
  jaxpr = equation.params.get("jaxpr", equation.params.get("call_jaxpr"))
  if isinstance(jaxpr, jex_core.Jaxpr):  # A checkpoint's body: no constants of its own.
    return jex_core.ClosedJaxpr(jaxpr, ())
  return jaxpr if isinstance(jaxpr, jex_core.ClosedJaxpr) else None


def scan_body(equation) -> tuple[ClosedJaxpr, int, int] | None:
  """``(body, num_consts, num_carry)`` of a ``lax.scan`` equation, or None for any other. The
  body's inputs are the equation's operands in order: the constants, the carry, then one step's
  slice of each scanned input."""
  if equation.primitive.name != "scan":
    return None
  return equation.params["jaxpr"], equation.params["num_consts"], equation.params["num_carry"]


def casts_to(equation):
  """The dtype a ``convert_element_type`` equation casts to, or None for any other equation."""
  if equation.primitive is not jax.lax.convert_element_type_p:
    return None
  return equation.params["new_dtype"]


# ------------------------------------------------------------------------------------------------
# Evaluating jaxprs.

def bind(equation, values: Sequence) -> list:
  """Applies ``equation``'s primitive to ``values`` as the jaxpr does: the list of its outputs."""
  got = equation.primitive.get_bind_params(equation.params)
  subfuns, params = got if isinstance(got, tuple) else ((), got)
  with equation.ctx.manager:
    out = equation.primitive.bind(*subfuns, *values, **params)
  return list(out) if equation.primitive.multiple_results else [out]
