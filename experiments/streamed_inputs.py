"""Streamed inputs against one gather of the batch: memory and transfers on two TPU slices.

Run from the repository root on any machine (the TPU compiler runs here, nothing runs on a TPU;
minutes)::

  python -m experiments.streamed_inputs           # writes experiments/results/streamed_inputs.md
  python -m experiments.streamed_inputs --smoke   # one small row: checks the script

A pipeline whose inputs are large (what a model gets when its embedding, or a vision encoder,
runs before the pipeline): a sequence of residual MLP blocks of width ``D`` on bfloat16
activations ``[rows, T, D]``, compiled for two ``v5p:2x2x1`` slices (8 chips) with the stage axis
over DCN (``tpipe.make_mesh(stages=4, data=2, dcn={"stage": 2})``), gpipe, 1F1B, ZB-H1 and ZB-V
(the fused ones in compound ticks, their default, whose stage 0 may read two micro-batches in one
tick: a conveyor per lane), M = 8 per data replica. The batch arrives split over data and stage
(``tpipe.data_sharding``). Per device, from the TPU compiler: the step's temporaries and the
collectives over ``stage`` that move the inputs, outside the tick loop (the gather, blocking the
first tick) and inside it (the conveyors' sends, beside the compute), with the gather's time
over DCN at v5p's 50 Gbit/s per chip (:mod:`tpipe.experimental.links`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

import tpipe
from experiments import _common
from tpipe.tools import analysis
from tpipe.experimental import links


class Block(nn.Module):
  """A residual MLP block on ``[rows, T, D]``."""

  @nn.compact
  def __call__(self, h):
    width = h.shape[-1]
    y = nn.Dense(2 * width, dtype=jnp.bfloat16)(h)
    return h + nn.Dense(width, dtype=jnp.bfloat16)(jax.nn.gelu(y))


class MeanSquare(nn.Module):
  """The per-example loss: mean square of the activations."""

  @nn.compact
  def __call__(self, h):
    return jnp.mean(jnp.square(h.astype(jnp.float32)), axis=(1, 2))


def measure(schedule: str, stream: bool, width: int, seq: int, rows: int, layers: int):
  """Per-device temporaries and the inputs' transfers over stage of one compiled step."""
  devices = tpipe.topology_devices("v5p:2x2x1", num_slices=2)
  mesh = tpipe.make_mesh(stages=4, data=2, dcn={"stage": 2}, devices=devices)
  microbatches = 8
  model = tpipe.Sequential([tpipe.Repeat(Block(), layers), MeanSquare()], num_stages=4,
                           num_microbatches=microbatches, schedule=schedule, remat="full",
                           mesh=mesh, stream_inputs=stream,
                           num_repeats=2 if schedule == "zbv" else 1)
  batch = 2 * microbatches * rows
  x = jax.ShapeDtypeStruct((batch, seq, width), jnp.bfloat16,
                           sharding=tpipe.data_sharding(mesh))
  params = jax.eval_shape(lambda x: model.init(jax.random.key(0), x), x)["params"]
  loss = lambda p, x: model.apply({"params": p}, x, method="loss")
  compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
  found = [c for c in analysis.collectives(compiled, mesh) if c.axes == ("stage",)]
  gathered = sum(c.total_bytes for c in found if c.kind == "all-gather" and not c.in_loop)
  permutes = [c for c in found if c.kind == "collective-permute" and c.in_loop]
  return {
      "temporaries": compiled.memory_analysis().temp_size_in_bytes,
      "gathered": gathered,
      "per_tick": sum(c.bytes for c in permutes),
  }


def main():
  run = _common.start("streamed_inputs", __doc__, smoke="width 256, T 256")
  smoke = run.args.smoke
  width, seq, rows, layers = (256, 256, 1, 8) if smoke else (2048, 2048, 2, 16)
  dcn = links.interconnect("v5p").dcn
  lines = [f"Width {width}, sequence {seq}, {rows} rows per micro-batch, M = 8 per replica, "
           f"{layers} blocks; each device's part of the batch is "
           f"{_common.mib(rows * 8 * 2 * seq * width * 2 / 8)} MiB "
           f"(bfloat16 [{2 * 8 * rows}, {seq}, {width}] over 8 devices).", "",
           "| schedule | inputs | temporaries MiB | gathered before tick 0 MiB | its DCN time ms "
           "| stage sends per tick MiB |", "|---|---|---:|---:|---:|---:|"]
  for schedule in ("gpipe", "1f1b", "zb_h1", "zbv"):
    for stream in (False, True):
      m = measure(schedule, stream, width, seq, rows, layers)
      seconds = dcn.seconds(m["gathered"]) if m["gathered"] else 0.0
      lines.append(f"| {schedule} | {'streamed' if stream else 'gathered'} "
                   f"| {_common.mib(m['temporaries'])} | {_common.mib(m['gathered'])} "
                   f"| {seconds * 1e3:.2f} | {_common.mib(m['per_tick'])} |")
      print(lines[-1], flush=True)
  run.write("Streamed inputs against one gather, two v5p slices, stage over DCN", lines)


if __name__ == "__main__":
  main()
