"""The forward tick loop's own guarantees (:mod:`tpipe.core.loops.forward`): run on a
:class:`~tpipe.core.programs.chunks.ChunkSet` it equals the layers in order, idle ticks compute
nothing, and no collective runs inside the tick loop except the neighbour sends (GPipe's ring has no
wrap-around edge)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpipe
from tpipe.core.base import arguments
from tpipe.core.base import spmd
from tpipe.core.layout import device_view as view_lib
from tpipe.core.layout import staging
from tpipe.core.loops import forward
from tpipe.core.programs import chunks as chunks_lib
from tpipe.tools import analysis
from tpipe.tools import hlo as hlo_lib
from tests.helpers import blocks
from tests.helpers import numerics

WIDTH = 8


def _grads(stack, x, *args):

  def loss(params):
    return jnp.sum(stack.apply({"params": params}, x, *args) ** 2)

  params = stack.init({"params": jax.random.key(0)}, x, *args)["params"]
  return jax.jit(jax.grad(loss))(params)


@pytest.mark.parametrize("schedule,stages,microbatches,repeats", [
    ("gpipe", 2, 2, 1), ("gpipe", 4, 1, 1), ("circular", 2, 1, 2), ("circular", 4, 2, 2)])
def test_block_undefined_at_zero_gets_finite_gradients(schedule, stages, microbatches, repeats):
  # Idle ticks run nothing: a stage run on a zero placeholder would give rsqrt(0) = inf, and the
  # masked result's zero cotangent times that infinite slope would make every gradient NaN.
  x = jax.random.normal(jax.random.key(1), (8, WIDTH))
  stack = tpipe.pipeline(blocks.RMSNoEpsBlock, length=4 * repeats, num_stages=stages,
                         num_microbatches=microbatches, schedule=schedule, num_repeats=repeats,
                         mesh=tpipe.make_mesh(stages=stages))(WIDTH)
  grads = _grads(stack, x)
  for leaf in jax.tree.leaves(grads):
    assert np.all(np.isfinite(leaf)), grads


def test_idle_ticks_run_no_layer_flops():
  # The busy branch of the tick's conditional holds the layers; a bubble tick takes the other.
  stages, microbatches = 4, 2
  mesh = tpipe.make_mesh(stages=stages)
  stack = tpipe.pipeline(blocks.MLPBlock, length=8, num_stages=stages,
                         num_microbatches=microbatches, mesh=mesh)(WIDTH)
  x = jnp.ones((8, WIDTH))
  params = stack.init({"params": jax.random.key(0)}, x)["params"]
  compiled = jax.jit(stack.apply).lower({"params": params}, x).compile()
  module = hlo_lib.parse_hlo(compiled.as_text())
  schedule = tpipe.schedules.build("gpipe", stages, microbatches)
  tick_loops = [loop for loop in module.loops() if loop.trip_count == schedule.num_ticks]
  assert tick_loops
  bodies = {loop.body for loop in tick_loops}
  conditionals = [ins for comp, ins in module.instructions()
                  if ins.opcode == "conditional" and comp.name in bodies]
  assert conditionals, "the stage must run under a conditional on the busy flag"
  flops = analysis.pipeline_flops(compiled, schedule)
  # Executed work is the useful work plus small per-tick bookkeeping, not S+M-1 ticks of layers.
  assert flops.executed < 1.05 * flops.useful, flops
  assert flops.lockstep > flops.executed * (1 + 0.9 * schedule.bubble_fraction), flops


@pytest.mark.parametrize("schedule,stages,microbatches,repeats,data", [
    ("gpipe", 2, 2, 1, 2), ("gpipe", 4, 3, 1, 1), ("circular", 2, 3, 2, 2)])
def test_run_on_a_chunkset_equals_the_layers_in_order(schedule, stages, microbatches, repeats,
                                                      data):
  """``forward.run`` called directly with the chunk programs of a planned stack: the last
  chunk's outputs for the whole batch, those of the blocks applied in order."""
  mesh = tpipe.make_mesh(stages=stages, data=data)
  block, length = blocks.MLPBlock(WIDTH), 4 * repeats
  model = tpipe.Sequential([tpipe.Repeat(block, length)], num_stages=stages,
                           num_microbatches=microbatches, schedule=schedule,
                           num_repeats=repeats, mesh=mesh)
  keys = jax.random.split(jax.random.key(2), 2)
  x = jax.random.normal(keys[0], (6 * data, WIDTH))
  stacked = jax.vmap(lambda k: block.init(k, x)["params"])(jax.random.split(keys[1], length))
  pipeline = model.pipeline_for(x)
  split = arguments.split_keywords({}, per_example=(), batch_size=x.shape[0], owner="test")
  chunkset = chunks_lib.ChunkSet(pipeline.layers, pipeline.plan, pipeline.layout, None,
                                 pipeline.spec, split)
  axes = spmd.Axes.of(mesh, "stage", "data")

  def run(params, x):
    staged = {view_lib.PARAMS: staging.to_staged(pipeline.layout, {"layers_0": params})}
    return forward.run(chunkset, staged, x, (), (), {}, schedule=pipeline.spec.table, axes=axes)

  got = jax.jit(run)(stacked, jax.device_put(x, tpipe.data_sharding(mesh)))
  sequential = lambda mb: jax.jit(
      lambda p, x: blocks.apply_in_sequence(block, p, x, microbatches=mb))
  plain = sequential(microbatches * data)(stacked, x)
  reference = numerics.float64_reference(sequential(1), stacked, x)
  numerics.assert_as_close_as_plain(got, plain, reference, what="outputs")


@pytest.mark.unit
def test_the_ring_wraps_around_only_for_another_lap():
  # The forward loop's ring (wrap=R > 1): stage S - 1 sends to stage 0 only when chunks go round
  # again; the fused loop's gradients go the other way.
  assert spmd.neighbour_pairs(4, 1, wrap=False) == [(0, 1), (1, 2), (2, 3)]
  assert spmd.neighbour_pairs(4, 1, wrap=True) == [(0, 1), (1, 2), (2, 3), (3, 0)]
  assert spmd.neighbour_pairs(1, 1, wrap=False) == []
  assert spmd.neighbour_pairs(4, -1, wrap=False) == [(1, 0), (2, 1), (3, 2)]
  assert spmd.neighbour_pairs(4, -1, wrap=True) == [(0, 3), (1, 0), (2, 1), (3, 2)]


def test_gpipe_ring_has_no_wrap_around_edge():

  def permute_pairs(schedule, repeats):
    mesh = tpipe.make_mesh(stages=4, data=2)
    stack = tpipe.pipeline(blocks.MLPBlock, length=8, num_stages=4, num_microbatches=4,
                           schedule=schedule, num_repeats=repeats, mesh=mesh)(WIDTH)
    x = jnp.ones((16, WIDTH))
    params = stack.init({"params": jax.random.key(0)}, x)["params"]
    text = jax.jit(stack.apply).lower({"params": params}, x).compile().as_text()
    pairs = set()
    for found in re.findall(r"collective-permute[^\n]*source_target_pairs=\{([^\n]*?)\}\}", text):
      pairs |= {tuple(map(int, p)) for p in re.findall(r"\{?(\d+),(\d+)", found)}
    return pairs

  # Devices: replica r holds stages 4r..4r+3. Activations go right; the inputs' conveyor to
  # stage 0 goes left (the batch splits over the stages, M = S); neither wraps round.
  gpipe = permute_pairs("gpipe", 1)
  right = {(0, 1), (1, 2), (2, 3), (4, 5), (5, 6), (6, 7)}
  assert gpipe == right | {(b, a) for a, b in right}, gpipe
  assert {(3, 0), (7, 4)} <= permute_pairs("circular", 2)


def _step_with_side_inputs(schedule, repeats):
  mesh = tpipe.make_mesh(stages=4, data=2)
  stack = tpipe.pipeline(blocks.SideInputBlock, length=8, num_stages=4, num_microbatches=4,
                         schedule=schedule, num_repeats=repeats, per_example=("gate",),
                         mesh=mesh)(WIDTH)
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (32, WIDTH))
  gate = jax.random.uniform(keys[1], (32, WIDTH))
  bias = jax.random.normal(keys[2], (WIDTH,))
  extras = {"gain": jnp.full((WIDTH,), 1.5), "shift": jnp.zeros((WIDTH,))}
  params = stack.init({"params": jax.random.key(1)}, x, gate, bias, extras)["params"]

  def loss(params, x, gate, bias, extras):
    return jnp.mean(stack.apply({"params": params}, x, gate, bias, extras, scale=0.5) ** 2)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  x, gate = jax.device_put((x, gate), tpipe.data_sharding(mesh))
  return grad.lower(params, x, gate, bias, extras).compile(), mesh


@pytest.mark.parametrize("schedule,repeats", [("gpipe", 1), ("circular", 2)])
def test_no_reduction_or_gather_inside_the_tick_loop(schedule, repeats):
  compiled, mesh = _step_with_side_inputs(schedule, repeats)
  found = analysis.collectives(compiled, mesh)
  in_loop = [c for c in found if c.in_loop and c.kind in ("all-reduce", "all-gather")]
  assert not in_loop, in_loop
  # The broadcast arrays' gradients are summed over data and stages, once per step.
  assert any(c.kind == "all-reduce" and not c.in_loop and "data" in (c.axes or ())
             for c in found), found
