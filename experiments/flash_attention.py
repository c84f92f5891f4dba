"""Flash attention in the stages: the 8B-shaped step with splash attention against blocked XLA
attention, memory and predicted step time, compiled ahead of time for a TPU v5p slice.

Each row is a row of ``experiments/memory_at_scale.py`` (``configs/lm.py``, the Llama-3-8B shape:
32 blocks of width 4096, 32 query and 8 key/value heads of 128, MLP 14336, vocabulary 128256,
sequence 4096, global batch 128, bfloat16 compute, remat full; stage 4 x fsdp 8 x tensor 2 on
``v5p:4x4x4``) compiled twice: ``attention="blocked"`` (tpipe's XLA attention, one block of 512
queries at a time in the backward) and ``attention="flash"`` (:mod:`tpipe.train.flash_attention`:
on TPU, JAX's Pallas splash attention, causal, grouped-query heads, blocks of 512, manual over
the ``tensor`` axis). The step is built by ``tpipe.train.cli.experiment.build`` on the topology's
devices and compiled by the TPU compiler on this CPU machine; nothing runs on a TPU.

Columns, per device: the peak, state and temporaries from ``memory_analysis()`` (peak =
arguments + outputs - aliased + temporaries); the predicted step time of
:func:`tpipe.train.cli.config_costs.predict` (:mod:`tpipe.tools.step_time`'s roofline on v5p,
the tick loop priced whole for GPipe with its simulated bubble, tick by tick for 1F1B); the
executed TFLOP the model counts; the compile time.

The roofline reads FLOPs off the HLO, and a Pallas kernel is one ``custom-call`` without an HLO
body: the model prices splash attention by the bytes it reads and writes only, as if its
matmuls were free (splash attention's ``pallas_call`` gives XLA no cost estimate on jax
0.10.2). The flash rows' "kernel compute" column estimates what is missing: the blocked row's
executed FLOPs less the flash row's (the attention the kernel took over: scores, softmax and
the two matmuls, in the forward, its recomputation and the backward), times the share of
key blocks a causal kernel computes (``(n + 1) / 2n`` of them for ``n`` blocks of 512), at the
chip's peak; "flash + kernel" adds it to the prediction. Both are estimates of a model; only a
TPU measures.

Command: ``python -m experiments.flash_attention`` (``--smoke``: a 2-block Llama on
``v5p:2x2x2``, stage 2 x fsdp 2 x tensor 2, sequence 1024).
"""

from __future__ import annotations

import dataclasses
import os
import time

from experiments import _common

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # One host: no slice discovery.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from experiments import memory_at_scale  # noqa: E402  pylint: disable=g-import-not-at-top
from experiments import scale_3d  # noqa: E402  pylint: disable=g-import-not-at-top
from tpipe.train import flash_attention  # noqa: E402  pylint: disable=g-import-not-at-top
from tpipe.train.cli import config_costs  # noqa: E402  pylint: disable=g-import-not-at-top

Row = memory_at_scale.Row
ROWS = [
    Row("default (gpipe, M = 16)", "llama3-8b", (4, 8, 2, 1),
        dict(schedule="gpipe", num_microbatches=16)),
    Row("1f1b, granularity layer (M = 16)", "llama3-8b", (4, 8, 2, 1),
        dict(schedule="1f1b", num_microbatches=16, remat_granularity="layer")),
]
SMOKE_MODEL = memory_at_scale.Model("v5p:2x2x2", dict(
    num_layers=2, width=1024, num_heads=8, num_kv_heads=2, mlp_dim=2048, block="llama",
    seq_len=1024, vocab_size=32000, batch_size=16))
SMOKE_ROWS = [Row("smoke (gpipe, M = 4)", "smoke", (2, 2, 2, 1),
                  dict(schedule="gpipe", num_microbatches=4))]
ATTENTION = ("blocked", "flash")


MODELS = dict(memory_at_scale.MODELS, smoke=SMOKE_MODEL)


def config_for(row: Row, attention: str):
  """``(config, topology)`` of ``row`` (as ``experiments/memory_at_scale.py`` makes its
  configs) with ``attention``."""
  from configs import lm  # pylint: disable=g-import-not-at-top

  model = MODELS[row.model]
  stages, fsdp, tensor, data = row.layout
  config = lm.get_config("size=base")
  config.update(dict(model.fields, dropout=0.0, dtype="bfloat16", remat="full",
                     num_stages=stages, num_data=data,
                     balance=scale_3d.balance(model.fields["num_layers"], stages)))
  config.update(row.fields)
  config.mesh.update(dict(fsdp=fsdp, tensor=tensor))
  config.attention = attention
  return config, model.topology


@dataclasses.dataclass(frozen=True)
class Measured:
  peak: int
  state: int
  temporaries: int
  seconds: float
  tflop: float
  peak_flops: float
  compile_seconds: float


def measure(row: Row, attention: str) -> Measured:
  config, topology = config_for(row, attention)
  start = time.perf_counter()
  report = config_costs.analyze_config(config, per_stage=False, topology=topology)
  memory = report.compiled.memory_analysis()
  p = report.prediction
  return Measured(peak=_common.peak_bytes(memory), state=memory.argument_size_in_bytes,
                  temporaries=memory.temp_size_in_bytes, seconds=p.seconds,
                  tflop=p.step_time.flops / 1e12, peak_flops=p.peak_flops,
                  compile_seconds=time.perf_counter() - start)


def causal_share(seq_len: int) -> float:
  """The share of key blocks splash attention computes under the causal mask."""
  n = seq_len // flash_attention.splash_block(seq_len)
  return (n + 1) / (2 * n)


def main():
  run = _common.start("flash_attention", __doc__, smoke="a 2-block Llama on v5p:2x2x2",
                      arguments=lambda parser: parser.add_argument(
                          "--rows", default="", help="comma-separated row numbers to compile "
                          "(0-based, in the order of ROWS); default all"))
  rows = SMOKE_ROWS if run.smoke else ROWS
  if run.args.rows:
    rows = [ROWS[int(i)] for i in run.args.rows.split(",")]
  gib = _common.gib
  table = ["| model | stage x fsdp x tensor x data | row | attention | peak GiB | state GiB | "
           "temporaries GiB | predicted step ms | executed TFLOP | kernel compute ms | "
           "flash + kernel ms | compile s |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for row in rows:
    found = {}
    for attention in ATTENTION:
      m = found[attention] = measure(row, attention)
      kernel = total = ""
      if attention != "blocked":
        config, _ = config_for(row, attention)
        missing = max(0.0, found["blocked"].tflop - m.tflop) * 1e12
        kernel_s = missing * causal_share(config.seq_len) / m.peak_flops
        kernel, total = f"{kernel_s * 1e3:.1f}", f"**{(m.seconds + kernel_s) * 1e3:.1f}**"
      layout = " x ".join(map(str, row.layout))
      table.append(f"| {row.model} | {layout} | {row.label} | {attention} | **{gib(m.peak)}** | "
                   f"{gib(m.state)} | {gib(m.temporaries)} | {m.seconds * 1e3:.1f} | "
                   f"{m.tflop:.2f} | {kernel} | {total} | {m.compile_seconds:.0f} |")
      print(table[-1], flush=True)
  run.write("Flash attention in the stages: splash against blocked attention", table,
            note="Per device, compiled by the TPU compiler (nothing ran on a TPU); the step "
            "times are the roofline model's predictions, the kernel's compute estimated as the "
            "script's documentation says.")


if __name__ == "__main__":
  main()
