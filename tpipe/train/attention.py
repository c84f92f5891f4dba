"""Dot-product attention whose backward keeps one score-sized array: the probabilities.

Differentiating ``softmax(where(mask, scores, -inf))`` the plain way keeps, for the backward,
the mask broadcast to every head, the masked scores, their exponentials and the probabilities:
four ``[batch, heads, seq, seq]`` arrays per layer, the largest residuals of a Transformer
block. The softmax's gradient needs only the probabilities ``p``::

  d scores = p * (d p - sum(d p * p, axis=-1))     (zero where the mask is False)

so :func:`masked_softmax` is a ``jax.custom_vjp`` that keeps ``p`` and the mask as given (not
broadcast). Its forward is the same operations as Flax's, so outputs are bit for bit Flax's;
the gradient is the same math, summed in at least float32.

:func:`dot_product_attention` is a drop-in ``attention_fn`` for
``flax.linen.MultiHeadDotProductAttention`` built on it (same parameters, same outputs, dropout
as Flax's), used by :class:`tpipe.train.models.TransformerBlock`.

Example::

  attention = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=dot_product_attention)
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


def _masked_probabilities(scores: jax.Array, mask: jax.Array | None) -> jax.Array:
  if mask is not None:
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
  return jax.nn.softmax(scores, axis=-1)


@jax.custom_vjp
def masked_softmax(scores: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """``softmax(scores)`` over the last axis with masked-out entries (``mask`` False) at the
  dtype's lowest value, as Flax's attention does; ``mask`` broadcasts against ``scores``.

  The backward keeps only the probabilities and ``mask`` (module docstring).
  """
  return _masked_probabilities(scores, mask)


def _masked_softmax_forward(scores, mask):
  probabilities = _masked_probabilities(scores, mask)
  return probabilities, (probabilities, mask)


def _masked_softmax_backward(saved, cotangent):
  probabilities, mask = saved
  accumulate = jnp.promote_types(probabilities.dtype, jnp.float32)
  p, g = probabilities.astype(accumulate), cotangent.astype(accumulate)
  d_scores = p * (g - jnp.sum(g * p, axis=-1, keepdims=True))
  if mask is not None:  # Masked entries never reached the softmax (``where`` sends them zero).
    d_scores = jnp.where(mask, d_scores, 0.0)
  return d_scores.astype(probabilities.dtype), None


masked_softmax.defvjp(_masked_softmax_forward, _masked_softmax_backward)


def dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                          mask: jax.Array | None = None, *, dropout_rng=None,
                          dropout_rate: float = 0.0, broadcast_dropout: bool = True,
                          deterministic: bool = False, dtype=None, precision=None) -> jax.Array:
  """Flax's ``nn.dot_product_attention`` (``[batch, seq, heads, depth]`` in and out) with
  :func:`masked_softmax`, so its backward keeps the probabilities and not three more
  score-sized arrays. Takes the arguments ``MultiHeadDotProductAttention`` passes."""
  query, key, value = nn.dtypes.promote_dtype(query, key, value, dtype=dtype)
  dtype = query.dtype
  query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
  scores = jnp.einsum("...qhd,...khd->...hqk", query, key, precision=precision)
  weights = masked_softmax(scores, mask).astype(dtype)
  if not deterministic and dropout_rate > 0.0:
    keep_prob = 1.0 - dropout_rate
    shape = ((1,) * (key.ndim - 2) + weights.shape[-2:]) if broadcast_dropout else weights.shape
    keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
    weights = weights * (keep.astype(dtype) / jnp.asarray(keep_prob, dtype=dtype))
  return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)
