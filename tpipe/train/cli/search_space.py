"""The auto-tuner's search space: the candidates, the repeats each schedule takes, and what a
candidate costs analytically before anything compiles.

:func:`candidates` lists every point (stages x replicas x micro-batches x schedule with each of
its ``num_repeats`` x remat x granularity, for a split backward x ``weight_recompute``, and for a
fused schedule in compound ticks whose stages span several devices x ``overlap_microbatches``)
with the invalid ones and their reasons;
:func:`analytic_step` and :func:`analytic_memory` are what :mod:`tpipe.train.cli.autotune` orders
and prunes them by. Pure NumPy: nothing here compiles.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

from tpipe import schedules
from tpipe import spec as spec_lib
from tpipe.schedules import derived_costs
from tpipe.train.cli import startup

REMAT_ORDER = ("none", "dots", "full")
GRANULARITY_ORDER = ("chunk", "layer")
# What W computes again in a split backward (ZB-H1, ZB-V): nothing, the chunk's forward, or its
# forward and backward; each saves the weight slots' memory for more FLOPs.
WEIGHT_RECOMPUTE_ORDER = spec_lib.WEIGHT_RECOMPUTE_NAMES
# Schedules that run one chunk per stage, and ZB-V's two; circular and interleaved 1F1B take
# every num_repeats >= 2 that divides the layers per stage.
FIXED_REPEATS = {"gpipe": 1, "1f1b": 1, "zb_h1": 1, "zbv": 2}
# Bytes per parameter a stage holds whatever the schedule: float32 parameters, gradients and
# Adam's two moments (the analytic memory estimate's lower bound).
STATE_BYTES_PER_PARAM = 16


def schedule_names() -> tuple[str, ...]:
  """Every schedule the search may try: the forward ones and the fused ones."""
  return schedules.NAMES


def repeat_options(name: str, layers_per_stage: int) -> list[int]:
  """The ``num_repeats`` values schedule ``name`` is tried with: its own (1, or 2 for ZB-V),
  or for ``"circular"`` and ``"interleaved_1f1b"`` every divisor >= 2 of the layers a stage
  holds. Empty when none fits."""
  if name in FIXED_REPEATS:
    repeats = FIXED_REPEATS[name]
    return [repeats] if layers_per_stage % repeats == 0 else []
  return [r for r in _divisors(layers_per_stage) if r >= 2]


def schedule_table(name: str, num_stages: int, num_microbatches: int, num_repeats: int):
  """The table of schedule ``name`` (forward or fused); ValueError when it does not exist for
  these sizes (e.g. ``"1f1b"`` with ``num_repeats=2``)."""
  if name == "circular" and num_repeats == 1:
    raise ValueError("circular with num_repeats=1 is gpipe")
  return schedules.build(name, num_stages, num_microbatches, num_repeats)


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One point of the search space."""

  num_stages: int
  num_data: int
  num_microbatches: int
  remat: str
  schedule: str = "gpipe"
  remat_granularity: str | int = "chunk"
  num_repeats: int = 1
  weight_recompute: str = "none"
  overlap_microbatches: bool = False

  def overrides(self) -> str:
    """The ``--config.*`` flags that select this candidate (``overlap_microbatches`` only where
    set: configs without micro-batches overlapped have no such field)."""
    return (f"--config.num_stages={self.num_stages} --config.num_data={self.num_data} "
            f"--config.num_microbatches={self.num_microbatches} --config.remat={self.remat} "
            f"--config.schedule={self.schedule} --config.num_repeats={self.num_repeats} "
            f"--config.remat_granularity={self.remat_granularity} "
            f"--config.weight_recompute={self.weight_recompute}"
            + (" --config.overlap_microbatches=true" if self.overlap_microbatches else ""))

  @property
  def group(self) -> tuple:
    """What its recomputation settings are tried over: all but remat, its granularity and
    ``weight_recompute``."""
    return (self.num_stages, self.num_data, self.num_microbatches, self.schedule,
            self.num_repeats, self.overlap_microbatches)

  @property
  def lanes_apart(self) -> Candidate:
    """The same candidate with its micro-batches not overlapped (itself where they are not)."""
    return dataclasses.replace(self, overlap_microbatches=False)


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def _check_options(remats, granularities, names, weight_recomputes, overlaps
                   ) -> tuple[list, list, list, list, list | None]:
  """The search options, checked and deduplicated (remats cheapest in FLOPs first)."""
  if overlaps is not None:
    bools = isinstance(overlaps, (list, tuple)) and all(isinstance(o, bool) for o in overlaps)
    if not bools or not overlaps:
      raise ValueError(f"overlaps must be None (tried where stages span several devices) or a "
                       f"non-empty list of overlap_microbatches values (True, False), got "
                       f"{overlaps!r}.")
    overlaps = list(dict.fromkeys(overlaps))
  if isinstance(weight_recomputes, str) or not weight_recomputes:
    raise ValueError(f"weight_recomputes must be a non-empty list of weight_recompute values "
                     f"{WEIGHT_RECOMPUTE_ORDER}, got {weight_recomputes!r}.")
  for w in weight_recomputes:
    if w not in WEIGHT_RECOMPUTE_ORDER:
      raise ValueError(f"Unknown weight_recompute {w!r} in weight_recomputes; choose from "
                       f"{WEIGHT_RECOMPUTE_ORDER}.")
  for r in remats:
    if r not in REMAT_ORDER:
      raise ValueError(f"Unknown remat {r!r} in remats; choose from {REMAT_ORDER}.")
  remats = sorted(set(remats), key=REMAT_ORDER.index)
  if isinstance(granularities, (str, int)) or not granularities:
    raise ValueError(f"granularities must be a non-empty list of remat_granularity values, got "
                     f"{granularities!r}.")
  for g in granularities:
    spec_lib.check_remat_granularity(g)  # Raises, naming the choices.
  known = schedule_names()
  names = list(dict.fromkeys(names if names is not None else known))
  for name in names:
    if name not in known:
      raise ValueError(f"Unknown schedule {name!r} in schedules; choose from {known}.")
  return (remats, list(dict.fromkeys(granularities)), names,
          list(dict.fromkeys(weight_recomputes)), overlaps)


def overlap_options(config, schedule: str, overlaps: Sequence[bool] | None) -> list[bool]:
  """The ``overlap_microbatches`` values ``schedule`` is tried with: lanes apart (False) alone
  for a forward schedule or one tick per action (``config.tick_costs="plain"``), where no two
  micro-batches share a tick; else ``overlaps``, or where None both, lanes apart first, when a
  stage's replica spans several devices (``config.mesh``'s fsdp x expert x tensor > 1: collectives
  inside a stage, such as the experts' all-to-all, for the other micro-batch's compute to hide),
  lanes apart alone when it does not (nothing to hide, more memory)."""
  plain = startup.parse_tick_costs(config.get("tick_costs", "")) == "plain"
  if not schedules.is_fused(schedule) or plain:
    return [False]
  if overlaps is None:
    return [False, True] if math.prod(startup.mesh_sizes(config).values()) > 1 else [False]
  return list(overlaps)


def recompute_options(schedule: str, remats: Sequence[str], granularities: Sequence[str | int],
                      weight_recomputes: Sequence[str]) -> list[tuple[str, str | int, str]]:
  """The ``(remat, remat_granularity, weight_recompute)`` settings ``schedule`` is tried with,
  least FLOPs per micro-batch first (:func:`recompute_flops`; ties in the order given):
  ``"none"`` recomputes nothing and takes ``"chunk"`` only; ``weight_recompute`` applies to a
  split backward only, every other schedule takes ``"none"``."""
  wrs = weight_recomputes if schedule in spec_lib.SPLIT_BACKWARD else ["none"]
  options = [(remat, g, w) for remat in remats
             for g in (["chunk"] if remat == "none" else granularities) for w in wrs]
  return sorted(options, key=lambda o: recompute_flops(*o))  # Stable: ties keep their order.


def recompute_flops(remat: str, granularity: str | int, weight_recompute: str) -> float:
  """A chunk's ``F`` plus its whole backward (``BI`` + ``W``) under these settings, in forwards
  of the matmul model (:func:`tpipe.schedules.derived_costs.from_flops`)."""
  costs = dict(derived_costs.from_flops(derived_costs.MATMUL_PARTS, remat, granularity,
                                        spec_lib.check_weight_recompute(weight_recompute)))
  return costs["F"] + costs["BI"] + costs["W"]


def candidates(config, num_devices: int, *, stages: Sequence[int] | None = None,
               microbatches: Sequence[int] | None = None,
               remats: Sequence[str] = REMAT_ORDER,
               granularities: Sequence[str | int] = GRANULARITY_ORDER,
               schedules: Sequence[str] | None = None,
               weight_recomputes: Sequence[str] = WEIGHT_RECOMPUTE_ORDER,
               overlaps: Sequence[bool] | None = None
               ) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
  """The search space for ``config`` on ``num_devices`` devices, and the invalid points.

  Args:
    config: the base experiment config.
    num_devices: devices to use: ``num_stages * num_data``.
    stages: stage counts to try (default: divisors of ``num_devices``).
    microbatches: micro-batch counts to try (default: divisors of the per-replica batch up to
      ``4 * num_stages``).
    remats: remat policies to try, cheapest in FLOPs first.
    granularities: ``remat_granularity`` values to try with ``"dots"`` and ``"full"``
      (``"none"`` recomputes nothing and is tried with ``"chunk"`` only).
    schedules: schedules to try (default :func:`schedule_names`: forward and fused), each with
      the ``num_repeats`` it takes (:func:`repeat_options`); a schedule without a table for a
      candidate's sizes is invalid.
    weight_recomputes: ``weight_recompute`` values to try with the split-backward schedules
      (ZB-H1, ZB-V).
    overlaps: ``overlap_microbatches`` values to try with the fused schedules in compound ticks
      (:func:`overlap_options`; None: both where a stage's replica spans several devices).

  Each point's recomputation settings (remat, granularity, ``weight_recompute``) go least FLOPs
  first, ties in the order given (:func:`recompute_options`).

  Returns:
    ``(valid candidates, [(invalid candidate, reason)])``.
  """
  remats, granularities, names, wrs, overlaps = _check_options(
      remats, granularities, schedules, weight_recomputes, overlaps)
  stage_options = list(stages) if stages is not None else _divisors(num_devices)
  valid, invalid = [], []
  for s in stage_options:
    if s < 1 or num_devices % s:
      invalid.append((Candidate(s, 0, 0, "-", "-"), f"{s} stages do not divide {num_devices} "
                      "devices"))
      continue
    data = num_devices // s
    if config.num_layers % s:
      invalid.append((Candidate(s, data, 0, "-", "-"), f"num_layers={config.num_layers} is not "
                      f"divisible by stages*repeats={s}"))
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
      for name in names:
        points = _schedule_points(config, s, data, m, name, invalid)
        for r, overlap in itertools.product(points, overlap_options(config, name, overlaps)):
          for remat, g, w in recompute_options(name, remats, granularities, wrs):
            valid.append(Candidate(s, data, m, remat, name, g, r, w, overlap))
  return valid, invalid


def _schedule_points(config, s: int, data: int, m: int, name: str, invalid: list) -> list[int]:
  """The ``num_repeats`` schedule ``name`` has a table for at these sizes; the others are
  appended to ``invalid`` with their reasons."""
  repeats = repeat_options(name, config.num_layers // s)
  if not repeats:
    needed = FIXED_REPEATS.get(name, 2)
    invalid.append((Candidate(s, data, m, "-", name, "-", needed), f"schedule={name!r}: "
                    f"num_layers={config.num_layers} is not divisible by stages*repeats="
                    f"{s * needed}"))
  points = []
  for r in repeats:
    try:
      schedule_table(name, s, m, r)
    except ValueError as e:
      invalid.append((Candidate(s, data, m, "-", name, "-", r), f"schedule={name!r}: {e}"))
      continue
    points.append(r)
  return points


def action_costs(config, candidate: Candidate) -> dict[str, float]:
  """Per-action costs of one chunk for the candidate: ``config.tick_costs`` where it gives them
  (``"F=1,B=3,..."``), else those its remat gives a matmul model
  (:func:`tpipe.schedules.derived_costs.from_flops`), as the trainer derives them from the
  layers' measured FLOPs."""
  given = startup.parse_tick_costs(config.get("tick_costs", ""))
  if isinstance(given, dict):
    return dict(given)
  c = candidate
  return dict(derived_costs.from_flops(derived_costs.MATMUL_PARTS, c.remat, c.remat_granularity,
                                       spec_lib.check_weight_recompute(c.weight_recompute)))


def analytic_step(config, candidate: Candidate) -> float:
  """The candidate's step per device before compiling, in forwards of the whole model on one
  example, under :func:`action_costs` (:mod:`tpipe.schedules.simulate`), each action on one
  micro-batch (``batch / (data * M)`` examples) through one of the ``S * R`` chunks. It
  charges the bubble and the recomputation; communication and what XLA makes of the program are
  left to the compile.

  The step is the one the trainer's table takes: a forward schedule's neighbour-synchronised
  step; a fused schedule's dependency-driven step (``natural``), which the compound ticks the
  engine lays it out in approach under the matmul model's costs (within 2%, and ZB-V's within
  5%, at S = 4, M = 8: tests/train/test_autotune.py), without the seconds a compound table
  takes to build; with ``config.tick_costs="plain"`` (one action per tick) its
  neighbour-synchronised step."""
  c = candidate
  costs = action_costs(config, c)
  table = schedule_table(c.schedule, c.num_stages, c.num_microbatches, c.num_repeats)
  timing = schedules.whole_step(table).simulate(costs)
  plain = startup.parse_tick_costs(config.get("tick_costs", "")) == "plain"
  fused = isinstance(table, schedules.FusedSchedule)
  step = timing.natural if fused and not plain else timing.neighbour
  examples = config.batch_size / (c.num_data * c.num_microbatches)
  return step * examples / (c.num_stages * c.num_repeats)


def analytic_memory(config, candidate: Candidate, num_params: int) -> int:
  """A lower bound of the candidate's peak per device, before compiling: a stage's share of
  the parameters, their gradients and Adam's moments (:data:`STATE_BYTES_PER_PARAM` each,
  ``num_params`` of them over the stages), and the stage inputs its schedule keeps in flight
  (the one-action table's stash slots, one micro-batch of ``seq_len x width`` float32
  activations each, where the config names them), both over the devices ``config.mesh`` gives a
  stage's replica (fsdp x expert x tensor: at most that many ways split)."""
  c = candidate
  table = schedule_table(c.schedule, c.num_stages, c.num_microbatches, c.num_repeats)
  mesh = config.get("mesh") or {}
  split = 1
  for name in ("fsdp", "expert", "tensor"):
    split *= int(mesh.get(name, 1))
  state = STATE_BYTES_PER_PARAM * num_params // c.num_stages
  rows = config.batch_size // (c.num_data * c.num_microbatches)
  activation = rows * int(config.get("seq_len", 0)) * int(config.get("width", 0)) * 4
  return int(state + int(table.stash_slots().max()) * activation) // split
