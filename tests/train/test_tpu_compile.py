"""Compiling for a TPU slice on this CPU machine: the TPU compiler (libtpu, installed with the
test extra on Linux x86-64) builds a small 3D pipeline's train step for ``v5p:2x2x2`` (8 chips:
stage 2 x fsdp 2 x tensor 2), and its program keeps every collective where it belongs. Nothing
runs on a TPU. Skips, saying why, where libtpu is not installed."""

import collections
import re
import math

import jax
import pytest

import tpipe
from configs import lm
from tests.helpers import linen_models
from tpipe.tools import analysis
from tpipe.tools import hlo
from tpipe.train.cli import experiment

TOPOLOGY = "v5p:2x2x2"


def _tpu_devices():
  """The slice's devices; skips, saying why, where the TPU compiler is not installed."""
  try:
    return tpipe.topology_devices(TOPOLOGY)
  except ValueError as error:
    pytest.skip(f"the TPU compiler is not installed here: {error}")


@pytest.fixture(scope="module")
def tpu_step():
  devices = _tpu_devices()
  config = lm.get_config("size=tiny")
  # The Llama block: query heads over tensor, a grouped key/value head whole, every matrix
  # named for fsdp; XLA's partitioner splits what runs inside a stage over tensor.
  # Width 256: a device's part of the embedding (shared with the head) is [128, 128], whole
  # TPU tiles (at the tiny config's width 32 the tiles would pad it eightfold).
  config.update(dict(num_stages=2, num_data=1, block="llama", num_kv_heads=1, width=256,
                     mlp_dim=512))
  config.mesh.update(dict(fsdp=2, tensor=2))
  exp = experiment.build(config, devices=devices)
  state = exp.abstract_state()
  compiled = exp.train_step.lower(state, exp.abstract_batch(), jax.random.key(0)).compile()
  return exp, state, compiled


def test_the_tpu_compiler_builds_the_step_for_the_slice(tpu_step):
  exp, state, compiled = tpu_step
  assert {d.platform for d in exp.mesh.devices.flat} == {"tpu"}
  assert dict(exp.mesh.shape) == {"data": 1, "fsdp": 2, "stage": 2, "expert": 1, "tensor": 2}
  assert ":T(8,128)" in compiled.as_text()  # TPU tiled layouts: not XLA:CPU's program.
  # Each device's arguments hold its share of the state (the TPU pads small arrays to tiles).
  share = sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
              for leaf in jax.tree.leaves(state))
  memory = compiled.memory_analysis()
  assert share <= memory.argument_size_in_bytes < 4 * share, (share, memory)


def test_collectives_on_the_tpu_stay_where_they_belong(tpu_step):
  exp, _, compiled = tpu_step
  found = analysis.collectives(compiled, exp.mesh)
  by_axis = collections.defaultdict(list)
  for c in found:
    by_axis[c.axes].append(c)
  in_loop = lambda cs: {c.kind for c in cs if c.in_loop}
  # Stage-to-stage sends are the tick loop's only collectives over stage, and no
  # collective-permute sits inside a stage's branch (the devices of the stages that took
  # another branch would never join it).
  assert in_loop(by_axis[("stage",)]) == {"collective-permute"}, by_axis[("stage",)]
  permutes = [c for c in found if c.kind == "collective-permute"]
  assert permutes and all(c.axes == ("stage",) and not c.in_branch for c in permutes), permutes
  # Inside the stage: fsdp gathers each unit's weights (the TPU compiler may reduce their
  # gradients with an all-reduce where a reduce-scatter's blocks are not tile aligned), tensor
  # works inside the layers; neither crosses stages.
  assert "all-gather" in in_loop(by_axis[("fsdp",)]), by_axis[("fsdp",)]
  assert any(c.in_branch for c in by_axis[("fsdp",)]), "the stage's branch gathers its weights"
  assert in_loop(by_axis[("fsdp",)]) <= {"all-gather", "reduce-scatter", "all-reduce"}
  assert in_loop(by_axis[("tensor",)]) and in_loop(by_axis[("tensor",)]) <= {
      "all-gather", "reduce-scatter", "all-reduce", "all-to-all"}
  # What spans several axes (the loss's sums over rows and stages) runs once, after the loop.
  for axes in set(by_axis) - {("stage",), ("fsdp",), ("tensor",)}:
    assert not in_loop(by_axis[axes]) and all(c.count == 1 for c in by_axis[axes]), axes


def _tick_body_order(text: str, ops=("send", "recv", "send-done", "recv-done")) -> list[str]:
  """In the fused tick loop's body (the computation whose switch picks among the action
  branches: idle and the forwards of the model's two chunk programs, their backwards each in a
  conditional of its own, tpipe.core.loops.tick_rows.lane_groups), the order of the instructions
  ``ops`` (by default its DCN sends and receives: ``send``/``recv`` to the megascale runtime,
  with their rendezvous) and of the action conditionals (each ``COMPUTE``)."""
  for computation in re.split(r"\n(?=\S)", text):
    order, switch = [], False
    for line in computation.split("\n"):
      branches = re.search(r" conditional\(.*branch_computations=\{([^}]*)\}", line)
      if branches:
        switch = switch or len(branches.group(1).split(",")) >= 3
        order.append("COMPUTE")
        continue
      op = re.search(r" (" + "|".join(map(re.escape, ops)) + r")\(", line)
      rendezvous = re.search(r'_xla_host_transfer_rendezvous="([^"]*)"', line)
      if op and rendezvous:
        order.append(f"{op.group(1)}:{rendezvous.group(1)}")
      elif op:
        order.append(op.group(1))
    if switch:
      return order
  raise AssertionError("no tick loop with an action switch in the program")


def _tpu_1f1b_program(mesh, delay, microbatches=4) -> str:
  """The compiled TPU program of 1F1B's loss gradient on ``mesh`` (4 stages)."""
  layers, x, targets, _ = linen_models.loss_model("blocks")
  # One action per tick, so each tick has one action conditional for the sends to be ordered
  # around (a compound tick runs several, one per lane).
  model = tpipe.Sequential(layers, num_stages=4, num_microbatches=microbatches, schedule="1f1b",
                           per_example=("targets",), mesh=mesh, transfer_delay=delay,
                           tick_costs="plain")
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), x, targets=targets,
                                             method="initialize"))["params"]
  sharding = tpipe.data_sharding(mesh)
  abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in (x, targets)]
  loss = lambda p, x, t: model.apply({"params": p}, x, targets=t, method="loss")
  return model.spec.delays, jax.jit(jax.grad(loss)).lower(params, *abstract).compile().as_text()


@pytest.mark.parametrize("delay", [None, 0])
def test_a_delayed_dcn_send_runs_beside_the_ticks_compute(delay):
  """1F1B on two v5p:2x2x1 slices, stage over DCN: XLA turns the sends between slices into DCN
  transfers (send/recv to the megascale runtime). Delayed (the default on those links) each is
  issued before the tick's action conditional and waited for after it; without the delay each
  is waited for before the compute that needs it. Three cross link 1: activations right,
  gradients left, and the inputs' conveyor left to stage 0 (M = 8: streamed with or without
  the delay)."""
  try:
    devices = tpipe.topology_devices("v5p:2x2x1", num_slices=2)
  except ValueError as error:
    pytest.skip(f"the TPU compiler is not installed here: {error}")
  mesh = tpipe.make_mesh(stages=4, data=2, dcn={"stage": 2}, devices=devices)
  delays, text = _tpu_1f1b_program(mesh, delay, microbatches=8)
  assert delays == ((0, 1, 0, 1) if delay is None else (0, 0, 0, 0))
  order = _tick_body_order(text)
  computes = [i for i, op in enumerate(order) if op == "COMPUTE"]
  sends = [i for i, op in enumerate(order) if op.startswith("send:")]
  waits = [i for i, op in enumerate(order) if op in ("send-done", "recv-done")]
  assert len(sends) == 3 and len(waits) == 6, order
  assert max(sends) < min(computes)
  if delay is None:
    assert min(waits) > max(computes), order
  else:
    assert max(waits) < min(computes), order


def test_on_one_slice_the_compiler_starts_a_delayed_exchange_after_the_compute():
  """What the README states as a limit: inside one slice (ICI) the TPU compiler starts a delayed
  link's collective-permute after the tick's action conditional, as an undelayed one's, so the
  exchange does not yet run beside the compute there. If this fails, the compiler overlaps it
  now: update the README's fused-schedules note (issue 19)."""
  try:
    devices = tpipe.topology_devices("v5p:2x2x1")
  except ValueError as error:
    pytest.skip(f"the TPU compiler is not installed here: {error}")
  mesh = tpipe.make_mesh(stages=4, devices=devices)
  for delay in (1, 0):
    delays, text = _tpu_1f1b_program(mesh, delay)
    assert delays == (delay,) * 4
    order = _tick_body_order(text, ops=("collective-permute-start", "collective-permute-done"))
    computes = [i for i, op in enumerate(order) if op == "COMPUTE"]
    permutes = [i for i, op in enumerate(order) if op.startswith("collective-permute")]
    assert permutes and min(permutes) > max(computes), order


def test_gradients_cross_slices_once_per_step_as_each_devices_share():
  """Data over DCN: two v5p:2x2x1 slices, the data axis (4) spanning both, two of its devices in
  each. The step's one gradient sum over data becomes, in the TPU compiler's multislice program,
  a sum within each slice, a DCN exchange (send/recv to the megascale runtime) of each device's
  half of it, and a gather within the slice: a gradient leaf of n bytes crosses DCN as n / 2 per
  device, once per step, not whole. tpipe's part is one sum over the data axis per step, with
  the axis's slices outermost (make_mesh's dcn=); the compiler makes it hierarchical."""
  try:
    devices = tpipe.topology_devices("v5p:2x2x1", num_slices=2)
  except ValueError as error:
    pytest.skip(f"the TPU compiler is not installed here: {error}")
  config = lm.get_config("size=tiny")
  config.update(dict(num_stages=2, num_data=4, num_microbatches=4))
  config.mesh.dcn.update(dict(data=2))
  exp = experiment.build(config, devices=devices)
  assert tpipe.mesh.crossing_links(exp.mesh, "stage") == (False, False)  # Stages stay on ICI.
  state = exp.abstract_state()
  compiled = exp.train_step.lower(state, exp.abstract_batch(), jax.random.key(0)).compile()
  module = hlo.module_of(compiled)
  runs = module.multipliers()
  sends = [(sum(a.nbytes for a in comp.operand_shape(ins, 0)), runs[comp.name])
           for comp, ins in module.instructions()
           if ins.opcode == "send" and "megascale" in ins.attrs]
  leaves = [math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
            for leaf in jax.tree.leaves(state.params)]
  assert sends and all(count == 1 for _, count in sends), sends
  # The largest leaf (tile-aligned; smaller ones are halved after padding to TPU tiles).
  assert max(size for size, _ in sends) == max(leaves) // 2, (sends, leaves)


def test_a_weight_tied_to_the_loop_steps_is_cast_inside_the_loops():
  """XLA's loop-invariant code motion hoists a loop-invariant weight's bfloat16 cast out of the
  loops (for a stack of layers, the whole stack at once); tied to the loops' indices
  (``weight_casts.tie_to_steps``), each layer's cast stays where it is used."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax import lax  # pylint: disable=import-outside-toplevel
  from tpipe.core.programs import weight_casts  # pylint: disable=import-outside-toplevel
  try:
    device = tpipe.topology_devices("v5p:2x2x1")[0]
  except ValueError as error:
    pytest.skip(f"the TPU compiler is not installed here: {error}")
  layers, width = 8, 512

  def temporaries(tie):
    def step(stack, x):
      def tick(t, h):  # A tick loop around a loop over the stage's layers.
        def layer(i, h):
          w = weight_casts.tie_to_steps(stack[i], (i, t)) if tie else stack[i]
          return jnp.tanh(h.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32)
        return lax.fori_loop(0, layers, layer, h)
      return lax.fori_loop(0, 4, tick, x)

    sharding = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)
            for shape in [(layers, width, width), (128, width)]]
    return jax.jit(step).lower(*args).compile().memory_analysis().temp_size_in_bytes

  stack_bf16 = layers * width * width * 2
  hoisted, tied = temporaries(False), temporaries(True)
  assert hoisted >= stack_bf16, hoisted  # The whole stack cast, live across the loops.
  assert tied <= hoisted - stack_bf16 * 3 // 4, (tied, hoisted)


def test_a_stage_without_fsdp_casts_each_layers_weights_inside_the_loops(monkeypatch):
  """Without fsdp nothing gathers a stage's weights, so a layer that only reads its float32
  weights as bfloat16 would have its casts hoisted out of the tick loop by the TPU compiler (a
  bfloat16 copy of the stage's weights live all step: 1.81 GiB per device at Mixtral-8x7B on
  stage 4 x expert 8 x tensor 2); the chunk programs cast them tied to the loops' steps instead
  (``weight_casts.cast_by_path``). Checked against the same program with the tie left out."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from tpipe.core.programs import weight_casts  # pylint: disable=import-outside-toplevel
  try:
    devices = tpipe.topology_devices("v5p:2x2x1")
  except ValueError as error:
    pytest.skip(f"the TPU compiler is not installed here: {error}")
  width, layers = 512, 8

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.relu(nn.Dense(width, dtype=jnp.bfloat16)(x))
      return x + nn.Dense(width, dtype=jnp.bfloat16)(h)

  class Loss(nn.Module):
    def __call__(self, x):
      return jnp.mean(x.astype(jnp.float32) ** 2, -1)

  mesh = tpipe.make_mesh(stages=2, data=2, devices=devices)
  model = tpipe.Sequential([tpipe.Repeat(Block(), layers), Loss()], num_stages=2,
                           num_microbatches=4, mesh=mesh, remat="full")
  x = jax.ShapeDtypeStruct((32, width), jnp.float32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(x.shape),
                                             method="initialize"))["params"]
  loss = lambda p, x: model.apply({"params": p}, x, method="loss")

  def temporaries():
    lowered = jax.jit(jax.grad(loss)).lower(params, x)
    return lowered.compile().memory_analysis().temp_size_in_bytes

  tied = temporaries()
  monkeypatch.setattr(weight_casts, "tie_to_steps", lambda tree, steps: tree)
  hoisted = temporaries()
  stage_bf16 = layers // 2 * 2 * width * width * 2
  assert tied <= hoisted - stage_bf16 * 3 // 4, (tied, hoisted, stage_bf16)


def test_a_moe_step_on_expert_and_fsdp_compiles_with_the_gathers_on_each_devices_experts():
  """A mixture-of-experts LM under 1F1B on stage 2 x expert 2 x fsdp 2 (one row per fsdp
  replica and micro-batch): the gather over fsdp of each device's experts runs in a
  ``shard_map`` nested in the stage's, inside the call JAX makes of a scan's body. Lowered as a
  called function, Shardy's export dropped the outer manual axes there and the TPU compiler
  aborted the process (``Check failed: target.IsManualSubgroup()``;
  :func:`tpipe.core.base.jax_compat.inline_calls_of_shard_maps`). It compiles, with those
  gathers over fsdp alone."""
  devices = _tpu_devices()
  config = lm.get_config("size=tiny")
  config.update(dict(block="moe", num_experts=4, experts_per_token=2, num_stages=2,
                     num_data=1, batch_size=8, num_microbatches=4, schedule="1f1b"))
  config.mesh.update(dict(expert=2, fsdp=2))
  exp = experiment.build(config, devices=devices)
  compiled = exp.train_step.lower(exp.abstract_state(), exp.abstract_batch(),
                                  jax.random.key(0)).compile()
  # The experts' gathers, each in its shard_map nested in the stage's: over fsdp alone.
  gathers = [c for c in analysis.collectives(compiled, exp.mesh)
             if c.in_loop and c.op_name.endswith("/shard_map/all_gather")]
  assert gathers and {c.axes for c in gathers} == {("fsdp",)}, [
      (c.axes, c.op_name) for c in gathers]
