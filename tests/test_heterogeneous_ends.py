"""A GPT with its ends on one stage each, through both front ends, equals its layers in order.

The model: an embedding (first chunk only), a ``Repeat`` of attention blocks (a causal mask
broadcast to every layer), and a head with its per-example loss (last chunk only). The blocks are
cut evenly (``balance`` gives every chunk ``k`` blocks, the first and last one unit more), so
every block is a stacked leaf and the middle stages hold no packed leaves at all, while the
first and last chunks pack the ends: the layout where staging once failed for NNX
(``lax.switch`` branches that differed in whether their buffers varied over ``stage``).

Every schedule (with the repeats it needs) through each of the two front ends
(``tpipe.Sequential`` and ``tpipe.nnx.Sequential``), at 1, 2, 3 or 4 stages with data 1 or 2: the
mean loss and its parameter gradients against the layers run in order (the numerics rule of
:mod:`tests.helpers.numerics`). The 12 cases are one per (front end, schedule) pair, chosen so
that every front end meets every stage count and both data sizes, every (stages, data) pair runs,
every schedule runs with both data sizes and at two stage counts, one of them 3 or 4 (where middle
stages hold no packed leaves), and ZB-V runs at 4 stages
(:func:`test_the_cases_cover_every_pairing`): the whole cross product (96 compiled programs) would
repeat the same staging many times over. Per-example outputs are checked at 4 stages (through
both front ends).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import tpipe
from tests.helpers import numerics
from tpipe import nnx as tnnx

WIDTH, VOCAB, SEQ, HEADS = 8, 11, 4, 2
BLOCKS = 24  # Divisible by every S * R below: 1, 2, 3, 4, 6, 8.
BATCH, MICROBATCHES = 8, 4
SCHEDULES = {"gpipe": 1, "circular": 2, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1, "zbv": 2}
FRONT_ENDS = ("linen", "nnx")


# ------------------------------------------------------------------------------------------------
# The layers, in linen and in NNX.

class LinenBlock(nn.Module):

  @nn.compact
  def __call__(self, x, mask):
    x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(nn.LayerNorm()(x), mask=mask)
    return x + nn.Dense(WIDTH)(nn.gelu(nn.Dense(2 * WIDTH)(nn.LayerNorm()(x))))


class LinenHead(nn.Module):

  @nn.compact
  def __call__(self, x, targets):
    logits = nn.Dense(VOCAB)(nn.RMSNorm()(x))
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(-1)


class NNXBlock(nnx.Module):

  def __init__(self, *, rngs):
    self.ln1 = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=WIDTH, decode=False,
                                       rngs=rngs)
    self.ln2 = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.up = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs)
    self.down = nnx.Linear(2 * WIDTH, WIDTH, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.ln1(x), mask=mask)
    return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class NNXEmbed(nnx.Module):
  """Token ids -> vectors in the table's dtype (``nnx.Embed`` computes in float32, which would
  make the float64 reference float32 here)."""

  def __init__(self, *, rngs):
    self.table = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, WIDTH)))

  def __call__(self, tokens):
    return self.table[...][tokens]


class NNXHead(nnx.Module):

  def __init__(self, *, rngs):
    self.norm = nnx.RMSNorm(WIDTH, rngs=rngs)
    self.out = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

  def __call__(self, x, targets):
    logits = self.out(self.norm(x))
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(-1)


def _inputs():
  k1, k2 = jax.random.split(jax.random.key(7))
  tokens = jax.random.randint(k1, (BATCH, SEQ), 0, VOCAB)
  targets = jax.random.randint(k2, (BATCH, SEQ), 0, VOCAB)
  mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))
  return tokens, {"targets": targets, "mask": mask}


def _balance(chunks: int) -> list[int]:
  """Every chunk ``k`` blocks; the embedding joins the first, the head the last."""
  k = BLOCKS // chunks
  counts = [k] * chunks
  counts[0] += 1
  counts[-1] += 1
  return counts


def _nnx_layers():
  rngs = nnx.Rngs(0)
  return [NNXEmbed(rngs=rngs),
          tnnx.Repeat(lambda r: NNXBlock(rngs=r), BLOCKS, rngs=rngs), NNXHead(rngs=rngs)]


def _linen_layers():
  return [nn.Embed(VOCAB, WIDTH), tpipe.Repeat(LinenBlock(), BLOCKS), LinenHead()]


def _settings(schedule, stages, data):
  repeats = SCHEDULES[schedule]
  return dict(num_stages=stages, num_microbatches=MICROBATCHES, schedule=schedule,
              num_repeats=repeats, balance=_balance(stages * repeats),
              per_example=("targets",), mesh=tpipe.make_mesh(stages=stages, data=data))


# ------------------------------------------------------------------------------------------------
# The layers in order (the plain model), on the pipeline's micro-batches or the whole batch.

def _in_order(embed, block, head, params, tokens, kwargs, microbatches):
  """Per-example losses of the layers applied in order: ``embed(p0, tokens)``, then
  ``block(p, h, mask)`` for each of the stacked copies in ``params[1]``, then ``head``."""

  def run(chunk):
    tokens, targets = chunk
    h = embed(params[0], tokens)
    h, _ = jax.lax.scan(lambda h, p: (block(p, h, kwargs["mask"]), None), h, params[1])
    return head(params[2], h, targets)

  split = lambda a: a.reshape(microbatches, -1, *a.shape[1:])
  return jax.lax.map(run, (split(tokens), split(kwargs["targets"]))).reshape(-1)


@functools.cache
def _linen_params():
  model = tpipe.Sequential(_linen_layers(), num_stages=1, num_microbatches=1,
                           per_example=("targets",))
  tokens, kwargs = _inputs()
  variables = model.init(jax.random.key(0), tokens, method="initialize", **kwargs)
  return nn.meta.unbox(variables["params"])


def _linen_in_order(params, tokens, kwargs, microbatches):
  embed, block, head = (layer.module if isinstance(layer, tpipe.Repeat) else layer
                        for layer in _linen_layers())
  ordered = [params[f"layers_{i}"] for i in range(3)]
  return _in_order(lambda p, t: embed.apply({"params": p}, t),
                   lambda p, h, m: block.apply({"params": p}, h, m),
                   lambda p, h, t: head.apply({"params": p}, h, t),
                   ordered, tokens, kwargs, microbatches)


@functools.cache
def _nnx_graphdefs():
  return tuple(nnx.split(layer.layer if isinstance(layer, tnnx.Repeat) else layer, nnx.Param)[0]
               for layer in _nnx_layers())


@functools.cache
def _nnx_params():
  """The NNX layers' Param state, as ``tpipe.nnx.Sequential.variables()`` names it."""
  model = tnnx.Sequential(_nnx_layers(), num_stages=1, num_microbatches=1,
                          per_example=("targets",))
  return model.variables()["params"]


def _nnx_in_order(params, tokens, kwargs, microbatches):
  graphdefs = _nnx_graphdefs()
  merge = lambda i, p: nnx.merge(graphdefs[i], nnx.State(p))
  ordered = [params[f"layers_{i}"] for i in range(3)]
  return _in_order(lambda p, t: merge(0, p)(t), lambda p, h, m: merge(1, p)(h, m),
                   lambda p, h, t: merge(2, p)(h, t), ordered, tokens, kwargs, microbatches)


PLAIN = {"linen": (_linen_params, _linen_in_order), "nnx": (_nnx_params, _nnx_in_order)}


def _objective(loss):
  return loss + 0.5 * loss ** 2  # Nonlinear, so the cotangent reaching the pipeline is not 1.


@functools.cache
def _plain(front_end, microbatches, precision="float32"):
  """``((objective of the mean loss, per-example losses), gradients)`` of the plain model."""
  params, in_order = PLAIN[front_end]

  def fn(params, tokens, kwargs):
    losses = in_order(params, tokens, kwargs, microbatches)
    return _objective(losses.mean()), losses

  fn = jax.jit(jax.value_and_grad(fn, has_aux=True))
  tokens, kwargs = _inputs()
  if precision == "float64":
    return numerics.float64_reference(fn, params(), tokens, kwargs)
  return fn(params(), tokens, kwargs)


# ------------------------------------------------------------------------------------------------
# The pipelined runs.

def _linen_pipelined(settings, tokens, kwargs, outputs: bool):
  model = tpipe.Sequential(_linen_layers(), **settings)
  params = _linen_params()
  objective = jax.jit(jax.value_and_grad(lambda p: _objective(model.apply(
      {"params": p}, tokens, method="loss", **kwargs))))
  (value, grads) = objective(params)
  losses = jax.jit(model.apply)({"params": params}, tokens, **kwargs) if outputs else None
  return value, losses, grads


def _nnx_pipelined(settings, tokens, kwargs, outputs: bool):
  model = tnnx.Sequential(_nnx_layers(), **settings)
  model.load_variables({"params": _nnx_params()})

  @nnx.jit
  def objective(model):
    return nnx.value_and_grad(lambda m: _objective(m.loss(tokens, **kwargs)))(model)

  value, grads = objective(model)
  grads = {f"layers_{i}": g for i, g in nnx.to_pure_dict(grads)["layers"].items()}
  grads["layers_1"] = grads["layers_1"]["layer"]  # The Repeat's stacked copies.
  losses = nnx.jit(lambda m: m(tokens, **kwargs))(model) if outputs else None
  return value, losses, grads


PIPELINED = {"linen": _linen_pipelined, "nnx": _nnx_pipelined}

# (front end, schedule, stages, data): one case per (front end, schedule) pair; see the docstring
# for what they cover.
CASES = [("linen", "gpipe", 1, 1), ("linen", "circular", 3, 2), ("linen", "1f1b", 4, 1),
         ("linen", "interleaved_1f1b", 2, 2), ("linen", "zb_h1", 3, 1), ("linen", "zbv", 4, 2),
         ("nnx", "gpipe", 4, 2), ("nnx", "circular", 2, 1), ("nnx", "1f1b", 1, 2),
         ("nnx", "interleaved_1f1b", 4, 1), ("nnx", "zb_h1", 2, 2), ("nnx", "zbv", 3, 1)]


def test_the_cases_cover_every_pairing():
  assert sorted((f, s) for f, s, _, _ in CASES) == sorted(
      (f, s) for f in FRONT_ENDS for s in SCHEDULES)
  assert {(n, d) for _, _, n, d in CASES} == {(n, d) for n in (1, 2, 3, 4) for d in (1, 2)}
  for front_end in FRONT_ENDS:
    assert {n for f, _, n, _ in CASES if f == front_end} == {1, 2, 3, 4}
    assert {d for f, _, _, d in CASES if f == front_end} == {1, 2}
  for schedule in SCHEDULES:
    stages = {n for _, s, n, _ in CASES if s == schedule}
    assert len(stages) == 2 and max(stages) >= 3, (schedule, stages)
    assert {d for _, s, _, d in CASES if s == schedule} == {1, 2}
  assert ("zbv", 4) in {(s, n) for _, s, n, _ in CASES}
  assert {f for f, _, n, _ in CASES if n == 4} == set(FRONT_ENDS)


@pytest.mark.parametrize("front_end,schedule,stages,data", CASES)
def test_ends_on_one_stage_each_equal_the_layers_in_order(front_end, schedule, stages, data):
  settings = _settings(schedule, stages, data)
  mesh = settings["mesh"]
  tokens, kwargs = jax.device_put(_inputs(), tpipe.data_sharding(mesh))
  kwargs["mask"] = _inputs()[1]["mask"]  # Broadcast to every layer: not split over the rows.
  value, losses, grads = PIPELINED[front_end](settings, tokens, kwargs, outputs=stages == 4)
  (plain_value, plain_losses), plain_grads = _plain(front_end, MICROBATCHES * data)
  (value64, losses64), grads64 = _plain(front_end, 1, "float64")
  numerics.assert_as_close_as_plain(value, plain_value, value64, what="objective")
  numerics.assert_as_close_as_plain(grads, plain_grads, grads64, what="gradients")
  if losses is not None:
    numerics.assert_as_close_as_plain(losses, plain_losses, losses64, what="outputs")


def test_middle_stages_hold_no_packed_leaves():
  """The layout the cases run: at 4 stages, only the first and last chunks pack anything."""
  model = tpipe.Sequential(_linen_layers(), **_settings("gpipe", 4, 1))
  tokens, kwargs = _inputs()
  layout = model.pipeline_for(tokens, **kwargs).layout
  packed = [bool(layout.packed_shapes(c)) for c in range(layout.num_chunks)]
  assert packed == [True, False, False, True]
  assert np.array_equal(sorted(layout.stacked.items()), [(1, BLOCKS // 4)])
