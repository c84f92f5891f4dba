"""The byte-level decoder LM of :mod:`tpipe.train.models`, written in Flax NNX.

:func:`decoder_lm` builds a :class:`tpipe.nnx.Sequential` of ``TokenEmbedding ->
Repeat(TransformerBlock, L) -> LMHead``: the same layer math as the linen LM, with the same
attribute names and parameter shapes, so ``model.variables()["params"]`` has exactly the linen
LM's logical parameter tree (``layers_0/embed/embedding``, ``layers_1/attn/query/kernel``
``[L, width, heads, head_dim]``, ...) and equal parameters give equal losses. The trainer uses
that to train either front end with the same checkpoints (``--config.frontend=nnx``).

Calls take the linen LM's keywords: ``targets`` (the head returns per-example losses) and
``deterministic`` (dropout off when True; by default each module's ``deterministic`` attribute,
which ``model.train()``/``model.eval()`` set).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import tpipe
from tpipe import nnx as tnnx
from tpipe.train import attention, losses, models, moe


def _deterministic(module, deterministic: bool | None) -> bool:
  return module.deterministic if deterministic is None else deterministic


class TransformerBlock(nnx.Module):
  """A pre-LayerNorm causal Transformer block, as :class:`tpipe.train.models.TransformerBlock`
  (``causal=True``): attention and an MLP, each residual; the residual stream keeps ``x``'s
  dtype."""

  # The block's settings, keyword-only past the shapes.
  def __init__(self, width: int, num_heads: int, mlp_dim: int, *, dropout_rate: float = 0.0,
               deterministic: bool = True, dtype: Any = jnp.float32,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    if width % num_heads:
      raise ValueError(f"num_heads={num_heads} must divide width={width}; pick a divisor.")
    self.width = width
    self.deterministic = deterministic
    self.attn_norm = nnx.LayerNorm(width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
        num_heads=num_heads, in_features=width, qkv_features=width, out_features=width,
        dropout_rate=dropout_rate, deterministic=deterministic, decode=False, dtype=dtype,
        param_dtype=param_dtype, attention_fn=attention.dot_product_attention, rngs=rngs)
    self.attn_dropout = nnx.Dropout(dropout_rate, deterministic=deterministic, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.mlp_in = nnx.Linear(width, mlp_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.mlp_out = nnx.Linear(mlp_dim, width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.mlp_dropout = nnx.Dropout(dropout_rate, deterministic=deterministic, rngs=rngs)

  def __call__(self, x: jax.Array, *, deterministic: bool | None = None) -> jax.Array:
    if x.ndim != 3 or x.shape[-1] != self.width:
      raise ValueError(
          f"TransformerBlock expects [batch, seq, {self.width}] activations, got {x.shape}.")
    deterministic = _deterministic(self, deterministic)
    residual_dtype = x.dtype
    h = self.attn_norm(x)
    h = self.attn(h, h, mask=models.causal_mask(x.shape[1]), deterministic=deterministic)
    h = self.attn_dropout(h, deterministic=deterministic)
    y = (x + h).astype(residual_dtype)
    h = self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(y))))
    h = self.mlp_dropout(h, deterministic=deterministic)
    return (y + h).astype(residual_dtype)


class MixtureOfExperts(nnx.Module):
  """A mixture-of-experts SwiGLU feed-forward layer, as :class:`tpipe.train.moe.MixtureOfExperts`
  (same parameter names and shapes, same routing, the same optional shared expert):
  ``[..., width]`` to the same, computed by :func:`tpipe.train.moe.mixture` as linen's is. Its
  auxiliary losses go to the training loss (``tpipe.nnx.AuxLoss``), its router's metrics to
  ``tpipe.nnx.AuxMetric``."""

  # The layer's settings, keyword-only past the shapes.
  def __init__(self, width: int, hidden: int, num_experts: int, experts_per_token: int, *,
               capacity_factor: float = 0.0, router_aux_loss_coef: float = 0.0,
               router_z_loss_coef: float = 0.0, normalize_expert_weights: bool = True,
               shared_expert_hidden: int = 0, dispatch: str = "partitioner",
               exchange_chunks: int = 1, dtype: Any = None, param_dtype: Any = jnp.float32,
               rngs: nnx.Rngs):
    moe.check_routing(num_experts, experts_per_token, capacity_factor,
                      normalize_expert_weights=normalize_expert_weights,
                      shared_expert_hidden=shared_expert_hidden, dispatch=dispatch,
                      exchange_chunks=exchange_chunks)
    self.experts_per_token = experts_per_token
    self.normalize_expert_weights = normalize_expert_weights
    self.shared_expert_hidden = shared_expert_hidden
    self.capacity_factor = capacity_factor
    self.router_aux_loss_coef = router_aux_loss_coef
    self.router_z_loss_coef = router_z_loss_coef
    self.dispatch = dispatch
    self.exchange_chunks = exchange_chunks
    self.dtype = dtype
    expert_init = jax.nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,))
    param = lambda init, shape, names: nnx.Param(init(rngs.params(), shape, param_dtype),
                                                 out_sharding=names, eager_sharding=False)
    self.router = param(jax.nn.initializers.lecun_normal(), (width, num_experts),
                        ("embed", None))
    self.gate = param(expert_init, (num_experts, width, hidden), ("expert", "embed", "mlp"))
    self.up = param(expert_init, (num_experts, width, hidden), ("expert", "embed", "mlp"))
    self.down = param(expert_init, (num_experts, hidden, width), ("expert", "mlp", "embed"))
    if shared_expert_hidden:
      dense = jax.nn.initializers.lecun_normal()
      self.shared_gate = param(dense, (width, shared_expert_hidden), ("embed", "mlp"))
      self.shared_up = param(dense, (width, shared_expert_hidden), ("embed", "mlp"))
      self.shared_down = param(dense, (shared_expert_hidden, width), ("mlp", "embed"))
      self.shared_router = param(dense, (width, 1), ("embed", None))

  def __call__(self, x: jax.Array) -> jax.Array:
    moe.check_expert_axis(self.router.shape[-1])
    shared = None
    if self.shared_expert_hidden:
      shared = (self.shared_gate[...], self.shared_up[...], self.shared_down[...],
                self.shared_router[...])
    return moe.mixture(x, self.router[...], (self.gate[...], self.up[...], self.down[...]),
                       shared, self, sow_loss=functools.partial(self.sow, tnnx.AuxLoss),
                       sow_metric=functools.partial(self.sow, tnnx.AuxMetric))


class TokenEmbedding(nnx.Module):
  """Token ids to vectors plus learned positions, then dropout (as the linen ``TokenEmbedding``;
  the position table is initialised from ``normal(0.02)`` like it)."""

  # The ends' settings, keyword-only past the shapes.
  def __init__(self, vocab_size: int, width: int, max_len: int, *, dropout_rate: float = 0.0,
               deterministic: bool = True, dtype: Any = jnp.float32,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    self.max_len = max_len
    self.dtype = dtype
    self.deterministic = deterministic
    self.embed = nnx.Embed(vocab_size, width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.pos_embed = nnx.Param(
        jax.nn.initializers.normal(0.02)(rngs.params(), (max_len, width), param_dtype))
    self.dropout = nnx.Dropout(dropout_rate, deterministic=deterministic, rngs=rngs)

  def __call__(self, tokens: jax.Array, *, deterministic: bool | None = None) -> jax.Array:
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}.")
    seq_len = tokens.shape[1]
    if seq_len > self.max_len:
      raise ValueError(f"sequence length {seq_len} exceeds max_len={self.max_len}.")
    x = self.embed(tokens) + self.pos_embed[...][None, :seq_len].astype(self.dtype)
    return self.dropout(x, deterministic=_deterministic(self, deterministic))


class LMHead(nnx.Module):
  """Final LayerNorm and the projection to the vocabulary; float32 logits, or with ``targets``
  each example's mean next-token cross-entropy ``[batch]`` (``vocab_chunks`` vocabulary slices
  at a time when above 1, as the linen :class:`tpipe.train.models.LMHead`)."""

  def __init__(self, vocab_size: int, width: int, *, dtype: Any = jnp.float32,
               param_dtype: Any = jnp.float32, vocab_chunks: int = 1, rngs: nnx.Rngs):
    self.vocab_chunks = losses.check_num_chunks(vocab_chunks, vocab_size)
    self.dtype = dtype
    self.final_norm = nnx.LayerNorm(width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.head = nnx.Linear(width, vocab_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array, targets: jax.Array | None = None) -> jax.Array:
    if self.vocab_chunks > 1 and targets is not None:
      return losses.chunked_cross_entropy(
          self.final_norm(x), self.head.kernel[...], self.head.bias[...], targets,
          self.vocab_chunks, self.dtype).mean(axis=-1)
    logits = self.head(self.final_norm(x))
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    if targets is None:
      return logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(axis=-1)


# Keyword-only: one per model setting (the config's fields).
def decoder_lm(*, num_layers: int, width: int, num_heads: int, mlp_dim: int, max_len: int,
               vocab_size: int = models.VOCAB_SIZE, dropout_rate: float = 0.0,
               dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
               vocab_chunks: int = 1, spec: tpipe.PipelineSpec | None = None, rngs: nnx.Rngs,
               **settings) -> tnnx.Sequential:
  """The NNX decoder LM, pipelined; arguments as :func:`tpipe.train.models.decoder_lm`, plus
  ``rngs`` (parameters from its ``params`` stream; dropout keys from its ``dropout`` stream, or
  its default one, when called in training mode)."""
  dtype = models.check_float_dtype("decoder_lm dtype", dtype)
  param_dtype = models.check_float_dtype("decoder_lm param_dtype", param_dtype)
  spec = tpipe.spec.make("decoder_lm", spec, **settings).replace(per_example=("targets",))
  kw = dict(dtype=dtype, param_dtype=param_dtype)
  layers = [
      TokenEmbedding(vocab_size, width, max_len, dropout_rate=dropout_rate, rngs=rngs, **kw),
      tnnx.Repeat(lambda r: TransformerBlock(width, num_heads, mlp_dim,
                                             dropout_rate=dropout_rate, rngs=r, **kw),
                  num_layers, rngs=rngs),
      LMHead(vocab_size, width, vocab_chunks=vocab_chunks, rngs=rngs, **kw),
  ]
  return tnnx.Sequential(layers, spec=spec, rngs=rngs)
