"""Tests for tpipe.train.losses: the vocabulary-chunked cross-entropy and the LM head using it."""

import functools
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tpipe
from tests.helpers import numerics
from tpipe.train import losses
from tpipe.train import models

WIDTH, VOCAB = 16, 48


def _inputs(seed=0, shape=(3, 5)):
  keys = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(keys[0], shape + (WIDTH,))
  kernel = jax.random.normal(keys[1], (WIDTH, VOCAB)) * 0.5
  bias = jax.random.normal(keys[2], (VOCAB,))
  targets = jax.random.randint(keys[3], shape, 0, VOCAB)
  return x, kernel, bias, targets


def _whole(x, kernel, bias, targets):
  return optax.softmax_cross_entropy_with_integer_labels(x @ kernel + bias, targets)


@pytest.mark.parametrize("num_chunks", [1, 2, 3, 8, VOCAB])
def test_chunked_loss_and_gradients_as_close_to_float64_as_the_whole_logits(num_chunks):
  x, kernel, bias, targets = _inputs()

  def objective(fn):
    def total(x, kernel, bias):
      per_position = fn(x, kernel, bias)
      return (per_position * jnp.linspace(0.5, 1.5, per_position.size).reshape(
          per_position.shape)).sum()
    return jax.jit(jax.value_and_grad(total, argnums=(0, 1, 2)))

  chunked = objective(lambda x, k, b: losses.chunked_cross_entropy(x, k, b, targets, num_chunks))
  whole = objective(lambda x, k, b: _whole(x, k, b, targets))
  reference = numerics.float64_reference(whole, x, kernel, bias)
  numerics.assert_as_close_as_plain(chunked(x, kernel, bias), whole(x, kernel, bias), reference)


def test_chunked_loss_without_bias_and_in_bfloat16():
  x, kernel, _, targets = _inputs(seed=1)
  got = losses.chunked_cross_entropy(x, kernel, None, targets, 4, dtype=jnp.bfloat16)
  assert got.dtype == jnp.float32 and got.shape == targets.shape
  want = optax.softmax_cross_entropy_with_integer_labels(
      (x.astype(jnp.bfloat16) @ kernel.astype(jnp.bfloat16)).astype(jnp.float32), targets)
  np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)  # bfloat16 products.
  assert np.abs(np.asarray(got) - np.asarray(_whole(x, kernel, 0.0, targets))).max() > 1e-5


def test_backward_holds_one_slice_of_logits():
  # 64 positions x 4096 words: whole float32 logits are 1 MiB; one of 16 slices is 64 KiB.
  x = jnp.zeros((64, 32))
  kernel, bias = jnp.zeros((32, 4096)), jnp.zeros(4096)
  targets = jnp.zeros(64, jnp.int32)

  def temporaries(fn):
    grad = jax.jit(jax.grad(lambda x, k, b: fn(x, k, b).sum(), argnums=(0, 1, 2)))
    return grad.lower(x, kernel, bias).compile().memory_analysis().temp_size_in_bytes

  whole = temporaries(lambda x, k, b: _whole(x, k, b, targets))
  chunked = temporaries(lambda x, k, b: losses.chunked_cross_entropy(x, k, b, targets, 16))
  logits_bytes = 64 * 4096 * 4
  assert whole >= logits_bytes
  # The kernel's gradient (512 KiB) is a result, not a temporary; what is left is a few slices.
  assert chunked < whole - logits_bytes // 2, (chunked, whole)


@pytest.mark.unit  # Raises before any JAX computation.
def test_bad_chunk_counts_name_the_fix():
  with pytest.raises(ValueError, match="positive divisor of the vocabulary size 48"):
    losses.check_num_chunks(5, VOCAB)
  with pytest.raises(ValueError, match="positive divisor"):
    losses.check_num_chunks(0, VOCAB)
  with pytest.raises(TypeError, match="must be an int"):
    losses.check_num_chunks(2.0, VOCAB)
  assert losses.check_num_chunks(6, VOCAB) == 6


def test_shape_mismatches_raise():
  x, kernel, bias, targets = _inputs()
  with pytest.raises(ValueError, match="kernel must be"):
    losses.chunked_cross_entropy(x, kernel.T, bias, targets, 2)
  with pytest.raises(ValueError, match="bias must be"):
    losses.chunked_cross_entropy(x, kernel, bias[:4], targets, 2)
  with pytest.raises(ValueError, match="targets must have"):
    losses.chunked_cross_entropy(x, kernel, bias, targets[:1], 2)


def test_lm_with_vocab_chunks_has_the_same_parameters_and_losses():
  mesh = tpipe.make_mesh(stages=2, data=1)
  sizes = dict(num_layers=2, width=16, num_heads=2, mlp_dim=32, max_len=8, vocab_size=64)
  kw = dict(sizes, num_stages=2, num_microbatches=2, mesh=mesh)
  tokens = jax.random.randint(jax.random.key(0), (4, 8), 0, 64, dtype=jnp.int32)
  targets = jnp.roll(tokens, -1, axis=1)
  # The chunked LM pipelined (2 stages, M = 2) against the plain whole-vocabulary LM (one stage,
  # one micro-batch: the sequential model of the numerics rule, and its float64 twin): one
  # pipelined program compiled, not three.
  plain_kw = dict(sizes, num_stages=1, num_microbatches=1, mesh=tpipe.make_mesh(stages=1))
  whole, chunked = models.decoder_lm(**plain_kw), models.decoder_lm(**kw, vocab_chunks=4)
  init = lambda model: jax.jit(functools.partial(model.init, targets=targets))(
      jax.random.key(1), tokens)
  variables, chunked_variables = init(whole), init(chunked)
  jax.tree.map(np.testing.assert_array_equal, variables, chunked_variables)

  def loss(model):
    return jax.jit(jax.value_and_grad(
        lambda v: model.apply(v, tokens, targets=targets).mean()))

  plain = loss(whole)(variables)
  exact = models.decoder_lm(**plain_kw, dtype=jnp.float64, param_dtype=jnp.float64)
  reference = numerics.float64_reference(loss(exact), variables)
  numerics.assert_as_close_as_plain(loss(chunked)(variables), plain, reference)
  # Without targets the chunked model still returns the whole logits.
  logits = jax.eval_shape(chunked.apply, variables, tokens)  # Traced, not compiled.
  assert logits.shape == (4, 8, 64)
  with pytest.raises(ValueError, match="vocab_chunks|positive divisor"):
    models.decoder_lm(**kw, vocab_chunks=5)
