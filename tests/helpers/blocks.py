"""Small Flax blocks the tests pipeline: an MLP, attention with a broadcast mask, a pytree carrier,
a block undefined at zero, and a block with side inputs of every kind."""

import flax.linen as nn
import jax
import jax.numpy as jnp


def apply_in_sequence(block, params, x, *args, microbatches=1):
  """The plain sequential model: ``block`` applied with each layer of ``nn.scan``-stacked params.

  No pipeline: a ``lax.scan`` over ``params``' leading axis (what ``nn.scan`` does), the model a
  pipelined stack must equal. Works in any dtype (float64 references included).

  Args:
    block: the block module (one layer).
    params: the block's params with every leaf stacked on a leading layer axis.
    x: the input, an array or pytree of arrays with a leading batch axis.
    *args: passed unchanged to every layer.
    microbatches: split the batch into this many contiguous micro-batches and run each through
      all layers on its own (``lax.map``), as a pipeline does; the results are concatenated.
      Exact arithmetic gives the same result for any value (blocks act per example), but float32
      does not: XLA:CPU picks kernels by shape, so the rounding errors of a 2-row and a 64-row
      batch differ in size (measured up to 3x in param grads on AVX2).

  Returns:
    The last layer's output, shaped like ``x``.
  """

  def layers(x):
    return jax.lax.scan(lambda h, p: (block.apply({"params": p}, h, *args), None), x, params)[0]

  if microbatches == 1:
    return layers(x)
  split = jax.tree.map(lambda a: a.reshape(microbatches, -1, *a.shape[1:]), x)
  return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), jax.lax.map(layers, split))


class MLPBlock(nn.Module):
  """Residual two-layer MLP: ``x + W2 gelu(W1 x)``."""

  width: int = 8

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(2 * self.width)(x))
    return x + nn.Dense(self.width)(h)


class AttentionBlock(nn.Module):
  """Pre-LayerNorm residual self-attention; ``mask`` ([seq, seq] bool) is broadcast to all
  layers."""

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


class RMSNoEpsBlock(nn.Module):
  """RMS-normalised residual MLP with no epsilon: fine on real data, infinite slope at zero.

  A pipeline that ran idle (bubble) ticks on a zero placeholder would multiply a zero cotangent
  by that infinite derivative and return NaN gradients.
  """

  width: int = 8

  @nn.compact
  def __call__(self, x):
    h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True))
    return x + nn.Dense(self.width)(h)


class SideInputBlock(nn.Module):
  """A block with side inputs of every kind the transform sorts.

  ``gate`` ([batch, width], per example) scales the update of each example, ``bias`` ([width],
  broadcast) shifts it, ``extras`` is a dict of arrays (broadcast), and ``scale`` and
  ``deterministic`` are static Python values (keyword-only).
  """

  width: int = 8

  @nn.compact
  def __call__(self, x, gate, bias, extras=None, *, scale=1.0, deterministic=True):
    h = nn.Dense(self.width)(x) + bias
    if extras is not None:
      h = h * extras["gain"] + extras["shift"]
    if not deterministic:
      h = -h
    return x + scale * jnp.tanh(h) * gate
