"""tpipe.Sequential: any sequence of layers, pipelined, equals running the layers in order.

Outputs and gradients (parameters and float inputs) against a float64 run of the plain sequential
model, for models whose layers change shapes, dtypes and pytree structure: an MLP whose width
changes at every layer, a small CNN whose layers change resolution and channels, an LM with
embedding -> repeated blocks -> head-and-loss with per-example targets, and a pytree whose
structure changes between layers. Eight cases cover every axis in one pass with the pairings
checked (:func:`test_the_cases_cover_every_pairing`): every stage count (1, 2, 4, 8) with both
micro-batch counts (1 and 2S) and both schedules, every stage count that fits with both data sizes,
every model with both schedules, and each schedule with every remat policy, every balance
("params", "flops", an uneven explicit list) and both data sizes.

Parameters in the engine's stage layout (``{"staged": {"stacked": ..., "packed": ...}}``) give the
same outputs and gradients as logical ones, bit for bit, and convert back exactly. Balances by
measured cost ("flops", "time") measure each distinct layer once, and split as
:func:`tpipe.partition.balanced_split` of what they measured; the tests never depend on how precise
a timing is.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpipe
from tests.helpers import numerics
from tests.helpers.linen_models import VOCAB, Block, DenseAct, Embed, HeadLoss, Residual
from tpipe import partition
from tpipe.core.layout import pack as layout_pack
from tpipe.core.layout import staging
from tpipe.core.planning import unit_cost

BATCH = 16
SEQ = 4


class ConvCell(nn.Module):
  """Conv + tanh; ``stride=2`` halves the resolution while the channels change."""

  features: int
  stride: int = 1

  @nn.compact
  def __call__(self, x):
    y = nn.Conv(self.features, (3, 3), strides=(self.stride, self.stride))(x)
    return jnp.tanh(y) if self.stride > 1 or x.shape[-1] != self.features else x + jnp.tanh(y)


class PoolClassify(nn.Module):
  classes: int = 5

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.classes)(jnp.mean(x, axis=(1, 2)))


class Split(nn.Module):
  """array -> {"h": [B, 6], "s": [B]}"""

  @nn.compact
  def __call__(self, x):
    return {"h": nn.Dense(6)(x), "s": jnp.sum(x, axis=-1)}


class Mix(nn.Module):
  """{"h", "s"} -> {"h", "s"}, or -> (h', s') with ``to_tuple``."""

  to_tuple: bool = False

  @nn.compact
  def __call__(self, d):
    h = jnp.tanh(nn.Dense(6)(d["h"]) + d["s"][:, None])
    s = d["s"] * 0.5 + jnp.mean(h, axis=-1)
    return (h, s) if self.to_tuple else {"h": h, "s": s}


class Merge(nn.Module):
  """(h, s) -> [B, 3]"""

  @nn.compact
  def __call__(self, pair):
    h, s = pair
    return nn.Dense(3)(h * s[:, None])


def _model(name):
  """(layers, x, keyword arguments, per_example names, float inputs differentiated?)"""
  key = jax.random.key(42)
  if name == "mlp":
    layers = [DenseAct(16), tpipe.Repeat(Residual(), 12), DenseAct(32), DenseAct(16),
              nn.Dense(4)]
    return layers, jax.random.normal(key, (BATCH, 8)), {}, (), True
  if name == "cnn":
    layers = [ConvCell(4), tpipe.Repeat(ConvCell(4), 6), ConvCell(8, stride=2),
              tpipe.Repeat(ConvCell(8), 6), ConvCell(16, stride=2), PoolClassify()]
    return layers, jax.random.normal(key, (BATCH, 8, 8, 1)), {}, (), True
  if name == "lm":
    k1, k2 = jax.random.split(key)
    tokens = jax.random.randint(k1, (BATCH, SEQ), 0, VOCAB)
    targets = jax.random.randint(k2, (BATCH, SEQ), 0, VOCAB)
    layers = [Embed(), tpipe.Repeat(Block(), 14), HeadLoss()]
    return layers, tokens, {"targets": targets}, ("targets",), False
  layers = [DenseAct(8), Split(), tpipe.Repeat(Mix(), 12), Mix(to_tuple=True), Merge()]
  return layers, jax.random.normal(key, (BATCH, 5)), {}, (), True


MODELS = ("mlp", "cnn", "lm", "pytree")
REMATS = ("full", "none", "dots")


def _sequential(layers, params, x, microbatches=1, **kwargs):
  """The plain model: every layer in order, on ``microbatches`` contiguous micro-batches of the
  batch (concatenated), as the pipeline splits it. Exact arithmetic gives the same result for any
  count; float32 on XLA:CPU rounds differently per row count (see tests/blocks.py)."""
  if microbatches > 1:
    split = lambda a: a.reshape(microbatches, -1, *a.shape[1:])
    ys = jax.lax.map(lambda xk: _sequential(layers, params, xk[0], **xk[1]),
                     (jax.tree.map(split, x), jax.tree.map(split, kwargs)))
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), ys)
  h = x
  for i, layer in enumerate(layers):
    p = params[f"layers_{i}"]
    if isinstance(layer, tpipe.Repeat):
      for j in range(layer.n):
        h = layer.module.apply({"params": jax.tree.map(lambda a, j=j: a[j], p)}, h)
    else:
      accepted = {k: v for k, v in kwargs.items() if k == "targets" and isinstance(layer, HeadLoss)}
      h = layer.apply({"params": p}, h, **accepted)
  return h


def _loss(apply, float_input):
  """A weighted sum of the outputs, differentiated by params (and x when it is float)."""

  def loss(params, x, kwargs):
    y = apply(params, x, **kwargs)
    weights = jax.tree.map(
        lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype)).reshape(a.shape), y)
    return sum(jnp.vdot(a, w) for a, w in zip(jax.tree.leaves(y), jax.tree.leaves(weights))), y

  return jax.value_and_grad(loss, argnums=(0, 1) if float_input else 0, has_aux=True)


@functools.cache
def _reference(name):
  """Params (from init) and the float64 plain model's outputs and gradients."""
  layers, x, kwargs, per_example, float_input = _model(name)
  model = tpipe.Sequential(layers, num_stages=1, num_microbatches=1, per_example=per_example)
  params = jax.jit(functools.partial(model.init, method="initialize"))(
      {"params": jax.random.key(0)}, x, **kwargs)["params"]
  plain_fn = jax.jit(_loss(functools.partial(_sequential, layers), float_input))
  (_, y64), grads64 = numerics.float64_reference(plain_fn, params, x, kwargs)
  return params, (y64, grads64)


@functools.cache
def _plain(name, microbatches):
  """The float32 plain model's outputs and gradients on the pipeline's micro-batches."""
  layers, x, kwargs, _, float_input = _model(name)
  params, _ = _reference(name)
  apply = functools.partial(_sequential, layers, microbatches=microbatches)
  (_, y), grads = jax.jit(_loss(apply, float_input))(params, x, kwargs)
  return y, grads


# (model, schedule, stages, micro-batches, data, remat, balance); see the docstring.
# A model's two cases mostly share M * data, and so the plain model's compiled run.
CASES = [("mlp", "gpipe", 1, 1, 1, "full", "params"),
         ("cnn", "circular", 1, 2, 2, "dots", "flops"),
         ("lm", "circular", 2, 1, 2, "none", "explicit"),
         ("cnn", "gpipe", 2, 4, 1, "full", "explicit"),
         ("lm", "gpipe", 4, 1, 2, "dots", "flops"),
         ("pytree", "circular", 4, 8, 1, "full", "params"),
         ("mlp", "circular", 8, 1, 1, "dots", "flops"),
         ("pytree", "gpipe", 8, 16, 1, "none", "explicit")]


def test_the_cases_cover_every_pairing():
  pairs = lambda a, b: {(case[a], case[b]) for case in CASES}
  schedules = ("gpipe", "circular")
  assert {case[2:4] for case in CASES} == {(s, m) for s in (1, 2, 4, 8) for m in {1, 2 * s}}
  assert pairs(2, 1) == {(s, k) for s in (1, 2, 4, 8) for k in schedules}
  assert pairs(2, 4) == {(s, d) for s in (1, 2, 4, 8) for d in (1, 2) if s * d <= 8}
  assert pairs(0, 1) == {(n, k) for n in MODELS for k in schedules}
  assert pairs(1, 5) == {(k, r) for k in schedules for r in REMATS}
  assert pairs(1, 6) == {(k, b) for k in schedules for b in ("params", "flops", "explicit")}
  assert pairs(1, 4) == {(k, d) for k in schedules for d in (1, 2)}
  assert all(BATCH % (m * d) == 0 for _, _, _, m, d, _, _ in CASES)


def _balance(kind, layers, chunks):
  if kind != "explicit":
    return kind
  units = sum(layer.n if isinstance(layer, tpipe.Repeat) else 1 for layer in layers)
  # Uneven on purpose: the first chunks take one unit each, the last the rest.
  return [1] * (chunks - 1) + [units - (chunks - 1)]


@functools.cache
def _pipelined(name, schedule, stages, microbatches, data, remat, balance):
  """A case's jitted ``(params, x, kwargs) -> ((loss, outputs), grads)`` and its inputs placed
  on its mesh: built once for the tests that run it (the check with layers out of order too)."""
  layers, x, kwargs, per_example, float_input = _model(name)
  repeats = 2 if schedule == "circular" else 1
  mesh = tpipe.make_mesh(stages=stages, data=data)
  model = tpipe.Sequential(
      layers, num_stages=stages, num_microbatches=microbatches, schedule=schedule,
      num_repeats=repeats, balance=_balance(balance, layers, stages * repeats), remat=remat,
      per_example=per_example, mesh=mesh)
  apply = lambda params, x, **kw: model.apply({"params": params}, x, **kw)
  sharding = tpipe.data_sharding(mesh)
  return jax.jit(_loss(apply, float_input)), jax.device_put((x, kwargs), sharding)


@pytest.mark.parametrize("name,schedule,stages,microbatches,data,remat,balance", CASES)
def test_outputs_and_gradients_equal_sequential(name, schedule, stages, microbatches, data, remat,
                                                balance):
  params, reference = _reference(name)
  plain = _plain(name, microbatches * data)
  grad_fn, (x, kwargs) = _pipelined(name, schedule, stages, microbatches, data, remat, balance)
  (_, y), grads = grad_fn(params, x, kwargs)
  numerics.assert_as_close_as_plain(y, plain[0], reference[0], what="outputs")
  numerics.assert_as_close_as_plain(grads, plain[1], reference[1], what="gradients")


def test_the_check_fails_for_layers_out_of_order():
  """The Repeat's copies reversed, through the program of the MLP's 8-stage case (compiled
  once for both tests)."""
  case = ("mlp", "circular", 8, 1, 1, "dots", "flops")
  assert case in CASES
  params, reference = _reference("mlp")
  plain = _plain("mlp", 1)
  swapped = dict(params)
  swapped["layers_1"] = jax.tree.map(lambda a: a[::-1], params["layers_1"])
  grad_fn, (x, kwargs) = _pipelined(*case)
  (_, y), _ = grad_fn(swapped, x, kwargs)
  with pytest.raises(AssertionError):
    numerics.assert_as_close_as_plain(y, plain[0], reference[0], what="outputs")


def test_params_use_the_logical_layout_whatever_the_pipeline():
  layers, x, kwargs, per_example, _ = _model("lm")
  trees = []
  for stages, schedule, repeats, balance in ((1, "gpipe", 1, "params"), (4, "gpipe", 1, "flops"),
                                             (2, "circular", 2, [1, 5, 5, 5])):
    model = tpipe.Sequential(layers, num_stages=stages, num_microbatches=2, schedule=schedule,
                             num_repeats=repeats, balance=balance, per_example=per_example,
                             mesh=tpipe.make_mesh(stages=stages))
    # Jitted (eager dispatch compiles every small op of the forward pass init runs).
    trees.append(jax.jit(model.init)({"params": jax.random.key(0)}, x, **kwargs)["params"])
  assert sorted(trees[0]) == ["layers_0", "layers_1", "layers_2"]
  assert {a.shape[0] for a in jax.tree.leaves(trees[0]["layers_1"])} == {14}
  for tree in trees[1:]:
    jax.tree.map(np.testing.assert_array_equal, tree, trees[0])
  kernels = trees[0]["layers_1"]["Dense_0"]["kernel"]
  assert not np.allclose(kernels[0], kernels[1]), "each copy needs its own initial values"


@functools.cache
def _random_params(name):
  """Logical params of model ``name``, every element its own random value. Cheap: the shapes come
  from an abstract init and the values from NumPy (eager jax.random would compile per shape)."""
  layers, x, kwargs, per_example, _ = _model(name)
  model = tpipe.Sequential(layers, num_stages=1, num_microbatches=1, per_example=per_example)
  shapes = jax.eval_shape(functools.partial(model.init, method="initialize"),
                          {"params": jax.random.key(0)}, x, **kwargs)["params"]
  rng = np.random.default_rng(7)
  return jax.tree.map(lambda a: jnp.asarray(0.3 * rng.standard_normal(a.shape), a.dtype), shapes)


# Each model, each schedule and each data size once (the layouts themselves are
# test_to_logical_inverts_to_staged_exactly's; a full product costs compile time and covers
# nothing the staged path depends on).
@pytest.mark.parametrize("name,schedule,data", [("mlp", "circular", 2), ("lm", "gpipe", 1)])
def test_staged_params_give_the_same_outputs_and_gradients(name, schedule, data):
  """The staged path runs the program the logical path runs after packing its params, so the
  loss and outputs are equal bit for bit, and the gradients (converted back with to_logical) as
  close to the float64 logical run's as the logical path's are (the two programs differ by the
  packing around the pipeline, which XLA may fuse into a reduction and sum in another order)."""
  layers, x, kwargs, per_example, float_input = _model(name)
  params = _random_params(name)
  repeats = 2 if schedule == "circular" else 1
  mesh = tpipe.make_mesh(stages=2, data=data)
  model = tpipe.Sequential(layers, num_stages=2, num_microbatches=2, schedule=schedule,
                           num_repeats=repeats, remat="none", per_example=per_example,
                           mesh=mesh)
  layout = model.stage_layout(x, **kwargs)
  fixed = model.with_split(layout)
  x, kwargs = jax.device_put((x, kwargs), tpipe.data_sharding(mesh))
  logical = jax.jit(_loss(lambda p, x, **kw: model.apply({"params": p}, x, **kw), float_input))
  staged = jax.jit(_loss(lambda s, x, **kw: fixed.apply({"params": {"staged": s}}, x, **kw),
                         float_input))
  (loss, y), grads = logical(params, x, kwargs)
  staged_params = jax.jit(functools.partial(staging.to_staged, layout))(params)
  (staged_loss, staged_y), staged_grads = staged(staged_params, x, kwargs)
  to_logical = jax.jit(functools.partial(staging.to_logical, layout))
  staged_grads = ((to_logical(staged_grads[0]), staged_grads[1]) if float_input
                  else to_logical(staged_grads))
  np.testing.assert_array_equal(staged_loss, loss)
  jax.tree.map(np.testing.assert_array_equal, staged_y, y)
  assert jax.tree.structure(staged_grads) == jax.tree.structure(grads)
  _, grads64 = numerics.float64_reference(logical, params, x, kwargs)
  numerics.assert_as_close_as_plain(staged_grads, grads, grads64, what="staged gradients")


# (stages, schedule, repeats, balance); "uneven" is [1] * 7 + [the rest].
SPLITS = {"one stage": (1, "gpipe", 1, "params"), "two stages": (2, "gpipe", 1, "params"),
          "circular uneven": (4, "circular", 2, "uneven"), "zbv": (2, "zbv", 2, "params")}
# Each model with two splits, each split with two models (ZB-V's reversed placement and the
# uneven circular split both on the CNN, whose two Repeats give the most chunk boundaries).
INVERSE_CASES = [("mlp", ("two stages", "circular uneven")), ("cnn", ("circular uneven", "zbv")),
                 ("lm", ("one stage", "zbv")), ("pytree", ("one stage", "two stages"))]


def test_the_inverse_cases_cover_every_model_and_split_twice():
  assert [name for name, _ in INVERSE_CASES] == list(MODELS)
  splits = [split for _, pair in INVERSE_CASES for split in pair]
  assert sorted(splits) == sorted(list(SPLITS) * 2)


@pytest.mark.parametrize("name,splits", INVERSE_CASES, ids=[name for name, _ in INVERSE_CASES])
def test_to_logical_inverts_to_staged_exactly(name, splits):
  layers, x, kwargs, per_example, _ = _model(name)
  params = _random_params(name)
  units = sum(layer.n if isinstance(layer, tpipe.Repeat) else 1 for layer in layers)
  for stages, schedule, repeats, balance in (SPLITS[split] for split in splits):
    balance = [1] * 7 + [units - 7] if balance == "uneven" else balance
    model = tpipe.Sequential(layers, num_stages=stages, num_microbatches=1, schedule=schedule,
                             num_repeats=repeats, balance=balance, per_example=per_example)
    layout = model.stage_layout(x, **kwargs)
    # Jitted one at a time (eager dispatch compiles every small op; XLA sees no pair to cancel).
    staged = jax.jit(functools.partial(staging.to_staged, layout))(params)
    assert sorted(staged) == ["packed", "shared", "stacked"]
    assert jax.tree.map(np.shape, staged) == jax.tree.map(lambda a: a.shape,
                                                          layout.staged_shapes())
    # A Repeat with copies in every chunk keeps the fewest any chunk has per leaf, stacked.
    for i, k in layout.stacked.items():
      for leaf in jax.tree.leaves(staged["stacked"][f"layers_{i}"]):
        assert leaf.shape[:3] == (repeats, stages, k), (i, leaf.shape)
    back = jax.jit(functools.partial(staging.to_logical, layout))(staged)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
      assert got.dtype == want.dtype
      np.testing.assert_array_equal(got, want)
    if schedule == "zbv":  # The second chunks run back up: stage s holds chunk 2S - 1 - s.
      loop = model.clone(schedule="circular").stage_layout(x, **kwargs)
      assert loop.groups == layout.groups
      assert loop.stacked == layout.stacked
      looped = jax.jit(functools.partial(staging.to_staged, loop))(params)
      jax.tree.map(lambda v, leaf: np.testing.assert_array_equal(v[1], leaf[1, ::-1]),
                   staged["stacked"], looped["stacked"])
      # Each chunk reads the same variables wherever its stage holds it (the placements may
      # pack and share their plain layers' matrices differently).
      for c in range(layout.num_chunks):
        jax.tree.map(np.testing.assert_array_equal,
                     layout_pack.chunk_trees(layout, layout.chunk_local(staged, c), c),
                     layout_pack.chunk_trees(loop, loop.chunk_local(looped, c), c))


def test_staged_params_made_for_another_split_are_rejected():
  layers, x, _, _, _ = _model("mlp")
  params = _random_params("mlp")
  make = lambda stages: tpipe.Sequential(layers, num_stages=stages, num_microbatches=1,
                                         mesh=tpipe.make_mesh(stages=stages))
  staged = jax.eval_shape(functools.partial(staging.to_staged, make(4).stage_layout(x)), params)
  with pytest.raises(ValueError, match=r"^tpipe.Sequential's staged parameters have shapes "
                                       r"\{'packed': \{'float32': \(1, 4, \d+\)\}.*\}, but this "
                                       r"model's stage layout needs \{'packed': \{'float32': "
                                       r"\(1, 2, \d+\)\}.*made for another split"):
    two = make(2)
    jax.eval_shape(two.with_split(two.stage_layout(x)).apply, {"params": {"staged": staged}}, x)


def test_staged_params_need_an_explicit_split():
  layers, x, _, _, _ = _model("mlp")
  params = _random_params("mlp")
  model = tpipe.Sequential(layers, num_stages=2, num_microbatches=1, balance="flops",
                           mesh=tpipe.make_mesh(stages=2))
  staged = jax.eval_shape(functools.partial(staging.to_staged, model.stage_layout(x)), params)
  with pytest.raises(ValueError, match=r"with_split\(layout\) \(balance='flops'"):
    jax.eval_shape(model.apply, {"params": {"staged": staged}}, x)


def test_logical_and_staged_params_do_not_mix():
  layers, x, _, _, _ = _model("mlp")
  params = _random_params("mlp")
  model = tpipe.Sequential(layers, num_stages=2, num_microbatches=1,
                           mesh=tpipe.make_mesh(stages=2))
  to_staged = functools.partial(staging.to_staged, model.stage_layout(x))
  mixed = {"staged": jax.eval_shape(to_staged, params), "layers_0": params["layers_0"]}
  with pytest.raises(ValueError, match=r"params hold \['layers_0', 'staged'\]; staged params "
                                       r"are .* alone"):
    jax.eval_shape(model.apply, {"params": mixed}, x)


def test_a_step_from_logical_params_builds_their_staged_copy_once():
  # Embedding, 6 blocks and head on 4 stages: 1 block per chunk stacked, the rest packed. A
  # stack of per-chunk slices, and a stack of per-stage packed buffers that end in zeros, made
  # XLA keep a copy of the whole staged leaf per stage: 2.9x the parameters in temporaries.
  from tpipe.train import models  # pylint: disable=g-import-not-at-top
  mesh = tpipe.make_mesh(stages=4)
  model = models.decoder_lm(num_layers=6, width=64, num_heads=4, mlp_dim=256, max_len=16,
                            num_stages=4, num_microbatches=4, schedule="gpipe",
                            balance=[2, 2, 2, 2], mesh=mesh)
  tokens = jax.ShapeDtypeStruct((8, 16), jnp.int32)
  params = model.variable_shapes(tokens, targets=tokens)["params"]
  assert model.stage_layout(tokens, targets=tokens).packed_sizes  # Some blocks are packed.
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  loss = lambda p, x, t: model.apply({"params": p}, x, targets=t, method="loss")
  step = jax.jit(jax.grad(loss), in_shardings=(
      jax.tree.map(lambda _: replicated, params), replicated, replicated))
  memory = step.lower(params, tokens, tokens).compile().memory_analysis()
  param_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
  assert memory.temp_size_in_bytes <= 1.5 * param_bytes


class Wide(nn.Module):
  """8 -> 512 -> 8: about 64 times the FLOPs of an 8 -> 8 Dense, with the same input and output."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(8)(jnp.tanh(nn.Dense(512)(x)))


def test_flops_balance_gives_the_heavy_layer_a_stage_of_its_own():
  layers = [nn.Dense(8), nn.Dense(8), Wide(), nn.Dense(8), nn.Dense(8)]
  x = jnp.ones((BATCH, 8))
  model = tpipe.Sequential(layers, num_stages=3, num_microbatches=1, balance="flops",
                           mesh=tpipe.make_mesh(stages=3))
  variables = jax.eval_shape(model.init, {"params": jax.random.key(0)}, x)
  summary = model.partition_summary(variables, x)
  rows = {line.split()[0]: line for line in summary.splitlines() if line.split()[0].isdigit()}
  assert "layers_2 Wide" in rows["1"] and "Dense" not in rows["1"], summary
  assert "layers_1" in rows["0"] and "layers_3" in rows["2"], summary


@pytest.fixture
def measurements(monkeypatch):
  """Every unit measurement as (kind, cost), in order, starting from an empty cost cache."""
  calls = []
  measure = unit_cost.measure

  def recording(kind, *args):
    calls.append((kind, measure(kind, *args)))
    return calls[-1][1]

  monkeypatch.setattr(unit_cost, "measure", recording)
  monkeypatch.setattr(unit_cost, "_CACHE", {})
  return calls


def _counts(layout):
  return tuple(sum(g.stop - g.start for g in chunk) for chunk in layout.groups)


class Heavy(nn.Module):
  """8 -> 1024 -> 1024 -> 8: hundreds of times the work of an 8 -> 8 Dense on the same input."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(8)(jnp.tanh(nn.Dense(1024)(jnp.tanh(nn.Dense(1024)(x)))))


def test_time_balance_gives_the_heavy_layer_a_stage_of_its_own(measurements):
  layers = [nn.Dense(8)] * 3 + [Heavy()] + [nn.Dense(8)] * 2
  model = tpipe.Sequential(layers, num_stages=3, num_microbatches=1, balance="time")
  layout = model.stage_layout(jnp.ones((BATCH, 8)))
  # The five equal Dense layers share one measurement.
  assert [kind for kind, _ in measurements] == ["time", "time"], measurements
  light, heavy = (cost for _, cost in measurements)
  assert light > 0 and heavy > 0
  assert _counts(layout) == partition.balanced_split([light] * 3 + [heavy] + [light] * 2, 3)
  alone = [chunk for chunk in layout.groups if [g.layer for g in chunk] == [3]]
  assert len(alone) == 1, (layout.groups, measurements)


@pytest.mark.parametrize("balance", ["flops", "time"])
def test_costs_are_measured_once_per_distinct_layer_and_shapes(measurements, balance):
  layers, x, _, _, _ = _model("mlp")  # DenseAct(16), Repeat(Residual(), 12), DenseAct(32), ...
  model = tpipe.Sequential(layers, num_stages=2, num_microbatches=2, balance=balance,
                           mesh=tpipe.make_mesh(stages=2))
  variables = jax.eval_shape(model.init, {"params": jax.random.key(0)}, x)
  # Five layers, five measurements: the Repeat once, for one copy, though it is 12 units.
  assert len(measurements) == 5 and all(kind == balance for kind, _ in measurements)
  costs = [cost for _, cost in measurements]
  assert all(cost > 0 for cost in costs), costs
  layout = model.stage_layout(x)
  unit_costs = costs[:1] + costs[1:2] * 12 + costs[2:]
  assert _counts(layout) == partition.balanced_split(unit_costs, 2)
  # Tracing again (apply, under jit or not; another layout or summary) measures nothing.
  jax.eval_shape(model.apply, variables, x)
  jax.eval_shape(jax.jit(model.apply), variables, x)
  model.partition_summary(variables, x)
  assert len(measurements) == 5
  # Another micro-batch size is another input shape: measured again.
  model.clone(num_microbatches=4).stage_layout(x)
  assert len(measurements) == 10


def test_explicit_balance_summary_shows_parameter_counts():
  layers = [nn.Dense(8), nn.Dense(8), Wide(), nn.Dense(8)]
  model = tpipe.Sequential(layers, num_stages=2, num_microbatches=1, balance=[3, 1],
                           mesh=tpipe.make_mesh(stages=2))
  x = jnp.ones((BATCH, 8))
  variables = jax.eval_shape(functools.partial(model.init, method="initialize"),
                             {"params": jax.random.key(0)}, x)
  summary = model.partition_summary(variables, x)
  rows = {line.split()[0]: line.split() for line in summary.splitlines()
          if line.split()[0].isdigit()}
  dense, wide = 8 * 8 + 8, 8 * 512 + 512 + 512 * 8 + 8
  assert rows["0"][-2] == f"{2 * dense + wide:,}" and rows["1"][-2] == f"{dense:,}", summary


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(layers=[]), TypeError, "non-empty list of layers"),
    (dict(layers=[nn.Dense]), TypeError, r"layers\[0\] is .*Module instance or a tpipe.Repeat"),
    (dict(layers=[nn.Dense(2)] * 3, num_stages=4), ValueError, "3 layer units but"),
    (dict(balance="speed"), ValueError, "Unknown balance 'speed'"),
    (dict(balance=[3, 3]), ValueError, "sums to 6"),
    (dict(balance=[4, 0]), ValueError, "at least one"),
    (dict(per_example=("mask",)), ValueError, "per_example names 'mask', which no layer"),
    (dict(per_example="targets"), TypeError, r"write per_example=\('targets',\)"),
    (dict(schedule="zigzag"), ValueError, "Unknown schedule"),
    (dict(remat="sometimes"), ValueError, "Unknown remat"),
    (dict(mesh=tpipe.make_mesh(stages=4)), ValueError, "num_stages=2 but the 'stage' axis"),
])
def test_bad_configuration_is_rejected_at_construction(kwargs, error, match):
  config = dict(layers=[nn.Dense(4)] * 4, num_stages=2, num_microbatches=2)
  config.update(kwargs)
  with pytest.raises(error, match=match):
    tpipe.Sequential(**config)


def test_repeat_validation_and_bad_calls():
  with pytest.raises(TypeError, match="Module instance"):
    tpipe.Repeat(nn.Dense, 2)
  with pytest.raises(ValueError, match="Repeat n must be >= 1"):
    tpipe.Repeat(nn.Dense(2), 0)
  widen = tpipe.Sequential([tpipe.Repeat(nn.Dense(5), 2)], num_stages=1, num_microbatches=1)
  with pytest.raises(ValueError, match=r"^tpipe.Sequential: layers\[0\] repeats Dense, which maps "
                                       r".*must keep its input's structure"):
    widen.init({"params": jax.random.key(0)}, jnp.ones((4, 3)))
  model = tpipe.Sequential([nn.Dense(4)] * 2, num_stages=1, num_microbatches=3)
  with pytest.raises(ValueError, match=r"^tpipe.Sequential: batch size 4 is not divisible"):
    model.init({"params": jax.random.key(0)}, jnp.ones((4, 3)))
  with pytest.raises(TypeError, match=r"^tpipe.Sequential: no layer's call takes the keyword "
                                      r"argument\(s\) \['colour'\]"):
    tpipe.Sequential([nn.Dense(4)] * 2, num_stages=1, num_microbatches=1).init(
        {"params": jax.random.key(0)}, jnp.ones((4, 3)), colour=1)
  layers, x, kwargs, per_example, _ = _model("lm")
  model = tpipe.Sequential(layers, num_stages=1, num_microbatches=2, per_example=per_example)
  with pytest.raises(ValueError, match=r"per-example argument 'targets' .* shape \(8, 4\)"):
    model.init({"params": jax.random.key(0)}, x, targets=kwargs["targets"][:8])


def test_sown_values_raise_when_asked_for_and_are_dropped_otherwise():
  """As tpipe.pipeline (tests/linen/test_call_arguments.py) and tpipe.nnx (a sown
  nnx.Intermediate, tests/nnx/test_sequential.py): the pipeline returns no sown values, so a
  collection the caller made mutable and a layer writes to is refused, before anything runs."""

  class Sows(nn.Module):

    @nn.compact
    def __call__(self, x):
      y = nn.Dense(4)(x)
      self.sow("intermediates", "out", y)
      return y

  model = tpipe.Sequential([nn.Dense(4), Sows()], num_stages=2, num_microbatches=2,
                           mesh=tpipe.make_mesh(stages=2))
  x = jnp.ones((4, 3))
  variables = jax.jit(model.init)({"params": jax.random.key(0)}, x)
  assert set(variables) == {"params"}
  jax.jit(model.apply)(variables, x)  # Not asked for: nothing to return, as in plain Flax.
  with pytest.raises(ValueError, match=r"layers\[1\] \(Sows\) failed .*tpipe.Sequential: Sows "
                                       r"writes to the variable collection\(s\) "
                                       r"\['intermediates'\] \(with self.sow\).*call apply "
                                       r"without mutable=\['intermediates'\]"):
    model.apply(variables, x, mutable=["intermediates"])


def test_a_layer_taking_any_keyword_accepts_per_example_names():

  class Weighted(nn.Module):

    @nn.compact
    def __call__(self, x, **kwargs):
      return nn.Dense(4)(x) * kwargs["weight"][:, None]

  model = tpipe.Sequential([nn.Dense(4), Weighted()], num_stages=1, num_microbatches=2,
                           per_example=("weight",))
  x, weight = jnp.ones((4, 3)), jnp.arange(4.0)
  variables = jax.jit(model.init)({"params": jax.random.key(0)}, x, weight=weight)
  y = jax.jit(model.apply)(variables, x, weight=weight)
  np.testing.assert_array_equal(y[0], np.zeros(4))  # weight 0 on the first example only
  assert np.all(y[1:] != 0)
