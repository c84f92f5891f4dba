r"""Searches stages, micro-batches, schedule, remat and its granularity for the fastest
configuration that fits in memory.

Usage::

  python -m tpipe.train.autotune --config=configs/lm.py --budget_gib=2
  python -m tpipe.train.autotune --config=configs/lm.py:size=tiny --budget_gib=0.002 \
      --microbatches=2,4,8 --remats=none,full --remat_granularities=chunk,layer \
      --schedules=gpipe,1f1b
  # Which axis should cross the slices of a multislice job (tpipe.train.multislice):
  python -m tpipe.train.autotune --config=configs/lm.py:size=tiny --config.num_data=2 \
      --config.mesh.fsdp=2 --config.num_stages=2 --dcn_slices=2

For every candidate (``num_stages`` dividing the device count and the layer count, ``num_data``
the remaining devices, ``num_microbatches`` dividing the per-replica batch, ``schedule`` among
the forward schedules and the fused ones :class:`tpipe.Sequential` runs whose table exists for
the config's ``num_repeats``, ``remat`` in none/dots/full, ``remat_granularity`` in chunk/layer
or ints for ``remat`` dots and full; with ``"none"`` nothing is recomputed, so only ``"chunk"``
is tried) the real training step is compiled ahead of time (never run) and measured with
:mod:`tpipe.tools.analysis`. A candidate fits when its peak per-device memory (largest device) is at
most the budget. Among those that fit, the one with the least predicted step time wins.

Cost model (:class:`CostModel`), per device and per step::

  time = executed_flops / flops_per_second
       + sum over collectives (bytes / bytes_per_second + executions * latency_seconds)

Executed FLOPs count every tick the device runs, bubbles and rematerialisation included, so the
model charges a bubble (fewer useful ticks per executed tick) and recomputation directly. The
schedule enters both sides through the compiled program: a fused schedule (1F1B, ...) stashes at
most its table's peak in flight (``min(S, M)`` stage inputs for 1F1B) instead of GPipe's one per
forward tick, which the measured memory shows, and runs its table's ticks, each counted at its
costliest action (the SPMD lockstep), which the FLOPs show. A stage of the tick loop need not
wait for the slowest stage every tick, only for the neighbours it exchanges sends with, so the
compute term is the table's neighbour-synchronised time (:mod:`tpipe.schedules.simulate`, a
model of that constraint): for a fused table (1F1B, ...; GPipe and circular under remat full)
the table simulated with the compiled program's FLOPs per action, plus its FLOPs outside the
actions; for a forward schedule differentiated through its tick loop, the executed FLOPs times
neighbour / lockstep time under the default costs (1 for GPipe and circular, whose ticks are all
forwards or all backwards). Each trial carries the table's neighbour-synchronised bubble under
the default costs, comparable across trials. The
defaults describe one TPU v4 chip (about 275 TFLOP/s bf16 peak, taken at 40% utilisation, and
45 GB/s per ICI link); only the ratios matter for the ranking.

Pruning, so the search compiles few programs: for a fixed (stages, micro-batches, schedule) the
remat policies are tried from cheapest in FLOPs to most memory-saving (none, dots, full), each
with its granularities in the order given (``chunk`` then ``layer`` by default: the same
recompute FLOPs, usually a lower backward peak), and the first that fits ends that group; the
others are reported as dominated. Every skipped or failed candidate
appears in the result with its reason.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from absl import app
from absl import flags
from ml_collections import config_flags

from tpipe import schedules
from tpipe import spec as spec_lib
from tpipe.tools import analysis
from tpipe.tools import flops as flops_lib
from tpipe.train import cli

REMAT_ORDER = ("none", "dots", "full")
GRANULARITY_ORDER = ("chunk", "layer")


def schedule_names() -> tuple[str, ...]:
  """Every schedule the search may try: the forward ones and the fused ones."""
  return schedules.NAMES


def schedule_table(name: str, num_stages: int, num_microbatches: int, num_repeats: int):
  """The table of schedule ``name`` (forward or fused); ValueError when it does not exist for
  these sizes (e.g. ``"1f1b"`` with ``num_repeats=2``)."""
  if name == "circular" and num_repeats == 1:
    raise ValueError("circular with num_repeats=1 is gpipe")
  return schedules.build(name, num_stages, num_microbatches, num_repeats)


@dataclasses.dataclass(frozen=True)
class CostModel:
  """A simple per-device step-time model (see the module docstring).

  Attributes:
    flops_per_second: sustained FLOP/s of one device.
    bytes_per_second: bytes/s one collective moves per device.
    latency_seconds: fixed cost of each collective execution.
  """

  flops_per_second: float = 0.4 * 275e12
  bytes_per_second: float = 45e9
  latency_seconds: float = 10e-6

  def step_time(self, flops: float, collectives: Sequence[analysis.Collective]) -> float:
    """Predicted seconds per step for executed ``flops`` and the step's collectives."""
    comm = sum(c.total_bytes / self.bytes_per_second + c.count * self.latency_seconds
               for c in collectives)
    return flops / self.flops_per_second + comm


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One point of the search space."""

  num_stages: int
  num_data: int
  num_microbatches: int
  remat: str
  schedule: str = "gpipe"
  remat_granularity: str | int = "chunk"

  def overrides(self) -> str:
    """The ``--config.*`` flags that select this candidate."""
    return (f"--config.num_stages={self.num_stages} --config.num_data={self.num_data} "
            f"--config.num_microbatches={self.num_microbatches} --config.remat={self.remat} "
            f"--config.schedule={self.schedule} "
            f"--config.remat_granularity={self.remat_granularity}")


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
    simulated_bubble: the schedule table's neighbour-synchronised bubble (see
      :func:`tpipe.tools.flops.simulated_bubble`).
    collective_bytes: bytes moved by collectives per device per step.
    predicted_seconds: the cost model's step time.
    compile_seconds: lowering plus compile time.
    fits: whether ``memory_bytes <= budget``.
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


@dataclasses.dataclass(frozen=True)
class TuneResult:
  """The auto-tuner's answer.

  Attributes:
    best: the fitting trial with the least predicted step time, or None if nothing fits.
    config: the base config with ``best``'s fields applied (None if nothing fits).
    trials: every compiled candidate.
    rejected: ``(candidate, reason)`` for every candidate not chosen.
    budget_bytes: the per-device budget searched against.
  """

  best: Trial | None
  config: Any
  trials: tuple[Trial, ...]
  rejected: tuple[tuple[Candidate, str], ...]
  budget_bytes: int


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def candidates(config, num_devices: int, *, stages: Sequence[int] | None = None,
               microbatches: Sequence[int] | None = None,
               remats: Sequence[str] = REMAT_ORDER,
               granularities: Sequence[str | int] = GRANULARITY_ORDER,
               schedules: Sequence[str] | None = None
               ) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
  """The search space for ``config`` on ``num_devices`` devices, and the invalid points.

  Args:
    config: the base experiment config.
    num_devices: devices to use: ``num_stages * num_data``.
    stages: stage counts to try (default: divisors of ``num_devices``).
    microbatches: micro-batch counts to try (default: divisors of the per-replica batch up to
      ``4 * num_stages``).
    remats: remat policies to try, cheapest in FLOPs first.
    granularities: ``remat_granularity`` values to try with ``"dots"`` and ``"full"``, in this
      order (``"none"`` recomputes nothing and is tried with ``"chunk"`` only).
    schedules: schedules to try (default :func:`schedule_names`: forward and fused); a schedule
      without a table for the config's ``num_repeats`` and a candidate's sizes is invalid.

  Returns:
    ``(valid candidates, [(invalid candidate, reason)])``.
  """
  for r in remats:
    if r not in REMAT_ORDER:
      raise ValueError(f"Unknown remat {r!r} in remats; choose from {REMAT_ORDER}.")
  remats = sorted(set(remats), key=REMAT_ORDER.index)
  if isinstance(granularities, (str, int)) or not granularities:
    raise ValueError(f"granularities must be a non-empty list of remat_granularity values, got "
                     f"{granularities!r}.")
  for g in granularities:
    spec_lib.check_remat_granularity(g)  # Raises, naming the choices.
  granularities = list(dict.fromkeys(granularities))
  known = schedule_names()
  schedules = list(dict.fromkeys(schedules if schedules is not None else known))
  for name in schedules:
    if name not in known:
      raise ValueError(f"Unknown schedule {name!r} in schedules; choose from {known}.")
  stage_options = list(stages) if stages is not None else _divisors(num_devices)
  valid, invalid = [], []
  repeats = int(config.num_repeats)
  for s in stage_options:
    if s < 1 or num_devices % s:
      invalid.append((Candidate(s, 0, 0, "-", "-"), f"{s} stages do not divide {num_devices} "
                      "devices"))
      continue
    data = num_devices // s
    if config.num_layers % (s * repeats):
      invalid.append((Candidate(s, data, 0, "-", "-"), f"num_layers={config.num_layers} is not "
                      f"divisible by stages*repeats={s * repeats}"))
      continue
    if config.batch_size % data:
      invalid.append((Candidate(s, data, 0, "-", "-"), f"batch_size={config.batch_size} is not "
                      f"divisible by num_data={data}"))
      continue
    per_replica = config.batch_size // data
    m_options = (list(microbatches) if microbatches is not None
                 else [m for m in _divisors(per_replica) if m <= 4 * s])
    for m in m_options:
      if m < 1 or per_replica % m:
        invalid.append((Candidate(s, data, m, "-", "-"), f"per-replica batch {per_replica} is not "
                        f"divisible by {m} micro-batches"))
        continue
      for name in schedules:
        try:
          schedule_table(name, s, m, repeats)
        except ValueError as e:
          invalid.append((Candidate(s, data, m, "-", name), f"schedule={name!r}: {e}"))
          continue
        for r in remats:
          for g in (["chunk"] if r == "none" else granularities):
            valid.append(Candidate(s, data, m, r, name, g))
  return valid, invalid


def _apply(config, candidate: Candidate):
  new = config.copy_and_resolve_references()
  with new.unlocked():
    new.num_stages = candidate.num_stages
    new.num_data = candidate.num_data
    new.num_microbatches = candidate.num_microbatches
    new.remat = candidate.remat
    # A string, as the flag gives it (the config field is a string; "2" is read as 2).
    new.remat_granularity = str(candidate.remat_granularity)
    new.schedule = candidate.schedule
    if not schedules.is_fused(candidate.schedule) and new.get("tick_costs"):
      new.tick_costs = ""  # Compound ticks lay out fused tables; forward tables have none.
      if new.get("tick_search"):
        new.tick_search = 0  # Nor a search over them.
  return new


def measure(config, candidate: Candidate, budget_bytes: int,
            cost_model: CostModel = CostModel()) -> Trial:
  """Compiles ``config`` with ``candidate`` applied and measures it against the budget."""
  from tpipe.train import report as report_lib  # pylint: disable=g-import-not-at-top

  # The step's memory, FLOPs and collectives; the per-stage floor is not needed here.
  rep = report_lib.analyze_config(_apply(config, candidate), per_stage=False)
  a = rep.analysis
  memory = rep.largest_device_bytes
  compute = flops_lib.step_flops(rep.schedule, a.pipeline, a.flops.executed)
  return Trial(
      candidate=candidate, memory_bytes=memory, executed_flops=a.flops.executed,
      useful_fraction=a.pipeline.lockstep_efficiency if a.pipeline else 1.0,
      collective_bytes=sum(c.total_bytes for c in a.collectives),
      predicted_seconds=cost_model.step_time(compute, a.collectives),
      compile_seconds=rep.lower_seconds + rep.compile_seconds,
      fits=memory <= budget_bytes, simulated_bubble=flops_lib.simulated_bubble(rep.schedule))


def autotune(config, budget_bytes: int, *, num_devices: int | None = None,
             stages: Sequence[int] | None = None, microbatches: Sequence[int] | None = None,
             remats: Sequence[str] = REMAT_ORDER,
             granularities: Sequence[str | int] = GRANULARITY_ORDER,
             schedules: Sequence[str] | None = None,
             cost_model: CostModel = CostModel(),
             verbose: bool = False) -> TuneResult:
  """Finds the configuration with the least predicted step time that fits ``budget_bytes``.

  Args:
    config: the base experiment config (``configs/lm.py``); its repeats, model and batch are
      kept; stages, data replicas, micro-batches, schedule, remat and its granularity are
      searched.
    budget_bytes: per-device memory budget in bytes (peak of the fullest device).
    num_devices: devices to use (default ``config.num_stages * config.num_data``).
    stages, microbatches, remats, granularities, schedules: restrict the search (see
      :func:`candidates`).
    cost_model: the step-time model.
    verbose: print each trial as it is measured.

  Returns:
    A :class:`TuneResult`; ``best`` is None when nothing fits.
  """
  if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)):
    raise TypeError(f"budget_bytes must be a number of bytes, got {budget_bytes!r}.")
  if budget_bytes <= 0:
    raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}.")
  num_devices = num_devices or int(config.num_stages) * int(config.num_data)
  valid, rejected = candidates(config, num_devices, stages=stages, microbatches=microbatches,
                               remats=remats, granularities=granularities,
                               schedules=schedules)
  trials: list[Trial] = []
  fitted_groups: dict[tuple[int, int, str], Candidate] = {}
  for cand in valid:
    group = (cand.num_stages, cand.num_microbatches, cand.schedule)
    if group in fitted_groups:
      fitted = fitted_groups[group]
      rejected.append((cand, f"dominated: remat={fitted.remat} remat_granularity="
                       f"{fitted.remat_granularity} already fits with no more FLOPs (not "
                       "compiled)"))
      continue
    start = time.perf_counter()
    try:
      trial = measure(config, cand, int(budget_bytes), cost_model)
    except (ValueError, TypeError) as e:
      rejected.append((cand, f"invalid: {e}"))
      continue
    trials.append(trial)
    if verbose:
      print(f"  {cand.overrides()}: {analysis.format_bytes(trial.memory_bytes)}, "
            f"{trial.predicted_seconds * 1e3:.3f} ms predicted "
            f"({time.perf_counter() - start:.1f} s)", flush=True)
    if trial.fits:
      fitted_groups[group] = cand
    else:
      rejected.append((cand, f"over budget: {analysis.format_bytes(trial.memory_bytes)} > "
                       f"{analysis.format_bytes(budget_bytes)}"))
  fitting = [t for t in trials if t.fits]
  best = min(fitting, key=lambda t: (t.predicted_seconds, t.memory_bytes), default=None)
  for t in fitting:
    if t is not best:
      rejected.append((t.candidate, f"slower: {t.predicted_seconds * 1e3:.3f} ms predicted vs "
                       f"{best.predicted_seconds * 1e3:.3f} ms"))
  return TuneResult(best=best, config=_apply(config, best.candidate) if best else None,
                    trials=tuple(trials), rejected=tuple(rejected),
                    budget_bytes=int(budget_bytes))


def format_result(result: TuneResult) -> str:
  """The trials and the choice as markdown."""
  fb = analysis.format_bytes
  lines = [f"budget per device: {fb(result.budget_bytes)}", "",
           "| stages | data | micro-batches | schedule | remat | granularity | peak memory | "
           "fits | lockstep FLOPs | useful | neighbour-synchronised bubble | collective bytes | "
           "predicted step | compile s |",
           "|---:|---:|---:|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
  for t in result.trials:
    c = t.candidate
    mark = " **(chosen)**" if t is result.best else ""
    lines.append(
        f"| {c.num_stages} | {c.num_data} | {c.num_microbatches} | {c.schedule} | "
        f"{c.remat} | {c.remat_granularity}{mark} | {fb(t.memory_bytes)} | "
        f"{'yes' if t.fits else 'no'} | "
        f"{t.executed_flops:.3g} | {t.useful_fraction:.1%} | {t.simulated_bubble:.1%} | "
        f"{fb(t.collective_bytes)} | "
        f"{t.predicted_seconds * 1e3:.3f} ms | {t.compile_seconds:.1f} |")
  lines += ["", "Rejected:"]
  for cand, reason in result.rejected:
    lines.append(f"- stages={cand.num_stages} data={cand.num_data} "
                 f"M={cand.num_microbatches} schedule={cand.schedule} remat={cand.remat} "
                 f"remat_granularity={cand.remat_granularity}: {reason}")
  lines.append("")
  if result.best is None:
    lines.append("Nothing fits the budget: raise it, shrink the model or the batch, or allow "
                 "more stages / remat=full / remat_granularity=layer.")
  else:
    lines.append(f"Best: {result.best.candidate.overrides()}")
  return "\n".join(lines)


def define_flags() -> None:
  """Defines the command-line flags (only when run as a program, so imports never clash)."""
  config_flags.DEFINE_config_file(
      "config", None, "Experiment config file, e.g. configs/lm.py.", lock_config=False)
  flags.DEFINE_float("budget_gib", None, "Per-device memory budget in GiB.")
  flags.DEFINE_integer("num_devices", None, "Devices (default: the config's mesh).")
  flags.DEFINE_list("stages", None, "Stage counts to try (default: divisors).")
  flags.DEFINE_list("microbatches", None, "Micro-batch counts to try.")
  flags.DEFINE_list("remats", list(REMAT_ORDER), "Remat policies to try.")
  flags.DEFINE_list("remat_granularities", list(GRANULARITY_ORDER),
                    "remat_granularity values to try with remat dots/full: chunk, layer, or an "
                    "int k (layers per checkpoint).")
  flags.DEFINE_list("schedules", None, "Schedules to try (default: the forward ones and every "
                    "fused one tpipe.Sequential runs).")
  flags.DEFINE_integer("dcn_slices", None, "Instead of the search: compare the stage, data and "
                       "fsdp axes over this many slices (DCN) and recommend one "
                       "(tpipe.train.multislice).")
  flags.DEFINE_string("topology", None, "With --dcn_slices: compile for this TPU topology "
                      "(that many slices of it) instead of emulated slices of CPU devices.")
  cli.define_network_flags()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  from tpipe.train import report as report_lib  # pylint: disable=g-import-not-at-top

  config = f.config
  if config is not None and f.dcn_slices:
    from tpipe.train import multislice  # pylint: disable=g-import-not-at-top

    if not f.topology:
      report_lib.setup_cpu_devices(num_devices=f.num_devices or cli.num_devices(config))
    options = multislice.compare(config, f.dcn_slices, topology=f.topology,
                                 network=cli.network_from_flags(f.topology),
                                 efficiency=f.efficiency)
    print(multislice.format_choice(options))
    return
  if config is None or f.budget_gib is None:
    raise app.UsageError("--config and --budget_gib are required (or --config and "
                         "--dcn_slices).")
  num_devices = f.num_devices or cli.num_devices(config)
  report_lib.setup_cpu_devices(num_devices=num_devices)
  result = autotune(
      config, int(f.budget_gib * 2**30), num_devices=num_devices,
      stages=[int(s) for s in f.stages] if f.stages else None,
      microbatches=[int(m) for m in f.microbatches] if f.microbatches else None,
      remats=f.remats,
      granularities=[int(g) if g.isdigit() else g for g in f.remat_granularities],
      schedules=f.schedules, verbose=True)
  print(format_result(result))
  if result.best is None:
    raise SystemExit(1)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
