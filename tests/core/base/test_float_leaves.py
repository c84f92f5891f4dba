"""tpipe.core.base.float_leaves: the leaves that can carry a gradient (inexact dtypes, in leaf
order) and the tree rebuilt with them replaced, other leaves untouched (on NumPy arrays: the
functions only look at dtypes and tree structure)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpipe.core.base import float_leaves as floats_lib

pytestmark = pytest.mark.unit


def test_is_float_for_inexact_dtypes_only():
  for value in (np.float32(1), np.ones(2, jnp.bfloat16), np.complex64(1), np.float16(1), 1.5):
    assert floats_lib.is_float(value), value
  for value in (np.int8(1), np.uint32(1), np.bool_(True), 3, True):
    assert not floats_lib.is_float(value), value
  assert floats_lib.is_float(jax.ShapeDtypeStruct((2,), jnp.float32))


def test_float_leaves_and_back():
  tree = {"a": np.ones(2, np.float32), "b": np.arange(3),
          "c": (np.zeros(1, jnp.bfloat16), True)}
  floats = floats_lib.float_leaves(tree)
  assert [a.dtype for a in floats] == [jnp.float32, jnp.bfloat16]
  back = floats_lib.with_float_leaves(tree, [a + 5 for a in floats])
  np.testing.assert_array_equal(back["a"], [6, 6])
  np.testing.assert_array_equal(back["b"], [0, 1, 2])  # Integer leaves untouched.
  assert back["c"][0].dtype == jnp.bfloat16 and float(back["c"][0][0]) == 5.0
  assert back["c"][1] is True
  assert jax.tree.structure(back) == jax.tree.structure(tree)


def test_round_trip_keeps_the_leaves_in_order():
  tree = [np.full(2, 1.0), {"x": np.int32(4), "y": np.full(3, 2.0)}, np.full(1, 3.0)]
  floats = floats_lib.float_leaves(tree)
  assert [float(a[0]) for a in floats] == [1.0, 2.0, 3.0]
  same = floats_lib.with_float_leaves(tree, floats)
  for got, want in zip(jax.tree.leaves(same), jax.tree.leaves(tree)):
    assert got is want
  assert floats_lib.float_leaves({"n": np.arange(2)}) == []
