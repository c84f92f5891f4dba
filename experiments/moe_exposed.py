"""The expert all-to-all a Mixtral-8x7B-shaped step leaves exposed on 64 v5p chips, per schedule.

Each row is :mod:`experiments.moe_memory`'s Mixtral-8x7B shape (32 blocks of width 4096, 8 SwiGLU
experts of MLP 14336, top-2, dropless; sequence 4096, global batch 128; bfloat16 compute, float32
parameters and AdamW state, remat full) with the explicit all-to-all dispatch
(``moe_dispatch="all_to_all"``, :mod:`tpipe.train.expert_dispatch`), on stage 4 x expert 8 x fsdp 2
of ``v5p:4x4x4``, 16 micro-batches, under GPipe, 1F1B and ZB-V (2 virtual stages per device); for
comparison, the partitioner's dispatch (the default) under 1F1B; and ZB-V again with
``weight_recompute="backward"`` (its weight slots hold each chunk's output gradient alone, where
by default they hold the tapped matmuls' operands, the exchange's blocks among them); and GPipe
and 1F1B with each device's tokens exchanged in 4 parts (``moe_exchange_chunks=4``). The whole
train step is compiled ahead of time by the TPU compiler on this CPU machine with its
asynchronous all-to-all on (``--xla_tpu_enable_async_all_to_all=true`` in ``LIBTPU_INIT_ARGS``,
as MaxText runs its MoE models); nothing runs on a TPU. The last rows overlap micro-batches
(``overlap_microbatches=True``): where a stage runs a forward and a backward of two
micro-batches in one tick, the two run in one conditional, their layer loops unrolled, so the
compiler can run one's all-to-all while the other computes, as DualPipe pairs them; under 1F1B
and ZB-V.

Columns, per device and step: the peak (``memory_analysis()``: arguments + outputs - aliased +
temporaries); the all-to-all start/done pairs in the program and how many have a fusion
scheduled between start and done; and the step as the report prices it on
v5p (:func:`experiments.moe_dispatch.priced`, a roofline of the compiled program with a fused
table followed tick by tick; not a measurement): the predicted time, its MFU, its bubble, the
collective time it leaves exposed, the expert all-to-all's part of that (each action's wait
times the actions a stage runs), and the three collectives the actions wait for longest, by
kind and mesh axes.

Rows compile one at a time (5-15 minutes each on a 2-core machine): ``--rows=2`` compiles that
row and keeps every row's figures in ``experiments/results/moe_exposed.json``; the table shows
every stored row (``--rows=none`` writes it from the store), so the command at its head names
only the last rows compiled.

Needs the TPU compiler: ``pip install -e '.[tpu]'``. ``--smoke`` compiles the first row.
"""

from __future__ import annotations

import dataclasses
import os
import time

from experiments import _common

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # One host: no slice discovery.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
_common.async_all_to_all_on_tpu()

import jax  # noqa: E402  pylint: disable=g-import-not-at-top

import tpipe  # noqa: E402  pylint: disable=g-import-not-at-top
from experiments import moe_dispatch  # noqa: E402  pylint: disable=g-import-not-at-top
from experiments import moe_memory  # noqa: E402  pylint: disable=g-import-not-at-top

LAYOUT = (4, 8, 2, 1)  # stages, expert, fsdp, tensor
MICROBATCHES = 16
ROWS = [
    moe_memory.Row(schedule, LAYOUT, dict(schedule=schedule, num_microbatches=MICROBATCHES,
                                          moe_dispatch="all_to_all",
                                          num_repeats=2 if schedule == "zbv" else 1))
    for schedule in ("gpipe", "1f1b", "zbv")]
# The partitioner's dispatch (the default) under 1F1B, for comparison.
ROWS.append(moe_memory.Row("1f1b", LAYOUT, dict(schedule="1f1b", num_microbatches=MICROBATCHES,
                                                moe_dispatch="partitioner")))
# ZB-V whose weight slots hold the chunk's output gradient alone (W reruns the chunk's forward
# and backward): with weight_recompute="none" they hold the exchange's blocks.
ROWS.append(moe_memory.Row("zbv, weight_recompute=backward", LAYOUT, dict(
    schedule="zbv", num_microbatches=MICROBATCHES, moe_dispatch="all_to_all", num_repeats=2,
    weight_recompute="backward")))
# GPipe and 1F1B with each device's tokens exchanged in 4 parts (moe_exchange_chunks=4): one
# part's all-to-all can run while the experts compute another's.
ROWS += [moe_memory.Row(f"{schedule}, exchange in 4 parts", LAYOUT, dict(
    schedule=schedule, num_microbatches=MICROBATCHES, moe_dispatch="all_to_all",
    moe_exchange_chunks=4)) for schedule in ("gpipe", "1f1b")]
# 1F1B and ZB-V with micro-batches overlapped (overlap_microbatches=True): a stage's forward of
# one micro-batch and backward of another in one tick run in one conditional, so one's exchange
# can run while the other computes. (1F1B overlapped with the exchange in 4 parts as well does
# not compile on a 24 GiB host: the TPU compiler passed 24 GiB of host memory on the unrolled
# parts.)
ROWS += [moe_memory.Row(f"{schedule}, micro-batches overlapped", LAYOUT, dict(
    schedule=schedule, num_microbatches=MICROBATCHES, moe_dispatch="all_to_all",
    num_repeats=2 if schedule == "zbv" else 1, overlap_microbatches=True))
    for schedule in ("1f1b", "zbv")]


def measure(row: moe_memory.Row) -> dict:
  """The row's compiled step: its peak, its asynchronous all-to-alls and its priced time."""
  from tpipe.train.cli import experiment  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()
  exp = experiment.build(moe_memory.config_for(row),
                         devices=tpipe.topology_devices(moe_memory.TOPOLOGY))
  compiled = exp.train_step.lower(exp.abstract_state(), exp.abstract_batch(),
                                  jax.random.key(0)).compile()
  seconds = time.perf_counter() - start
  pairs, busy = moe_dispatch.async_pairs(compiled.as_text())
  return dict(moe_dispatch.priced(compiled, exp), pairs=pairs, busy=busy,
              peak=_common.peak_bytes(compiled.memory_analysis()), seconds=seconds)


def _key(row: moe_memory.Row) -> str:
  return moe_memory._key(row)  # pylint: disable=protected-access


def main():
  run = _common.start("moe_exposed", __doc__, smoke="the first row",
                      arguments=_common.add_rows_argument)
  results = _common.measure_rows(run, ROWS, ROWS[:1], _key,
                                 lambda row: dict(measure(row), row=dataclasses.asdict(row)))
  table = ["| dispatch | schedule | micro-batches | peak GiB | async all-to-all pairs (work "
           "between) | predicted step s | MFU | bubble s | exposed collectives s | of which "
           "all-to-all over expert s | the actions' largest waits, s per step | compile s |",
           "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|---:|"]
  for row in ROWS:
    got = results.get(_key(row))
    if got is None:
      continue
    largest = sorted(got.get("waits", {}).items(), key=lambda kv: -kv[1])[:3]
    table.append(f"| {row.fields['moe_dispatch']} | {row.label} | "
                 f"{row.fields['num_microbatches']} | {_common.gib(got['peak'])} | "
                 f"{got['pairs']} ({got['busy']}) | {got['step']:.2f} | {got['mfu']:.1%} | "
                 f"{got['bubble']:.2f} | {got['exposed']:.2f} | "
                 f"**{got['exposed_all_to_all']:.3f}** | "
                 + "; ".join(f"{name} {seconds:.2f}" for name, seconds in largest)
                 + f" | {got['seconds']:.0f} |")
  run.write("Mixtral-8x7B on v5p:4x4x4 (stage 4 x expert 8 x fsdp 2): the expert all-to-all "
            "each schedule leaves exposed", table)


if __name__ == "__main__":
  main()
