"""Tests for tpipe.train.cli.experiment: the mesh, model and steps from a config; AOT compile."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import tpipe
from configs import lm
from tests.helpers import numerics
from tests.helpers import train_runs
from tpipe.core.layout import description as layout_lib
from tpipe.core.layout import staging
from tpipe.train import architecture
from tpipe.train import models
from tpipe.train.cli import experiment
from tpipe.train.cli import translate
from tpipe.train.cli import tasks


def _config(**overrides):
  config = lm.get_config("size=tiny")
  for key, value in overrides.items():
    config[key] = value
  return config


@pytest.fixture(scope="module")
def exp():
  """The tiny LM's experiment (data=2 x stage=4, M=8), shared with the trainer tests."""
  built = train_runs.lm_experiment()
  resolved = architecture.resolve(_config(num_steps=train_runs.NUM_STEPS))  # The vocabulary.
  assert built.config.to_dict() == resolved.to_dict()
  return built


@functools.cache
def _plain():
  """The tiny LM without a pipeline (one stage, one micro-batch): jitted ``(logical params,
  batch) -> {"loss", "grad_norm"}`` of the mean loss, computed in the parameters' dtype."""
  arguments = tasks.lm_arguments(train_runs.lm_config())

  @jax.jit
  def run(params, batch):
    dtype = train_runs.params_dtype(params)
    model = models.decoder_lm(**dict(arguments, dtype=dtype, param_dtype=dtype), num_stages=1,
                              num_microbatches=1)
    loss, grads = jax.value_and_grad(lambda p: model.apply(
        {"params": p}, batch["inputs"], targets=batch["targets"]).mean())(params)
    return {"loss": loss, "grad_norm": optax.tree.norm(grads)}

  return run


def _random_batch(exp, seed=0):
  rng = np.random.default_rng(seed)
  shape = (exp.config.batch_size, exp.config.seq_len)
  batch = {k: jnp.asarray(rng.integers(0, 256, shape), jnp.int32) for k in ("inputs", "targets")}
  return jax.device_put(batch, exp.abstract_batch()["inputs"].sharding)


def test_abstract_state_is_staged_sharded_and_allocates_nothing(exp):
  state = exp.abstract_state()
  leaves = jax.tree.leaves(state)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  # The parameters are the staged tree itself: the blocks per leaf, the rest packed.
  assert set(state.params) == {layout_lib.STACKED, layout_lib.PACKED, layout_lib.SHARED}
  packed = state.params[layout_lib.PACKED]["float32"]
  assert packed.shape[:2] == (1, exp.config.num_stages)
  blocks = state.params[layout_lib.STACKED]["layers_1"]
  assert blocks["mlp_in"]["kernel"].shape[:3] == (1, exp.config.num_stages, 1)
  for leaf in jax.tree.leaves(state.params):
    assert leaf.sharding.spec == P(None, "stage")
  adam = state.opt_state[1]  # chain(clip, adam, decay, lr) -> ScaleByAdamState.
  # The embedding and head share one leaf with an entry per stage, two of them real: their
  # moments keep those two, split over the stages (tpipe.train.compact_moments).
  (name, compact), = exp.compact_leaves.items()
  assert compact.entries == ((0, 0), (0, exp.config.num_stages - 1))
  for moment in (adam.mu, adam.nu):
    assert jax.tree.structure(moment) == jax.tree.structure(state.params)
    shared = dict(moment[layout_lib.SHARED])  # A copy: the abstract state is cached.
    ends = shared.pop(name)
    assert ends.shape == (2,) + state.params[layout_lib.SHARED][name].shape[2:]
    assert ends.sharding.spec == P(None, "stage")
    rest = {**moment, layout_lib.SHARED: shared}
    assert {leaf.sharding.spec for leaf in jax.tree.leaves(rest)} == {P(None, "stage")}
  assert adam.count.sharding.spec == P()
  # Weight decay keeps no state: the packed buffers' mask is computed in the update.
  assert state.opt_state[2] == optax.EmptyState()
  assert jnp.dtype(jnp.bool_) not in {leaf.dtype for leaf in leaves}
  batch = exp.abstract_batch()
  assert batch["inputs"].shape == (exp.config.batch_size, exp.config.seq_len)
  assert batch["inputs"].sharding.spec == P("data")
  # Without the padding of the stage layout: the logical parameters' count.
  assert exp.num_params() == sum(x.size for x in jax.tree.leaves(exp.layout.logical))
  assert exp.num_params() <= sum(x.size for x in jax.tree.leaves(state.params))


def test_embedding_first_and_head_last(exp):
  groups = exp.layout.groups
  assert groups[0][0].layer == 0 and groups[-1][-1].layer == 2
  assert all(g.layer == 1 for chunk in groups[1:-1] for g in chunk)


def test_checkpoint_layout_is_logical_and_exact(exp):
  state = exp.init_state(jax.random.key(0))
  logical = exp.to_checkpoint(state)
  assert set(logical.params) == {"layers_0", "layers_1", "layers_2"}
  kernel = logical.params["layers_1"]["mlp_in"]["kernel"]
  assert kernel.shape[0] == exp.config.num_layers
  # Split over the stages (on a weight dimension), not gathered: a quarter per device here.
  assert kernel.addressable_shards[0].data.size * exp.config.num_stages == kernel.size
  assert logical.opt_state[2] == optax.EmptyState()  # No weight-decay mask to convert.
  assert logical.opt_state[1].mu["layers_1"]["mlp_in"]["kernel"].shape == kernel.shape
  for leaf, want in zip(jax.tree.leaves(logical), jax.tree.leaves(exp.abstract_checkpoint())):
    assert leaf.shape == want.shape and leaf.dtype == want.dtype
  back = exp.from_checkpoint(logical)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding == b.sharding


def test_checkpoint_moves_between_meshes_and_splits(exp):
  state = exp.init_state(jax.random.key(0))
  other = experiment.build(_config(num_stages=2, num_data=4, num_microbatches=2,
                                   balance="1,5"))
  moved = other.from_checkpoint(jax.device_get(exp.to_checkpoint(state)))
  assert {leaf.shape[1] for leaf in jax.tree.leaves(moved.params)} == {2}
  assert [leaf.shape[:2] for leaf in jax.tree.leaves(exp.abstract_state().params)] == [
      (1, 4)] * len(jax.tree.leaves(exp.abstract_state().params))
  for a, b in zip(jax.tree.leaves(other.to_checkpoint(moved).params),
                  jax.tree.leaves(exp.to_checkpoint(state).params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_train_step_compiles_ahead_of_time(exp):
  compiled = exp.train_step.lower(
      exp.abstract_state(), exp.abstract_batch(), jax.random.key(0)).compile()
  assert compiled.memory_analysis() is not None
  assert "all-reduce" in compiled.as_text() or "all-gather" in compiled.as_text()


def _decay_of_ones(exp):
  """The decay term of ``translate.staged_weight_decay(0.5)`` on all-ones parameters, logical."""
  decay = translate.staged_weight_decay(0.5, exp.layout)
  ones = jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype), exp.layout.logical)
  staged = staging.to_staged(exp.layout, ones)
  zeros = jax.tree.map(jnp.zeros_like, staged)
  updates, state = jax.jit(decay.update)(zeros, decay.init(staged), staged)
  assert state == optax.EmptyState()
  return jax.device_get(staging.to_logical(exp.layout, updates))


def _assert_decayed(decayed, matrices):
  for path, leaf in jax.tree_util.tree_leaves_with_path(decayed):
    want = 0.5 if path[-1].key in matrices else 0.0
    np.testing.assert_array_equal(leaf, np.full(leaf.shape, want, leaf.dtype),
                                  err_msg=jax.tree_util.keystr(path))


def test_weight_decay_applies_to_kernels_and_embeddings_only(exp):
  """The optimizer's decay on staged parameters: per stacked leaf by its name, in the packed
  buffers by the ranges of the leaves it belongs to (the embedding and the head live there)."""
  decayed = _decay_of_ones(exp)
  _assert_decayed(decayed, ("kernel", "embedding"))
  assert decayed["layers_0"]["embed"]["embedding"].all()
  assert decayed["layers_2"]["head"]["kernel"].all()
  assert not decayed["layers_1"]["mlp_norm"]["scale"].any()
  assert not decayed["layers_0"]["pos_embed"].any()


def test_weight_decay_applies_to_llama_blocks_projections():
  """LlamaBlock names its matrices by role (query ... down): they decay; its norms' scales and
  the q/k/v biases do not."""
  exp = experiment.build(_config(block="llama", num_stages=2, num_data=1, num_microbatches=2,
                                 qkv_bias=True, tie_embeddings=False))
  decayed = _decay_of_ones(exp)
  block = decayed["layers_1"]
  assert set(block) >= {"query", "key", "value", "out", "gate", "up", "down", "query_bias"}
  _assert_decayed(decayed, ("kernel", "embedding", "query", "key", "value", "out", "gate", "up",
                            "down"))


def test_init_state_and_steps(exp):
  """The eval step's mean, the training loss and the train step's loss are the plain LM's."""
  state = exp.init_state(jax.random.key(0))
  abstract = exp.abstract_state()
  for leaf, want in zip(jax.tree.leaves(state), jax.tree.leaves(abstract)):
    assert leaf.shape == want.shape and leaf.sharding == want.sharding
  batch = _random_batch(exp)
  logical = jax.device_get(exp.to_checkpoint(state).params)
  plain = _plain()(logical, jax.device_get(batch))["loss"]
  exact = numerics.float64_reference(_plain(), logical, jax.device_get(batch))["loss"]
  sums = exp.eval_step(state, batch)  # Sums over the batch's real examples (all, unmasked).
  assert float(sums["count"]) == exp.config.batch_size and "correct" not in sums
  eval_loss = sums["loss"] / sums["count"]
  numerics.assert_as_close_as_plain(eval_loss, plain, exact, what="eval loss")
  # Dropout is 0 in the tiny config, so the training loss is the same function.
  numerics.assert_as_close_as_plain(exp.loss_fn(state.params, batch, jax.random.key(1)), plain,
                                    exact, what="training loss")
  assert 4.0 < float(eval_loss) < 8.0  # About ln(256) = 5.5 at initialisation.
  new_state, metrics = exp.train_step(state, batch, jax.random.key(1))
  numerics.assert_as_close_as_plain(metrics["loss"], plain, exact, what="train step loss")
  assert int(new_state.step) == 1
  for leaf in jax.tree.leaves(new_state.params):
    assert leaf.sharding.spec == P(None, "stage")


@pytest.mark.unit  # No JAX computation.
@pytest.mark.parametrize("overrides, error, match", [
    (dict(batch_size=12), ValueError, "num_microbatches"),
    (dict(batch_size=15), ValueError, "num_data"),
    (dict(num_data=1, mesh=dict(fsdp=4)), ValueError,
     r"per-shard batch 4 \(batch_size 16 / \(num_data \* mesh.fsdp = 4\)\) must be divisible "
     r"by config.num_microbatches=8"),
    (dict(num_data=1, batch_size=15, mesh=dict(fsdp=2)), ValueError,
     r"divisible by config.num_data \* config.mesh.fsdp = 1 \* 2"),
    (dict(mesh=dict(tensor=0)), ValueError, r"config.mesh.tensor must be >= 1, got 0"),
    (dict(mesh=dict(expert=0)), ValueError, r"config.mesh.expert must be >= 1, got 0"),
    (dict(num_stages=2, mesh=dict(expert=2)), ValueError,
     r"config.mesh.expert=2 splits a mixture's experts, but config.block='gpt' has none"),
    (dict(num_stages=2, block="moe", num_experts=3, mesh=dict(expert=2)), ValueError,
     r"config.num_experts=3 must be divisible by config.mesh.expert=2"),
    (dict(block="moe", experts_per_token=9), ValueError,
     r"block='moe': experts_per_token must be an int from 1 to num_experts = 8, got 9"),
    (dict(block="moe", capacity_factor=-0.5), ValueError,
     r"block='moe': capacity_factor must be >= 0 \(0 = dropless\), got -0.5"),
    (dict(num_stages=8), ValueError, "JAX sees only 8"),
    (dict(num_layers=0), ValueError, "num_layers"),
    (dict(learning_rate=0.0), ValueError, "learning_rate"),
    (dict(dtype="float16"), ValueError, "config.dtype must be one of"),
    (dict(balance="flop"), ValueError, "config.balance='flop'"),
    (dict(balance="1,2"), ValueError, "has 2 entries"),
    (dict(remat_granularity="block"), ValueError, "config.remat_granularity: Unknown"),
    (dict(remat_granularity="0"), ValueError, "config.remat_granularity: .* must be >= 1"),
    (dict(mesh=dict(dcn=dict(stage=3))), ValueError,
     r"dcn\['stage'\]=3 does not divide the 'stage' axis's size 4"),
    (dict(mesh=dict(dcn=dict(stage=2))), ValueError,
     r"spans 2 slice\(s\), but the devices are on 1.*config.mesh.emulate_slices=True"),
    (dict(mesh=dict(dcn=dict(tensor=2))), ValueError,
     r"config.mesh.dcn has unknown axes \['tensor'\]; use stage, data or fsdp"),
    (dict(mesh=dict(dcn=dict(data=0))), ValueError, r"config.mesh.dcn.data must be an int >= 1"),
    (dict(transfer_delay="2"), ValueError, r"transfer_delay=2: a transfer is delayed by 0 or 1"),
    (dict(transfer_delay="soon"), ValueError, r"config.transfer_delay='soon': write 'auto'"),
    (dict(tick_costs="F=1,B=x"), ValueError, r"config.tick_costs='F=1,B=x': write"),
    (dict(tick_costs="F=1,B=3"), ValueError, r"config: costs lay fused schedules out"),
    (dict(schedule="1f1b", tick_costs="F=1,B=-3"), ValueError,
     r"costs\['B'\] must be finite and > 0"),
    (dict(schedule="1f1b", tick_search=1), ValueError,
     r"config: tick_search=1 re-places .* pass costs \(tick_costs\) too"),
    (dict(schedule="1f1b", tick_costs="F=1,B=3", tick_search=-1), ValueError,
     r"must be >= 0 sweeps, got -1"),
])
def test_bad_config_raises_before_tracing(overrides, error, match):
  with pytest.raises(error, match=match):
    experiment.build(_config(**overrides))


def test_bfloat16_config_computes_in_bfloat16_with_float32_state():
  exp = experiment.build(_config(dtype="bfloat16"))
  block = exp.model.layer_list()[1].module
  assert block.dtype == jnp.bfloat16 and block.param_dtype == jnp.float32
  # Parameters and both Adam moments stay float32 (the step counters are int32).
  dtypes = {leaf.dtype for leaf in jax.tree.leaves(exp.abstract_state())}
  assert dtypes == {jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)}


@pytest.mark.unit  # No JAX computation.
def test_config_sizes_and_bad_argument():
  assert lm.get_config().size == "small"
  assert lm.get_config("size=base").num_layers > lm.get_config("size=small").num_layers
  with pytest.raises(ValueError, match="Unknown size"):
    lm.get_config("size=huge")


def _gpipe_config(arg):
  import importlib.util  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(__file__).resolve().parents[2] / "configs" / "transformer_gpipe.py"
  spec = importlib.util.spec_from_file_location("transformer_gpipe", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def test_transformer_gpipe_config():
  big = _gpipe_config(None)
  assert (big.num_layers, big.width, big.mlp_dim, big.num_heads) == (48, 2048, 8192, 32)
  assert big.num_microbatches == 32 and big.remat == "full" and big.dtype == "bfloat16"
  tiny = experiment.build(_gpipe_config("size=tiny"))
  assert tiny.model.layer_list()[1].module.dtype == jnp.bfloat16
  compiled = tiny.train_step.lower(
      tiny.abstract_state(), tiny.abstract_batch(), jax.random.key(0)).compile()
  assert compiled.memory_analysis() is not None
  with pytest.raises(ValueError, match="Unknown size"):
    _gpipe_config("size=medium")


@pytest.mark.parametrize("schedule", ["gpipe", "circular"])
def test_train_step_moves_no_parameters_between_stages(schedule, request):
  """The state lives in the stage layout: over 'stage' the step only passes activations (and
  their gradients) to neighbours; no all-gather or all-to-all re-lays the parameters out. GPipe:
  the shared tiny LM's step (compiled once for the module); circular: 2 repeats of 6 layers."""
  from tpipe.tools import analysis  # pylint: disable=g-import-not-at-top
  if schedule == "gpipe":
    exp = request.getfixturevalue("exp")
    assert exp.config.schedule == "gpipe" and exp.config.num_repeats == 1
  else:
    exp = experiment.build(_config(schedule=schedule, num_repeats=2, num_layers=6))
  compiled = exp.train_step.lower(exp.abstract_state(), exp.abstract_batch(),
                                  jax.random.key(0)).compile()
  found = analysis.collectives(compiled, mesh=exp.mesh)
  over_stage = {c.kind for c in found if c.axes and "stage" in c.axes}
  assert "collective-permute" in over_stage  # The pipeline's neighbour sends.
  # Only the update moves the shared leaves' real entries to where their moments live, and
  # back (tpipe.train.compact_moments): once per step, no more than those entries.
  compact_bytes = sum(np.prod(leaf.shape) * 4 for leaf in exp.compact_leaves.values())
  moves = [c for c in found if c.axes and "stage" in c.axes and c.kind == "all-to-all"]
  assert all(not c.in_loop and c.count == 1 and c.bytes <= compact_bytes for c in moves), moves
  # The only gather over 'stage' is the batch's (it enters split over the stages), once per
  # step: no parameter is gathered.
  batch_bytes = sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(exp.abstract_batch()))
  gathers = [c for c in found if c.axes and "stage" in c.axes and c.kind == "all-gather"]
  assert all(not c.in_loop and c.count == 1 and c.bytes <= batch_bytes for c in gathers), gathers
  # What is all-reduced over 'stage' is small: the per-example losses (and the loss's scalars),
  # never a parameter-sized buffer.
  staged_bytes = sum(s.size * s.dtype.itemsize
                     for s in jax.tree.leaves(exp.abstract_state().params)) // exp.config.num_stages
  big = [c for c in found if c.axes and "stage" in c.axes and c.kind == "all-reduce"
         and c.bytes >= staged_bytes // 4]
  assert not big, big


@pytest.mark.unit  # No JAX computation.
def test_a_fused_schedule_with_batchnorm_is_rejected_before_tracing():
  from configs import convnet  # pylint: disable=g-import-not-at-top
  config = convnet.get_config("size=tiny")
  config.schedule = "1f1b"
  with pytest.raises(ValueError, match=r"config.schedule='1f1b' is a fused schedule, which "
                     r"cannot train config.task='image_classification': its convnet has "
                     r"BatchNorm.*Use config.schedule='gpipe'"):
    translate.validate_config(config)


def test_fused_schedule_trains_as_gpipe_does(exp):
  """``config.schedule="1f1b"``: from the same states, the train step's loss and gradient norm
  are GPipe's (float64 reference: the plain LM on the logical parameters), and evaluation (the
  fused table's forward pass on the same staged parameters) is GPipe's, bit for bit."""
  config = _config(schedule="1f1b")
  gpipe = exp
  fused = experiment.build(config)
  assert fused.pipeline.spec.is_fused and not gpipe.pipeline.spec.is_fused
  assert fused.layout.staged_shapes() == gpipe.layout.staged_shapes()

  copy = lambda state: jax.tree.map(jnp.copy, state)  # The steps donate their state.
  state = gpipe.init_state(jax.random.key(0))
  for step in range(3):
    batch = _random_batch(gpipe, seed=step)
    logical = jax.device_get(gpipe.to_checkpoint(state).params)
    reference = numerics.float64_reference(_plain(), logical, jax.device_get(batch))
    _, got = fused.train_step(copy(state), batch, jax.random.key(step))
    evaluated = jax.device_get((fused.eval_step(state, batch), gpipe.eval_step(state, batch)))
    assert evaluated[0].keys() == evaluated[1].keys()
    for key in evaluated[1]:
      np.testing.assert_array_equal(evaluated[0][key], evaluated[1][key], err_msg=key)
    state, want = gpipe.train_step(state, batch, jax.random.key(step))
    for name in ("loss", "grad_norm"):
      numerics.assert_as_close_as_plain(float(got[name]), float(want[name]), reference[name],
                                        what=f"step {step + 1} {name}")


@pytest.mark.unit  # Builds meshes and tables only.
def test_a_config_over_two_emulated_slices_delays_the_links_between_them():
  config = _config(mesh=dict(fsdp=1, tensor=1, dcn=dict(stage=2), emulate_slices=True))
  mesh = jax.devices()[:8]
  spec = translate.spec_from_config(config, tpipe.make_mesh(
      stages=4, data=2, dcn={"stage": 2}, slices=[mesh[:4], mesh[4:]]))
  assert spec.delays == (0, 1, 0, 1)
  assert translate.spec_from_config(_config(transfer_delay="1")).delays == (1, 1, 1, 1)
  assert translate.spec_from_config(_config(transfer_delay="0,0,1,0")).delays == (0, 0, 1, 0)


@pytest.mark.unit  # Builds tables only.
def test_config_tick_costs_give_compound_tables():
  spec = translate.spec_from_config(_config(schedule="zbv", num_repeats=2,
                                            tick_costs="F=1, B=3, BI=2, W=1"))
  assert spec.tick_costs == (("B", 3.0), ("BI", 2.0), ("F", 1.0), ("W", 1.0))
  assert spec.table.is_compound
  assert translate.spec_from_config(_config(schedule="zbv", num_repeats=2)).tick_costs is None
  overlapped = translate.spec_from_config(_config(schedule="zbv", num_repeats=2,
                                                  overlap_microbatches=True))
  assert overlapped.overlap_microbatches
  with pytest.raises(ValueError, match="config: overlap_microbatches=True pairs"):
    translate.spec_from_config(_config(schedule="gpipe", overlap_microbatches=True))
  costs = "F=403.4, BI=528.9, W=407.5"  # ZB-H1's measured costs under remat none.
  searched = translate.spec_from_config(_config(schedule="zb_h1", tick_costs=costs,
                                                tick_search=1))
  assert searched.tick_search == 1
  from tpipe.experimental import search  # pylint: disable=g-import-not-at-top
  plain = translate.spec_from_config(_config(schedule="zb_h1", tick_costs=costs))
  assert type(plain) is tpipe.PipelineSpec  # pylint: disable=unidiomatic-typecheck
  assert searched.table is search.with_search(plain, 1).table
