"""``remat_granularity``: what a chunk checkpoints with its remat policy, one piece at a time.

``"chunk"`` (the default) checkpoints the whole chunk; its lowered program is unchanged, so the
other tests cover it. ``"layer"`` and an int ``k`` checkpoint every ``k`` layer units: the loss and
gradients still equal the layers in order (numerics rule: :mod:`tests.helpers.numerics`), under
GPipe (backward by autodiff through the tick loop) and 1F1B (explicit per-tick VJP), for chunks
that mix plain layers with part of a Repeat and leave a Repeat remainder shorter than ``k``, and
through ``tpipe.pipeline``'s uniform stack. ``tpipe.nnx`` hands the granularity to the engine too.

Memory is checked with compile-time quantities: for a chunk of wide layers under
``remat="full"``, ``"layer"`` lowers the compiled step's per-device temporaries well below
``"chunk"``, since the backward holds one layer's intermediates instead of all of them. The chunk
is a Repeat (a scan over pieces): XLA:CPU's buffer assignment does not reflect the per-piece
order of straight-line (plain-layer) pieces, which a memory-aware scheduler (GPU, TPU) keeps.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tpipe
from tests.helpers import blocks
from tests.helpers import linen_models as lm
from tests.helpers import numerics
from tpipe.core.planning import backward_plan
from tpipe.core.planning import remat as remat_lib
from tpipe.tools import flops as flops_lib
from tpipe.tools import hlo

# (model, schedule, granularity, remat, balance): a chunk of plain layers and Repeat units, the
# Repeat's remainder shorter than k, and each remat policy within the pieces. A covering set, not
# a cross product (each case compiles its own step): "layer", k = 2 and "nested" each under GPipe
# and 1F1B, k = 2 under ZB-H1, each remat policy, balance and model at least once ("chunk", the
# default, is every other pipelined test's).
CASES = [
    ("mlp", "gpipe", "layer", "full", [2, 5]),
    ("lm", "gpipe", 2, "none", "params"),
    ("mlp", "1f1b", "layer", "dots", [2, 5]),
    ("mlp", "1f1b", 2, "full", [2, 5]),
    ("mlp", "zb_h1", 2, "full", [2, 5]),  # the split backward's taps inside the pieces
    ("mlp", "gpipe", "nested", "full", [2, 5]),
    ("mlp", "1f1b", "nested", "dots", "params"),
]
STAGES, MICROBATCHES = 2, 3


# Under remat="full" the loss's backward runs one unit at a time with the gradients summed in
# place for every fused schedule and for forward ones (as their fused table) with "chunk" or
# "nested": more layouts of it.
# A covering set: each schedule, each granularity, data replicas and each model once.
BY_UNITS_CASES = [
    ("lm", dict(schedule="gpipe", remat_granularity="chunk", data=2)),
    ("mlp", dict(schedule="circular", num_repeats=2, remat_granularity="nested")),
    ("mlp", dict(schedule="interleaved_1f1b", num_repeats=2, remat_granularity="layer")),
    ("lm", dict(schedule="zbv", num_repeats=2, remat_granularity=2)),
]


def _check_equal_sequential(name, schedule, remat, balance="params", data=1, **settings):
  layers, x, targets, float_input = lm.loss_model(name)
  mesh = tpipe.make_mesh(stages=STAGES, data=data)
  microbatches = MICROBATCHES if data == 1 else 2
  model = tpipe.Sequential(layers, num_stages=STAGES, num_microbatches=microbatches,
                           schedule=schedule, remat=remat, balance=balance,
                           per_example=("targets",), mesh=mesh, **settings)
  x, targets = jax.device_put((x, targets), tpipe.data_sharding(mesh))
  value, grads = jax.jit(lm.value_and_grad(lm.pipelined_loss(model), float_input))(
      lm.random_params(name), x, targets)
  plain_value, plain_grads = lm.plain(name, microbatches * data)
  ref_value, ref_grads = lm.reference(name)
  numerics.assert_as_close_as_plain(value, plain_value, ref_value, what="loss")
  numerics.assert_as_close_as_plain(grads, plain_grads, ref_grads, what="gradients")


@pytest.mark.parametrize("name,schedule,granularity,remat,balance", CASES)
def test_loss_and_gradients_equal_sequential(name, schedule, granularity, remat, balance):
  _check_equal_sequential(name, schedule, remat, balance, remat_granularity=granularity)


@pytest.mark.parametrize("name,settings", BY_UNITS_CASES)
def test_backward_by_units_equals_sequential(name, settings):
  _check_equal_sequential(name, remat="full", **settings)


def test_pipeline_pieces_of_k_layers_equal_sequential():
  """``tpipe.pipeline``: 4 layers per chunk in pieces of 3 (one scanned piece and a remainder)."""
  block, length = blocks.MLPBlock(8), 8
  x = jax.random.normal(jax.random.key(1), (8, 8))
  stack = tpipe.pipeline(blocks.MLPBlock, length=length, num_stages=2, num_microbatches=2,
                         remat_granularity=3, mesh=tpipe.make_mesh(stages=2))(8)
  params = jax.jit(stack.init)(jax.random.key(0), x)["params"]
  loss = lambda apply: jax.value_and_grad(lambda p, x: jnp.sum(jnp.sin(apply(p, x))),
                                          argnums=(0, 1))
  sequential = lambda mb: lambda p, x: blocks.apply_in_sequence(block, p, x, microbatches=mb)
  got = jax.jit(loss(lambda p, x: stack.apply({"params": p}, x)))(params, x)
  plain = jax.jit(loss(sequential(2)))(params, x)
  reference = numerics.float64_reference(jax.jit(loss(sequential(1))), params, x)
  numerics.assert_as_close_as_plain(got, plain, reference, what="loss and gradients")


class WideMLP(nn.Module):
  """``x + W2 gelu(W1 x)`` with a 4x hidden layer: 8 activations of intermediates per layer."""

  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(4 * x.shape[-1])(x)))


class MeanSquare(nn.Module):

  @nn.compact
  def __call__(self, x, targets):
    return jnp.mean((x - targets) ** 2, axis=-1)


ROWS, WIDTH, LAYERS = 1024, 128, 8


def _temporaries(schedule, granularity, microbatches=1, method="loss", rows=ROWS, devices=None):
  """Per-device temporary bytes of :func:`_compiled_step`."""
  if devices is None:  # Compiled once for the tests that read it (its FLOPs: _step_flops).
    compiled = _cached_step(schedule, granularity, microbatches, method, rows)
  else:
    compiled = _compiled_step(schedule, granularity, microbatches, method, rows, devices)
  return compiled.memory_analysis().temp_size_in_bytes


def _compiled_step(schedule, granularity, microbatches=1, method="loss", rows=ROWS,
                   devices=None):
  """The compiled gradient step: one stage, a chunk of ``LAYERS`` wide layers under
  ``remat="full"``. ``method="loss"`` differentiates the model's loss (a fused schedule's
  backward runs inside it; under remat full with "chunk" or "nested", every schedule's backward
  runs one unit at a time); ``"apply"`` differentiates the mean of its outputs by autodiff
  through the tick loop (forward schedules only)."""
  layers = [tpipe.Repeat(WideMLP(), LAYERS), MeanSquare()]
  x = jax.ShapeDtypeStruct((rows, WIDTH), jnp.float32)
  model = tpipe.Sequential(layers, num_stages=1, num_microbatches=microbatches,
                           schedule=schedule,
                           remat="full", remat_granularity=granularity,
                           per_example=("targets",), mesh=tpipe.make_mesh(stages=1,
                                                                          devices=devices))
  if method == "loss":
    loss_fn = lm.pipelined_loss(model)
  else:
    loss_fn = lambda p, x, t: jnp.mean(model.apply({"params": p}, x, targets=t))
  params = jax.eval_shape(functools.partial(model.init, method="initialize"),
                          {"params": jax.random.key(0)}, x, targets=x)["params"]
  return jax.jit(jax.grad(loss_fn)).lower(params, x, x).compile()


_cached_step = functools.cache(_compiled_step)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_layer_granularity_lowers_the_temporaries_of_a_chunk(schedule):
  chunk, layer = _temporaries(schedule, "chunk"), _temporaries(schedule, "layer")
  nested = _temporaries(schedule, "nested")
  # Measured: about 211 vs 36 activations (gpipe) and 235 vs 47 (1f1b), i.e. 5-6x.
  assert layer * 3 < chunk, (chunk, layer)
  assert nested * 3 < chunk, (chunk, nested)


def test_nested_granularity_stashes_one_input_per_chunk_across_ticks():
  """Autodiff through GPipe's ticks keeps each micro-batch's stash until the backward:
  ``"layer"`` keeps every unit's input there, ``"nested"`` only the chunk's, with the same
  one-unit backward."""
  microbatches = 8
  layer, nested = (_temporaries("gpipe", g, microbatches, method="apply")
                   for g in ("layer", "nested"))
  # Per micro-batch, "layer" stashes LAYERS - 1 more unit inputs of ROWS / M x WIDTH floats.
  saved = microbatches * (LAYERS - 1) * (ROWS // microbatches) * WIDTH * 4
  assert layer - nested >= 0.75 * saved, (layer, nested, saved)  # measured: 1.14x saved


def test_backward_by_units_sums_gradients_in_place():
  """The loss's backward one unit at a time, parameter gradients added into the running sums
  inside the loop over the chunk's units, against autodiff through the same GPipe ticks, which
  builds every tick's whole parameter gradient before adding it: the same FLOPs ("nested") in a
  fraction of the temporaries."""
  microbatches = 4
  by_units = _temporaries("gpipe", "nested", microbatches)
  autodiff = _temporaries("gpipe", "nested", microbatches, method="apply")
  assert 2 * by_units < autodiff, (by_units, autodiff)  # Measured: 4.2 MB against 13.2 MB.
  # 1F1B's backward ticks are the same ones, with its stash bounded in S: "layer" and "nested"
  # are one program there, no larger than GPipe's at this M.
  one_f_one_b = _temporaries("1f1b", "layer", microbatches)
  assert one_f_one_b == _temporaries("1f1b", "nested", microbatches)
  assert one_f_one_b <= by_units, (one_f_one_b, by_units)


@pytest.mark.unit
@pytest.mark.parametrize("schedule,repeats,remat,granularity,expected", [
    ("1f1b", 1, "full", "layer", True),
    ("zbv", 2, "full", 2, True),
    ("1f1b", 1, "full", "chunk", True),
    ("1f1b", 1, "dots", "layer", False),
    ("gpipe", 1, "full", "nested", True),
    ("gpipe", 1, "full", "chunk", True),  # one recompute keeping every unit's residuals
    ("circular", 2, "full", "nested", True),
    ("circular", 2, "full", "chunk", True),
    ("gpipe", 1, "full", "layer", False),  # keeps every piece's input: one forward less
    ("gpipe", 1, "none", "nested", False),
    ("gpipe", 1, "dots", "chunk", False),
])
def test_which_settings_run_the_backward_by_units(schedule, repeats, remat, granularity, expected):
  spec = tpipe.PipelineSpec(num_stages=2, num_microbatches=4, schedule=schedule,
                            num_repeats=repeats, remat=remat, remat_granularity=granularity)
  assert backward_plan.resolve(spec).by_units is expected


def _norm_relative(a, b):
  a, b = jax.tree.leaves(a), jax.tree.leaves(b)
  diff = sum(float(np.sum((np.asarray(x, np.float64) - y) ** 2)) for x, y in zip(a, b))
  return (diff / sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in b)) ** 0.5


def _step_flops(schedule, granularity):
  """Executed FLOPs per device (:func:`tpipe.tools.flops.flop_count`; a conditional counts its
  costliest branch) of the compiled loss gradient of :func:`_temporaries`' model, one
  micro-batch (the step test_layer_granularity_lowers_the_temporaries_of_a_chunk compiles)."""
  return flops_lib.flop_count(_cached_step(schedule, granularity, 1, "loss", ROWS)).executed


def test_chunk_backward_by_units_keeps_the_residuals_and_sums_in_place():
  """With ``"chunk"`` granularity the loss's backward recomputes each chunk once keeping every
  unit's residuals (its VJP), then runs the units backwards with their parameter gradients
  added into the running sums in place: autodiff's FLOPs through the same checkpoint, in fewer
  temporaries, and one forward per unit fewer than ``"nested"``."""
  microbatches, rows = 4, 256
  by_units = _temporaries("gpipe", "chunk", microbatches, rows=rows)
  autodiff = _temporaries("gpipe", "chunk", microbatches, method="apply", rows=rows)
  assert by_units < 0.8 * autodiff, (by_units, autodiff)  # Measured: 7.5 MB against 12.0 MB.
  # Both run the same two-tick table; a unit's forward is 2 * 2 * ROWS * WIDTH * 4 * WIDTH
  # FLOPs, and nested's backward tick runs one more of them per unit.
  unit_forward = 16 * ROWS * WIDTH * WIDTH
  extra = _step_flops("gpipe", "nested") - _step_flops("gpipe", "chunk")
  assert extra >= 0.9 * LAYERS * unit_forward, (extra, LAYERS * unit_forward)


def test_on_the_tpu_compiler_the_chunk_backward_by_units_needs_fewer_temporaries():
  """The in-place sums matter most to the TPU compiler, which reserves about as much again for a
  chunk's whole parameter gradient (experiments/tpu_memory.py): the same comparison compiled
  for one chip of ``v5p:2x2x2``. Skips where libtpu is not installed."""
  try:
    devices = tpipe.topology_devices("v5p:2x2x2")
  except ValueError as error:
    pytest.skip(f"the TPU compiler is not installed here: {error}")
  by_units = _temporaries("gpipe", "chunk", 4, rows=256, devices=devices)
  autodiff = _temporaries("gpipe", "chunk", 4, method="apply", rows=256, devices=devices)
  assert by_units < 0.95 * autodiff, (by_units, autodiff)  # Measured: 8.9 MB against 10.1 MB.


class CastMLP(nn.Module):
  """``x + tanh(W x + b)`` computing in ``dtype`` on float32 parameters (Flax's ``Dense`` casts
  ``W`` and ``b`` on every call; ``None``: the input's dtype)."""

  dtype: object = jnp.bfloat16

  @nn.compact
  def __call__(self, x):
    return x + jnp.tanh(nn.Dense(x.shape[-1], dtype=self.dtype)(x)).astype(x.dtype)


def _cast_model(dtype, rows=16, width=512, layers=8, stages=1):
  model = tpipe.Sequential([tpipe.Repeat(CastMLP(dtype), layers), MeanSquare()],
                           num_stages=stages, num_microbatches=2, remat="full",
                           remat_granularity="chunk", per_example=("targets",),
                           mesh=tpipe.make_mesh(stages=stages))
  x = jax.ShapeDtypeStruct((rows, width), jnp.float32)
  params = jax.eval_shape(functools.partial(model.init, method="initialize"),
                          {"params": jax.random.key(0)}, x, targets=x)["params"]
  return model, params, x


def test_chunk_backward_casts_the_weights_again_instead_of_keeping_the_casts():
  """Under ``"chunk"`` the recomputed forward keeps every unit's residuals, but not the bfloat16
  casts of the units' weights (:mod:`tpipe.core.programs.weight_casts`): the backward casts each
  unit's weights again from the float32 ones. So the step's temporaries with bfloat16 layers are no
  larger than with float32 ones, where keeping the casts added one bfloat16 copy of every
  weight of the chunk (measured: 8.4 MB either way; 12.9 MB when the casts were kept)."""
  temporaries = {}
  for dtype in (jnp.bfloat16, jnp.float32):
    model, params, x = _cast_model(dtype)
    assert backward_plan.resolve(model.spec).by_units
    compiled = jax.jit(jax.grad(lm.pipelined_loss(model))).lower(params, x, x).compile()
    temporaries[dtype] = compiled.memory_analysis().temp_size_in_bytes
  one_layer_cast = 512 * 512 * 2
  assert temporaries[jnp.bfloat16] < temporaries[jnp.float32] + one_layer_cast, temporaries


def test_chunk_backward_of_bfloat16_layers_is_as_accurate_as_sequential():
  """The casts the backward makes again give the gradients the layers' own casts give: the
  pipelined bfloat16 loss and gradients are as close to float64 as the bfloat16 layers run in
  sequence are."""
  model, shapes, _ = _cast_model(jnp.bfloat16, layers=4, width=16, stages=2)
  rng = np.random.default_rng(3)
  params = jax.tree.map(lambda a: jnp.asarray(0.3 * rng.standard_normal(a.shape), a.dtype),
                        shapes)
  x, targets = (jnp.asarray(rng.standard_normal((16, 16)), jnp.float32) for _ in range(2))

  def sequential(dtype):
    layers = [tpipe.Repeat(CastMLP(dtype), 4), MeanSquare()]
    return lambda p, x, t: jnp.mean(lm.losses_in_order(layers, p, x, t, 2))

  grad = lambda fn: jax.jit(jax.value_and_grad(fn))
  got = grad(lm.pipelined_loss(model))(params, x, targets)
  plain = grad(sequential(jnp.bfloat16))(params, x, targets)
  reference = numerics.float64_reference(grad(sequential(None)), params, x, targets)
  numerics.assert_as_close_as_plain(got, plain, reference, what="loss and gradients")


def test_chunk_backward_by_units_reads_side_inputs_again_and_equals_sequential():
  """Under ``"chunk"`` the kept residuals leave out the unit's variables and the side inputs a
  unit uses as they are (a broadcast gain, a per-example gate here), which the backward reads
  again: the loss and the gradients of the parameters and of every float side input equal the
  layers run in sequence."""
  width, batch = 8, 12
  block = blocks.SideInputBlock(width)
  layers = [tpipe.Repeat(block, 4), MeanSquare()]
  keys = jax.random.split(jax.random.key(5), 6)
  x, gate, targets = (jax.random.normal(k, (batch, width)) for k in keys[:3])
  bias = jax.random.normal(keys[3], (width,))
  extras = {"gain": jax.random.normal(keys[4], (width,)),
            "shift": jax.random.normal(keys[5], (width,))}
  model = tpipe.Sequential(layers, num_stages=2, num_microbatches=3, remat="full",
                           remat_granularity="chunk", per_example=("gate", "targets"),
                           mesh=tpipe.make_mesh(stages=2))
  assert backward_plan.resolve(model.spec).by_units
  init = jax.jit(functools.partial(model.init, method="initialize"))  # Equal to init's.
  params = init(jax.random.key(0), x, gate=gate, bias=bias, extras=extras,
                targets=targets)["params"]

  def pipelined(p, gate, bias, extras, x, targets):
    return model.apply({"params": p}, x, gate=gate, bias=bias, extras=extras, targets=targets,
                       method="loss")

  def sequential(p, gate, bias, extras, x, targets):
    # The layers in order on each micro-batch of 4 rows (its own slice of the gate).
    parts = [blocks.apply_in_sequence(block, p["layers_0"], x[i:i + 4], gate[i:i + 4], bias,
                                      extras) for i in range(0, batch, 4)]
    return jnp.mean(MeanSquare().apply({}, jnp.concatenate(parts), targets))

  grad = lambda fn: jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2, 3)))
  args = (params, gate, bias, extras, x, targets)
  got, plain = grad(pipelined)(*args), grad(sequential)(*args)
  reference = numerics.float64_reference(grad(sequential), *args)
  numerics.assert_as_close_as_plain(got, plain, reference, what="loss and gradients")


@pytest.mark.parametrize("granularity", ["layer", "chunk"])
def test_backward_by_units_replays_the_dropout_masks(granularity):
  """Each unit recomputed in the by-units backward draws the masks its forward drew: the
  gradients equal autodiff's through the same ticks to rounding (float32 differences between
  two programs, about 1e-7), where other masks change them by O(1)."""
  layers = [tpipe.Repeat(blocks.DropoutBlock(8), 4), MeanSquare()]
  kx, kt = jax.random.split(jax.random.key(3))
  x, targets = jax.random.normal(kx, (16, 8)), jax.random.normal(kt, (16, 8))
  model = tpipe.Sequential(layers, num_stages=2, num_microbatches=4, remat="full",
                           remat_granularity=granularity, per_example=("targets",),
                           mesh=tpipe.make_mesh(stages=2))
  init = jax.jit(functools.partial(model.init, method="initialize"))  # Equal to init's.
  params = init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x,
                targets=targets)["params"]

  # One program for both keys: the key is an argument, not a constant of the trace.
  by_units = jax.jit(jax.grad(lambda p, key: model.apply(
      {"params": p}, x, targets=targets, method="loss", rngs={"dropout": key})))

  autodiff = jax.jit(jax.grad(lambda p: jnp.mean(model.apply(
      {"params": p}, x, targets=targets, rngs={"dropout": jax.random.key(7)}))))(params)
  assert _norm_relative(by_units(params, jax.random.key(7)), autodiff) < 1e-4
  assert _norm_relative(by_units(params, jax.random.key(8)), autodiff) > 1e-1


BAD_GRANULARITIES = [
    ("block", ValueError, "Unknown remat_granularity 'block'"),
    (0, ValueError, "remat_granularity must be >= 1"),
    (-2, ValueError, "remat_granularity must be >= 1"),
    (1.5, TypeError, "remat_granularity must be one of"),
    (True, TypeError, "remat_granularity must be one of"),
    (None, TypeError, "remat_granularity must be one of"),
]


@pytest.mark.unit
@pytest.mark.parametrize("granularity,error,match", BAD_GRANULARITIES)
def test_bad_granularity_is_rejected_at_construction(granularity, error, match):
  with pytest.raises(error, match=match):
    tpipe.Sequential([nn.Dense(4), nn.Dense(4)], num_stages=1, num_microbatches=1,
                     remat_granularity=granularity)
  with pytest.raises(error, match=match):
    tpipe.pipeline(blocks.MLPBlock, length=2, num_stages=1, num_microbatches=1,
                   remat_granularity=granularity)
  with pytest.raises(error, match=match):
    tpipe.PipelineSpec(num_stages=1, num_microbatches=1, remat_granularity=granularity)


@pytest.mark.parametrize("granularity,error,match", BAD_GRANULARITIES)
def test_bad_granularity_is_rejected_by_nnx_at_construction(granularity, error, match):
  layers = [nnx.Linear(4, 4, rngs=nnx.Rngs(0))]  # Creating the layer runs JAX: not a unit test.
  with pytest.raises(error, match=match):
    tpipe.nnx.Sequential(layers, num_stages=1, num_microbatches=1,
                         remat_granularity=granularity)


def _checkpoints(jaxpr) -> int:
  """How many ``jax.checkpoint`` regions a jaxpr holds, nested ones included."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name in ("checkpoint", "remat", "remat2")
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      count += _checkpoints(sub)
  return count


def test_nnx_passes_the_granularity_to_the_engine():
  """With a granularity of 1 the chunk's program holds one more checkpoint per layer unit than
  with ``"chunk"`` (the remat pieces of :func:`tpipe.core.planning.remat.apply_units`)."""
  x = jnp.ones((4, 4))

  def checkpoints(granularity):
    model = tpipe.nnx.Sequential([nnx.Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(3)],
                                 num_stages=1, num_microbatches=2,
                                 remat_granularity=granularity)
    assert model.spec.remat_granularity == granularity
    assert model.pipeline_for(x).spec.remat_granularity == granularity
    return _checkpoints(jax.make_jaxpr(lambda x: model(x))(x).jaxpr)

  chunk, layer = checkpoints("chunk"), checkpoints(1)
  assert layer == chunk + 3, (chunk, layer)


@pytest.mark.unit
def test_remat_none_runs_every_granularity_as_chunk():
  """Under ``remat="none"`` the granularity in effect is ``"chunk"``; a bad one still raises."""
  for granularity in ("chunk", "layer", "nested", 2):
    spec = tpipe.PipelineSpec(num_stages=1, num_microbatches=1, remat="none",
                              remat_granularity=granularity)
    assert spec.granularity == "chunk"
    assert spec.remat_granularity == granularity  # As given: spec.replace(remat=...) keeps it.
    assert spec.replace(remat="full").granularity == granularity
  with pytest.raises(ValueError, match="Unknown remat_granularity 'block'"):
    tpipe.PipelineSpec(num_stages=1, num_microbatches=1, remat="none", remat_granularity="block")


@pytest.mark.parametrize("stages,microbatches", [(1, 1), (2, 2)])
def test_remat_none_is_one_program_at_every_granularity(stages, microbatches):
  """With nothing to recompute the granularity must not change the program (issue 58: pieces
  under a save-everything checkpoint re-rolled ``unroll=True`` into a loop over pieces, 1.16x
  the plain step's time at S = 1, M = 1): the gradient's jaxpr is the same text at every
  granularity, with only the chunk's own checkpoints (the tick's, which keeps everything but the
  parameter slice), and the compiled programs run the same FLOPs; at S = 1 the unrolled layers
  compile to no loop."""
  x = jax.random.normal(jax.random.key(1), (8, 8))
  found = {}
  for granularity in ("chunk", "layer", "nested", 2):
    stack = tpipe.pipeline(blocks.MLPBlock, length=4, num_stages=stages,
                           num_microbatches=microbatches, remat="none", unroll=True,
                           remat_granularity=granularity, mesh=tpipe.make_mesh(stages=stages))(8)
    params = jax.eval_shape(stack.init, jax.random.key(0), x)["params"]
    grad = jax.grad(lambda p, x, stack=stack: jnp.sum(jnp.sin(stack.apply({"params": p}, x))))
    traced = jax.jit(grad).trace(params, x)
    compiled = traced.lower().compile()
    loops = len(hlo.parse_hlo(compiled.as_text()).loops())
    found[granularity] = (str(traced.jaxpr), _checkpoints(traced.jaxpr.jaxpr),
                          flops_lib.flop_count(compiled).executed, loops)
  chunk = found.pop("chunk")
  for granularity, (text, checkpoints, flops, loops) in found.items():
    assert text == chunk[0], f"remat_granularity={granularity!r} changed the jaxpr"
    assert (checkpoints, flops, loops) == chunk[1:], (granularity, chunk[1:])
  if stages == 1:
    assert chunk[3] == 0, chunk  # unroll=True: no loop over layers (nor over pieces).


def test_tick_policy():
  spec = lambda remat, granularity: tpipe.PipelineSpec(
      num_stages=2, num_microbatches=2, remat=remat, remat_granularity=granularity)
  assert remat_lib.tick_policy(spec("full", "nested")) is remat_lib.FULL
  # Other settings: the chunk's own remat policy (a checkpoint policy function), never FULL.
  policy = remat_lib.tick_policy(spec("none", "nested"))
  assert remat_lib.chunk_policy("none", "nested") is not None
  assert callable(policy) and policy is not remat_lib.FULL
