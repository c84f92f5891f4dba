"""Remat granularity at the GPipe paper's scale: the gradient program, chunk vs layer.

Run from the repository root (compiles only, nothing runs)::

  python -m experiments.remat_granularity_grad           # experiments/results/<this name>.md
  python -m experiments.remat_granularity_grad --smoke   # a tiny model, to check the script

The model is ``configs/transformer_gpipe.py`` (48 blocks of width 2048, MLP 8192, 32 heads,
sequence 512, batch 128 in M = 32 micro-batches of 4, bfloat16 compute, float32 parameters,
remat full, dropout off), on S = 4 stages (data = 1) with 12 blocks per stage (the embedding
joins the first stage's blocks, the head the last's). For ``schedule`` in gpipe / 1f1b and
``remat_granularity`` in chunk / layer it compiles ``jax.grad`` of the mean loss
(``method="loss"``; no optimizer; parameters in the stage layout, split over the stages, as the
train step keeps them) and reads ``memory_analysis()`` per device. The whole train step's
numbers (optimizer included) come from ``python -m tpipe.train.cli.report
--config=configs/transformer_gpipe.py --config.remat_granularity=...``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

import tpipe
from configs import transformer_gpipe
from experiments import _common
from tpipe.train import models


def measure(config, schedule: str, granularity) -> dict:
  """Per-device bytes of the compiled gradient of the mean loss."""
  stages = config.num_stages
  blocks = config.num_layers // stages
  balance = [blocks + 1] + [blocks] * (stages - 2) + [blocks + 1]
  kwargs = dict(num_layers=config.num_layers, width=config.width, num_heads=config.num_heads,
                mlp_dim=config.mlp_dim, max_len=config.seq_len, schedule=schedule,
                num_microbatches=config.num_microbatches, remat=config.remat,
                remat_granularity=granularity, dtype=jnp.dtype(config.dtype))
  mesh = tpipe.make_mesh(stages=stages, data=1)
  model = models.decoder_lm(num_stages=stages, balance=balance, mesh=mesh, **kwargs)
  tokens = jax.ShapeDtypeStruct((config.batch_size, config.seq_len), jnp.int32)
  # Parameters in the stage layout, split over 'stage', as the train step keeps them.
  layout = model.stage_layout(tokens, targets=tokens)
  model = model.with_split(layout)
  shapes = layout.staged_shapes()
  shardings = jax.tree.map(lambda _, spec: NamedSharding(mesh, spec), shapes,
                           layout.partition_specs())
  params = {"staged": _common.placed(shapes, shardings)}
  loss = lambda p, x, t: model.apply({"params": p}, x, targets=t, method="loss")
  start = time.perf_counter()
  compiled = jax.jit(jax.grad(loss)).lower(params, tokens, tokens).compile()
  memory = compiled.memory_analysis()
  return {"schedule": schedule, "granularity": granularity,
          "temp": memory.temp_size_in_bytes, "peak": _common.peak_bytes(memory),
          "seconds": time.perf_counter() - start}


def main():
  run = _common.start("remat_granularity_grad", __doc__, smoke="a tiny model (size=tiny, batch 16)")
  config = transformer_gpipe.get_config("size=tiny" if run.smoke else None)
  config.num_stages, config.num_data = 4, 1
  if run.smoke:
    config.batch_size = 16
  rows = []
  for schedule in ("gpipe", "1f1b"):
    for granularity in ("chunk", "layer"):
      row = measure(config, schedule, granularity)
      print(row, flush=True)
      rows.append(row)
  lines = [
      f"Model: L={config.num_layers} width={config.width} mlp={config.mlp_dim} "
      f"heads={config.num_heads} seq={config.seq_len} batch={config.batch_size} "
      f"M={config.num_microbatches} S={config.num_stages} dtype={config.dtype} "
      f"remat={config.remat}; `jax.grad` of the mean loss only (no optimizer).",
      "",
      "| schedule | remat_granularity | temporaries per device | peak per device | compile s |",
      "|---|---|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(f"| {r['schedule']} | {r['granularity']} | {_common.mib(r['temp'])} MiB | "
                 f"{_common.mib(r['peak'])} MiB | {r['seconds']:.0f} |")
  run.write("Remat granularity: the gradient program at the GPipe paper's scale", lines,
            "Compile only: every number is read from an ahead-of-time compile.")


if __name__ == "__main__":
  main()
