"""gated_call: the function's value and gradients when busy; zeros, no NaN and no work when idle.

A gate inside a scan equals the busy steps applied in a Python loop (numerics rule:
:mod:`tests.helpers.numerics`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import numerics
from tpipe.core.loops import gated

POLICIES = {"full": None, "none": jax.checkpoint_policies.everything_saveable,
            "dots": jax.checkpoint_policies.dots_saveable}


def _fn(params, x, tokens, key):
  """Undefined at x = 0 (rsqrt), with an integer and a key input that get no gradient."""
  h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True))
  noise = jax.random.normal(key, x.shape)
  return {"y": jnp.tanh(h @ params["w"]) + params["b"][tokens] + 0.1 * noise}


def _inputs():
  keys = jax.random.split(jax.random.key(0), 3)
  params = {"w": jax.random.normal(keys[0], (4, 4)), "b": jax.random.normal(keys[1], (5, 4))}
  x = jax.random.normal(keys[2], (3, 4))
  return params, x, jnp.array([0, 2, 4]), jax.random.key(7)


def _loss(fn):
  return lambda params, x, tokens, key: jnp.sum(fn(params, x, tokens, key)["y"] ** 2)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_busy_equals_the_function_and_its_gradients(policy):
  fn = jax.checkpoint(_fn, policy=POLICIES[policy])
  params, x, tokens, key = _inputs()
  gated_fn = lambda *a: gated.gated_call(jnp.bool_(True), fn, *a)
  np.testing.assert_array_equal(jax.jit(gated_fn)(params, x, tokens, key)["y"],
                                jax.jit(fn)(params, x, tokens, key)["y"])
  expected = jax.jit(jax.grad(_loss(fn), argnums=(0, 1)))(params, x, tokens, key)
  actual = jax.jit(jax.grad(_loss(gated_fn), argnums=(0, 1)))(params, x, tokens, key)
  jax.tree.map(np.testing.assert_array_equal, actual, expected)


def test_idle_returns_zeros_and_finite_zero_gradients_at_a_singular_input():
  params, _, tokens, key = _inputs()
  zero = jnp.zeros((3, 4))
  # The plain function's gradient at zero input is NaN: the case the gate exists for.
  plain = jax.grad(lambda p, x: _loss(_fn)(p, x, tokens, key) * 0.0, argnums=(0, 1))(params, zero)
  assert not np.all(np.isfinite(plain[1]))

  def masked_loss(params, x, busy):
    out = gated.gated_call(busy, _fn, params, x, tokens, key)
    return jnp.sum(out["y"] ** 2)

  out = jax.jit(lambda p, x: gated.gated_call(jnp.bool_(False), _fn, p, x, tokens, key))(
      params, zero)
  np.testing.assert_array_equal(out["y"], np.zeros((3, 4)))
  grads = jax.jit(jax.grad(masked_loss, argnums=(0, 1)), static_argnums=())(
      params, zero, jnp.bool_(False))
  for leaf in jax.tree.leaves(grads):
    np.testing.assert_array_equal(leaf, np.zeros_like(leaf))


def test_gate_inside_scan_runs_only_busy_steps():
  params, x, tokens, key = _inputs()
  busy = jnp.array([True, False, True, False])

  def loop(params, x):
    def step(h, b):
      return gated.gated_call(b, lambda p, h: jnp.tanh(h @ p["w"]), params, h) + h, None
    return jnp.sum(jax.lax.scan(step, x, busy)[0])

  def reference(params, x):
    for b in busy.tolist():
      x = (jnp.tanh(x @ params["w"]) if b else 0.0) + x
    return jnp.sum(x)

  value_and_grad = lambda fn: jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
  value, grads = value_and_grad(loop)(params, x)
  plain_value, plain_grads = value_and_grad(reference)(params, x)
  ref_value, ref_grads = numerics.float64_reference(value_and_grad(reference), params, x)
  numerics.assert_as_close_as_plain(value, plain_value, ref_value, what="value")
  numerics.assert_as_close_as_plain(grads, plain_grads, ref_grads, what="gradients")


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_switch_runs_the_chosen_branch_forward_and_backward(policy):
  # Branches with different internal shapes save different residuals (packed per dtype).
  def wide(params, x):
    return jnp.tanh(jnp.tile(x, (1, 3)) @ jnp.tile(params["w"], (3, 1))) + params["b"][0]

  def narrow(params, x):
    return jnp.sin(x @ params["w"]) * params["b"][1]

  branches = [jax.checkpoint(f, policy=POLICIES[policy]) for f in (wide, narrow)]
  params, x, _, _ = _inputs()

  def loss(params, x, index):
    return jnp.sum(gated.switch_call(index, branches, params, x) ** 2)

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  for index, fn in enumerate(branches):
    value, grads = grad(params, x, jnp.int32(index))
    plain = jax.jit(jax.value_and_grad(lambda p, x, fn=fn: jnp.sum(fn(p, x) ** 2),
                                       argnums=(0, 1)))
    # The same operations, compiled in another program: equal up to float32 rounding.
    expected_value, expected = plain(params, x)
    ref_value, ref = numerics.float64_reference(plain, params, x)
    numerics.assert_as_close_as_plain(value, expected_value, ref_value, what="value")
    numerics.assert_as_close_as_plain(grads, expected, ref, what="gradients")
  value, grads = grad(params, x, jnp.int32(-1))
  assert value == 0
  for leaf in jax.tree.leaves(grads):
    np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
