"""What balancing by FLOPs counts for one unit: the forward and the backward a training step runs
(the weight gradient and the input gradient, for a cotangent XLA cannot fold away), checked
against the analytic count of a matmul."""

import jax
import jax.numpy as jnp
import pytest

from tpipe.core.planning import unit_cost

ROWS, IN, OUT = 16, 32, 64


def _matmul(params, h, broadcast, per_example):
  del broadcast, per_example
  return h @ params["w"]


def _flops(h_dtype):
  params = {"w": jax.ShapeDtypeStruct((IN, OUT), jnp.float32)}
  h = jax.ShapeDtypeStruct((ROWS, IN), h_dtype)
  return unit_cost.measure("flops", _matmul, params, h, ((), ()))


def test_a_matmul_counts_its_forward_and_both_gradients():
  # 2 x rows x in x out each: the product, the input's gradient g w^T, the weight's h^T g.
  assert _flops(jnp.float32) == 6 * ROWS * IN * OUT


def test_integer_inputs_get_no_gradient():
  # Token ids and indices are held fixed: the product and the weight's gradient only.
  params = {"w": jax.ShapeDtypeStruct((IN, OUT), jnp.float32)}
  ids = jax.ShapeDtypeStruct((ROWS,), jnp.int32)
  lookup = lambda params, h, broadcast, per_example: params["w"][h % IN] @ params["w"].T
  flops = unit_cost.measure("flops", lookup, params, ids, ((), ()))
  # Forward (rows x out x in), and for the weight both operands' gradients: 3 products.
  assert flops == pytest.approx(3 * 2 * ROWS * IN * OUT, rel=0.05)


def test_action_flops_split_a_matmul_into_forward_input_and_weight_gradients():
  params = {"w": jax.ShapeDtypeStruct((IN, OUT), jnp.float32)}
  h = jax.ShapeDtypeStruct((ROWS, IN), jnp.float32)
  parts = unit_cost.action_flops(_matmul, params, h, ((), ()), identity=("matmul-parts",))
  product = 2 * ROWS * IN * OUT
  assert parts == {"forward": product, "backward_input": product, "backward_weight": product}


def test_action_flops_of_integer_inputs_have_no_input_gradient():
  params = {"w": jax.ShapeDtypeStruct((IN, OUT), jnp.float32)}
  ids = jax.ShapeDtypeStruct((ROWS,), jnp.int32)
  lookup = lambda params, h, broadcast, per_example: params["w"][h % IN] @ params["w"].T
  parts = unit_cost.action_flops(lookup, params, ids, ((), ()), identity=None)
  assert parts["backward_input"] == 0
  assert parts["backward_weight"] == pytest.approx(2 * parts["forward"], rel=0.05)


def test_counting_flops_is_true_only_while_a_count_traces_the_layer():
  seen = []

  def layer(params, h, broadcast, per_example):
    seen.append(unit_cost.counting_flops())
    return _matmul(params, h, broadcast, per_example)

  params = {"w": jax.ShapeDtypeStruct((IN, OUT), jnp.float32)}
  h = jax.ShapeDtypeStruct((ROWS, IN), jnp.float32)
  unit_cost.measure("flops", layer, params, h, ((), ()))
  assert seen and all(seen)
  assert not unit_cost.counting_flops()
  jax.eval_shape(layer, params, h, (), ())  # Traced to run, not to count.
  assert seen[-1] is False
