"""tpipe.core.programs.residuals: which VJP residuals a slot keeps, and a VJP rebuilt from them.

A chunk's backward residuals that depend on the micro-batch are kept from the forward tick to
the backward tick; those computed from the parameters alone (the weights, their casts) are not.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from tpipe.core.base import packing
from tpipe.core.programs import residuals


def _layers(trees):
  """Two bfloat16 layers scanned over float32 weights; ``ids`` pick the input rows."""
  w, (x, ids) = trees

  def fn(w, x):
    def layer(h, wl):
      return jnp.tanh(h @ wl.astype(jnp.bfloat16)), None

    h, _ = lax.scan(layer, x[ids].astype(jnp.bfloat16), w)
    return jnp.sum(h.astype(jnp.float32))

  return fn


def _example():
  w = jax.random.normal(jax.random.key(0), (2, 8, 8)) / 3
  x = jax.random.normal(jax.random.key(1), (6, 8))
  return w, (x, jnp.array([4, 0, 2, 5]))


def test_the_slot_keeps_what_depends_on_the_microbatch_only():
  trees = _example()
  plan = residuals.plan_of(_layers, trees, [False, True])
  fn = _layers(trees)
  leaves = jax.tree.leaves(jax.vjp(fn, trees[0], trees[1][0])[1])
  assert len(plan.kept) == len(leaves) and any(plan.kept) and not all(plan.kept)
  # The weights' bfloat16 casts [2, 8, 8] are the parameters' own; the layers' activations
  # [2, 4, 8] and the gather's indices come from the input rows and the integer ids (which the
  # plan sees as inputs too).
  found = sorted((leaf.shape, str(leaf.dtype), kept) for leaf, kept in zip(leaves, plan.kept))
  assert ((2, 8, 8), "bfloat16", False) in found, found
  assert all(kept == (shape != (2, 8, 8)) for shape, _, kept in found), found
  assert ((2, 4, 8), "bfloat16", True) in found, found


def test_a_vjp_rebuilt_from_the_kept_residuals_gives_the_same_gradients():
  trees = _example()
  plan = residuals.plan_of(_layers, trees, [False, True])
  sizes = packing.buffer_sizes([plan.layout])
  w, (x, ids) = trees

  @jax.jit
  def both(w, x, other_x):
    seed = jnp.ones((), jnp.float32)
    _, vjp = jax.vjp(_layers((w, (x, ids))), w, x)
    slot = residuals.keep(plan, vjp, sizes)
    # Another micro-batch's forward, with this one's residuals put in place of its own: the
    # same backward on the same values, in one program.
    _, other = jax.vjp(_layers((w, (other_x, ids))), w, other_x)
    return vjp(seed), residuals.restore(plan, other, slot)(seed), other(seed)

  expected, found, others = both(w, x, 2 * x + 1)
  for e, f, o in zip(expected, found, others):
    np.testing.assert_array_equal(np.asarray(f), np.asarray(e))
    assert not np.array_equal(np.asarray(o), np.asarray(e))  # The other micro-batch differs.


def test_a_vjp_of_another_function_is_rejected():
  trees = _example()
  plan = residuals.plan_of(_layers, trees, [False, True])
  _, vjp = jax.vjp(lambda w: jnp.sum(jnp.sin(w)), trees[0])
  with pytest.raises(RuntimeError, match="traced differently"):
    residuals.keep(plan, vjp, packing.buffer_sizes([plan.layout]))
