"""The two ways a pipelined mixture-of-experts layer reaches its experts, side by side, as the
TPU compiler builds them for 8 v5p chips: XLA's partitioner (``moe_dispatch="partitioner"``,
the default) and the explicit all-to-all (``"all_to_all"``, :mod:`tpipe.train.expert_dispatch`).

Each row is ``configs/lm.py`` with ``block="moe"`` built by ``tpipe.train.cli.experiment.build``
on the devices of ``v5p:2x2x2`` (:func:`tpipe.topology_devices`); its whole train step is
compiled ahead of time on this CPU machine, with the TPU compiler's asynchronous all-to-all on
(``--xla_tpu_enable_async_all_to_all=true`` in ``LIBTPU_INIT_ARGS``, as MaxText runs its MoE
models). Nothing runs on a TPU. Two shapes, neither tuned for: a Mixtral-like one (4 blocks of
width 1024, 8 heads, 8 SwiGLU experts of MLP 2048, top-2) and one of many small experts (16
experts of MLP 512, top-4); vocabulary 32000, sequence 1024, global batch 32, bfloat16 compute,
remat full, 4 micro-batches, 1F1B; and the Mixtral-like shape under GPipe and ZB-V (2 virtual
stages per device) as well.

Columns, per device and step: the peak (``memory_analysis()``: arguments + outputs - aliased +
temporaries) and the temporaries; the bytes the program moves over the ``expert`` axis by kind
(:func:`tpipe.tools.analysis.collectives`, loop trip counts included); the all-to-all
start/done pairs in the program and how many of them have other work (a fusion) scheduled
between start and done; and the step as the report prices it on v5p (:func:`priced`): the
predicted time, the collective time it leaves exposed, and the expert all-to-all's part of that.

:func:`priced` is :func:`tpipe.train.cli.config_costs.predict`: a roofline of the compiled
program (not a measurement) that overlaps each asynchronous collective with the work between its
start and done. A fused table's actions (1F1B's, ZB-V's, and GPipe's, whose backward remat full
fuses into the table) are priced from their branches of the tick loop and followed tick by tick
as the neighbour-synchronised simulation follows them, so a tick costs the action it runs (the
program itself would wait for its slowest branch on every tick); a forward table's loops
(autodiff's backward) are priced as the program runs them. The expert all-to-all's wait is
:attr:`tpipe.train.cli.config_costs.Prediction.exposed_by`: each action's wait times the actions
a stage runs, or, for a forward table, the program's.

Needs the TPU compiler: ``pip install -e '.[tpu]'``. ``--smoke`` compiles the first two rows.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import time

from experiments import _common

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # One host: no slice discovery.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
_common.async_all_to_all_on_tpu()

import jax  # noqa: E402  pylint: disable=g-import-not-at-top

import tpipe  # noqa: E402  pylint: disable=g-import-not-at-top
from tpipe.tools import analysis  # noqa: E402  pylint: disable=g-import-not-at-top

TOPOLOGY = "v5p:2x2x2"
EXCHANGE = ("all-to-all", ("expert",))  # The explicit dispatch's collectives: (kind, mesh axes).
SHAPES = {
    "mixtral-like": dict(num_layers=4, width=1024, num_heads=8, num_kv_heads=8, mlp_dim=2048,
                         num_experts=8, experts_per_token=2),
    "many small experts": dict(num_layers=4, width=1024, num_heads=8, num_kv_heads=8,
                               mlp_dim=512, num_experts=16, experts_per_token=4),
}


@dataclasses.dataclass(frozen=True)
class Row:
  shape: str
  layout: tuple[int, int, int]  # stages, expert, fsdp
  dispatch: str
  schedule: str = "1f1b"
  exchange_chunks: int = 1  # moe_exchange_chunks: the exchange in this many parts.
  overlap: bool = False  # overlap_microbatches: a tick's forward and backward in one conditional.


ROWS = [Row(shape, layout, dispatch)
        for shape, layout in (("mixtral-like", (2, 4, 1)), ("mixtral-like", (2, 2, 2)),
                              ("many small experts", (2, 4, 1)))
        for dispatch in ("partitioner", "all_to_all")]
ROWS += [Row("mixtral-like", (2, 4, 1), dispatch, schedule)
         for schedule in ("gpipe", "zbv") for dispatch in ("partitioner", "all_to_all")]


def config_for(row: Row):
  from configs import lm  # pylint: disable=g-import-not-at-top

  stages, expert, fsdp = row.layout
  c = lm.get_config("size=base")
  c.update(dict(SHAPES[row.shape], block="moe", capacity_factor=0.0, positions="rotary",
                final_norm="rms", head_bias=False, seq_len=1024, vocab_size=32000,
                batch_size=32, dropout=0.0, dtype="bfloat16", remat="full",
                num_stages=stages, num_data=1, num_microbatches=4, schedule=row.schedule,
                num_repeats=2 if row.schedule == "zbv" else 1,
                router_aux_loss_coef=0.02, router_z_loss_coef=0.001, moe_dispatch=row.dispatch,
                moe_exchange_chunks=row.exchange_chunks, overlap_microbatches=row.overlap))
  c.mesh.update(dict(expert=expert, fsdp=fsdp, tensor=1))
  return c


def async_pairs(text: str) -> tuple[int, int]:
  """``(pairs, pairs with a fusion between start and done)`` of the program's all-to-alls."""
  lines = text.splitlines()
  started, pairs, busy = {}, 0, 0
  for i, line in enumerate(lines):
    start = re.match(r"\s*%(\S+) = .* all-to-all-start\(", line)
    if start:
      started[start.group(1)] = i
    done = re.match(r"\s*%\S+ = .* all-to-all-done\(%([^)\s,]+)", line)
    if done and done.group(1) in started:
      pairs += 1
      between = lines[started[done.group(1)] + 1:i]
      busy += any(re.search(r"= .* fusion\(", x) for x in between)
  return pairs, busy


def priced(compiled, exp) -> dict:
  """``exp``'s compiled step priced on v5p as the report prices it (see the module docstring):
  ``step``, ``bubble``, ``exposed`` (collectives) and ``exposed_all_to_all`` (over ``expert``)
  seconds, ``mfu``, whether the table was followed ``tick_by_tick``, and the collective waits
  by kind and mesh axes (``waits``: the actions' for a table followed tick by tick)."""
  from tpipe.train.cli import config_costs  # pylint: disable=g-import-not-at-top

  predicted = config_costs.predict(compiled, exp, exp.pipeline.loss_table, "v5p")
  waits = predicted.exposed_by
  return dict(step=predicted.seconds, bubble=predicted.parts["bubble"],
              exposed=predicted.parts["exposed collectives"],
              exposed_all_to_all=waits.get(EXCHANGE, 0.0), mfu=predicted.mfu,
              tick_by_tick=predicted.tick_by_tick,
              waits={f"{kind} over {' x '.join(axes or ('?',))}": seconds
                     for (kind, axes), seconds in waits.items()})


def measure(row: Row) -> dict:
  from tpipe.train.cli import experiment  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()
  exp = experiment.build(config_for(row), devices=tpipe.topology_devices(TOPOLOGY))
  compiled = exp.train_step.lower(exp.abstract_state(), exp.abstract_batch(),
                                  jax.random.key(0)).compile()
  seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  over_expert = collections.Counter()
  for c in analysis.collectives(compiled, exp.mesh):
    if c.axes == ("expert",):
      over_expert[c.kind] += c.count * c.bytes
  pairs, busy = async_pairs(compiled.as_text())
  return dict(priced(compiled, exp), peak=_common.peak_bytes(memory),
              temporaries=memory.temp_size_in_bytes, over_expert=dict(over_expert), pairs=pairs,
              busy=busy, seconds=seconds)


def main():
  run = _common.start("moe_dispatch", __doc__, smoke="the first two rows")
  rows = ROWS[:2] if run.smoke else ROWS
  mib = lambda n: f"{n / 2 ** 20:.0f}"
  table = ["| shape | stage x expert x fsdp | schedule | dispatch | peak MiB | "
           "temporaries MiB | "
           "over expert: all-gather MiB | all-reduce MiB | all-to-all MiB | total MiB | "
           "async all-to-all pairs (work between) | predicted step ms | exposed collectives "
           "ms | of which all-to-all over expert ms | compile s |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
  for row in rows:
    got = measure(row)
    moved = got["over_expert"]
    print(row, got, flush=True)
    table.append(
        f"| {row.shape} | {' x '.join(map(str, row.layout))} | {row.schedule} | "
        f"{row.dispatch} | "
        f"{mib(got['peak'])} | {mib(got['temporaries'])} | "
        f"{mib(moved.get('all-gather', 0))} | {mib(moved.get('all-reduce', 0))} | "
        f"{mib(moved.get('all-to-all', 0))} | **{mib(sum(moved.values()))}** | "
        f"{got['pairs']} ({got['busy']}) | {got['step'] * 1e3:.1f} | "
        f"{got['exposed'] * 1e3:.1f} | {got['exposed_all_to_all'] * 1e3:.1f} | "
        f"{got['seconds']:.0f} |")
  run.write("Mixture-of-experts dispatch on v5p:2x2x2: the partitioner's and the explicit "
            "all-to-all", table)


if __name__ == "__main__":
  main()
