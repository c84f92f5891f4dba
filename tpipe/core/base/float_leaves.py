"""Float leaves: the leaves of a tree that can carry a gradient, and the tree rebuilt from them.

Gradients flow through inexact leaves only; the tick loops move and sum these leaves (in leaf
order) and put them back into their trees.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def is_float(leaf) -> bool:
  """Whether ``leaf`` has an inexact dtype (can carry a gradient)."""
  return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


def float_leaves(tree) -> list:
  """The leaves of ``tree`` that can carry a gradient (inexact dtypes), in leaf order."""
  return [leaf for leaf in jax.tree.leaves(tree) if is_float(leaf)]


def with_float_leaves(tree, floats):
  """``tree`` with its float leaves replaced, in order, by ``floats``."""
  floats = iter(floats)
  return jax.tree.map(lambda leaf: next(floats) if is_float(leaf) else leaf, tree)
