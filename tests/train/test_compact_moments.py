"""Adam's moments of the shared leaves keep their real entries only, split over the stages
(``tpipe.train.compact_moments``), and the optimizer computes exactly what it computed with
moments in the staged form."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from tests.helpers import train_runs
from tpipe.core.layout import shared_leaves
from tpipe.core.layout import description as layout_lib
from tpipe.tools import analysis
from tpipe.train import compact_moments
from tpipe.train.cli import experiment
from tpipe.train.cli import translate

SHARED = layout_lib.SHARED


@pytest.fixture(scope="module")
def exp():
  """The tiny LM on data 2 x stage 4: its embedding and head share one leaf of four entries."""
  return train_runs.lm_experiment()


def _staged(exp, seed):
  """A staged tree of random values, zero in the shared leaves' padding (as the parameters and
  their gradients are)."""
  rng = np.random.RandomState(seed)
  tree = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(s.dtype),
                      exp.layout.staged_shapes())
  (name, leaf), = exp.compact_leaves.items()
  padding = np.ones(leaf.staged_shape[:2], bool)
  for p, s in leaf.entries:
    padding[p, s] = False
  tree[SHARED][name][padding] = 0
  return tree


def test_the_tiny_lms_ends_keep_two_entries_split_over_the_stages(exp):
  (name, leaf), = exp.compact_leaves.items()
  stages = exp.config.num_stages
  assert leaf.entries == ((0, 0), (0, stages - 1))  # The embedding and the head.
  assert leaf.staged_shape[:2] == (1, stages)
  assert leaf.shape == (2,) + leaf.staged_shape[2:]
  assert leaf.spec == P(None, "stage")  # The vocabulary, the first dimension 4 divides.
  state = exp.abstract_state()
  moment = state.opt_state[1].mu[SHARED][name]
  assert moment.shape == leaf.shape and moment.sharding.spec == leaf.spec
  # A device holds half an entry's moments where the staged form gave it a whole entry.
  param = state.params[SHARED][name]
  local = lambda a: np.prod(a.sharding.shard_shape(a.shape))
  assert 2 * local(moment) == local(param)


def test_compact_then_expand_gives_the_staged_tree_back(exp):
  tree = _staged(exp, 0)
  leaves = exp.compact_leaves
  small = compact_moments.compact(tree, leaves)
  assert compact_moments.is_compact(small, leaves) and not compact_moments.is_compact(tree, leaves)
  (name, leaf), = leaves.items()
  for i, (p, s) in enumerate(leaf.entries):
    np.testing.assert_array_equal(small[SHARED][name][i], tree[SHARED][name][p, s])
  back = compact_moments.expand(small, leaves)
  assert jax.tree.structure(back) == jax.tree.structure(tree)
  for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
    np.testing.assert_array_equal(got, want)


def test_the_optimizer_steps_as_with_staged_moments(exp):
  """Three AdamW steps of the trainer's optimizer on the same parameters and gradients: the
  parameters bit for bit those of the optimizer with staged moments, and the moments too."""
  staged_opt = translate.make_optimizer(exp.config, exp.layout)
  compact_opt = exp.optimizer
  params = _staged(exp, 1)
  runs = []
  for opt in (staged_opt, compact_opt):
    p, state = params, opt.init(params)
    for step in range(3):
      grads = _staged(exp, 10 + step)
      updates, state = jax.jit(opt.update)(grads, state, p)
      p = optax.apply_updates(p, updates)
    runs.append((p, state))
  (p_staged, s_staged), (p_compact, s_compact) = runs
  for got, want in zip(jax.tree.leaves(p_compact), jax.tree.leaves(p_staged)):
    np.testing.assert_array_equal(got, want)
  assert compact_moments.is_compact(s_compact[1].mu, exp.compact_leaves)
  for name in ("mu", "nu"):
    expanded = compact_moments.expand(getattr(s_compact[1], name), exp.compact_leaves)
    for got, want in zip(jax.tree.leaves(expanded), jax.tree.leaves(getattr(s_staged[1], name))):
      np.testing.assert_array_equal(got, want)


def test_the_checkpoint_holds_the_moments_in_the_logical_form(exp):
  """to_checkpoint expands the compact moments; from_checkpoint gives them back compact."""
  state = exp.init_state(jax.random.key(0))
  adam = state.opt_state[1]
  (name, leaf), = exp.compact_leaves.items()
  # Moments with the parameters' values: non-zero, and zero in every padding (which the
  # logical form drops).
  moved = compact_moments.compact(state.params, exp.compact_leaves)
  state = state.replace(opt_state=(state.opt_state[0], adam._replace(mu=moved))
                        + tuple(state.opt_state[2:]))
  logical = exp.to_checkpoint(state)
  # The moments hold the parameters' values: in the logical form they equal the parameters',
  # the head's kernel in its own orientation.
  for got, want in zip(jax.tree.leaves(logical.opt_state[1].mu), jax.tree.leaves(logical.params)):
    np.testing.assert_array_equal(got, want)
  back = exp.from_checkpoint(logical)
  assert back.opt_state[1].mu[SHARED][name].shape == leaf.shape
  for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
    np.testing.assert_array_equal(got, want)


def _stub_layout(stages, shape, places, names=("vocab", "embed")):
  """A layout stand-in for :func:`compact_moments.plan`: one shared leaf of ``shape`` holding a
  weight at each ``(slot, stage)`` of ``places``, split over tensor and fsdp by ``names``."""
  slots = 1 + max(p for p, _ in places)
  group = shared_leaves.Group(
      "shared_0", shape, "float32", names, slots,
      tuple(shared_leaves.Member(chunk=s, layer=0, path="['w']", slot=p, transposed=False)
            for p, s in places))
  spec = P(None, "stage", "tensor", "fsdp")
  staged = jax.ShapeDtypeStruct((slots, stages) + shape, np.float32)
  return types.SimpleNamespace(
      shared=(group,), num_stages=stages, position=lambda chunk: (0, chunk),
      partition_specs=lambda stage_axis, mesh: {SHARED: {"shared_0": spec}},
      staged_shapes=lambda: {SHARED: {"shared_0": staged}})


@pytest.mark.unit  # No JAX computation.
@pytest.mark.parametrize("stages, shape, places, spec", [
    (4, (64, 16), [(0, 0), (0, 3)], P(None, ("tensor", "stage"), "fsdp")),  # 64 / (2 x 4).
    (4, (36, 64), [(0, 0), (0, 3)], P(None, "tensor", ("fsdp", "stage"))),  # 36 / 8 no.
    (4, (64, 16), [(0, 0), (1, 0), (0, 2), (1, 3)], P("stage", "tensor", "fsdp")),  # 4 / 4.
    (4, (36, 36), [(0, 0), (0, 3)], None),  # No dimension divisible: staged moments.
    (2, (64, 16), [(0, 0), (0, 1)], None),  # No padding: nothing to gain.
])
def test_plan_adds_the_stage_axis_to_the_first_dimension_it_divides(stages, shape, places, spec):
  mesh = types.SimpleNamespace(shape={"data": 1, "fsdp": 2, "stage": stages, "tensor": 2})
  plan = compact_moments.plan(_stub_layout(stages, shape, places), mesh)
  if spec is None:
    assert plan == {}
  else:
    assert plan["shared_0"].spec == spec
    assert plan["shared_0"].entries == tuple(sorted(places))


def test_a_layout_without_padding_keeps_staged_moments():
  config = train_runs.lm_config()
  config.num_stages, config.num_data, config.num_microbatches = 2, 4, 4
  built = experiment.build(config)
  assert built.compact_leaves == {}
  mu = built.abstract_state().opt_state[1].mu
  assert jax.tree.structure(mu) == jax.tree.structure(built.abstract_state().params)
  assert all(m.shape == p.shape for m, p in zip(jax.tree.leaves(mu),
                                                jax.tree.leaves(built.abstract_state().params)))
  assert jnp.dtype(mu[SHARED]["shared_0"].dtype) == jnp.float32


# --------------------------------------------------------------------------------------------
# config.compact_moments: staged moments where the stage axis spans slices, unless asked.


@pytest.mark.unit  # Raises before anything is built.
@pytest.mark.parametrize("setting", ["yes", "", "On"])
def test_a_bad_setting_is_refused_naming_the_choices(setting):
  config = train_runs.lm_config()
  config.compact_moments = setting
  with pytest.raises(ValueError, match=rf"config.compact_moments={setting!r}: write 'auto'"):
    translate.validate_config(config)


@pytest.fixture(scope="module")
def two_slices():
  """The tiny LM with its stages over two emulated slices (links 1 and 3 cross them): by
  default (auto) and with compact_moments='on'."""
  built = {}
  for setting in ("auto", "on"):
    config = train_runs.lm_config()
    config.mesh.dcn.stage, config.mesh.emulate_slices = 2, True
    config.compact_moments = setting
    built[setting] = experiment.build(config)
  return built


def _moves_over_stage(exp):
  """The optimizer update's all-to-alls over the stage axis, compiled with the train state's
  shardings (the step's gradients arrive as the parameters are laid out)."""
  state = exp.abstract_state()
  compiled = jax.jit(exp.optimizer.update).lower(state.params, state.opt_state,
                                                 state.params).compile()
  return [c for c in analysis.collectives(compiled, exp.mesh)
          if c.kind == "all-to-all" and c.axes and "stage" in c.axes]


def test_over_dcn_the_moments_stay_staged_unless_asked(two_slices):
  """Over DCN only stage-boundary activations cross the stage axis by default: the ends'
  moments stay staged and the update moves nothing over it; 'on' compacts them, for an
  all-to-all of the entries' gradients there and of the updates back."""
  auto, on = two_slices["auto"], two_slices["on"]
  assert compact_moments.spans_slices(auto.mesh)
  assert auto.compact_leaves == {} and list(on.compact_leaves) == ["shared_0"]
  params = auto.abstract_state().params
  staged_mu = auto.abstract_state().opt_state[1].mu
  assert all(m.shape == p.shape and m.sharding == p.sharding
             for m, p in zip(jax.tree.leaves(staged_mu), jax.tree.leaves(params)))
  assert _moves_over_stage(auto) == []
  assert len(_moves_over_stage(on)) == 2
  assert "the stage axis spans slices): 'on' would save" in compact_moments.describe(
      "auto", auto.layout, auto.mesh)
  assert compact_moments.describe("on", on.layout, on.mesh).startswith(
      "Adam's moments of the ends compact (config.compact_moments='on')")


def test_a_checkpoint_restores_across_the_setting(two_slices):
  """Checkpoints hold the logical moments: a state saved with compact moments restores with
  staged ones, exactly, and back."""
  auto, on = two_slices["auto"], two_slices["on"]
  state = on.init_state(jax.random.key(0))
  adam = state.opt_state[1]
  # Moments holding the parameters' values (non-zero, zero in the padding as real moments are).
  moved = compact_moments.compact(state.params, on.compact_leaves)
  state = state.replace(opt_state=(state.opt_state[0], adam._replace(mu=moved))
                        + tuple(state.opt_state[2:]))
  logical = on.to_checkpoint(state)
  staged = auto.from_checkpoint(logical)
  for got, want in zip(jax.tree.leaves(staged.opt_state[1].mu), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(got, want)
  back = on.from_checkpoint(auto.to_checkpoint(staged))
  for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
    np.testing.assert_array_equal(got, want)
