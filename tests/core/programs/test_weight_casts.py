"""``tpipe.core.programs.weight_casts``: which of a unit's variables it only casts, read from its
program."""

import jax
import jax.numpy as jnp
import numpy as np

from tpipe.core.programs import weight_casts


def _leaves():
  return [jnp.ones((4, 4), jnp.float32), jnp.ones((4,), jnp.float32),
          jnp.ones((4, 4), jnp.float32)]


def test_names_the_dtype_of_a_leaf_used_only_through_casts():
  def unit(leaves, x):
    w, b, v = leaves
    # ``b`` cast twice: cast once before both, its gradient would be summed in bfloat16.
    y = x @ w.astype(jnp.bfloat16) + b.astype(jnp.bfloat16) + b.astype(jnp.bfloat16)
    return y.astype(jnp.float32) @ v  # ``v`` is used as it is.

  x = jnp.ones((2, 4), jnp.bfloat16)
  assert weight_casts.only_cast_dtypes(unit, _leaves(), x) == [np.dtype(jnp.bfloat16), None, None]


def test_a_leaf_used_as_it_is_anywhere_is_not_only_cast():
  def unit(leaves, x):
    w, b, v = leaves
    y = x @ w.astype(jnp.bfloat16)           # ``w``: a cast, and also summed as float32.
    z = b.astype(jnp.bfloat16) * 2 + b.astype(jnp.float16).astype(jnp.bfloat16)  # two dtypes
    return y + z, jnp.sum(w), v                # ``v`` reaches an output as it is.

  x = jnp.ones((2, 4), jnp.bfloat16)
  assert weight_casts.only_cast_dtypes(unit, _leaves(), x) == [None, None, None]


def test_a_cast_to_its_own_dtype_or_no_use_names_nothing():
  def unit(leaves, x):
    w, _, _ = leaves
    return x @ w.astype(jnp.float32)

  assert weight_casts.only_cast_dtypes(unit, _leaves(), jnp.ones((2, 4))) == [None, None, None]


def test_cast_and_uncast_round_trip_dtypes():
  leaves = _leaves()
  dtypes = [np.dtype(jnp.bfloat16), None, None]
  cast = weight_casts.cast(leaves, dtypes)
  assert [a.dtype for a in cast] == [jnp.bfloat16, jnp.float32, jnp.float32]
  assert cast[1] is leaves[1]
  back = weight_casts.uncast(cast, [a.dtype for a in leaves])
  assert [a.dtype for a in back] == [jnp.float32] * 3


def test_casts_inside_a_checkpoint_or_jit_count_as_the_leafs_uses():
  def unit(leaves, x):
    w, b, v = leaves
    y = jax.checkpoint(lambda w, x: x @ w.astype(jnp.bfloat16))(w, x)
    z = jax.jit(lambda b, v: b.astype(jnp.bfloat16) + v[0].astype(jnp.bfloat16))(b, v)
    return y + z, v  # ``v`` is sliced inside the jit (and reaches an output).

  x = jnp.ones((2, 4), jnp.bfloat16)
  assert weight_casts.only_cast_dtypes(unit, _leaves(), x) == [
      np.dtype(jnp.bfloat16), np.dtype(jnp.bfloat16), None]


def test_through_moves_follows_transposes_slices_and_loops_to_the_casts():
  def unit(leaves, x):
    w, b, v = leaves
    # ``w``: transposed, cut into slices inside a loop (a jitted index), each slice cast.
    slices = w.T.reshape(2, 2, 4)

    def body(total, j):
      piece = jax.lax.dynamic_index_in_dim(slices, j, keepdims=False).astype(jnp.bfloat16)
      return total + (x @ piece.T).sum(), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.bfloat16), jnp.arange(2))
    # ``b``: broadcast before its cast (a broadcast's transpose sums, so it is no move);
    # ``v``: the loop's carry (the body also sees values the last step made).
    wide = jnp.broadcast_to(b, (3, 4)).astype(jnp.bfloat16)
    carried, _ = jax.lax.scan(lambda c, _: (c.astype(jnp.bfloat16).astype(jnp.float32), None),
                              v, jnp.arange(2))
    return total + wide.sum() + carried.sum()

  x = jnp.ones((2, 4), jnp.bfloat16)
  assert weight_casts.only_cast_dtypes(unit, _leaves(), x, through_moves=True) == [
      np.dtype(jnp.bfloat16), None, None]
  # Not asked to follow moves, a transposed leaf is used as it is.
  assert weight_casts.only_cast_dtypes(unit, _leaves(), x) == [None, None, None]


def test_through_moves_a_leaf_moved_to_an_output_or_used_raw_is_not_only_cast():
  def unit(leaves, x):
    w, b, v = leaves
    moved = jax.jit(lambda w: w.T)(w)           # Returned by a call as a move: followed on...
    y = x @ moved.astype(jnp.bfloat16)
    return y, moved.reshape(-1)[:2], b.T * 2, v  # ...to an output; ``b`` multiplied raw.

  x = jnp.ones((2, 4), jnp.bfloat16)
  assert weight_casts.only_cast_dtypes(unit, _leaves(), x, through_moves=True) == [
      None, None, None]
  # Returned by a call as a move and then only cast: bfloat16.
  cast = lambda leaves, x: x @ jax.jit(lambda w: w.T)(leaves[0]).astype(jnp.bfloat16)
  assert weight_casts.only_cast_dtypes(cast, _leaves(), x, through_moves=True) == [
      np.dtype(jnp.bfloat16), None, None]


def test_through_moves_an_element_cast_twice_is_not_only_cast():
  """Cast before its uses, a leaf whose elements reach two casts would sum their gradients in
  the cast dtype: cast at two places, cast in every step of a loop, or sliced at an index that
  is not the loop's step (it may repeat)."""
  x = jnp.ones((2, 4), jnp.bfloat16)

  def unit(leaves, x):
    w, b, v = leaves
    twice = (x @ w.astype(jnp.bfloat16)).sum() + (x @ w.T.T.astype(jnp.bfloat16)).sum()
    every_step = jax.lax.scan(lambda c, _: (c + (x[0] @ b.astype(jnp.bfloat16)), None),
                              jnp.zeros((), jnp.bfloat16), jnp.arange(3))[0]
    # ``v``'s rows at the indices [0, 0]: the same row twice.
    repeated = jax.lax.scan(
        lambda c, j: (c + jax.lax.dynamic_index_in_dim(v, j, keepdims=False).astype(
            jnp.bfloat16).sum(), None), jnp.zeros((), jnp.bfloat16), jnp.zeros(2, jnp.int32))[0]
    return twice + every_step + repeated

  assert weight_casts.only_cast_dtypes(unit, _leaves(), x, through_moves=True) == [
      None, None, None]
  # Each step its own row (at the step's index, a scanned iota): each element cast once.
  rows = lambda leaves, x: jax.lax.scan(
      lambda c, j: (c + jax.lax.dynamic_index_in_dim(leaves[2], j, keepdims=False).astype(
          jnp.bfloat16).sum(), None), jnp.zeros((), jnp.bfloat16), jnp.arange(4))[0]
  assert weight_casts.only_cast_dtypes(rows, _leaves(), x, through_moves=True) == [
      None, None, np.dtype(jnp.bfloat16)]


def test_through_moves_a_slice_the_index_may_clamp_to_is_read_twice():
  # 5 steps over 4 rows: the last step's index clamps to row 3, which step 3 read too.
  rows = lambda leaves, x: jax.lax.scan(
      lambda c, j: (c + jax.lax.dynamic_index_in_dim(leaves[2], j, keepdims=False).astype(
          jnp.bfloat16).sum(), None), jnp.zeros((), jnp.bfloat16), jnp.arange(5))[0]
  assert weight_casts.only_cast_dtypes(rows, _leaves(), None, through_moves=True) == [
      None, None, None]


def test_tie_to_steps_keeps_every_value_bit_for_bit_and_the_gradient():
  # Normal values only: a device that flushes subnormals to zero in arithmetic flushes them
  # here too (XLA:CPU does in bfloat16).
  special = jnp.array([-0.0, 0.0, jnp.inf, -jnp.inf, jnp.nan, 1.5, -2.5e-38], jnp.float32)
  tree = {"w": special, "half": special.astype(jnp.bfloat16), "count": jnp.arange(3)}
  steps = (jnp.int32(5), jnp.int32(0))
  tied = jax.jit(lambda t, s: weight_casts.tie_to_steps(t, s))(tree, steps)
  for key in ("w", "half"):
    bits = lambda a: np.asarray(a).view(np.uint16 if a.dtype == jnp.bfloat16 else np.uint32)
    np.testing.assert_array_equal(bits(tied[key]), bits(tree[key]))
  assert tied["count"].dtype == jnp.int32
  np.testing.assert_array_equal(tied["count"], tree["count"])
  weights = jnp.arange(1.0, 8.0)
  grad = jax.grad(lambda w: jnp.sum(weight_casts.tie_to_steps(w, steps) * weights))(special)
  np.testing.assert_array_equal(grad, weights)


def test_tie_to_steps_makes_the_leaves_depend_on_every_step():
  # The tie is a value of each loop whose index it reads: traced, the result depends on them.
  jaxpr = jax.make_jaxpr(lambda w, i, t: weight_casts.tie_to_steps(w, (i, t)))(
      jnp.ones(3), jnp.int32(1), jnp.int32(2))
  used = {id(v) for eqn in jaxpr.jaxpr.eqns for v in eqn.invars}
  assert all(id(v) in used for v in jaxpr.jaxpr.invars)
