"""A chunk's backward residuals kept from its forward tick to its backward tick (remat none).

A fused schedule's ``B`` tick differentiates its chunk with ``jax.vjp``. Without a residual stash
it recomputes the chunk's forward from the stashed input first: remat at the granularity of a
chunk whatever the remat setting. Under ``remat="none"`` the ``F`` tick runs the same ``jax.vjp``
instead and keeps the residuals that depend on the micro-batch in a slot; ``B`` traces the VJP
again, puts the kept residuals in place of its own, and XLA drops the forward whose results
nothing reads any more. What ``B`` still computes from its arguments is what depends on the
parameters alone (the weights as the chunk reads them, their casts to the compute dtype): kept
per micro-batch, those would be a copy of the stage's weights in every slot.

Which residual depends on what is read once per chunk program, from the jaxpr of the VJP's
residuals: dead-code elimination of the jaxpr for each residual alone names the inputs it needs.
The choice is a cost choice only: ``B`` traces the same function on the same micro-batch, so a
residual computed again equals the kept one.

Example::

  plan = residuals.plan_of(fn_of, trees, dynamic)    # once: fn_of(trees) = fn
  _, vjp = jax.vjp(fn, *floats)                      # F tick
  slot = residuals.keep(plan, vjp, sizes)            # packed, one buffer per dtype
  _, vjp = jax.vjp(fn, *floats)                      # B tick: the forward is dead code ...
  vjp = residuals.restore(plan, vjp, slot)           # ... once the kept residuals replace its
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax

from tpipe.core.base import float_leaves as floats_lib
from tpipe.core.base import jax_compat
from tpipe.core.base import packing


@dataclasses.dataclass(frozen=True)
class ResidualPlan:
  """Which of a VJP's residual leaves a slot keeps.

  Attributes:
    kept: per residual leaf (``jax.tree.leaves`` of the VJP), whether the slot keeps it.
    leaves: every residual leaf's shape and dtype, as the plan saw them.
  """

  kept: tuple[bool, ...]
  leaves: tuple = ()

  @property
  def kept_shapes(self) -> list[jax.ShapeDtypeStruct]:
    """The shapes and dtypes of the leaves the plan keeps, in order."""
    return [jax.ShapeDtypeStruct(shape, dtype)
            for (shape, dtype), k in zip(self.leaves, self.kept) if k]

  @property
  def layout(self):
    """:func:`tpipe.core.base.packing.layout_of` the kept leaves: what :func:`keep` packs."""
    return packing.layout_of(self.kept_shapes)


def plan_of(fn_of: Callable, trees: tuple, dynamic: Sequence[bool],
            has_aux: bool = False) -> ResidualPlan:
  """The residual plan of ``jax.vjp(fn_of(trees), *float leaves of trees)``.

  Args:
    fn_of: ``fn_of(trees)`` is the differentiated function of the float leaves of ``trees``
      (their other leaves, such as token ids, taken from ``trees``).
    trees: example arguments (arrays or tracers of the shapes the ticks pass).
    dynamic: per tree, whether it changes from micro-batch to micro-batch (the chunk's inputs;
      not its parameters). A residual computed from any leaf of such a tree is kept; what
      ``fn_of`` closes over counts as not changing.
    has_aux: as for ``jax.vjp``.
  """
  if len(dynamic) != len(trees):
    raise ValueError(f"dynamic has {len(dynamic)} entries for {len(trees)} trees.")
  leaves, treedef = jax.tree.flatten(tuple(trees))
  of_tree = [d for tree, d in zip(trees, dynamic) for _ in jax.tree.leaves(tree)]
  is_float = [floats_lib.is_float(a) for a in leaves]
  # Every leaf an input of the traced function (the differentiated ones first), so that the
  # jaxpr names what each residual is computed from.
  order = ([i for i, f in enumerate(is_float) if f]
           + [i for i, f in enumerate(is_float) if not f])

  def residual_leaves(inputs):
    by_leaf = dict(zip(order, inputs))
    fn = fn_of(jax.tree.unflatten(treedef, [by_leaf[i] for i in range(len(leaves))]))
    floats = [by_leaf[i] for i in order[:sum(is_float)]]
    return jax.tree.leaves(jax.vjp(fn, *floats, has_aux=has_aux)[1])

  inputs = [leaves[i] for i in order]
  closed = jax.make_jaxpr(residual_leaves)(inputs)
  needs = jax_compat.inputs_needed(closed)
  constants, moving = len(closed.jaxpr.constvars), [of_tree[i] for i in order]
  kept = []
  for output, var in enumerate(closed.jaxpr.outvars):
    computed_from = needs(output)[constants:]
    kept.append(not jax_compat.is_literal(var)
                and any(n and d for n, d in zip(computed_from, moving)))
  return ResidualPlan(tuple(kept), tuple((a.shape, a.dtype) for a in closed.out_avals))


def _leaves(plan: ResidualPlan, vjp):
  leaves, treedef = jax_compat.vjp_residuals(vjp)
  found = tuple((jax.numpy.shape(a), jax.numpy.result_type(a)) for a in leaves)
  if found != plan.leaves:
    raise RuntimeError(f"This VJP's residuals {[(s, str(d)) for s, d in found]} are not the "
                       f"{[(s, str(d)) for s, d in plan.leaves]} its plan was made for: the "
                       "function traced differently from the plan's.")
  return leaves, treedef


def kept(plan: ResidualPlan, vjp) -> list:
  """The leaves of ``vjp`` the plan keeps, in order (their layout is ``plan.layout``)."""
  leaves, _ = _leaves(plan, vjp)
  return [a for a, k in zip(leaves, plan.kept) if k]


def substitute(plan: ResidualPlan, vjp, kept_leaves: Sequence):
  """``vjp`` with the leaves the plan keeps replaced by ``kept_leaves`` (what :func:`kept`
  gave)."""
  leaves, treedef = _leaves(plan, vjp)
  kept_leaves = iter(kept_leaves)
  return jax_compat.vjp_with_residuals(treedef, [next(kept_leaves) if k else a
                                                 for a, k in zip(leaves, plan.kept)])


def keep(plan: ResidualPlan, vjp, sizes) -> dict:
  """The leaves of ``vjp`` the plan keeps, packed into buffers of ``sizes``."""
  return packing.pack(kept(plan, vjp), plan.layout, sizes)


def restore(plan: ResidualPlan, vjp, slot: dict):
  """``vjp`` with the leaves the plan keeps taken from ``slot`` (what :func:`keep` packed)."""
  return substitute(plan, vjp, packing.unpack(slot, plan.layout))
