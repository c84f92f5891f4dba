r"""Searches stages, micro-batches, schedule, remat and its granularity (what a split backward's
``W`` recomputes, and whether micro-batches overlap) for the fastest configuration that fits in
memory: the least step time predicted on a chip, under its HBM.

Usage::

  python -m tpipe.train.cli.autotune --config=configs/lm.py --budget_gib=2
  python -m tpipe.train.cli.autotune --config=configs/lm.py --chip=v5p   # budget: v5p's 95 GiB
  python -m tpipe.train.cli.autotune --config=configs/lm.py:size=tiny --budget_gib=0.002 \
      --microbatches=2,4,8 --remats=none,full --remat_granularities=chunk,layer \
      --schedules=gpipe,1f1b
  # Each candidate compiled by the TPU compiler for a 64-chip v5p slice (the memory and the
  # program priced are the TPU's; stages x data take the devices config.mesh's fsdp x tensor
  # leave, here 64 / (8 x 2) = 4):
  python -m tpipe.train.cli.autotune --config=configs/lm.py --config.mesh.fsdp=8 \
      --config.mesh.tensor=2 --config.num_stages=4 --topology=v5p:4x4x4 --stages=4
  # Which axis should cross the slices of a multislice job (tpipe.train.cli.multislice):
  python -m tpipe.train.cli.autotune --config=configs/lm.py:size=tiny --config.num_data=2 \
      --config.mesh.fsdp=2 --config.num_stages=2 --dcn_slices=2

For every candidate (``num_stages`` dividing the device count and the layer count,
``num_data`` the remaining devices, ``num_microbatches`` dividing the per-replica batch, every
schedule, forward and fused, each with the ``num_repeats`` it takes (1; 2 for ZB-V; for
circular and interleaved 1F1B every divisor >= 2 of the layers per stage), ``remat`` in
none/dots/full, ``remat_granularity`` in chunk/layer or ints for ``remat`` dots and full; with
``"none"`` nothing is recomputed, so only ``"chunk"`` is tried; for ZB-H1 and ZB-V
``weight_recompute`` in none/forward/backward, which trades the weight slots' memory for
FLOPs; for a fused schedule in compound ticks where a stage's replica spans several devices
(``config.mesh``'s fsdp x expert x tensor), ``overlap_microbatches`` off and on, which trades
memory for collectives hidden behind the other micro-batch's compute (the experts' all-to-all);
the space and the analytic costs are :mod:`tpipe.train.cli.search_space`) the real
training step can be compiled ahead of time (never run) and measured with
:mod:`tpipe.tools.analysis`. A candidate fits when its peak per-device memory (largest device)
is at most the budget. Among those that fit, the one with
the least predicted step time wins.

Before anything compiles the search prints its plan: the candidates, how many compiles it
expects and about how long they take. Each compile prints its measurements, the time left and
the best so far. Ctrl-C stops the search cleanly: the best so far and the command that trains
with it are printed. Compiled programs go to JAX's persistent compilation cache
(``--cache_dir``), and a config already measured in the process is not compiled again.

The predicted step time is the report's (:func:`tpipe.train.cli.config_costs.predict`): the
compiled program priced on a chip (``--chip``, v5p by default; :mod:`tpipe.tools.chips`) by
:mod:`tpipe.tools.step_time`, every instruction at the roofline of the chip's peak FLOP/s and HBM
bandwidth, every collective at its links' bandwidth and latency, loops counted as often as they
run; a fused table (1F1B, ...) is followed tick by tick with each action's branch priced
(:mod:`tpipe.tools.pipeline_time`), so its bubble is the neighbour-synchronised one, and a
forward table's bubble is its simulated share. Each trial also carries the predicted MFU
(model FLOPs: 6 x parameters x tokens plus attention, over the chip's peak) and its peak memory.
The budget is the chip's HBM (``--budget_gib`` to set another), so by default the search picks
the fastest setting that fits the device.

Pruning, so the search compiles few programs (every skipped or failed candidate appears in the
result with its reason):

* order: candidates go fastest analytic step first
  (:func:`~tpipe.train.cli.search_space.analytic_step`: the step of the table the trainer
  runs, a fused schedule's compound ticks approached by its dependency-driven step, under the
  costs its remat gives, bubble and recomputation charged, no compile), so a good fitting
  trial comes early;
* dominated: for a fixed (stages, micro-batches, schedule, repeats) the recomputation settings
  (remat, its granularity, ``weight_recompute``) are tried least FLOPs first (none, dots, full;
  ties in the order given), and the first that fits ends that group;
* analytic bubble: once a trial fits, a candidate on the same mesh (stages x replicas) is
  compiled only if its analytic step is shorter, and on another mesh only within
  :data:`PRUNE_RATIO` of the fitting trial's;
* analytic memory: once the parameter count is known, a candidate whose lower bound
  (:func:`~tpipe.train.cli.search_space.analytic_memory`: a stage's parameters, gradients and
  optimizer state, and its stashed inputs) exceeds the budget is not compiled;
* micro-batches overlapped: what they save is collective time the analytic step does not
  price, and they hold more memory than lanes apart, so an overlapped candidate is compiled
  once its point (stages, micro-batches, schedule, repeats) with lanes apart has a fitting
  trial, unless the same setting with lanes apart was over budget (the analytic bubble prunes
  neither), and the compiled steps decide.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Sequence

from absl import app
import jax
from absl import flags
from ml_collections import config_flags

from tpipe import schedules
from tpipe.experimental import links
from tpipe.tools import analysis
from tpipe.tools import chips
from tpipe.tools import flops as flops_lib
from tpipe.train.cli import startup
from tpipe.train.cli.search_space import analytic_memory
from tpipe.train.cli.search_space import analytic_step
from tpipe.train.cli.search_space import Candidate
from tpipe.train.cli.search_space import candidates
from tpipe.train.cli.search_space import GRANULARITY_ORDER
from tpipe.train.cli.search_space import REMAT_ORDER
from tpipe.train.cli.search_space import WEIGHT_RECOMPUTE_ORDER

# The chip a step time is predicted on unless told otherwise (tpipe.tools.chips).
DEFAULT_CHIP = "v5p"
# A candidate is compiled only while its analytic step (see analytic_step) is within this
# factor of the fastest fitting trial's: a larger bubble or more recomputation than that is
# not made up by anything the compile measures.
PRUNE_RATIO = 1.15
# On the mesh of a fitting trial (same stages and replicas: about the same communication), a
# candidate is compiled only when its analytic step is shorter by more than this share.
SAME_MESH_MARGIN = 0.01
# Seconds one compile is taken to last before any has been measured (this 2-core machine, the
# LM config: 5 to 30 s).
PRIOR_COMPILE_SECONDS = 15.0


@dataclasses.dataclass(frozen=True)
class Trial:
  """A compiled candidate and its measurements.

  Attributes:
    candidate: the candidate.
    memory_bytes: peak bytes on the fullest device.
    executed_flops: lockstep FLOPs per device per step (every tick counted as busy, at its
      costliest branch; the prediction takes the neighbour-synchronised time instead,
      :func:`tpipe.tools.flops.step_flops`).
    useful_fraction: useful / lockstep FLOPs, the share of the step's time doing useful work.
    collective_bytes: bytes moved by collectives per device per step.
    predicted_seconds: the step time predicted on the chip (see the module docstring).
    compile_seconds: lowering plus compile time.
    fits: whether ``memory_bytes <= budget``.
    simulated_bubble: the schedule table's neighbour-synchronised bubble (see
      :func:`tpipe.tools.flops.simulated_bubble`).
    num_params: the model's parameters (for the analytic memory estimate of later candidates).
    predicted_mfu: model FLOPs per device per second over the chip's peak at the predicted step
      time (None where the model's FLOPs are unknown).
  """

  candidate: Candidate
  memory_bytes: int
  executed_flops: float
  useful_fraction: float
  collective_bytes: int
  predicted_seconds: float
  compile_seconds: float
  fits: bool
  simulated_bubble: float = 0.0
  num_params: int = 0
  predicted_mfu: float | None = None


@dataclasses.dataclass(frozen=True)
class TuneResult:
  """The auto-tuner's answer.

  Attributes:
    best: the fitting trial with the least predicted step time, or None if nothing fits.
    config: the base config with ``best``'s fields applied (None if nothing fits).
    trials: every compiled candidate.
    rejected: ``(candidate, reason)`` for every candidate not chosen.
    budget_bytes: the per-device budget searched against.
    interrupted: whether the search was stopped (Ctrl-C) before it tried every candidate.
    chip: the chip the step times are predicted on.
  """

  best: Trial | None
  config: Any
  trials: tuple[Trial, ...]
  rejected: tuple[tuple[Candidate, str], ...]
  budget_bytes: int
  interrupted: bool = False
  chip: str = DEFAULT_CHIP


def _apply(config, candidate: Candidate):
  new = config.copy_and_resolve_references()
  with new.unlocked():
    new.num_stages = candidate.num_stages
    new.num_data = candidate.num_data
    new.num_microbatches = candidate.num_microbatches
    new.num_repeats = candidate.num_repeats
    new.remat = candidate.remat
    # A string, as the flag gives it (the config field is a string; "2" is read as 2).
    new.remat_granularity = str(candidate.remat_granularity)
    new.schedule = candidate.schedule
    new.weight_recompute = candidate.weight_recompute  # "none" wherever the backward is whole.
    if candidate.overlap_microbatches or "overlap_microbatches" in new:
      new.overlap_microbatches = candidate.overlap_microbatches
    if not schedules.is_fused(candidate.schedule) and new.get("tick_costs"):
      new.tick_costs = ""  # Compound ticks lay out fused tables; forward tables have none.
      if new.get("tick_search"):
        new.tick_search = 0  # Nor a search over them.
  return new


# Trials already compiled in this process, by the config they compiled (the same program is
# never compiled twice: a repeated search, or two candidates that resolve to one config).
_TRIALS: dict[tuple[str, int, Any, Any], Trial] = {}


def measure(config, candidate: Candidate, budget_bytes: int, chip: str = DEFAULT_CHIP,
            topology: str | None = None) -> Trial:
  """Compiles ``config`` with ``candidate`` applied, measures it against the budget and
  predicts its step time on ``chip`` (a name of :data:`tpipe.tools.chips.CHIPS`); a config
  already compiled in this process is not compiled again. ``topology`` (``"v5p:4x4x4"``):
  compile for that TPU slice's devices with the TPU compiler (:func:`tpipe.topology_devices`)
  instead of this machine's, so the memory and the program priced are the TPU's."""
  from tpipe.train.cli import config_costs  # pylint: disable=g-import-not-at-top

  applied = _apply(config, candidate)
  key = (applied.to_json(), int(budget_bytes), chip, topology)
  if key in _TRIALS:
    return dataclasses.replace(_TRIALS[key], candidate=candidate)
  # The step's memory, FLOPs and collectives; the per-stage floor is not needed here.
  rep = config_costs.analyze_config(applied, per_stage=False, network=links.interconnect(chip),
                                    topology=topology)
  a = rep.analysis
  memory = rep.largest_device_bytes
  trial = Trial(
      candidate=candidate, memory_bytes=memory, executed_flops=a.flops.executed,
      useful_fraction=a.pipeline.lockstep_efficiency if a.pipeline else 1.0,
      collective_bytes=sum(c.total_bytes for c in a.collectives),
      predicted_seconds=rep.prediction.seconds,
      compile_seconds=rep.lower_seconds + rep.compile_seconds,
      fits=memory <= budget_bytes, simulated_bubble=flops_lib.simulated_bubble(rep.schedule),
      num_params=rep.num_params, predicted_mfu=rep.prediction.mfu)
  _TRIALS[key] = trial
  return trial


@dataclasses.dataclass
class _Search:
  """The state of one search as it goes: what was compiled, what was rejected and why."""

  config: Any
  budget_bytes: int
  chip: str
  out: Callable[[str], None]
  trials: list = dataclasses.field(default_factory=list)
  rejected: list = dataclasses.field(default_factory=list)
  fitted: dict = dataclasses.field(default_factory=dict)  # group -> the candidate that fits.
  steps: dict = dataclasses.field(default_factory=dict)  # candidate -> analytic step.
  num_params: int = 0
  compile_seconds: list = dataclasses.field(default_factory=list)
  config_path: str = "CONFIG"
  topology: str | None = None

  @property
  def best(self) -> Trial | None:
    fitting = [t for t in self.trials if t.fits]
    return min(fitting, key=lambda t: (t.predicted_seconds, t.memory_bytes), default=None)

  def skip_reason(self, cand: Candidate) -> str | None:
    """Why ``cand`` is not compiled (dominated or pruned), or None to compile it."""
    fitted = self.fitted.get(cand.group)
    if fitted is not None:
      return (f"dominated: remat={fitted.remat} remat_granularity={fitted.remat_granularity} "
              "already fits with no more FLOPs (not compiled)")
    if self.num_params:
      memory = analytic_memory(self.config, cand, self.num_params)
      if memory > self.budget_bytes:
        return (f"pruned: analytic memory {analysis.format_bytes(memory)} (parameters, "
                f"gradients, optimizer state and stashed inputs alone) > budget (not compiled)")
    if cand.overlap_microbatches:
      apart = next((t for t in self.trials if t.candidate == cand.lanes_apart), None)
      if apart is not None and not apart.fits:
        return ("pruned: the same setting with lanes apart is over budget, and overlapped "
                "micro-batches hold more (not compiled)")
      if cand.lanes_apart.group not in self.fitted:
        return ("pruned: micro-batches overlapped are compiled only once the same point with "
                "lanes apart fits (not compiled)")
      return None  # The collectives it hides are not in the analytic step: compile both.
    fitting = [t.candidate for t in self.trials if t.fits]
    mesh = (cand.num_stages, cand.num_data)
    alike = min((self.steps[c] for c in fitting if (c.num_stages, c.num_data) == mesh),
                default=None)
    if alike is not None and self.steps[cand] >= alike * (1 - SAME_MESH_MARGIN):
      return (f"pruned: analytic step {self.steps[cand] / alike:.2f}x a fitting trial's on the "
              f"same {cand.num_stages} stages x {cand.num_data} replicas (not compiled)")
    fastest = min((self.steps[c] for c in fitting), default=None)
    if fastest is not None and self.steps[cand] > PRUNE_RATIO * fastest:
      return (f"pruned: analytic step {self.steps[cand] / fastest:.2f}x a fitting trial's "
              f"(bubble and recomputation; limit {PRUNE_RATIO}x; not compiled)")
    return None

  def record(self, cand: Candidate, trial: Trial) -> None:
    self.trials.append(trial)
    self.compile_seconds.append(trial.compile_seconds)
    self.num_params = self.num_params or trial.num_params
    if trial.fits:
      self.fitted[cand.group] = cand
    else:
      self.rejected.append((cand, f"over budget: {analysis.format_bytes(trial.memory_bytes)} > "
                            f"{analysis.format_bytes(self.budget_bytes)}"))

  def seconds_per_compile(self) -> float:
    times = self.compile_seconds
    return sum(times) / len(times) if times else PRIOR_COMPILE_SECONDS


def ordered(config, valid: Sequence[Candidate]) -> tuple[list[Candidate], dict]:
  """``valid`` in the order the search compiles them, and each one's :func:`analytic_step`:
  the groups (all but remat) fastest analytic step first, each group's remat policies in the
  order given (cheapest in FLOPs first), so a good fitting trial comes early and prunes."""
  steps = {c: analytic_step(config, c) for c in valid}
  first = {}
  for i, c in enumerate(valid):
    first.setdefault(c.group, (steps[c], i))
  order = sorted(range(len(valid)), key=lambda i: (first[valid[i].group], i))
  return [valid[i] for i in order], steps


def _expected_compiles(search: _Search, queue: Sequence[Candidate]) -> int:
  """How many compiles the search still expects: one per mesh (stages x replicas) with no
  fitting trial yet, where the first candidate tried fits and prunes the rest of its mesh, and
  one more where that mesh tries micro-batches overlapped (compiled beside a fitting trial)."""
  fitted = {(t.candidate.num_stages, t.candidate.num_data) for t in search.trials if t.fits}
  meshes = {(c.num_stages, c.num_data) for c in queue} - fitted
  overlapped = {(c.num_stages, c.num_data) for c in queue if c.overlap_microbatches}
  return len(meshes) + len(meshes & overlapped)


def _progress(search: _Search, done: int, queue: Sequence[Candidate], cand: Candidate,
              trial: Trial) -> str:
  left = _expected_compiles(search, queue[done:]) * search.seconds_per_compile()
  best = search.best
  best_text = (f"best so far {best.predicted_seconds * 1e3:.3f} ms: {best.candidate.overrides()}"
               if best else "nothing fits yet")
  return (f"[{done}/{len(queue)}] {cand.overrides()}: "
          f"{analysis.format_bytes(trial.memory_bytes)}"
          f"{'' if trial.fits else ' (over budget)'}, {trial.predicted_seconds * 1e3:.3f} ms "
          f"predicted, {trial.compile_seconds:.1f} s to compile; about {left / 60:.1f} min left; "
          f"{best_text}")


def command(candidate: Candidate, config_path: str = "CONFIG") -> str:
  """The command that trains with ``candidate``."""
  return f"python -m tpipe.train --config={config_path} {candidate.overrides()}"


def plan_text(num_candidates: int, num_invalid: int, expected: int,
              seconds: float = PRIOR_COMPILE_SECONDS) -> str:
  """What the search will do, printed before it starts: the candidates, the compiles expected
  (one per mesh when its first candidate fits) and the time they take."""
  return (f"autotune: {num_candidates} candidates ({num_invalid} invalid points left out), "
          f"fastest analytic step first; each compiled unless one before it dominates it or "
          f"analytic memory or bubble prunes it: about {expected} compiles of about "
          f"{seconds:.0f} s, {expected * seconds / 60:.1f} min (at most {num_candidates}, where "
          "candidates do not fit). Ctrl-C stops it and prints the best so far.")


def autotune(config, budget_bytes: int | None = None, *, num_devices: int | None = None,
             stages: Sequence[int] | None = None, microbatches: Sequence[int] | None = None,
             remats: Sequence[str] = REMAT_ORDER,
             granularities: Sequence[str | int] = GRANULARITY_ORDER,
             schedules: Sequence[str] | None = None,
             weight_recomputes: Sequence[str] = WEIGHT_RECOMPUTE_ORDER,
             overlaps: Sequence[bool] | None = None, chip: str = DEFAULT_CHIP,
             topology: str | None = None, verbose: bool = False, out: Callable[[str], None] = print,
             config_path: str = "CONFIG") -> TuneResult:
  """Finds the configuration with the least predicted step time that fits ``budget_bytes``.

  Args:
    config: the base experiment config (``configs/lm.py``); its model and batch are kept;
      stages, data replicas, micro-batches, schedule with its repeats, remat and its
      granularity, and a split backward's ``weight_recompute`` are searched.
    budget_bytes: per-device memory budget in bytes (peak of the fullest device); None: the
      chip's HBM.
    num_devices: devices to use (default ``config.num_stages * config.num_data``).
    stages, microbatches, remats, granularities, schedules, weight_recomputes, overlaps:
      restrict the search (see :func:`candidates`).
    chip: the chip the step time is predicted on (:data:`tpipe.tools.chips.CHIPS`).
    topology: compile every candidate for this TPU topology (``"v5p:4x4x4"``) with the TPU
      compiler instead of for this machine's devices (:func:`measure`); None: this machine's
      (emulated CPU devices: XLA:CPU's memory and program, priced on ``chip``).
    verbose: print the plan first (candidates, an estimate of the time), then each trial as it
      is measured with the time left and the best so far.
    out: where ``verbose`` prints (``print``).
    config_path: the config's file, for the command that runs the best so far.

  Returns:
    A :class:`TuneResult`; ``best`` is None when nothing fits. Interrupted (Ctrl-C), the
    result so far, ``interrupted`` set, the candidates not tried rejected as such.
  """
  chip = chips.chip(chip).name  # Raises for an unknown chip, naming the choices.
  links.interconnect(chip)  # The report prices TPU links: raises for another chip, naming them.
  if budget_bytes is None:
    budget_bytes = int(chips.chip(chip).hbm_bytes)
  if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)):
    raise TypeError(f"budget_bytes must be a number of bytes, got {budget_bytes!r}.")
  if budget_bytes <= 0:
    raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}.")
  num_devices = num_devices or int(config.num_stages) * int(config.num_data)
  valid, invalid = candidates(config, num_devices, stages=stages, microbatches=microbatches,
                              remats=remats, granularities=granularities, schedules=schedules,
                              weight_recomputes=weight_recomputes, overlaps=overlaps)
  search = _Search(config, int(budget_bytes), chip, out if verbose else (lambda _: None),
                   config_path=config_path, topology=topology)
  search.rejected.extend(invalid)
  queue, search.steps = ordered(config, valid)
  search.out(plan_text(len(queue), len(invalid), _expected_compiles(search, queue)))
  interrupted = _run(search, queue)
  best = search.best
  for t in search.trials:
    if t.fits and t is not best:
      search.rejected.append((t.candidate, f"slower: {t.predicted_seconds * 1e3:.3f} ms "
                              f"predicted vs {best.predicted_seconds * 1e3:.3f} ms"))
  return TuneResult(best=best, config=_apply(config, best.candidate) if best else None,
                    trials=tuple(search.trials), rejected=tuple(search.rejected),
                    budget_bytes=int(budget_bytes), interrupted=interrupted, chip=chip)


def _run(search: _Search, queue: Sequence[Candidate]) -> bool:
  """Compiles the queue's candidates that nothing rules out; True when interrupted (Ctrl-C:
  the rest rejected as not tried, the best so far printed)."""
  for done, cand in enumerate(queue, start=1):
    reason = search.skip_reason(cand)
    if reason is not None:
      search.rejected.append((cand, reason))
      continue
    try:
      trial = measure(search.config, cand, search.budget_bytes, search.chip,
                      topology=search.topology)
    except (ValueError, TypeError) as e:
      search.rejected.append((cand, f"invalid: {e}"))
      continue
    except jax.errors.JaxRuntimeError as e:
      # The TPU compiler refuses a program beyond the device's HBM: it does not fit.
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      search.rejected.append((cand, "over budget: the compiler ran out of device memory ("
                              f"{str(e).splitlines()[0]})"))
      search.out(f"[{done}/{len(queue)}] {cand.overrides()}: over budget (the compiler ran "
                 "out of device memory)")
      continue
    except KeyboardInterrupt:
      search.rejected.extend((c, "not tried: interrupted") for c in queue[done - 1:])
      best = search.best
      search.out(f"Interrupted after {len(search.trials)} compiles; " + (
          f"best so far ({best.predicted_seconds * 1e3:.3f} ms predicted), run it with:\n  "
          f"{command(best.candidate, search.config_path)}" if best else "nothing fits yet."))
      return True
    search.record(cand, trial)
    search.out(_progress(search, done, queue, cand, trial))
  return False


def format_result(result: TuneResult, config_path: str = "CONFIG") -> str:
  """The trials and the choice as markdown (``config_path``: the config's file, for the
  command that runs the choice)."""
  fb = analysis.format_bytes
  lines = [f"budget per device: {fb(result.budget_bytes)}; step times predicted on {result.chip}",
           "",
           "| stages | data | micro-batches | schedule | repeats | remat | granularity | "
           "weight recompute | overlapped | peak memory | fits | lockstep FLOPs | useful | "
           "neighbour-synchronised bubble | collective bytes | predicted step | predicted MFU | "
           "compile s |",
           "|---:|---:|---:|---|---:|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
  for t in result.trials:
    c = t.candidate
    mark = " **(chosen)**" if t is result.best else ""
    lines.append(
        f"| {c.num_stages} | {c.num_data} | {c.num_microbatches} | {c.schedule} | "
        f"{c.num_repeats} | {c.remat} | {c.remat_granularity} | {c.weight_recompute} | "
        f"{'yes' if c.overlap_microbatches else 'no'}{mark} | "
        f"{fb(t.memory_bytes)} | "
        f"{'yes' if t.fits else 'no'} | "
        f"{t.executed_flops:.3g} | {t.useful_fraction:.1%} | {t.simulated_bubble:.1%} | "
        f"{fb(t.collective_bytes)} | "
        f"{t.predicted_seconds * 1e3:.3f} ms | "
        f"{'-' if t.predicted_mfu is None else f'{t.predicted_mfu:.1%}'} | "
        f"{t.compile_seconds:.1f} |")
  kinds = {}
  for _, reason in result.rejected:
    kind = reason.split(":")[0] if not reason.startswith("schedule=") else "no table"
    kinds[kind] = kinds.get(kind, 0) + 1
  summary = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
  lines += ["", f"Rejected ({summary or 'none'}):"]
  for cand, reason in result.rejected:
    lines.append(f"- stages={cand.num_stages} data={cand.num_data} "
                 f"M={cand.num_microbatches} schedule={cand.schedule} "
                 f"repeats={cand.num_repeats} remat={cand.remat} "
                 f"remat_granularity={cand.remat_granularity} "
                 f"weight_recompute={cand.weight_recompute}"
                 f"{' overlap_microbatches=true' if cand.overlap_microbatches else ''}: {reason}")
  lines.append("")
  if result.best is None:
    lines.append("Nothing fits the budget: raise it, shrink the model or the batch, or allow "
                 "more stages / remat=full / remat_granularity=layer.")
  else:
    lines.append(f"Best{' so far (interrupted)' if result.interrupted else ''}: "
                 f"{result.best.candidate.overrides()}")
    lines.append(f"Run it: {command(result.best.candidate, config_path)}")
  return "\n".join(lines)


def define_flags() -> None:
  """Defines the command-line flags (only when run as a program, so imports never clash)."""
  config_flags.DEFINE_config_file(
      "config", None, "Experiment config file, e.g. configs/lm.py.", lock_config=False)
  flags.DEFINE_float("budget_gib", None, "Per-device memory budget in GiB (default: the HBM of "
                     "--chip).")
  flags.DEFINE_integer("num_devices", None, "Devices, all mesh axes together (default: the "
                       "config's mesh); the search splits them over stages x data, each "
                       "holding config.mesh's fsdp x expert x tensor devices.")
  flags.DEFINE_list("stages", None, "Stage counts to try (default: divisors).")
  flags.DEFINE_list("microbatches", None, "Micro-batch counts to try.")
  flags.DEFINE_list("remats", list(REMAT_ORDER), "Remat policies to try.")
  flags.DEFINE_list("remat_granularities", list(GRANULARITY_ORDER),
                    "remat_granularity values to try with remat dots/full: chunk, layer, or an "
                    "int k (layers per checkpoint).")
  flags.DEFINE_list("schedules", None, "Schedules to try (default: the forward ones and every "
                    "fused one tpipe.Sequential runs).")
  flags.DEFINE_list("weight_recomputes", list(WEIGHT_RECOMPUTE_ORDER), "weight_recompute values "
                    "to try with the split-backward schedules (zb_h1, zbv): none, forward, "
                    "backward.")
  flags.DEFINE_list("overlaps", None, "overlap_microbatches values to try with the fused "
                    "schedules in compound ticks: false, true (default: both where config.mesh "
                    "spans a stage's replica over several devices, else false).")
  flags.DEFINE_integer("dcn_slices", None, "Instead of the search: compare the stage, data and "
                       "fsdp axes over this many slices (DCN) and recommend one "
                       "(tpipe.train.cli.multislice).")
  flags.DEFINE_string("topology", None, "Compile every candidate for this TPU topology with the "
                      "TPU compiler (e.g. v5p:4x4x4; --chip defaults to its chip); with "
                      "--dcn_slices: compile for this TPU topology "
                      "(that many slices of it) instead of emulated slices of CPU devices.")
  flags.DEFINE_string("cache_dir", os.path.join(os.path.expanduser("~"), ".cache", "tpipe",
                                                "autotune"),
                      "JAX's persistent compilation cache, so a program compiled by an earlier "
                      "search is not compiled again ('' for none).")
  startup.define_network_flags()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  from tpipe.train.cli import config_costs  # pylint: disable=g-import-not-at-top

  config = f.config
  if config is not None and f.dcn_slices:
    from tpipe.train.cli import multislice  # pylint: disable=g-import-not-at-top

    if not f.topology:
      config_costs.setup_cpu_devices(num_devices=f.num_devices or startup.num_devices(config))
    options = multislice.compare(config, f.dcn_slices, topology=f.topology,
                                 network=startup.network_from_flags(f.topology),
                                 efficiency=f.efficiency)
    print(multislice.format_choice(options))
    return
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/lm.py:size=tiny.")
  num_devices = f.num_devices or startup.num_devices(config)
  config_costs.setup_cpu_devices(num_devices=num_devices)
  if f.cache_dir:
    import jax  # pylint: disable=g-import-not-at-top

    jax.config.update("jax_compilation_cache_dir", f.cache_dir)
  config_path = config_flags.get_config_filename(f["config"])
  try:
    result = _search_from_flags(f, config, num_devices, config_path)
  except KeyboardInterrupt:  # Before the first compile: nothing to report.
    print("Interrupted before any candidate was compiled.")
    raise SystemExit(130) from None
  print(format_result(result, config_path))
  if result.interrupted:
    raise SystemExit(130)
  if result.best is None:
    raise SystemExit(1)


def _search_from_flags(f, config, num_devices: int, config_path: str) -> TuneResult:
  # The search places stages x data replicas; each replica of a stage spans config.mesh's
  # fsdp x expert x tensor devices.
  per_replica = math.prod(startup.mesh_sizes(config).values())
  if num_devices % per_replica:
    raise app.UsageError(f"--num_devices={num_devices} is not divisible by config.mesh's "
                         f"fsdp x expert x tensor = {per_replica} devices.")
  chip = f.chip or (f.topology.split(":")[0] if f.topology else DEFAULT_CHIP)
  return autotune(
      config, None if f.budget_gib is None else int(f.budget_gib * 2**30),
      chip=chip, topology=f.topology, num_devices=num_devices // per_replica,
      stages=[int(s) for s in f.stages] if f.stages else None,
      microbatches=[int(m) for m in f.microbatches] if f.microbatches else None,
      remats=f.remats,
      granularities=[int(g) if g.isdigit() else g for g in f.remat_granularities],
      schedules=f.schedules, weight_recomputes=f.weight_recomputes,
      overlaps=None if f.overlaps is None else startup.parse_bools("overlaps", f.overlaps),
      verbose=True,
      config_path=config_path)


if __name__ == "__main__":
  define_flags()
  startup.run(main)
