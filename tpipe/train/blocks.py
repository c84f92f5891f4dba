"""The LM's Transformer blocks: GPT's and Llama's, with their masks, norms and rotary positions.

:class:`TransformerBlock` (pre-LayerNorm, learned positions come from the embedding) and
:class:`LlamaBlock` (RMSNorm, grouped-query attention, rotary positions) map activations
``[batch, seq, width]`` to the same; both take a key/value cache for decoding
(:func:`init_cache`). :mod:`tpipe.train.models` stacks them between the LM's ends.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tpipe.train import attention
from tpipe.train import flash_attention
from tpipe.train import model_args
from tpipe.train import moe

_named = model_args.named


def causal_mask(seq_len: int) -> jax.Array:
  """Returns a boolean ``[1, 1, seq_len, seq_len]`` mask: query i attends to keys j <= i."""
  return jnp.tril(jnp.ones((seq_len, seq_len), dtype=jnp.bool_))[None, None]


# The recomputed pieces' checkpoints leave out prevent_cse's barriers: tpipe runs blocks inside
# scans, where XLA cannot merge a recomputation with the forward, and the barriers cost memory
# (0.06 GiB at the v5p peak of experiments/tpu_memory.py's gpipe row, remat chunk, M = 8).
_recomputed = functools.partial(nn.remat, prevent_cse=False)


def _lean_layer_norm(dtype, param_dtype, name: str, epsilon: float = 1e-6) -> nn.Module:
  """Flax's LayerNorm (same parameters, same outputs) recomputed in the backward from its input,
  so the backward keeps its input and output, not three float32 intermediates as well."""
  return _recomputed(nn.LayerNorm)(dtype=dtype, param_dtype=param_dtype, epsilon=epsilon,
                                   name=name)


def attention_mask(seq_len: int, segment_ids: jax.Array | None = None,
                   sliding_window: int | None = None) -> jax.Array:
  """The causal mask, kept inside each packed document and an optional sliding window.

  Args:
    seq_len: the sequence length.
    segment_ids: int ``[batch, seq]``, which packed document each position belongs to (a
      query attends only keys of its own segment; padding is a segment of its own), or None.
    sliding_window: a query attends at most this many keys (itself included), or None.

  Returns:
    bool ``[1 or batch, 1, seq, seq]``, True where query i may attend key j.
  """
  query = jnp.arange(seq_len)[:, None]
  key = jnp.arange(seq_len)[None, :]
  mask = key <= query
  if sliding_window:
    mask = mask & (query - key < sliding_window)
  mask = mask[None, None]
  if segment_ids is not None:
    mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
  return mask


class _GeluThenDense(nn.Dense):
  """``Dense(gelu(x))``, the parameters ``Dense``'s. Under ``nn.remat`` (as the block uses it)
  the backward keeps only ``x`` and computes ``gelu(x)`` again (not the matmul, which the
  backward does not need): one ``[batch, seq, mlp_dim]`` array per block instead of the GELU's
  output and its tanh approximation's five intermediates."""

  def __call__(self, inputs: jax.Array) -> jax.Array:
    return super().__call__(nn.gelu(inputs))


class TransformerBlock(nn.Module):
  """A pre-LayerNorm Transformer block: causal self-attention and an MLP, each residual.

  The activation shape is preserved: ``(batch, seq, width)`` in, the same out, so the block can
  be a pipeline stage. The MLP's weights carry logical axis names (``embed``, ``mlp``) for
  splitting over a mesh's ``fsdp`` and ``tensor`` axes (:mod:`tpipe.axis_rules`); the
  attention's have none (``nn.MultiHeadDotProductAttention`` initializes its four kernels
  flattened to the same 2-D shape, so one initializer cannot name them apart), so they take
  the default: FSDP over their largest axis.

  The backward keeps little per block (the block's math and parameters are Flax's): the
  attention keeps no score-sized array (:mod:`tpipe.train.attention`), the two LayerNorms and
  the GELU are recomputed from their inputs. Compiled for a TPU v5p at width 2048, sequence
  1024, 2 sequences per micro-batch, this cut what a chunk of 4 blocks keeps for its backward
  (with GPipe's stash of 16 micro-batch inputs) from 2.08 to 0.52 GiB
  (``experiments/tpu_memory.py``).

  With its LayerNorms' ``epsilon=1e-5`` it is GPT-2's block (the tanh-approximated GELU, biases
  everywhere, attention scaled by ``1/sqrt(head_dim)``): :mod:`tpipe.train.pretrained` imports
  GPT-2 checkpoints into it.

  Attributes:
    width: model width (the last axis of the activations).
    num_heads: attention heads; must divide ``width``.
    mlp_dim: hidden width of the MLP.
    dropout_rate: dropout on attention weights and on both residual branches.
    deterministic: if True, dropout is off (evaluation); if False a ``"dropout"`` RNG is needed.
      A ``deterministic=`` call argument overrides it.
    dtype: the computation dtype of the LayerNorms, the attention and the MLP (e.g.
      ``jnp.bfloat16``). The residual stream stays in the dtype of the input ``x``, which is also
      the output's dtype.
    param_dtype: the dtype the parameters are stored in.
    causal: attend causally (query i to keys j <= i) when no ``mask`` is given.
    epsilon: the LayerNorms' epsilon (Flax's default 1e-6; GPT-2's 1e-5).
    attention: how the attention is computed (:mod:`tpipe.train.flash_attention`):
      ``"blocked"`` (XLA), ``"flash"`` (the platform's kernel: splash attention on TPU,
      cuDNN's on GPU), ``"splash"``, ``"cudnn"`` or ``"splash_interpret"``; the kernels need
      ``causal``, no ``mask`` array and no dropout.
  """

  width: int
  num_heads: int
  mlp_dim: int
  dropout_rate: float = 0.0
  deterministic: bool = True
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  causal: bool = False
  epsilon: float = 1e-6
  attention: str = "blocked"

  def __post_init__(self):
    model_args.check_float_dtype("TransformerBlock.dtype", self.dtype)
    model_args.check_float_dtype("TransformerBlock.param_dtype", self.param_dtype)
    flash_attention.check(self.attention, dropout_rate=self.dropout_rate,
                          owner="TransformerBlock.attention")
    if self.attention != "blocked" and not self.causal:
      raise ValueError(f"TransformerBlock.attention={self.attention!r} attends causally; set "
                       "causal=True or use attention='blocked'.")
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array | None = None, *,
               segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
               cache: dict | None = None, deterministic: bool | None = None):
    """Applies the block.

    Args:
      x: float activations ``[batch, seq, width]``.
      mask: boolean attention mask broadcastable to ``[batch, heads, seq, seq]`` (True = attend),
        typically :func:`causal_mask`; None attends everywhere (or causally when ``causal``).
      segment_ids: int ``[batch, seq]`` packed-document ids: with ``causal``, a query attends
        only the keys of its own segment (:func:`attention_mask`).
      positions: int ``[batch, seq]`` positions of the tokens; used with ``cache`` only (where
        the new keys go and which cached keys a query sees).
      cache: ``{"key", "value"}`` float ``[batch, max_len, heads, head_dim]``, the keys and
        values of earlier tokens (:func:`init_cache`), for decoding; then the call returns
        ``(output, updated cache)``.
      deterministic: overrides the ``deterministic`` attribute for this call when not None.

    Returns:
      The activations, the same shape and dtype as ``x`` (whatever ``dtype`` computes in: the
      pipeline needs the activation's dtype to be the same at every stage boundary); with a
      ``cache``, ``(activations, cache)``.
    """
    if x.ndim != 3 or x.shape[-1] != self.width:
      raise ValueError(
          f"TransformerBlock expects [batch, seq, {self.width}] activations, got {x.shape}.")
    if self.width % self.num_heads:
      raise ValueError(
          f"num_heads={self.num_heads} must divide width={self.width}; pick a divisor.")
    dtype, param_dtype = jnp.dtype(self.dtype), jnp.dtype(self.param_dtype)
    deterministic = self.deterministic if deterministic is None else deterministic
    attention_fn = attention.dot_product_attention
    if self.attention != "blocked":  # The kernel masks by the segment ids itself.
      attention_fn = flash_attention.flax_attention_fn(self.attention, segment_ids)
    elif mask is None and self.causal:
      mask = attention_mask(x.shape[1], segment_ids)
    residual_dtype = x.dtype
    h = _lean_layer_norm(dtype, param_dtype, "attn_norm", self.epsilon)(x)
    if cache is not None:
      h, cache = _CachedSelfAttention(self.num_heads, self.width, dtype, param_dtype,
                                      name="attn")(h, cache, _positions_of(x, positions))
    else:
      h = nn.MultiHeadDotProductAttention(
          num_heads=self.num_heads,
          qkv_features=self.width,
          out_features=self.width,
          dropout_rate=self.dropout_rate,
          deterministic=deterministic,
          dtype=dtype,
          param_dtype=param_dtype,
          attention_fn=attention_fn,
          name="attn")(h, h, mask=mask)
    h = nn.Dropout(self.dropout_rate, deterministic=deterministic)(h)
    y = (x + h).astype(residual_dtype)
    h = _lean_layer_norm(dtype, param_dtype, "mlp_norm", self.epsilon)(y)
    kernel_init = nn.linear.default_kernel_init
    h = nn.Dense(self.mlp_dim, dtype=dtype, param_dtype=param_dtype,
                 kernel_init=_named(kernel_init, ("embed", "mlp")),
                 bias_init=_named(nn.initializers.zeros_init(), ("mlp",)), name="mlp_in")(h)
    h = _recomputed(_GeluThenDense)(self.width, dtype=dtype, param_dtype=param_dtype,
                                    kernel_init=_named(kernel_init, ("mlp", "embed")),
                                    name="mlp_out")(h)
    h = nn.Dropout(self.dropout_rate, deterministic=deterministic)(h)
    y = (y + h).astype(residual_dtype)
    return y if cache is None else (y, cache)


def _positions_of(x: jax.Array, positions: jax.Array | None) -> jax.Array:
  """``positions``, or ``0 .. seq - 1`` for every row of ``x`` when None."""
  if positions is not None:
    return positions
  return jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])


class _CachedSelfAttention(nn.Module):
  """``nn.MultiHeadDotProductAttention``'s self-attention (the same parameters: ``query``,
  ``key``, ``value`` and ``out`` ``DenseGeneral``s) over a key/value cache, for decoding."""

  num_heads: int
  width: int
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x, cache, positions):
    head_dim = self.width // self.num_heads
    dense = lambda name: nn.DenseGeneral((self.num_heads, head_dim), axis=-1, dtype=self.dtype,
                                         param_dtype=self.param_dtype, name=name)
    query, key, value = (dense(name)(x) for name in ("query", "key", "value"))
    query = query / jnp.sqrt(head_dim).astype(query.dtype)
    out, cache = attention.cached_attention(query, key, value, cache, positions)
    out = nn.DenseGeneral(self.width, axis=(-2, -1), dtype=self.dtype,
                          param_dtype=self.param_dtype, name="out")(out)
    return out, cache


class RMSNorm(nn.Module):
  """Root-mean-square normalisation with a learned scale (no mean, no bias), in float32."""

  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  epsilon: float = 1e-6

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", _named(nn.initializers.ones_init(), ("embed",)), (x.shape[-1],),
                       self.param_dtype)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
    return (y * scale.astype(jnp.float32)).astype(self.dtype)


class LlamaBlock(nn.Module):
  """A Llama-style block: RMSNorm, causal grouped-query attention and a SwiGLU MLP, each
  residual, every matrix with logical axis names for FSDP and tensor parallelism.

  The attention has ``num_heads`` query heads sharing ``num_kv_heads`` key and value heads
  (``num_kv_heads`` divides ``num_heads``; query head ``h`` reads key/value head
  ``h // (num_heads / num_kv_heads)``, as Hugging Face's ``repeat_kv``). Positions come from the
  embedding unless ``rope_theta`` is set: then queries and keys are rotated by their positions
  (rotary embeddings, Hugging Face's half-split convention, :func:`rotary_frequencies`). With
  these settings it is the block of Llama, Mistral (``sliding_window``) and Qwen2
  (``qkv_bias``), which :mod:`tpipe.train.pretrained` imports; with ``num_experts`` its MLP is a
  mixture of SwiGLU experts (:class:`tpipe.train.moe.MixtureOfExperts`, Mixtral's block; with a
  shared expert and the top-k probabilities as they are, Qwen2-MoE's). Kernels:
  ``query [embed, heads, kv]``, ``key``/``value [embed, kv_heads, kv]``, ``out [heads, kv,
  embed]``, ``gate``/``up [embed, mlp]``, ``down [mlp, embed]`` (with experts ``moe/router
  [embed, experts]``, ``moe/gate``/``moe/up [expert, embed, mlp]``, ``moe/down [expert, mlp,
  embed]``; with a shared expert also ``moe/shared_gate``/``moe/shared_up [embed, mlp]``,
  ``moe/shared_down [mlp, embed]`` and ``moe/shared_router [embed, 1]``); with ``qkv_bias``,
  ``query_bias [heads, kv]`` and ``key_bias``/``value_bias [kv_heads, kv]``.

  Attributes:
    width: model width.
    num_heads: query heads.
    num_kv_heads: key and value heads; must divide ``num_heads``.
    mlp_dim: hidden width of the SwiGLU MLP.
    dtype: the computation dtype (softmax and norms in float32).
    param_dtype: the dtype the parameters are stored in.
    head_dim: each head's width; None for ``width // num_heads`` (which must divide then).
    epsilon: the RMSNorms' epsilon.
    rope_theta: the rotary embedding's base; None for no rotary embedding.
    rope_scaling: Hugging Face's ``rope_scaling`` as a tuple of ``(key, value)`` pairs (``linear``
      and ``llama3`` types), or None.
    qkv_bias: biases on the query, key and value projections (Qwen2).
    sliding_window: a query attends at most this many keys, itself included (Mistral); None for
      all earlier ones.
    num_experts: 0 for the dense SwiGLU MLP; else the experts of a mixture (``mlp_dim`` wide
      each).
    experts_per_token: the experts each token goes to (with ``num_experts``).
    capacity_factor: 0 for dropless routing, else the experts' capacity factor.
    router_aux_loss_coef: the router's load-balancing loss weight in the training loss.
    router_z_loss_coef: the router z-loss weight.
    normalize_expert_weights: with experts, mix each token's ``k`` experts by their router
      probabilities renormalised to sum to one (True, Mixtral) or as they are (False,
      Qwen2-MoE).
    shared_expert_mlp_dim: with experts, 0 for none or the hidden width of a shared SwiGLU
      expert every token goes through, gated by a sigmoid (Qwen2-MoE).
    moe_dispatch: with experts, how tokens reach experts split over an ``expert`` mesh axis
      (:attr:`tpipe.train.moe.MixtureOfExperts.dispatch`).
    moe_exchange_chunks: with ``moe_dispatch="all_to_all"``, the parts each device's tokens are
      exchanged in (:attr:`tpipe.train.moe.MixtureOfExperts.exchange_chunks`).
    attention: how the attention is computed (:mod:`tpipe.train.flash_attention`):
      ``"blocked"`` (XLA), ``"flash"`` (the platform's kernel: splash attention on TPU,
      cuDNN's on GPU), ``"splash"``, ``"cudnn"`` or ``"splash_interpret"``.
  """

  width: int
  num_heads: int
  num_kv_heads: int
  mlp_dim: int
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  head_dim: int | None = None
  epsilon: float = 1e-6
  rope_theta: float | None = None
  rope_scaling: tuple | None = None
  qkv_bias: bool = False
  sliding_window: int | None = None
  num_experts: int = 0
  experts_per_token: int = 2
  capacity_factor: float = 0.0
  router_aux_loss_coef: float = 0.0
  router_z_loss_coef: float = 0.0
  normalize_expert_weights: bool = True
  shared_expert_mlp_dim: int = 0
  moe_dispatch: str = "partitioner"
  moe_exchange_chunks: int = 1
  attention: str = "blocked"

  def __post_init__(self):
    flash_attention.check(self.attention, owner="LlamaBlock.attention")
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None, cache: dict | None = None,
               deterministic: bool | None = None):
    """``[batch, seq, width]`` to the same.

    Args:
      x: the activations.
      segment_ids: int ``[batch, seq]`` packed-document ids (attention stays in a segment).
      positions: int ``[batch, seq]`` token positions for the rotary embedding (and, with a
        cache, where the new keys go); None for ``0 .. seq - 1``.
      cache: ``{"key", "value"}`` ``[batch, max_len, num_kv_heads, head_dim]`` for decoding
        (:func:`init_cache`); the call then returns ``(activations, updated cache)``.
      deterministic: accepted for the trainer's calls (the block has no dropout).
    """
    del deterministic
    if x.ndim != 3 or x.shape[-1] != self.width:
      raise ValueError(f"LlamaBlock expects [batch, seq, {self.width}] activations, got "
                       f"{x.shape}.")
    uneven = self.head_dim is None and self.width % self.num_heads
    if uneven or self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must divide width={self.width} (or give "
                       f"head_dim) and num_kv_heads={self.num_kv_heads} must divide num_heads.")
    dtype, param_dtype = jnp.dtype(self.dtype), jnp.dtype(self.param_dtype)
    head_dim = self.head_dim or self.width // self.num_heads
    groups = self.num_heads // self.num_kv_heads
    x = moe.rows_over_expert(x)  # The expert axis carries data outside the experts.
    init = nn.linear.default_kernel_init
    weight = lambda name, shape, names: self.param(name, _named(init, names), shape,
                                                   param_dtype).astype(dtype)
    bias = lambda name, shape, names: self.param(
        name, _named(nn.initializers.zeros_init(), names), shape, param_dtype).astype(dtype)
    h = RMSNorm(dtype, param_dtype, self.epsilon, name="attn_norm")(x)
    q = jnp.einsum("bsd,dhk->bshk", h, weight(
        "query", (self.width, self.num_heads, head_dim), ("embed", "heads", "kv")))
    k, v = (jnp.einsum("bsd,dgk->bsgk", h, weight(
        name, (self.width, self.num_kv_heads, head_dim), ("embed", "kv_heads", "kv")))
        for name in ("key", "value"))
    if self.qkv_bias:
      q = q + bias("query_bias", (self.num_heads, head_dim), ("heads", "kv"))
      k = k + bias("key_bias", (self.num_kv_heads, head_dim), ("kv_heads", "kv"))
      v = v + bias("value_bias", (self.num_kv_heads, head_dim), ("kv_heads", "kv"))
    if self.rope_theta is not None or cache is not None:
      positions = _positions_of(x, positions)
    if self.rope_theta is not None:
      frequencies = rotary_frequencies(head_dim, self.rope_theta, self.rope_scaling)
      q, k = (rotate(a, positions, frequencies) for a in (q, k))
    if cache is not None:
      attended, cache = attention.cached_attention(
          q, k, v, cache, positions, scale=1 / math.sqrt(head_dim),
          sliding_window=self.sliding_window)
    elif self.attention != "blocked":
      attended = flash_attention.causal_attention(
          q, k, v, implementation=self.attention, segment_ids=segment_ids,
          sliding_window=self.sliding_window, scale=1 / math.sqrt(head_dim))
    else:
      q = q.reshape(q.shape[:2] + (self.num_kv_heads, groups, head_dim))
      mask = attention_mask(x.shape[1], segment_ids, self.sliding_window)[:, :, None]
      attended = attention.grouped_attention(q, k, v, mask, math.sqrt(head_dim)).reshape(
          q.shape[:2] + (self.num_heads, head_dim))
    y = x + jnp.einsum("bshk,hkd->bsd", attended, weight(
        "out", (self.num_heads, head_dim, self.width), ("heads", "kv", "embed"))).astype(x.dtype)
    h = RMSNorm(dtype, param_dtype, self.epsilon, name="mlp_norm")(y)
    if self.num_experts:
      y = moe.rows_over_expert(y) + moe.MixtureOfExperts(
          num_experts=self.num_experts, experts_per_token=self.experts_per_token,
          hidden=self.mlp_dim, capacity_factor=self.capacity_factor,
          router_aux_loss_coef=self.router_aux_loss_coef,
          router_z_loss_coef=self.router_z_loss_coef,
          normalize_expert_weights=self.normalize_expert_weights,
          shared_expert_hidden=self.shared_expert_mlp_dim, dispatch=self.moe_dispatch,
          exchange_chunks=self.moe_exchange_chunks,
          dtype=dtype, param_dtype=param_dtype, name="moe")(h).astype(x.dtype)
      return y if cache is None else (y, cache)
    gate = h @ weight("gate", (self.width, self.mlp_dim), ("embed", "mlp"))
    up = h @ weight("up", (self.width, self.mlp_dim), ("embed", "mlp"))
    down = weight("down", (self.mlp_dim, self.width), ("mlp", "embed"))
    y = y + (nn.silu(gate) * up @ down).astype(x.dtype)
    return y if cache is None else (y, cache)


def rotary_frequencies(head_dim: int, theta: float, scaling: tuple | None = None) -> np.ndarray:
  """The rotary embedding's ``head_dim / 2`` angular frequencies, float64, as Hugging Face's
  ``rope_init_fn`` defines them (``theta ** (-2i / head_dim)``; ``scaling`` of type ``linear``
  divides them by its ``factor``, ``llama3`` stretches the low ones as Llama 3.1 does).

  Raises:
    ValueError: an odd ``head_dim`` or a scaling type other than those two.
  """
  if head_dim % 2:
    raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}.")
  frequencies = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  if not scaling:
    return frequencies
  scaling = dict(scaling)
  kind = scaling.get("rope_type", scaling.get("type"))
  factor = float(scaling["factor"])
  if kind == "linear":
    return frequencies / factor
  if kind == "llama3":
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / frequencies
    scaled = np.where(wavelength > original / low, frequencies / factor, frequencies)
    smooth = (original / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return np.where(medium, smoothed, scaled)
  raise ValueError(f"rope_scaling type {kind!r} is not supported; tpipe implements 'linear' "
                   "and 'llama3' (or none).")


def rotate(x: jax.Array, positions: jax.Array, frequencies: np.ndarray) -> jax.Array:
  """``x [batch, seq, heads, head_dim]`` rotated by ``positions [batch, seq]``: Hugging Face's
  ``x * cos + rotate_half(x) * sin``, the angles computed in float32 (at least)."""
  dtype = jnp.promote_types(x.dtype, jnp.float32)
  angles = positions[..., None].astype(dtype) * jnp.asarray(frequencies, dtype)
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


def init_cache(batch: int, max_len: int, kv_heads: int, head_dim: int,
               dtype=jnp.float32) -> dict[str, jax.Array]:
  """An empty key/value cache of one block: ``{"key", "value"}`` zeros
  ``[batch, max_len, kv_heads, head_dim]``."""
  shape = (batch, max_len, kv_heads, head_dim)
  return {"key": jnp.zeros(shape, dtype), "value": jnp.zeros(shape, dtype)}
