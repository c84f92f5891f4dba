"""The cost report of :mod:`tpipe.train.cli.report` as markdown text: memory, FLOPs, collectives,
the per-stage table and the notes on what the floor counts.

Every function takes a :class:`tpipe.train.cli.config_costs.Report` (what
:func:`tpipe.train.cli.report. analyze_config` returns) and reads nothing else.
"""

from __future__ import annotations

from tpipe.spec import check_weight_recompute
from tpipe.spec import granularity_in_effect
from tpipe.spec import SPLIT_BACKWARD
from tpipe.train.cli import schedule_summary


def _flops(x: float) -> str:
  for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6),
                      ("kFLOP", 1e3)):
    if abs(x) >= scale:
      return f"{x / scale:.2f} {unit}"
  return f"{x:.0f} FLOP"


def format_report(report) -> str:
  """The report as a short markdown text (tables of memory, FLOPs and collectives)."""
  from tpipe.tools import analysis  # pylint: disable=g-import-not-at-top
  from tpipe.train.cli import communication  # pylint: disable=g-import-not-at-top
  from tpipe.train.cli import moe_costs  # pylint: disable=g-import-not-at-top

  fb = analysis.format_bytes
  c, mem, flops, pipe = report.config, report.analysis.memory, report.analysis.flops, \
      report.analysis.pipeline
  # The task's own sizes (an LM's depth and sequence, a convnet's width), where present.
  sizes = " ".join(f"{label}={c[key]}" for key, label in (("num_layers", "L"), ("width", "width"))
                   if key in c)
  seq = f" x seq {c.seq_len}" if "seq_len" in c else ""
  lines = [
      f"## tpipe report: {c.get('size', '')} {sizes} params={report.num_params:,}",
      "",
      f"mesh {' x '.join(f'{a}={n}' for a, n in report.mesh_shape.items())} "
      f"({report.num_devices} devices), "
      f"schedule={c.schedule} M={c.num_microbatches} R={c.num_repeats} remat={c.remat} "
      f"remat_granularity={c.get('remat_granularity', 'chunk')}, "
      f"dtype={c.get('dtype', 'float32')}, "
      f"batch={c.batch_size}{seq}; lowered in {report.lower_seconds:.1f} s, "
      f"compiled in {report.compile_seconds:.1f} s (not run)"
      + (f" for the TPU topology {report.topology}." if report.topology else "."),
      "",
      *([report.backward.capitalize() + ".", ""] if report.backward else []),
      "| memory per device | bytes |",
      "|---|---:|",
      *_state_rows(report),
      f"| activations and other temporaries | {fb(report.activation_bytes)} |",
      *_moe_activation_rows(report),
      f"| outputs not aliased to donated inputs | {fb(mem.outputs - mem.aliased)} |",
      f"| **peak total** (arguments + outputs - aliased + temporaries + code) | "
      f"**{fb(report.total_bytes)}** |",
      f"| largest device | {fb(report.largest_device_bytes)} |",
      "",
      *([moe_costs.describe_tokens(report.moe) + _expert_traffic(report), ""]
        if getattr(report, "moe", None) else []),
      *([report.moments + ".", ""] if report.moments else []),
      "| FLOPs per device per step | |",
      "|---|---:|",
      f"| XLA cost_analysis (each loop body once) | {_flops(flops.xla or 0)} |",
      f"| lockstep (loop bodies x trip counts, every tick busy) | {_flops(flops.executed)} |",
  ]
  if pipe is not None:
    lines += [
        f"| executed (idle ticks skip the stage) | {_flops(pipe.executed)} |",
        f"| useful (busy slots' work and work outside the tick loops) | {_flops(pipe.useful)} |",
        f"| useful / executed (no wasted compute: near 100%) | {pipe.useful_fraction:.1%} |",
        f"| useful / lockstep (share of the step's time doing useful work) | "
        f"{pipe.lockstep_efficiency:.1%} |",
        f"| analytic bubble fraction ({report.schedule.num_ticks} ticks) | "
        f"{pipe.bubble_fraction:.1%} |",
    ]
  if report.state_split:
    lines += ["", "| parameters per mesh axis | devices | split over it | held whole along it |",
              "|---|---:|---:|---:|"]
    for row in report.state_split:
      total = max(1, row["split_bytes"] + row["whole_bytes"])
      lines.append(f"| {row['axis']} | {row['devices']} | {fb(row['split_bytes'])} "
                   f"({row['split_bytes'] / total:.1%}) | {fb(row['whole_bytes'])} "
                   f"({row['whole_bytes'] / total:.1%}) |")
  if report.tick_costs is not None:
    from tpipe.schedules import derived_costs  # pylint: disable=g-import-not-at-top

    lines += ["", derived_costs.describe(report.tick_costs, report.tick_costs_derived) + "."]
  lines += [""] + schedule_summary.format_schedule(report.schedule, report.costs)
  if flops.loops_without_trip_count:
    lines += ["", f"Warning: XLA proved no trip count for loops "
              f"{list(flops.loops_without_trip_count)}; each is counted once, so executed FLOPs "
              "are a lower bound."]
  lines += ["", "| collectives per step | axes | role | instructions | executions | bytes "
            "per device | in a loop |", "|---|---|---|---:|---:|---:|---:|"]
  for row in report.collective_rows():
    lines.append(f"| {row['kind']} | {row['axes']} | {row['role']} | {row['instructions']} | "
                 f"{row['count']} | {fb(row['bytes'])} | {row['in_loop']} |")
  if report.communication is not None:
    lines += [""] + communication.format_communication(report.communication)
  if getattr(report, "prediction", None) is not None:
    lines += [""] + format_prediction(report.prediction)
  if report.stages:
    lines += [""] + format_stages(report)
  if report.peak is not None:
    lines += ["", "### What is live at the memory peak", "",
              "From XLA's buffer assignment of the compiled step (`tpipe.tools.peak`): the buffers "
              "live where the program's memory use peaks, each with the role that made it. "
              f"`memory_analysis()` counts {fb(mem.temporaries)} of temporaries in all.",
              "", report.peak.format(count=12)]
  return "\n".join(lines)


def _state_rows(report) -> list[str]:
  """The memory table's parameter, optimizer-state, batch and gradient rows; with experts
  (``report.moe``), the experts' weights, optimizer state and gradients as rows of their own
  beside the rest (the rows still add up to the same total)."""
  from tpipe.tools import analysis  # pylint: disable=g-import-not-at-top

  fb, moe = analysis.format_bytes, getattr(report, "moe", None)
  if moe is None:
    return [f"| parameters | {fb(report.params_bytes)} |",
            f"| optimizer state | {fb(report.opt_state_bytes)} |",
            f"| batch | {fb(report.batch_bytes)} |",
            f"| gradients (= parameters, inside temporaries) | {fb(report.gradient_bytes)} |"]
  grads = min(moe.expert_gradient_bytes, report.gradient_bytes)
  return [
      f"| parameters other than the experts' | {fb(report.params_bytes - moe.expert_param_bytes)}"
      " |",
      f"| experts' weights (measured: the staged tree's expert leaves) | "
      f"{fb(moe.expert_param_bytes)} |",
      f"| optimizer state other than the experts' | "
      f"{fb(report.opt_state_bytes - moe.expert_opt_state_bytes)} |",
      f"| experts' optimizer state (measured likewise) | {fb(moe.expert_opt_state_bytes)} |",
      f"| batch | {fb(report.batch_bytes)} |",
      f"| gradients other than the experts' (= their parameters, inside temporaries) | "
      f"{fb(report.gradient_bytes - grads)} |",
      f"| experts' gradients (= their weights, inside temporaries) | {fb(grads)} |"]


def _moe_activation_rows(report) -> list[str]:
  """With experts, the dispatch buffers' and routing metadata's rows (inside the activations
  and temporaries above, so not added to the total)."""
  from tpipe.tools import analysis  # pylint: disable=g-import-not-at-top

  fb, moe = analysis.format_bytes, getattr(report, "moe", None)
  if moe is None:
    return []
  return [f"| of which MoE dispatch buffers, one MoE layer on one micro-batch (estimate from "
          f"shapes) | {fb(moe.dispatch_bytes)} |",
          f"| of which MoE routing metadata, one MoE layer on one micro-batch (estimate from "
          f"shapes) | {fb(moe.routing_bytes)} |"]


def _expert_traffic(report) -> str:
  """The collectives over the ``expert`` axis alone per step, measured from the compiled
  program, as a sentence (empty where there are none)."""
  from tpipe.tools import analysis  # pylint: disable=g-import-not-at-top

  rows = [row for row in report.collective_rows() if row["axes"] == "expert"]
  if not rows:
    return ""
  kinds = ", ".join(sorted({row["kind"] for row in rows}))
  return (f" Collectives over the expert axis alone per step (measured from the compiled "
          f"program: the tokens' dispatch and combine, and sums of the gradients of weights the "
          f"expert axis holds whole): {analysis.format_bytes(sum(r['bytes'] for r in rows))} "
          f"per device in {sum(r['count'] for r in rows)} executions ({kinds}).")


def format_stages(report) -> list[str]:
  """The per-stage table and the memory floor, as markdown lines."""
  from tpipe.tools import analysis  # pylint: disable=g-import-not-at-top

  fb = analysis.format_bytes
  lines = [
      "| stage | layers (chunks separated by /) | parameters | parameter slots (padding) | "
      "optimizer state | FLOPs "
      "fwd+bwd per micro-batch | input per micro-batch | stash slots | chunk working set | "
      "floor |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for st in report.stages:
    lines.append(
        f"| {st.stage} | {' / '.join(', '.join(chunk) for chunk in st.chunk_layers)} | "
        f"{fb(st.param_bytes)} | {fb(st.buffer_bytes)} "
        f"(+{st.padding_fraction:.1%}) | {fb(st.optimizer_bytes)} | {_flops(st.flops)} | "
        f"{fb(st.input_bytes)} | {st.stash_slots} | {fb(st.working_set_bytes)} | "
        f"{fb(st.floor.total)} |")
  floor = report.floor
  lines += [
      "",
      f"Packed parameter buffers: every chunk slot is padded to the largest chunk; the boundary "
      f"format (what crosses stages) is {fb(report.ring_bytes)} per micro-batch.",
      "",
      f"| memory floor (stage {floor.stage}, the largest) | bytes |", "|---|---:|",
      f"| parameters + optimizer state + gradients (own, no padding) | {fb(floor.state_bytes)} |",
      f"| in-flight stage inputs (stash slots x one micro-batch's input) | "
      f"{fb(floor.stash_bytes)} |",
      f"| working set of one chunk's forward and backward on one micro-batch | "
      f"{fb(floor.working_set_bytes)} |",
      f"| **floor** | **{fb(floor.total)}** |",
      f"| real peak (largest device) | {fb(report.largest_device_bytes)} |",
      f"| **peak / floor** | **{report.floor_ratio:.2f}x** |",
  ]
  # A fused schedule stashes only chunk inputs (its backward recomputes the chunk's forward
  # from them), except under remat="none": F keeps the VJP's residuals (unless W recomputes).
  remat, fused = report.config.get("remat"), schedule_summary.is_fused(report.schedule)
  recomputes = (report.schedule.name in SPLIT_BACKWARD
                and check_weight_recompute(report.config.get("weight_recompute", False)))
  keeps_residuals = remat == "none" and fused and not recomputes
  if remat != "full" and (keeps_residuals or not fused):
    lines += ["", f"remat={report.config.get('remat')!r}: the floor counts the stage inputs a "
              "stash slot keeps under remat='full'; with this policy each slot also keeps the "
              "chunk's saved activations, which the ratio then includes."]
  granularity = granularity_in_effect(report.config.get("remat", "full"),
                                      report.config.get("remat_granularity", "chunk"))
  if granularity != "chunk":  # Under remat="none" every granularity runs as "chunk".
    lines += ["", f"remat_granularity={granularity!r}: the floor's working set is the chunk's "
              "forward and backward with its pieces checkpointed, as a tick runs it (each "
              "piece's input, and one piece's intermediates at a time)"
              + ("." if schedule_summary.is_fused(report.schedule) else
                 "; under gpipe/circular each stash slot also keeps the inputs of the chunk's "
                 "pieces, which the floor does not count.")]
  return lines


def _time(seconds: float) -> str:
  for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
    if abs(seconds) >= scale:
      return f"{seconds / scale:.3g} {unit}"
  return f"{seconds * 1e9:.3g} ns"


def format_prediction(prediction) -> list[str]:
  """The predicted step time, tokens per second, MFU and where the time goes, as markdown lines
  (``prediction`` a :class:`tpipe.train.cli.config_costs.Prediction`)."""
  st = prediction.step_time
  how = ("the table followed tick by tick, each action's branch priced" if prediction.tick_by_tick
         else "the program priced whole, the bubble the table's simulated share")
  rates = []
  if prediction.tokens_per_second:
    rates.append(f"{prediction.tokens_per_second:,.0f} tokens/s")
  if prediction.mfu is not None:
    rates.append(f"MFU {prediction.mfu:.1%} (model FLOPs {_flops(prediction.model_flops)} per "
                 f"step, 6 x active parameters x tokens plus attention)")
  lines = [f"### Predicted step time on {prediction.chip}", "",
           f"Roofline of the compiled program (`tpipe.tools.step_time`; {how}): "
           f"**{_time(prediction.seconds)}** per step"
           + (", " + ", ".join(rates) if rates else "") + ".",
           "", "| where the time goes | seconds | share |", "|---|---:|---:|"]
  total = prediction.seconds or 1.0
  for part, seconds in prediction.parts.items():
    label = {"compute": "compute-bound instructions", "memory": "memory-bound instructions",
             "exposed collectives": "exposed collectives",
             "bubble": "bubble (stages idle or waiting)"}.get(part, part)
    lines.append(f"| {label} | {_time(seconds)} | {seconds / total:.1%} |")
  lines.append(f"| of which rematerialisation (jax.checkpoint recompute) | "
               f"{_time(prediction.recompute)} | {prediction.recompute / total:.1%} |")
  if st is not None:
    unknown = [name for name, n in st.trip_counts.items() if n is None]
    lines += ["", f"Per device: {_flops(st.flops)} executed, "
              f"{st.hbm_bytes / 2 ** 30:.3g} GiB of HBM traffic, collectives hidden behind "
              f"compute {_time(st.hidden_collective_seconds)}; loop trip counts "
              f"{sorted(n for n in st.trip_counts.values() if n is not None)}"
              + (f", unknown for {unknown} (counted once)" if unknown else "") + "."]
  return lines
