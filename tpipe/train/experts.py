"""Experts' SwiGLU MLPs over rows grouped by expert (:func:`swiglu`), which both
mixture-of-experts dispatches run: :mod:`tpipe.train.moe`'s on every token a device holds, by
:func:`grouped_matmul`, and :mod:`tpipe.train.expert_dispatch`'s on the pairs an all-to-all
brought to each device's experts, by its per-device grouped product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import custom_batching

import tpipe


def _batched_at_zero(fn):
  """``fn`` with a batching rule that batches every operand at axis 0, the unbatched ones
  broadcast: ``jax.lax.ragged_dot`` batches only so (JAX 0.10), and tpipe runs layers under
  ``vmap`` (its planning passes bind the mesh's axis names with size-1 ``vmap`` axes)."""
  wrapped = custom_batching.custom_vmap(fn)

  @wrapped.def_vmap
  def rule(axis_size, in_batched, *args):
    grow = lambda a, b: a if b else jnp.broadcast_to(a, (axis_size,) + jnp.shape(a))
    leaves, tree = jax.tree.flatten(args)
    flags = jax.tree.leaves(in_batched)
    out = jax.vmap(fn)(*jax.tree.unflatten(tree, list(map(grow, leaves, flags))))
    return out, jax.tree.map(lambda _: True, out)

  return wrapped


@_batched_at_zero
def _grouped_product(x, w, sizes):
  return jax.lax.ragged_dot(x, w, sizes)


@_batched_at_zero
def _grouped_cotangents(x, w, sizes, cotangent):
  return jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x, w)[1](cotangent)


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
  """``jax.lax.ragged_dot(x, w, sizes)``: rows ``x [M, K]`` in groups of ``sizes [G]``
  consecutive rows, group ``g`` times ``w[g] [K, N]``; ``[M, N]``. Differentiable and batchable
  under any ``vmap`` (ragged_dot's own rules batch only at axis 0 of every operand).

  While tpipe counts FLOPs (:func:`tpipe.counting_flops`) it is ``x @ w[0]`` instead: the
  grouped product's FLOPs forward and backward (``2 M K N`` each way), where XLA:CPU counts
  ``ragged_dot`` as a product with every group, ``G`` times as many."""
  if tpipe.counting_flops():
    return x @ w[0]
  return _grouped(x, w, sizes)


@jax.custom_vjp
def _grouped(x, w, sizes):
  return _grouped_product(x, w, sizes)


def _grouped_forward(x, w, sizes):
  return _grouped_product(x, w, sizes), (x, w, sizes)


def _grouped_backward(residuals, cotangent):
  x, w, sizes = residuals
  dx, dw = _grouped_cotangents(x, w, sizes, cotangent)
  return dx, dw, np.zeros(sizes.shape, jax.dtypes.float0)


_grouped.defvjp(_grouped_forward, _grouped_backward)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
           sizes: jax.Array, product=None) -> jax.Array:
  """Rows ``x [M, D]`` in groups of ``sizes [G]`` consecutive rows, group ``g`` through expert
  ``g``'s SwiGLU (``w_gate``/``w_up`` ``[G, D, H]``, ``w_down [G, H, D]``, cast to ``x``'s
  dtype); ``[M, D]``. Rows after the last group are not defined: mask them.

  ``product(rows, weights, sizes)`` is the grouped matmul (default :func:`grouped_matmul`);
  :mod:`tpipe.train.expert_dispatch` passes its per-device one, whose operands carry a leading
  axis of devices."""
  product = grouped_matmul if product is None else product
  hidden = (jax.nn.silu(product(x, w_gate.astype(x.dtype), sizes))
            * product(x, w_up.astype(x.dtype), sizes))
  return product(hidden, w_down.astype(x.dtype), sizes)
