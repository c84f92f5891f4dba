"""A byte-level decoder-only Transformer language model, pipelined as a sequence of layers.

:func:`decoder_lm` builds a :class:`tpipe.Sequential` of three layers::

  TokenEmbedding (tokens -> vectors, learned positions) -> Repeat(TransformerBlock, L) -> LMHead

over the 256 byte values (or ``vocab_size`` tokens). The embedding runs in the first stage and the
head, with the cross-entropy, in the last, so what leaves the pipeline is one loss per example,
not the logits; with ``balance="flops"`` the stages are cut where the forward-and-backward FLOPs
balance, so the embedding's and head's work counts like the blocks'.

Example::

  mesh = tpipe.make_mesh(stages=4, data=2)
  model = decoder_lm(num_layers=8, width=128, num_heads=4, mlp_dim=512, max_len=128,
                     num_stages=4, num_microbatches=4, mesh=mesh)
  variables = model.init(jax.random.key(0), tokens, targets=targets)   # int32 [batch, seq]
  losses = model.apply(variables, tokens, targets=targets)       # float32 [batch]
  logits = model.apply(variables, tokens)                        # float32 [batch, seq, vocab]
  losses = model.apply(variables, tokens, targets=targets, deterministic=False,
                       rngs={"dropout": key})                    # with dropout

Mixed precision: ``dtype`` is the computation dtype (activations, matmul inputs) and
``param_dtype`` the dtype parameters are stored in. ``dtype=jnp.bfloat16`` keeps float32
parameters (so gradients and optimizer state are float32 too) and runs the embedding, the blocks
and the head in bfloat16; the logits, and so the loss, are float32. LayerNorm statistics are
float32 in any case (Flax computes them in at least float32).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import tpipe
from tpipe.train import attention
from tpipe.train import losses

VOCAB_SIZE = 256
# The floating dtypes the models compute in or store parameters in.
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _check_int(name: str, value: Any, minimum: int = 1) -> None:
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}.")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}.")


def _check_rate(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
    raise ValueError(f"{name} must be a float in [0, 1), got {value!r}.")


def check_float_dtype(name: str, value: Any) -> jnp.dtype:
  """Returns ``value`` as a ``jnp.dtype``; raises unless it names one of :data:`FLOAT_DTYPES`.

  Args:
    name: the field's name, for the error message.
    value: a dtype, a dtype's name (``"bfloat16"``) or a scalar type (``jnp.bfloat16``).

  Returns:
    The dtype.

  Raises:
    TypeError: ``value`` is not a dtype at all.
    ValueError: ``value`` is a dtype but not one of :data:`FLOAT_DTYPES` (e.g. ``int32``).
  """
  if value is None or isinstance(value, bool):
    raise TypeError(f"{name} must be a floating dtype, one of {FLOAT_DTYPES}, got {value!r}.")
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    raise TypeError(f"{name} must be a floating dtype, one of {FLOAT_DTYPES}, got {value!r} "
                    f"which is not a dtype.") from None
  if dtype.name not in FLOAT_DTYPES:
    raise ValueError(f"{name} must be a floating dtype, one of {FLOAT_DTYPES}, got {dtype.name}.")
  return dtype


def causal_mask(seq_len: int) -> jax.Array:
  """Returns a boolean ``[1, 1, seq_len, seq_len]`` mask: query i attends to keys j <= i."""
  return jnp.tril(jnp.ones((seq_len, seq_len), dtype=jnp.bool_))[None, None]


def _named(init, names):
  """``init`` whose weights carry logical axis ``names`` (``nn.with_logical_partitioning``)."""
  return nn.with_logical_partitioning(init, names)


# The recomputed pieces' checkpoints leave out prevent_cse's barriers: tpipe runs blocks inside
# scans, where XLA cannot merge a recomputation with the forward, and the barriers cost memory
# (0.06 GiB at the v5p peak of experiments/tpu_memory.py's gpipe row, remat chunk, M = 8).
_recomputed = functools.partial(nn.remat, prevent_cse=False)


def _lean_layer_norm(dtype, param_dtype, name: str) -> nn.Module:
  """Flax's LayerNorm (same parameters, same outputs) recomputed in the backward from its input,
  so the backward keeps its input and output, not three float32 intermediates as well."""
  return _recomputed(nn.LayerNorm)(dtype=dtype, param_dtype=param_dtype, name=name)


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
  """

  width: int
  num_heads: int
  mlp_dim: int
  dropout_rate: float = 0.0
  deterministic: bool = True
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  causal: bool = False

  def __post_init__(self):
    check_float_dtype("TransformerBlock.dtype", self.dtype)
    check_float_dtype("TransformerBlock.param_dtype", self.param_dtype)
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array | None = None, *,
               deterministic: bool | None = None) -> jax.Array:
    """Applies the block.

    Args:
      x: float activations ``[batch, seq, width]``.
      mask: boolean attention mask broadcastable to ``[batch, heads, seq, seq]`` (True = attend),
        typically :func:`causal_mask`; None attends everywhere (or causally when ``causal``).
      deterministic: overrides the ``deterministic`` attribute for this call when not None.

    Returns:
      The activations, the same shape and dtype as ``x`` (whatever ``dtype`` computes in: the
      pipeline needs the activation's dtype to be the same at every stage boundary).
    """
    if x.ndim != 3 or x.shape[-1] != self.width:
      raise ValueError(
          f"TransformerBlock expects [batch, seq, {self.width}] activations, got {x.shape}.")
    if self.width % self.num_heads:
      raise ValueError(
          f"num_heads={self.num_heads} must divide width={self.width}; pick a divisor.")
    dtype, param_dtype = jnp.dtype(self.dtype), jnp.dtype(self.param_dtype)
    deterministic = self.deterministic if deterministic is None else deterministic
    if mask is None and self.causal:
      mask = causal_mask(x.shape[1])
    residual_dtype = x.dtype
    h = _lean_layer_norm(dtype, param_dtype, "attn_norm")(x)
    h = nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads,
        qkv_features=self.width,
        out_features=self.width,
        dropout_rate=self.dropout_rate,
        deterministic=deterministic,
        dtype=dtype,
        param_dtype=param_dtype,
        attention_fn=attention.dot_product_attention,
        name="attn")(h, h, mask=mask)
    h = nn.Dropout(self.dropout_rate, deterministic=deterministic)(h)
    y = (x + h).astype(residual_dtype)
    h = _lean_layer_norm(dtype, param_dtype, "mlp_norm")(y)
    kernel_init = nn.linear.default_kernel_init
    h = nn.Dense(self.mlp_dim, dtype=dtype, param_dtype=param_dtype,
                 kernel_init=_named(kernel_init, ("embed", "mlp")),
                 bias_init=_named(nn.initializers.zeros_init(), ("mlp",)), name="mlp_in")(h)
    h = _recomputed(_GeluThenDense)(self.width, dtype=dtype, param_dtype=param_dtype,
                                    kernel_init=_named(kernel_init, ("mlp", "embed")),
                                    name="mlp_out")(h)
    h = nn.Dropout(self.dropout_rate, deterministic=deterministic)(h)
    return (y + h).astype(residual_dtype)


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
  (``num_kv_heads`` divides ``num_heads``). Positions come from the embedding (no rotary
  embedding). Kernels: ``query [embed, heads, kv]``, ``key``/``value [embed, kv_heads, kv]``,
  ``out [heads, kv, embed]``, ``gate``/``up [embed, mlp]``, ``down [mlp, embed]``.

  Attributes:
    width: model width.
    num_heads: query heads; must divide ``width``.
    num_kv_heads: key and value heads; must divide ``num_heads``.
    mlp_dim: hidden width of the SwiGLU MLP.
    dtype: the computation dtype (softmax and norms in float32).
    param_dtype: the dtype the parameters are stored in.
  """

  width: int
  num_heads: int
  num_kv_heads: int
  mlp_dim: int
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, *, deterministic: bool | None = None) -> jax.Array:
    """``[batch, seq, width]`` to the same; ``deterministic`` is accepted (no dropout)."""
    del deterministic
    if x.ndim != 3 or x.shape[-1] != self.width:
      raise ValueError(f"LlamaBlock expects [batch, seq, {self.width}] activations, got "
                       f"{x.shape}.")
    if self.width % self.num_heads or self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must divide width={self.width} and "
                       f"num_kv_heads={self.num_kv_heads} must divide num_heads.")
    dtype, param_dtype = jnp.dtype(self.dtype), jnp.dtype(self.param_dtype)
    head_dim, groups = self.width // self.num_heads, self.num_heads // self.num_kv_heads
    init = nn.linear.default_kernel_init
    weight = lambda name, shape, names: self.param(name, _named(init, names), shape,
                                                   param_dtype).astype(dtype)
    h = RMSNorm(dtype, param_dtype, name="attn_norm")(x)
    q = jnp.einsum("bsd,dhk->bshk", h, weight(
        "query", (self.width, self.num_heads, head_dim), ("embed", "heads", "kv")))
    k, v = (jnp.einsum("bsd,dgk->bsgk", h, weight(
        name, (self.width, self.num_kv_heads, head_dim), ("embed", "kv_heads", "kv")))
        for name in ("key", "value"))
    q = q.reshape(q.shape[:2] + (self.num_kv_heads, groups, head_dim))
    logits = jnp.einsum("bsgrk,btgk->bgrst", q, k).astype(jnp.float32) / math.sqrt(head_dim)
    seq = x.shape[1]
    probs = attention.masked_softmax(logits, jnp.tril(jnp.ones((seq, seq), bool))).astype(dtype)
    attended = jnp.einsum("bgrst,btgk->bsgrk", probs, v).reshape(q.shape[:2] + (
        self.num_heads, head_dim))
    y = x + jnp.einsum("bshk,hkd->bsd", attended, weight(
        "out", (self.num_heads, head_dim, self.width), ("heads", "kv", "embed"))).astype(x.dtype)
    h = RMSNorm(dtype, param_dtype, name="mlp_norm")(y)
    gate = h @ weight("gate", (self.width, self.mlp_dim), ("embed", "mlp"))
    up = h @ weight("up", (self.width, self.mlp_dim), ("embed", "mlp"))
    down = weight("down", (self.mlp_dim, self.width), ("mlp", "embed"))
    return y + (nn.silu(gate) * up @ down).astype(x.dtype)


class TokenEmbedding(nn.Module):
  """Token ids to vectors: a learned embedding plus learned positions, then dropout.

  Attributes:
    vocab_size: number of token values.
    width: model width.
    max_len: longest sequence (size of the position table).
    dropout_rate: dropout on the sum.
    dtype: the computation dtype of the output.
    param_dtype: the dtype the parameters are stored in.
  """

  vocab_size: int
  width: int
  max_len: int
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, tokens: jax.Array, *, deterministic: bool = True) -> jax.Array:
    """int ``[batch, seq]`` tokens to ``[batch, seq, width]`` vectors in ``dtype``."""
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}.")
    seq_len = tokens.shape[1]
    if seq_len > self.max_len:
      raise ValueError(f"sequence length {seq_len} exceeds max_len={self.max_len}.")
    dtype, param_dtype = jnp.dtype(self.dtype), jnp.dtype(self.param_dtype)
    x = nn.Embed(self.vocab_size, self.width, dtype=dtype, param_dtype=param_dtype,
                 embedding_init=_named(nn.linear.default_embed_init, ("vocab", "embed")),
                 name="embed")(tokens)
    pos = self.param("pos_embed", _named(nn.initializers.normal(0.02), (None, "embed")),
                     (self.max_len, self.width), param_dtype)
    x = x + pos[None, :seq_len].astype(dtype)
    return nn.Dropout(self.dropout_rate, deterministic=deterministic)(x)


class _VocabProjection(nn.Module):
  """The head's ``kernel [width, vocab]`` and ``bias [vocab]``, made as ``nn.Dense`` makes them
  (same names and initializers), for a loss that uses them a vocabulary slice at a time."""

  vocab_size: int
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, width: int):
    kernel = self.param("kernel", _named(nn.initializers.lecun_normal(), ("embed", "vocab")),
                        (width, self.vocab_size), self.param_dtype)
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
  """Final LayerNorm and the projection to the vocabulary; with targets, the loss too.

  Attributes:
    vocab_size: number of token values.
    dtype: the computation dtype; the logits are cast to float32 whatever it is.
    param_dtype: the dtype the parameters are stored in.
    vocab_chunks: with targets, compute the loss this many vocabulary slices at a time
      (:func:`tpipe.train.losses.chunked_cross_entropy`) so a micro-batch's whole logits are
      never formed; must divide ``vocab_size``. The parameters are the same either way.
  """

  vocab_size: int
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  vocab_chunks: int = 1

  @nn.compact
  def __call__(self, x: jax.Array, targets: jax.Array | None = None) -> jax.Array:
    """Logits, or per-example losses.

    Args:
      x: ``[batch, seq, width]`` activations.
      targets: int ``[batch, seq]`` next tokens, or None.

    Returns:
      float32 logits ``[batch, seq, vocab]`` when ``targets`` is None; otherwise float32
      ``[batch]``: each example's next-token cross-entropy (nats), averaged over its positions.
    """
    dtype, param_dtype = jnp.dtype(self.dtype), jnp.dtype(self.param_dtype)
    x = nn.LayerNorm(dtype=dtype, param_dtype=param_dtype, name="final_norm")(x)
    if self.vocab_chunks > 1 and targets is not None:
      kernel, bias = _VocabProjection(self.vocab_size, param_dtype, name="head")(x.shape[-1])
      return losses.chunked_cross_entropy(
          x, kernel, bias, targets, self.vocab_chunks, dtype,
          vocab_shards=_vocab_shards(self.vocab_size // self.vocab_chunks)).mean(axis=-1)
    logits = nn.Dense(self.vocab_size, dtype=dtype, param_dtype=param_dtype,
                      kernel_init=_named(nn.initializers.lecun_normal(), ("embed", "vocab")),
                      bias_init=_named(nn.initializers.zeros_init(), ("vocab",)),
                      name="head")(x)
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # At least float32.
    if targets is None:
      return logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(axis=-1)


def decoder_lm(*, num_layers: int, width: int, num_heads: int, mlp_dim: int, max_len: int,
               vocab_size: int = VOCAB_SIZE, dropout_rate: float = 0.0, dtype: Any = jnp.float32,
               param_dtype: Any = jnp.float32, vocab_chunks: int = 1, block: str = "gpt",
               num_kv_heads: int | None = None, spec: tpipe.PipelineSpec | None = None,
               **settings) -> tpipe.Sequential:
  """A decoder-only LM: ``TokenEmbedding -> Repeat(TransformerBlock, L) -> LMHead``, pipelined.

  Args:
    num_layers: L, the number of Transformer blocks.
    width: model width.
    num_heads: attention heads per block; must divide ``width``.
    mlp_dim: MLP hidden width.
    max_len: longest sequence (size of the learned position table).
    vocab_size: number of token values (256 bytes by default).
    dropout_rate: dropout in the embedding and the blocks (active with ``deterministic=False``).
    dtype: the computation dtype (activations cross the stage boundaries in it).
    param_dtype: the dtype the parameters are stored in (float32 for mixed precision).
    vocab_chunks: compute the loss this many vocabulary slices at a time (see
      :class:`LMHead`); 1 forms each micro-batch's whole logits.
    block: ``"gpt"`` (:class:`TransformerBlock`: LayerNorm, multi-head attention, GELU MLP,
      dropout) or ``"llama"`` (:class:`LlamaBlock`: RMSNorm, grouped-query attention with
      ``num_kv_heads`` key/value heads, SwiGLU MLP, no dropout).
    num_kv_heads: the key and value heads of a ``"llama"`` block (default ``num_heads``).
    spec: the pipeline settings (:class:`tpipe.PipelineSpec`), or None to build them from
      ``settings``; ``per_example`` is always ``("targets",)``.
    **settings: :class:`tpipe.PipelineSpec` fields, overriding ``spec``'s.

  Returns:
    The :class:`tpipe.Sequential`. Its params are ``layers_0`` (embedding), ``layers_1`` (the
    blocks, stacked ``[L, ...]``) and ``layers_2`` (final norm and head); ``targets`` (int
    ``[batch, seq]``) reach the head only and are split into micro-batches with the tokens.
  """
  for name, value in (("num_layers", num_layers), ("width", width), ("num_heads", num_heads),
                      ("mlp_dim", mlp_dim), ("max_len", max_len), ("vocab_size", vocab_size)):
    _check_int(name, value)
  losses.check_num_chunks(vocab_chunks, vocab_size)
  _check_rate("dropout_rate", dropout_rate)
  dtype = check_float_dtype("decoder_lm dtype", dtype)
  param_dtype = check_float_dtype("decoder_lm param_dtype", param_dtype)
  if width % num_heads:
    raise ValueError(f"num_heads={num_heads} must divide width={width}; pick a divisor.")
  spec = tpipe.spec.make("decoder_lm", spec, **settings).replace(per_example=("targets",))
  if block == "llama":
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    _check_int("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads:
      raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}.")
    if dropout_rate:
      raise ValueError(f"block='llama' has no dropout; got dropout_rate={dropout_rate}.")
    block = LlamaBlock(width=width, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       mlp_dim=mlp_dim, dtype=dtype, param_dtype=param_dtype)
  elif block == "gpt":
    if num_kv_heads not in (None, num_heads):
      raise ValueError(f"num_kv_heads={num_kv_heads}: block='gpt' has one key/value head per "
                       "query head; use block='llama' for grouped-query attention.")
    block = TransformerBlock(width=width, num_heads=num_heads, mlp_dim=mlp_dim,
                             dropout_rate=dropout_rate, dtype=dtype, param_dtype=param_dtype,
                             causal=True)
  else:
    raise ValueError(f"block must be 'gpt' or 'llama', got {block!r}.")
  layers = [
      TokenEmbedding(vocab_size, width, max_len, dropout_rate=dropout_rate, dtype=dtype,
                     param_dtype=param_dtype),
      tpipe.Repeat(block, num_layers),
      LMHead(vocab_size, dtype=dtype, param_dtype=param_dtype, vocab_chunks=vocab_chunks),
  ]
  return tpipe.Sequential(layers, spec)
