"""Causal attention by a fused flash kernel: Pallas splash attention on TPU, cuDNN's on GPU.

The LM blocks (:mod:`tpipe.train.blocks`) attend causally, optionally within packed documents
(segment ids) and a sliding window, with grouped-query heads. Their ``attention`` setting picks
how (:data:`IMPLEMENTATIONS`):

* ``"blocked"`` (the default): :func:`tpipe.train.attention.grouped_attention` and
  :func:`tpipe.train.attention.attend`, plain XLA, one block of queries at a time in the
  backward. It runs everywhere and is the reference the kernels are tested against.
* ``"flash"``: the flash kernel of the platform (:func:`resolve`): ``"splash"`` on TPU,
  ``"cudnn"`` on GPU; elsewhere (CPU) a ValueError. :func:`tpipe.train.models.decoder_lm`
  resolves it by its mesh's devices before anything is traced (a TPU topology's when compiling
  ahead of time on a CPU machine); a block used on its own resolves it when traced, by the
  devices of the mesh in context or else JAX's default backend.
* ``"splash"``: JAX's Pallas splash attention
  (``jax.experimental.pallas.ops.tpu.splash_attention``), TPU only. The causal, window and
  segment masks are the kernel's own: it skips the key blocks a query block never sees and
  forms no score-sized array in either pass. It cuts the sequence into blocks of
  :func:`splash_block` (512, 256 or 128) positions, so the sequence must be a multiple of 128.
  Its backward calls splash attention's own backward kernels through their private rule
  (``_splash_attention_bwd``; see :func:`_over_partitioned_axes` for why), which the gradient
  tests check. Traced without a TPU mesh on a machine without a TPU (tpipe's planner compiling
  each unit here to count FLOPs, for a step compiled for a TPU topology), a program lowered for
  another platform gets the blocked attention instead (``jax.lax.platform_dependent``).
* ``"cudnn"``: cuDNN's flash attention through ``jax.nn.dot_product_attention(...,
  implementation="cudnn")``, GPU only, bfloat16 or float16 (cuDNN's kernel takes no float32);
  segment ids become a ``[batch, 1, seq, seq]`` boolean mask there (cuDNN adds it as a bias).
* ``"splash_interpret"``: the splash kernel run by the Pallas interpreter, on any platform:
  slow, for tests of the kernel's wiring on CPU.

None of the kernels has dropout on the attention weights.

Example::

  out = causal_attention(q, k, v, implementation="splash_interpret", segment_ids=segments,
                         sliding_window=64)   # q [b, s, heads, d], k and v [b, s, kv_heads, d]
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash_kernel_lib)
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from tpipe.train import attention

# The values of a block's ``attention`` setting (the trainer's ``config.attention``).
IMPLEMENTATIONS = ("blocked", "flash", "splash", "cudnn", "splash_interpret")
# The platforms each kernel runs on ("splash_interpret": any).
PLATFORMS = {"splash": ("tpu",), "cudnn": ("gpu", "cuda", "rocm")}
# cuDNN's flash attention takes these dtypes only.
CUDNN_DTYPES = ("bfloat16", "float16")
# Splash attention's smallest block: its key blocks are computed 128 lanes at a time.
LANES = 128
# The largest block of queries and keys splash attention is given (a divisor of the sequence).
MAX_BLOCK = 512


def check(attention: str, *, seq_len: int | None = None, dropout_rate: float = 0.0,
          owner: str = "attention") -> str:
  """Returns ``attention`` if it names one of :data:`IMPLEMENTATIONS` that can run with these
  settings; raises ValueError naming the value and the fix otherwise.

  Args:
    attention: the setting.
    seq_len: the sequence length, where known (splash attention needs a multiple of 128).
    dropout_rate: the block's dropout on the attention weights (the kernels have none).
    owner: the setting's name in the messages (``"config.attention"`` for the trainer's).
  """
  if attention not in IMPLEMENTATIONS:
    raise ValueError(f"{owner}={attention!r} is not one of {IMPLEMENTATIONS}: 'blocked' (XLA, "
                     "everywhere), 'flash' (the platform's flash kernel: splash attention on "
                     "TPU, cuDNN's on GPU), 'splash', 'cudnn', or 'splash_interpret' (splash "
                     "attention interpreted, for tests).")
  if attention == "blocked":
    return attention
  if dropout_rate:
    raise ValueError(f"{owner}={attention!r} has no dropout on the attention weights, and "
                     f"dropout_rate={dropout_rate}; set the dropout to 0 or use "
                     f"{owner}='blocked'.")
  if seq_len is not None and seq_len % LANES and attention != "cudnn":
    raise ValueError(f"{owner}={attention!r} cuts the sequence into blocks of {LANES} and "
                     f"seq_len={seq_len} is not a multiple of {LANES}; pad the sequences to "
                     f"one or use {owner}='blocked'.")
  return attention


def resolve(attention: str, platform_name: str, dtype=None, *,
            owner: str = "attention") -> str:
  """``attention`` with ``"flash"`` replaced by the kernel of ``platform_name`` (``"splash"``
  on ``"tpu"``, ``"cudnn"`` on GPU); every other value as it is, once checked to run there.

  Args:
    attention: one of :data:`IMPLEMENTATIONS`.
    platform_name: the platform of the devices the program is for (``Device.platform``).
    dtype: the dtype the attention computes in, where known (cuDNN takes bfloat16 and
      float16 only).
    owner: the setting's name in the messages.

  Raises:
    ValueError: the platform has no such kernel, or cuDNN would get another dtype.
  """
  check(attention, owner=owner)
  if attention == "flash":
    kernel = next((k for k, where in PLATFORMS.items() if platform_name in where), None)
    if kernel is None:
      raise ValueError(f"{owner}='flash' runs splash attention on TPU or cuDNN's on GPU, and "
                       f"the devices are {platform_name!r}; use {owner}='blocked' there (or "
                       "'splash_interpret' to interpret the TPU kernel, slowly).")
    attention = kernel
  if attention in PLATFORMS and platform_name not in PLATFORMS[attention]:
    raise ValueError(f"{owner}={attention!r} runs on {PLATFORMS[attention][0]!r} only, and the "
                     f"devices are {platform_name!r}; use {owner}='flash' (the platform's "
                     f"kernel) or 'blocked'.")
  if attention == "cudnn" and dtype is not None and jnp.dtype(dtype).name not in CUDNN_DTYPES:
    raise ValueError(f"{owner}={attention!r} is cuDNN's flash attention, which takes "
                     f"{' or '.join(CUDNN_DTYPES)}, and the blocks compute in "
                     f"{jnp.dtype(dtype).name}; use dtype='bfloat16' or {owner}='blocked'.")
  return attention


def splash_block(seq_len: int) -> int:
  """The block of queries and keys splash attention works in: the largest of 512, 256 and 128
  that divides ``seq_len``."""
  return next(b for b in (MAX_BLOCK, 256, LANES) if seq_len % b == 0)


def mesh_platform() -> str | None:
  """The platform of the devices of the mesh in context (``jax.set_mesh``, or a
  ``shard_map``'s, which carries them) while tracing, or None without one (shapes traced on
  their own, ``jax.eval_shape``: what they are for is not known then)."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return device.platform if device is not None else None


def causal_attention(query: jax.Array, key: jax.Array, value: jax.Array, *,
                     implementation: str = "flash", segment_ids: jax.Array | None = None,
                     sliding_window: int | None = None,
                     scale: float | None = None) -> jax.Array:
  """Causal grouped-query attention by a flash kernel.

  Query ``i`` attends key ``j`` where ``j <= i``, both are in the same segment (where
  ``segment_ids`` is given) and ``i - j < sliding_window`` (where given): the mask of
  :func:`tpipe.train.blocks.attention_mask`. Query head ``h`` reads key/value head
  ``h // (heads / kv_heads)``.

  Args:
    query: ``[batch, seq, heads, depth]``.
    key: ``[batch, seq, kv_heads, depth]``; ``kv_heads`` divides ``heads``.
    value: like ``key``.
    implementation: ``"flash"`` (the kernel of the devices of the mesh in context, else of
      JAX's default backend), ``"splash"``, ``"cudnn"`` or ``"splash_interpret"`` (see the
      module docstring).
    segment_ids: int ``[batch, seq]`` packed-document ids, or None.
    sliding_window: a query attends at most this many keys (itself included), or None.
    scale: multiplies the scores; None for ``1 / sqrt(depth)``.

  Returns:
    ``[batch, seq, heads, depth]`` in ``query``'s dtype.

  Raises:
    ValueError: an unknown ``implementation`` (or ``"blocked"``), a sequence splash attention
      cannot cut into blocks, a kernel the platform does not have, or cuDNN with float32.
  """
  batch, seq, heads, depth = query.shape
  kv_heads = key.shape[2]
  if implementation == "blocked":
    raise ValueError("causal_attention runs the flash kernels; for implementation='blocked' "
                     "use tpipe.train.attention.grouped_attention.")
  check(implementation, seq_len=seq)
  if heads % kv_heads or key.shape != value.shape or key.shape[:2] != (batch, seq):
    raise ValueError(f"causal_attention needs key and value [batch, seq, kv_heads, depth] with "
                     f"kv_heads dividing the query's heads; got query {query.shape}, key "
                     f"{key.shape}, value {value.shape}.")
  where = mesh_platform()
  if implementation == "flash":
    implementation = resolve(implementation, where or jax.default_backend(), query.dtype)
  elif implementation in PLATFORMS:  # Checked where the devices are known.
    resolve(implementation, where or PLATFORMS[implementation][0], query.dtype)
  scale = 1.0 / math.sqrt(depth) if scale is None else scale
  if implementation == "cudnn":
    return _cudnn(query, key, value, segment_ids, sliding_window, scale)
  splash_fn = lambda q, k, v: _over_partitioned_axes(
      sliding_window or None, scale, implementation == "splash_interpret", q, k, v, segment_ids)
  if implementation == "splash" and where is None and jax.default_backend() != "tpu":
    # Traced without the TPU mesh the kernel was chosen for, on a machine without a TPU: tpipe's
    # planner compiles each unit for this machine to count its FLOPs (fused schedules' tick
    # costs) when the step itself is compiled ahead of time for a TPU topology. A program
    # lowered for another platform than TPU gets the blocked attention, the same function (its
    # FLOPs those of the whole score matrix, where the kernel skips masked blocks).
    blocked = lambda q, k, v: _blocked(q, k, v, segment_ids, sliding_window, scale)
    return jax.lax.platform_dependent(query, key, value, tpu=splash_fn, default=blocked)
  return splash_fn(query, key, value)


def _blocked(query, key, value, segment_ids, sliding_window, scale):
  """:func:`tpipe.train.attention.grouped_attention` with the kernels' mask."""
  batch, seq, heads, depth = query.shape
  kv_heads = key.shape[2]
  positions = jnp.arange(seq)
  mask = positions[None, :] <= positions[:, None]
  if sliding_window:
    mask &= positions[:, None] - positions[None, :] < sliding_window
  mask = mask[None, None, None]
  if segment_ids is not None:
    mask = mask & (segment_ids[:, None, None, :, None] == segment_ids[:, None, None, None, :])
  grouped = query.reshape(batch, seq, kv_heads, heads // kv_heads, depth)
  out = attention.grouped_attention(grouped, key, value, mask, 1.0 / scale)
  return out.reshape(batch, seq, heads, depth)


def flax_attention_fn(implementation: str, segment_ids: jax.Array | None = None):
  """An ``attention_fn`` for ``flax.linen.MultiHeadDotProductAttention``: causal attention
  (within ``segment_ids``' documents) by :func:`causal_attention`, scaled by ``1 /
  sqrt(depth)`` as Flax's. The kernels take their mask from ``segment_ids``, not a mask array:
  a call with one raises ValueError."""

  def attention_fn(query, key, value, mask=None, dtype=None):
    if mask is not None:
      raise ValueError(f"attention={implementation!r} applies the causal mask within the "
                       "segment ids itself and takes no mask array; pass segment_ids instead "
                       "of a mask, or use attention='blocked'.")
    if dtype is not None:
      query, key, value = (a.astype(dtype) for a in (query, key, value))
    return causal_attention(query, key, value, implementation=implementation,
                            segment_ids=segment_ids)

  return attention_fn


def _splash_kernel(seq: int, heads: int, window: int | None, interpret: bool):
  """Splash attention's multi-head kernel for one sequence length, head count and window: the
  causal mask (within ``window``), the same on every head; it returns the output and each
  row's log-sum-exp (``save_residuals``), which :func:`_splash_backward` takes.

  Made anew in each trace (0.6 s at sequence 4096 and 32 heads): its block tables become
  arrays as it is made, inside the trace they belong to; made outside one and kept, they would
  be placed on the devices of the mesh in context, which a topology's (compiling ahead of time)
  cannot hold."""
  if window:  # Keys j with i - window < j <= i.
    mask = splash.LocalMask((seq, seq), window_size=(window - 1, 0), offset=0)
  else:
    mask = splash.CausalMask((seq, seq))
  b = splash_block(seq)
  sizes = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                            block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
  return splash.make_splash_mha(splash.MultiHeadMask([mask] * heads), block_sizes=sizes,
                                head_shards=1, q_seq_shards=1, interpret=interpret,
                                save_residuals=True)


def _heads_first(query, key, value, scale):
  """``[b, s, h, d]`` to the kernel's ``[b, h, s, d]``, the queries scaled (splash attention's
  scores are ``q k^T``; it works in float32 inside)."""
  q = jnp.swapaxes(query * jnp.asarray(scale, query.dtype), 1, 2)
  return (q,) + tuple(jnp.swapaxes(a, 1, 2) for a in (key, value))


def _splash_forward(query, key, value, segment_ids, *, window, scale, interpret):
  """Splash attention of one device's rows and heads (``[b, s, h, d]`` queries, ``[b, s, g,
  d]`` keys and values, int ``[b, s]`` segment ids), one example at a time (``vmap``):
  ``(out [b, s, h, d], log-sum-exp [b, h, s])``."""
  kernel = _splash_kernel(query.shape[1], query.shape[2], window, interpret)
  q, k, v = _heads_first(query, key, value, scale)
  ids = segment_ids.astype(jnp.int32)
  out, (lse,) = jax.vmap(
      lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s)))(q, k, v, ids)
  return jnp.swapaxes(out, 1, 2).astype(query.dtype), lse


def _splash_backward(query, key, value, segment_ids, out, lse, cotangent, *, window, scale,
                     interpret):
  """The gradients ``(d_query, d_key, d_value)`` of :func:`_splash_forward`'s output, from what
  it computed (``out``, ``lse``) and the output's cotangent, by splash attention's own backward
  kernels (``_splash_attention_bwd``, the rule its ``custom_vjp`` uses; the one private name
  this module reads, see :func:`_over_partitioned_axes` for why it calls it directly)."""
  kernel = _splash_kernel(query.shape[1], query.shape[2], window, interpret)
  q, k, v = _heads_first(query, key, value, scale)
  o, g = (jnp.swapaxes(a, 1, 2) for a in (out, cotangent))
  options = dict(kernel.kwargs)
  static = [options.pop(name) for name in (
      "save_residuals", "mask_value", "is_mqa", "block_sizes", "residual_checkpoint_name",
      "mask_function", "attn_logits_soft_cap", "interpret")]
  # As the kernel's call does: the partial mask blocks' leading axes as one.
  collapse = lambda info: info if info.partial_mask_blocks is None else info._replace(
      partial_mask_blocks=info.partial_mask_blocks.reshape(
          -1, *info.partial_mask_blocks.shape[-2:]))
  dq_info, dkv_info = collapse(kernel.dq_mask_info), collapse(kernel.dkv_mask_info)

  def one(q, k, v, s, o, lse, g):
    saved = (q, k, v, splash.SegmentIds(s, s), None, o, lse, dq_info, dkv_info)
    backward = splash_kernel_lib._splash_attention_bwd  # pylint: disable=protected-access
    return backward(*static, saved, g)[3:6]

  ids = segment_ids.astype(jnp.int32)
  d_q, d_k, d_v = jax.vmap(one)(q, k, v, ids, o, lse, g)
  d_q = d_q * jnp.asarray(scale, d_q.dtype)  # Through the scaling of the queries.
  return tuple(jnp.swapaxes(d, 1, 2).astype(a.dtype)
               for d, a in zip((d_q, d_k, d_v), (query, key, value)))


def _over_partitioned_axes(window, scale, interpret, query, key, value, segment_ids):
  """Splash attention of ``query``, ``key``, ``value`` and ``segment_ids`` (zeros where None:
  one segment) on each device's part of them, differentiable.

  A Pallas kernel is opaque to XLA's partitioner, which would gather its operands whole onto
  every device of the axes it partitions (a pipeline's ``tensor`` and ``expert`` axes inside a
  stage, every axis of a plain ``jit`` on a mesh). So the kernel runs manual over those axes
  (``jax.shard_map``): heads over ``tensor`` where it divides the key/value heads, rows over the
  others where they divide the batch; an axis that divides neither keeps them whole.

  That ``shard_map`` checks no varying-axes types (``check_vma=False``): splash attention's
  ``pallas_call`` gives its outputs none, which a checked ``shard_map`` (a pipeline's) refuses.
  Nothing differentiates through it: on jax 0.10.2, inside a checked ``shard_map``, the values
  in an unchecked one keep the outer axes in their types and the kernel's outputs have none,
  so both differentiating the unchecked ``shard_map`` and ``jax.vjp`` of the kernel inside it
  fail their type checks. So the forward and the backward kernels are called directly, each in
  its own unchecked ``shard_map``, under one ``custom_vjp``, and the results are cast back to
  vary over the manual axes their inputs vary over."""
  if segment_ids is None:
    segment_ids = jnp.zeros(query.shape[:2], jnp.int32)  # One segment: the causal mask alone.
  options = dict(window=window, scale=scale, interpret=interpret)
  forward = functools.partial(_splash_forward, **options)
  backward = functools.partial(_splash_backward, **options)
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:  # Each device's part, manual over the axes the partitioner has.
    sizes = dict(mesh.shape)
    free = [a for a, kind in zip(mesh.axis_names, mesh.axis_types) if kind != AxisType.Manual]
    heads = tuple(a for a in free if a == "tensor" and sizes[a] > 1
                  and key.shape[2] % sizes[a] == 0)
    row_axes, rows = [], query.shape[0]
    for a in free:
      if a not in heads and sizes[a] > 1 and rows % sizes[a] == 0:
        row_axes.append(a)
        rows //= sizes[a]
    qkv = P(tuple(row_axes) or None, None, heads or None, None)
    ids = P(tuple(row_axes) or None, None)
    lse = P(tuple(row_axes) or None, heads or None, None)
    local = functools.partial(jax.shard_map, axis_names=set(free), check_vma=False)
    forward = local(forward, in_specs=(qkv, qkv, qkv, ids), out_specs=(qkv, lse))
    backward = local(backward, in_specs=(qkv, qkv, qkv, ids, qkv, lse, qkv),
                     out_specs=(qkv, qkv, qkv))
  varying = [_varying(a) for a in (query, key, value)]
  everywhere = frozenset().union(*varying)

  def attended(q, k, v, s):
    out, lse = forward(q, k, v, s)
    return _cast(out, everywhere), _cast(lse, everywhere)

  def attend_forward(q, k, v, s):
    out, lse = attended(q, k, v, s)
    return out, (q, k, v, s, out, lse)

  def attend_backward(saved, cotangent):
    grads = backward(*saved, cotangent)
    return tuple(_cast(g, axes) for g, axes in zip(grads, varying)) + (None,)

  attend = jax.custom_vjp(lambda q, k, v, s: attended(q, k, v, s)[0])
  attend.defvjp(attend_forward, attend_backward)
  return attend(query, key, value, segment_ids)


def _varying(x) -> frozenset:
  """The manual mesh axes ``x`` varies over (empty outside ``shard_map``)."""
  kind = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(kind.varying) if kind is not None else frozenset()


def _cast(x, axes: frozenset):
  """``x`` made to vary over ``axes`` (a superset of those it varies over)."""
  missing = tuple(sorted(axes - _varying(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def _cudnn(query, key, value, segment_ids, sliding_window, scale):
  """cuDNN's flash attention (``jax.nn.dot_product_attention``): causal, grouped-query heads,
  the window as cuDNN's left window; segment ids as a boolean mask (cuDNN takes it as a bias)."""
  mask = None
  if segment_ids is not None:
    mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
  window = (sliding_window - 1, 0) if sliding_window else None
  return jax.nn.dot_product_attention(query, key, value, mask=mask, scale=scale, is_causal=True,
                                      local_window_size=window, implementation="cudnn")
