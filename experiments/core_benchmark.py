"""Core benchmark: compile time stays flat in M and L, memory per device falls as 1/S, overhead.

Run from the repository root::

  python -m experiments.core_benchmark            # writes experiments/results/core_benchmark.md
  python -m experiments.core_benchmark --smoke    # fewer sizes and rounds, to check the script

Three measurements, each of the full training step (forward, backward, SGD update) of a stack of
residual MLP blocks (width 256, hidden 1024, float32) pipelined by ``tpipe.pipeline``:

1. Compile time (process CPU seconds) of the pipelined step at M = 4 vs 64 micro-batches and
   L = 8 vs 64 layers (S = 4, gpipe, remat="full"). Ticks and layers are ``lax.scan`` loops, so
   neither should grow.
2. Per-device bytes from ``compiled.memory_analysis()`` at S = 1, 2, 4, 8 for L = 64 layers:
   the parameter (argument) bytes per device should fall as 1/S. The temporaries are shown
   beside the parameters they hold a gradient of, and what remains of them after that one
   parameter-sized buffer.
3. Framework overhead: step time of the S = 1, M = 1 pipeline against a plain ``jax.jit`` step
   of the same model on one device, (a) both with a ``lax.scan`` over the layers (``nn.scan``;
   tpipe's default ``unroll=1``) and (b) both with the layers unrolled (``nn.scan(unroll=True)``;
   ``tpipe.pipeline(..., unroll=True)``), and the plain unrolled step against the plain scanned
   one. The four steps are timed in rounds in one process and each ratio is the median of the
   per-round ratios, with quartiles; on emulated devices only ratios measured side by side mean
   anything. What the four compiled programs run (loops, conditionals, collectives, copies,
   FLOPs, temporaries) is tabulated beside them, to explain a ratio away from 1.
"""

from __future__ import annotations

import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import tpipe
from experiments import _common
from tpipe.tools import analysis
from tpipe.tools import hlo

WIDTH = 256
BATCH = 256


class Block(nn.Module):
  width: int = WIDTH

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(4 * self.width)(x))
    return x + nn.Dense(self.width)(h)


def _loss(apply):

  def loss(params, batch, rng):
    del rng
    return jnp.mean((apply(params, batch["x"]) - batch["y"]) ** 2)

  return loss


def _batch():
  kx, ky = jax.random.split(jax.random.key(1))
  return {"x": jax.random.normal(kx, (BATCH, WIDTH)), "y": jax.random.normal(ky, (BATCH, WIDTH))}


def pipelined_step(length, stages, microbatches, remat="full"):
  """(jitted step, abstract state, abstract batch) for the pipelined model.

  The abstract state carries the shardings a real state has, as the trainer's does
  (:func:`tpipe.shardings`): the stack under ``blocks`` split over
  'stage' on its layer axis, the rest replicated. ``jax.eval_shape`` alone returns leaves without
  shardings, and XLA would then choose the step's input layout itself.
  """
  mesh = tpipe.make_mesh(stages=stages)
  stack = tpipe.pipeline(Block, length=length, num_stages=stages, num_microbatches=microbatches,
                         remat=remat, mesh=mesh)()
  batch = _batch()
  optimizer = optax.sgd(1e-3)

  def init_state():
    params = {"blocks": stack.init(jax.random.key(0), batch["x"])["params"]}
    return tpipe.TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))

  shapes = jax.eval_shape(init_state)
  shardings = tpipe.shardings(shapes, mesh, ("blocks",))
  state = _common.placed(shapes, shardings)
  abstract_batch = _common.placed(batch, jax.tree.map(lambda _: tpipe.data_sharding(mesh), batch))
  step = tpipe.make_train_step(_loss(lambda p, x: stack.apply({"params": p["blocks"]}, x)),
                               optimizer, shardings=shardings)
  return step, state, abstract_batch


def compile_seconds(step, state, batch):
  """CPU seconds (all threads) to lower and compile: less disturbed by other work than wall time."""
  start = time.process_time()
  compiled = step.lower(state, batch, jax.random.key(0)).compile()
  return time.process_time() - start, compiled


def measure_compile_time(sizes):
  """``(L, M, compile CPU seconds)`` at S = 4 for each ``(L, M)`` in ``sizes``."""
  rows = []
  for length, microbatches in sizes:
    seconds, _ = compile_seconds(*pipelined_step(length, 4, microbatches))
    rows.append((length, microbatches, seconds))
  return rows


def measure_memory(length, stage_counts):
  """Per S: ``(S, arguments, parameters, temporaries, outputs)``, bytes on the fullest device."""
  rows = []
  for stages in stage_counts:
    step, state, batch = pipelined_step(length, stages, 4 * stages)
    _, compiled = compile_seconds(step, state, batch)
    memory = compiled.memory_analysis()
    rows.append((stages, memory.argument_size_in_bytes, analysis.input_bytes(state.params)[1],
                 memory.temp_size_in_bytes, memory.output_size_in_bytes))
  return rows


class ScannedStack(nn.Module):
  """The same model without tpipe: ``nn.scan`` over the blocks, params in the same layout.

  Attributes:
    length: number of blocks.
    unroll: blocks per iteration of the scan, as ``nn.scan`` takes it (``True``: all of them).
  """

  length: int
  unroll: int | bool = 1

  @nn.compact
  def __call__(self, x):
    scanned = nn.scan(lambda block, h, _: (block(h), None), variable_axes={"params": 0},
                      split_rngs={"params": True}, length=self.length, unroll=self.unroll)
    return scanned(Block(), x, None)[0]


# The four steps of the overhead measurement, in timing order: each tpipe step right after the
# plain step it is compared with.
OVERHEAD_STEPS = (
    ("plain_scan", "plain `jax.jit`, `nn.scan`"),
    ("tpipe", "tpipe S=1, M=1, `unroll=1`"),
    ("plain_unrolled", "plain `jax.jit`, `nn.scan(unroll=True)`"),
    ("tpipe_unrolled", "tpipe S=1, M=1, `unroll=True`"),
)
# (numerator, denominator, what the ratio says).
OVERHEAD_RATIOS = (
    ("tpipe", "plain_scan", "(a) tpipe / plain, layer loops"),
    ("tpipe_unrolled", "plain_unrolled", "(b) tpipe / plain, layers unrolled"),
    ("plain_unrolled", "plain_scan", "plain unrolled / plain scanned"),
)
# Opcodes counted per step in the HLO comparison (executions: loop bodies times trip counts).
COUNTED_OPCODES = ("conditional", "all-reduce", "copy", "fusion", "dot")


def overhead_steps(length):
  """The four train steps of :data:`OVERHEAD_STEPS` (one device, not donating) and one state."""
  optimizer = optax.sgd(1e-3)
  variables = ScannedStack(length).init(jax.random.key(0), _batch()["x"])
  (scope_name,) = variables["params"]
  models = {
      "plain_scan": (ScannedStack(length), True),
      "plain_unrolled": (ScannedStack(length, unroll=True), True),
      "tpipe": (tpipe.pipeline(Block, length=length, num_stages=1, num_microbatches=1,
                               remat="none")(), False),
      "tpipe_unrolled": (tpipe.pipeline(Block, length=length, num_stages=1, num_microbatches=1,
                                        remat="none", unroll=True)(), False),
  }
  steps = {}
  for name, (model, plain) in models.items():

    def apply(p, x, model=model, plain=plain):
      return model.apply({"params": {scope_name: p} if plain else p}, x)

    steps[name] = tpipe.make_train_step(_loss(apply), optimizer, donate=False)
  return steps, tpipe.create_train_state(variables["params"][scope_name], optimizer)


def hlo_summary(compiled):
  """Executions per step of :data:`COUNTED_OPCODES`, loop trip counts, FLOPs and temporaries."""
  module = hlo.parse_hlo(compiled.as_text())
  runs = module.multipliers()
  counts = dict.fromkeys(COUNTED_OPCODES, 0)
  for comp, ins in module.instructions():
    if ins.opcode in counts:
      counts[ins.opcode] += runs.get(comp.name, 0)
  return {
      "counts": counts,
      "trips": [loop.trip_count for loop in module.loops()],
      "flops": analysis.flop_count(compiled).executed,
      "temporaries": compiled.memory_analysis().temp_size_in_bytes,
  }


def measure_overhead(length=8, rounds=100):
  """Times the four :data:`OVERHEAD_STEPS` in rounds, one of each per round.

  The order of the steps reverses every round, so neither step of a compared pair always runs
  first; the two steps of each ratio in :data:`OVERHEAD_RATIOS` run in the same round, moments
  apart, and their per-round ratio cancels most of what other processes do to the shared cores.

  Returns:
    ``(times, difference, summaries)``: seconds per step name (one entry per round); the largest
    parameter difference from the plain scanned step after one step; :func:`hlo_summary` per step.
  """
  steps, state = overhead_steps(length)
  batch, rng = _batch(), jax.random.key(0)
  summaries = {name: hlo_summary(step.lower(state, batch, rng).compile())
               for name, step in steps.items()}
  # Same math: every step gives the parameters of the plain scanned step (up to rounding).
  updated = {name: step(state, batch, rng)[0].params for name, step in steps.items()}
  difference = max(float(jnp.max(jnp.abs(x - y)))
                   for name in steps
                   for x, y in zip(jax.tree.leaves(updated[name]),
                                   jax.tree.leaves(updated["plain_scan"])))
  order = [name for name, _ in OVERHEAD_STEPS]
  times = {name: [] for name in order}
  for i in range(rounds):
    for name in order if i % 2 == 0 else order[::-1]:
      start = time.perf_counter()
      jax.block_until_ready(steps[name](state, batch, rng))
      times[name].append(time.perf_counter() - start)
  return times, difference, summaries


def overhead_lines(length, rounds):
  """The framework-overhead section of the results, as markdown lines."""
  times, difference, summaries = measure_overhead(length, rounds)
  lines = [f"## Framework overhead (S = 1, M = 1, remat=none, L = {length}, one device)", "",
           f"{rounds} rounds, each timing the four steps below once, in an order that reverses "
           "every round, in one process. A ratio is taken between two steps of the same round; "
           "the median of the per-round ratios is the least sensitive to other work on the "
           "shared cores.", "",
           "| step | median ms | minimum ms |", "|---|---:|---:|"]
  for name, label in OVERHEAD_STEPS:
    lines.append(f"| {label} | {statistics.median(times[name]) * 1e3:.2f} | "
                 f"{min(times[name]) * 1e3:.2f} |")
  lines += ["", "| ratio | median per-round ratio | quartiles | ratio of minima |",
            "|---|---:|---:|---:|"]
  for top, bottom, label in OVERHEAD_RATIOS:
    ratios = [t / b for t, b in zip(times[top], times[bottom])]
    quartiles = statistics.quantiles(ratios, n=4)
    lines.append(f"| {label} | **{statistics.median(ratios):.3f}** | {quartiles[0]:.3f} to "
                 f"{quartiles[2]:.3f} | {min(times[top]) / min(times[bottom]):.3f} |")
  lines += ["", f"Largest parameter difference from the plain scanned step after one step: "
            f"{difference:.1e}.", "",
            "What each compiled step runs (executions per step: loop bodies times trip counts; "
            "conditional branches both counted), its FLOPs (`tpipe.tools.analysis.flop_count`) and "
            "temporaries (`memory_analysis()`):", "",
            "| step | while loops (trips) | " + " | ".join(COUNTED_OPCODES) +
            " | FLOPs | temporaries MiB |",
            "|---|---|" + "---:|" * (len(COUNTED_OPCODES) + 2)]
  for name, label in OVERHEAD_STEPS:
    summary = summaries[name]
    trips = ", ".join(str(t) for t in summary["trips"]) or "none"
    counts = " | ".join(str(summary["counts"][op]) for op in COUNTED_OPCODES)
    lines.append(f"| {label} | {len(summary['trips'])} ({trips}) | {counts} | "
                 f"{summary['flops']:.4g} | {summary['temporaries'] / 2**20:.2f} |")
  return lines


# (compile-time sizes (L, M), memory L, memory stage counts, overhead L, overhead rounds)
FULL = dict(compile_sizes=((8, 4), (8, 64), (64, 4), (64, 64)), memory_length=64,
            memory_stages=(1, 2, 4, 8), overhead_length=8, rounds=100)
SMOKE = dict(compile_sizes=((8, 4), (8, 8)), memory_length=8, memory_stages=(1, 2),
             overhead_length=2, rounds=4)


def main():
  run = _common.start("core_benchmark", __doc__, smoke="fewer sizes and 4 overhead rounds")
  sizes = SMOKE if run.smoke else FULL
  lines = [f"Residual MLP blocks, width {WIDTH}, batch {BATCH}, float32, full train step.", ""]

  lines += ["## Compile time (S = 4, gpipe, remat=full)", "",
            "| layers L | micro-batches M | compile CPU seconds |", "|---:|---:|---:|"]
  for length, microbatches, seconds in measure_compile_time(sizes["compile_sizes"]):
    lines.append(f"| {length} | {microbatches} | {seconds:.2f} |")

  length = sizes["memory_length"]
  lines += ["", f"## Per-device memory from `memory_analysis()` (L = {length}, M = 4S, "
            "remat=full)", "",
            "Bytes on the fullest device. The temporaries hold the gradients (one buffer the size "
            "of the parameters); the last column is what they hold beyond that buffer.", "",
            "| stages S | arguments (params, opt state, batch) MiB | ratio to S=1 | parameters "
            "MiB | temporaries MiB | temporaries - parameters MiB | outputs MiB |",
            "|---:|---:|---:|---:|---:|---:|---:|"]
  memory = measure_memory(length, sizes["memory_stages"])
  for stages, arguments, params, temporaries, outputs in memory:
    lines.append(f"| {stages} | {arguments / 2**20:.2f} | {arguments / memory[0][1]:.3f} | "
                 f"{params / 2**20:.2f} | {temporaries / 2**20:.2f} | "
                 f"{(temporaries - params) / 2**20:.2f} | {outputs / 2**20:.2f} |")

  lines += [""] + overhead_lines(sizes["overhead_length"], sizes["rounds"])
  run.write("Core benchmark", lines)


if __name__ == "__main__":
  main()
