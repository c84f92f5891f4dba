"""Next-token cross-entropy computed a slice of the vocabulary at a time.

A language model's head turns ``[batch, seq, width]`` activations into ``[batch, seq, vocab]``
logits; with a large vocabulary the float32 logits of one micro-batch, and their gradient, are
among the largest buffers of a training step (1024 tokens x 32000 words is 125 MiB each).
:func:`chunked_cross_entropy` never forms them: it projects onto ``num_chunks`` slices of the
vocabulary in turn (a ``lax.scan``), keeps a running log-sum-exp and the target's logit, and
recomputes each slice's logits in the backward pass, so one slice's logits are live at a time.
The result is the same cross-entropy as
``optax.softmax_cross_entropy_with_integer_labels(x @ kernel + bias, targets)`` up to rounding
(the sums run in another order), for one more matmul of the head in the backward pass.

  >>> import jax, jax.numpy as jnp, optax
  >>> x = jax.random.normal(jax.random.key(0), (2, 3, 8))
  >>> kernel = jax.random.normal(jax.random.key(1), (8, 12))
  >>> bias = jnp.zeros(12)
  >>> targets = jnp.array([[0, 5, 11], [3, 3, 7]])
  >>> chunked = chunked_cross_entropy(x, kernel, bias, targets, num_chunks=4)
  >>> whole = optax.softmax_cross_entropy_with_integer_labels(x @ kernel + bias, targets)
  >>> bool(jnp.allclose(chunked, whole, atol=1e-5))
  True
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


# The vocabulary is sliced when a micro-batch's whole float32 logits on a device would exceed
# WHOLE_LOGITS_LIMIT, into slices of at most SLICE_LOGITS_LIMIT each. Measured with the TPU
# compiler (experiments/results/memory_at_scale.md, tpu_memory_vocab.md): at 250 MiB of logits
# (vocabulary 32000, shape A) 8 slices save 0.13 GiB of 5.44 for one more matmul of the head
# per micro-batch, so below the limit the logits stay whole. Past it, smaller slices cost no
# FLOPs (the sliced loss recomputes each slice's matmul once whatever their number) and each
# slice's logits, their gradient and what the compiler reserves for the slice loop shrink with
# them: per device, Llama-3-8B on stage 4 x fsdp 8 x tensor 2 (1 GiB of logits) 5.94 GiB in 4
# slices, 5.82 in 8, 5.75 in 16, 5.70 in 32; shape C (2 GiB) 10.56 in 8, 10.44 in 16, 10.38
# in 32; gemma-256k (4 GiB) 9.54 in 16, 9.30 in 32 and in 64.
WHOLE_LOGITS_LIMIT = 512 * 2**20
SLICE_LOGITS_LIMIT = 64 * 2**20


def auto_chunks(positions: int, vocab_size: int, vocab_shards: int = 1) -> int:
  """The vocabulary slices for a loss over ``positions`` (a micro-batch's rows x sequence on one
  device) whose vocabulary is split ``vocab_shards`` ways across devices: 1 while the whole
  float32 logits fit :data:`WHOLE_LOGITS_LIMIT`, else the fewest slices (a divisor of the
  vocabulary, 64 at most) of at most :data:`SLICE_LOGITS_LIMIT` each.

    >>> auto_chunks(2 * 1024, 32000)                 # 250 MiB of logits: whole
    1
    >>> auto_chunks(4096, 128256, vocab_shards=2)    # 1 GiB
    16
  """
  shards = vocab_shards if vocab_size % vocab_shards == 0 else 1
  whole = positions * (vocab_size // shards) * 4
  if whole <= WHOLE_LOGITS_LIMIT:
    return 1
  for n in range(2, 65):
    if vocab_size % (n * shards) == 0 and whole / n <= SLICE_LOGITS_LIMIT:
      return n
  return max(n for n in range(1, 65) if vocab_size % (n * shards) == 0)


def check_num_chunks(num_chunks, vocab_size: int) -> int:
  """``num_chunks`` as an int, or a ValueError/TypeError naming the fix."""
  if isinstance(num_chunks, bool) or not isinstance(num_chunks, int):
    raise TypeError(f"num_chunks must be an int, got {num_chunks!r}.")
  if num_chunks < 1 or vocab_size % num_chunks:
    divisors = [d for d in range(1, min(vocab_size, 64) + 1) if vocab_size % d == 0]
    raise ValueError(f"num_chunks={num_chunks} must be a positive divisor of the vocabulary size "
                     f"{vocab_size}; for example one of {divisors}.")
  return num_chunks


def chunked_cross_entropy(x: jax.Array, kernel: jax.Array, bias: jax.Array | None,
                          targets: jax.Array, num_chunks: int, dtype: Any = None,
                          vocab_shards: int = 1) -> jax.Array:
  """Per-position cross-entropy of ``x @ kernel + bias`` against ``targets``, a vocabulary slice
  at a time.

  Args:
    x: ``[..., width]`` activations.
    kernel: ``[width, vocab]`` projection.
    bias: ``[vocab]`` or None.
    targets: integer ``[...]`` target indices in ``[0, vocab)``.
    num_chunks: how many slices of the vocabulary; must divide ``vocab``. 1 projects at once.
    dtype: the matmul's dtype (``x``, ``kernel`` and ``bias`` are cast to it, as ``nn.Dense``
      with that ``dtype`` does); None keeps ``x``'s. The logits are float32 at least.
    vocab_shards: the vocabulary's contiguous blocks across devices (the ``tensor`` axis's size
      where the kernel's vocabulary is split over it). Slice ``j`` takes the ``j``-th part of
      every block, so each device projects onto its own block's part (no kernel moves between
      devices) and only the per-position log-sum-exp crosses them. Must divide
      ``vocab / num_chunks``; 1: slices of the whole vocabulary.

  Returns:
    float32 (at least) ``[...]`` cross-entropies in nats.
  """
  if kernel.ndim != 2 or kernel.shape[0] != x.shape[-1]:
    raise ValueError(f"kernel must be [width={x.shape[-1]}, vocab], got shape {kernel.shape}.")
  vocab = kernel.shape[1]
  if bias is not None and bias.shape != (vocab,):
    raise ValueError(f"bias must be [vocab={vocab}], got shape {bias.shape}.")
  if targets.shape != x.shape[:-1]:
    raise ValueError(f"targets must have x's leading shape {x.shape[:-1]}, got {targets.shape}.")
  n = check_num_chunks(num_chunks, vocab)
  shards = vocab_shards
  if (isinstance(shards, bool) or not isinstance(shards, int) or shards < 1
          or vocab % (n * shards)):
    raise ValueError(f"vocab_shards={vocab_shards!r} must be a positive int dividing "
                     f"vocab / num_chunks = {vocab // n}.")
  dtype = jnp.dtype(dtype or x.dtype)
  logits_dtype = jnp.promote_types(dtype, jnp.float32)
  block, part = vocab // shards, vocab // (shards * n)  # A shard's block; a slice's part of it.
  x = x.astype(dtype)
  # [shards, n, part, width]: slice j is [:, j] (a shard's block stays on its device). Sliced
  # in the [vocab, width] orientation the pipelined ends store the head in (tpipe's shared
  # leaves), the transposes cancel; sliced as [width, ..., part], the TPU compiler copied the
  # whole gathered kernel into the loop's layout (gemma-256k 1F1B: 1 GiB, 12.12 -> 10.66).
  kernel = kernel.T.reshape(shards, n, part, kernel.shape[0])
  bias = None if bias is None else bias.reshape(shards, n, part)
  shard_of, within = targets // block, targets % block
  slice_of, column = within // part, shard_of * part + within % part

  # Each slice is read in place from the kernel (no re-arranged copy of it), so its gradient
  # lands in place too.
  @jax.checkpoint  # The backward pass recomputes one slice's logits at a time.
  def one_slice(carry, j):
    top, total, picked = carry
    k = lax.dynamic_index_in_dim(kernel, j, axis=1, keepdims=False).astype(dtype)
    logits = jnp.einsum("...w,vw->...v", x, k.reshape(shards * part, k.shape[-1]))
    if bias is not None:
      logits = logits + lax.dynamic_index_in_dim(bias, j, axis=1, keepdims=False).reshape(
          -1).astype(dtype)
    logits = logits.astype(logits_dtype)
    new_top = jnp.maximum(top, lax.stop_gradient(logits.max(axis=-1)))
    total = total * jnp.exp(top - new_top) + jnp.exp(logits - new_top[..., None]).sum(axis=-1)
    # The target's logit picked by a mask, not a gather: the mask's transpose is a select
    # fused into the slice's other elementwise work, a gather's a scatter-add into a zeroed
    # float32 copy of the slice's logits (llama3-8b on v5p, 1F1B: 0.55 GiB more at the peak).
    columns = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    hit = jnp.where(columns == column[..., None], logits, 0).sum(axis=-1)
    return (new_top, total, picked + jnp.where(slice_of == j, hit, 0)), None

  # Zeros made from x so the carry varies over the same mesh axes as x inside shard_map.
  zeros = lax.stop_gradient(x[..., 0].astype(logits_dtype) * 0)
  (top, total, picked), _ = lax.scan(one_slice, (zeros - jnp.inf, zeros, zeros),
                                     jnp.arange(n, dtype=jnp.int32))
  return top + jnp.log(total) - picked
