"""Memory per device at the scale TPU users train, beside MaxText's, with every byte explained.

Every row is ``configs/lm.py`` with a model, a layout and a schedule, built by
``tpipe.train.cli.experiment.build`` on the devices of a TPU topology
(:func:`tpipe.topology_devices`)
and its whole train step compiled ahead of time by the TPU compiler on this CPU machine; nothing
runs on a TPU. bfloat16 compute, float32 parameters and AdamW state, remat full; "default" rows
leave everything else as the trainer's config has it (granularity, vocabulary slices).

The models (untied embedding and head; positions learned):

* ``llama3-8b``: 32 blocks of width 4096, 32 query heads and 8 key/value heads of 128, SwiGLU
  MLP 14336, vocabulary 128256, sequence 4096, global batch 128; ``v5p:4x4x4`` (64 chips).
* ``llama3-70b``: 80 blocks of width 8192, 64 / 8 heads, MLP 28672; same vocabulary, sequence
  and batch; ``v5p:4x4x4``.
* ``shape-c``: 20 GPT blocks of width 2048 (16 heads of 128, MLP 5632), vocabulary 128256,
  sequence 2048, global batch 32; ``v5p:2x2x2``, pipeline 4 x data 2, balance 6,5,5,6.
* ``shape-a``: 16 GPT blocks of width 2048 (16 heads, MLP 8192), vocabulary 32000, sequence
  1024, global batch 64; ``v5p:2x2x2``, pipeline 4 x data 2, balance 5,4,4,5 (the earlier memory
  issue's target: ``experiments/tpu_memory.py`` has its other rows).
* ``gemma-256k`` (a shape no target was tuned on): 18 GPT blocks of width 2048 (8 heads of 256,
  MLP 16384), vocabulary 256000, sequence 4096, global batch 32; ``v5p:2x2x2``, stage 2 x fsdp 4.

Columns, per device: the peak as ``memory_analysis()`` gives it (arguments + outputs - aliased +
temporaries, what the issue compares), the state (arguments) and temporaries, and the compile
time. The breakdown (:mod:`tpipe.tools.peak`, from the compiler's buffer assignment) says what is
live at the peak by role, and where the rest of the peak is:

* **live at peak**: the values live at the buffer assignment's busiest point (the compiler's
  own ``peak_memory_in_bytes`` is this, less padding);
* **fragmentation**: the temporaries' allocation less what of it is live at the peak (buffers
  live at other times that could not be packed around the peak). The gradient sums live in the
  new parameters' output buffers (the step does not donate the parameters, and the update
  overwrites the sums in place), so they are live at the peak but not in this allocation;
* **beyond the buffer assignment**: ``memory_analysis()``'s temporaries less the buffer
  assignment's temporary allocation. The TPU compiler reserves it outside the HLO buffer
  assignment; no dumped buffer names it. It is not tpipe's: the grad of a ``lax.scan`` of
  matmuls (``jax.grad`` of 8 steps ``h = tanh(h @ w)``, ``w`` 4096 x 4096) has it too, two of
  the loop's carried ``[4096, 4096]`` float32 values, whatever the number of steps, and plain
  programs (a matmul, a loop, collectives, a conditional) have none.

The **floor** is what any pipeline must hold at the layout, per device: the state and gradient
(16 bytes per parameter, parameter, two moments and gradient in float32, over the devices); the
stash (bfloat16 activations ``[rows, sequence, width]`` of a micro-batch, the rows split over
``data`` and ``fsdp``: GPipe keeps one per micro-batch and per remat piece of the fullest
stage, a fused schedule one per micro-batch in flight, min(S, M)); and the working set measured
at the peak (one unit's forward and backward on a micro-batch, the weights it gathers, the
loss's logits).

MaxText's figures are quoted from the issue (MaxText 0.2.5, jax 0.11.1, libtpu 0.0.46.3, the same
models and targets, the same peak formula); this script does not run MaxText.

Needs the TPU compiler: ``pip install -e '.[tpu]'``. ``--smoke`` compiles the shape-a default row.
"""

from __future__ import annotations

import dataclasses
import os

from experiments import _common

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # One host: no slice discovery.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import tpipe  # noqa: E402  pylint: disable=g-import-not-at-top
from experiments import scale_3d  # noqa: E402  pylint: disable=g-import-not-at-top


@dataclasses.dataclass(frozen=True)
class Model:
  """A model, its data and the slice it is compiled for."""

  topology: str
  fields: dict  # configs/lm.py fields.


MODELS = {
    "llama3-8b": Model("v5p:4x4x4", dict(
        num_layers=32, width=4096, num_heads=32, num_kv_heads=8, mlp_dim=14336, block="llama",
        seq_len=4096, vocab_size=128256, batch_size=128)),
    "llama3-70b": Model("v5p:4x4x4", dict(
        num_layers=80, width=8192, num_heads=64, num_kv_heads=8, mlp_dim=28672, block="llama",
        seq_len=4096, vocab_size=128256, batch_size=128)),
    "shape-c": Model("v5p:2x2x2", dict(
        num_layers=20, width=2048, num_heads=16, mlp_dim=5632, seq_len=2048, vocab_size=128256,
        batch_size=32)),
    "shape-a": Model("v5p:2x2x2", dict(
        num_layers=16, width=2048, num_heads=16, mlp_dim=8192, seq_len=1024, vocab_size=32000,
        batch_size=64)),
    "gemma-256k": Model("v5p:2x2x2", dict(
        num_layers=18, width=2048, num_heads=8, mlp_dim=16384, seq_len=4096, vocab_size=256000,
        batch_size=32)),
}


@dataclasses.dataclass(frozen=True)
class Row:
  """One compiled configuration: a label, its model and its config fields."""

  label: str
  model: str
  layout: tuple[int, int, int, int]  # stages, fsdp, tensor, data
  fields: dict
  maxtext: str = ""  # MaxText's figure for the same target, quoted (GiB), or "".


def _layout(stages, fsdp, tensor, data=1):
  return (stages, fsdp, tensor, data)


G, F = "gpipe", "1f1b"
ROWS = [
    Row("default (gpipe)", "llama3-8b", _layout(4, 8, 2), dict(schedule=G, num_microbatches=16),
        "14.44 (gpipe-style)"),
    Row("gpipe, granularity chunk", "llama3-8b", _layout(4, 8, 2),
        dict(schedule=G, num_microbatches=16, remat_granularity="chunk")),
    Row("gpipe, granularity layer", "llama3-8b", _layout(4, 8, 2),
        dict(schedule=G, num_microbatches=16, remat_granularity="layer")),
    Row("1f1b, default granularity", "llama3-8b", _layout(4, 8, 2),
        dict(schedule=F, num_microbatches=16)),
    Row("1f1b, granularity layer", "llama3-8b", _layout(4, 8, 2),
        dict(schedule=F, num_microbatches=16, remat_granularity="layer"),
        "11.09 (circular, its best)"),
    Row("circular R = 2", "llama3-8b", _layout(4, 8, 2),
        dict(schedule="circular", num_repeats=2, num_microbatches=16)),
    Row("zb_h1 (weight_recompute none)", "llama3-8b", _layout(4, 8, 2),
        dict(schedule="zb_h1", num_microbatches=16)),
    Row("zb_h1, weight_recompute backward", "llama3-8b", _layout(4, 8, 2),
        dict(schedule="zb_h1", num_microbatches=16, weight_recompute="backward")),
    Row("default (gpipe)", "llama3-8b", _layout(8, 4, 2), dict(schedule=G, num_microbatches=16)),
    Row("1f1b, granularity layer", "llama3-8b", _layout(8, 4, 2),
        dict(schedule=F, num_microbatches=16, remat_granularity="layer")),
    Row("1f1b, granularity layer", "llama3-70b", _layout(8, 4, 2),
        dict(schedule=F, num_microbatches=16, remat_granularity="layer")),
    Row("default (gpipe)", "shape-c", _layout(4, 1, 1, 2), dict(schedule=G, num_microbatches=8),
        "14.67 (gpipe-style)"),
    Row("gpipe, granularity chunk, whole logits", "shape-c", _layout(4, 1, 1, 2),
        dict(schedule=G, num_microbatches=8, remat_granularity="chunk", vocab_chunks=1)),
    Row("1f1b, default granularity", "shape-c", _layout(4, 1, 1, 2),
        dict(schedule=F, num_microbatches=8)),
    Row("default (gpipe)", "shape-a", _layout(4, 1, 1, 2), dict(schedule=G, num_microbatches=16),
        "7.52 (gpipe-style)"),
    Row("1f1b, granularity layer", "shape-a", _layout(4, 1, 1, 2),
        dict(schedule=F, num_microbatches=16, remat_granularity="layer")),
    Row("default (gpipe)", "gemma-256k", _layout(2, 4, 1), dict(schedule=G, num_microbatches=8)),
    Row("1f1b, default granularity", "gemma-256k", _layout(2, 4, 1),
        dict(schedule=F, num_microbatches=8)),
]
SMOKE_ROWS = [next(row for row in ROWS if row.model == "shape-a")]


def config_for(row: Row):
  from configs import lm  # pylint: disable=g-import-not-at-top

  model = MODELS[row.model]
  stages, fsdp, tensor, data = row.layout
  c = lm.get_config("size=base")
  chunks = stages * row.fields.get("num_repeats", 1)
  c.update(dict(model.fields, dropout=0.0, dtype="bfloat16", remat="full", num_stages=stages,
                num_data=data, balance=scale_3d.balance(model.fields["num_layers"], chunks)))
  c.update(row.fields)
  c.mesh.update(dict(fsdp=fsdp, tensor=tensor))
  return c


def compile_row(row: Row):
  """``(experiment, memory_analysis, breakdown, seconds)`` of one row's step
  (:func:`experiments.scale_3d.compile_row` on the row's topology)."""
  return scale_3d.compile_row(config_for(row),
                              tpipe.topology_devices(MODELS[row.model].topology))


def main():
  run = _common.start("memory_at_scale", __doc__, smoke="the shape-a default row",
                      arguments=lambda parser: parser.add_argument(
                          "--rows", default="", help="comma-separated row numbers to compile "
                          "(0-based, in the order of ROWS); default all"))
  gib = _common.gib
  rows = SMOKE_ROWS if run.smoke else ROWS
  if run.args.rows:
    rows = [ROWS[int(i)] for i in run.args.rows.split(",")]
  table = ["| model | stage x fsdp x tensor x data | row | peak GiB | MaxText GiB | state GiB | "
           "temporaries GiB | compile s |", "|---|---|---|---:|---|---:|---:|---:|"]
  parts = ["| model | row | " + " | ".join(scale_3d.PARTS) + " | live at peak | fragmentation "
           "| beyond the buffer assignment | floor | peak / floor |",
           "|---|---|" + "---:|" * (len(scale_3d.PARTS) + 5)]
  for row in rows:
    exp, memory, breakdown, seconds = compile_row(row)
    peak_bytes = _common.peak_bytes(memory)
    layout = " x ".join(map(str, row.layout))
    table.append(f"| {row.model} | {layout} | {row.label} | **{gib(peak_bytes)}** | "
                 f"{row.maxtext} | {gib(memory.argument_size_in_bytes)} | "
                 f"{gib(memory.temp_size_in_bytes)} | {seconds:.0f} |")
    sums = scale_3d.part_sums(breakdown)
    floor = sum(scale_3d.floor_parts(exp.config, exp.num_params(), sums["working set"]).values())
    allocated = breakdown.allocated_temporaries or 0
    parts.append(
        f"| {row.model} {layout} | {row.label} | " + " | ".join(gib(n) for n in sums.values())
        + f" | {gib(breakdown.total)} | {gib(allocated - breakdown.in_temporaries)} | "
        f"{gib(memory.temp_size_in_bytes - allocated)} | {gib(floor)} | "
        f"{peak_bytes / floor:.2f} |")
    print(table[-1], parts[-1], sep="\n", flush=True)
  lines = ["Per device, from the TPU compiler; see the script's documentation for every column.",
           ""] + table + ["", "Where each peak is: what is live at it by role, the allocation "
                          "beside it, and the floor.", ""] + parts
  run.write("Memory at scale: tpipe on TPU v5p slices, beside MaxText", lines)


if __name__ == "__main__":
  main()
