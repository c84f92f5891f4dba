"""Memory per device of mixture-of-experts train steps on 64 v5p chips (Mixtral-8x7B-shaped and a
second shape of many small experts), beside MaxText's.

Each row is ``configs/lm.py`` with ``block="moe"`` (Mixtral's: llama attention, a mixture of 8
SwiGLU experts, top-2, dropless), built by ``tpipe.train.cli.experiment.build`` on the devices of
the
``v5p:4x4x4`` topology (:func:`tpipe.topology_devices`) and its whole train step compiled ahead of
time by the TPU compiler on this CPU machine; nothing runs on a TPU. The model: 32 blocks of width
4096, 32 query heads and 8 key/value heads, experts of MLP 14336, vocabulary 32000, sequence 4096,
global batch 128; bfloat16 compute, float32 parameters and AdamW state, remat full, 16 or 64
micro-batches. The second shape (:data:`MANY_SMALL_EXPERTS`, DeepSeek-MoE-16B-like): 28 blocks
of width 2048, 64 experts of MLP 1408, top-6, vocabulary 102400. The layouts put stages, experts
and fsdp or tensor shards on the 64 chips (``stage x expert x fsdp x tensor``; no data axis);
with fsdp (no tensor) the rows of a micro-batch are split over ``expert`` outside the experts
(:func:`tpipe.train.moe.rows_over_expert`), with tensor they stay whole.

Columns, per device: the peak as ``memory_analysis()`` gives it (arguments + outputs - aliased +
temporaries), the state (arguments), the temporaries, and the compile time; the breakdown by role
(:mod:`tpipe.tools.peak`) as ``experiments/memory_at_scale.py`` gives it.

MaxText's figures are quoted from issue 60 (MaxText 0.2.5, the same model, slice and formula:
pipeline 4 x expert 8 x tensor 2, 16 micro-batches, 38.01 GiB; its best layout, expert 8 x fsdp
8 without a pipeline, 29.65 GiB); this script does not run MaxText.

Rows compile one at a time (3-25 minutes each on a 2-core machine): ``--rows=4,2`` compiles
those and keeps every row's figures in ``experiments/results/moe_memory.json``; the table shows
every stored row (``--rows=none`` writes it again from the store, compiling nothing), so the
command at its head names only the last rows compiled.

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


# A second shape, DeepSeek-MoE-16B-like (many small experts, top-6; its two shared experts
# and its dense first layer are not modelled): 28 blocks of width 2048, 16 heads, 64 experts of
# MLP 1408, vocabulary 102400.
MANY_SMALL_EXPERTS = dict(num_layers=28, width=2048, num_heads=16, num_kv_heads=16,
                          mlp_dim=1408, block="moe", num_experts=64, experts_per_token=6,
                          capacity_factor=0.0, positions="rotary", final_norm="rms",
                          head_bias=False, seq_len=4096, vocab_size=102400, batch_size=128)


@dataclasses.dataclass(frozen=True)
class Row:
  """One compiled configuration."""

  label: str
  layout: tuple[int, int, int, int]  # stages, expert, fsdp, tensor
  fields: dict
  maxtext: str = ""
  model: str = "mixtral-8x7b"


MODELS = {"mixtral-8x7b": MIXTRAL_8X7B, "many-small-experts": MANY_SMALL_EXPERTS}
ROWS = [
    Row("default (gpipe)", (4, 8, 1, 2), dict(schedule="gpipe", num_microbatches=16),
        "38.01 (its pipeline)"),
    Row("1f1b", (4, 8, 1, 2), dict(schedule="1f1b", num_microbatches=16)),
    Row("default (gpipe)", (4, 8, 2, 1), dict(schedule="gpipe", num_microbatches=16)),
    Row("1f1b", (4, 8, 2, 1), dict(schedule="1f1b", num_microbatches=16),
        "29.65 (its best: expert 8 x fsdp 8, no pipeline)"),
    Row("1f1b", (4, 8, 2, 1), dict(schedule="1f1b", num_microbatches=64)),
    Row("zbv", (4, 8, 2, 1), dict(schedule="zbv", num_microbatches=64, num_repeats=2)),
    Row("default (gpipe)", (4, 8, 2, 1), dict(schedule="gpipe", num_microbatches=16),
        model="many-small-experts"),
    Row("1f1b", (4, 8, 2, 1), dict(schedule="1f1b", num_microbatches=64),
        model="many-small-experts"),
]


def config_for(row: Row):
  from configs import lm  # pylint: disable=g-import-not-at-top

  stages, expert, fsdp, tensor = row.layout
  model = MODELS[row.model]
  c = lm.get_config("size=base")
  chunks = stages * row.fields.get("num_repeats", 1)
  c.update(dict(model, dropout=0.0, dtype="bfloat16", remat="full", num_stages=stages,
                num_data=1, balance=scale_3d.balance(model["num_layers"], chunks),
                router_aux_loss_coef=0.02, router_z_loss_coef=0.001))
  c.update(row.fields)
  c.mesh.update(dict(fsdp=fsdp, expert=expert, tensor=tensor))
  return c


def _key(row: Row) -> str:
  return f"{row.model} | {' x '.join(map(str, row.layout))} | {row.label} | {row.fields}"


def main():
  run = _common.start("moe_memory", __doc__, smoke="the first row",
                      arguments=_common.add_rows_argument)
  gib = _common.gib
  # Each row's figures, kept beside the table so that rows compile in separate runs (a row
  # takes 3-25 minutes on a 2-core machine).
  store = _common.RowStore(run)
  results = store.results
  devices = tpipe.topology_devices(TOPOLOGY)
  for row in _common.rows_to_compile(run, ROWS, ROWS[:1]):
    exp, memory, breakdown, seconds = scale_3d.compile_row(config_for(row), devices)
    del exp
    results[_key(row)] = dict(
        peak=_common.peak_bytes(memory), state=memory.argument_size_in_bytes,
        temporaries=memory.temp_size_in_bytes, seconds=seconds,
        parts=scale_3d.part_sums(breakdown), live=breakdown.total)
    print(_key(row), gib(results[_key(row)]["peak"]), flush=True)
    store.save()
  table = ["| model | stage x expert x fsdp x tensor | row | micro-batches | peak GiB | "
           "MaxText GiB | state GiB | temporaries GiB | compile s |",
           "|---|---|---|---:|---:|---|---:|---:|---:|"]
  parts = ["| row | " + " | ".join(scale_3d.PARTS) + " | live at peak |",
           "|---|" + "---:|" * (len(scale_3d.PARTS) + 1)]
  for row in ROWS:
    got = results.get(_key(row))
    if got is None:
      continue
    name = f"{row.model} | {' x '.join(map(str, row.layout))} | {row.label}"
    table.append(f"| {name} | {row.fields['num_microbatches']} | **{gib(got['peak'])}** | "
                 f"{row.maxtext} | {gib(got['state'])} | {gib(got['temporaries'])} | "
                 f"{got['seconds']:.0f} |")
    parts.append(f"| {name.replace(' | ', ' ')} M={row.fields['num_microbatches']} | "
                 + " | ".join(gib(n) for n in got["parts"].values()) + f" | {gib(got['live'])} |")
  run.write("Mixture-of-experts steps on v5p:4x4x4: memory per device", table + [""] + parts)


if __name__ == "__main__":
  main()
