"""Memory per device of the train step compiled for a TPU v5p slice, against MaxText's.

The model and target of the memory issue: 16 decoder blocks of width 2048 (16 heads of 128, MLP
8192, gelu), vocabulary 32000 with an untied embedding and head, sequence 1024, global batch 64,
bfloat16 compute with float32 parameters and AdamW state, remat full, pipeline 4 x data 2 (the
last rows: 4 x fsdp 2, each stage's state and rows split over the fsdp pair), the
layers cut 5,4,4,5 (embedding and head one unit each; 3,2,2,2,2,2,2,3 for the 8 chunks of
circular R = 2). Each row is ``configs/lm.py`` with those
fields, built with ``tpipe.train.cli.experiment.build`` on the devices of the TPU topology
``v5p:2x2x2`` (8 chips; :func:`tpipe.topology_devices`), its whole train step lowered on the
abstract state and compiled by the TPU compiler on this CPU machine. Nothing runs on a TPU.

Each row is what ``python -m tpipe.train.cli.report --topology=v5p:2x2x2`` measures for that
config (:func:`tpipe.train.cli.config_costs.analyze_config`): the arguments, temporaries and peak of
``memory_analysis()``, and the breakdown of what is live at the memory peak
(:mod:`tpipe.tools.peak`) by role. MaxText's numbers are quoted from
the issue (MaxText 0.2.5, jax 0.11.1, libtpu 0.0.46.3, the same model and target); this script
does not run MaxText.

Needs the TPU compiler: ``pip install -e '.[tpu]'`` (or ``pip install libtpu`` in an environment
whose jax matches).
"""

from __future__ import annotations

import os

from experiments import _common

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # One host: no slice discovery.

from tpipe.train.cli import config_costs  # noqa: E402  pylint: disable=g-import-not-at-top

TOPOLOGY = "v5p:2x2x2"
# (label, schedule, M, remat_granularity, num_repeats, vocab_chunks[, fsdp]): with fsdp = 2 the
# mesh is pipeline 4 x fsdp 2 instead of 4 x data 2 (MaxText's last row).
ROWS = [
    ("gpipe, remat chunk", "gpipe", 16, "chunk", 1, 1),
    ("gpipe, remat chunk", "gpipe", 8, "chunk", 1, 1),
    ("gpipe, remat chunk, loss in 8 vocabulary slices", "gpipe", 16, "chunk", 1, 8),
    ("gpipe, remat per layer", "gpipe", 16, "layer", 1, 1),
    ("gpipe, remat nested (chunk, then each layer)", "gpipe", 16, "nested", 1, 1),
    ("gpipe, remat nested (chunk, then each layer)", "gpipe", 8, "nested", 1, 1),
    ("gpipe, remat nested, loss in 8 vocabulary slices", "gpipe", 16, "nested", 1, 8),
    ("1f1b, remat chunk", "1f1b", 16, "chunk", 1, 1),
    ("1f1b, remat per layer", "1f1b", 16, "layer", 1, 1),
    ("1f1b, remat nested", "1f1b", 16, "nested", 1, 1),
    ("circular R=2, remat chunk", "circular", 16, "chunk", 2, 1),
    ("circular R=2, remat nested", "circular", 16, "nested", 2, 1),
    ("gpipe, remat chunk, fsdp=2 instead of data=2", "gpipe", 16, "chunk", 1, 1, 2),
    ("gpipe, remat nested, fsdp=2 instead of data=2", "gpipe", 16, "nested", 1, 1, 2),
    ("gpipe, remat nested, fsdp=2 instead of data=2", "gpipe", 8, "nested", 1, 1, 2),
    ("1f1b, remat per layer, fsdp=2 instead of data=2", "1f1b", 16, "layer", 1, 1, 2),
]
SMOKE_ROWS = [("gpipe, remat nested (chunk, then each layer)", "gpipe", 16, "nested", 1, 1)]
# MaxText 0.2.5 on the same model and target, from the issue: (schedule, M, arguments GiB,
# temporaries GiB, peak GiB).
MAXTEXT = [
    ("gpipe-style, 4 layers/stage", 16, 3.72, 3.81, 7.52),
    ("gpipe-style", 8, 3.72, 3.64, 7.35),
    ("circular, 1 layer/stage x 4 repeats", 16, 3.72, 2.96, 6.67),
    ("gpipe-style, fsdp=2 instead of data=2", 16, 1.86, 3.29, 5.15),
]


def lm_config(schedule: str, microbatches: int, granularity: str, repeats: int,
              vocab_chunks: int = 1, fsdp: int = 1):
  from configs import lm  # pylint: disable=g-import-not-at-top

  c = lm.get_config("size=base")
  c.update(dict(num_layers=16, width=2048, num_heads=16, mlp_dim=8192, seq_len=1024,
                vocab_size=32000, batch_size=64, dropout=0.0, dtype="bfloat16", num_stages=4,
                num_data=2, balance="5,4,4,5" if repeats == 1 else "3,2,2,2,2,2,2,3",
                num_microbatches=microbatches,
                schedule=schedule, remat="full", remat_granularity=granularity,
                num_repeats=repeats, vocab_chunks=vocab_chunks))
  if fsdp > 1:  # The batch's rows and each stage's state split over fsdp instead of data.
    c.num_data = 1
    c.mesh.fsdp = fsdp
  return c


def compile_row(schedule, microbatches, granularity, repeats, vocab_chunks, fsdp=1):
  measured = config_costs.analyze_config(
      lm_config(schedule, microbatches, granularity, repeats, vocab_chunks, fsdp),
      per_stage=False, topology=TOPOLOGY, breakdown=True)
  return measured.compiled.memory_analysis(), measured.peak


def main():
  run = _common.start(
      "tpu_memory", __doc__, smoke="the nested-remat gpipe row alone",
      arguments=lambda parser: parser.add_argument(
          "--only", default="", help="run only the rows whose label contains this text (with "
          "--out, e.g. --only='vocabulary slices' --out=experiments/results/tpu_memory_vocab.md)"))
  gib = lambda n: f"{n / 2**30:.2f}"
  table = ["| framework | schedule | M | arguments GiB | temporaries GiB | peak GiB |",
           "|---|---|---:|---:|---:|---:|"]
  table += [f"| MaxText (quoted) | {s} | {m} | {a:.2f} | {t:.2f} | {p:.2f} |"
            for s, m, a, t, p in MAXTEXT]
  details = []
  rows = SMOKE_ROWS if run.args.smoke else [row for row in ROWS if run.args.only in row[0]]
  for label, schedule, microbatches, granularity, repeats, vocab_chunks, *fsdp in rows:
    memory, breakdown = compile_row(schedule, microbatches, granularity, repeats, vocab_chunks,
                                    *fsdp)
    peak_bytes = _common.peak_bytes(memory)
    table.append(f"| tpipe | {label} | {microbatches} | {gib(memory.argument_size_in_bytes)} "
                 f"| {gib(memory.temp_size_in_bytes)} | **{gib(peak_bytes)}** |")
    print(table[-1], flush=True)
    roles = breakdown.by_role()
    allocated = breakdown.allocated_temporaries
    details += [f"### {label}, M = {microbatches}", "",
                f"Live at the peak: {gib(breakdown.total)} GiB, of which temporaries "
                f"{gib(breakdown.temporaries)} GiB (no role explains "
                f"{gib(breakdown.unexplained)} GiB of them). Buffer assignment reserves "
                f"{gib(allocated)} GiB for temporaries (what is live at other times, packed "
                f"around the peak: {gib(allocated - breakdown.in_temporaries)} GiB more); "
                f"`memory_analysis()` reports {gib(memory.temp_size_in_bytes)} GiB "
                f"({gib(memory.temp_size_in_bytes - allocated)} GiB beyond the dumped "
                "buffer assignment, which this breakdown cannot see into).", "",
                "| role | GiB |", "|---|---:|"]
    details += [f"| {role} | {gib(n)} |" for role, n in roles.items()]
    details += [""]
  lines = ["Per device, from `memory_analysis()` of the step compiled for "
           f"`{TOPOLOGY}`; peak = arguments + outputs - aliased + temporaries.", ""]
  lines += table + ["", "## What is live at each peak", ""] + details
  run.write("Memory per device on a TPU v5p slice: tpipe against MaxText", lines)


if __name__ == "__main__":
  main()
