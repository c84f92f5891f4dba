"""Predicted step time, tokens per second and MFU of the Llama-3-8B-shaped step on 64 v5p chips,
for each schedule and for a plain FSDP step without a pipeline.

Command: ``python -m experiments.step_time_8b`` (``--smoke``: memory_at_scale's shape-a default
row on ``v5p:2x2x2``).

The model and layout are ``experiments/memory_at_scale.py``'s ``llama3-8b`` rows
(:func:`experiments.memory_at_scale.config_for`: 32 Llama blocks of width 4096, 32 / 8 heads,
MLP 14336, vocabulary 128256, sequence 4096, global batch 128; bfloat16 compute, float32
parameters and AdamW state, remat full), pipeline 4 x fsdp 8 x tensor 2 on ``v5p:4x4x4``:

* the default (gpipe, M = 16), 1F1B, interleaved 1F1B (R = 2: 8 layers per stage, two chunks
  of 4), ZB-H1 with ``weight_recompute="backward"``, all at M = 16;
* 1F1B at remat granularity chunk, and with remat dots at chunk (two candidates the auto-tuner
  below prunes by its analytic step, compiled here to see what the pruning left out);
* the reference without a pipeline: ``num_stages=1``, fsdp 32 x tensor 2, the whole batch at
  once (M = 1). The trainer runs a one-stage config through the same step builder (a
  one-stage table, no stage axis to cross), which is as close to a plain FSDP step as its
  config path comes.

Each row's train step is compiled ahead of time by the TPU compiler on this CPU machine and
priced as ``python -m tpipe.train.cli.report --topology=v5p:4x4x4`` prices it
(:func:`tpipe.train.cli.config_costs.analyze_config`, whose prediction is
:func:`tpipe.train.cli.config_costs.predict`): every instruction at the roofline of v5p's peak
FLOP/s and HBM bandwidth, collectives on ICI, loops times their trip counts, a fused table
followed tick by tick, a forward table (GPipe) priced whole with its simulated bubble share. MFU
divides the model FLOPs (6 x parameters x tokens plus attention) by the predicted time and the
peak. Nothing ran on a TPU: these are roofline predictions, not measurements.

``--autotune`` also runs the auto-tuner (:func:`tpipe.train.cli.autotune.autotune`, every
candidate compiled for ``v5p:4x4x4`` by the TPU compiler and priced the same way, under v5p's
95 GiB) from the default row's config over :data:`AUTOTUNE_SPACE` (4 stages: the layout of the
rows; gpipe and 1F1B; M = 8 or 16; remat none, dots or full at chunk, layer or nested
granularity, the last the default's; each group's first that fits ends the group),
and writes its ranking (every compiled trial, every candidate it skipped and why) and its
choice as a second section. M = 32 is left out: its micro-batch of 4 rows does not split over
fsdp 8.

Rows compile one at a time (3-5 minutes each on a busy 2-core machine): ``--rows=0,2`` compiles
those and keeps every row's figures in ``experiments/results/step_time_8b.json``; the table
shows every stored row (``--rows=none`` writes it again from the store, compiling nothing), so
the command at its head names only the last rows compiled.

Needs the TPU compiler: ``pip install -e '.[tpu]'``.
"""

from __future__ import annotations

import os
import time

from experiments import _common

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # One host: no slice discovery.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402  pylint: disable=g-import-not-at-top

from experiments import memory_at_scale  # noqa: E402  pylint: disable=g-import-not-at-top
from tpipe.train.cli import config_costs  # noqa: E402  pylint: disable=g-import-not-at-top

Row = memory_at_scale.Row
ROWS = [
    Row("default (gpipe)", "llama3-8b", (4, 8, 2, 1),
        dict(schedule="gpipe", num_microbatches=16)),
    Row("1f1b", "llama3-8b", (4, 8, 2, 1), dict(schedule="1f1b", num_microbatches=16)),
    Row("interleaved_1f1b R = 2", "llama3-8b", (4, 8, 2, 1),
        dict(schedule="interleaved_1f1b", num_repeats=2, num_microbatches=16)),
    Row("zb_h1, weight_recompute backward", "llama3-8b", (4, 8, 2, 1),
        dict(schedule="zb_h1", num_microbatches=16, weight_recompute="backward")),
    Row("no pipeline (FSDP reference)", "llama3-8b", (1, 32, 2, 1),
        dict(schedule="gpipe", num_microbatches=1)),
    # Two the auto-tuner below prunes by its analytic step without compiling them.
    Row("1f1b, granularity chunk", "llama3-8b", (4, 8, 2, 1),
        dict(schedule="1f1b", num_microbatches=16, remat_granularity="chunk")),
    Row("1f1b, remat dots, granularity chunk", "llama3-8b", (4, 8, 2, 1),
        dict(schedule="1f1b", num_microbatches=16, remat="dots", remat_granularity="chunk")),
]
SMOKE_ROWS = memory_at_scale.SMOKE_ROWS
PARTS = ("compute", "memory", "exposed collectives", "bubble")
AUTOTUNE_SPACE = dict(stages=[4], microbatches=[8, 16], schedules=["gpipe", "1f1b"],
                      remats=["none", "dots", "full"],
                      granularities=["chunk", "layer", "nested"])


def _key(row: Row) -> str:
  return f"{row.model} | {' x '.join(map(str, row.layout))} | {row.label} | {row.fields}"


def measure(row: Row) -> dict:
  """One row's step compiled for its topology and priced on v5p (the report's figures)."""
  start = time.perf_counter()
  topology = memory_at_scale.MODELS[row.model].topology
  rep = config_costs.analyze_config(memory_at_scale.config_for(row), per_stage=False,
                                    topology=topology)
  p = rep.prediction
  return dict(peak=_common.peak_bytes(rep.compiled.memory_analysis()),
              largest_device=rep.largest_device_bytes, params=rep.num_params,
              seconds=p.seconds, parts=dict(p.parts), recompute=p.recompute,
              tokens_per_second=p.tokens_per_second, mfu=p.mfu,
              tick_by_tick=p.tick_by_tick, executed_flops=p.step_time.flops,
              hbm_bytes=p.step_time.hbm_bytes, wall=time.perf_counter() - start)


def table(rows, results) -> list[str]:
  lines = ["| stage x fsdp x tensor x data | row | M | peak GiB | predicted step s | tokens/s | "
           "MFU | compute / memory / exposed collectives / bubble s | of which recompute s | "
           "pipeline priced | step / default | compile s |",
           "|---|---|---:|---:|---:|---:|---:|---|---:|---|---:|---:|"]
  default = results.get(_key(rows[0]))
  for row in rows:
    got = results.get(_key(row))
    if got is None:
      continue
    if "error" in got:
      lines.append(f"| {' x '.join(map(str, row.layout))} | {row.label} | "
                   f"{row.fields['num_microbatches']} | does not compile: {got['error']} |"
                   + " |" * 9)
      continue
    ratio = f"{got['seconds'] / default['seconds']:.3f}" if default else "-"
    lines.append(
        f"| {' x '.join(map(str, row.layout))} | {row.label} | "
        f"{row.fields['num_microbatches']} | {_common.gib(got['peak'])} | "
        f"**{got['seconds']:.3f}** | {got['tokens_per_second']:,.0f} | {got['mfu']:.1%} | "
        + " / ".join(f"{got['parts'][k]:.3f}" for k in PARTS)
        + f" | {got['recompute']:.3f} | {'tick by tick' if got['tick_by_tick'] else 'whole'} | "
        f"{ratio} | {got['wall']:.0f} |")
  return lines


def tune(row: Row, smoke: bool) -> dict:
  """The auto-tuner's ranking (markdown) and choice from ``row``'s config, on its topology."""
  from tpipe.train.cli import autotune  # pylint: disable=g-import-not-at-top

  space = dict(AUTOTUNE_SPACE, microbatches=[8], remats=["full"]) if smoke else AUTOTUNE_SPACE
  if smoke:
    space["stages"] = [row.layout[0]]
  result = autotune.autotune(memory_at_scale.config_for(row),
                             num_devices=row.layout[0] * row.layout[3],
                             topology=memory_at_scale.MODELS[row.model].topology,
                             verbose=True, config_path="configs/lm.py", **space)
  best = result.best
  return dict(ranking=autotune.format_result(result, "configs/lm.py"),
              choice=best and dict(overrides=best.candidate.overrides(),
                                   seconds=best.predicted_seconds, mfu=best.predicted_mfu,
                                   memory=best.memory_bytes))


def _arguments(parser):
  _common.add_rows_argument(parser)
  parser.add_argument("--autotune", action="store_true", help="also run the auto-tuner from "
                      "the default row's config (AUTOTUNE_SPACE) and store its ranking")


def main():
  run = _common.start("step_time_8b", __doc__, smoke="memory_at_scale's shape-a default row",
                      arguments=_arguments)
  rows = SMOKE_ROWS if run.smoke else ROWS
  # Each row's figures, kept beside the table so that rows compile in separate runs.
  store = _common.RowStore(run)
  results = store.results
  for row in _common.rows_to_compile(run, ROWS, SMOKE_ROWS):
    try:
      results[_key(row)] = measure(row)
    except jax.errors.JaxRuntimeError as e:  # The TPU compiler refuses what exceeds HBM.
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      results[_key(row)] = dict(error=str(e).splitlines()[0])
    print(table([row], results)[-1], flush=True)
    store.save()
  if run.args.autotune:
    results["autotune"] = dict(command=run.command, space=AUTOTUNE_SPACE,
                               **tune(rows[0], run.smoke))
    store.save()
  lines = ["Per device, priced on v5p (459 TFLOP/s bfloat16, 2765 GB/s HBM, ICI links). The "
           "parts add up to the predicted step; recompute is a part of compute and memory. "
           "\"step / default\" is the row's predicted step over the default row's.", ""]
  lines += table(rows, results)
  tuned = results.get("autotune")
  if tuned:
    lines += ["", "## The auto-tuner from the default row", "",
              f"Command: `{tuned['command']}`; the search space: "
              + ", ".join(f"{k} {v}" for k, v in tuned["space"].items())
              + ". Every trial compiled for the topology by the TPU compiler and priced as the "
              "rows above; the fitting trial with the least predicted step is chosen.", ""]
    choice, default = tuned["choice"], results.get(_key(rows[0]))
    if choice and default:
      lines += [f"Its choice, `{choice['overrides']}`: **{choice['seconds']:.3f} s** predicted "
                f"(MFU {choice['mfu']:.1%}, {_common.gib(choice['memory'])} GiB), against the "
                f"default row's {default['seconds']:.3f} s (MFU {default['mfu']:.1%}): "
                f"**{default['seconds'] / choice['seconds']:.2f}x** faster predicted.", ""]
    lines.append(tuned["ranking"])
  run.write("Predicted step time of the Llama-3-8B-shaped step on v5p:4x4x4", lines,
            note="Roofline predictions from the compiled program (`tpipe.tools.step_time` "
            "through `tpipe.train.cli.config_costs.predict`); nothing ran on a TPU, so no "
            "number here is checked against a measurement.")


if __name__ == "__main__":
  main()
