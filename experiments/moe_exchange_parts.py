"""The explicit all-to-all exchanged in parts (``moe_exchange_chunks``), side by side with one
exchange, as the TPU compiler builds a pipelined mixture-of-experts step for 8 v5p chips.

Within one exchange every step depends on the one before (the tokens sent, the experts' grouped
matmuls, the outputs returned), so its all-to-alls have little to overlap with.
``moe_exchange_chunks=C`` splits each device's tokens into C parts, each exchanged and computed
on its own (the same bytes and FLOPs): the question is whether the TPU compiler then runs one
part's all-to-all while the experts compute another's, and what that does to the step.

Each row is :mod:`experiments.moe_dispatch`'s configuration (``configs/lm.py``, ``block="moe"``,
``moe_dispatch="all_to_all"``, stage 2 x expert 4 of ``v5p:2x2x2``, 1F1B, 4 micro-batches,
sequence 1024, global batch 32, bfloat16 compute, remat full) with its two shapes, neither tuned
for: a Mixtral-like one (8 experts of MLP 2048, top-2) and one of many small experts (16 of MLP
512, top-4), each with 1, 2 and 4 parts. The whole train step is compiled ahead of time on this
CPU machine with the TPU compiler's asynchronous all-to-all on; nothing runs on a TPU.

Columns, per device and step: the peak (``memory_analysis()``), the all-to-all start/done pairs
and how many have a fusion between start and done, and the step as the report prices it on v5p
(:func:`experiments.moe_dispatch.priced`: a roofline of the compiled program that overlaps each
asynchronous collective with the work the compiler put between its start and done, the fused
table followed tick by tick; not a measurement): the predicted time, the collective time left
exposed and the expert all-to-all's part of it.

Needs the TPU compiler: ``pip install -e '.[tpu]'``. ``--smoke`` compiles the first two rows.
"""

from __future__ import annotations

from experiments import _common
from experiments import moe_dispatch

ROWS = [moe_dispatch.Row(shape, (2, 4, 1), "all_to_all", "1f1b", chunks)
        for shape in ("mixtral-like", "many small experts") for chunks in (1, 2, 4)]


def main():
  run = _common.start("moe_exchange_parts", __doc__, smoke="the first two rows")
  rows = ROWS[:2] if run.smoke else ROWS
  table = ["| shape | exchange parts | peak MiB | async all-to-all pairs (work between) | "
           "predicted step ms | exposed collectives ms | of which all-to-all over expert ms | "
           "step vs one exchange | compile s |",
           "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
  one = {}
  for row in rows:
    got = moe_dispatch.measure(row)
    print(row, got, flush=True)
    one.setdefault(row.shape, got["step"])
    table.append(
        f"| {row.shape} | {row.exchange_chunks} | {got['peak'] / 2 ** 20:.0f} | "
        f"{got['pairs']} ({got['busy']}) | {got['step'] * 1e3:.1f} | "
        f"{got['exposed'] * 1e3:.1f} | **{got['exposed_all_to_all'] * 1e3:.2f}** | "
        f"{got['step'] / one[row.shape]:.3f} | {got['seconds']:.0f} |")
  run.write("The explicit all-to-all in parts on v5p:2x2x2 (stage 2 x expert 4, 1F1B)", table)


if __name__ == "__main__":
  main()
