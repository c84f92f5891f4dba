"""Compile time of the gradient step per schedule: every schedule within 2x of GPipe's?

Run from the repository root (compiles only, nothing runs)::

  pip install -e '.[tpu]'                       # the TPU compiler, for the TPU rows
  python -m experiments.compile_times           # writes experiments/results/compile_times.md
  python -m experiments.compile_times --smoke   # 4 blocks of width 256: checks the script

The model of issue 19's measurement: a ``tpipe.Sequential`` of 16 of the trainer's Transformer
blocks (width 2048, 16 heads, MLP 8192), bfloat16 compute with float32 parameters, remat full,
4 stages, 16 micro-batches of 1 x 1024 tokens, ending in a per-example loss. For every schedule
(GPipe, circular with 2 repeats, 1F1B, interleaved 1F1B, ZB-H1, ZB-V; 1F1B and ZB-V also in
compound ticks) the gradient of the mean loss is lowered and compiled ahead of time for the 8
chips of ``v5p:2x2x2`` (the TPU compiler, from this CPU machine) and for 8 emulated CPU devices,
and the wall seconds of lowering and of compiling are printed beside GPipe's, each the faster of
:data:`REPEATS` lowerings and compiles from scratch (one compile's time moves by a fifth between
runs on shared cores). The ratios to GPipe's (compiled in the same run) are what to read.
"""

from __future__ import annotations

import time

import flax.linen as nn
import jax
import jax.numpy as jnp

import tpipe
from experiments import _common
from tpipe.train import models

SIZES = dict(blocks=16, width=2048, heads=16, mlp=8192, seq=1024, stages=4, microbatches=16)
SMOKE_SIZES = dict(blocks=4, width=256, heads=4, mlp=1024, seq=128, stages=2, microbatches=4)
REPEATS = 2
# (label, schedule, chunks per stage, tick costs): compound ticks with B three forwards.
COSTS = {"F": 1.0, "B": 3.0, "BI": 2.0, "W": 1.0}
ROWS = (("gpipe", "gpipe", 1, None), ("circular", "circular", 2, None),
        ("1f1b", "1f1b", 1, None), ("interleaved_1f1b", "interleaved_1f1b", 2, None),
        ("zb_h1", "zb_h1", 1, None), ("zbv", "zbv", 2, None),
        ("1f1b, compound ticks", "1f1b", 1, COSTS), ("zbv, compound ticks", "zbv", 2, COSTS))


class SquaredLoss(nn.Module):
  """A per-example loss: the mean square of the last block's output."""

  @nn.compact
  def __call__(self, h):
    return jnp.mean(jnp.square(h.astype(jnp.float32)), axis=(1, 2))


def compile_seconds(devices, schedule: str, repeats: int, costs, sizes: dict) -> tuple:
  """``(lower seconds, compile seconds)`` of the gradient step on a mesh of ``devices``."""
  mesh = tpipe.make_mesh(stages=sizes["stages"], data=len(devices) // sizes["stages"],
                         devices=devices)
  block = models.TransformerBlock(width=sizes["width"], num_heads=sizes["heads"],
                                  mlp_dim=sizes["mlp"], deterministic=True,
                                  dtype=jnp.bfloat16)
  model = tpipe.Sequential(
      [tpipe.Repeat(block, sizes["blocks"]), SquaredLoss()], num_stages=sizes["stages"],
      num_microbatches=sizes["microbatches"], schedule=schedule, num_repeats=repeats,
      remat="full", mesh=mesh, tick_costs=costs)
  batch = sizes["microbatches"] * len(devices) // sizes["stages"]
  sharding = tpipe.data_sharding(mesh)
  x = jax.ShapeDtypeStruct((batch, sizes["seq"], sizes["width"]), jnp.bfloat16,
                           sharding=sharding)
  params = jax.eval_shape(lambda x: model.init(jax.random.key(0), x), x)["params"]
  grad = jax.jit(jax.grad(lambda p, x: model.apply({"params": p}, x, method="loss")))
  start = time.perf_counter()
  lowered = grad.lower(params, x)
  lowered_at = time.perf_counter()
  lowered.compile()
  return lowered_at - start, time.perf_counter() - lowered_at


def table(label: str, devices, sizes: dict) -> list[str]:
  lines = [f"### {label}", "", "| schedule | lower s | compile s | compile / GPipe's |",
           "|---|---|---|---|"]
  gpipe = None
  for name, schedule, repeats, costs in ROWS:
    times = [compile_seconds(devices, schedule, repeats, costs, sizes) for _ in range(REPEATS)]
    lower, compiled = min(t[0] for t in times), min(t[1] for t in times)
    gpipe = gpipe or compiled
    lines.append(f"| {name} | {lower:.1f} | {compiled:.1f} | {compiled / gpipe:.2f} |")
    print(lines[-1], flush=True)
  return lines


def main(argv=None) -> None:
  run = _common.start("compile_times", __doc__, smoke="4 small blocks on 2 stages", argv=argv)
  sizes = SMOKE_SIZES if run.smoke else SIZES
  lines = [f"{sizes['blocks']} blocks of width {sizes['width']} ({sizes['heads']} heads, MLP "
           f"{sizes['mlp']}), bf16, remat full, S = {sizes['stages']}, M = "
           f"{sizes['microbatches']} of 1 x {sizes['seq']} tokens; the gradient of the mean "
           "loss.", ""]
  lines += table("8 emulated CPU devices", jax.devices()[:8], sizes)
  try:
    tpu = tpipe.topology_devices("v5p:2x2x2")
  except (ValueError, RuntimeError) as error:  # No TPU compiler installed.
    lines += ["", f"(TPU rows skipped: {error})"]
  else:
    lines += [""] + table("TPU v5p:2x2x2 (8 chips)", tpu, sizes)
  run.write("Compile time per schedule", lines,
            "Compile only: lowering and compiling the gradient step; nothing runs.")


if __name__ == "__main__":
  main()
