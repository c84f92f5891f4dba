"""Memory per device of a Mixtral-8x7B-shaped train step on 64 v5p chips, beside MaxText's.

Each row is ``configs/lm.py`` with ``block="moe"`` (Mixtral's: llama attention, a mixture of 8
SwiGLU experts, top-2, dropless), built by ``tpipe.train.experiment.build`` on the devices of the
``v5p:4x4x4`` topology (:func:`tpipe.topology_devices`) and its whole train step compiled ahead of
time by the TPU compiler on this CPU machine; nothing runs on a TPU. The model: 32 blocks of width
4096, 32 query heads and 8 key/value heads, experts of MLP 14336, vocabulary 32000, sequence 4096,
global batch 128; bfloat16 compute, float32 parameters and AdamW state, remat full, 16
micro-batches. The layouts put stages, experts and tensor shards on the 64 chips (``stage x
expert x tensor``; no fsdp, no data).

Columns, per device: the peak as ``memory_analysis()`` gives it (arguments + outputs - aliased +
temporaries), the state (arguments), the temporaries, and the compile time; the breakdown by role
(:mod:`tpipe.tools.peak`) as ``experiments/memory_at_scale.py`` gives it.

MaxText's figures are quoted from issue 60 (MaxText 0.2.5, the same model, slice and formula:
pipeline 4 x expert 8 x tensor 2, 16 micro-batches, 38.01 GiB; its best layout, expert 8 x fsdp
8 without a pipeline, 29.65 GiB); this script does not run MaxText.

Needs the TPU compiler: ``pip install -e '.[tpu]'``. ``--smoke`` compiles the first row.
"""

from __future__ import annotations

import dataclasses
import os

from experiments import _common

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # One host: no slice discovery.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import tpipe  # noqa: E402  pylint: disable=g-import-not-at-top
from experiments import scale_3d  # noqa: E402  pylint: disable=g-import-not-at-top

TOPOLOGY = "v5p:4x4x4"
MIXTRAL_8X7B = dict(num_layers=32, width=4096, num_heads=32, num_kv_heads=8, mlp_dim=14336,
                    block="moe", num_experts=8, experts_per_token=2, capacity_factor=0.0,
                    positions="rotary", final_norm="rms", head_bias=False, seq_len=4096,
                    vocab_size=32000, batch_size=128)


@dataclasses.dataclass(frozen=True)
class Row:
  """One compiled configuration."""

  label: str
  layout: tuple[int, int, int]  # stages, expert, tensor
  fields: dict
  maxtext: str = ""


ROWS = [
    Row("default (gpipe)", (4, 8, 2), dict(schedule="gpipe", num_microbatches=16),
        "38.01 (its pipeline)"),
    Row("1f1b", (4, 8, 2), dict(schedule="1f1b", num_microbatches=16)),
]


def config_for(row: Row):
  from configs import lm  # pylint: disable=g-import-not-at-top

  stages, expert, tensor = row.layout
  c = lm.get_config("size=base")
  c.update(dict(MIXTRAL_8X7B, dropout=0.0, dtype="bfloat16", remat="full", num_stages=stages,
                num_data=1, balance=scale_3d.balance(MIXTRAL_8X7B["num_layers"], stages),
                router_aux_loss_coef=0.02, router_z_loss_coef=0.001))
  c.update(row.fields)
  c.mesh.update(dict(fsdp=1, expert=expert, tensor=tensor))
  return c


def main():
  run = _common.start("moe_memory", __doc__, smoke="the first row",
                      arguments=lambda parser: parser.add_argument(
                          "--rows", default="", help="comma-separated row numbers (0-based)"))
  gib = _common.gib
  rows = ROWS[:1] if run.smoke else ROWS
  if run.args.rows:
    rows = [ROWS[int(i)] for i in run.args.rows.split(",")]
  table = ["| stage x expert x tensor | row | peak GiB | MaxText GiB | state GiB | "
           "temporaries GiB | compile s |", "|---|---|---:|---|---:|---:|---:|"]
  parts = ["| row | " + " | ".join(scale_3d.PARTS) + " | live at peak |",
           "|---|" + "---:|" * (len(scale_3d.PARTS) + 1)]
  devices = tpipe.topology_devices(TOPOLOGY)
  for row in rows:
    exp, memory, breakdown, seconds = scale_3d.compile_row(config_for(row), devices)
    layout = " x ".join(map(str, row.layout))
    table.append(f"| {layout} | {row.label} | **{gib(_common.peak_bytes(memory))}** | "
                 f"{row.maxtext} | {gib(memory.argument_size_in_bytes)} | "
                 f"{gib(memory.temp_size_in_bytes)} | {seconds:.0f} |")
    sums = scale_3d.part_sums(breakdown)
    parts.append(f"| {layout} {row.label} | " + " | ".join(gib(n) for n in sums.values())
                 + f" | {gib(breakdown.total)} |")
    print(table[-1], flush=True)
  run.write("Mixtral-8x7B-shaped step on v5p:4x4x4: memory per device",
            table + [""] + parts)


if __name__ == "__main__":
  main()
