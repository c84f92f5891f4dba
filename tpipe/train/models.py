"""A byte-level decoder-only Transformer language model whose block stack is pipelined.

``DecoderLM`` is ``embedding + learned positions -> [TransformerBlock x L] -> LayerNorm -> head``
over the 256 byte values. The L blocks are one :func:`tpipe.pipeline` stack named ``"blocks"``, so
their parameters are stacked on a leading axis of length L and split over the mesh's ``stage``
axis; the embedding and the head run under plain ``jax.jit`` on the global batch.

Example::

  mesh = tpipe.make_mesh(stages=4, data=2)
  model = DecoderLM(num_layers=8, width=128, num_heads=4, mlp_dim=512, max_len=128,
                    num_stages=4, num_microbatches=4, mesh=mesh)
  variables = model.init(jax.random.key(0), tokens)              # tokens: int32 [batch, seq]
  logits = model.apply(variables, tokens)                          # float32 [batch, seq, 256]
  logits = model.apply(variables, tokens, train=True, rngs={"dropout": key})

Mixed precision: ``dtype`` is the computation dtype (activations, matmul inputs) and
``param_dtype`` the dtype parameters are stored in. ``DecoderLM(..., dtype=jnp.bfloat16)`` keeps
float32 parameters (so gradients and optimizer state are float32 too) and runs the embedding, the
blocks and the head in bfloat16; the logits are cast to float32, so the loss is computed in
float32. LayerNorm statistics are float32 in any case (Flax computes them in at least float32).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import tpipe

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


class TransformerBlock(nn.Module):
  """A pre-LayerNorm Transformer block: causal self-attention and an MLP, each residual.

  The activation shape is preserved: ``(batch, seq, width)`` in, the same out, so the block can
  be a pipeline stage.

  Attributes:
    width: model width (the last axis of the activations).
    num_heads: attention heads; must divide ``width``.
    mlp_dim: hidden width of the MLP.
    dropout_rate: dropout on attention weights and on both residual branches.
    deterministic: if True, dropout is off (evaluation); if False a ``"dropout"`` RNG is needed.
    dtype: the computation dtype of the LayerNorms, the attention and the MLP (e.g.
      ``jnp.bfloat16``). The residual stream stays in the dtype of the input ``x``, which is also
      the output's dtype.
    param_dtype: the dtype the parameters are stored in.
  """

  width: int
  num_heads: int
  mlp_dim: int
  dropout_rate: float = 0.0
  deterministic: bool = True
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    check_float_dtype("TransformerBlock.dtype", self.dtype)
    check_float_dtype("TransformerBlock.param_dtype", self.param_dtype)
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Applies the block.

    Args:
      x: float activations ``[batch, seq, width]``.
      mask: boolean attention mask broadcastable to ``[batch, heads, seq, seq]`` (True = attend),
        typically :func:`causal_mask`; None attends everywhere.

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
    residual_dtype = x.dtype
    h = nn.LayerNorm(dtype=dtype, param_dtype=param_dtype, name="attn_norm")(x)
    h = nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads,
        qkv_features=self.width,
        out_features=self.width,
        dropout_rate=self.dropout_rate,
        deterministic=self.deterministic,
        dtype=dtype,
        param_dtype=param_dtype,
        name="attn")(h, h, mask=mask)
    h = nn.Dropout(self.dropout_rate, deterministic=self.deterministic)(h)
    y = (x + h).astype(residual_dtype)
    h = nn.LayerNorm(dtype=dtype, param_dtype=param_dtype, name="mlp_norm")(y)
    h = nn.Dense(self.mlp_dim, dtype=dtype, param_dtype=param_dtype, name="mlp_in")(h)
    h = nn.gelu(h)
    h = nn.Dense(self.width, dtype=dtype, param_dtype=param_dtype, name="mlp_out")(h)
    h = nn.Dropout(self.dropout_rate, deterministic=self.deterministic)(h)
    return (y + h).astype(residual_dtype)


class DecoderLM(nn.Module):
  """Byte-level decoder-only LM: embedding -> pipelined ``TransformerBlock`` stack -> head.

  Attributes:
    num_layers: L, the number of Transformer blocks (the pipelined stack's length).
    width: model width.
    num_heads: attention heads per block.
    mlp_dim: MLP hidden width.
    max_len: longest sequence (size of the learned position table).
    dropout_rate: dropout rate in the embedding and the blocks.
    num_stages: pipeline stages (devices along the mesh's ``stage`` axis).
    num_microbatches: micro-batches each per-data-shard batch is split into.
    schedule: pipeline schedule name (``"gpipe"`` or ``"circular"``).
    num_repeats: layer chunks per stage for the circular schedule (1 for GPipe).
    remat: rematerialisation policy for the blocks (``"none"``, ``"full"``, ``"dots"``, ...).
    mesh: the ``jax.sharding.Mesh`` with axes ``('data', 'stage')``.
    dtype: the computation dtype of the embedding, the blocks (their activations cross the stage
      boundaries in it) and the head, e.g. ``jnp.bfloat16``. The logits are float32 whatever it
      is.
    param_dtype: the dtype the parameters are stored in (float32 for mixed precision).
  """

  num_layers: int
  width: int
  num_heads: int
  mlp_dim: int
  max_len: int
  dropout_rate: float = 0.0
  num_stages: int = 1
  num_microbatches: int = 1
  schedule: str = "gpipe"
  num_repeats: int = 1
  remat: Any = "none"
  mesh: Any = None
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    for name in ("num_layers", "width", "num_heads", "mlp_dim", "max_len", "num_stages",
                 "num_microbatches", "num_repeats"):
      _check_int(name, getattr(self, name))
    _check_rate("dropout_rate", self.dropout_rate)
    check_float_dtype("DecoderLM.dtype", self.dtype)
    check_float_dtype("DecoderLM.param_dtype", self.param_dtype)
    if self.width % self.num_heads:
      raise ValueError(
          f"num_heads={self.num_heads} must divide width={self.width}; pick a divisor.")
    super().__post_init__()

  @nn.compact
  def __call__(self, tokens: jax.Array, *, train: bool = False) -> jax.Array:
    """Computes next-byte logits.

    Args:
      tokens: int ``[batch, seq]`` byte values in ``[0, 256)``, ``seq <= max_len``.
      train: enables dropout (then pass ``rngs={"dropout": key}``).

    Returns:
      float32 logits ``[batch, seq, 256]``: the head computes in ``dtype`` and its output is cast
      to float32, so a softmax cross-entropy on them is computed in float32.
    """
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}.")
    seq_len = tokens.shape[1]
    if seq_len > self.max_len:
      raise ValueError(f"sequence length {seq_len} exceeds max_len={self.max_len}.")
    dtype, param_dtype = jnp.dtype(self.dtype), jnp.dtype(self.param_dtype)
    x = nn.Embed(VOCAB_SIZE, self.width, dtype=dtype, param_dtype=param_dtype, name="embed")(tokens)
    pos = self.param("pos_embed", nn.initializers.normal(0.02), (self.max_len, self.width),
                     param_dtype)
    x = x + pos[None, :seq_len].astype(dtype)
    x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
    stack = tpipe.pipeline(
        TransformerBlock,
        length=self.num_layers,
        num_stages=self.num_stages,
        num_microbatches=self.num_microbatches,
        schedule=self.schedule,
        num_repeats=self.num_repeats,
        remat=self.remat,
        mesh=self.mesh)
    x = stack(
        width=self.width,
        num_heads=self.num_heads,
        mlp_dim=self.mlp_dim,
        dropout_rate=self.dropout_rate,
        deterministic=not train,
        dtype=dtype,
        param_dtype=param_dtype,
        name="blocks")(x, causal_mask(seq_len))
    x = nn.LayerNorm(dtype=dtype, param_dtype=param_dtype, name="final_norm")(x)
    logits = nn.Dense(VOCAB_SIZE, dtype=dtype, param_dtype=param_dtype, name="head")(x)
    return logits.astype(jnp.float32)
