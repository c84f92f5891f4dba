"""Fused schedules side by side: activation memory in M, FLOPs per action, bubbles.

Run (8 emulated CPU devices; compiles only, nothing runs):

  python experiments/fused_schedules.py --out experiments/results/fused_schedules.md

The model is the decoder LM of the trainer (``tpipe.train.models.decoder_lm``: token embedding,
Transformer blocks, final norm + head + per-example loss), float32, one micro-batch of 4 x 64
tokens, width 128 (4 heads, MLP 512). Every schedule compiles the gradient of the mean loss
(``jax.grad``; for GPipe and circular, of ``mean(model(...))``) ahead of time, and reports:

* **Memory** (S = 4, 16 blocks, M = 8 and 64 micro-batches of a fixed size, so the batch grows
  with M): the compiled step's per-device temporaries (``memory_analysis().temp_size_in_bytes``),
  which hold the activations kept between forward and backward. GPipe keeps one stage input per
  forward tick (M + S - 1 of them), so its temporaries grow with M; the fused schedules keep at
  most the table's peak of micro-batches in flight, bounded by S.
* **FLOPs and bubble** (S = 8, 32 blocks, M = 8 and 32): from the compiled tick loop's branches
  (:func:`tpipe.tools.analysis.fused_flops`): the FLOPs of one ``F``, ``B``, ``BI`` and ``W``
  (mean over model chunks); the busiest device's executed FLOPs vs the useful FLOPs; the step's
  lockstep time in FLOPs (every tick lasts its costliest action); the lockstep-simulated bubble
  of the table under the measured per-action costs (``FusedSchedule.simulate``); and for the
  zero-bubble schedules ``(BI + W) / B``, the split backward's FLOPs over a fused backward's
  (the B branches are compiled into the same program, unused).

ZB-H1's analytic bubble with costs ``F``, ``BI``, ``W`` (Qi et al., 2024): the first stage idles
``(S - 1)(F + BI - W)`` per step of ``M (F + BI + W)`` work, a fraction
``(S - 1)(F + BI - W) / (M (F + BI + W) + (S - 1)(F + BI - W))``; with equal costs that is about
``(S - 1) / (3M)``.

``--smoke`` runs a tiny version in a minute, to check the script.
"""

from __future__ import annotations

import os

if "JAX_NUM_CPU_DEVICES" not in os.environ:
  os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import datetime
import platform
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import tpipe  # noqa: E402
from tpipe.tools import analysis  # noqa: E402
from tpipe.train import models  # noqa: E402

ROWS, SEQ, WIDTH, HEADS, MLP = 4, 64, 128, 4, 512
# (name, chunks per stage)
SCHEDULES = (("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved_1f1b", 2),
             ("zb_h1", 1), ("zbv", 2))
FUSED = tpipe.schedules.FUSED_SCHEDULE_NAMES


def compile_step(schedule: str, repeats: int, *, stages: int, microbatches: int,
                 num_layers: int, rows: int = ROWS, seq: int = SEQ, width: int = WIDTH):
  """(model, compiled gradient step) of the LM for one schedule."""
  mesh = tpipe.make_mesh(stages=stages)
  chunks = stages * repeats
  # Embedding with the first blocks, the head with the last: units split evenly.
  units = num_layers + 2
  counts = [units // chunks + (c < units % chunks) for c in range(chunks)]
  model = models.decoder_lm(num_layers=num_layers, width=width, num_heads=HEADS,
                            mlp_dim=4 * width, max_len=seq, num_stages=stages,
                            num_microbatches=microbatches, schedule=schedule,
                            num_repeats=repeats, remat="full", balance=counts, mesh=mesh)
  batch = rows * microbatches
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  plain = model.clone(num_stages=1, num_microbatches=1, schedule="gpipe", num_repeats=1,
                      balance="params", mesh=None)
  params = jax.eval_shape(plain.init, {"params": jax.random.key(0)}, tokens,
                          targets=tokens)["params"]
  apply = lambda p, x, t: model.apply({"params": p}, x, targets=t)
  loss = apply if schedule in FUSED else (lambda p, x, t: jnp.mean(apply(p, x, t)))
  compiled = jax.jit(jax.grad(loss)).lower(params, tokens, tokens).compile()
  return model, compiled


def zb_h1_analytic(costs, stages: int, microbatches: int) -> float:
  f, bi, w = costs["F"], costs["BI"], costs["W"]
  idle = (stages - 1) * (f + bi - w)
  return idle / (microbatches * (f + bi + w) + idle)


def memory_table(stages: int, num_layers: int, ms: tuple[int, ...]) -> list[str]:
  lines = [f"### Activation memory in M (S = {stages}, {num_layers} blocks, micro-batch "
           f"{ROWS} x {SEQ})", "",
           "| schedule | " + " | ".join(f"temporaries at M = {m}" for m in ms)
           + f" | M = {ms[-1]} / M = {ms[0]} | in flight per stage (peak) |",
           "|---|" + "---|" * (len(ms) + 2)]
  for name, repeats in SCHEDULES:
    temps, peak = [], "-"
    for m in ms:
      model, compiled = compile_step(name, repeats, stages=stages, microbatches=m,
                                     num_layers=num_layers)
      temps.append(compiled.memory_analysis().temp_size_in_bytes)
      table = model.schedule_table()
      if name in FUSED:
        peak = str(table.peak_in_flight().tolist())
      else:
        peak = f"{int(table.stashed_microbatches().max())} (one per forward tick)"
    lines.append(f"| {name} | " + " | ".join(analysis.format_bytes(t) for t in temps)
                 + f" | {temps[-1] / temps[0]:.2f} | {peak} |")
  return lines


def flops_table(stages: int, num_layers: int, ms: tuple[int, ...]) -> list[str]:
  lines = [f"### FLOPs and bubble (S = {stages}, {num_layers} blocks, micro-batch "
           f"{ROWS} x {SEQ}; MFLOP per device)", "",
           "| schedule | M | F | B | BI | W | (BI + W) / B | executed (busiest device) | useful "
           "(mean) | lockstep | bubble, unit costs: table | ZB-H1 analytic | bubble, measured "
           "costs: natural | ZB-H1 analytic | lockstep |",
           "|---|" + "---|" * 14]
  mf = lambda v: f"{v / 1e6:.1f}" if np.isfinite(v) else "-"
  for name, repeats in SCHEDULES:
    if name not in FUSED:
      continue
    for m in ms:
      model, compiled = compile_step(name, repeats, stages=stages, microbatches=m,
                                     num_layers=num_layers)
      table = model.schedule_table()
      found = analysis.fused_flops(compiled, table)
      mean = {k: float(np.mean(v)) for k, v in found.actions.items()}
      costs = found.costs()
      timing = table.simulate(costs)
      split = (mean["BI"] + mean["W"]) / mean["B"] if np.isfinite(mean["BI"]) else float("nan")
      zb = name == "zb_h1"
      unit = zb_h1_analytic({"F": 1, "BI": 1, "W": 1}, stages, m) if zb else float("nan")
      analytic = zb_h1_analytic(costs, stages, m) if zb else float("nan")
      show = lambda v: f"{v:.3f}" if np.isfinite(v) else "-"
      lines.append(
          f"| {name} | {m} | {mf(mean['F'])} | {mf(mean['B'])} | {mf(mean['BI'])} | "
          f"{mf(mean['W'])} | {split:.4f} | {mf(found.executed)} | {mf(found.useful)} | "
          f"{mf(found.lockstep)} | {table.bubble_fraction:.3f} | {show(unit)} | "
          f"{timing.natural_bubble:.3f} | {show(analytic)} | {timing.lockstep_bubble:.3f} |")
  return lines


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=None, help="write the markdown results here")
  parser.add_argument("--smoke", action="store_true", help="a tiny version, to check the script")
  args = parser.parse_args(argv)
  start = time.time()
  if args.smoke:
    lines = memory_table(2, 4, (2, 4)) + [""] + flops_table(2, 6, (2,))
  else:
    lines = memory_table(4, 16, (8, 64)) + [""] + flops_table(8, 32, (8, 32))
  header = [
      "# Fused schedules: memory in M, FLOPs per action, bubbles", "",
      f"Command: `python experiments/fused_schedules.py{' --smoke' if args.smoke else ''}"
      f"{' --out ' + args.out if args.out else ''}`", "",
      f"{datetime.date.today()}, jax {jax.__version__}, {platform.machine()}, "
      f"{jax.device_count()} emulated CPU devices; compile only, {time.time() - start:.0f} s.",
      ""]
  text = "\n".join(header + lines) + "\n"
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text)


if __name__ == "__main__":
  main()
