"""Transparency: the pipelined stack's outputs and gradients equal applying its layers in order.

One parameterized test over schedules, stage counts, micro-batch counts, data-parallel sizes,
remat policies and blocks, in one pass of 14 cases (:func:`test_the_cases_cover_every_pairing`):
every (stages, micro-batches) pair runs, with the schedules and the data-parallel sizes taking
turns so that each stage count meets each of them, and the same cases cross every remat policy
with every block, each block and each remat policy meeting both schedules, each block data 2 and
4 or more stages.

"Equal" is :mod:`tests.helpers.numerics`' rule: against a float64 run of the sequential model, the
pipelined float32 error is at most twice that of the float32 sequential model run on the same
micro-batches, per leaf and over the tree. A bare tolerance on the float32 difference passed on an
AVX-512 CPU and failed on AVX2.
"""

import functools
import itertools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpipe
from tests.helpers import blocks
from tests.helpers import numerics

LENGTH = 16  # divisible by S * R for S <= 8, R = 2
BATCH = 64
WIDTH = 8
SEQ = 4
REMATS = ("none", "full", "dots")


def _mlp_inputs(keys):
  return jax.random.normal(keys[0], (BATCH, WIDTH)), ()


def _attention_inputs(keys):
  mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))
  return jax.random.normal(keys[0], (BATCH, SEQ, WIDTH)), (mask,)


def _pytree_inputs(keys):
  return {"h": jax.random.normal(keys[0], (BATCH, SEQ, WIDTH)),
          "summary": jax.random.normal(keys[1], (BATCH, WIDTH))}, ()


# name -> (block class, called with WIDTH; inputs(keys) -> (x, broadcast args)).
BLOCKS = {
    "mlp": (blocks.MLPBlock, _mlp_inputs),
    "attention": (blocks.AttentionBlock, _attention_inputs),
    "pytree": (blocks.PytreeBlock, _pytree_inputs),
    # Undefined at zero: fails if a bubble tick ever runs it on a placeholder.
    "rms_no_eps": (blocks.RMSNoEpsBlock, _mlp_inputs),
}


def _block_and_inputs(name):
  block_cls, inputs = BLOCKS[name]
  x, args = inputs(jax.random.split(jax.random.key(42), 2))
  return block_cls(WIDTH), x, args


def _loss_and_output(apply, params, x, args):
  """A loss whose gradient reaches every output element with a different weight."""
  y = apply(params, x, *args)
  # The weights are float32 numbers whatever y's dtype, so the float64 reference weighs the same.
  weights = [jnp.cos(jnp.arange(a.size, dtype=jnp.float32)).reshape(a.shape).astype(a.dtype)
             for a in jax.tree.leaves(y)]
  loss = sum(jnp.vdot(a, w) for a, w in zip(jax.tree.leaves(y), weights))
  return loss, y


def _grad_fn(apply):
  """``(params, x, args) -> ((loss, y), (param_grads, input_grads))``."""
  return jax.value_and_grad(functools.partial(_loss_and_output, apply), argnums=(0, 1),
                            has_aux=True)


class _Reference(NamedTuple):
  """A block's params and inputs, and the float64 sequential model's results on them.

  ``exact`` is ``(outputs, param_grads, input_grads)``.
  """

  params: Any
  x: Any
  args: tuple
  exact: tuple


@functools.cache
def _reference(block_name):
  """Params (from the pipeline's init), inputs and the float64 results, once per block."""
  block, x, args = _block_and_inputs(block_name)
  stack = tpipe.pipeline(type(block), length=LENGTH, num_stages=1, num_microbatches=1)(WIDTH)
  params = jax.jit(stack.init)({"params": jax.random.key(0)}, x, *args)["params"]
  grad_fn = _grad_fn(functools.partial(blocks.apply_in_sequence, block))
  (_, y), grads = numerics.float64_reference(jax.jit(grad_fn), params, x, args)
  return _Reference(params, x, args, (y, *grads))


@functools.cache
def _plain(block_name, microbatches):
  """The float32 sequential model's results, on the pipeline's micro-batches of the batch.

  A pipeline runs the layers on ``num_microbatches * data`` micro-batches, so its error budget is
  that of the sequential model run on the same micro-batches: XLA:CPU's rounding depends on the
  row count (on AVX2, 4-row batches of the MLP give 2-3x the param-grad error of 64-row ones).
  """
  block, _, _ = _block_and_inputs(block_name)
  reference = _reference(block_name)
  apply = functools.partial(blocks.apply_in_sequence, block, microbatches=microbatches)
  (_, y), grads = jax.jit(_grad_fn(apply))(reference.params, reference.x, reference.args)
  return (y, *grads)


@functools.cache
def _pipelined(block_name, schedule="gpipe", stages=4, microbatches=4, data=2, remat="full",
               unroll=1):
  """The pipelined stack's jitted grad function and the mesh it runs on.

  The defaults (used by the control tests) run 4 micro-batches on each of 2 replicas.
  """
  repeats = 2 if schedule == "circular" else 1
  mesh = tpipe.make_mesh(stages=stages, data=data)
  block_cls, _ = BLOCKS[block_name]
  stack = tpipe.pipeline(
      block_cls, length=LENGTH, num_stages=stages, num_microbatches=microbatches,
      schedule=schedule, num_repeats=repeats, remat=remat, unroll=unroll, mesh=mesh)(WIDTH)

  def apply(params, x, *args):
    return stack.apply({"params": params}, x, *args)

  return jax.jit(_grad_fn(apply)), mesh


def _assert_equals_sequential(results, block_name, microbatches):
  """Outputs, param grads and input grads against the sequential model's (see numerics)."""
  (_, y), (param_grads, input_grads) = results
  for what, actual, plain, exact in zip(("outputs", "param grads", "input grads"),
                                        (y, param_grads, input_grads),
                                        _plain(block_name, microbatches),
                                        _reference(block_name).exact):
    numerics.assert_as_close_as_plain(actual, plain, exact, what=what)


# (schedule, stages, micro-batches, data, remat, block). Every micro-batch count in
# {1, 2, S, 4S} with every stage count; the schedules take turns, and so does the data-parallel
# size where it fits, so each stage count meets both schedules and both sizes (the engine's full
# grid is tests/linen/test_sequential.py's and tests/core's). The remat policies and blocks are
# placed so that every pair of them runs. The S = 4, M = 4, data = 2 case is the control tests'.
CASES = [("gpipe", 1, 1, 1, "dots", "attention"), ("circular", 1, 2, 1, "none", "rms_no_eps"),
         ("gpipe", 1, 4, 2, "none", "attention"), ("circular", 2, 1, 1, "dots", "mlp"),
         ("gpipe", 2, 2, 1, "none", "mlp"), ("circular", 2, 8, 2, "full", "pytree"),
         ("gpipe", 4, 1, 1, "dots", "attention"), ("circular", 4, 2, 1, "full", "attention"),
         ("gpipe", 4, 4, 2, "full", "mlp"), ("circular", 4, 16, 2, "dots", "rms_no_eps"),
         ("circular", 8, 1, 1, "none", "pytree"), ("gpipe", 8, 2, 1, "full", "rms_no_eps"),
         ("circular", 8, 8, 1, "dots", "rms_no_eps"), ("gpipe", 8, 32, 1, "dots", "pytree")]


def test_the_cases_cover_every_pairing():
  schedules = {"gpipe", "circular"}
  assert [c[1:3] for c in CASES] == [(s, m) for s in (1, 2, 4, 8)
                                     for m in sorted({1, 2, s, 4 * s})]
  for stages in (1, 2, 4, 8):
    assert {c[0] for c in CASES if c[1] == stages} == schedules
    assert {c[3] for c in CASES if c[1] == stages} == ({1, 2} if 2 * stages <= 8 else {1})
  assert {c[4:] for c in CASES} == set(itertools.product(REMATS, BLOCKS))
  for name in BLOCKS:
    assert {c[0] for c in CASES if c[5] == name} == schedules
    assert any(c[3] == 2 for c in CASES if c[5] == name)
    assert any(c[1] >= 4 for c in CASES if c[5] == name)
  for remat in REMATS:
    assert {c[0] for c in CASES if c[4] == remat} == schedules
  assert ("gpipe", 4, 4, 2, "full", "mlp") in CASES  # _pipelined("mlp")'s defaults.


@pytest.mark.parametrize("schedule,stages,microbatches,data,remat,block", CASES)
def test_outputs_and_gradients_equal_sequential(schedule, stages, microbatches, data, remat, block):
  reference = _reference(block)
  grad_fn, mesh = _pipelined(block, schedule, stages, microbatches, data, remat)
  x = jax.device_put(reference.x, tpipe.data_sharding(mesh))
  _assert_equals_sequential(grad_fn(reference.params, x, reference.args), block,
                            microbatches * data)


@pytest.mark.parametrize("schedule,unroll,remat", [("gpipe", True, "full"),
                                                   ("circular", 2, "none")])
def test_unrolled_layer_loops_equal_sequential(schedule, unroll, remat):
  reference = _reference("attention")
  grad_fn, mesh = _pipelined("attention", schedule, 4, 4, 2, remat, unroll=unroll)
  x = jax.device_put(reference.x, tpipe.data_sharding(mesh))
  _assert_equals_sequential(grad_fn(reference.params, x, reference.args), "attention", 4 * 2)


def test_check_fails_for_layers_in_reverse_order():
  """The check above can fail: the same layers in reverse order give a different answer."""
  reference = _reference("mlp")
  grad_fn, mesh = _pipelined("mlp")
  x = jax.device_put(reference.x, tpipe.data_sharding(mesh))  # As the cases run it: one compile.
  reversed_params = jax.tree.map(lambda p: p[::-1], reference.params)
  with pytest.raises(AssertionError, match="outputs is further from the float64 reference"):
    _assert_equals_sequential(grad_fn(reversed_params, x, reference.args), "mlp", 4 * 2)


def test_check_fails_for_one_weight_matrix_off_by_1e_4():
  """A small real error is rejected: one layer's kernel scaled by 1 + 1e-4, in each result."""
  reference = _reference("mlp")
  grad_fn, mesh = _pipelined("mlp")
  x = jax.device_put(reference.x, tpipe.data_sharding(mesh))
  dense = reference.params["Dense_0"]
  params = {**reference.params, "Dense_0": {
      **dense, "kernel": dense["kernel"].at[LENGTH // 2].multiply(1 + 1e-4)}}
  (_, y), (param_grads, input_grads) = grad_fn(params, x, reference.args)
  for what, actual, plain, exact in zip(("outputs", "param grads", "input grads"),
                                        (y, param_grads, input_grads), _plain("mlp", 4 * 2),
                                        reference.exact):
    with pytest.raises(AssertionError, match=f"{what} is further"):
      numerics.assert_as_close_as_plain(actual, plain, exact, what=what)


def test_params_use_nn_scan_layout_and_do_not_depend_on_the_pipeline():
  _, x, _ = _block_and_inputs("mlp")
  single = blocks.MLPBlock(WIDTH).init({"params": jax.random.key(1)}, x[:1])["params"]
  layouts = []
  for stages, microbatches, schedule, repeats in ((1, 1, "gpipe", 1), (4, 8, "gpipe", 1),
                                                  (2, 4, "circular", 4)):
    stack = tpipe.pipeline(blocks.MLPBlock, length=LENGTH, num_stages=stages,
                           num_microbatches=microbatches, schedule=schedule, num_repeats=repeats,
                           mesh=tpipe.make_mesh(stages=stages))(WIDTH)
    # Jitted: an eager init runs the pipeline op by op.
    layouts.append(jax.jit(stack.init)({"params": jax.random.key(0)}, x)["params"])
  for params in layouts:
    assert jax.tree.structure(params) == jax.tree.structure(single)
    for stacked, one in zip(jax.tree.leaves(params), jax.tree.leaves(single)):
      assert stacked.shape == (LENGTH,) + one.shape
    jax.tree.map(np.testing.assert_array_equal, params, layouts[0])
  kernels = layouts[0]["Dense_0"]["kernel"]
  assert not np.allclose(kernels[0], kernels[1]), "each layer needs its own initial values"


# ----------------------------------------------------------------------------------- side inputs
# A per-example gate ([batch, width], split into micro-batches), a broadcast bias, a dict of
# broadcast arrays and a static keyword; gradients with respect to all of them.

SIDE_CASES = [("gpipe", 4, 4, 2, "full"), ("circular", 2, 2, 2, "none"), ("gpipe", 8, 1, 1, "dots"),
              ("circular", 4, 8, 2, "dots"), ("gpipe", 1, 2, 1, "none"), ("gpipe", 2, 4, 1, "full")]


def _side_inputs():
  keys = jax.random.split(jax.random.key(7), 5)
  x = jax.random.normal(keys[0], (BATCH, WIDTH))
  gate = jax.random.uniform(keys[1], (BATCH, WIDTH))
  bias = jax.random.normal(keys[2], (WIDTH,))
  extras = {"gain": 1 + 0.1 * jax.random.normal(keys[3], (WIDTH,)),
            "shift": 0.1 * jax.random.normal(keys[4], (WIDTH,))}
  return x, gate, bias, extras


def _side_sequential(params, x, gate, bias, extras, microbatches=1):
  """The plain model on ``microbatches`` contiguous micro-batches, the gate split with x."""
  block = blocks.SideInputBlock(WIDTH)

  def layers(xg):
    x, gate = xg
    step = lambda h, p: (block.apply({"params": p}, h, gate, bias, extras, scale=0.5), None)
    return jax.lax.scan(step, x, params)[0]

  split = lambda a: a.reshape(microbatches, -1, *a.shape[1:])
  return jax.lax.map(layers, (split(x), split(gate))).reshape(x.shape)


def _side_grad_fn(apply):
  def loss(params, x, gate, bias, extras):
    y = apply(params, x, gate, bias, extras)
    return jnp.vdot(y, jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)), y

  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)


@functools.cache
def _side_reference():
  x, gate, bias, extras = _side_inputs()
  stack = tpipe.pipeline(blocks.SideInputBlock, length=LENGTH, num_stages=1, num_microbatches=1,
                         per_example=("gate",))(WIDTH)
  params = jax.jit(stack.init)({"params": jax.random.key(0)}, x, gate, bias, extras)["params"]
  (_, y), grads = numerics.float64_reference(jax.jit(_side_grad_fn(_side_sequential)), params,
                                             x, gate, bias, extras)
  return params, (y, grads)


@functools.cache
def _side_plain(microbatches):
  """The float32 plain model's ``((loss, outputs), grads)`` on ``microbatches`` micro-batches,
  once per count."""
  params, _ = _side_reference()
  plain_apply = functools.partial(_side_sequential, microbatches=microbatches)
  return jax.jit(_side_grad_fn(plain_apply))(params, *_side_inputs())


@pytest.mark.parametrize("schedule,stages,microbatches,data,remat", SIDE_CASES)
def test_side_input_gradients_equal_sequential(schedule, stages, microbatches, data, remat):
  params, exact = _side_reference()
  x, gate, bias, extras = _side_inputs()
  (_, y_plain), grads_plain = _side_plain(microbatches * data)
  mesh = tpipe.make_mesh(stages=stages, data=data)
  stack = tpipe.pipeline(
      blocks.SideInputBlock, length=LENGTH, num_stages=stages, num_microbatches=microbatches,
      schedule=schedule, num_repeats=2 if schedule == "circular" else 1, remat=remat,
      per_example=("gate",), mesh=mesh)(WIDTH)
  # The gate by keyword, the others by position: binding to the signature finds both.
  apply = lambda p, x, gate, bias, extras: stack.apply({"params": p}, x, bias=bias, gate=gate,
                                                       extras=extras, scale=0.5)
  x, gate = jax.device_put((x, gate), tpipe.data_sharding(mesh))
  (_, y), grads = jax.jit(_side_grad_fn(apply))(params, x, gate, bias, extras)
  numerics.assert_as_close_as_plain(y, y_plain, exact[0], what="outputs")
  names = ("param grads", "input grads", "per-example gate grads", "broadcast bias grads",
           "broadcast dict grads")
  for what, actual, plain, reference in zip(names, grads, grads_plain, exact[1]):
    numerics.assert_as_close_as_plain(actual, plain, reference, what=what)
