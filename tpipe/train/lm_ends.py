"""The LM's ends: the token embedding, and the head with its loss.

:class:`TokenEmbedding` turns token ids into vectors (with learned positions, unless the blocks
rotate by position); :class:`LMHead` normalizes, projects to the vocabulary and, given targets,
returns each example's loss, the vocabulary sliced so a micro-batch's whole logits are never
live (:func:`tpipe.train.losses.chunked_cross_entropy`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import tpipe
from tpipe.train import blocks
from tpipe.train import losses
from tpipe.train import model_args

_named = model_args.named


class TokenEmbedding(nn.Module):
  """Token ids to vectors: a learned embedding plus learned positions, then dropout.

  Attributes:
    vocab_size: number of token values.
    width: model width.
    max_len: longest sequence (size of the position table).
    dropout_rate: dropout on the sum.
    dtype: the computation dtype of the output.
    param_dtype: the dtype the parameters are stored in.
    learned_positions: add the learned position table ``pos_embed``; False for models whose
      blocks rotate by position instead (rotary embeddings).
  """

  vocab_size: int
  width: int
  max_len: int
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  learned_positions: bool = True

  @nn.compact
  def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
               deterministic: bool = True) -> jax.Array:
    """int ``[batch, seq]`` tokens to ``[batch, seq, width]`` vectors in ``dtype``.

    ``positions`` (int ``[batch, seq]``, e.g. restarting at each packed document) pick the rows
    of the position table; None uses ``0 .. seq - 1``.
    """
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}.")
    seq_len = tokens.shape[1]
    if seq_len > self.max_len:
      raise ValueError(f"sequence length {seq_len} exceeds max_len={self.max_len}.")
    dtype, param_dtype = jnp.dtype(self.dtype), jnp.dtype(self.param_dtype)
    x = nn.Embed(self.vocab_size, self.width, dtype=dtype, param_dtype=param_dtype,
                 embedding_init=_named(nn.linear.default_embed_init, ("vocab", "embed")),
                 name="embed")(tokens)
    if self.learned_positions:
      pos = self.param("pos_embed", _named(nn.initializers.normal(0.02), (None, "embed")),
                       (self.max_len, self.width), param_dtype)
      if positions is None:
        x = x + pos[None, :seq_len].astype(dtype)
      else:
        x = x + jnp.take(pos, positions, axis=0).astype(dtype)
    return nn.Dropout(self.dropout_rate, deterministic=deterministic)(x)


class _VocabProjection(nn.Module):
  """The head's ``kernel [width, vocab]`` and ``bias [vocab]``, made as ``nn.Dense`` makes them
  (same names and initializers), for a loss that uses them a vocabulary slice at a time."""

  vocab_size: int
  param_dtype: Any = jnp.float32
  use_bias: bool = True

  @nn.compact
  def __call__(self, width: int):
    kernel = self.param("kernel", _named(nn.initializers.lecun_normal(), ("embed", "vocab")),
                        (width, self.vocab_size), self.param_dtype)
    if not self.use_bias:
      return kernel, None
    bias = self.param("bias", _named(nn.initializers.zeros_init(), ("vocab",)),
                      (self.vocab_size,), self.param_dtype)
    return kernel, bias


def _vocab_shards(part: int) -> int:
  """The ways the vocabulary splits over the mesh axis its logical name maps to (``vocab`` ->
  ``tensor`` under the default rules) where the partitioner runs this code, if that divides
  ``part``, else 1."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  sizes = dict(mesh.shape)
  for name, target in tpipe.axis_rules.resolve_rules():
    if name == "vocab":
      axes = (target,) if isinstance(target, str) else tuple(target or ())
      ways = 1
      for axis, kind in zip(mesh.axis_names, mesh.axis_types):
        if axis in axes and kind == jax.sharding.AxisType.Auto:
          ways *= sizes[axis]
      return ways if part % ways == 0 else 1
  return 1


class LMHead(nn.Module):
  """Final norm and the projection to the vocabulary; with targets, the loss too.

  Attributes:
    vocab_size: number of token values.
    dtype: the computation dtype; the logits are cast to float32 whatever it is.
    param_dtype: the dtype the parameters are stored in.
    vocab_chunks: with targets, compute the loss this many vocabulary slices at a time
      (:func:`tpipe.train.losses.chunked_cross_entropy`) so a micro-batch's whole logits are
      never formed; must divide ``vocab_size``. The parameters are the same either way.
    norm: the final norm, ``"layer"`` (LayerNorm) or ``"rms"`` (:class:`RMSNorm`, the Llama
      family's).
    epsilon: the final norm's epsilon.
    use_bias: whether the projection has a bias (the pretrained families' heads have none).
  """

  vocab_size: int
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  vocab_chunks: int = 1
  norm: str = "layer"
  epsilon: float = 1e-6
  use_bias: bool = True

  @nn.compact
  def __call__(self, x: jax.Array, targets: jax.Array | None = None,
               loss_weights: jax.Array | None = None) -> jax.Array:
    """Logits, or per-example losses.

    Args:
      x: ``[batch, seq, width]`` activations.
      targets: int ``[batch, seq]`` next tokens, or None.
      loss_weights: float ``[batch, seq]`` weights of each position's loss (0 leaves a position
        out: a packed document's boundary, padding), or None for all 1.

    Returns:
      float32 logits ``[batch, seq, vocab]`` when ``targets`` is None; otherwise float32
      ``[batch]``: each example's next-token cross-entropy (nats) times ``loss_weights``,
      averaged over its positions.
    """
    dtype, param_dtype = jnp.dtype(self.dtype), jnp.dtype(self.param_dtype)
    if self.norm == "rms":
      x = blocks.RMSNorm(dtype, param_dtype, self.epsilon, name="final_norm")(x)
    elif self.norm == "layer":
      x = nn.LayerNorm(dtype=dtype, param_dtype=param_dtype, epsilon=self.epsilon,
                       name="final_norm")(x)
    else:
      raise ValueError(f"LMHead.norm must be 'layer' or 'rms', got {self.norm!r}.")
    weigh = lambda per_position: (per_position if loss_weights is None
                                  else per_position * loss_weights).mean(axis=-1)
    if self.vocab_chunks > 1 and targets is not None:
      if self.use_bias:
        kernel, bias = _VocabProjection(self.vocab_size, param_dtype, name="head")(x.shape[-1])
      else:
        kernel = _VocabProjection(self.vocab_size, param_dtype, False, name="head")(
            x.shape[-1])[0]
        bias = None
      return weigh(losses.chunked_cross_entropy(
          x, kernel, bias, targets, self.vocab_chunks, dtype,
          vocab_shards=_vocab_shards(self.vocab_size // self.vocab_chunks)))
    logits = nn.Dense(self.vocab_size, dtype=dtype, param_dtype=param_dtype,
                      use_bias=self.use_bias,
                      kernel_init=_named(nn.initializers.lecun_normal(), ("embed", "vocab")),
                      bias_init=_named(nn.initializers.zeros_init(), ("vocab",)),
                      name="head")(x)
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # At least float32.
    if targets is None:
      return logits
    return weigh(optax.softmax_cross_entropy_with_integer_labels(logits, targets))
