"""Transparency: the pipelined stack's outputs and gradients equal applying its layers in order.

One parameterized test over schedules, stage counts, micro-batch counts, data-parallel sizes,
remat policies and blocks. Every (stages, micro-batches, data, schedule) combination that fits on
8 devices runs; remat policies and blocks rotate over those cases, and a second grid crosses
every remat policy with every block and schedule.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpipe
from tests import blocks

LENGTH = 16  # divisible by S * R for S <= 8, R = 2
BATCH = 64
WIDTH = 8
SEQ = 4
TOLERANCE = 1e-5
REMATS = ("none", "full", "dots")
BLOCKS = ("mlp", "attention", "pytree")


def _block_and_inputs(name):
  keys = jax.random.split(jax.random.key(42), 2)
  if name == "mlp":
    return blocks.MLPBlock(WIDTH), jax.random.normal(keys[0], (BATCH, WIDTH)), ()
  if name == "attention":
    mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))
    x = jax.random.normal(keys[0], (BATCH, SEQ, WIDTH))
    return blocks.AttentionBlock(WIDTH), x, (mask,)
  x = {"h": jax.random.normal(keys[0], (BATCH, SEQ, WIDTH)),
       "summary": jax.random.normal(keys[1], (BATCH, WIDTH))}
  return blocks.PytreeBlock(WIDTH), x, ()


def _loss_and_output(apply, params, x, args):
  """A loss whose gradient reaches every output element with a different weight."""
  y = apply(params, x, *args)
  weights = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype)).reshape(a.shape), y)
  loss = sum(jnp.vdot(a, w) for a, w in zip(jax.tree.leaves(y), jax.tree.leaves(weights)))
  return loss, y


@functools.cache
def _reference(block_name):
  """Params (from the pipeline's init) and the sequential model's output and gradients."""
  block, x, args = _block_and_inputs(block_name)
  stack = tpipe.pipeline(type(block), length=LENGTH, num_stages=1, num_microbatches=1)(WIDTH)
  params = stack.init({"params": jax.random.key(0)}, x, *args)["params"]

  def sequential(params, x, *args):
    for layer in range(LENGTH):
      layer_params = jax.tree.map(lambda p: p[layer], params)
      x = block.apply({"params": layer_params}, x, *args)
    return x

  grad_fn = jax.value_and_grad(functools.partial(_loss_and_output, sequential),
                               argnums=(0, 1), has_aux=True)
  (_, y), grads = jax.jit(grad_fn)(params, x, args)
  return params, x, args, y, grads


def _relative_error(actual, expected):
  """``|actual - expected| / |expected|`` with the norm over all leaves of the tree.

  Per-leaf ratios would be dominated by float noise on gradients that are zero in exact
  arithmetic (an attention key bias cancels in the softmax).
  """
  pairs = list(zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True))
  diff = sum(float(jnp.sum((a - b) ** 2)) for a, b in pairs)
  norm = sum(float(jnp.sum(b ** 2)) for _, b in pairs)
  return (diff / norm) ** 0.5


def _cases():
  cases = []
  for stages in (1, 2, 4, 8):
    for microbatches in sorted({1, 2, stages, 4 * stages}):
      for data in (1, 2):
        if stages * data > 8:
          continue
        for schedule in ("gpipe", "circular"):
          i = len(cases)
          cases.append((schedule, stages, microbatches, data, REMATS[i % 3], BLOCKS[(i // 3) % 3]))
  for schedule, remat, block in itertools.product(("gpipe", "circular"), REMATS, BLOCKS):
    cases.append((schedule, 4, 4, 2, remat, block))
  return cases


@pytest.mark.parametrize("schedule,stages,microbatches,data,remat,block", _cases())
def test_outputs_and_gradients_equal_sequential(schedule, stages, microbatches, data, remat, block):
  params, x, args, y_expected, grads_expected = _reference(block)
  repeats = 2 if schedule == "circular" else 1
  mesh = tpipe.make_mesh(stages=stages, data=data)
  block_module, _, _ = _block_and_inputs(block)
  stack = tpipe.pipeline(
      type(block_module), length=LENGTH, num_stages=stages, num_microbatches=microbatches, schedule=schedule,
      num_repeats=repeats, remat=remat, mesh=mesh)(WIDTH)

  def apply(params, x, *args):
    return stack.apply({"params": params}, x, *args)

  grad_fn = jax.value_and_grad(functools.partial(_loss_and_output, apply),
                               argnums=(0, 1), has_aux=True)
  x = jax.device_put(x, tpipe.data_sharding(mesh))
  (_, y), grads = jax.jit(grad_fn)(params, x, args)
  param_grads, input_grads = grads
  assert _relative_error(y, y_expected) <= TOLERANCE
  assert _relative_error(param_grads, grads_expected[0]) <= TOLERANCE
  assert _relative_error(input_grads, grads_expected[1]) <= TOLERANCE


def test_reference_is_sensitive_to_layer_order():
  """The check above can fail: the same layers in reverse order give a different answer."""
  params, x, args, y_expected, _ = _reference("mlp")
  mesh = tpipe.make_mesh(stages=4, data=2)
  stack = tpipe.pipeline(blocks.MLPBlock, length=LENGTH, num_stages=4, num_microbatches=4,
                         mesh=mesh)(WIDTH)
  reversed_params = jax.tree.map(lambda p: p[::-1], params)
  y = jax.jit(stack.apply)({"params": reversed_params}, x)
  assert _relative_error(y, y_expected) > 1e-2


def test_params_use_nn_scan_layout_and_do_not_depend_on_the_pipeline():
  _, x, _ = _block_and_inputs("mlp")
  single = blocks.MLPBlock(WIDTH).init({"params": jax.random.key(1)}, x[:1])["params"]
  layouts = []
  for stages, microbatches, schedule, repeats in ((1, 1, "gpipe", 1), (4, 8, "gpipe", 1),
                                                  (2, 4, "circular", 4)):
    stack = tpipe.pipeline(blocks.MLPBlock, length=LENGTH, num_stages=stages,
                           num_microbatches=microbatches, schedule=schedule, num_repeats=repeats,
                           mesh=tpipe.make_mesh(stages=stages))(WIDTH)
    layouts.append(stack.init({"params": jax.random.key(0)}, x)["params"])
  for params in layouts:
    assert jax.tree.structure(params) == jax.tree.structure(single)
    for stacked, one in zip(jax.tree.leaves(params), jax.tree.leaves(single)):
      assert stacked.shape == (LENGTH,) + one.shape
    jax.tree.map(np.testing.assert_array_equal, params, layouts[0])
  kernels = layouts[0]["Dense_0"]["kernel"]
  assert not np.allclose(kernels[0], kernels[1]), "each layer needs its own initial values"
