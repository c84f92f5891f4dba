"""Dot-product attention whose backward keeps no score-sized array.

Differentiating ``softmax(where(mask, q k^T, -inf)) v`` the plain way keeps, for the backward,
the mask broadcast to every head, the masked scores, their exponentials and the probabilities:
four ``[batch, heads, seq, seq]`` arrays per layer, the largest residuals of a Transformer
block. :func:`attend` keeps none: it keeps ``q``, ``k``, ``v`` and, per row, the scores'
maximum and the sum of their exponentials, and its backward forms the probabilities again from
``q k^T`` (the recomputation a flash attention's backward makes, one more matmul of that size),
one block of queries at a time over a long sequence:

  d v = p^T d o,   d p = d o v^T,   d s = p * (d p - sum(d p * p, axis=-1)),
  d q = d s k,     d k = d s^T q    (d s zero where the mask is False).

With dropout on the attention weights, :func:`masked_softmax` keeps the probabilities alone
(and the dropout mask, as Flax does). Forwards are Flax's operations, so outputs are bit for
bit Flax's; gradients are the same math, the softmax's summed in at least float32.

:func:`dot_product_attention` is a drop-in ``attention_fn`` for
``flax.linen.MultiHeadDotProductAttention`` (same parameters, same outputs, dropout as Flax's),
used by :class:`tpipe.train.models.TransformerBlock`.

Example::

  attention = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=dot_product_attention)
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tpipe import mesh as mesh_lib
from tpipe.core.base import spmd


def _masked(scores: jax.Array, mask: jax.Array | None) -> jax.Array:
  """``scores`` with masked-out entries (``mask`` False) at the dtype's lowest value, as Flax's
  attention masks them."""
  if mask is None:
    return scores
  return jnp.where(mask, scores, jnp.finfo(scores.dtype).min)


def _scores(query, key, mask, precision):
  return _masked(jnp.einsum("...qhd,...khd->...hqk", query, key, precision=precision), mask)


def _attended(weights, value, precision):
  return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)


@jax.custom_vjp
def masked_softmax(scores: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """``softmax(scores)`` over the last axis with masked-out entries (``mask`` False) at the
  dtype's lowest value, as Flax's attention does; ``mask`` broadcasts against ``scores``.

  The backward keeps only the probabilities and ``mask`` (module docstring).
  """
  return jax.nn.softmax(_masked(scores, mask), axis=-1)


def _masked_softmax_forward(scores, mask):
  probabilities = masked_softmax(scores, mask)
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def attend(query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None = None,
           precision=None) -> jax.Array:
  """``softmax(where(mask, q k^T, lowest)) v`` for ``query [..., q, heads, depth]`` (already
  scaled), ``key`` and ``value [..., k, heads, depth]``; ``mask`` broadcasts against
  ``[..., heads, q, k]``. The operations are Flax's, so the output is bit for bit Flax's.

  The backward keeps no score-sized array: it keeps the inputs and each row's maximum and sum
  of exponentials, and forms the probabilities again from ``q k^T`` (one more matmul of the
  two, the cost of a flash attention's backward) instead of keeping them. Over a sequence
  longer than :data:`QUERY_BLOCK` (a multiple of it) it runs one block of queries at a time,
  so it forms no array larger than one block's scores; the forward is Flax's, whole.
  """
  return _attended(jax.nn.softmax(_scores(query, key, mask, precision), axis=-1), value,
                   precision)


def _attend_forward(query, key, value, mask, precision):
  scores = _scores(query, key, mask, precision)
  out = _attended(jax.nn.softmax(scores, axis=-1), value, precision)
  accumulate = jnp.promote_types(scores.dtype, jnp.float32)
  scores = scores.astype(accumulate)
  peak = jnp.max(scores, axis=-1, keepdims=True)
  total = jnp.sum(jnp.exp(scores - peak), axis=-1, keepdims=True)
  return out, (query, key, value, mask, peak, total)


def _attend_block_backward(query, key, value, mask, peak, total, cotangent, precision):
  """``(d_query, d_key, d_value)`` of the queries ``query`` (all or one block of them), from
  what the forward saved (``query`` to ``total``) and the cotangent of its output."""
  scores = _scores(query, key, mask, precision).astype(peak.dtype)
  p = jnp.exp(scores - peak) / total  # A row masked everywhere: uniform, as in the forward.
  d_value = jnp.einsum("...hqk,...qhd->...khd", p.astype(value.dtype), cotangent,
                       precision=precision)
  d_p = jnp.einsum("...qhd,...khd->...hqk", cotangent, value,
                   precision=precision).astype(p.dtype)
  d_scores = p * (d_p - jnp.sum(d_p * p, axis=-1, keepdims=True))
  if mask is not None:
    d_scores = jnp.where(mask, d_scores, 0.0)
  d_scores = d_scores.astype(query.dtype)
  d_query = _attended(d_scores, key, precision)
  d_key = jnp.einsum("...hqk,...qhd->...khd", d_scores, query, precision=precision)
  return d_query, d_key, d_value


def _attend_backward(precision, saved, cotangent):
  query, key, value, mask, peak, total = saved
  q_axis = query.ndim - 3  # query [..., q, heads, depth]; peak [..., heads, q, 1].
  count, per_block = _query_blocks(query, mask, q_axis)
  if count == 1:
    return _attend_block_backward(query, key, value, mask, peak, total, cotangent,
                                  precision) + (None,)
  # Over a long sequence one block of queries at a time, as grouped_attention's backward: the
  # largest arrays are one block's scores, not the whole [..., heads, q, k].
  masks = _blocked(mask, count, mask.ndim - 2) if per_block else None
  block = lambda q, m, block_peak, block_total, g: _attend_block_backward(
      q, key, value, mask if m is None else m, block_peak, block_total, g, precision)
  d_query, d_key, d_value = _summed_over_blocks(
      block, (_blocked(query, count, q_axis), masks, _blocked(peak, count, peak.ndim - 2),
              _blocked(total, count, total.ndim - 2), _blocked(cotangent, count, q_axis)),
      key, value)
  return _unblocked(d_query, q_axis), d_key, d_value, None


attend.defvjp(_attend_forward, _attend_backward)


# Queries per block over a long sequence, in both passes of grouped_attention and in attend's
# backward: their largest arrays are then one block's scores, [..., heads, QUERY_BLOCK, keys]
# (attend at sequence 4096, 8 heads of 256, one row, on a TPU v5p chip: the gradient's
# temporaries 1920 MiB whole, 256 MiB in blocks; at 2048, 16 heads of 128: 264 and 129).
QUERY_BLOCK = 512


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def grouped_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                      mask: jax.Array | None, sqrt_depth: float) -> jax.Array:
  """Grouped-query attention whose backward keeps no score-sized array: ``query [b, s, g, r,
  d]`` (``g`` key/value heads, ``r`` query heads each), ``key`` and ``value [b, t, g, d]``;
  ``mask`` broadcasts against ``[b, g, r, s, t]``. The scores are formed in float32 and
  divided by ``sqrt_depth``, the probabilities cast back to ``value``'s dtype (as Llama's
  attention computes them): ``[b, s, g, r, d]``.

  Like :func:`attend`, it keeps its inputs and each row's maximum and sum of exponentials, and
  its backward forms the probabilities again from ``q k^T``. Over a sequence longer than
  :data:`QUERY_BLOCK` (a multiple of it) both passes run one block of queries at a time, so no
  array larger than one block's scores is formed, and a batch of several rows runs one row at
  a time (:func:`_by_rows`).
  """
  return _grouped_forward(query, key, value, mask, sqrt_depth)[0]


def _query_blocks(query, mask, axis: int = 1):
  """How many blocks of the queries (along ``query``'s ``axis``), and whether the mask has
  rows per block (else it broadcasts them)."""
  s = query.shape[axis]
  count = s // QUERY_BLOCK if s > QUERY_BLOCK and s % QUERY_BLOCK == 0 else 1
  per_block = mask is not None and mask.shape[-2] == s
  return count, per_block


def _blocked(x, count: int, axis: int):
  """``x`` with ``axis`` cut into ``count`` blocks, the blocks first."""
  shape = x.shape[:axis] + (count, x.shape[axis] // count) + x.shape[axis + 1:]
  return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unblocked(x, axis: int):
  """The inverse of :func:`_blocked`."""
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def _grouped_logits(query, key, mask, sqrt_depth):
  logits = jnp.einsum("bsgrk,btgk->bgrst", query, key).astype(jnp.float32) / sqrt_depth
  return _masked(logits, mask)


def _grouped_block_forward(query, key, value, mask, sqrt_depth):
  logits = _grouped_logits(query, key, mask, sqrt_depth)
  peak = jnp.max(logits, axis=-1, keepdims=True)
  total = jnp.sum(jnp.exp(logits - peak), axis=-1, keepdims=True)
  probabilities = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
  return jnp.einsum("bgrst,btgk->bsgrk", probabilities, value), peak, total


def _by_rows(fn, arrays, query_axes, mask, out_query_axes):
  """``fn(*rows, row_mask)`` for each batch row of ``arrays`` (each ``[batch, ...]``; a row
  keeps its batch axis, of 1, or of one row per device below), the results stacked back into
  ``[batch, ...]``. ``mask`` has one row per batch row or broadcasts (a leading 1), or is None.
  ``query_axes`` names each array's axis of queries (None: an array over the keys, the
  ``key`` and ``value``), ``out_query_axes`` each result's (None: a result over the keys).

  The blocked passes of :func:`grouped_attention` run a row at a time (a loop of one step for
  one row, which XLA removes): over several rows at once the TPU compiler materialises each
  block's ``[batch, kv heads, groups, block, keys]`` float32 intermediates (the mask's and the
  softmax's) instead of fusing them as it does for one row. The gradient of one layer's
  attention at sequence 4096 (4 key/value heads of 128, 4 query heads each) on one v5p chip
  needs 261 MiB of temporaries for one row, 1634 MiB for two rows at once and 335 row by row;
  3268 and 369 for four rows.

  Where a stage's tokens split over its ``expert`` axis (:func:`spmd.expert_devices_here`),
  each device attends its own tokens as the stage's activations split them
  (:func:`spmd.pieces_per_row`). Where the rows divide over the devices, step ``i`` takes row
  ``i`` of every device's share, one row per device. Where the devices outnumber the rows,
  each row's queries split over the ``p`` devices that hold it, and one step attends every
  device's piece against its row's keys and values, which those ``p`` devices gather from
  each other (the gradients of the keys and values summed back over them). A loop over all the
  rows would have every device gather the micro-batch's queries, keys and values from every
  other device each layer and compute every row's attention itself (Mixtral-8x7B on stage 4 x
  expert 8 x fsdp 2, M = 16, 4 rows per fsdp replica over 8 devices: 2.65 s of all-gathers
  over ``expert`` in a 15.9 s step, as priced on v5p)."""
  batch, length = arrays[0].shape[0], arrays[0].shape[query_axes[0]]
  devices = spmd.expert_devices_here()
  pieces = spmd.pieces_per_row((batch, length), devices) if devices > 1 else None
  shards, pieces = (1, 1) if pieces is None else (devices, pieces)
  steps = batch * pieces // shards
  pin = (lambda x: x) if shards == 1 else (
      lambda x: jax.lax.with_sharding_constraint(x, P(mesh_lib.EXPERT_AXIS)))
  if mask is not None and pieces > 1:  # One mask row per piece: batch first, at full rank.
    mask = mask.reshape((1,) * (arrays[0].ndim - mask.ndim) + mask.shape)
    mask = jnp.broadcast_to(mask, (batch,) + mask.shape[1:])
  per_row = (mask is not None and mask.ndim == arrays[0].ndim and mask.shape[0] == batch)
  mask_axis = mask.ndim - 2 if per_row and mask.shape[-2] == length else None

  def to_steps(x, axis):  # [batch, ...] -> [steps, shards, ...], the devices' shares apart.
    x = _spread(x, pieces) if axis is None else _cut(x, axis, pieces)
    return jnp.swapaxes(pin(x.reshape(shards, steps, *x.shape[1:])), 0, 1)

  def from_steps(x, axis):
    x = pin(jnp.swapaxes(x, 0, 1))
    x = x.reshape(batch * pieces, *x.shape[2:])
    if axis is not None:
      return _joined(x, axis, pieces)
    total = _summed(x, pieces)  # Each device keeps its own piece of the sum, as it came.
    split = None if pieces == 1 else spmd.split_over_expert(total, devices)
    return total if split is None else split

  def step(xs):
    rows, row_mask = xs
    return tuple(map(pin, fn(*map(pin, rows), pin(row_mask) if per_row else mask)))

  steps_in = (tuple(map(to_steps, arrays, query_axes)),
              to_steps(mask, mask_axis) if per_row else None)
  return tuple(map(from_steps, jax.lax.map(step, steps_in), out_query_axes))


def _cut(x, axis: int, pieces: int):
  """``[batch, ..., n, ...]`` (``n`` at ``axis``) to ``[batch * pieces, ..., n / pieces,
  ...]``: each row cut into ``pieces`` along ``axis``, a row's pieces next to each other."""
  if pieces == 1:
    return x
  x = x.reshape(x.shape[:axis] + (pieces, x.shape[axis] // pieces) + x.shape[axis + 1:])
  x = jnp.moveaxis(x, axis, 1)
  return x.reshape((x.shape[0] * pieces,) + x.shape[2:])


def _joined(x, axis: int, pieces: int):
  """The inverse of :func:`_cut`."""
  if pieces == 1:
    return x
  x = jnp.moveaxis(x.reshape((x.shape[0] // pieces, pieces) + x.shape[1:]), 1, axis)
  return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def _spread(x, pieces: int):
  """``[batch, ...]`` to ``[batch * pieces, ...]``: each row once per piece of it."""
  return x if pieces == 1 else jnp.repeat(x, pieces, axis=0)


def _summed(x, pieces: int):
  """The inverse of :func:`_spread` for gradients: each row's pieces summed, in at least
  float32."""
  if pieces == 1:
    return x
  total = x.reshape((x.shape[0] // pieces, pieces) + x.shape[1:])
  return jnp.sum(total.astype(jnp.promote_types(x.dtype, jnp.float32)), axis=1).astype(x.dtype)


def _grouped_blocked_forward(query, key, value, mask, sqrt_depth):
  """The forward one block of :data:`QUERY_BLOCK` queries at a time: ``(out, peak, total)``."""
  count, per_block = _query_blocks(query, mask)
  masks = _blocked(mask, count, mask.ndim - 2) if per_block else None

  def block(xs):
    q, m = xs
    return _grouped_block_forward(q, key, value, mask if m is None else m, sqrt_depth)

  out, peak, total = jax.lax.map(block, (_blocked(query, count, 1), masks))
  return _unblocked(out, 1), _unblocked(peak, 3), _unblocked(total, 3)


def _grouped_forward(query, key, value, mask, sqrt_depth):
  count, _ = _query_blocks(query, mask)
  if count == 1:
    out, peak, total = _grouped_block_forward(query, key, value, mask, sqrt_depth)
  else:
    out, peak, total = _by_rows(
        lambda q, k, v, m: _grouped_blocked_forward(q, k, v, m, sqrt_depth),
        (query, key, value), (1, None, None), mask, (1, 3, 3))
  return out, (query, key, value, mask, peak, total)


def _grouped_block_backward(query, key, value, mask, peak, total, cotangent, sqrt_depth):
  """One query block's ``(d_query, d_key, d_value)``, from what the forward saved (``query``
  to ``total``) and the cotangent of its output."""
  p = jnp.exp(_grouped_logits(query, key, mask, sqrt_depth) - peak) / total
  d_value = jnp.einsum("bgrst,bsgrk->btgk", p.astype(value.dtype), cotangent)
  d_p = jnp.einsum("bsgrk,btgk->bgrst", cotangent, value).astype(p.dtype)
  d_logits = p * (d_p - jnp.sum(d_p * p, axis=-1, keepdims=True))
  if mask is not None:
    d_logits = jnp.where(mask, d_logits, 0.0)
  d_scores = (d_logits / sqrt_depth).astype(query.dtype)
  d_query = jnp.einsum("bgrst,btgk->bsgrk", d_scores, key)
  d_key = jnp.einsum("bgrst,bsgrk->btgk", d_scores, query)
  return d_query, d_key, d_value


def _grouped_blocked_backward(query, key, value, mask, peak, total, cotangent, sqrt_depth):
  """The backward one block of :data:`QUERY_BLOCK` queries at a time: ``(d_query, d_key,
  d_value)``."""
  count, per_block = _query_blocks(query, mask)
  masks = _blocked(mask, count, mask.ndim - 2) if per_block else None
  block = lambda q, m, block_peak, block_total, g: _grouped_block_backward(
      q, key, value, mask if m is None else m, block_peak, block_total, g, sqrt_depth)
  d_query, d_key, d_value = _summed_over_blocks(
      block, (_blocked(query, count, 1), masks, _blocked(peak, count, 3),
              _blocked(total, count, 3), _blocked(cotangent, count, 1)), key, value)
  return _unblocked(d_query, 1), d_key, d_value


def _grouped_backward(sqrt_depth, saved, cotangent):
  query, key, value, mask, peak, total = saved
  count, _ = _query_blocks(query, mask)
  if count == 1:
    grads = _grouped_block_backward(query, key, value, mask, peak, total, cotangent, sqrt_depth)
  else:
    grads = _by_rows(
        lambda q, k, v, p, t, g, m: _grouped_blocked_backward(q, k, v, m, p, t, g, sqrt_depth),
        (query, key, value, peak, total, cotangent), (1, None, None, 3, 3, 1), mask,
        (1, None, None))
  return (*grads, None)


def _summed_over_blocks(block, blocks, key, value):
  """A blocked backward: ``block(*xs)`` gives one query block's ``(d_query, d_key, d_value)``
  for each ``xs`` of ``blocks`` (arrays with the blocks first, or None); the blocks'
  ``d_query`` stacked, their ``d_key`` and ``d_value`` summed in at least float32 as the loop
  goes (a key-sized running sum, not one per block)."""
  accumulate = jnp.promote_types(key.dtype, jnp.float32)

  def step(sums, xs):
    d_q, d_k, d_v = block(*xs)
    return (sums[0] + d_k.astype(accumulate), sums[1] + d_v.astype(accumulate)), d_q

  # Inside shard_map the sums vary over every manual axis the inputs do, as the gradients may.
  axes = frozenset().union(*map(spmd.varying_axes, jax.tree.leaves((blocks, key, value))))
  zeros = tuple(spmd.cast_to(jnp.zeros(a.shape, accumulate), axes) for a in (key, value))
  (d_key, d_value), d_query = jax.lax.scan(step, zeros, blocks)
  return d_query, d_key.astype(key.dtype), d_value.astype(value.dtype)


grouped_attention.defvjp(_grouped_forward, _grouped_backward)


# Flax's attention_fn signature, which Flax calls.
def dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                          mask: jax.Array | None = None, *, dropout_rng=None,
                          dropout_rate: float = 0.0, broadcast_dropout: bool = True,
                          deterministic: bool = False, dtype=None, precision=None,
                          module=None, is_causal: bool = False) -> jax.Array:
  """Flax's ``nn.dot_product_attention`` (``[batch, seq, heads, depth]`` in and out; the
  arguments linen's ``MultiHeadDotProductAttention`` and NNX's ``MultiHeadAttention`` pass)
  whose backward keeps no score-sized array (:func:`attend`), or, with dropout on the attention
  weights or a ``module`` to sow them into (``sow_weights``), only the probabilities
  (:func:`masked_softmax`; the dropout mask is kept as Flax keeps it). ``is_causal`` adds the
  causal mask (query i attends to keys j <= i) to ``mask``, as NNX's attention does."""
  if is_causal:
    causal = jnp.tril(jnp.ones((query.shape[-3], key.shape[-3]), bool))
    mask = causal if mask is None else jnp.logical_and(mask, causal)
  query, key, value = nn.dtypes.promote_dtype(query, key, value, dtype=dtype)
  dtype = query.dtype
  query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
  dropout = not deterministic and dropout_rate > 0.0
  if not dropout and module is None:
    return attend(query, key, value, mask, precision)
  scores = jnp.einsum("...qhd,...khd->...hqk", query, key, precision=precision)
  weights = masked_softmax(scores, mask).astype(dtype)
  if module is not None:
    module.sow("intermediates", "attention_weights", weights)
  if dropout:
    keep_prob = 1.0 - dropout_rate
    shape = (((1,) * (key.ndim - 2) + weights.shape[-2:]) if broadcast_dropout
             else weights.shape)
    keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
    weights = weights * (keep.astype(dtype) / jnp.asarray(keep_prob, dtype=dtype))
  return _attended(weights, value, precision)


def cached_attention(query: jax.Array, key: jax.Array, value: jax.Array, cache: dict,
                     positions: jax.Array, *, scale: float = 1.0,
                     sliding_window: int | None = None) -> tuple[jax.Array, dict]:
  """Causal attention of new tokens over a key/value cache (decoding).

  The new keys and values are written into the cache at the new tokens' positions (every row
  at ``positions[0, 0]`` onwards: the rows of a batch decode in step), then each query attends
  the cached keys at positions up to its own (and within ``sliding_window`` of it).

  Args:
    query: ``[batch, seq, heads, depth]``, the new tokens' queries.
    key: ``[batch, seq, kv_heads, depth]``, their keys; ``kv_heads`` divides ``heads`` (query
      head ``h`` reads key head ``h // (heads / kv_heads)``).
    value: like ``key``.
    cache: ``{"key", "value"}`` ``[batch, max_len, kv_heads, depth]``.
    positions: int ``[batch, seq]``, the new tokens' positions.
    scale: multiplies the scores (``1 / sqrt(depth)`` unless the query is scaled already).
    sliding_window: a query attends at most this many keys, itself included; None for all.

  Returns:
    ``(attended [batch, seq, heads, depth], updated cache)``.
  """
  start = positions[0, 0]
  keys = jax.lax.dynamic_update_slice(cache["key"], key.astype(cache["key"].dtype),
                                      (0, start, 0, 0))
  values = jax.lax.dynamic_update_slice(cache["value"], value.astype(cache["value"].dtype),
                                        (0, start, 0, 0))
  batch, seq, heads, depth = query.shape
  kv_heads = keys.shape[2]
  grouped = query.reshape(batch, seq, kv_heads, heads // kv_heads, depth)
  scores = jnp.einsum("bsgrk,btgk->bgrst", grouped, keys.astype(query.dtype))
  scores = scores.astype(jnp.promote_types(scores.dtype, jnp.float32)) * scale
  slots = jnp.arange(keys.shape[1])
  mask = slots[None, None, :] <= positions[:, :, None]
  if sliding_window:
    mask = mask & (positions[:, :, None] - slots[None, None, :] < sliding_window)
  probabilities = masked_softmax(scores, mask[:, None, None]).astype(query.dtype)
  attended = jnp.einsum("bgrst,btgk->bsgrk", probabilities, values.astype(query.dtype))
  return attended.reshape(batch, seq, heads, depth), {"key": keys, "value": values}
