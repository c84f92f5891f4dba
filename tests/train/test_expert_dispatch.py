"""The explicit all-to-all dispatch of a mixture-of-experts layer's tokens
(:mod:`tpipe.train.expert_dispatch`) on a mesh with an expert axis: its pair outputs and their
gradients against every pair run through its expert in turn, its program's collectives, and the
settings it refuses by name. (Through a pipeline under every schedule: tests/train/test_moe.py.)"""

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


@pytest.mark.parametrize("skewed", [False, True])
def test_the_exchange_equals_each_pair_through_its_expert(skewed):
  mesh = tpipe.make_mesh(stages=1, expert=4)
  tokens, experts, weights = _case(skewed=skewed)
  args32 = [jnp.asarray(a, jnp.float32) for a in (tokens, *weights)]
  grad = lambda fn: jax.value_and_grad(_loss(fn, experts), argnums=(0, 1, 2, 3))
  with jax.set_mesh(mesh):
    assert expert_dispatch.devices_here() == 4
    placed = [jax.device_put(a, NamedSharding(mesh, P("expert"))) for a in args32]
    compiled = jax.jit(grad(expert_dispatch.expert_outputs)).lower(*placed).compile()
    value, grads = compiled(*placed)
  plain = jax.jit(grad(mm.each_pair_in_turn))(*args32)
  reference = numerics.float64_reference(grad(mm.each_pair_in_turn), *args32)
  numerics.assert_as_close_as_plain(value, plain[0], reference[0], what="value")
  numerics.assert_as_close_as_plain(grads, plain[1], reference[1], what="gradients")
  kinds = [c.kind for c in analysis.collectives(compiled, mesh)]
  # Tokens and their experts' ids there, outputs back; the gradients' way back and forth.
  assert kinds.count("all-to-all") >= 5
  assert "all-gather" not in kinds and "collective-permute" not in kinds


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


@pytest.mark.unit
@pytest.mark.parametrize("kwargs,match", [
    (dict(dispatch="ragged"), r"dispatch must be one of \('partitioner', 'all_to_all'\), "
                              r"got 'ragged'"),
    (dict(dispatch="all_to_all", capacity_factor=1.0),
     r"dispatch='all_to_all' routes dropless only, got capacity_factor=1.0"),
])
def test_bad_dispatch_settings_are_refused_by_name(kwargs, match):
  settings = dict(num_experts=4, experts_per_token=2, capacity_factor=0.0)
  settings.update(kwargs)
  with pytest.raises(ValueError, match=match):
    moe.check_routing(**settings)
  with pytest.raises(ValueError, match=match):
    moe.MixtureOfExperts(hidden=4, **settings).init(jax.random.key(0), jnp.ones((2, 3)))
