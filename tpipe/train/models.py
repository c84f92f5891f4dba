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

from typing import Any

import jax
import jax.numpy as jnp

import tpipe
from tpipe import spec as spec_lib
from tpipe.train import blocks
from tpipe.train import flash_attention
from tpipe.train import lm_ends
from tpipe.train import losses
from tpipe.train import model_args
from tpipe.train import moe


VOCAB_SIZE = 256
# The models' pieces, defined in their own modules (one name per line).
FLOAT_DTYPES = model_args.FLOAT_DTYPES
check_float_dtype = model_args.check_float_dtype
causal_mask = blocks.causal_mask
attention_mask = blocks.attention_mask
init_cache = blocks.init_cache
rotary_frequencies = blocks.rotary_frequencies
rotate = blocks.rotate
RMSNorm = blocks.RMSNorm
TransformerBlock = blocks.TransformerBlock
LlamaBlock = blocks.LlamaBlock
TokenEmbedding = lm_ends.TokenEmbedding
LMHead = lm_ends.LMHead

# The keyword arguments of the LM's layers that carry the batch on their leading axis.
PER_EXAMPLE = ("targets", "loss_weights", "segment_ids", "positions")
POSITIONS = ("learned", "rotary")


# One keyword per architecture field (tpipe.train.architecture.lm_arguments fills them).
def lm_layers(*, num_layers: int, width: int, num_heads: int, mlp_dim: int, max_len: int,
              vocab_size: int = VOCAB_SIZE, dropout_rate: float = 0.0, dtype: Any = jnp.float32,
              param_dtype: Any = jnp.float32, vocab_chunks: int = 1, block: str = "gpt",
              num_kv_heads: int | None = None, positions: str = "learned",
              rope_theta: float = 10000.0, rope_scaling: tuple | None = None,
              norm_epsilon: float = 1e-6, final_norm: str = "layer", head_bias: bool = True,
              qkv_bias: bool = False, head_dim: int | None = None,
              sliding_window: int | None = None, num_experts: int = 8,
              experts_per_token: int = 2, capacity_factor: float = 0.0,
              router_aux_loss_coef: float = 0.0, router_z_loss_coef: float = 0.0,
              normalize_expert_weights: bool = True, shared_expert_mlp_dim: int = 0,
              attention: str = "blocked", moe_dispatch: str = "partitioner",
              moe_exchange_chunks: int = 1) -> list:
  """The LM's layers ``[TokenEmbedding, tpipe.Repeat(block, L), LMHead]`` (arguments as
  :func:`decoder_lm`), checked; :func:`decoder_lm` pipelines them, and
  :mod:`tpipe.train.cli.generate` applies them one after the other with a key/value cache."""
  for name, value in (("num_layers", num_layers), ("width", width), ("num_heads", num_heads),
                      ("mlp_dim", mlp_dim), ("max_len", max_len), ("vocab_size", vocab_size)):
    model_args.check_int(name, value)
  losses.check_num_chunks(vocab_chunks, vocab_size)
  model_args.check_rate("dropout_rate", dropout_rate)
  dtype = check_float_dtype("decoder_lm dtype", dtype)
  param_dtype = check_float_dtype("decoder_lm param_dtype", param_dtype)
  if positions not in POSITIONS:
    raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}.")
  if head_dim is not None:
    model_args.check_int("head_dim", head_dim)
  elif width % num_heads:
    raise ValueError(f"num_heads={num_heads} must divide width={width}; pick a divisor.")
  if sliding_window is not None:
    model_args.check_int("sliding_window", sliding_window)
  flash_attention.check(attention, dropout_rate=dropout_rate, owner="attention")
  if block != "moe" and (shared_expert_mlp_dim or normalize_expert_weights is not True):
    raise ValueError(f"shared_expert_mlp_dim={shared_expert_mlp_dim!r} and "
                     f"normalize_expert_weights={normalize_expert_weights!r} shape a mixture of "
                     f"experts, and block={block!r} has none; use block='moe' or leave them at "
                     "0 and True.")
  if block in ("llama", "moe"):
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    model_args.check_int("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads:
      raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}.")
    if dropout_rate:
      raise ValueError(f"block={block!r} has no dropout; got dropout_rate={dropout_rate}.")
    experts = {}
    if block == "moe":
      whole = isinstance(shared_expert_mlp_dim, int) and not isinstance(shared_expert_mlp_dim,
                                                                        bool)
      if not whole or shared_expert_mlp_dim < 0:
        raise ValueError(f"shared_expert_mlp_dim must be an int >= 0 (0: no shared expert), "
                         f"got {shared_expert_mlp_dim!r}.")
      moe.check_routing(num_experts, experts_per_token, capacity_factor, owner="block='moe'",
                        normalize_expert_weights=normalize_expert_weights,
                        shared_expert_hidden=shared_expert_mlp_dim, dispatch=moe_dispatch,
                        exchange_chunks=moe_exchange_chunks)
      experts = dict(num_experts=num_experts, experts_per_token=experts_per_token,
                     moe_dispatch=moe_dispatch, moe_exchange_chunks=int(moe_exchange_chunks),
                     capacity_factor=float(capacity_factor),
                     router_aux_loss_coef=float(router_aux_loss_coef),
                     router_z_loss_coef=float(router_z_loss_coef),
                     normalize_expert_weights=bool(normalize_expert_weights),
                     shared_expert_mlp_dim=shared_expert_mlp_dim)
    rotary = positions == "rotary"
    if rotary:
      rotary_frequencies(head_dim or width // num_heads, rope_theta, rope_scaling)  # Checks.
    block = LlamaBlock(width=width, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       mlp_dim=mlp_dim, dtype=dtype, param_dtype=param_dtype, head_dim=head_dim,
                       epsilon=norm_epsilon, rope_theta=rope_theta if rotary else None,
                       rope_scaling=rope_scaling if rotary else None, qkv_bias=qkv_bias,
                       sliding_window=sliding_window, attention=attention, **experts)
  elif block == "gpt":
    if num_kv_heads not in (None, num_heads):
      raise ValueError(f"num_kv_heads={num_kv_heads}: block='gpt' has one key/value head per "
                       "query head; use block='llama' for grouped-query attention.")
    unsupported = [name for name, value in (
        ("positions='rotary'", positions == "rotary"),
        ("head_dim", head_dim not in (None, width // num_heads)),
        ("sliding_window", sliding_window is not None)) if value]
    if unsupported:
      raise ValueError(f"block='gpt' has learned positions, width / num_heads wide heads "
                       f"and full causal attention; "
                       f"{', '.join(unsupported)} need block='llama'.")
    block = TransformerBlock(width=width, num_heads=num_heads, mlp_dim=mlp_dim,
                             dropout_rate=dropout_rate, dtype=dtype, param_dtype=param_dtype,
                             causal=True, epsilon=norm_epsilon, attention=attention)
  else:
    raise ValueError(f"block must be 'gpt', 'llama' or 'moe', got {block!r}.")
  if final_norm not in ("layer", "rms"):
    raise ValueError(f"final_norm must be 'layer' or 'rms', got {final_norm!r}.")
  return [
      TokenEmbedding(vocab_size, width, max_len, dropout_rate=dropout_rate, dtype=dtype,
                     param_dtype=param_dtype, learned_positions=positions == "learned"),
      tpipe.Repeat(block, num_layers),
      LMHead(vocab_size, dtype=dtype, param_dtype=param_dtype, vocab_chunks=vocab_chunks,
             norm=final_norm, epsilon=norm_epsilon, use_bias=head_bias),
  ]


def decoder_lm(*, spec: tpipe.PipelineSpec | None = None, **arguments) -> tpipe.Sequential:
  """A decoder-only LM: ``TokenEmbedding -> Repeat(block, L) -> LMHead``, pipelined.

  Args:
    num_layers: L, the number of Transformer blocks.
    width: model width.
    num_heads: attention heads per block; must divide ``width`` (unless ``head_dim`` is given).
    mlp_dim: MLP hidden width.
    max_len: longest sequence (size of the learned position table).
    vocab_size: number of token values (256 bytes by default).
    dropout_rate: dropout in the embedding and the blocks (active with ``deterministic=False``).
    dtype: the computation dtype (activations cross the stage boundaries in it).
    param_dtype: the dtype the parameters are stored in (float32 for mixed precision).
    vocab_chunks: compute the loss this many vocabulary slices at a time (see
      :class:`LMHead`); 1 forms each micro-batch's whole logits.
    block: ``"gpt"`` (:class:`TransformerBlock`: LayerNorm, multi-head attention, GELU MLP,
      dropout), ``"llama"`` (:class:`LlamaBlock`: RMSNorm, grouped-query attention with
      ``num_kv_heads`` key/value heads, SwiGLU MLP, no dropout) or ``"moe"`` (Mixtral's: the
      llama block with a mixture of ``num_experts`` SwiGLU experts for its MLP, each token to
      ``experts_per_token`` of them; :class:`tpipe.train.moe.MixtureOfExperts`).
    num_kv_heads: the key and value heads of a ``"llama"`` block (default ``num_heads``).
    positions: ``"learned"`` (a position table in the embedding) or ``"rotary"`` (rotary
      embeddings in ``"llama"`` blocks, base ``rope_theta``, Hugging Face's ``rope_scaling``
      as a tuple of pairs or None).
    norm_epsilon: the epsilon of every norm.
    final_norm: the head's norm, ``"layer"`` or ``"rms"``.
    head_bias: whether the vocabulary projection has a bias.
    qkv_bias: ``"llama"`` blocks only: biases on the query, key and value projections.
    head_dim: ``"llama"`` blocks only: each head's width (default ``width // num_heads``).
    sliding_window: ``"llama"`` blocks only: attend at most this many keys (None: all).
    num_experts, experts_per_token, capacity_factor: ``"moe"`` blocks only: the experts, the
      experts per token, and 0 for dropless routing or the experts' capacity factor.
    router_aux_loss_coef, router_z_loss_coef: ``"moe"`` blocks only: the weights of the
      router's load-balancing loss and z-loss in the training loss.
    normalize_expert_weights: ``"moe"`` blocks only: each token's ``k`` experts mixed by their
      router probabilities renormalised to sum to one (True, Mixtral's) or as they are (False,
      Qwen2-MoE's).
    shared_expert_mlp_dim: ``"moe"`` blocks only: 0, or the hidden width of a shared SwiGLU
      expert every token goes through, its output scaled by a sigmoid gate (Qwen2-MoE's).
    moe_dispatch: ``"moe"`` blocks only: how tokens reach experts split over an ``expert``
      mesh axis, ``"partitioner"`` (XLA's) or ``"all_to_all"`` (explicit;
      :mod:`tpipe.train.expert_dispatch`).
    moe_exchange_chunks: with ``moe_dispatch="all_to_all"``: each device's tokens exchanged in
      this many parts, so one part's all-to-all can run while the experts compute another's
      (:func:`tpipe.train.expert_dispatch.expert_outputs`); 1: one exchange.
    attention: how the blocks attend (:mod:`tpipe.train.flash_attention`): ``"blocked"``
      (XLA, any platform), ``"flash"`` (a fused kernel: splash attention on TPU, cuDNN's on
      GPU, chosen by the devices of the spec's mesh, else JAX's default backend; no dropout),
      ``"splash"``, ``"cudnn"``, or ``"splash_interpret"`` (splash attention interpreted, for
      tests). The same parameters and, up to rounding, the same outputs either way.
    spec: the pipeline settings (:class:`tpipe.PipelineSpec`), or None to build them from the
      :class:`tpipe.PipelineSpec` fields among ``arguments``; ``per_example`` is always
      :data:`PER_EXAMPLE`.

  Calls take ``targets`` (the head then returns per-example losses), ``loss_weights``
  (weights of each position's loss), ``segment_ids`` (packed documents: attention stays inside
  each) and ``positions`` (each token's position, e.g. restarting per packed document), all
  ``[batch, seq]``.

  Returns:
    The :class:`tpipe.Sequential`. Its params are ``layers_0`` (embedding), ``layers_1`` (the
    blocks, stacked ``[L, ...]``) and ``layers_2`` (final norm and head); the keyword inputs
    reach the layers that take them and are split into micro-batches with the tokens.
  """
  settings = {k: arguments.pop(k) for k in list(arguments) if k in spec_lib.field_names()}
  spec = tpipe.spec.make("decoder_lm", spec, **settings).replace(per_example=PER_EXAMPLE)
  if arguments.get("attention", "blocked") != "blocked":  # The kernel of the mesh's devices.
    platform = (spec.mesh.devices.flat[0].platform if spec.mesh is not None
                else jax.default_backend())
    arguments["attention"] = flash_attention.resolve(
        arguments["attention"], platform, arguments.get("dtype", jnp.float32))
  layers = lm_layers(**arguments)
  return tpipe.Sequential(layers, spec)
