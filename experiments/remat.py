"""Rematerialization: per-device activation memory and FLOPs for remat none / dots / full.

Run from the repository root::

  python -m experiments.remat

Fixed pipeline (4 stages, M=8, GPipe, no data parallelism) and model (16 layers, width 256,
4 heads, MLP 1024, sequence 256, batch 32). For each remat policy the training step is compiled
ahead of time and its per-device memory (XLA ``memory_analysis``) and executed FLOPs (loop bodies
times trip counts) are reported. The recomputation share is the extra executed FLOPs over the
no-remat step, as a fraction of the step's FLOPs.

Writes ``experiments/results/remat.md``.
"""

from __future__ import annotations

import time

from experiments import _common

POLICIES = ("none", "dots", "full")


def main():
  started = time.time()
  reports = {}
  for policy in POLICIES:
    cfg = _common.config(num_layers=16, num_stages=4, num_microbatches=8, remat=policy)
    reports[policy] = _common.measure(cfg)
    print(f"  remat={policy}: {_common.mib(reports[policy].total_bytes)} MiB", flush=True)
  base = reports["none"]
  lines = _common.header("Rematerialization: memory and FLOPs per device",
                         "python -m experiments.remat", started)
  lines += [
      "Model: `configs/lm.py` with 16 layers, width 256, 4 heads, MLP 1024, sequence 256, "
      "global batch 32; 4 stages, M=8, GPipe, AdamW, float32. Activations = XLA temporaries "
      "minus the gradients (one parameter-sized buffer).", "",
      "| remat | activations + temporaries | peak total | executed FLOPs | x no-remat FLOPs | "
      "recompute share of step FLOPs | useful / executed |",
      "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for policy in POLICIES:
    r = reports[policy]
    executed = r.analysis.flops.executed
    extra = executed - base.analysis.flops.executed
    lines.append(
        f"| {policy} | {_common.mib(r.activation_bytes)} MiB | {_common.mib(r.total_bytes)} "
        f"MiB | {executed:.3g} | {executed / base.analysis.flops.executed:.3f} | "
        f"{extra / executed:.1%} | {r.analysis.pipeline.useful_fraction:.1%} |")
  full, dots = reports["full"], reports["dots"]
  lines += [
      "",
      f"Full remat cuts activation memory {base.activation_bytes / full.activation_bytes:.1f}x "
      f"({_common.mib(base.activation_bytes)} -> {_common.mib(full.activation_bytes)} MiB) for "
      f"{(full.analysis.flops.executed / base.analysis.flops.executed - 1):.0%} more FLOPs; "
      f"dots-saveable keeps the matmul outputs: "
      f"{_common.mib(dots.activation_bytes)} MiB for "
      f"{(dots.analysis.flops.executed / base.analysis.flops.executed - 1):.0%} more FLOPs.",
      "",
      "Paper (GPipe, Table 1, AmoebaNet on one accelerator): peak activation memory 6.26 GB "
      "without remat vs 3.46 GB with remat and micro-batches (a 1.8x cut, while the model grew "
      "3.9x); recomputation costs up to about 23% of step time (sec. 2.3 / 4). Our FLOP "
      "overhead for full remat is the forward pass run again: about a third of a step whose "
      "backward costs twice its forward.",
  ]
  _common.write("remat.md", lines)


if __name__ == "__main__":
  _common.setup()
  main()
