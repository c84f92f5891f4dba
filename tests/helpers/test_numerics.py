"""The test helper that decides "equal to the sequential model" (tests/helpers/numerics.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import numerics

EPS = float(np.finfo(np.float32).eps)


def _matrices():
  keys = jax.random.split(jax.random.key(0), 2)
  return jax.random.normal(keys[0], (64, 256)), jax.random.normal(keys[1], (256, 32))


def _blocked_matmul(a, b):
  """``a @ b`` as a float32 sum of 8 partial products: other rounding, same accuracy."""
  partial = [a[:, k:k + 32] @ b[k:k + 32] for k in range(0, a.shape[1], 32)]
  total = partial[0]
  for p in partial[1:]:
    total = total + p
  return total


def test_float64_reference_casts_floats_only():

  def fn(x, tokens, key):
    return {"x": x / 3, "tokens": tokens, "key": key}

  x = jnp.ones((2,), jnp.float32)
  tokens = jnp.arange(2, dtype=jnp.int32)
  key = jax.random.key(1)
  result = numerics.float64_reference(fn, x, tokens, key)
  assert result["x"].dtype == np.float64 and result["x"][0] == 1 / 3
  assert result["tokens"].dtype == np.int32
  np.testing.assert_array_equal(jax.random.key_data(result["key"]), jax.random.key_data(key))
  assert jnp.ones(()).dtype == jnp.float32, "x64 must be off again afterwards"


def test_float64_reference_rejects_a_part_computed_in_float32():
  with pytest.raises(AssertionError, match=r"computed \['b'\] in lower precision"):
    numerics.float64_reference(lambda x: {"a": x, "b": x.astype(jnp.float32)}, jnp.ones(2))


def test_same_work_in_another_order_passes_and_a_1e_4_error_fails():
  a, b = _matrices()
  exact = numerics.float64_reference(lambda a, b: a @ b, a, b)
  plain = jax.jit(lambda a, b: a @ b)(a, b)
  blocked = jax.jit(_blocked_matmul)(a, b)
  found = numerics.assert_as_close_as_plain({"y": blocked}, {"y": plain}, {"y": exact})
  assert [e.path for e in found] == ["['y']", "<tree>"]
  assert found[-1].ratio < 2
  wrong = blocked.at[0].multiply(1 + 1e-4)
  with pytest.raises(AssertionError, match=r"(?s)\['y'\]: error .* vs plain .* \(ratio "):
    numerics.assert_as_close_as_plain({"y": wrong}, {"y": plain}, {"y": exact}, what="y")


@pytest.mark.unit  # NumPy arrays only.
def test_floor_is_a_few_ulps_at_the_scale_of_the_tree():
  # A leaf that is zero in exact arithmetic and exactly zero in the plain run: float32 noise at
  # the tree's scale passes; the same noise 1e3 times larger fails, naming that leaf only.
  reference = {"big": np.ones(100), "zero": np.zeros(10)}
  plain = {"big": np.ones(100, np.float32), "zero": np.zeros(10, np.float32)}
  noise = {"big": np.ones(100, np.float32), "zero": np.full(10, EPS, np.float32)}
  numerics.assert_as_close_as_plain(noise, plain, reference)
  louder = {"big": plain["big"], "zero": np.full(10, 1e3 * EPS, np.float32)}
  with pytest.raises(AssertionError, match=r"\['zero'\]: error") as failure:
    numerics.assert_as_close_as_plain(louder, plain, reference)
  assert "['big']" not in str(failure.value)


@pytest.mark.unit  # NumPy arrays only.
def test_floor_follows_an_element_larger_than_the_tree_scale():
  # One large leaf among many small ones (a final layer's kernel gradient): a few ulps of its own
  # size is rounding noise even where the plain run happens to be exact; 100 ulps is not.
  reference = {"large": np.full(4, 1e3), "small": np.ones(1000)}
  plain = {"large": np.full(4, 1e3, np.float32), "small": np.ones(1000, np.float32)}
  noisy = {"large": np.full(4, 1e3 * (1 + 3 * EPS), np.float32), "small": plain["small"]}
  numerics.assert_as_close_as_plain(noisy, plain, reference)
  wrong = {"large": np.full(4, 1e3 * (1 + 100 * EPS), np.float32), "small": plain["small"]}
  with pytest.raises(AssertionError, match=r"\['large'\]: error"):
    numerics.assert_as_close_as_plain(wrong, plain, reference)


@pytest.mark.unit  # NumPy arrays only.
def test_bad_inputs_are_errors_not_passes():
  reference = {"a": np.ones(3)}
  plain = {"a": np.ones(3, np.float32)}
  with pytest.raises(ValueError, match="structure"):
    numerics.assert_as_close_as_plain({"b": plain["a"]}, plain, reference)
  with pytest.raises(ValueError, match="shapes"):
    numerics.assert_as_close_as_plain({"a": np.ones(4, np.float32)}, plain, reference)
  with pytest.raises(ValueError, match="plain result is not finite"):
    numerics.assert_as_close_as_plain(plain, {"a": np.full(3, np.nan, np.float32)}, reference)
  with pytest.raises(AssertionError, match="error nan"):
    numerics.assert_as_close_as_plain({"a": np.full(3, np.nan, np.float32)}, plain, reference)
