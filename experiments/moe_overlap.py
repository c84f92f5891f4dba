"""Micro-batches overlapped (``overlap_microbatches``), side by side with the lanes run one after
another, as the TPU compiler builds a pipelined mixture-of-experts step for 8 v5p chips.

In a compound tick a stage runs a forward of one micro-batch and a backward of another. Run one
after the other (each in its lane's conditional, its layer loops rolled), each action's
all-to-alls wait for that action's own work only. With ``overlap_microbatches=True`` the two
run together in one conditional, their layer loops unrolled (the same bytes, FLOPs and
outputs): the question is whether the TPU compiler then runs one micro-batch's exchange while
the other computes, as DualPipe overlaps them, and what that costs in memory.

Each row is :mod:`experiments.moe_dispatch`'s configuration (``configs/lm.py``,
``block="moe"``, ``moe_dispatch="all_to_all"``, stage 2 x expert 4 of ``v5p:2x2x2``, 4
micro-batches, sequence 1024, global batch 32, bfloat16 compute, remat full) with its two
shapes, neither tuned for: a Mixtral-like one (8 experts of MLP 2048, top-2) and one of many
small experts (16 of MLP 512, top-4), under 1F1B and ZB-V (2 virtual stages per device), each
without and with micro-batches overlapped. The whole train step is compiled ahead of time on this
CPU machine with the TPU compiler's asynchronous all-to-all on; nothing runs on a TPU.

Columns, per device and step: the peak (``memory_analysis()``), the all-to-all start/done pairs
and how many have a fusion between start and done, and the step as the report prices it on v5p
(:func:`experiments.moe_dispatch.priced`: a roofline of the compiled program that overlaps each
asynchronous collective with the work the compiler put between its start and done, the fused
table followed tick by tick, a pair of overlapped actions priced as one; not a measurement):
the predicted time, the collective time left exposed and the expert all-to-all's part of it.

Rows compile one at a time (2-5 minutes each on a 2-core machine): ``--rows=2,3`` compiles those
rows and keeps every row's figures in ``experiments/results/moe_overlap.json``; the table shows
every stored row beside its row without overlap (``--rows=none`` writes it from the store).

Needs the TPU compiler: ``pip install -e '.[tpu]'``. ``--smoke`` compiles the first two rows.
"""

from __future__ import annotations

import dataclasses

from experiments import _common
from experiments import moe_dispatch

ROWS = [moe_dispatch.Row(shape, (2, 4, 1), "all_to_all", schedule, overlap=overlap)
        for shape in ("mixtral-like", "many small experts") for schedule in ("1f1b", "zbv")
        for overlap in (False, True)]


def _key(row: moe_dispatch.Row) -> str:
  return f"{row.shape} | {row.schedule} | overlap={row.overlap}"


def main():
  run = _common.start("moe_overlap", __doc__, smoke="the first two rows",
                      arguments=_common.add_rows_argument)
  results = _common.measure_rows(run, ROWS, ROWS[:2], _key, moe_dispatch.measure)
  table = ["| shape | schedule | micro-batches overlapped | peak MiB | async all-to-all pairs "
           "(work between) | predicted step ms | exposed collectives ms | of which all-to-all "
           "over expert ms | step vs lanes apart | peak vs lanes apart | compile s |",
           "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
  for row in ROWS:
    got = results.get(_key(row))
    base = results.get(_key(dataclasses.replace(row, overlap=False)))
    if got is None or base is None:
      continue
    table.append(
        f"| {row.shape} | {row.schedule} | {'yes' if row.overlap else 'no'} | "
        f"{got['peak'] / 2 ** 20:.0f} | {got['pairs']} ({got['busy']}) | "
        f"{got['step'] * 1e3:.1f} | {got['exposed'] * 1e3:.1f} | "
        f"**{got['exposed_all_to_all'] * 1e3:.2f}** | {got['step'] / base['step']:.3f} | "
        f"{got['peak'] / base['peak']:.2f} | {got['seconds']:.0f} |")
  run.write("Micro-batches overlapped on v5p:2x2x2 (stage 2 x expert 4)", table)


if __name__ == "__main__":
  main()
