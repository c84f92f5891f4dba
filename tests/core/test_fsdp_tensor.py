"""Pipelines on meshes with ``fsdp`` and ``tensor`` axes: equal to the sequential model, weights
split inside each stage, and the collectives where they belong.

The meshes are the issue's four on 8 devices: (stage 2, fsdp 2, tensor 2), (stage 4, fsdp 2),
(stage 2, tensor 2, data 2) and (stage 1, fsdp 8).
"""

import collections
import functools
import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import tpipe
from tpipe.core.layout import staging
from tests.helpers import linen_models as lm
from tests.helpers import numerics

MESHES = {
    "stage2-fsdp2-tensor2": dict(stages=2, fsdp=2, tensor=2),
    "stage4-fsdp2": dict(stages=4, fsdp=2),
    "stage2-tensor2-data2": dict(stages=2, tensor=2, data=2),
    "stage1-fsdp8": dict(stages=1, fsdp=8),
}


def _model(mesh_name, schedule, microbatches=None, **settings):
  sizes = MESHES[mesh_name]
  mesh = tpipe.make_mesh(**sizes)
  rows = sizes.get("data", 1) * sizes.get("fsdp", 1)
  if microbatches is None:
    microbatches = 3 if rows == 8 else 2
  layers, x, targets, _ = lm.loss_model("annotated")
  model = tpipe.Sequential(layers, num_stages=sizes["stages"], num_microbatches=microbatches,
                           schedule=schedule, per_example=("targets",), mesh=mesh, **settings)
  return model, mesh, x, targets, microbatches * rows


# A covering set, not a cross product (each case compiles its own pipelined step): each mesh,
# each schedule and each remat granularity at least once, and both schedules of two chunks per
# stage on the 3D mesh.
CASES = [
    ("stage2-fsdp2-tensor2", "gpipe", dict(remat="full", remat_granularity="nested")),
    ("stage4-fsdp2", "1f1b", dict(remat="full", remat_granularity="layer")),
    ("stage2-tensor2-data2", "zb_h1", {}),
    ("stage1-fsdp8", "gpipe", {}),
    # Two chunks per stage read windows of one packed buffer per stage (the embedding's chunk
    # and the head's on different stages), each window's fsdp blocks gathered.
    ("stage2-fsdp2-tensor2", "circular", dict(num_repeats=2)),
    ("stage2-fsdp2-tensor2", "zbv", dict(num_repeats=2)),
]


@pytest.mark.unit
def test_the_cases_cover_every_mesh_and_schedule():
  assert {case[0] for case in CASES} == set(MESHES)
  assert {case[1] for case in CASES} == {"gpipe", "1f1b", "zb_h1", "circular", "zbv"}


@pytest.mark.parametrize("mesh_name,schedule,settings", CASES)
def test_loss_and_gradients_equal_sequential(mesh_name, schedule, settings):
  model, mesh, x, targets, microbatches = _model(mesh_name, schedule, **settings)
  x, targets = jax.device_put((x, targets), tpipe.data_sharding(mesh))
  value, grads = jax.jit(lm.value_and_grad(lm.pipelined_loss(model), False))(
      lm.random_params("annotated"), x, targets)
  plain_value, plain_grads = lm.plain("annotated", microbatches)
  ref_value, ref_grads = lm.reference("annotated")
  numerics.assert_as_close_as_plain(value, plain_value, ref_value, what="loss")
  numerics.assert_as_close_as_plain(grads, plain_grads, ref_grads, what="gradients")


@functools.lru_cache(maxsize=None)
def _staged_step(mesh_name, schedule="gpipe"):
  """The compiled loss-and-gradient step on staged parameters placed as the layout's specs say,
  and its arguments: compiled once for the tests that run it or read its collectives."""
  model, mesh, x, targets, _ = _model(mesh_name, schedule)
  pipeline = model.pipeline_for(x, targets=targets)
  specs = pipeline.layout.partition_specs(mesh=mesh)
  shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs,
                           is_leaf=lambda s: isinstance(s, P))
  staged = jax.jit(functools.partial(staging.to_staged, pipeline.layout), out_shardings=shardings)(
      lm.random_params("annotated"))
  x, targets = jax.device_put((x, targets), tpipe.data_sharding(mesh))
  step = jax.jit(jax.value_and_grad(
      lambda p, x, t: pipeline.loss(p, x, {"targets": t}, mesh=mesh)),
      out_shardings=(None, shardings))
  return pipeline, step.lower(staged, x, targets).compile(), staged, x, targets


@pytest.mark.parametrize("mesh_name", ["stage2-fsdp2-tensor2", "stage1-fsdp8"])
def test_each_device_holds_its_share_of_the_weights_and_gradients(mesh_name):
  sizes = MESHES[mesh_name]
  pipeline, step, staged, x, targets = _staged_step(mesh_name)
  _, grads = step(staged, x, targets)
  total = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(staged))
  ways = sizes["stages"] * sizes.get("fsdp", 1) * sizes.get("tensor", 1)
  for tree in (staged, grads):
    per_device = collections.Counter()
    for leaf in jax.tree.leaves(tree):
      for shard in leaf.addressable_shards:
        per_device[shard.device] += shard.data.size * shard.data.dtype.itemsize
    # Every matrix of the blocks is split over fsdp and tensor; the LayerNorms' vectors over
    # fsdp only, and the packed embedding and head over fsdp: so a little over the share.
    share = total / ways
    assert max(per_device.values()) <= 1.3 * share, (per_device, share)
    assert min(per_device.values()) >= share / 1.3, (per_device, share)
  # The blocks' matrices carry their names: embed over fsdp, heads and mlp over tensor.
  blocks = jax.tree.map(lambda a: a.sharding.spec, staged["stacked"]["layers_1"])
  if sizes.get("tensor", 1) > 1:
    assert blocks["query"] == P(None, "stage", None, "fsdp", "tensor")
    assert blocks["mlp_out"] == P(None, "stage", None, "tensor", "fsdp")
  else:
    assert blocks["query"] == P(None, "stage", None, "fsdp")


def _collectives(text):
  """Counts of ``(collective, inside a conditional branch)`` in compiled HLO text."""
  found = collections.Counter()
  for line in text.splitlines():
    match = re.search(r"= \S+ (all-gather|all-reduce|reduce-scatter|collective-permute|"
                      r"all-to-all)(?:-start)?\(", line)
    if match:
      found[(match.group(1), "branch_" in line)] += 1
  return found


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_fsdp_gathers_and_scatters_inside_the_stage_and_sends_only_between_stages(schedule):
  _, compiled, _, _, _ = _staged_step("stage2-fsdp2-tensor2", schedule)
  found = _collectives(compiled.as_text())
  # The stage's branch gathers each unit's weights and reduce-scatters their gradients over
  # fsdp; stage-to-stage sends are the only collective-permutes, all outside the branches (one
  # inside would wait forever for the devices of the stages that took another branch).
  assert found[("all-gather", True)] > 0 and found[("reduce-scatter", True)] > 0, found
  assert found[("collective-permute", True)] == 0, found
  assert 0 < found[("collective-permute", False)] <= 4, found


def test_packed_buffers_are_padded_to_split_evenly_over_fsdp():
  # Embedding + 1 block | 3 blocks + head: one block per chunk stacked, two copies packed.
  model, mesh, x, targets, _ = _model("stage2-fsdp2-tensor2", "gpipe", balance=[2, 4])
  layout = model.pipeline_for(x, targets=targets).layout
  assert layout.packed_sizes and all(n % 2 == 0 for n in layout.packed_sizes.values()), (
      layout.packed_sizes)
  specs = layout.partition_specs(mesh=mesh)
  assert specs["packed"]["float32"] == P(None, "stage", "fsdp")
  # The embedding and the head (transposed) share one leaf, split as their names say (the 11
  # vocabulary rows do not divide over tensor: whole there).
  (shared,) = layout.shared
  assert shared.shape == (lm.VOCAB, 8) and shared.names == ("vocab", "embed")
  assert specs["shared"][shared.name] == P(None, "stage", None, "fsdp")
  # Without a mesh, the stage split alone.
  assert layout.partition_specs()["packed"]["float32"] == P(None, "stage")
  params = lm.random_params("annotated")
  # Jitted (eager dispatch compiles every small op): the padding changes no value.
  staged = jax.jit(functools.partial(staging.to_staged, layout))(params)
  back = jax.jit(functools.partial(staging.to_logical, layout))(staged)
  jax.tree.map(np.testing.assert_array_equal, back, params)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_nnx_front_end_on_a_3d_mesh_equals_the_layers_in_order(schedule):
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from tests.helpers import nnx_models  # pylint: disable=import-outside-toplevel

  mesh = tpipe.make_mesh(stages=2, fsdp=2, tensor=2)
  microbatches = 2
  model, x, kwargs = nnx_models.pipelined("lm", num_stages=2, num_microbatches=microbatches,
                                          schedule=schedule, mesh=mesh)
  x, kwargs = jax.device_put((x, kwargs), tpipe.data_sharding(mesh))

  @nnx.jit
  def value_and_grad(model, x, kwargs):
    return nnx.value_and_grad(lambda m: nnx_models.objective(m.loss(x, **kwargs)))(model)

  value, grads = value_and_grad(model, x, kwargs)
  # The rows split over fsdp too: the plain model runs on fsdp x M micro-batches.
  plain_value, plain_grads = nnx_models.plain_loss(2 * microbatches)
  ref_value, ref_grads = nnx_models.plain_loss(1, "float64")
  numerics.assert_as_close_as_plain(value, plain_value, ref_value, what="loss")
  numerics.assert_as_close_as_plain(nnx.to_pure_dict(grads)["layers"], plain_grads, ref_grads,
                                    what="gradients")


def test_nnx_out_sharding_metadata_names_the_axes():
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from tpipe import nnx as tnnx  # pylint: disable=import-outside-toplevel

  mesh = tpipe.make_mesh(stages=2, fsdp=2, tensor=2)
  init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("fsdp", "tensor"))
  with jax.set_mesh(mesh):
    layers = [nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(0)),
              nnx.Linear(16, 8, rngs=nnx.Rngs(1))]
  model = tnnx.Sequential(layers, num_stages=2, num_microbatches=2, mesh=mesh)
  axes = model.pipeline_for(jax.ShapeDtypeStruct((8, 8), np.float32)).layout.axes
  assert axes["layers_0"] == {"['bias']": None, "['kernel']": ("fsdp", "tensor")}
  assert axes["layers_1"]["['kernel']"] is None


def test_the_llama_train_step_has_no_collective_permute_inside_a_stage_branch():
  """The trainer's step for the Llama-style LM (query heads over tensor, a grouped key/value
  head whole): XLA's partitioner splits what runs inside a stage over tensor, and nothing tpipe
  packs (a chunk's plain layers, the residuals of a stage's branch) is left for it to split."""
  from configs import lm as lm_config  # pylint: disable=import-outside-toplevel
  from tpipe.train.cli import experiment  # pylint: disable=import-outside-toplevel

  config = lm_config.get_config("size=tiny")
  config.update(dict(num_stages=2, num_data=1, block="llama", num_kv_heads=1))
  config.mesh.update(dict(fsdp=2, tensor=2))
  exp = experiment.build(config)
  compiled = exp.train_step.lower(exp.abstract_state(), exp.abstract_batch(),
                                  jax.random.key(0)).compile()
  found = _collectives(compiled.as_text())
  assert found[("collective-permute", True)] == 0, found
  assert found[("all-gather", True)] > 0 and found[("reduce-scatter", True)] > 0, found


@pytest.mark.parametrize("mesh_name", ["stage2-fsdp2-tensor2", "stage4-fsdp2"])
def test_the_homogeneous_stack_equals_the_blocks_in_sequence(mesh_name):
  """``tpipe.pipeline`` (unannotated blocks: their weights split over fsdp on the largest
  dimension), outputs and gradients of a nonlinear function of them."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from tests.helpers import blocks  # pylint: disable=import-outside-toplevel

  sizes = MESHES[mesh_name]
  stages, microbatches = sizes["stages"], 2
  stack = tpipe.pipeline(blocks.MLPBlock, length=2 * stages, num_stages=stages,
                         num_microbatches=microbatches, remat="full",
                         mesh=tpipe.make_mesh(**sizes))(8)
  x = jax.random.normal(jax.random.key(1), (16, 8))
  params = jax.jit(stack.init)(jax.random.key(0), x)["params"]
  objective = lambda apply: jax.value_and_grad(lambda p, x: jnp.sum(jnp.sin(apply(p, x))),
                                               argnums=(0, 1))
  in_order = lambda mb: lambda p, x: blocks.apply_in_sequence(blocks.MLPBlock(8), p, x,
                                                              microbatches=mb)
  apply = lambda p, x: stack.apply({"params": p}, x)
  # One program for the objective's gradients and the outputs.
  got, out = jax.jit(lambda p, x: (objective(apply)(p, x), apply(p, x)))(params, x)
  plain = jax.jit(objective(in_order(2 * microbatches)))(params, x)
  reference = numerics.float64_reference(jax.jit(objective(in_order(1))), params, x)
  numerics.assert_as_close_as_plain(got, plain, reference, what="outputs' objective and grads")
  # The output is split over the stages as well as the rows: no stage holds the whole batch.
  rows = sizes.get("data", 1) * sizes.get("fsdp", 1)
  assert {s.data.shape[0] for s in out.addressable_shards} == {16 // (rows * stages)}


@pytest.mark.parametrize("mesh_name", ["stage2-fsdp2-tensor2", "stage2-tensor2-data2"])
def test_each_axis_communicates_where_it_should(mesh_name):
  """Per mesh axis, in the compiled step: ``stage`` sends between neighbours in the tick loop;
  ``data`` reduces the gradients once per step, outside it; ``fsdp`` gathers weights and
  reduce-scatters their gradients inside it (once per step outside it: the sum of what no
  dimension could split); ``tensor`` only inside the layers."""
  from tpipe.tools import analysis  # pylint: disable=import-outside-toplevel

  pipeline, compiled, _, _, _ = _staged_step(mesh_name)
  found = analysis.collectives(compiled,
                               tpipe.make_mesh(**MESHES[mesh_name]))
  by_axis = collections.defaultdict(list)
  for c in found:
    by_axis[c.axes].append(c)
  single = {("stage",), ("data",), ("fsdp",), ("tensor",)}
  in_loop = lambda cs: {c.kind for c in cs if c.in_loop}
  # The batch enters and leaves split over the stages as over the rows: what runs after the
  # pipeline (the loss's sum) reduces over rows and stages at once, once per step.
  for axes in set(by_axis) - single:
    assert "stage" in axes and "tensor" not in axes, axes
    assert not in_loop(by_axis[axes]) and all(c.count == 1 for c in by_axis[axes]), axes
  assert in_loop(by_axis[("stage",)]) == {"collective-permute"}, by_axis[("stage",)]
  outside = [c for c in by_axis[("data",)] + by_axis[("fsdp",)] if not c.in_loop]
  assert all(c.kind == "all-reduce" and c.count == 1 for c in outside), outside
  assert not in_loop(by_axis[("data",)]), by_axis[("data",)]
  if "fsdp" in mesh_name:
    assert in_loop(by_axis[("fsdp",)]) == {"all-gather", "reduce-scatter"}, by_axis[("fsdp",)]
    # One unit's weights at a time (or a chunk's packed buffer), never a stage's two blocks.
    block = sum(a.size * a.dtype.itemsize
                for a in jax.tree.leaves(pipeline.layout.logical["layers_1"])) // 4
    packed = sum(4 * n for n in pipeline.layout.packed_sizes.values())
    gathers = [c.bytes for c in by_axis[("fsdp",)] if c.kind == "all-gather"]
    assert max(gathers) <= max(block, packed) < 2 * block, (gathers, block, packed)
  else:
    assert [c.kind for c in by_axis[("data",)]] == ["all-reduce"], by_axis[("data",)]
  assert in_loop(by_axis[("tensor",)]) <= {"all-reduce", "all-gather", "reduce-scatter"}


def test_a_batch_that_the_row_shards_do_not_divide_is_a_clear_error():
  model, mesh, x, targets, _ = _model("stage1-fsdp8", "gpipe", microbatches=2)
  with pytest.raises(ValueError, match=r"batch size 24 is not divisible by num_microbatches \* "
                                       r"row shards \(data x fsdp devices\) = 2 \* 8 = 16"):
    model.apply({"params": lm.random_params("annotated")}, x, targets=targets, method="loss")


def _mixed_precision_lm(schedule):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from tpipe.train import models  # pylint: disable=import-outside-toplevel

  mesh = tpipe.make_mesh(**MESHES["stage2-fsdp2-tensor2"])
  return models.decoder_lm(num_layers=2, width=32, num_heads=2, mlp_dim=64, max_len=8,
                           dtype=jnp.bfloat16, vocab_chunks=2, num_stages=2,
                           num_microbatches=2, schedule=schedule, mesh=mesh)


@functools.cache
def _mixed_precision_inputs():
  """``(tokens, targets, params)``: the LM's logical parameters are the same whatever the
  schedule, initialized once for every schedule."""
  tokens, targets = (jax.random.randint(jax.random.key(k), (8, 8), 0, 256) for k in (0, 1))
  model = _mixed_precision_lm("gpipe")
  # "initialize": init's variables without tracing the pipelined forward pass.
  init = jax.jit(functools.partial(model.init, method="initialize"))
  return tokens, targets, init(jax.random.key(2), tokens, targets=targets)["params"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_weights_a_layer_only_casts_are_gathered_cast_with_the_same_gradients(
        schedule, monkeypatch):
  """A mixed-precision LM (float32 weights, bfloat16 compute, the loss in vocabulary slices):
  every weight its layer only casts is gathered in bfloat16, the head's kernel too (transposed
  and sliced before its cast), and the loss and gradients are those of gathering float32 and
  casting after: the same values, the gradients summed over fsdp in float32 either way."""
  from tpipe.core.programs import fsdp  # pylint: disable=import-outside-toplevel

  model = _mixed_precision_lm(schedule)
  tokens, targets, params = _mixed_precision_inputs()

  def step():  # Traced afresh: whether weights are gathered cast is decided while tracing.
    loss = lambda p: model.apply({"params": p}, tokens, targets=targets, method="loss")
    lowered = jax.jit(jax.value_and_grad(loss)).lower(params)
    gathered = re.findall(r"all_gather.*?-> tensor<([0-9x]+)x(bf16|f32)>", lowered.as_text())
    return (lowered.compile()(params),
            {(shape, dtype) for shape, dtype in gathered if "x" in shape})

  got, cast = step()
  monkeypatch.setattr(fsdp, "casts_before_gather", lambda whole, run: {})
  want, plain = step()
  # Each unit's matrices, the head's [vocabulary / tensor, width] kernel ("128x32") among them,
  # gathered in bfloat16, but for the position table, which the embedding adds as it is.
  assert {dtype for _, dtype in plain} == {"f32"}, plain
  assert {shape for shape, _ in cast} == {shape for shape, _ in plain}
  assert {shape for shape, dtype in cast if dtype == "f32"} == {"8x32"}, cast
  assert ("128x32", "bf16") in cast
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1])):
    a, b, name = np.asarray(a), np.asarray(b), jax.tree_util.keystr(path)
    assert a.dtype == b.dtype == np.float32, name
    # float32 sums in another order at most; bfloat16 sums would be ~1e-3 off.
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), name
