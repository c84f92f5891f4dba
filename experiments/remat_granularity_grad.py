"""Remat granularity at the GPipe paper's scale: the gradient program, chunk vs layer, GPipe vs 1F1B.

Run (8 emulated CPU devices; compiles only, nothing runs):

  python experiments/remat_granularity.py --out experiments/results/remat_granularity_grad.md

The model is ``configs/transformer_gpipe.py`` (48 blocks of width 2048, MLP 8192, 32 heads,
sequence 512, batch 128 in M = 32 micro-batches of 4, bfloat16 compute, float32 parameters,
remat full, dropout off), on S = 4 stages (data = 1) with 12 blocks per stage (the embedding
joins the first stage's blocks, the head the last's). The trainer does not run fused schedules
yet, so this compiles ``jax.grad`` of the mean loss (no optimizer; parameters in the stage
layout, split over the stages, as the train step keeps them) for ``schedule`` in gpipe / 1f1b
and ``remat_granularity`` in chunk / layer, and reads ``memory_analysis()`` per device. ``python -m tpipe.report`` gives the
train step's numbers for GPipe (see experiments/results/remat_granularity.md).

``--smoke`` compiles a tiny model instead, to check the script in a minute.
"""

from __future__ import annotations

import os

if "JAX_NUM_CPU_DEVICES" not in os.environ:
  os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import tpipe  # noqa: E402
from configs import transformer_gpipe  # noqa: E402
from tpipe.train import models  # noqa: E402

MIB = 2**20


def measure(config, schedule: str, granularity) -> dict:
  """Per-device bytes of the compiled gradient of the mean loss."""
  stages = config.num_stages
  blocks = config.num_layers // stages
  balance = [blocks + 1] + [blocks] * (stages - 2) + [blocks + 1]
  kwargs = dict(num_layers=config.num_layers, width=config.width, num_heads=config.num_heads,
                mlp_dim=config.mlp_dim, max_len=config.seq_len, schedule=schedule,
                num_microbatches=config.num_microbatches, remat=config.remat,
                remat_granularity=granularity, dtype=jnp.dtype(config.dtype))
  model = models.decoder_lm(num_stages=stages, balance=balance,
                            mesh=tpipe.make_mesh(stages=stages, data=1), **kwargs)
  tokens = jax.ShapeDtypeStruct((config.batch_size, config.seq_len), jnp.int32)
  # Parameters in the stage layout, split over 'stage', as the train step keeps them.
  layout = model.stage_layout(tokens, targets=tokens)
  model = model.with_split(layout)
  mesh = model.mesh
  specs = layout.partition_specs()
  params = {"staged": {k: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                               sharding=NamedSharding(mesh, specs[k]))
                       for k, s in layout.staged_shapes().items()}}
  apply = lambda p, x, t: model.apply({"params": p}, x, targets=t)
  loss = apply if schedule == "1f1b" else (lambda p, x, t: jnp.mean(apply(p, x, t)))
  start = time.perf_counter()
  compiled = jax.jit(jax.grad(loss)).lower(params, tokens, tokens).compile()
  mem = compiled.memory_analysis()
  return {"schedule": schedule, "granularity": granularity, "temp": mem.temp_size_in_bytes,
          "peak": (mem.argument_size_in_bytes + mem.output_size_in_bytes
                   - mem.alias_size_in_bytes + mem.temp_size_in_bytes),
          "seconds": time.perf_counter() - start}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=None, help="markdown file to write")
  parser.add_argument("--smoke", action="store_true", help="a tiny model, to check the script")
  args = parser.parse_args()
  started = time.time()
  config = transformer_gpipe.get_config("size=tiny" if args.smoke else None)
  config.num_stages, config.num_data = 4, 1
  if args.smoke:
    config.batch_size = 16
  rows = []
  for schedule in ("gpipe", "1f1b"):
    for granularity in ("chunk", "layer"):
      row = measure(config, schedule, granularity)
      print(row, flush=True)
      rows.append(row)
  command = "python " + " ".join(sys.argv)
  lines = [
      "# Remat granularity: the gradient program at the GPipe paper's scale",
      "",
      f"Command: `{command}` ({time.time() - started:.0f} s, "
      f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
      f"{platform.machine()}, jax {jax.__version__}).",
      "",
      f"Model: L={config.num_layers} width={config.width} mlp={config.mlp_dim} "
      f"heads={config.num_heads} seq={config.seq_len} batch={config.batch_size} "
      f"M={config.num_microbatches} S={config.num_stages} dtype={config.dtype} "
      f"remat={config.remat}; `jax.grad` of the mean loss only (no optimizer).",
      "",
      "| schedule | remat_granularity | temporaries per device | peak per device | compile s |",
      "|---|---|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(f"| {r['schedule']} | {r['granularity']} | {r['temp'] / MIB:,.1f} MiB | "
                 f"{r['peak'] / MIB:,.1f} MiB | {r['seconds']:.0f} |")
  text = "\n".join(lines) + "\n"
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text)


if __name__ == "__main__":
  main()
