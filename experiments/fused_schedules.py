"""Fused schedules side by side: activation memory in M, FLOPs per action, bubbles.

Run from the repository root (compiles only, nothing runs)::

  python -m experiments.fused_schedules            # writes experiments/results/fused_schedules.md
  python -m experiments.fused_schedules --smoke    # S = 2, M = 2, width 32: checks the script

The model is the decoder LM of the trainer (``tpipe.train.models.decoder_lm``: token embedding,
Transformer blocks, final norm + head + per-example loss), float32, one micro-batch of 4 x 64
tokens, width 128 (4 heads, MLP 512). Every schedule compiles the gradient of the mean loss
(``jax.grad`` of ``model.apply(..., method="loss")``, the same call under every schedule; a fused
schedule runs its backward inside its table) ahead of time, and reports:

* **Memory** (S = 4, 16 blocks, M = 8 and 64 micro-batches of a fixed size, so the batch grows
  with M): the compiled step's per-device temporaries (``memory_analysis().temp_size_in_bytes``),
  which hold the activations kept between forward and backward; the logical parameters and the
  batch come in whole on every device (``in_shardings``), so the compiler cannot trade
  arguments for temporaries. GPipe keeps one stage input per
  micro-batch (its loss runs its forward and backward ticks as one fused table under remat full;
  circular one per micro-batch and chunk), so its temporaries grow with M; the fused schedules
  keep at most the table's peak of micro-batches in flight, bounded by S.
* **FLOPs and bubble** (S = 8, 32 blocks, M = 8 and 32; every schedule, GPipe and circular
  too: under remat full their loss runs its forward ticks and autodiff's backward ticks as one
  fused table): from the compiled tick loop's branches
  (:func:`tpipe.tools.analysis.fused_flops`, given the pipeline's chunk programs): the FLOPs of
  one ``F``, ``B``, ``BI`` and ``W`` (mean over model chunks); the busiest device's executed
  FLOPs vs the useful FLOPs; the step's lockstep time in FLOPs (every tick lasts its costliest
  action); the table's bubble under the measured per-action costs in the three time models of
  :mod:`tpipe.schedules.simulate` (dependency-driven, neighbour-synchronised: what the tick loop
  takes, lockstep), and the neighbour-synchronised step over GPipe's at the same M; and for the
  zero-bubble schedules ``(BI + W) / B``, the split backward's FLOPs over a fused backward's
  (``B`` from the schedule that runs the same chunks unsplit, :data:`UNSPLIT`: the split
  program compiles no ``B``).
* **Per-action costs as the TPU sees them**: one chunk's F, B and BI compiled alone for one v5p
  chip, the TPU compiler's ``optimal_seconds`` for each (``W = B - BI``), and every table
  simulated under them beside the FLOP-based costs.
* **Every link delayed** (``transfer_delay=1``): the same measured costs on each schedule's
  table built with delayed transfers, simulated: ticks, peak in flight, the natural and
  neighbour-synchronised bubbles and the step over plain GPipe's. A delayed exchange runs beside
  the next tick, so neighbours meet at the start of a tick instead of its end.

ZB-H1's analytic bubble with costs ``F``, ``BI``, ``W`` (Qi et al., 2024): the first stage idles
``(S - 1)(F + BI - W)`` per step of ``M (F + BI + W)`` work, a fraction
``(S - 1)(F + BI - W) / (M (F + BI + W) + (S - 1)(F + BI - W))``; with equal costs that is about
``(S - 1) / (3M)``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import tpipe
from experiments import _common
from tpipe.experimental import refine
from tpipe.tools import analysis
from tpipe.train import models

# One micro-batch of rows x seq tokens, and the model width (4 heads, MLP 4 x width).
MICROBATCH = dict(rows=4, seq=64, width=128)
SMOKE_MICROBATCH = dict(rows=2, seq=16, width=32)
HEADS = 4
# (name, chunks per stage)
SCHEDULES = (("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved_1f1b", 2),
             ("zb_h1", 1), ("zbv", 2))
# A split backward's program compiles no B (its table runs none): the fused B it is compared
# with is the schedule that runs the same model chunks unsplit.
UNSPLIT = {"zb_h1": "1f1b", "zbv": "interleaved_1f1b"}


def compile_step(schedule: str, repeats: int, *, stages: int, microbatches: int,
                 num_layers: int, rows: int, seq: int, width: int, tick_costs=None,
                 weight_recompute: bool | str = False, remat: str = "full"):
  """(model, its engine pipeline, compiled gradient step) of the LM for one schedule (a fused
  one in compound ticks for ``tick_costs``; a split backward's W recomputing what
  ``weight_recompute`` says)."""
  mesh = tpipe.make_mesh(stages=stages)
  chunks = stages * repeats
  # Embedding with the first blocks, the head with the last: units split evenly.
  units = num_layers + 2
  counts = [units // chunks + (c < units % chunks) for c in range(chunks)]
  model = models.decoder_lm(num_layers=num_layers, width=width, num_heads=HEADS,
                            mlp_dim=4 * width, max_len=seq, num_stages=stages,
                            num_microbatches=microbatches, schedule=schedule,
                            num_repeats=repeats, remat=remat, balance=counts, mesh=mesh,
                            tick_costs=tick_costs, weight_recompute=weight_recompute)
  batch = rows * microbatches
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  params = model.variable_shapes(tokens, targets=tokens)["params"]
  loss = lambda p, x, t: model.apply({"params": p}, x, targets=t, method="loss")
  # The logical parameters and the batch whole on every device, as a caller holds them (left
  # to the compiler, it may shard them to save arguments for temporaries).
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  shardings = (jax.tree.map(lambda _: whole, params), whole, whole)
  step = jax.jit(jax.grad(loss), in_shardings=shardings)
  compiled = step.lower(params, tokens, tokens).compile()
  return model, model.pipeline_for(tokens, targets=tokens), compiled


def zb_h1_analytic(costs, stages: int, microbatches: int) -> float:
  f, bi, w = costs["F"], costs["BI"], costs["W"]
  idle = (stages - 1) * (f + bi - w)
  return idle / (microbatches * (f + bi + w) + idle)


def memory_table(stages: int, num_layers: int, ms: tuple[int, ...], sizes: dict,
                 measured=()) -> list[str]:
  """Temporaries per device at each M; with ``measured`` costs (:func:`flops_table`), every
  fused schedule also in compound ticks built for its measured costs; the split backward's
  schedules with ``weight_recompute`` "forward" and "backward", with what that costs in FLOPs;
  and GPipe, 1F1B, ZB-H1 and ZB-V under ``remat="none"`` (the fused ones keeping each chunk's
  residuals in a slot per micro-batch in flight; the split ones also the weight operations'
  inputs, until ``W``)."""
  lines = [f"### Activation memory in M (S = {stages}, {num_layers} blocks, micro-batch "
           f"{sizes['rows']} x {sizes['seq']}, width {sizes['width']})", "",
           "| schedule | " + " | ".join(f"temporaries at M = {m}" for m in ms)
           + f" | M = {ms[-1]} / M = {ms[0]} | / 1F1B's at M = {ms[0]} | in flight per stage "
           "(peak) |", "|---|" + "---|" * (len(ms) + 3)]
  costs_of = {name: costs for name, _, _, costs in measured}
  rows = [(name, name, repeats, None, False, "full") for name, repeats in SCHEDULES]
  rows += [(f"{name}, compound ticks", name, repeats, costs_of[name], False, "full")
           for name, repeats in SCHEDULES if name in costs_of and tpipe.schedules.is_fused(name)]
  rows += [(f"{name}, weight_recompute {what}", name, repeats, None, what, "full")
           for what in ("forward", "backward")
           for name, repeats in SCHEDULES if name in ("zb_h1", "zbv")]
  rows += [(f"{name}, remat none", name, repeats, None, False, "none")
           for name, repeats in SCHEDULES if name != "circular"]
  # SCHEDULES lists the unsplit schedules first, so their B is there for the split rows
  # (remat none's rows come in the same order).
  one_f_one_b, flops, fused_backward = None, [], {}
  for label, name, repeats, costs, recompute, remat in rows:
    temps, peak = [], "-"
    for m in ms:
      _, pipeline, compiled = compile_step(name, repeats, stages=stages, microbatches=m,
                                           num_layers=num_layers, tick_costs=costs,
                                           weight_recompute=recompute, remat=remat, **sizes)
      temps.append(compiled.memory_analysis().temp_size_in_bytes)
      # GPipe and circular under remat full run their forward and backward ticks as one table,
      # whose stash holds one input per micro-batch chunk; under remat none autodiff keeps
      # every micro-batch's residuals (M in flight).
      table = pipeline.loss_table
      peak = (str(table.peak_in_flight().tolist())
              if isinstance(table, tpipe.schedules.FusedSchedule)
              else f"[{m}] * {stages}")
      if name in UNSPLIT.values() and costs is None and m == ms[0]:  # The split rows' B.
        fused_backward[name, remat] = float(np.mean(analysis.fused_flops(
            compiled, pipeline.loss_table, pipeline.programs()).actions["B"]))
      if name in UNSPLIT and costs is None and m == ms[0]:
        found = analysis.fused_flops(compiled, pipeline.loss_table, pipeline.programs())
        mean = {k: float(np.mean(v)) for k, v in found.actions.items()}
        flops.append((label, dict(mean, B=fused_backward[UNSPLIT[name], remat])))
    if label == "1f1b":
      one_f_one_b = temps[0]
    versus = f"{temps[0] / one_f_one_b:.2f}" if one_f_one_b else "-"
    lines.append(f"| {label} | " + " | ".join(analysis.format_bytes(t) for t in temps)
                 + f" | {temps[-1] / temps[0]:.2f} | {versus} | {peak} |")
  if flops:
    lines += ["", "What the split backward costs, with `weight_recompute` and under remat none: "
              "per action of one chunk, MFLOP (mean over chunks), and the split backward over "
              "the fused `B` of the same chunks and remat (1F1B's, interleaved 1F1B's):", "",
              "| schedule | F | BI | W | (BI + W) / B |", "|---|---|---|---|---|"]
    for label, f in flops:
      lines.append(f"| {label} | {f['F'] / 1e6:.1f} | {f['BI'] / 1e6:.1f} | "
                   f"{f['W'] / 1e6:.1f} | {(f['BI'] + f['W']) / f['B']:.3f} |")
  return lines


def flops_table(stages: int, num_layers: int, ms: tuple[int, ...],
                sizes: dict) -> tuple[list[str], list]:
  """The FLOPs-and-bubble tables, and the measured ``(name, repeats, M, costs)`` per row."""
  lines = [f"### FLOPs and bubble (S = {stages}, {num_layers} blocks, micro-batch "
           f"{sizes['rows']} x {sizes['seq']}, width {sizes['width']}; MFLOP per device)", "",
           "| schedule | M | F | B | BI | W | (BI + W) / B | executed (busiest device) | useful "
           "(mean) | lockstep | bubble, unit costs: table | ZB-H1 analytic | bubble, measured "
           "costs: natural | ZB-H1 analytic | neighbour-synchronised | lockstep | "
           "neighbour-synchronised step / GPipe's |",
           "|---|" + "---|" * 16]
  mf = lambda v: f"{v / 1e6:.1f}" if np.isfinite(v) else "-"
  show = lambda v, digits=3: f"{v:.{digits}f}" if np.isfinite(v) else "-"
  gpipe_step, measured = {}, []
  for name, repeats in SCHEDULES:
    for m in ms:
      _, pipeline, compiled = compile_step(name, repeats, stages=stages, microbatches=m,
                                           num_layers=num_layers, **sizes)
      # GPipe and circular under remat full run their loss as one fused table too (the forward
      # ticks, then autodiff's backward ticks: tpipe.schedules.whole_step).
      table = pipeline.loss_table
      found = analysis.fused_flops(compiled, table, pipeline.programs())
      mean = {k: float(np.mean(v)) for k, v in found.actions.items()}
      if name in UNSPLIT:  # B of the same chunks, from the unsplit schedule's program.
        mean["B"] = next(c["B"] for n, _, mm, c in measured if (n, mm) == (UNSPLIT[name], m))
      costs = dict(found.costs(), B=mean["B"])
      measured.append((name, repeats, m, costs))
      timing = table.simulate(costs)
      gpipe_step.setdefault(m, timing.neighbour)
      split = (mean["BI"] + mean["W"]) / mean["B"] if np.isfinite(mean["BI"]) else float("nan")
      zb = name == "zb_h1"
      unit = zb_h1_analytic({"F": 1, "BI": 1, "W": 1}, stages, m) if zb else float("nan")
      analytic = zb_h1_analytic(costs, stages, m) if zb else float("nan")
      lines.append(
          f"| {name} | {m} | {mf(mean['F'])} | {mf(mean['B'])} | {mf(mean['BI'])} | "
          f"{mf(mean['W'])} | {show(split, 4)} | {mf(found.executed)} | {mf(found.useful)} | "
          f"{mf(found.lockstep)} | {table.bubble_fraction:.3f} | {show(unit)} | "
          f"{timing.natural_bubble:.3f} | {show(analytic)} | {timing.neighbour_bubble:.3f} | "
          f"{timing.lockstep_bubble:.3f} | {timing.neighbour / gpipe_step[m]:.3f} |")
  lines += [""] + delayed_table(stages, measured, gpipe_step)
  try:
    tpu_lines, tpu = tpu_costs_table(stages, num_layers, ms, sizes, measured)
  except ValueError as error:  # No TPU compiler here (libtpu comes with the test extra).
    tpu_lines, tpu = [f"(TPU per-action costs skipped: {error})"], None
  lines += [""] + tpu_lines + [""] + compound_table(stages, measured, tpu)
  lines += [""] + search_table(stages, measured, tpu)
  return lines, measured


def delayed_table(stages: int, measured, gpipe_step: dict) -> list[str]:
  """Every link delayed (``transfer_delay=1``): the same measured costs on tables built with
  the longer transfers. A delayed exchange runs beside the next tick's compute, so a stage waits
  for its neighbours only at the start of a tick, not for their slowest action."""
  lines = [f"### Every link delayed (transfer_delay=1; S = {stages}, the costs measured above)",
           "", "| schedule | M | ticks | in flight per stage (peak) | bubble: natural | "
           "neighbour-synchronised | neighbour / natural | step / GPipe's (no delay) |",
           "|---|---|---|---|---|---|---|---|"]
  for name, repeats, m, costs in measured:
    table = tpipe.schedules.whole_step(
        tpipe.schedules.build(name, stages, m, repeats, delays=1))
    timing = table.simulate(costs)
    lines.append(f"| {name} | {m} | {table.num_ticks} | {int(table.peak_in_flight().max())} | "
                 f"{timing.natural_bubble:.3f} | {timing.neighbour_bubble:.3f} | "
                 f"{timing.neighbour / timing.natural:.3f} | "
                 f"{timing.neighbour / gpipe_step[m]:.3f} |")
  return lines


def tpu_action_seconds(blocks: int, rows: int, seq: int, width: int,
                       topology: str = "v5p:2x2x1") -> dict[str, float]:
  """Per-action costs as the TPU compiler sees them: ``cost_analysis()["optimal_seconds"]`` of
  one chunk of ``blocks`` Transformer blocks on one micro-batch, each action
  (:func:`chunk_actions`) compiled alone for one chip of ``topology`` (nothing runs on a TPU);
  ``W = B - BI``, the weight-gradient products ``BI`` leaves to ``W``."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  device = tpipe.topology_devices(topology)[0]
  on_chip = jax.sharding.SingleDeviceSharding(device)
  block = models.TransformerBlock(width=width, num_heads=HEADS, mlp_dim=4 * width,
                                  deterministic=True)
  chunk = nn.Sequential([block.clone() for _ in range(blocks)])
  h = jax.ShapeDtypeStruct((rows, seq, width), jnp.float32, sharding=on_chip)
  params = jax.eval_shape(lambda h: chunk.init(jax.random.key(0), h), h)
  params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_chip),
                        params)

  def seconds(fn):
    analysis = jax.jit(fn).lower(params, h, h).compile().cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    return float(analysis["optimal_seconds"])

  costs = {name: seconds(fn) for name, fn in chunk_actions(chunk).items()}
  return dict(costs, W=costs["B"] - costs["BI"])


def chunk_actions(chunk) -> dict:
  """One chunk's actions, each ``fn(params, h, g)`` for its input ``h`` and output cotangent
  ``g``: ``F`` its forward; ``B`` its forward again and the VJP for the weights and the input
  (a fused backward under remat full); ``BI`` its forward again and the input's gradient alone
  (XLA drops the weight gradients nobody reads). ``W`` is what ``B`` does beyond ``BI``."""
  forward = lambda p, h: chunk.apply(p, h)
  return {
      "F": lambda p, h, g: forward(p, h),
      "B": lambda p, h, g: jax.vjp(forward, p, h)[1](g),
      "BI": lambda p, h, g: jax.vjp(lambda h: forward(p, h), h)[1](g),
  }


def chunk_actions_keeping_residuals(chunk) -> tuple:
  """One chunk's actions under ``remat="none"``, where the forward keeps its VJP's residuals
  for the backward: ``(linearize, actions)``. ``linearize(params, h)`` is that forward, returning
  the output and the two VJPs (their residuals are arrays); ``actions`` maps ``"F"`` to
  ``fn(params, h, g)`` (the same forward), ``"B"`` and ``"BI"`` to ``fn(vjps, g)``: the VJP for
  the weights and the input, and for the input alone, from the kept residuals."""
  forward = lambda p, h: chunk.apply(p, h)

  def linearize(p, h):
    out, both = jax.vjp(forward, p, h)
    _, inputs = jax.vjp(lambda h: forward(p, h), h)
    return out, (both, inputs)

  return linearize, {
      "F": lambda p, h, g: jax.vjp(forward, p, h),
      "B": lambda vjps, g: vjps[0](g),
      "BI": lambda vjps, g: vjps[1](g),
  }


def tpu_costs_table(stages: int, num_layers: int, ms: tuple[int, ...], sizes: dict,
                    measured) -> tuple[list[str], dict]:
  """Every schedule simulated under the TPU compiler's per-action seconds beside the FLOP-based
  costs measured above (same tables, same M); and those seconds per chunks-per-stage."""
  # A chunk holds the blocks of one stage (one repeat) or of half a stage (two).
  per_chunk = {r: max(1, num_layers // (stages * r)) for r in (1, 2)}
  tpu = {r: tpu_action_seconds(per_chunk[r], **sizes) for r in (1, 2)}
  us = lambda v: f"{v * 1e6:.1f}"
  lines = [f"### Per-action costs as the TPU sees them (one v5p chip, micro-batch "
           f"{sizes['rows']} x {sizes['seq']}, width {sizes['width']})", "",
           "The TPU compiler's `optimal_seconds` per action of one chunk, us (`W = B - BI`; "
           "the embedding and the head are left out, as the blocks dominate):", "",
           "| blocks per chunk | F | B | BI | W | B / F |", "|---|---|---|---|---|---|"]
  for r, c in tpu.items():
    lines.append(f"| {per_chunk[r]} | {us(c['F'])} | {us(c['B'])} | "
                 f"{us(c['BI'])} | {us(c['W'])} | {c['B'] / c['F']:.2f} |")
  lines += ["", "| schedule | M | costs | bubble: natural | neighbour-synchronised | lockstep | "
            "neighbour-synchronised step / GPipe's |", "|---|---|---|---|---|---|---|"]
  gpipe = {}
  for label, costs_of in (("FLOPs (measured above)", lambda c, r: c),
                          ("TPU optimal_seconds", lambda c, r: tpu[r])):
    for name, repeats, m, costs in measured:
      table = tpipe.schedules.whole_step(tpipe.schedules.build(name, stages, m, repeats))
      timing = table.simulate(costs_of(costs, repeats))
      key = (label, m)
      gpipe.setdefault(key, timing.neighbour)
      lines.append(f"| {name} | {m} | {label} | {timing.natural_bubble:.3f} | "
                   f"{timing.neighbour_bubble:.3f} | {timing.lockstep_bubble:.3f} | "
                   f"{timing.neighbour / gpipe[key]:.3f} |")
  return lines, tpu


# Per-action wall times of a 4-block chunk (width 2048, bf16, micro-batch 4 x 1024) timed on a
# lent NVIDIA H200 by experiments/gpu_action_costs.py (results/gpu_action_costs.md), ms; the
# 2-block chunk's row there for two chunks per stage. Under remat none the forward keeps its
# VJP's residuals and the backward starts from them.
GPU_COSTS = {"full": {1: {"F": 4.3143, "B": 13.5065, "BI": 9.0592, "W": 4.4473},
                      2: {"F": 2.2336, "B": 6.8166, "BI": 4.5136, "W": 2.303}},
             "none": {1: {"F": 6.7852, "B": 10.0734, "BI": 5.6441, "W": 4.4293},
                      2: {"F": 3.567, "B": 5.3716, "BI": 3.0104, "W": 2.3612}}}


def cost_sets(tpu) -> list[tuple[str, Any]]:
  """``(label, costs_of(measured costs, chunks per stage) -> costs)``: the cost sets the
  compound tables are built and timed for. Under ``remat="none"`` every backward keeps the
  forward's residuals (autodiff's in GPipe and circular, the residual slots of the fused
  schedules), so its ``B`` or ``BI`` is one forward less. From FLOPs this is a model (the
  forward that keeps its residuals also costs more: the memory table's remat-none rows measure
  both); the H200's remat-none set is timed."""
  without_recompute = lambda c: dict(c, **{k: c[k] - c["F"] for k in ("B", "BI") if k in c})
  sets = [("FLOPs, remat full", lambda c, r: c),
          ("FLOPs, remat none", lambda c, r: without_recompute(c))]
  if tpu is not None:
    sets.append(("TPU v5p optimal_seconds", lambda c, r: tpu[r]))
  sets.append(("H200 wall time (width 2048), remat full", lambda c, r: GPU_COSTS["full"][r]))
  sets.append(("H200 wall time (width 2048), remat none", lambda c, r: GPU_COSTS["none"][r]))
  return sets


def ratio(timing, natural=None) -> str:
  """The neighbour-synchronised bubble over the natural one (``natural``'s, another table's
  timing, where given; "inf" where only the natural one is 0)."""
  natural = (natural or timing).natural_bubble
  if natural <= 1e-12:
    return "1.00" if timing.neighbour_bubble <= 1e-12 else "inf"
  return f"{timing.neighbour_bubble / natural:.2f}"


def gpipe_step(stages: int, microbatches: int, costs) -> float:
  """GPipe's neighbour-synchronised step under ``costs``: the tables' reference."""
  gpipe = tpipe.schedules.whole_step(tpipe.schedules.build("gpipe", stages, microbatches))
  return gpipe.simulate(costs).neighbour


def compound_table(stages: int, measured, tpu) -> list[str]:
  """Every fused schedule laid out in compound ticks for each cost set (:func:`cost_sets`),
  simulated beside its one-action table and GPipe under the same costs."""
  lines = [f"### Compound ticks (S = {stages}): a forward, a backward and weight work per tick",
           "", "Each fused table built by `tpipe.schedules.build(..., costs=)` for the cost set "
           "and simulated under it; GPipe's step under the same costs is the reference (under "
           "remat none every `B` and `BI` keeps the forward's residuals: one forward less). "
           "Bubble ratios: the neighbour-synchronised bubble over the compound table's own "
           "natural (dependency-driven) bubble, and over the schedule's: its one-action "
           "table's. The critical chain (`FusedSchedule.critical_path`) is the run of ticks, "
           "hopping between neighbours, whose costs make up the neighbour-synchronised step; "
           "its time in forwards, backwards (`B` or `BI`) and `W` is given over one stage's own "
           "(the chain's excess over a stage's work is the bubble; in steady ticks the chain "
           "runs what a stage runs).", "",
           "| costs | schedule | M | ticks | actions per tick (most) | in flight (peak) | "
           "weight slots | bubble: natural | neighbour-synchronised | bubble ratio: own | "
           "schedule's | step / GPipe's | one action per tick: step / GPipe's | "
           "critical chain over a stage's work: F / B / W |",
           "|---|" + "---|" * 13]
  gpipe_costs = {m: c for name, _, m, c in measured if name == "gpipe"}
  for label, costs_of in cost_sets(tpu):
    for name, repeats, m, measured_costs in measured:
      fused = tpipe.schedules.is_fused(name)
      costs = costs_of(measured_costs, repeats)
      reference = gpipe_step(stages, m, costs_of(gpipe_costs[m], 1))
      if not fused:
        table = tpipe.schedules.whole_step(tpipe.schedules.build(name, stages, m, repeats))
        plain = None
      else:
        table = tpipe.schedules.build(name, stages, m, repeats, costs=costs)
        plain = tpipe.schedules.build(name, stages, m, repeats).simulate(costs)
      timing = table.simulate(costs)
      lanes = table.lanes if fused else 1
      slots = int(table.awaiting_weight().max()) if fused else 0
      lines.append(
          f"| {label} | {name} | {m} | {table.num_ticks} | {lanes} | "
          f"{int(table.peak_in_flight().max())} | {slots} | {timing.natural_bubble:.3f} | "
          f"{timing.neighbour_bubble:.3f} | {ratio(timing)} | {ratio(timing, plain)} | "
          f"{timing.neighbour / reference:.3f} | "
          f"{'-' if plain is None else f'{plain.neighbour / reference:.3f}'} | "
          f"{chain_by_kind(table, costs) if fused else '-'} |")
  return lines


def search_table(stages: int, measured, tpu) -> list[str]:
  """The compound tables again with four sweeps of exact window search
  (:func:`tpipe.experimental.refine.refine`): 1F1B and ZB-H1 under every cost set, ZB-V at M = 8
  under the FLOP-based ones (a V table's windows hold twice the actions: minutes each)."""
  lines = [f"### Exact window search (S = {stages}): `tick_search=4`", "",
           "Each table above searched again (`refine(table, costs, sweeps=4)`: "
           "the actions of six ticks at a time re-placed by a mixed-integer program, up to four "
           "sweeps of windows while a sweep finds a shorter step or, as long, one whose ticks "
           "end earlier, from the built table and from three re-timings of it that run the last "
           "backwards' loss chunk in their forward's tick; never longer, never more stash or "
           "weight slots on any stage). "
           "Bubble ratio: the neighbour-synchronised bubble over the schedule's natural one "
           "(its one-action table's), before and after; seconds: the search's wall time on "
           "this 2-core machine.", "",
           "| costs | schedule | M | bubble ratio: builder | searched | step / GPipe's: builder "
           "| searched | in flight (peak): builder / searched | weight slots | seconds |",
           "|---|" + "---|" * 9]
  gpipe_costs = {m: c for name, _, m, c in measured if name == "gpipe"}
  for label, costs_of in cost_sets(tpu):
    for name, repeats, m, measured_costs in measured:
      v_skipped = name == "zbv" and (m != min(gpipe_costs) or not label.startswith("FLOPs"))
      if name not in ("1f1b", "zb_h1", "zbv") or v_skipped:
        continue
      costs = costs_of(measured_costs, repeats)
      reference = gpipe_step(stages, m, costs_of(gpipe_costs[m], 1))
      plain = tpipe.schedules.build(name, stages, m, repeats).simulate(costs)
      built = tpipe.schedules.build(name, stages, m, repeats, costs=costs)
      start = time.perf_counter()
      searched = refine.refine(built, costs, sweeps=4)
      seconds = time.perf_counter() - start
      before, after = built.simulate(costs), searched.simulate(costs)
      slots = lambda t: int(t.awaiting_weight().max())
      lines.append(
          f"| {label} | {name} | {m} | {ratio(before, plain)} | {ratio(after, plain)} | "
          f"{before.neighbour / reference:.3f} | {after.neighbour / reference:.3f} | "
          f"{int(built.peak_in_flight().max())} / {int(searched.peak_in_flight().max())} | "
          f"{slots(built)} / {slots(searched)} | {seconds:.0f} |")
  return lines


def chain_by_kind(table, costs) -> str:
  """The critical chain's time in forwards, backwards (``B`` or ``BI``) and ``W``, each over a
  stage's own time in them (every stage runs each action once per micro-batch chunk)."""
  chain = set(table.critical_path(costs))
  spent = {"F": 0.0, "B": 0.0, "W": 0.0}
  for t, s, kind, _, _ in table.actions():
    if (t, s) in chain:
      spent["B" if kind in ("B", "BI") else kind] += costs[kind]
  per_stage = table.num_microbatches * table.num_chunks
  own = {"F": costs["F"], "B": costs.get("BI", costs.get("B")), "W": costs.get("W", 0.0)}
  return " / ".join(f"{spent[k] / (per_stage * own[k]):.2f}" if own[k] else "-"
                    for k in ("F", "B", "W"))


def save_pictures(out_dir: str, costs: dict) -> list[str]:
  """ZB-V at S = 4, M = 8 drawn in neighbour-synchronised time under ``costs`` (in units of one
  forward): one action per tick, and in compound ticks; returns the files' names."""
  from tpipe.tools import timeline  # pylint: disable=g-import-not-at-top

  costs = {name: value / costs["F"] for name, value in costs.items()}
  names = []
  for tag, table in (("one_action", tpipe.schedules.build("zbv", 4, 8, 2)),
                     ("compound", tpipe.schedules.build("zbv", 4, 8, 2, costs=costs))):
    name = f"fused_timeline_zbv_{tag}.png"
    timeline.save_timeline(table, os.path.join(out_dir, name), costs=costs)
    names.append(name)
  return names


def main(argv=None) -> None:
  run = _common.start("fused_schedules", __doc__, smoke="a tiny version (S = 2)", argv=argv)
  if run.smoke:
    sizes = SMOKE_MICROBATCH
    flops_lines, measured = flops_table(2, 2, (2,), sizes)
    lines = memory_table(2, 2, (2,), sizes, measured) + [""] + flops_lines
  else:
    sizes = MICROBATCH
    flops_lines, measured = flops_table(8, 32, (8, 32), sizes)
    lines = memory_table(4, 16, (8, 64), sizes, measured) + [""] + flops_lines
    costs = next(c for name, _, m, c in measured if name == "zbv")
    pictures = save_pictures(os.path.dirname(os.path.abspath(run.args.out)), costs)
    lines += ["", "ZB-V (S = 4, M = 8) in neighbour-synchronised time under its measured costs, "
              "one action per tick and in compound ticks:", ""]
    lines += [f"![{name}]({name})" for name in pictures]
  run.write("Fused schedules: memory in M, FLOPs per action, bubbles", lines,
            "Compile only: every number is read from an ahead-of-time compile.")


if __name__ == "__main__":
  main()
