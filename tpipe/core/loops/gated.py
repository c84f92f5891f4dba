"""Run a function only when a traced flag says so, in the forward pass and in the backward pass.

A pipeline tick runs a stage's layers only when the schedule gives the stage work; idle (bubble)
ticks must compute nothing, or a block that is undefined at a placeholder input (an RMS norm
without epsilon at zero) turns the masked result's zero cotangent into NaN gradients.

``lax.cond`` alone is not enough under autodiff: when JAX linearizes a conditional it hands every
value the backward branch needs to it as a residual *output* of the forward conditional, so the
stage's parameters are copied once per linearization (and, if the conditional sits directly in the
tick loop, once per tick). :func:`switch_call` (and :func:`gated_call`, its one-branch case)
therefore defines its own VJP:

* forward: ``lax.switch(index, [idle, vjp_of_branch_0, ...])``. A busy branch runs
  ``jax.vjp(fn, ...)`` and returns the output and the residuals the VJP needs. Residuals that are
  ``fn``'s own inputs (the parameters, the stage input) are recognised by identity while the
  branch is traced and are not returned through the conditional but taken again from the
  inputs, so nothing is copied; only values ``fn`` computed (activations its remat policy saves)
  cross the conditional. The idle branch returns zeros and computes nothing.
* backward: ``lax.switch(index, [zeros, apply_vjp_0, ...])``: the same branch, or nothing.

What is saved is whatever ``fn``'s own ``jax.checkpoint`` policy saves: with full
rematerialization only inputs, so nothing; with no remat, every activation.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpipe.core.base import jax_compat
from tpipe.core.base import packing
from tpipe.core.base import spmd


def _differentiable(leaf) -> bool:
  return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


def _zeros(shapes, varying):
  """Zeros of the given shapes and dtypes, varying over the given manual axes (all branches of a
  conditional inside ``shard_map`` must agree on that)."""
  return [spmd.cast_to(jnp.zeros(shape.shape, shape.dtype), axes)
          for shape, axes in zip(shapes, varying)]


def gated_call(busy, fn: Callable[..., Any], *args) -> Any:
  """``fn(*args)`` if ``busy`` else zeros shaped like its output; differentiable.

  Gradients flow to every floating-point leaf of ``args`` (zero when not ``busy``); integer, bool
  and PRNG-key leaves get none. ``fn`` must be pure and must not contain collectives (every device
  runs its own branch).

  Args:
    busy: a traced boolean scalar.
    fn: the function to run, typically wrapped in ``jax.checkpoint`` with a remat policy.
    *args: its arguments (pytrees of arrays).

  Returns:
    ``fn(*args)``, or zeros of the same structure, shapes and dtypes.
  """
  return switch_call(jnp.where(busy, 0, -1), [fn], *args)


def switch_call(index, branches: Sequence[Callable[..., Any]], *args) -> Any:
  """``branches[index](*args)``, or zeros when ``index < 0``; differentiable, with the same
  branch taken in the backward pass.

  Every branch must return the same pytree structure, shapes and dtypes. Residuals that branches
  compute (activations their remat policies save) differ per branch; with more than one branch
  they are packed into one buffer per dtype, as large as the largest branch needs
  (:mod:`tpipe.core.base.packing`), so the conditional holds one branch's worth, not the sum.

  Args:
    index: a traced integer scalar: the branch to run, or negative for none.
    branches: the functions, each pure and free of collectives.
    *args: their arguments (pytrees of arrays).

  Returns:
    The chosen branch's output, or zeros of the same structure, shapes and dtypes.
  """
  return _Switch(branches, args).run(index)


class _Switch:
  """:func:`switch_call` on one call's arguments: the forward conditional, what each branch
  saves, and the backward conditional that rebuilds its VJP."""

  def __init__(self, branches: Sequence[Callable[..., Any]], args):
    self.branches = branches
    leaves, self.treedef = jax.tree.flatten(args)
    self.is_diff = [_differentiable(leaf) for leaf in leaves]
    self.diff_leaves = tuple(leaf for leaf, d in zip(leaves, self.is_diff) if d)
    self.other_leaves = tuple(leaf for leaf, d in zip(leaves, self.is_diff) if not d)
    # With several branches the residuals branches compute are packed into one buffer per
    # dtype. Not on a mesh with auto axes (tensor): XLA's partitioner may split such a buffer,
    # and slicing residuals out of a split buffer moves pieces between devices with
    # collective-permutes inside the branch, which the devices running other branches never
    # join. There every branch's residuals get their own outputs (zeros from the others).
    self.packed = len(branches) > 1 and not spmd.auto_axes_here()
    self.separate = len(branches) > 1 and not self.packed
    # Filled while tracing each branch: how to rebuild its VJP from the saved residuals.
    self.plans: list[dict[str, Any]] = [{} for _ in branches]
    self.sizes = None  # with several branches: the common residual buffer sizes

  def call(self, fn, diff_leaves, other_leaves):
    diff_leaves, other_leaves = iter(diff_leaves), iter(other_leaves)
    merged = [next(diff_leaves) if d else next(other_leaves) for d in self.is_diff]
    return fn(*jax.tree.unflatten(self.treedef, merged))

  def busy_forward(self, k, diff_leaves, other_leaves, out_axes=None):
    """Branch ``k`` under ``jax.vjp``: its outputs and the residuals it computed (the ones that
    are its inputs are recognised by identity and taken again in the backward pass)."""

    def fn(*d):
      out = self.call(self.branches[k], d, other_leaves)
      if out_axes is None:
        return out
      # Inside the differentiated function, so the VJP takes cotangents of the cast type. Only
      # outputs that do not depend on the inputs (zeros) vary over fewer axes than the union,
      # and a constant has no linear part, so no reduction over mesh axes enters the branch.
      out_leaves, tree = jax.tree.flatten(out)
      return jax.tree.unflatten(tree, [spmd.cast_to(o, a) for o, a in zip(out_leaves, out_axes)])

    out, vjp_fn = jax.vjp(fn, *diff_leaves)
    residuals, vjp_tree = jax_compat.vjp_residuals(vjp_fn)
    # Per residual, an input's index (the input itself), or None if computed.
    source = jax_compat.identical_positions(residuals, list(diff_leaves) + list(other_leaves))
    computed = [r for r, s in zip(residuals, source) if s is None]
    out_leaves, out_tree = jax.tree.flatten(out)
    self.plans[k].update(vjp_tree=vjp_tree, source=source, out_tree=out_tree,
                         out_axes=[spmd.varying_axes(o) for o in out_leaves],
                         res_axes=[spmd.varying_axes(r) for r in computed],
                         layout=packing.layout_of(computed) if self.packed else None)
    return out_leaves, computed

  def _types(self, diff_leaves, other_leaves):
    """One shape pass over the branches: their output types, residual layouts and the mesh axes
    their values vary over (every branch of the switch must return the same types, varying
    axes included)."""
    shapes = [jax.eval_shape(lambda d, o, k=k: self.busy_forward(k, d, o), diff_leaves,
                             other_leaves) for k in range(len(self.branches))]
    out_tree, out_shapes = self.plans[0]["out_tree"], shapes[0][0]
    types = lambda leaves: [(tuple(s.shape), s.dtype) for s in leaves]
    for k, plan in enumerate(self.plans):
      # Varying mesh axes may differ between branches (a zero-filled output varies over none);
      # every output is cast to the union.
      if plan["out_tree"] != out_tree or types(shapes[k][0]) != types(out_shapes):
        raise ValueError(f"switch_call: branch {k} returns {plan['out_tree']} with "
                         f"{types(shapes[k][0])}, branch 0 {out_tree} with {types(out_shapes)}; "
                         "every branch must return the same structure, shapes and dtypes.")
    out_axes = [frozenset().union(*axes) for axes in zip(*[p["out_axes"] for p in self.plans])]
    if self.packed:
      self.sizes = packing.buffer_sizes([p["layout"] for p in self.plans])
      res_shapes = [jax.ShapeDtypeStruct((n,), jnp.dtype(k)) for k, n in self.sizes.items()]
      axes = frozenset().union(*[a for p in self.plans for a in p["res_axes"]])
      res_axes = [axes] * len(self.sizes)
    elif self.separate:
      res_shapes = [r for k in range(len(self.branches)) for r in shapes[k][1]]
      res_axes = [a for p in self.plans for a in p["res_axes"]]
      starts = np.cumsum([0] + [len(p["res_axes"]) for p in self.plans])
      self.slots = [(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]
    else:
      res_shapes, res_axes = shapes[0][1], self.plans[0]["res_axes"]
    return out_tree, out_shapes, out_axes, res_shapes, res_axes

  def forward(self, index, diff_leaves, other_leaves):
    out_tree, out_shapes, out_axes, res_shapes, res_axes = self._types(diff_leaves, other_leaves)

    def branch(k):

      def run_branch(diff_leaves, other_leaves):
        out_leaves, computed = self.busy_forward(k, diff_leaves, other_leaves, out_axes)
        if self.packed:
          computed = list(packing.pack(computed, self.plans[k]["layout"], self.sizes).values())
        elif self.separate:
          start, stop = self.slots[k]
          zeros = _zeros(res_shapes, res_axes)
          computed = zeros[:start] + list(computed) + zeros[stop:]
        return ([spmd.cast_to(o, a) for o, a in zip(out_leaves, out_axes)],
                [spmd.cast_to(r, a) for r, a in zip(computed, res_axes)])

      return run_branch

    def idle(diff_leaves, other_leaves):
      del diff_leaves, other_leaves
      return _zeros(out_shapes, out_axes), _zeros(res_shapes, res_axes)

    out_leaves, computed = lax.switch(jnp.maximum(index + 1, 0),
                                      [idle] + [branch(k) for k in range(len(self.branches))],
                                      diff_leaves, other_leaves)
    return jax.tree.unflatten(out_tree, out_leaves), computed

  def backward(self, saved, cotangent):
    index, diff_leaves, other_leaves, computed = saved
    inputs = list(diff_leaves) + list(other_leaves)

    def apply_vjp(k):

      def backward(cotangent, computed):
        plan = self.plans[k]
        if self.packed:
          computed = jax.tree.leaves(packing.unpack(dict(zip(self.sizes, computed)),
                                                    plan["layout"]))
        elif self.separate:
          computed = computed[slice(*self.slots[k])]
        computed = iter(computed)
        residuals = [next(computed) if s is None else inputs[s] for s in plan["source"]]
        grads = jax_compat.vjp_with_residuals(plan["vjp_tree"], residuals)(cotangent)
        return tuple(spmd.cast_to(g, spmd.varying_axes(d)) for g, d in zip(grads, diff_leaves))

      return backward

    def no_gradient(cotangent, computed):
      del cotangent, computed
      return tuple(jnp.zeros_like(leaf) for leaf in diff_leaves)

    grads = lax.switch(jnp.maximum(index + 1, 0),
                       [no_gradient] + [apply_vjp(k) for k in range(len(self.branches))],
                       cotangent, computed)
    return None, grads, None

  def run(self, index):

    @jax.custom_vjp
    def run(index, diff_leaves, other_leaves):
      return self.forward(index, diff_leaves, other_leaves)[0]

    def run_fwd(index, diff_leaves, other_leaves):
      out, computed = self.forward(index, diff_leaves, other_leaves)
      return out, (index, diff_leaves, other_leaves, computed)

    run.defvjp(run_fwd, self.backward)
    return run(index, self.diff_leaves, self.other_leaves)
