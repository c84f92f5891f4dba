"""Small Flax blocks the tests pipeline: an MLP, attention with a broadcast mask, a pytree carrier."""

import flax.linen as nn
import jax.numpy as jnp


class MLPBlock(nn.Module):
  """Residual two-layer MLP: ``x + W2 gelu(W1 x)``."""

  width: int = 8

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(2 * self.width)(x))
    return x + nn.Dense(self.width)(h)


class AttentionBlock(nn.Module):
  """Pre-LayerNorm residual self-attention; ``mask`` ([seq, seq] bool) is broadcast to all layers."""

  width: int = 8
  heads: int = 2

  @nn.compact
  def __call__(self, x, mask):
    h = nn.LayerNorm()(x)
    h = nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask[None, None])
    return x + h


class PytreeBlock(nn.Module):
  """An activation that is a dict of two arrays with different shapes, both carried through."""

  width: int = 8

  @nn.compact
  def __call__(self, x):
    h, summary = x["h"], x["summary"]
    h = h + jnp.tanh(nn.Dense(self.width)(h) + nn.Dense(self.width)(summary)[:, None, :])
    summary = summary + nn.Dense(self.width)(h.mean(axis=1))
    return {"h": h, "summary": summary}


class DropoutBlock(nn.Module):
  """MLP with dropout: exercises per-layer, per-micro-batch RNG folding."""

  width: int = 8
  rate: float = 0.5

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(2 * self.width)(x))
    h = nn.Dropout(self.rate, deterministic=False)(h)
    return x + nn.Dense(self.width)(h)
