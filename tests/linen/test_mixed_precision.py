"""Transparency in bfloat16: the pipelined stack is as accurate as the plain model in bfloat16.

``tpipe.pipeline(TransformerBlock, ...)`` with ``dtype=bfloat16`` (bfloat16 activations crossing
the stage boundaries, float32 parameters) is compared with the float32 sequential model on the
same float32 parameters: its outputs, parameter gradients and input gradients. bfloat16 cannot
match float32 closely, so the yardstick is the plain (sequential, unpipelined) bfloat16 model's
own error against float32: pipelining must not make bfloat16 noticeably less accurate.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpipe
from tpipe.train import models

LENGTH = 8  # Divisible by S * R = 4 * 2.
BATCH = 32
SEQ = 8
WIDTH = 16
HEADS = 2
MLP = 32

# bfloat16 keeps 8 significand bits: each rounding has a relative error of at most the unit
# roundoff u = 2**-8 ~ 3.9e-3. A block rounds about a dozen intermediates to bfloat16 (LayerNorm
# outputs, q/k/v, scores, softmax, projections, the MLP, two residual adds), so the stack's L
# blocks make L * 12 roundings and the backward pass as many again. Independent roundings add up
# like a random walk: the expected relative error is about sqrt(2 * L * 12) * u ~ 0.054 for
# L = 8 (the worst case, 2 * L * 12 * u ~ 0.75, says nothing useful). The sequential bfloat16
# model measured 1.1e-2 (outputs), 2.7e-2 (parameter gradients) and 2.4e-2 (input gradients)
# here. Its error must lie between u / 4 (else it did not compute in bfloat16: float32 errors are
# ~1e-6) and that estimate.
UNIT_ROUNDOFF = 2.0 ** -8
ROUNDINGS_PER_LAYER = 12
ESTIMATE = math.sqrt(2 * LENGTH * ROUNDINGS_PER_LAYER) * UNIT_ROUNDOFF

# The pipelined bfloat16 error against float32 must be within FACTOR times the sequential
# bfloat16 model's, over the whole tree and per parameter leaf. Both round the activation to
# bfloat16 between layers (the sequential model scans over layers, its carry in bfloat16), but
# XLA fuses the two programs differently (keeping different intermediates in float32 inside a
# fusion) and the pipeline sums parameter gradients over micro-batches (in float32), so the
# errors are not the same numbers. Measured ratios: 0.99 to 1.00 over the tree, 0.82 to 1.01 per
# leaf (a leaf has as few as 128 elements, so its error scatters more). Against an unrolled
# Python loop, which lets XLA skip roundings between layers, the ratios were up to 1.21 over the
# tree and 1.70 per leaf: 2 leaves room for such compiler differences. Real faults are far above
# the bound (2 * 2.7e-2): one micro-batch of 4 sequences lost gives errors of 0.35, the layers in
# reverse order 1.3 (measured on the float32 model).
FACTOR = 2.0
# Leaves whose float32 gradient is this small against the tree's are zero in exact arithmetic
# (the attention key bias cancels in the softmax): their relative error is noise over noise.
NEGLIGIBLE = 1e-6


def _block_kwargs(dtype):
  return dict(width=WIDTH, num_heads=HEADS, mlp_dim=MLP, dtype=dtype)


@functools.cache
def _params_and_inputs():
  """float32 parameters in the stacked layout, float32 inputs and the causal mask."""
  x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, WIDTH), jnp.float32)
  mask = models.causal_mask(SEQ)
  stack = tpipe.pipeline(models.TransformerBlock, length=LENGTH, num_stages=1,
                         num_microbatches=1)(**_block_kwargs(jnp.float32))
  params = stack.init({"params": jax.random.key(0)}, x, mask)["params"]
  return params, x, mask


def _sequential(dtype):
  """The plain model: the L blocks applied one after another (a scan over layers), no pipeline."""
  block = models.TransformerBlock(**_block_kwargs(dtype))

  def apply(params, x, mask):
    def one_layer(h, layer_params):
      return block.apply({"params": layer_params}, h, mask), None

    return jax.lax.scan(one_layer, x, params)[0]

  return apply


def _outputs_and_gradients(apply, params, x, mask):
  """Outputs and the gradients of a float32 loss that weighs every output element differently."""

  def loss(params, x):
    y = apply(params, x, mask)
    weights = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    return jnp.vdot(y.astype(jnp.float32), weights), y

  (_, y), (param_grads, input_grads) = jax.jit(
      jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return {"outputs": y, "param_grads": param_grads, "input_grads": input_grads}


@functools.cache
def _sequential_results():
  """(float32 results, bfloat16 results) of the sequential model on the same float32 params."""
  params, x, mask = _params_and_inputs()
  exact = _outputs_and_gradients(_sequential(jnp.float32), params, x, mask)
  rounded = _outputs_and_gradients(_sequential(jnp.bfloat16), params, x.astype(jnp.bfloat16),
                                   mask)
  return exact, rounded


def _relative_error(actual, expected):
  """``|actual - expected| / |expected|``, the norms over all leaves of the trees, in float64."""
  pairs = [(np.asarray(a, np.float64), np.asarray(b, np.float64))
           for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)]
  diff = sum(float(np.sum((a - b) ** 2)) for a, b in pairs)
  norm = sum(float(np.sum(b ** 2)) for _, b in pairs)
  return math.sqrt(diff / norm)


def test_sequential_bfloat16_error_is_what_its_precision_predicts():
  exact, rounded = _sequential_results()
  for name in exact:
    error = _relative_error(rounded[name], exact[name])
    assert UNIT_ROUNDOFF / 4 < error < ESTIMATE, (name, error)


@pytest.mark.parametrize("schedule,stages,data,microbatches,remat", [
    ("gpipe", 4, 2, 4, "full"),
    ("circular", 4, 2, 4, "none"),
    ("gpipe", 2, 2, 2, "dots"),
])
def test_pipelined_bfloat16_is_as_accurate_as_sequential_bfloat16(schedule, stages, data,
                                                                  microbatches, remat):
  params, x, mask = _params_and_inputs()
  exact, rounded = _sequential_results()
  mesh = tpipe.make_mesh(stages=stages, data=data)
  stack = tpipe.pipeline(
      models.TransformerBlock, length=LENGTH, num_stages=stages, num_microbatches=microbatches,
      schedule=schedule, num_repeats=2 if schedule == "circular" else 1, remat=remat,
      mesh=mesh)(**_block_kwargs(jnp.bfloat16))
  x_bf16 = jax.device_put(x.astype(jnp.bfloat16), tpipe.data_sharding(mesh))
  piped = _outputs_and_gradients(lambda p, x, m: stack.apply({"params": p}, x, m), params, x_bf16,
                                 mask)

  # bfloat16 activations and input gradients, float32 parameter gradients.
  assert piped["outputs"].dtype == jnp.bfloat16
  assert piped["input_grads"].dtype == jnp.bfloat16
  assert {g.dtype for g in jax.tree.leaves(piped["param_grads"])} == {jnp.dtype(jnp.float32)}

  for name in exact:
    own = _relative_error(rounded[name], exact[name])
    error = _relative_error(piped[name], exact[name])
    assert error <= FACTOR * own, (name, error, own)

  tree_norm = math.sqrt(sum(float(np.sum(np.asarray(g, np.float64) ** 2))
                            for g in jax.tree.leaves(exact["param_grads"])))
  leaves = zip(jax.tree_util.tree_flatten_with_path(exact["param_grads"])[0],
               jax.tree.leaves(rounded["param_grads"]), jax.tree.leaves(piped["param_grads"]),
               strict=True)
  for (path, want), sequential, got in leaves:
    if np.linalg.norm(np.asarray(want, np.float64)) < NEGLIGIBLE * tree_norm:
      continue
    own = _relative_error(sequential, want)
    error = _relative_error(got, want)
    assert error <= FACTOR * own, (jax.tree_util.keystr(path), error, own)
