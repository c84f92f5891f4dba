"""Per-action costs measured on a GPU: F, B, BI and W of a Transformer chunk, timed.

Run from the repository root on a machine with a GPU (on this CPU-only machine, ``--smoke`` checks
the script on tiny sizes)::

  python -m experiments.gpu_action_costs           # writes experiments/results/gpu_action_costs.md
  python -m experiments.gpu_action_costs --smoke

One chunk of the trainer's Transformer blocks (``tpipe.train.models.TransformerBlock``; width 2048,
16 heads, MLP 8192, bfloat16 compute, float32 parameters) on one micro-batch of 4 x 1024 tokens,
each action jitted alone and timed on the device (median of 20 runs after 3 warm-ups, each waited
for): ``F`` the chunk's forward; ``B`` its forward again and the VJP for the weights and the input
(what a fused schedule's backward runs under remat full); ``BI`` the forward again and the input's
gradient alone; ``W = B - BI``. Under remat none, ``F`` is the forward that keeps its VJP's
residuals and ``B``, ``BI`` start from them, with no forward. Chunks of 4 blocks (S = 8 stages of a
32-block model) and 2 blocks (two chunks per stage). Every schedule's table at S = 8, M = 8 and 32
is then simulated under these costs (:meth:`tpipe.schedules.FusedSchedule.simulate`), as
``experiments.fused_schedules`` does under FLOP counts and the TPU compiler's estimates.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

import tpipe
from experiments import _common
from experiments import fused_schedules
from tpipe.core.planning import unit_cost
from tpipe.train import models

SIZES = dict(width=2048, heads=16, mlp=8192, rows=4, seq=1024)
SMOKE_SIZES = dict(width=64, heads=4, mlp=128, rows=2, seq=32)
SCHEDULES = (("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved_1f1b", 2),
             ("zb_h1", 1), ("zbv", 2))
STAGES = 8
WARMUP, RUNS = 3, 20


def action_seconds(blocks: int, width: int, heads: int, mlp: int, rows: int, seq: int):
  """``({action: seconds}, {action: seconds under remat none})`` of one chunk of ``blocks``
  blocks (under remat none the forward keeps its VJP's residuals and ``B``, ``BI`` start from
  them: :func:`experiments.fused_schedules.chunk_actions_keeping_residuals`)."""
  block = models.TransformerBlock(width=width, num_heads=heads, mlp_dim=mlp,
                                  deterministic=True, dtype=jnp.bfloat16)
  chunk = nn.Sequential([block.clone() for _ in range(blocks)])
  key = jax.random.key(0)
  h = jax.random.normal(key, (rows, seq, width), jnp.bfloat16)
  params = jax.jit(chunk.init)(key, h)
  seconds = {}
  for name, fn in fused_schedules.chunk_actions(chunk).items():
    compiled = jax.jit(fn).lower(params, h, h).compile()
    seconds[name] = unit_cost.median_seconds(compiled, (params, h, h), WARMUP, RUNS)
    print(f"{blocks} blocks, {name}: {seconds[name] * 1e6:.1f} us", flush=True)
  seconds["W"] = seconds["B"] - seconds["BI"]
  # Under remat none the forward keeps its residuals and the backward starts from them.
  linearize, kept = fused_schedules.chunk_actions_keeping_residuals(chunk)
  vjps = jax.jit(linearize)(params, h)[1]
  none = {}
  for name, fn in kept.items():
    args = (params, h, h) if name == "F" else (vjps, h)
    compiled = jax.jit(fn).lower(*args).compile()
    none[name] = unit_cost.median_seconds(compiled, args, WARMUP, RUNS)
    print(f"{blocks} blocks, remat none, {name}: {none[name] * 1e6:.1f} us", flush=True)
  none["W"] = none["B"] - none["BI"]
  return seconds, none


def forward_flops(blocks: int, width: int, heads: int, mlp: int, rows: int, seq: int) -> float:
  """The chunk's forward FLOPs, counted by hand: per token and block, the four attention
  projections and the two MLP matrices (2 FLOPs per weight), and attention's scores and values
  (2 x 2 x seq x width, every key, not only the causal half)."""
  del heads
  per_token = 2 * (4 * width * width + 2 * width * mlp) + 4 * seq * width
  return float(blocks * rows * seq * per_token)


def main():
  run = _common.start("gpu_action_costs", __doc__, smoke="tiny sizes, 2 and 1 blocks")
  sizes = SMOKE_SIZES if run.args.smoke else SIZES
  device = jax.devices()[0]
  per_chunk = {1: 2 if run.args.smoke else 4, 2: 1 if run.args.smoke else 2}
  timed = {r: action_seconds(per_chunk[r], **sizes) for r in (1, 2)}
  us = lambda v: f"{v * 1e6:.1f}"
  lines = [f"Device: {device.device_kind} ({device.platform}). Width {sizes['width']}, "
           f"{sizes['heads']} heads, MLP {sizes['mlp']}, micro-batch {sizes['rows']} x "
           f"{sizes['seq']}, bfloat16 compute. TFLOP/s from the forward's FLOPs counted by hand "
           "(the GPU compiler's cost analysis leaves out the cuBLAS calls), B as three forwards "
           "under remat full, two under remat none.",
           "", "Remat none: the forward keeps its VJP's residuals (returns them), `B` and `BI` "
           "start from them, as a fused schedule's backward does under `remat=\"none\"`.", "",
           "| remat | blocks per chunk | F us | B us | BI us | W = B - BI us | B / F | BI / F | "
           "W / F | TFLOP/s in F | in B |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  for index, remat in enumerate(("full", "none")):
    for r, both in timed.items():
      sec, flops = both[index], forward_flops(per_chunk[r], **sizes)
      backward_flops = (3 if remat == "full" else 2) * flops
      lines.append(f"| {remat} | {per_chunk[r]} | {us(sec['F'])} | {us(sec['B'])} | "
                   f"{us(sec['BI'])} | {us(sec['W'])} | {sec['B'] / sec['F']:.2f} | "
                   f"{sec['BI'] / sec['F']:.2f} | {sec['W'] / sec['F']:.2f} | "
                   f"{flops / sec['F'] / 1e12:.0f} | {backward_flops / sec['B'] / 1e12:.0f} |")
  lines += ["", f"Every table at S = {STAGES} simulated under the timed costs (one action per "
            "tick):", "", "| remat | schedule | M | bubble: natural | neighbour-synchronised | "
            "lockstep | neighbour-synchronised step / GPipe's |", "|---|---|---|---|---|---|---|"]
  for index, remat in enumerate(("full", "none")):
    for m in (8, 32):
      gpipe = None
      for name, repeats in SCHEDULES:
        table = tpipe.schedules.whole_step(tpipe.schedules.build(name, STAGES, m, repeats))
        # Timing noise can make B - BI negative for tiny chunks (--smoke): W costs at least 0.
        costs = {k: max(v, 0.0) for k, v in timed[repeats][index].items()}
        timing = table.simulate(costs)
        gpipe = gpipe or timing.neighbour
        lines.append(f"| {remat} | {name} | {m} | {timing.natural_bubble:.3f} | "
                     f"{timing.neighbour_bubble:.3f} | {timing.lockstep_bubble:.3f} | "
                     f"{timing.neighbour / gpipe:.3f} |")
  lines += ["", "As `fused_schedules.GPU_COSTS` (ms; chunks per stage: costs):", "",
            "```", *(f"{remat}: " + repr({r: {k: round(v * 1e3, 4) for k, v in both[i].items()}
                                          for r, both in timed.items()})
                     for i, remat in enumerate(("full", "none"))), "```"]
  run.write("Per-action costs timed on a GPU", lines,
            "Wall times of each action jitted alone (median of 20 after 3 warm-ups).")


if __name__ == "__main__":
  main()
