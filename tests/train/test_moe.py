"""Mixture-of-experts layers: routing, dropless and capacity experts, the router's auxiliary
losses; and a MoE LM pipelined on meshes with an expert axis under every schedule, in linen and
NNX, equal to the model run in sequence (its auxiliary losses and their gradients included)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import tpipe
from tests.helpers import moe_models as mm
from tests.helpers import numerics
from tpipe import nnx as tnnx
from tpipe.core.loops import tick_rows
from tpipe.tools import analysis
from tpipe.train import architecture
from tpipe.train import experts
from tpipe.train import moe


def _routing_case(tokens=12, experts=4, k=2, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((tokens, 6)), jnp.float32)
  weights = [jnp.asarray(rng.standard_normal(s) * 0.4, jnp.float32)
             for s in ((experts, 6, 5), (experts, 6, 5), (experts, 5, 6))]
  router = jnp.asarray(rng.standard_normal((6, experts)), jnp.float32)
  return x, moe.route(x, router, k), weights


def _each_pair_in_turn(x, routing, w_gate, w_up, w_down):
  """Every token through each of its experts one at a time, mixed: the layer's definition."""
  pairs = mm.each_pair_in_turn(x, routing.experts, w_gate, w_up, w_down)
  return jnp.einsum("nkd,nk->nd", pairs, routing.weights)


@pytest.mark.unit
def test_routing_picks_the_top_k_and_renormalises():
  x, routing, _ = _routing_case()
  order = np.argsort(-np.asarray(routing.probs), axis=-1)[:, :2]
  np.testing.assert_array_equal(routing.experts, order)
  np.testing.assert_allclose(routing.weights.sum(-1), 1.0, rtol=1e-6)
  picked = np.take_along_axis(np.asarray(routing.probs), order, -1)
  np.testing.assert_allclose(routing.weights, picked / picked.sum(-1, keepdims=True), rtol=1e-6)
  assert routing.probs.dtype == jnp.float32
  assert moe.route(x.astype(jnp.bfloat16), jnp.ones((6, 4)), 2).logits.dtype == jnp.float32


@pytest.mark.unit
def test_dropless_and_ample_capacity_equal_each_pair_in_turn():
  x, routing, weights = _routing_case()
  want = _each_pair_in_turn(x, routing, *weights)
  np.testing.assert_allclose(moe.dropless(x, routing, *weights), want, rtol=1e-5, atol=1e-6)
  out, dropped = moe.with_capacity(x, routing, *weights, capacity_factor=2.0)  # E/k: room for all
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
  assert float(dropped) == 0.0


@pytest.mark.unit
def test_capacity_drops_the_pairs_beyond_it_in_token_order():
  x, routing, weights = _routing_case(tokens=16)
  capacity = moe.capacity_of(16, 2, 4, 0.5)
  assert capacity == 4
  out, dropped = moe.with_capacity(x, routing, *weights, capacity_factor=0.5)
  # Which pairs survive: each expert's first `capacity` claims, best choices first.
  kept = np.zeros(routing.experts.shape, bool)
  seen = np.zeros(4, int)
  for j in range(2):
    for n in range(16):
      e = int(routing.experts[n, j])
      kept[n, j] = seen[e] < capacity
      seen[e] += 1
  assert float(dropped) == (~kept).sum() > 0
  masked = routing._replace(weights=routing.weights * kept)
  np.testing.assert_allclose(out, _each_pair_in_turn(x, masked, *weights), rtol=1e-5, atol=1e-6)


@pytest.mark.unit
def test_the_router_losses_by_their_definitions():
  _, routing, _ = _routing_case(tokens=64, experts=4, k=2)
  counts = np.bincount(np.asarray(routing.experts).ravel(), minlength=4)
  np.testing.assert_allclose(moe.expert_load(routing), counts)
  np.testing.assert_allclose(moe.load_imbalance(routing), counts.max() / counts.mean())
  want = 4 * np.sum(counts / 64 * np.asarray(routing.probs).mean(0))
  np.testing.assert_allclose(moe.balance_loss(routing), want, rtol=1e-6)
  lse = jax.scipy.special.logsumexp(np.asarray(routing.logits, np.float64), axis=-1)
  np.testing.assert_allclose(moe.z_loss(routing), np.mean(lse ** 2), rtol=1e-5)
  # Perfectly balanced routing gives k.
  even = moe.Routing(jnp.asarray([[0, 1], [2, 3]] * 8, jnp.int32), jnp.full((16, 2), 0.5),
                     jnp.full((16, 4), 0.25), jnp.zeros((16, 4)))
  np.testing.assert_allclose(moe.balance_loss(even), 2.0)


@pytest.mark.unit
@pytest.mark.parametrize("kwargs,match", [
    (dict(num_experts=0, experts_per_token=1, capacity_factor=0.0),
     "num_experts must be an int >= 1, got 0"),
    (dict(num_experts=4, experts_per_token=5, capacity_factor=0.0),
     "experts_per_token must be an int from 1 to num_experts = 4, got 5"),
    (dict(num_experts=4, experts_per_token=0, capacity_factor=0.0),
     "experts_per_token must be an int from 1 to num_experts = 4, got 0"),
    (dict(num_experts=4, experts_per_token=2, capacity_factor=-1.0),
     r"capacity_factor must be >= 0 \(0 = dropless\), got -1.0"),
])
def test_bad_routing_is_refused_by_name(kwargs, match):
  with pytest.raises(ValueError, match=match):
    moe.check_routing(**kwargs)
  with pytest.raises(ValueError, match=match):
    moe.MixtureOfExperts(hidden=4, **kwargs).init(jax.random.key(0), jnp.ones((2, 3)))


MESHES = {
    "stage2-expert2-data2": dict(stages=2, expert=2, data=2),
    "stage2-expert4": dict(stages=2, expert=4),
}
# Each schedule at least once with the partitioner's dispatch and, but for gpipe (whose backward
# is autodiff through its loop, as circular's is), once with the explicit all-to-all; each layout
# four or five times; capacity on two; NNX on two, one per dispatch. "all_to_all/2" exchanges
# each device's tokens in two parts (exchange_chunks=2), once per front end; "+overlap" runs a
# stage's forward and backward of one tick in one conditional (overlap_microbatches), once per
# front end.
CASES = [
    ("linen", "stage2-expert2-data2", "gpipe", 0.0, "partitioner"),
    ("linen", "stage2-expert4", "circular", 0.0, "partitioner"),
    ("linen", "stage2-expert2-data2", "1f1b", 1.0, "partitioner"),
    ("nnx", "stage2-expert4", "interleaved_1f1b", 0.0, "partitioner+overlap"),
    ("nnx", "stage2-expert2-data2", "zb_h1", 0.0, "partitioner"),
    ("linen", "stage2-expert4", "zbv", 1.0, "partitioner"),
    ("linen", "stage2-expert2-data2", "circular", 0.0, "all_to_all"),
    ("linen", "stage2-expert4", "1f1b", 0.0, "all_to_all+overlap"),
    ("linen", "stage2-expert2-data2", "interleaved_1f1b", 0.0, "all_to_all"),
    ("linen", "stage2-expert4", "zb_h1", 1.0, "all_to_all/2+overlap"),
    ("nnx", "stage2-expert2-data2", "zbv", 0.0, "all_to_all/2"),
]
MICROBATCHES = 2
# The dropless experts' grouped matmuls split over the expert axis run, on XLA:CPU, as dense dot
# fusions of YNNPACK (its default) on the per-shard shapes, which round differently from the
# plain model's: measured 5-10x the plain model's gradient error here (about 30 float32 ulps of
# the gradients' norm); with YNNPACK's fusions off (XLA_FLAGS=
# --xla_cpu_experimental_ynn_fusion_type=) the same programs come within 1.05x of it.
GROUPED_FACTOR = 16.0


def _spec(schedule, mesh, dispatch="partitioner"):
  return dict(num_stages=2, num_microbatches=MICROBATCHES, schedule=schedule, mesh=mesh,
              num_repeats=2 if schedule in ("circular", "interleaved_1f1b", "zbv") else 1,
              per_example=("targets",), overlap_microbatches=_overlaps(dispatch))


def _dispatch(name):
  """``(dispatch, exchange_chunks)`` of a case's dispatch: ``"all_to_all/2"`` in two parts."""
  dispatch, _, chunks = name.removesuffix("+overlap").partition("/")
  return dispatch, int(chunks or 1)


def _overlaps(name) -> bool:
  """Whether a case's dispatch (``"all_to_all+overlap"``) overlaps micro-batches."""
  return name.endswith("+overlap")


def _linen_step(schedule, mesh, capacity_factor, dispatch, tokens, targets):
  model = tpipe.Sequential(mm.linen_layers(capacity_factor, *_dispatch(dispatch)),
                           **_spec(schedule, mesh, dispatch))
  if _overlaps(dispatch):  # Its table pairs a forward and a backward somewhere.
    assert tick_rows.paired(model.pipeline_for(tokens, targets=targets).loss_table).any()
  boxed = jax.eval_shape(functools.partial(model.init, method="initialize"),
                         {"params": jax.random.key(0)}, tokens, targets=targets)["params"]
  shardings = nn.unbox(tpipe.shardings(boxed, mesh, stacked=("layers_1",),
                                       rules=tpipe.DEFAULT_RULES))
  params = jax.device_put(mm.random_params(), shardings)
  loss = lambda p, x, t: model.apply({"params": p}, x, targets=t, method="loss")
  with nn.logical_axis_rules(tpipe.DEFAULT_RULES):
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, tokens, targets).compile()
    value, grads = compiled(params, tokens, targets)
  return compiled, value, grads


def _nnx_step(schedule, mesh, capacity_factor, dispatch, tokens, targets):
  spec = _spec(schedule, mesh, dispatch)
  dispatch, chunks = _dispatch(dispatch)
  model = tnnx.Sequential(mm.nnx_layers(capacity_factor, dispatch=dispatch,
                                        exchange_chunks=chunks), **spec)
  state = nnx.state(model, nnx.Param)
  pure = nnx.to_pure_dict(state)
  params = mm.random_params()  # A Repeat keeps its stacked copies under "layer".
  pure["layers"] = {0: params["layers_0"], 1: {"layer": params["layers_1"]},
                    2: params["layers_2"]}
  nnx.replace_by_pure_dict(state, pure)
  nnx.update(model, state)

  @nnx.jit
  def value_and_grad(model, x, t):
    return nnx.value_and_grad(lambda m: m.loss(x, targets=t))(model)

  value, grads = value_and_grad(model, tokens, targets)
  grads = nnx.to_pure_dict(grads)["layers"]
  return None, value, {"layers_0": grads[0], "layers_1": grads[1]["layer"],
                       "layers_2": grads[2]}


@pytest.mark.parametrize("front,mesh_name,schedule,capacity_factor,dispatch", CASES)
def test_moe_lm_on_an_expert_axis_equals_the_sequential_model(front, mesh_name, schedule,
                                                              capacity_factor, dispatch):
  sizes = MESHES[mesh_name]
  mesh = tpipe.make_mesh(**sizes)
  tokens, targets = jax.device_put(mm.inputs(), tpipe.data_sharding(mesh))
  step = _linen_step if front == "linen" else _nnx_step
  compiled, value, grads = step(schedule, mesh, capacity_factor, dispatch, tokens, targets)
  if compiled is not None:
    assert not analysis.cross_branch_collectives(compiled, mesh)
    exchanges = [c for c in analysis.collectives(compiled, mesh)
                 if c.kind == "all-to-all" and "/moe/" in c.op_name]
    # The explicit dispatch's all-to-alls over the expert axis, in the tick loop; the
    # partitioner's dispatch makes none in the experts (its all-to-alls are the embedding's).
    assert bool(exchanges) == (_dispatch(dispatch)[0] == "all_to_all")
    assert all(c.axes == ("expert",) and c.in_loop for c in exchanges)
  groups = MICROBATCHES * sizes.get("data", 1)
  # Grouped matmuls: dropless, or any capacity under the exchange (its kept pairs grouped).
  grouped = not capacity_factor or _dispatch(dispatch)[0] == "all_to_all"
  plain = mm.sequential_value_and_grad(groups, capacity_factor)
  reference = mm.sequential_value_and_grad(groups, capacity_factor, "float64")
  numerics.assert_as_close_as_plain(value, plain[0], reference[0], what="loss")
  numerics.assert_as_close_as_plain(grads, plain[1], reference[1], what="gradients",
                                    factor=GROUPED_FACTOR if grouped else 2.0)
  # The router's losses are in it: the router's gradient is not the main loss's alone.
  without = mm.sequential_loss_without_aux(groups, capacity_factor)
  assert abs(float(value) - float(without)) > 1e-3


def test_the_fsdp_gathers_of_the_experts_weights_stay_on_each_devices_experts():
  """On stage 2 x expert 2 x fsdp 2, the tick loops' gathers over fsdp of the experts' weights
  (and their transposes, the gradients' reduce-scatters) run on each device's own experts: none
  of them gathers over ``expert`` first, which would put every expert's weights whole on every
  device (the partitioner did so for a stacked unit's weights)."""
  mesh = tpipe.make_mesh(stages=2, expert=2, fsdp=2)
  tokens, targets = jax.device_put(mm.inputs(), tpipe.data_sharding(mesh))
  compiled, value, _ = _linen_step("1f1b", mesh, 0.0, "partitioner", tokens, targets)
  assert np.isfinite(float(value))
  assert not analysis.cross_branch_collectives(compiled, mesh)
  gathers = [c for c in analysis.collectives(compiled, mesh)
             if c.in_loop and c.op_name.rsplit("/", 1)[-1] in ("all_gather", "reduce_scatter")]
  assert {c.axes for c in gathers} == {("fsdp",)}, gathers


def test_the_cases_cover_every_schedule_and_both_front_ends():
  every = {"gpipe", "circular", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"}
  base = lambda case: _dispatch(case[4])[0]
  assert {c[2] for c in CASES if base(c) == "partitioner"} == every
  assert {c[2] for c in CASES if base(c) == "all_to_all"} == every - {"gpipe"}
  assert {c[0] for c in CASES} == {"linen", "nnx"} and {c[3] for c in CASES} == {0.0, 1.0}
  for dispatch in ("partitioner", "all_to_all"):
    assert {c[0] for c in CASES if base(c) == dispatch} == {"linen", "nnx"}
    assert {c[1] for c in CASES if base(c) == dispatch} == set(MESHES)
    assert {c[3] for c in CASES if base(c) == dispatch} == {0.0, 1.0}
  # The exchange in parts: through each front end, a split backward and a capacity among them.
  parts = [c for c in CASES if _dispatch(c[4])[1] > 1]
  assert {c[0] for c in parts} == {"linen", "nnx"} and {c[3] for c in parts} == {0.0, 1.0}
  # Overlapped micro-batches: through each front end, a whole and a split backward, the
  # explicit exchange's and the partitioner's collectives in the pairs.
  overlapped = [c for c in CASES if _overlaps(c[4])]
  assert {c[0] for c in overlapped} == {"linen", "nnx"}
  assert {c[2] in tpipe.spec.SPLIT_BACKWARD for c in overlapped} == {True, False}
  assert {_dispatch(c[4])[0] for c in overlapped} == {"partitioner", "all_to_all"}


def test_the_trainer_builds_and_steps_a_moe_lm_with_its_experts_split():
  from configs import lm as lm_config  # pylint: disable=g-import-not-at-top
  from tpipe.train.cli import experiment
  from tpipe.train.cli import throughput  # pylint: disable=g-import-not-at-top

  config = lm_config.get_config("size=tiny")
  # The explicit all-to-all dispatch in two parts (the other tests of the trainer's MoE LM take
  # the partitioner's, the default).
  for key, value in dict(block="moe", num_stages=2, num_data=2, num_microbatches=2,
                         num_experts=4, experts_per_token=2, router_aux_loss_coef=0.1,
                         router_z_loss_coef=0.01, moe_dispatch="all_to_all",
                         moe_exchange_chunks=2).items():
    config[key] = value
  config.mesh.expert = 2
  assert architecture.lm_arguments(config)["moe_exchange_chunks"] == 2
  exp = experiment.build(config)
  state = exp.init_state(jax.random.key(0))
  gate = state.params["stacked"]["layers_1"]["moe"]["gate"]
  assert gate.shape[-3:] == (4, config.width, config.mlp_dim)
  assert "expert" in gate.sharding.spec  # Each expert device holds 2 of the 4 experts.
  rng = np.random.default_rng(0)
  batch = {k: jnp.asarray(rng.integers(0, 256, (config.batch_size, config.seq_len)), jnp.int32)
           for k in ("inputs", "targets")}
  batch = jax.device_put(batch, exp.abstract_batch()["inputs"].sharding)
  # The loss's terms apart, before the step donates the state: the step's loss is their sum;
  # evaluation (dropout 0 in the tiny config, as in training) is the task's loss alone.
  terms = jax.device_get(exp.loss_terms_step(state, batch, jax.random.key(1)))
  evaluated = jax.device_get(exp.eval_step(state, batch))
  new_state, metrics = exp.train_step(state, batch, jax.random.key(1))
  assert np.isfinite(float(metrics["loss"])) and int(new_state.step) == 1
  assert set(terms) >= {"loss", "aux_loss/moe/router_balance", "aux_loss/moe/router_z"}
  with_aux = sum(float(v) for k, v in terms.items() if not k.startswith("aux_metric/"))
  np.testing.assert_allclose(float(metrics["loss"]), with_aux, rtol=1e-5)
  np.testing.assert_allclose(float(evaluated["loss"]) / float(evaluated["count"]),
                             float(terms["loss"]), rtol=1e-5)
  # Balance: at least k per token, summed over the blocks.
  assert float(terms["aux_loss/moe/router_balance"]) >= 0.1 * 2 * config.num_layers - 1e-4
  # The busiest expert's load over the mean, between 1 and E, summed over the blocks.
  load = float(terms["aux_metric/moe/expert_load"]) / config.num_layers
  assert 1.0 <= load <= 4.0
  assert "expert" in new_state.params["stacked"]["layers_1"]["moe"]["gate"].sharding.spec
  arguments = {"num_layers": 1, "width": 8, "num_heads": 2, "mlp_dim": 16, "vocab_size": 4,
               "block": "moe", "num_experts": 8, "experts_per_token": 2}
  dense = dict(arguments, block="llama")
  per_token = throughput.lm_forward_flops_per_token
  # Active FLOPs: k experts' MLPs and the router, not E experts'.
  assert per_token(arguments, 4) - per_token(dense, 4) == 2 * 8 * 16 * 3 + 2 * 8 * 8


def test_experts_the_expert_axis_does_not_divide_are_refused_by_name():
  mesh = tpipe.make_mesh(stages=2, expert=4)
  model = tpipe.Sequential(
      [mm.Embed(), tpipe.Repeat(_ThreeExperts(), 2), mm.Head()], num_stages=2,
      num_microbatches=2, per_example=("targets",), mesh=mesh)
  tokens, targets = mm.inputs()
  with pytest.raises(ValueError, match="num_experts=3 is not divisible by the mesh's 'expert' "
                     "axis of 4 devices"):
    jax.eval_shape(model.init, jax.random.key(0), tokens, targets=targets)


class _ThreeExperts(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + moe.MixtureOfExperts(num_experts=3, experts_per_token=1, hidden=4)(x)


# Qwen2-MoE's options: the top-k probabilities as they are (norm_topk_prob=False) and a shared
# expert gated by a sigmoid of the token.


def _shared_case(seed=3):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((2, 5, 6)), jnp.float32)
  return x, dict(num_experts=4, experts_per_token=2, hidden=5)


@pytest.mark.unit
def test_routing_can_keep_the_top_k_probabilities_as_they_are():
  x, routing, weights = _routing_case()
  router = jnp.asarray(np.random.default_rng(7).standard_normal((6, 4)), jnp.float32)
  kept, renormalised = moe.route(x, router, 2, normalize=False), moe.route(x, router, 2)
  np.testing.assert_array_equal(kept.experts, renormalised.experts)
  picked = np.take_along_axis(np.asarray(kept.probs), np.asarray(kept.experts), -1)
  np.testing.assert_array_equal(kept.weights, picked)
  assert (np.asarray(kept.weights).sum(-1) < 1 - 1e-3).all()  # Not renormalised.
  np.testing.assert_allclose(moe.dropless(x, kept, *weights),
                             _each_pair_in_turn(x, kept, *weights), rtol=1e-5, atol=1e-6)


@pytest.mark.unit
def test_the_shared_expert_adds_its_gated_swiglu_to_the_routed_mix():
  x, shape = _shared_case()
  plain = moe.MixtureOfExperts(**shape)
  params = plain.init(jax.random.key(0), x)["params"]
  assert sorted(params) == ["down", "gate", "router", "up"]  # Off: Mixtral's tree, unchanged.
  shared = moe.MixtureOfExperts(**shape, shared_expert_hidden=7, normalize_expert_weights=False)
  with_shared = nn.unbox(shared.init(jax.random.key(1), x)["params"])
  assert {k: v.shape for k, v in with_shared.items() if k.startswith("shared")} == {
      "shared_gate": (6, 7), "shared_up": (6, 7), "shared_down": (7, 6),
      "shared_router": (6, 1)}
  routed = {k: with_shared[k] for k in params}
  got = shared.apply({"params": with_shared}, x) - moe.MixtureOfExperts(
      **shape, normalize_expert_weights=False).apply({"params": routed}, x)
  t = np.asarray(x, np.float64).reshape(-1, 6)
  w = {k: np.asarray(v, np.float64) for k, v in with_shared.items()}
  gate = t @ w["shared_gate"]
  want = (1 / (1 + np.exp(-t @ w["shared_router"])) * ((gate / (1 + np.exp(-gate)))
                                                       * (t @ w["shared_up"])) @ w["shared_down"])
  np.testing.assert_allclose(np.asarray(got).reshape(-1, 6), want, rtol=1e-4, atol=1e-5)


@pytest.mark.unit
def test_the_nnx_layer_with_a_shared_expert_is_the_linen_one():
  from tpipe.train import models_nnx  # pylint: disable=g-import-not-at-top
  x, shape = _shared_case()
  options = dict(normalize_expert_weights=False, shared_expert_hidden=7)
  linen = moe.MixtureOfExperts(**shape, **options)
  params = nn.unbox(linen.init(jax.random.key(0), x)["params"])
  layer = models_nnx.MixtureOfExperts(6, shape["hidden"], 4, 2, **options, rngs=nnx.Rngs(0))
  state = nnx.state(layer, nnx.Param)
  pure = nnx.to_pure_dict(state)
  assert jax.tree.map(jnp.shape, pure) == jax.tree.map(jnp.shape, params)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(layer, state)
  np.testing.assert_array_equal(layer(x), linen.apply({"params": params}, x))
  # Off, the NNX layer keeps the four weights it had.
  bare = models_nnx.MixtureOfExperts(6, 5, 4, 2, rngs=nnx.Rngs(0))
  assert sorted(nnx.to_pure_dict(nnx.state(bare, nnx.Param))) == ["down", "gate", "router", "up"]


@pytest.mark.unit
@pytest.mark.parametrize("options,match", [
    (dict(shared_expert_hidden=-1), r"shared_expert_hidden \(the shared expert's hidden width\) "
                                    r"must be an int >= 0 \(0 = no shared expert\), got -1"),
    (dict(shared_expert_hidden=2.5), "must be an int >= 0 .*got 2.5"),
    (dict(normalize_expert_weights="no"), r"normalize_expert_weights must be True .* or False "
                                          r".*got 'no'"),
])
def test_a_bad_shared_expert_or_weighting_is_refused_by_name(options, match):
  from tpipe.train import models_nnx  # pylint: disable=g-import-not-at-top
  x, shape = _shared_case()
  with pytest.raises(ValueError, match=match):
    moe.MixtureOfExperts(**shape, **options).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=match):
    models_nnx.MixtureOfExperts(6, 5, 4, 2, **options, rngs=nnx.Rngs(0))


@pytest.mark.unit
def test_the_lm_refuses_a_shared_expert_without_experts_and_a_negative_width():
  from tpipe.train import models  # pylint: disable=g-import-not-at-top
  sizes = dict(num_layers=1, width=8, num_heads=2, mlp_dim=8, max_len=4, vocab_size=16,
               positions="rotary", final_norm="rms", head_bias=False)
  with pytest.raises(ValueError, match="shared_expert_mlp_dim=8 and normalize_expert_weights="
                                       "True shape a mixture of experts, and block='llama' has "
                                       "none; use block='moe'"):
    models.lm_layers(**sizes, block="llama", shared_expert_mlp_dim=8)
  with pytest.raises(ValueError, match="normalize_expert_weights=False .* block='gpt'"):
    models.lm_layers(**dict(sizes, positions="learned"), normalize_expert_weights=False)
  with pytest.raises(ValueError, match=r"shared_expert_mlp_dim must be an int >= 0 \(0: no "
                                       r"shared expert\), got -2"):
    models.lm_layers(**sizes, block="moe", num_experts=2, shared_expert_mlp_dim=-2)
  # A Qwen2-MoE-shaped block: the shared expert's weights beside the experts'.
  layers = models.lm_layers(**sizes, block="moe", num_experts=2, experts_per_token=1,
                            normalize_expert_weights=False, shared_expert_mlp_dim=12)
  block = layers[1].module
  assert (block.shared_expert_mlp_dim, block.normalize_expert_weights) == (12, False)


@pytest.mark.unit
def test_the_shared_expert_counts_in_the_active_flops():
  from tpipe.train.cli import throughput  # pylint: disable=g-import-not-at-top
  arguments = {"num_layers": 1, "width": 8, "num_heads": 2, "mlp_dim": 16, "vocab_size": 4,
               "block": "moe", "num_experts": 8, "experts_per_token": 2}
  per_token = throughput.lm_forward_flops_per_token
  shared = dict(arguments, shared_expert_mlp_dim=12)
  # Every token through the shared SwiGLU (three matrices) and its gate.
  assert per_token(shared, 4) - per_token(arguments, 4) == 2 * 8 * 12 * 3 + 2 * 8


# Outside the experts, the expert axis carries data inside a pipeline's stage.


def _lowered_rows(mesh_sizes, fn=None, shape=(16, 3)):
  """The StableHLO of ``moe.rows_over_expert`` (or ``fn``) on ``shape`` (``[8, 3]`` rows per
  stage) inside a ``shard_map`` manual over stage, as a pipeline's stage runs it."""
  mesh = tpipe.make_mesh(**mesh_sizes)
  body = jax.shard_map(fn or moe.rows_over_expert, mesh=mesh, in_specs=P("stage"),
                       out_specs=P("stage"), axis_names={"stage"})
  return jax.jit(body).lower(jnp.zeros(shape)).as_text()


@pytest.mark.unit
def test_rows_split_over_the_expert_axis_only_inside_a_stage_without_tensor():
  x = jnp.arange(12.0).reshape(4, 3)
  assert moe.rows_over_expert(x) is x and moe.rows_whole(x) is x  # No mesh.
  with jax.set_mesh(tpipe.make_mesh(stages=2, expert=4)):  # A mesh, no manual axis.
    assert moe.rows_over_expert(x) is x
  constraint = lambda text: [line for line in text.splitlines() if "sharding_constraint" in line]
  split = constraint(_lowered_rows(dict(stages=2, expert=4)))
  assert len(split) == 1 and '"expert"' in split[0]
  # 2 rows of 8 positions over 4 devices: each row's positions halved, the 4 pieces split.
  pieces = [line for line in constraint(_lowered_rows(dict(stages=2, expert=4), shape=(4, 8)))
            if '"expert"' in line]
  assert len(pieces) == 1 and "tensor<4x4xf32>" in pieces[0], pieces
  assert not constraint(_lowered_rows(dict(stages=2, expert=4), shape=(4, 3)))  # Neither.
  whole = constraint(_lowered_rows(dict(stages=2, expert=4), moe.rows_whole))
  assert len(whole) == 1 and '"expert"' not in whole[0]
  # Beside a tensor axis the TPU compiler's partitioner fails on the split: rows stay whole.
  assert not constraint(_lowered_rows(dict(stages=2, expert=2, tensor=2)))


def test_balance_counts_a_grouped_matmul_as_its_groups_not_as_every_expert():
  from tpipe.core.planning import unit_cost  # pylint: disable=g-import-not-at-top
  rows, k_dim, n_dim, groups = 24, 16, 32, 4
  sizes = jnp.array([5, 0, 12, 7], jnp.int32)
  product = lambda params, h, broadcast, per_example: experts.grouped_matmul(h, params["w"], sizes)
  params = {"w": jax.ShapeDtypeStruct((groups, k_dim, n_dim), jnp.float32)}
  h = jax.ShapeDtypeStruct((rows, k_dim), jnp.float32)
  flops = unit_cost.measure("flops", product, params, h, ((), ()))
  # The product and both gradients, 2 x rows x K x N each, whatever the groups (XLA:CPU's own
  # count of ragged_dot is a product with every group: 4x as many).
  assert flops == pytest.approx(6 * rows * k_dim * n_dim, rel=0.02)
  # Run (not counted), it is the grouped product itself.
  x = jax.random.normal(jax.random.key(0), (rows, k_dim))
  w = jax.random.normal(jax.random.key(1), (groups, k_dim, n_dim))
  starts = np.cumsum([0, 5, 0, 12])
  expected = np.concatenate([np.asarray(x[s:s + n]) @ np.asarray(w[g])
                             for g, (s, n) in enumerate(zip(starts, [5, 0, 12, 7]))])
  np.testing.assert_allclose(experts.grouped_matmul(x, w, sizes), expected, rtol=1e-5, atol=1e-5)
