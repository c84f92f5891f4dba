"""The RNG rule of :mod:`tpipe.core.base.layers`, checked against the layers run one by one.

The rule: a pipelined call gets one key ``K`` per random stream; unit ``u`` (0-based over all
units, a ``Repeat`` of n counting n, :func:`tpipe.core.planning.plan.group_units`) on global
micro-batch
``m`` (micro-batch ``i`` of data replica ``d`` is ``m = d * M + i``: the batch's ``m``-th block of
rows) runs with ``k = fold_in(fold_in(K, u), m)``, a linen layer with ``rngs={name: k}``. For
:meth:`tpipe.core.engine.PlannedPipeline.apply` ``K`` is the key passed; for
``tpipe.Sequential`` it is ``self.make_rng(name)``, drawn once per call.

The model is a few dense layers with ``nn.Dropout`` (``deterministic=False``), one a
``tpipe.Repeat``. Its activation is ``{"h": features, "seen": int32}``: each unit doubles
``seen`` and adds where its dropout kept ``h``, so ``seen`` holds every unit's mask of every
example, one bit per unit, exactly. The expected result runs the layers in order on each
micro-batch with the keys the rule gives; the masks must be equal exactly, the features as close
as the plain model's (numerics rule: :mod:`tests.helpers.numerics`). The dropout rate is a
float32 scalar, so ``jax.random.bernoulli`` draws float32 uniforms and the masks of the float64
reference are the float32 run's (with a Python float they would be drawn in float64, from other
bits). Then the same model under other layouts (stages, chunks per stage, schedule, balance,
remat) gives the same masks and features, since none of them enters the rule.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpipe
from tpipe.core.layout import staging
from tests.helpers import numerics

WIDTH, BATCH = 8, 12
# float32, not a Python float: the masks do not depend on jax_enable_x64 (see above).
RATE = np.float32(0.5)


class DenseDropout(nn.Module):
  """``h -> dropout(tanh(Dense(h)))``, recording the dropout mask as one bit of ``seen``."""

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(WIDTH)(x["h"]))
    h = nn.Dropout(RATE, deterministic=False)(h)
    return {"h": h, "seen": 2 * x["seen"] + (h != 0).astype(jnp.int32)}


LAYERS = [DenseDropout(), tpipe.Repeat(DenseDropout(), 3), DenseDropout()]
UNITS = 5


class FirstKey(nn.Module):
  """Draws ``make_rng("dropout")`` once at the root of a call, as ``tpipe.Sequential`` does."""

  @nn.compact
  def __call__(self):
    return self.make_rng("dropout")


def _model(stages=2, microbatches=3, data=2, **settings):
  mesh = tpipe.make_mesh(stages=stages, data=data)
  return tpipe.Sequential(LAYERS, num_stages=stages, num_microbatches=microbatches, mesh=mesh,
                          **settings), mesh


@functools.cache
def _inputs():
  k1, k2 = jax.random.split(jax.random.key(0))
  x = {"h": jax.random.normal(k1, (BATCH, WIDTH)), "seen": jnp.zeros((BATCH, WIDTH), jnp.int32)}
  model, _ = _model(stages=1, microbatches=1, data=1)
  params = model.init({"params": k2, "dropout": k2}, x)["params"]
  return params, x


def _layers_in_order(params, x, key, microbatches, rule=None):
  """The layers one by one on ``microbatches`` contiguous micro-batches (global micro-batch
  ``m`` is the ``m``-th), unit ``u`` on micro-batch ``m`` with ``rngs={"dropout": rule(key, u,
  m)}``, by default the documented rule."""
  rule = rule or (lambda key, u, m: jax.random.fold_in(jax.random.fold_in(key, u), m))

  def one_microbatch(m_and_h):
    m, h = m_and_h
    u = 0
    for i, layer in enumerate(LAYERS):
      p = params[f"layers_{i}"]
      if isinstance(layer, tpipe.Repeat):
        copies = [(layer.module, jax.tree.map(lambda a, j=j: a[j], p)) for j in range(layer.n)]
      else:
        copies = [(layer, p)]
      for module, one in copies:
        h = module.apply({"params": one}, h, rngs={"dropout": rule(key, u, m)})
        u += 1
    assert u == UNITS
    return h

  split = jax.tree.map(lambda a: a.reshape((microbatches, -1) + a.shape[1:]), x)
  out = jax.lax.map(one_microbatch, (jnp.arange(microbatches), split))
  return jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), out)


MICROBATCHES = 3 * 2  # per replica, times the replicas: global micro-batches


def _call_key(seed):
  """``K`` of a ``tpipe.Sequential`` call given ``rngs={"dropout": key(seed)}``: the root's first
  ``make_rng("dropout")``."""
  return FirstKey().apply({}, rngs={"dropout": jax.random.key(seed)})


@functools.cache
def _expected(seed, linen_call=False):
  """The layers in order by the rule, with ``K = key(seed)`` (or, for ``linen_call``, the K of a
  linen call given that key): the plain float32 result and its float64 reference."""
  params, x = _inputs()
  key = _call_key(seed) if linen_call else jax.random.key(seed)
  run = jax.jit(lambda p, x, data: _layers_in_order(p, x, jax.random.wrap_key_data(data),
                                                    MICROBATCHES))
  data = jax.random.key_data(key)
  plain = run(params, x, data)
  reference = numerics.float64_reference(run, params, x, data)
  # The reference drew the same masks (float32 rate).
  np.testing.assert_array_equal(np.asarray(plain["seen"]), np.asarray(reference["seen"]))
  return plain, reference


def _assert_follows_the_rule(got, seed, what, linen_call=False):
  """Every unit's mask of every example exactly, the features to rounding."""
  plain, reference = _expected(seed, linen_call)
  np.testing.assert_array_equal(np.asarray(got["seen"]), np.asarray(plain["seen"]),
                                err_msg=f"{what}: dropout masks")
  numerics.assert_as_close_as_plain(got["h"], plain["h"], reference["h"], what=f"{what} outputs")


def _linen_call(model, mesh, seed):
  params, x = _inputs()
  run = jax.jit(lambda p, x, key: model.apply({"params": p}, x, rngs={"dropout": key}))
  return run(params, jax.device_put(x, tpipe.data_sharding(mesh)), jax.random.key(seed))


@functools.cache
def _default_engine_call(seed):
  """``_engine_call`` of the default layout, run once per seed for the tests that read it."""
  return _engine_call(*_model(), seed)


def _engine_call(model, mesh, seed):
  params, x = _inputs()
  pipeline = model.pipeline_for(x, rng_names=("dropout",))
  run = jax.jit(lambda staged, x, key: pipeline.apply(staged, x, rngs={"dropout": key}))
  return run(staging.to_staged(pipeline.layout, params),
             jax.device_put(x, tpipe.data_sharding(mesh)), jax.random.key(seed))


def test_the_model_draws_a_mask_per_unit_and_microbatch():
  """The checks below can fail: masks differ between units and between micro-batches."""
  plain, _ = _expected(1)
  seen = np.asarray(plain["seen"])
  bits = [(seen >> (UNITS - 1 - u)) & 1 for u in range(UNITS)]  # unit u's mask
  assert all(0.2 < b.mean() < 0.8 for b in bits), [b.mean() for b in bits]
  assert all(not np.array_equal(bits[0], b) for b in bits[1:])
  rows = BATCH // MICROBATCHES
  blocks = [seen[m * rows:(m + 1) * rows] for m in range(MICROBATCHES)]
  assert all(not np.array_equal(blocks[0], b) for b in blocks[1:])


def test_pipeline_apply_uses_the_key_passed_as_k():
  _assert_follows_the_rule(_default_engine_call(1), 1, "PlannedPipeline.apply")


def test_sequential_draws_k_with_make_rng_once_per_call():
  model, mesh = _model()
  got = _linen_call(model, mesh, 2)
  _assert_follows_the_rule(got, 2, "tpipe.Sequential", linen_call=True)
  # K is not the key passed itself: the rule run on that key gives other masks.
  assert not np.array_equal(np.asarray(got["seen"]), np.asarray(_expected(2)[0]["seen"]))


def test_the_comparison_is_sharp_for_another_fold_order():
  """Folding the micro-batch in first (another rule) gives other masks."""
  got = _default_engine_call(1)
  params, x = _inputs()
  swapped = lambda key, u, m: jax.random.fold_in(jax.random.fold_in(key, m), u)
  other = jax.jit(functools.partial(_layers_in_order, microbatches=MICROBATCHES, rule=swapped))(
      params, x, jax.random.key(1))
  assert not np.array_equal(np.asarray(got["seen"]), np.asarray(other["seen"]))


# Other layouts of the same model, micro-batches and replicas: stages, chunks per stage and
# their placement, schedule (fused ones return their forward pass's outputs), balance, remat.
# A covering set (each layout compiles its own call): each change at least once, two at a time.
LAYOUTS = {
    "4 stages, 1f1b": dict(stages=4, schedule="1f1b"),
    "explicit balance, remat per layer": dict(balance=[1, 4], remat="none",
                                              remat_granularity="layer"),
    "circular": dict(schedule="circular", num_repeats=2),
    "zbv": dict(schedule="zbv", num_repeats=2),
}


@pytest.fixture(scope="module")
def default_layout_outputs():
  """The outputs of the default layout (2 stages, GPipe, balanced by parameters)."""
  return _linen_call(*_model(), 3)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_outputs_do_not_depend_on_the_layout(layout, default_layout_outputs):
  got = _linen_call(*_model(**LAYOUTS[layout]), 3)
  # The same masks as the default layout, exactly; the same outputs as the rule's, to rounding.
  np.testing.assert_array_equal(np.asarray(got["seen"]),
                                np.asarray(default_layout_outputs["seen"]),
                                err_msg=f"{layout}: dropout masks")
  _assert_follows_the_rule(got, 3, layout, linen_call=True)
  _assert_follows_the_rule(default_layout_outputs, 3, "default layout", linen_call=True)
