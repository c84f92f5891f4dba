"""``tpipe.train.attention``: Flax's attention whose backward keeps no score-sized array (or,
with dropout, only the probabilities). Outputs bit for bit Flax's; gradients Flax's to float64
rounding, rows masked everywhere included."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import numerics
from tpipe.train import attention


def _flax_masked_softmax(scores, mask):
  if mask is not None:
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
  return jax.nn.softmax(scores)


@pytest.mark.parametrize("mask_shape", [(1, 1, 6, 6), (2, 3, 6, 6)])
def test_masked_softmax_equals_flax_and_its_gradient_in_float64(mask_shape):
  with jax.enable_x64(True):
    _check_masked_softmax(mask_shape)


def _check_masked_softmax(mask_shape):
  keys = jax.random.split(jax.random.key(0), 3)
  scores = jax.random.normal(keys[0], (2, 3, 6, 6), jnp.float64)
  cotangent = jax.random.normal(keys[1], scores.shape, jnp.float64)
  mask = jax.random.bernoulli(keys[2], 0.6, mask_shape)
  mask = mask.at[..., 0, :].set(False)  # A row with every entry masked (uniform output).
  mine = lambda s: jnp.sum(attention.masked_softmax(s, mask) * cotangent)
  flax = lambda s: jnp.sum(_flax_masked_softmax(s, mask) * cotangent)
  np.testing.assert_array_equal(attention.masked_softmax(scores, mask),
                                _flax_masked_softmax(scores, mask))
  np.testing.assert_allclose(jax.grad(mine)(scores), jax.grad(flax)(scores), atol=1e-14)
  assert np.all(np.asarray(jax.grad(mine)(scores))[np.broadcast_to(~mask, scores.shape)] == 0)


@jax.enable_x64(True)
def test_without_a_mask_the_gradient_is_softmaxs():
  scores = jax.random.normal(jax.random.key(1), (3, 5), jnp.float64)
  cotangent = jax.random.normal(jax.random.key(2), (3, 5), jnp.float64)
  mine = jax.grad(lambda s: jnp.sum(attention.masked_softmax(s) * cotangent))(scores)
  plain = jax.grad(lambda s: jnp.sum(jax.nn.softmax(s) * cotangent))(scores)
  np.testing.assert_allclose(mine, plain, atol=1e-14)


def _residual_bytes(fn, *args):
  """Bytes of the residuals ``jax.vjp`` keeps (its closure's array leaves)."""
  _, vjp = jax.vjp(fn, *args)
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(vjp) if hasattr(a, "dtype"))


def test_the_backward_keeps_the_probabilities_alone():
  scores = jnp.ones((2, 4, 64, 64), jnp.bfloat16)
  mask = jnp.tril(jnp.ones((64, 64), bool))[None, None]
  score_bytes = scores.size * 2
  mine = _residual_bytes(lambda s: attention.masked_softmax(s, mask), scores)
  flax = _residual_bytes(lambda s: _flax_masked_softmax(s, mask), scores)
  assert mine <= score_bytes + mask.size, mine
  assert flax >= 2 * score_bytes, flax


@pytest.mark.parametrize("deterministic", [True, False])
def test_multi_head_attention_equals_flaxs(deterministic):
  with jax.enable_x64(True):
    _check_multi_head_attention(deterministic)


def _check_multi_head_attention(deterministic):
  x = jax.random.normal(jax.random.key(3), (2, 8, 16), jnp.float64)
  mask = jnp.tril(jnp.ones((8, 8), bool))[None, None]
  make = lambda fn: nn.MultiHeadDotProductAttention(num_heads=4, dropout_rate=0.25,
                                                    deterministic=deterministic,
                                                    param_dtype=jnp.float64, attention_fn=fn)
  params = make(nn.dot_product_attention).init(jax.random.key(4), x, x, mask=mask)
  rngs = {"dropout": jax.random.key(5)}
  run = lambda fn: lambda p, x: make(fn).apply(p, x, x, mask=mask, rngs=rngs)
  ours, flax = run(attention.dot_product_attention), run(nn.dot_product_attention)
  np.testing.assert_array_equal(ours(params, x), flax(params, x))
  cotangent = jax.random.normal(jax.random.key(6), x.shape, jnp.float64)
  grad = lambda fn: jax.grad(lambda p, x: jnp.sum(fn(p, x) * cotangent), argnums=(0, 1))
  for a, b in zip(jax.tree.leaves(grad(ours)(params, x)), jax.tree.leaves(grad(flax)(params, x))):
    np.testing.assert_allclose(a, b, atol=1e-12)


def _flax_attend(query, key, value, mask):
  scores = jnp.einsum("...qhd,...khd->...hqk", query, key)
  return jnp.einsum("...hqk,...khd->...qhd", _flax_masked_softmax(scores, mask), value)


@pytest.mark.parametrize("query_block", [512, 2])
@jax.enable_x64(True)
def test_attend_equals_flax_and_its_gradients_in_float64(query_block, monkeypatch):
  """Outputs bit for bit Flax's; gradients Flax's to float64 rounding, the backward whole or one
  block of queries at a time (``query_block=2``: three blocks of six queries, each block's
  scores alone formed)."""
  monkeypatch.setattr(attention, "QUERY_BLOCK", query_block)
  blocks_seen = []
  block_backward = attention._attend_block_backward  # pylint: disable=protected-access
  monkeypatch.setattr(attention, "_attend_block_backward",
                      lambda q, *a: blocks_seen.append(q.shape[-3]) or block_backward(q, *a))
  keys = jax.random.split(jax.random.key(7), 5)
  query, key, value = (jax.random.normal(k, (2, 6, 3, 4), jnp.float64) for k in keys[:3])
  cotangent = jax.random.normal(keys[3], (2, 6, 3, 4), jnp.float64)
  mask = jax.random.bernoulli(keys[4], 0.6, (2, 1, 6, 6)).at[:, :, 2, :].set(False)
  for m in (mask, None):
    np.testing.assert_array_equal(attention.attend(query, key, value, m),
                                  _flax_attend(query, key, value, m))
    loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v, m) * cotangent)
    got = jax.grad(loss(attention.attend), argnums=(0, 1, 2))(query, key, value)
    want = jax.grad(loss(_flax_attend), argnums=(0, 1, 2))(query, key, value)
    for a, b in zip(got, want):
      np.testing.assert_allclose(a, b, atol=1e-13)
  assert set(blocks_seen) == ({2} if query_block == 2 else {6}), blocks_seen


def test_attend_keeps_no_score_sized_array():
  query = jnp.ones((2, 64, 4, 8), jnp.bfloat16)
  mask = jnp.tril(jnp.ones((64, 64), bool))[None, None]
  score_bytes = 2 * 4 * 64 * 64 * 2
  mine = _residual_bytes(lambda q, k, v: attention.attend(q, k, v, mask), query, query, query)
  flax = _residual_bytes(lambda q, k, v: _flax_attend(q, k, v, mask), query, query, query)
  rows = 2 * 4 * 64
  assert mine <= 3 * query.nbytes + mask.size + 2 * 4 * rows, mine  # q, k, v, mask, 2 per row
  assert mine <= score_bytes / 2, mine
  assert flax >= 2 * score_bytes, flax


@jax.enable_x64(True)
def test_sown_weights_are_flaxs():
  x = jax.random.normal(jax.random.key(8), (2, 8, 16), jnp.float64)
  make = lambda fn: nn.MultiHeadDotProductAttention(num_heads=4, param_dtype=jnp.float64,
                                                    attention_fn=fn)
  params = make(nn.dot_product_attention).init(jax.random.key(4), x, x)
  sown = lambda fn: make(fn).apply(params, x, x, sow_weights=True, mutable="intermediates")
  (out, ours), (flax_out, flax) = sown(attention.dot_product_attention), sown(
      nn.dot_product_attention)
  np.testing.assert_array_equal(out, flax_out)
  np.testing.assert_array_equal(jax.tree.leaves(ours)[0], jax.tree.leaves(flax)[0])


@jax.enable_x64(True)
def test_is_causal_adds_the_causal_mask():
  keys = jax.random.split(jax.random.key(9), 4)
  query, key, value = (jax.random.normal(k, (2, 6, 3, 4), jnp.float64) for k in keys[:3])
  mask = jax.random.bernoulli(keys[3], 0.7, (2, 1, 6, 6))
  causal = jnp.tril(jnp.ones((6, 6), bool))
  for m, combined in ((mask, mask & causal), (None, causal)):
    ours = attention.dot_product_attention(query, key, value, m, deterministic=True,
                                           is_causal=True)
    np.testing.assert_array_equal(
        ours, nn.dot_product_attention(query, key, value, mask=combined))


@pytest.mark.parametrize("masked", [None, "causal", "per_row"])
@pytest.mark.parametrize("query_block", [512, 2])
def test_grouped_attention_equals_its_plain_composition_and_its_gradients(masked, query_block,
                                                                          monkeypatch):
  """Llama's grouped-query attention: the same outputs as softmax of the float32 scores, and
  the gradients autodiff gives the plain composition (float32 inputs: the numerics rule), whole
  or one block of queries at a time (``query_block=2``: three blocks of six queries, each row of
  the batch of two on its own), with no mask, one mask for every row, or a mask per row."""
  monkeypatch.setattr(attention, "QUERY_BLOCK", query_block)
  b, s, g, r, d = 2, 6, 2, 3, 4
  keys = jax.random.split(jax.random.key(3), 5)
  q = jax.random.normal(keys[0], (b, s, g, r, d))
  k, v = (jax.random.normal(key, (b, s, g, d)) for key in keys[1:3])
  causal = jnp.tril(jnp.ones((s, s), bool))[None, None, None]
  # Per row: causal, some keys dropped in each row (never a query's own).
  dropped = jax.random.bernoulli(keys[4], 0.4, (b, 1, 1, 1, s)) & ~jnp.eye(s, dtype=bool)
  mask = {None: None, "causal": causal, "per_row": causal & ~dropped}[masked]
  rows_seen = []
  block_forward = attention._grouped_block_forward  # pylint: disable=protected-access
  monkeypatch.setattr(attention, "_grouped_block_forward",
                      lambda q, *a: rows_seen.append(q.shape[0]) or block_forward(q, *a))
  cotangent = jax.random.normal(keys[3], (b, s, g, r, d))

  def plain(q, k, v, float32=True):
    logits = jnp.einsum("bsgrk,btgk->bgrst", q, k)
    logits = (logits.astype(jnp.float32) if float32 else logits) / 2.0
    if mask is not None:
      logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    return jnp.einsum("bgrst,btgk->bsgrk", jax.nn.softmax(logits, axis=-1), v)

  grouped = lambda q, k, v: attention.grouped_attention(q, k, v, mask, 2.0)
  if query_block > s:
    np.testing.assert_array_equal(jax.jit(grouped)(q, k, v), jax.jit(plain)(q, k, v))
  else:
    exact_out = numerics.float64_reference(
        jax.jit(lambda q, k, v: plain(q, k, v, float32=False)), q, k, v)
    numerics.assert_as_close_as_plain(jax.jit(grouped)(q, k, v), jax.jit(plain)(q, k, v),
                                      exact_out, what="outputs")
  vjp_of = lambda fn: (lambda q, k, v, g: jax.vjp(fn, q, k, v)[1](g))
  exact = numerics.float64_reference(
      jax.jit(vjp_of(lambda q, k, v: plain(q, k, v, float32=False))), q, k, v, cotangent)
  numerics.assert_as_close_as_plain(jax.jit(vjp_of(grouped))(q, k, v, cotangent),
                                    jax.jit(vjp_of(plain))(q, k, v, cotangent), exact,
                                    what="gradients")
  assert set(rows_seen) == ({b} if query_block > s else {1}), rows_seen


@pytest.mark.parametrize("expert", [1, 4])
def test_llama_blocks_attend_in_query_blocks_inside_a_fused_pipeline(expert, monkeypatch):
  """Llama blocks in a 1F1B pipeline (inside ``shard_map``, the backward by units): the loss
  gradients with queries in blocks of 4 equal the unblocked ones (the numerics rule against the
  float64 unblocked model). With an expert axis of 4 beside the 2 stages, a micro-batch's 2 rows
  split over the 4 devices by rows and positions (a piece of 4 queries per device), and no
  collective in the step waits for another stage's devices."""
  import tpipe  # pylint: disable=g-import-not-at-top
  from tpipe.tools import analysis  # pylint: disable=g-import-not-at-top
  from tpipe.train import blocks  # pylint: disable=g-import-not-at-top

  class Loss(nn.Module):
    @nn.compact
    def __call__(self, h, targets):
      return jnp.mean((h - targets) ** 2, axis=(1, 2))

  block = blocks.LlamaBlock(width=8, num_heads=4, num_kv_heads=2, mlp_dim=16, rope_theta=1e4)
  mesh = tpipe.make_mesh(stages=2, expert=expert)
  model = tpipe.Sequential([tpipe.Repeat(block, 2), Loss()], num_stages=2, num_microbatches=2,
                           schedule="1f1b", balance=[1, 2], per_example=("targets",), mesh=mesh)
  x = jax.random.normal(jax.random.key(0), (4, 8, 8))
  targets = jax.random.normal(jax.random.key(1), (4, 8, 8))
  params = model.init(jax.random.key(2), x, targets=targets, method="initialize")["params"]

  def grad_fn():  # A new function each time, so each call traces afresh.
    return jax.jit(lambda p, x, t: jax.grad(
        lambda p: model.apply({"params": p}, x, targets=t, method="loss"))(p))

  unblocked = grad_fn()(params, x, targets)
  exact = numerics.float64_reference(grad_fn(), params, x, targets)
  monkeypatch.setattr(attention, "QUERY_BLOCK", 4)
  blocks_seen = []
  block_forward = attention._grouped_block_forward  # pylint: disable=protected-access
  monkeypatch.setattr(attention, "_grouped_block_forward",
                      lambda q, *a: blocks_seen.append(q.shape[1]) or block_forward(q, *a))
  compiled = grad_fn().lower(params, x, targets).compile()
  assert not analysis.cross_branch_collectives(compiled, mesh)
  blocked = compiled(params, x, targets)
  # Two blocks of 4 queries per row, or one piece of 4 per device.
  assert blocks_seen and set(blocks_seen) == {4}, blocks_seen
  numerics.assert_as_close_as_plain(blocked, unblocked, exact, what="gradients")


@pytest.mark.parametrize("rows_per_stage,query_block", [(8, 512), (8, 2), (2, 2)])
def test_rows_split_over_an_expert_axis_attend_where_they_are(rows_per_stage, query_block,
                                                              monkeypatch):
  """Inside a stage whose rows split over its ``expert`` axis (stage 2 x expert 4, manual over
  stage): grouped attention one block of queries at a time loops over each device's own rows,
  one row per device at a step, so the program gathers no row from another device (the same
  collectives as attending the whole sequence at once: none). With 2 rows over the 4 devices,
  each row's queries split over its two devices, one piece per device at a step, and the only
  collectives are the two devices' exchanges of the row's keys and values (and their
  gradients) over ``expert``, no query gathered. Outputs and gradients are the plain
  composition's (the numerics rule)."""
  import tpipe  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from tpipe.core.base import spmd  # pylint: disable=g-import-not-at-top
  from tpipe.tools import analysis  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(attention, "QUERY_BLOCK", query_block)
  mesh = tpipe.make_mesh(stages=2, expert=4)
  b, s, g, r, d = 2 * rows_per_stage, 8, 2, 4, 4
  keys = jax.random.split(jax.random.key(5), 4)
  q = jax.random.normal(keys[0], (b, s, g, r, d))
  k, v = (jax.random.normal(key, (b, s, g, d)) for key in keys[1:3])
  cotangent = jax.random.normal(keys[3], (b, s, g, r, d))
  causal = jnp.tril(jnp.ones((s, s), bool))  # [s, t], or broadcast at full rank.
  causal = causal if rows_per_stage < 4 else causal[None, None, None]
  rows_seen = []
  block_forward = attention._grouped_block_forward  # pylint: disable=protected-access
  monkeypatch.setattr(attention, "_grouped_block_forward",
                      lambda q, *a: rows_seen.append(q.shape[:2]) or block_forward(q, *a))

  def in_stage(fn):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("stage"), out_specs=P("stage"),
                                 axis_names={"stage"}))

  split = lambda xs: tuple(spmd.split_over_expert(x, 4) for x in xs)

  def grouped(q, k, v, g):  # Split over expert as a stage's layers split their activations.
    q, k, v, g = split((q, k, v, g))
    out, vjp = jax.vjp(lambda q, k, v: attention.grouped_attention(q, k, v, causal, 2.0),
                       q, k, v)
    # Handed back split as they came, rows and positions flattened: a program's outputs split
    # over one mesh axis by two of their dimensions would be gathered whole at its end.
    return tuple(x.reshape(x.shape[0] * x.shape[1], -1) for x in split((out, *vjp(g))))

  def plain(q, k, v, g, float32=True):
    def forward(q, k, v):
      logits = jnp.einsum("bsgrk,btgk->bgrst", q, k)
      logits = (logits.astype(jnp.float32) if float32 else logits) / 2.0
      logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
      return jnp.einsum("bgrst,btgk->bsgrk", jax.nn.softmax(logits, axis=-1), v)
    out, vjp = jax.vjp(forward, q, k, v)
    return out, *vjp(g)

  compiled = in_stage(grouped).lower(q, k, v, cotangent).compile()
  got = tuple(x.reshape(like.shape)
              for x, like in zip(compiled(q, k, v, cotangent), (q, q, k, v)))
  # Rows and queries a block attends: the stage's whole sequence at once, or a block of the
  # queries of one row (or one row's piece) per device.
  assert set(rows_seen) == ({(rows_per_stage, s)} if query_block > s else {(4, query_block)})
  collectives = analysis.collectives(compiled, mesh)
  if rows_per_stage >= 4:
    assert not collectives, collectives
  else:  # The row's keys and values gathered once each, their gradients summed once each.
    row_of_keys = s * g * d * 4  # One row's keys (or values) in float32.
    assert collectives and all(c.axes == ("expert",) for c in collectives), collectives
    assert sum(c.bytes * c.count for c in collectives) <= 4 * row_of_keys, collectives
  exact = numerics.float64_reference(jax.jit(lambda *a: plain(*a, float32=False)),
                                     q, k, v, cotangent)
  numerics.assert_as_close_as_plain(got, jax.jit(plain)(q, k, v, cotangent), exact,
                                    what="outputs and gradients")
