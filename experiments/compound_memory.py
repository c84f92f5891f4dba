"""Fused schedules in compound ticks: temporaries in M, and whether streamed inputs are gathered.

Run from the repository root (8 emulated CPU devices; compile-time quantities only, minutes)::

  python -m experiments.compound_memory            # writes experiments/results/compound_memory.md
  python -m experiments.compound_memory --smoke    # two rows: checks the script

A ``tpipe.Sequential`` of 8 residual MLP blocks (width 128) on float32 activation inputs
``[rows, 16, 128]`` (what a pipeline gets when its embedding runs before it), a mean-square loss
per example, 4 rows per micro-batch, ``remat="none"``, on S = 4 stages (4 devices). For each
fused schedule (1F1B, interleaved 1F1B and ZB-V with 2 chunks per stage, ZB-H1), laid out in
compound ticks (the default, ``tick_costs=None``) and one action per tick (``"plain"``), the
compiled gradient step's per-device temporaries (``memory_analysis().temp_size_in_bytes``) at
M = 8 and M = 64. The batch grows with M: a device's part of it and of its gradient is
``4 * M * 16 * 128 * 4`` bytes each, 0.25 MiB at M = 8 and 2 MiB at M = 64. A schedule whose
memory is bounded in S grows by at most the batch and its gradient (column "allowed": 1.1x the
M = 8 temporaries plus that growth).

Second table: the same model on 2 stages x 4 data (8 devices), M = 8, ``stream_inputs=True``: the
all-gathers over ``stage`` in the compiled program (a streamed batch reaches stage 0 by
neighbour sends inside the tick loop, and none of it is gathered).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

import tpipe
from experiments import _common
from tpipe.tools import analysis

WIDTH, SEQ, ROWS, LAYERS = 128, 16, 4, 8
SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1", "zbv")
REPEATS = {"interleaved_1f1b": 2, "zbv": 2}


class Block(nn.Module):
  """A residual MLP block on ``[rows, T, D]``."""

  @nn.compact
  def __call__(self, h):
    width = h.shape[-1]
    return h + nn.Dense(width)(jax.nn.gelu(nn.Dense(2 * width)(h)))


class MeanSquare(nn.Module):
  """The per-example loss: mean square of the activations."""

  @nn.compact
  def __call__(self, h):
    return jnp.mean(jnp.square(h), axis=(1, 2))


def lower_step(schedule: str, microbatches: int, tick_costs, stages: int = 4, data: int = 1,
               stream: bool = True):
  """The lowered gradient step of the model (in the parameters, in their stage layout as a
  train state holds them, and in the inputs), and its mesh."""
  mesh = tpipe.make_mesh(stages=stages, data=data)
  model = tpipe.Sequential([Block() for _ in range(LAYERS)] + [MeanSquare()],
                           num_stages=stages, num_microbatches=microbatches, schedule=schedule,
                           num_repeats=REPEATS.get(schedule, 1), remat="none", mesh=mesh,
                           tick_costs=tick_costs, stream_inputs=stream)
  shape = (ROWS * microbatches * data, SEQ, WIDTH)
  x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=tpipe.data_sharding(mesh))
  pipeline = model.pipeline_for(jnp.zeros(shape, jnp.float32))
  single = model.clone(num_stages=1, num_microbatches=1, mesh=None)
  params = jax.eval_shape(lambda x: single.init(jax.random.key(0), x), x)["params"]
  staged, _ = jax.eval_shape(pipeline.stage, params)
  specs = pipeline.layout.partition_specs(mesh=mesh)
  staged = jax.tree.map(lambda a, spec: jax.ShapeDtypeStruct(
      a.shape, a.dtype, sharding=jax.NamedSharding(mesh, spec)), staged, specs)
  grad = jax.grad(lambda p, x: pipeline.loss(p, x), argnums=(0, 1))
  return jax.jit(grad).lower(staged, x), mesh


def compile_step(*args, **kwargs):
  """:func:`lower_step`, compiled."""
  lowered, mesh = lower_step(*args, **kwargs)
  return lowered.compile(), mesh


def temporaries(schedule: str, microbatches: int, tick_costs) -> int:
  return compile_step(schedule, microbatches, tick_costs)[0].memory_analysis().temp_size_in_bytes


def stage_gathers(schedule: str, tick_costs) -> tuple[int, int]:
  """``(count, bytes)`` of the all-gathers over ``stage`` in the streamed step on 2 x 4."""
  compiled, mesh = compile_step(schedule, 8, tick_costs, stages=2, data=4)
  found = [c for c in analysis.collectives(compiled, mesh)
           if c.kind == "all-gather" and "stage" in (c.axes or ())]
  return len(found), sum(c.total_bytes for c in found)


def batch_bytes(microbatches: int) -> int:
  """A device's part of the batch (or of its gradient): every row, as one stage sees them."""
  return ROWS * microbatches * SEQ * WIDTH * 4


def main():
  run = _common.start("compound_memory", __doc__, smoke="1F1B only, M = 8 and 16")
  smoke = run.args.smoke
  schedules = ("1f1b",) if smoke else SCHEDULES
  low, high = (8, 16) if smoke else (8, 64)
  mib = _common.mib
  lines = [f"Temporaries per device, MiB, S = 4, remat none, M = {low} and {high}; "
           f"\"allowed\" is 1.1 x (M = {low}) + the growth of the batch and its gradient "
           f"({mib(2 * (batch_bytes(high) - batch_bytes(low)))} MiB).", "",
           f"| schedule | ticks | M = {low} | M = {high} | ratio | allowed | within |",
           "|---|---|---:|---:|---:|---:|---|"]
  for schedule in schedules:
    for costs, label in ((None, "compound"), ("plain", "plain")):
      small, large = (temporaries(schedule, m, costs) for m in (low, high))
      allowed = 1.1 * small + 2 * (batch_bytes(high) - batch_bytes(low))
      lines.append(f"| {schedule} | {label} | {mib(small)} | {mib(large)} "
                   f"| {large / small:.2f} | {mib(allowed)} "
                   f"| {'yes' if large <= allowed else 'NO'} |")
      print(lines[-1], flush=True)
  lines += ["", "All-gathers over `stage` in the compiled step, 2 stages x 4 data, M = 8, "
            "`stream_inputs=True` (count, MiB per device per step):", "",
            "| schedule | ticks | all-gathers | MiB |", "|---|---|---:|---:|"]
  for schedule in schedules:
    for costs, label in ((None, "compound"), ("plain", "plain")):
      count, total = stage_gathers(schedule, costs)
      lines.append(f"| {schedule} | {label} | {count} | {mib(total)} |")
      print(lines[-1], flush=True)
  run.write("Fused schedules in compound ticks: temporaries in M, streamed inputs", lines)


if __name__ == "__main__":
  main()
