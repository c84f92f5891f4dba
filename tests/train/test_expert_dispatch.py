"""The explicit all-to-all dispatch of a mixture-of-experts layer's tokens
(:mod:`tpipe.train.expert_dispatch`) on a mesh with an expert axis: its pair outputs and their
gradients against every pair run through its expert in turn, its program's collectives, and the
settings it refuses by name. (Through a pipeline under every schedule: tests/train/test_moe.py.)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpipe
from tests.helpers import moe_models as mm
from tests.helpers import numerics
from tpipe.tools import analysis
from tpipe.train import expert_dispatch
from tpipe.train import moe

TOKENS, WIDTH, HIDDEN, EXPERTS, TOP_K = 32, 6, 5, 8, 2


def _case(seed=0, skewed=False):
  rng = np.random.default_rng(seed)
  tokens = rng.standard_normal((TOKENS, WIDTH))
  if skewed:  # Every pair to experts 0 and 1, both on the first expert device.
    experts = np.tile([0, 1], (TOKENS, 1))
  else:
    experts = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(TOKENS)])
  shapes = ((EXPERTS, WIDTH, HIDDEN), (EXPERTS, WIDTH, HIDDEN), (EXPERTS, HIDDEN, WIDTH))
  weights = [rng.standard_normal(s) * 0.5 for s in shapes]
  return tokens, experts.astype(np.int32), weights


def _loss(pairs_fn, experts):
  # A nonlinear readout, so every pair's gradient differs.
  return lambda t, a, b, c: jnp.sum(jnp.sin(pairs_fn(t, experts, a, b, c)))


# One exchange, and the rows in parts (each its own exchange), with spread and skewed routing.
@pytest.mark.parametrize("skewed,chunks", [(False, 1), (True, 1), (False, 2), (True, 4)])
def test_the_exchange_equals_each_pair_through_its_expert(skewed, chunks):
  mesh = tpipe.make_mesh(stages=1, expert=4)
  tokens, experts, weights = _case(skewed=skewed)
  args32 = [jnp.asarray(a, jnp.float32) for a in (tokens, *weights)]
  grad = lambda fn: jax.value_and_grad(_loss(fn, experts), argnums=(0, 1, 2, 3))
  exchange = functools.partial(expert_dispatch.expert_outputs, chunks=chunks)
  with jax.set_mesh(mesh):
    assert expert_dispatch.devices_here() == 4
    placed = [jax.device_put(a, NamedSharding(mesh, P("expert"))) for a in args32]
    compiled = jax.jit(grad(exchange)).lower(*placed).compile()
    value, grads = compiled(*placed)
  plain = jax.jit(grad(mm.each_pair_in_turn))(*args32)
  reference = numerics.float64_reference(grad(mm.each_pair_in_turn), *args32)
  numerics.assert_as_close_as_plain(value, plain[0], reference[0], what="value")
  numerics.assert_as_close_as_plain(grads, plain[1], reference[1], what="gradients")
  kinds = [c.kind for c in analysis.collectives(compiled, mesh)]
  # Tokens and their experts' ids there, outputs back; the gradients' way back and forth: per
  # part.
  assert kinds.count("all-to-all") >= 5 * chunks
  assert "all-gather" not in kinds and "collective-permute" not in kinds


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_capacity_drops_under_the_exchange_the_pairs_it_drops_in_one_batch(chunks):
  """With a capacity, the pairs beyond each expert's slots (claimed best choices first, tokens
  in order, whichever device holds them) join no expert's group: their outputs are zero and
  their gradients too; the others equal each pair through its expert. Exchanged in parts, the
  same pairs drop (they are chosen over all the rows before the exchange)."""
  mesh = tpipe.make_mesh(stages=1, expert=4)
  tokens, experts, weights = _case(seed=1)
  capacity = moe.capacity_of(TOKENS, TOP_K, EXPERTS, 0.5)
  kept = np.asarray(moe.kept_pairs(jnp.asarray(experts), EXPERTS, capacity))
  want = np.zeros_like(kept)
  taken = np.zeros(EXPERTS, int)
  for j in range(TOP_K):
    for n in range(TOKENS):
      want[n, j] = taken[experts[n, j]] < capacity
      taken[experts[n, j]] += 1
  np.testing.assert_array_equal(kept, want)
  assert 0 < (~kept).sum() < kept.size
  args32 = [jnp.asarray(a, jnp.float32) for a in (tokens, *weights)]
  masked = lambda t, e, a, b, c: mm.each_pair_in_turn(t, e, a, b, c) * kept[..., None]
  exchange = lambda t, e, a, b, c: expert_dispatch.expert_outputs(t, e, a, b, c, kept=kept,
                                                                  chunks=chunks)
  grad = lambda fn: jax.value_and_grad(_loss(fn, experts), argnums=(0, 1, 2, 3))
  with jax.set_mesh(mesh):
    placed = [jax.device_put(a, NamedSharding(mesh, P("expert"))) for a in args32]
    value, grads = jax.jit(grad(exchange))(*placed)
    pairs = jax.jit(lambda *a: exchange(a[0], experts, *a[1:]))(*placed)
  assert not np.any(np.asarray(pairs)[~kept])  # Dropped: exactly zero.
  plain = jax.jit(grad(masked))(*args32)
  reference = numerics.float64_reference(grad(masked), *args32)
  numerics.assert_as_close_as_plain(value, plain[0], reference[0], what="value")
  numerics.assert_as_close_as_plain(grads, plain[1], reference[1], what="gradients")


def test_the_layer_with_a_capacity_drops_and_counts_the_same_pairs_either_dispatch():
  """A MixtureOfExperts with a capacity on an expert axis: the explicit exchange gives the
  partitioner's (batched ``[E, C]``) output and counts the same dropped pairs."""
  mesh = tpipe.make_mesh(stages=1, expert=4)
  x = jax.random.normal(jax.random.key(1), (4, 8, WIDTH))
  settings = dict(hidden=HIDDEN, num_experts=EXPERTS, experts_per_token=TOP_K,
                  capacity_factor=0.5)
  layer = moe.MixtureOfExperts(dispatch="partitioner", **settings)
  params = layer.init(jax.random.key(2), x)["params"]
  outs = {}
  with jax.set_mesh(mesh):
    for dispatch in ("partitioner", "all_to_all"):
      run = moe.MixtureOfExperts(dispatch=dispatch, **settings).apply
      step = jax.jit(lambda p, x, run=run: run({"params": p}, x, mutable="aux_metric"))
      compiled = step.lower(params, x).compile()
      kinds = {c.kind for c in analysis.collectives(compiled, mesh)}
      assert ("all-to-all" in kinds) == (dispatch == "all_to_all"), (dispatch, kinds)
      out, metrics = compiled(params, x)
      outs[dispatch] = out, metrics["aux_metric"]
  np.testing.assert_allclose(outs["all_to_all"][0], outs["partitioner"][0], rtol=1e-5,
                             atol=1e-5)
  metrics, want = outs["all_to_all"][1], outs["partitioner"][1]
  assert set(metrics) == {"dropped", "expert_load"} and float(want["dropped"][0]) > 0
  for name in want:
    np.testing.assert_allclose(metrics[name], want[name], rtol=1e-6)


def test_outside_a_mesh_with_an_expert_axis_there_is_one_device():
  assert expert_dispatch.devices_here() == 1
  with jax.set_mesh(tpipe.make_mesh(stages=2, data=2)):
    assert expert_dispatch.devices_here() == 1


def test_tokens_the_expert_axis_does_not_divide_are_refused_by_name():
  with pytest.raises(ValueError, match=r"splits the 30 tokens .* over the 4 devices of the "
                     r"'expert' axis, which does not divide them"):
    expert_dispatch.check_tokens(30, 4)
  mesh = tpipe.make_mesh(stages=1, expert=4)
  tokens, experts, weights = _case()
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="splits the 30 tokens"):
    jax.eval_shape(expert_dispatch.expert_outputs, tokens[:30], experts[:30], *weights)


def test_an_expert_axis_beside_a_tensor_axis_is_refused_by_name():
  tokens, experts, weights = _case()
  match = (r"dispatch='all_to_all' runs on an 'expert' axis with no other axis .* has "
           r"tensor=2 beside it")
  with jax.set_mesh(tpipe.make_mesh(stages=1, expert=2, tensor=2)):
    with pytest.raises(ValueError, match=match):
      jax.eval_shape(expert_dispatch.expert_outputs, tokens, experts, *weights)


def test_parts_that_do_not_divide_a_devices_tokens_are_refused_by_name():
  with pytest.raises(ValueError, match=r"exchange_chunks=3 parts do not divide the 8 tokens "
                     r"each device of the 'expert' axis routes; use a divisor of 8"):
    expert_dispatch.check_chunks(3, rows=8)
  tokens, experts, weights = _case()
  with jax.set_mesh(tpipe.make_mesh(stages=1, expert=4)):
    with pytest.raises(ValueError, match="exchange_chunks=16 parts do not divide the 8"):
      jax.eval_shape(functools.partial(expert_dispatch.expert_outputs, chunks=16), tokens,
                     experts, *weights)


@pytest.mark.unit
@pytest.mark.parametrize("kwargs,match", [
    (dict(dispatch="ragged"), r"dispatch must be one of \('partitioner', 'all_to_all'\), "
                              r"got 'ragged'"),
    (dict(dispatch="all_to_all", exchange_chunks=0), r"exchange_chunks must be an int >= 1 "
                                                     r"\(1: one exchange\), got 0"),
    (dict(dispatch="all_to_all", exchange_chunks=2.0), r"exchange_chunks must be an int >= 1"),
    (dict(exchange_chunks=2), r"exchange_chunks=2 splits the explicit all-to-all, and "
                              r"dispatch='partitioner' has none; use dispatch='all_to_all'"),
])
def test_bad_dispatch_settings_are_refused_by_name(kwargs, match):
  settings = dict(num_experts=4, experts_per_token=2, capacity_factor=0.0)
  settings.update(kwargs)
  with pytest.raises(ValueError, match=match):
    moe.check_routing(**settings)
  with pytest.raises(ValueError, match=match):
    moe.MixtureOfExperts(hidden=4, **settings).init(jax.random.key(0), jnp.ones((2, 3)))
