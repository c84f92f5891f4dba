"""Predicted step time, tokens per second and MFU from the compiled program (tpipe.tools.step_time).

Command: ``python -m experiments.step_time`` (``--smoke``: the tiny LM under 1F1B and the CPU
step only).

Each TPU row is ``configs/lm.py`` with the fields below, its train step compiled by the TPU
compiler for the topology ``v5p:2x2x2`` (8 chips) on this CPU machine and never run, then
priced as ``python -m tpipe.train.cli.report --topology=v5p:2x2x2`` prices it
(:func:`tpipe.train.cli.config_costs.predict`): every top-level instruction by the roofline of v5p's
459 TFLOP/s and 2765 GB/s, loop bodies times the trip counts read from their counters, the
collectives on ICI (async ones overlapped with the compute between start and done), a fused
table followed tick by tick with each action's branch priced (the bubble counted), a forward
table (GPipe) priced whole with its simulated bubble share. MFU divides the model FLOPs (6 x
parameters x tokens plus attention) by the predicted time and the peak.

The model: 8 decoder blocks of width 1024 (8 heads, MLP 4096), vocabulary 32000, sequence 512,
global batch 32, bfloat16 compute, remat full; pipeline 4 x data 2 with M = 8, and the same model
without a pipeline (data 8) as the reference.

The last rows price a plain ``jax.jit`` training step of a 4-layer MLP compiled for this CPU
(no tpipe in it: the estimator reads only the HLO text) on each chip of the table, and check its
FLOPs against :func:`tpipe.tools.flops.flop_count`.

Nothing here ran on an accelerator: these are predictions, not measurements.
"""

from __future__ import annotations

import os
import time

from experiments import _common

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # One host: no slice discovery.

import jax  # noqa: E402  pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # noqa: E402  pylint: disable=g-import-not-at-top

from tpipe.tools import chips  # noqa: E402  pylint: disable=g-import-not-at-top
from tpipe.tools import flops as flops_lib  # noqa: E402  pylint: disable=g-import-not-at-top
from tpipe.tools import step_time  # noqa: E402  pylint: disable=g-import-not-at-top
from tpipe.train.cli import config_costs  # noqa: E402  pylint: disable=g-import-not-at-top

TOPOLOGY = "v5p:2x2x2"
# (label, schedule, num_stages, num_data, M).
ROWS = [
    ("GPipe, 4 stages x data 2", "gpipe", 4, 2, 8),
    ("1F1B, 4 stages x data 2", "1f1b", 4, 2, 8),
    ("no pipeline, data 8", "gpipe", 1, 8, 1),
]


def lm_config(schedule: str, stages: int, data: int, microbatches: int, smoke: bool):
  from configs import lm  # pylint: disable=g-import-not-at-top

  if smoke:
    c = lm.get_config("size=tiny")
    c.update(dict(schedule=schedule, num_stages=stages, num_data=data, dtype="bfloat16"))
    return c
  c = lm.get_config("size=base")
  c.update(dict(num_layers=8, width=1024, num_heads=8, mlp_dim=4096, seq_len=512,
                vocab_size=32000, batch_size=32, dropout=0.0, dtype="bfloat16",
                num_stages=stages, num_data=data, num_microbatches=microbatches,
                schedule=schedule, remat="full"))
  return c


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:.3f}"


def tpu_row(label, schedule, stages, data, microbatches, smoke):
  start = time.perf_counter()
  measured = config_costs.analyze_config(
      lm_config(schedule, stages, data, microbatches, smoke), per_stage=False, topology=TOPOLOGY)
  p = measured.prediction
  kinds = ("compute", "memory", "exposed collectives", "bubble")
  parts = " / ".join(_ms(p.parts[k]) for k in kinds)
  row = (f"| {label} | {measured.num_params / 1e6:.1f} M | **{_ms(p.seconds)}** | "
         f"{p.tokens_per_second:,.0f} | {p.mfu:.1%} | {parts} | {_ms(p.recompute)} | "
         f"{p.step_time.flops / 1e12:.3f} | {p.step_time.hbm_bytes / 2 ** 30:.2f} | "
         f"{'tick by tick' if p.tick_by_tick else 'whole'} | "
         f"{sorted(n for n in p.step_time.trip_counts.values() if n)} | "
         f"{time.perf_counter() - start:.0f} |")
  print(row, flush=True)
  return row


def mlp_step():
  """A plain jax.jit training step: a 4-layer MLP of width 2048, batch 256, bfloat16, SGD."""
  def loss(params, x):
    for w in params:
      x = jax.nn.gelu(x @ w)
    return jnp.mean(x.astype(jnp.float32) ** 2)

  def step(params, x):
    grads = jax.grad(loss)(params, x)
    return [w - 1e-3 * g for w, g in zip(params, grads)]

  params = [jnp.zeros((2048, 2048), jnp.bfloat16)] * 4
  x = jnp.zeros((256, 2048), jnp.bfloat16)
  return jax.jit(step).lower(params, x).compile(), 3 * 4 * 2 * 256 * 2048 * 2048


def cpu_rows():
  compiled, model_flops = mlp_step()
  counted = flops_lib.flop_count(compiled).executed
  rows = []
  for name in chips.CHIPS:
    t = step_time.estimate(compiled, name)
    b = t.breakdown()
    rows.append(f"| {name} | **{_ms(t.seconds)}** | {t.mfu(model_flops):.1%} | "
                f"{_ms(b['compute'])} / {_ms(b['memory'])} | {t.flops / 1e9:.3f} | "
                f"{counted / 1e9:.3f} | {t.hbm_bytes / 2 ** 20:.1f} |")
    print(rows[-1], flush=True)
  return rows, model_flops


def main():
  run = _common.start("step_time", __doc__, smoke="the tiny LM under 1F1B and the CPU step")
  rows = [ROWS[1]] if run.smoke else ROWS
  lines = ["## Train steps compiled for " + TOPOLOGY, "",
           "Per device, priced on v5p. Parts: compute-bound / memory-bound / exposed collectives "
           "/ bubble, in ms (they add up to the step).", "",
           "| config | parameters | predicted step ms | tokens/s | MFU | parts ms | of which "
           "recompute ms | executed TFLOP | HBM GiB | pipeline priced | loop trips | compile s |",
           "|---|---:|---:|---:|---:|---|---:|---:|---:|---|---|---:|"]
  lines += [tpu_row(*row, run.smoke) for row in rows]
  cpu, model_flops = cpu_rows()
  lines += ["", "## A plain jax.jit step compiled for this CPU, priced on every chip", "",
            f"A 4-layer MLP of width 2048, batch 256, bfloat16 (model FLOPs "
            f"{model_flops / 1e9:.3f} G per step); parts: compute-bound / memory-bound ms; "
            "FLOPs: the estimator's and `tpipe.tools.flops.flop_count`'s.", "",
            "| chip | predicted step ms | MFU | parts ms | GFLOP (estimate) | GFLOP (flop_count) "
            "| HBM MiB |", "|---|---:|---:|---|---:|---:|---:|"] + cpu
  run.write("Predicted step time from the compiled program", lines,
            note="Predictions from the roofline model of `tpipe.tools.step_time`; nothing ran "
            "on a TPU or GPU, so no prediction here is checked against a measurement.")


if __name__ == "__main__":
  main()
