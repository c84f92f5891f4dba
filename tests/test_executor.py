"""The executor's own guarantees: idle ticks compute nothing, and no collective runs inside the
tick loop except the neighbour sends (GPipe's ring has no wrap-around edge)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpipe
from tpipe.core import executor
from tpipe.tools import analysis
from tpipe.tools import hlo as hlo_lib
from tests import blocks

WIDTH = 8


def _grads(stack, x, *args):

  def loss(params):
    return jnp.sum(stack.apply({"params": params}, x, *args) ** 2)

  params = stack.init({"params": jax.random.key(0)}, x, *args)["params"]
  return jax.jit(jax.grad(loss))(params)


@pytest.mark.parametrize("schedule,stages,microbatches,repeats", [
    ("gpipe", 2, 2, 1), ("gpipe", 4, 1, 1), ("circular", 2, 1, 2), ("circular", 4, 2, 2)])
def test_block_undefined_at_zero_gets_finite_gradients(schedule, stages, microbatches, repeats):
  # Idle ticks used to run the stage on a zero placeholder: rsqrt(0) = inf, and the masked
  # result's zero cotangent times that infinite slope made every parameter gradient NaN.
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
  schedule = tpipe.make_schedule("gpipe", stages, microbatches)
  tick_loops = [l for l in module.loops() if l.trip_count == schedule.num_ticks]
  assert tick_loops
  conditionals = [ins for comp, ins in module.instructions()
                  if ins.opcode == "conditional" and comp.name in {l.body for l in tick_loops}]
  assert conditionals, "the stage must run under a conditional on the busy flag"
  flops = analysis.pipeline_flops(compiled, schedule)
  # Executed work is the useful work plus small per-tick bookkeeping, not S+M-1 ticks of layers.
  assert flops.executed < 1.05 * flops.useful, flops
  assert flops.lockstep > flops.executed * (1 + 0.9 * schedule.bubble_fraction), flops


def test_gpipe_ring_has_no_wrap_around_edge():
  assert executor.stage_ring(4, 1) == [(0, 1), (1, 2), (2, 3)]
  assert executor.stage_ring(4, 2) == [(0, 1), (1, 2), (2, 3), (3, 0)]
  assert executor.stage_ring(1, 1) == []

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

  # Devices: replica r holds stages 4r..4r+3.
  gpipe = permute_pairs("gpipe", 1)
  assert gpipe == {(0, 1), (1, 2), (2, 3), (4, 5), (5, 6), (6, 7)}, gpipe
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
