"""Side inputs and keyword arguments of a pipelined block (tpipe.pipeline): per-example,
broadcast and static, through the front end.

Equality of outputs and gradients with the sequential model, side inputs included, is in
tests/linen/test_transform_transparency.py; the binding rules alone (tpipe.core.base.arguments) in
tests/core/base/test_arguments.py; here are the rules and their errors as a pipelined stack applies
them.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpipe
from tests.helpers import blocks

WIDTH = 8
BATCH = 16


def _inputs():
  keys = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(keys[0], (BATCH, WIDTH)),
          jax.random.uniform(keys[1], (BATCH, WIDTH)),
          jax.random.normal(keys[2], (WIDTH,)))


def test_per_example_argument_is_split_by_name_however_it_is_passed():
  x, gate, bias = _inputs()
  mesh = tpipe.make_mesh(stages=2, data=2)
  stack = tpipe.pipeline(blocks.SideInputBlock, length=4, num_stages=2, num_microbatches=2,
                         per_example=("gate",), mesh=mesh)(WIDTH)
  params = stack.init({"params": jax.random.key(1)}, x, gate, bias)["params"]
  apply = jax.jit(lambda p, *a, **k: stack.apply({"params": p}, *a, **k))
  positional = apply(params, x, gate, bias)
  keyword = apply(params, x, bias=bias, gate=gate)
  np.testing.assert_array_equal(positional, keyword)
  # Each example sees its own gate row: changing one row changes exactly that example.
  changed = apply(params, x, gate.at[3].set(0.0), bias)
  rows = np.any(np.asarray(changed) != np.asarray(positional), axis=1)
  assert rows.tolist() == [i == 3 for i in range(BATCH)]


def test_static_keyword_is_passed_untraced():
  x, gate, bias = _inputs()
  stack = tpipe.pipeline(blocks.SideInputBlock, length=2, num_stages=1, num_microbatches=2,
                         per_example=("gate",))(WIDTH)
  params = stack.init({"params": jax.random.key(1)}, x, gate, bias)["params"]
  on = jax.jit(lambda p: stack.apply({"params": p}, x, gate, bias, deterministic=True))(params)
  off = jax.jit(lambda p: stack.apply({"params": p}, x, gate, bias, deterministic=False))(params)
  assert not np.allclose(on, off)


def test_per_example_name_must_be_a_parameter():
  with pytest.raises(ValueError, match=r"'mask', which is not a parameter of SideInputBlock.*"
                                       r"\['gate', 'bias', 'extras', 'scale', 'deterministic'\]"):
    tpipe.pipeline(blocks.SideInputBlock, length=2, num_stages=1, num_microbatches=1,
                   per_example=("mask",))
  with pytest.raises(ValueError, match="the input .* is always split"):
    tpipe.pipeline(blocks.SideInputBlock, length=2, num_stages=1, num_microbatches=1,
                   per_example=("x",))
  with pytest.raises(TypeError, match=r"write per_example=\('gate',\)"):
    tpipe.pipeline(blocks.SideInputBlock, length=2, num_stages=1, num_microbatches=1,
                   per_example="gate")


def test_per_example_array_needs_the_batch_as_leading_axis():
  x, gate, bias = _inputs()
  stack = tpipe.pipeline(blocks.SideInputBlock, length=2, num_stages=1, num_microbatches=2,
                         per_example=("gate",))(WIDTH)
  with pytest.raises(ValueError, match=r"per-example argument 'gate' .* shape \(8, 8\).* batch "
                                       r"\(16\)"):
    stack.init({"params": jax.random.key(1)}, x, gate[:8], bias)


def test_unknown_keyword_is_a_clear_type_error():
  x, gate, bias = _inputs()
  stack = tpipe.pipeline(blocks.SideInputBlock, length=2, num_stages=1, num_microbatches=1)(WIDTH)
  with pytest.raises(TypeError, match="do not fit SideInputBlock.__call__.*'colour'"):
    stack.init({"params": jax.random.key(1)}, x, gate, bias, colour=3)


def test_arguments_that_cannot_be_passed_by_name_are_a_clear_type_error():
  """The layers take their arguments by keyword (tpipe.core.base.arguments.bind, as
  tpipe.nnx.pipeline
  binds them), so a value for a positional-only parameter is refused, not given to another."""

  class ByPosition(nn.Module):

    @nn.compact
    def __call__(self, x, gate, /, bias=0.0):
      return x * gate + bias

  x, gate, _ = _inputs()
  stack = tpipe.pipeline(ByPosition, length=2, num_stages=1, num_microbatches=1)()
  with pytest.raises(TypeError, match=r"ByPosition.__call__\(self, x, gate, /, bias=0.0\) takes "
                                      r"'gate' by position only"):
    stack.init({"params": jax.random.key(1)}, x, gate)


def test_broadcast_array_with_batch_rows_gets_a_per_example_hint():

  class PaddingMasked(nn.Module):

    @nn.compact
    def __call__(self, x, attention_mask):
      return x + nn.Dense(WIDTH)(x) * attention_mask

  x = jnp.ones((BATCH, WIDTH))
  mask = jnp.ones((BATCH, 1))
  stack = tpipe.pipeline(PaddingMasked, length=2, num_stages=1, num_microbatches=4)()
  with pytest.raises(ValueError, match=r"per_example=\('attention_mask',\)"):
    stack.init({"params": jax.random.key(1)}, x, mask)
  fixed = tpipe.pipeline(PaddingMasked, length=2, num_stages=1, num_microbatches=4,
                         per_example=("attention_mask",))()
  fixed.init({"params": jax.random.key(1)}, x, mask)


def test_sown_values_raise_when_asked_for_and_are_dropped_otherwise():

  class Sows(nn.Module):

    @nn.compact
    def __call__(self, x):
      y = x + nn.Dense(WIDTH)(x)
      self.sow("intermediates", "out", y)
      return y

  x = jnp.ones((BATCH, WIDTH))
  stack = tpipe.pipeline(Sows, length=2, num_stages=1, num_microbatches=2)()
  variables = stack.init({"params": jax.random.key(1)}, x)
  assert set(variables) == {"params"}
  stack.apply(variables, x)  # Not asked for: nothing to return, as in plain Flax.
  with pytest.raises(ValueError, match=r"writes to the variable collection\(s\) "
                                       r"\['intermediates'\]"):
    stack.apply(variables, x, mutable=["intermediates"])


def test_partitioning_metadata_is_kept_with_the_stage_axis_added():

  class Boxed(nn.Module):

    @nn.compact
    def __call__(self, x):
      kernel_init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, None))
      logical_init = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",))
      h = nn.Dense(WIDTH, kernel_init=kernel_init, bias_init=logical_init)(x)
      return x + h

  mesh = tpipe.make_mesh(stages=4, data=2)
  stack = tpipe.pipeline(Boxed, length=8, num_stages=4, num_microbatches=2, mesh=mesh)()
  x = jnp.ones((BATCH, WIDTH))
  variables = stack.init({"params": jax.random.key(1)}, x)
  kernel = variables["params"]["Dense_0"]["kernel"]
  bias = variables["params"]["Dense_0"]["bias"]
  assert isinstance(kernel, nn.Partitioned) and kernel.names == ("stage", None, None)
  assert isinstance(bias, nn.LogicallyPartitioned) and bias.names == ("stage", "embed")
  specs = nn.get_partition_spec(variables)["params"]["Dense_0"]
  assert specs["kernel"] == jax.sharding.PartitionSpec("stage", None, None)
  rules = (("stage", "stage"), ("embed", None))
  sharding = nn.logical_to_mesh_sharding(specs, mesh, rules)["bias"]
  assert sharding.spec == jax.sharding.PartitionSpec("stage", None)
  # Boxed and unboxed variables give the same result.
  np.testing.assert_array_equal(stack.apply(variables, x),
                                stack.apply(nn.meta.unbox(variables), x))
