"""Executed FLOPs of a compiled step, and what a pipeline's bubble takes of them.

* :func:`flop_count`: ``cost_analysis()`` counts the body of every ``while`` loop (``lax.scan``,
  ``fori_loop``) once; executed FLOPs count each body as many times as it runs: its trip count,
  times those of the loops around it.
* :func:`pipeline_flops`: a pipeline's tick loops run the stage under a conditional that idle
  (tick, stage) slots skip. XLA counts a conditional as its costliest branch on every trip, which
  is the time a tick costs in lockstep SPMD; the FLOPs actually executed leave out the skipped
  share (the schedule's bubble fraction). A fused schedule's counts come from each action's own
  branch (:func:`fused_flops`).

FLOP conventions follow XLA's ``HloCostAnalysis``: a dot is ``2 * output elements * contracted
size``; each elementwise arithmetic op, compare, select and convert is 1 FLOP per element;
transcendental ops (exp, log, tanh, ...) count as transcendentals, not FLOPs; a reduction is
``(input - output elements)`` applications of its reducer; a conditional counts its most
expensive branch. Our own count of the HLO reproduces ``cost_analysis()['flops']`` (tested on
tiny programs). A convolution counts the taps that meet input elements
(:func:`convolution_flops`), as XLA does.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from tpipe import schedules as schedules_lib
from tpipe.core.loops import tick_rows
from tpipe.tools import hlo as hlo_lib
from tpipe.tools import tick_conditionals as conditionals_lib

# Elementwise ops XLA counts as one FLOP per output element.
_ELEMENTWISE = frozenset({
    "add", "subtract", "multiply", "divide", "remainder", "maximum", "minimum", "negate", "abs",
    "sign", "compare", "select", "clamp", "convert", "and", "or", "xor", "not", "floor", "ceil",
    "round-nearest-afz", "round-nearest-even", "shift-left", "shift-right-arithmetic",
    "shift-right-logical", "is-finite", "popcnt", "count-leading-zeros", "real", "imag",
    "complex", "stochastic-convert", "reduce-precision",
})
# Elementwise ops XLA counts as transcendentals instead of FLOPs.
_TRANSCENDENTAL = frozenset({
    "exponential", "exponential-minus-one", "log", "log-plus-one", "logistic", "tanh", "sqrt",
    "rsqrt", "cbrt", "power", "sine", "cosine", "tan", "atan2", "erf", "erf-inv",
})


# --------------------------------------------------------------------------------------------
# FLOPs.


@dataclasses.dataclass(frozen=True)
class FlopCount:
  """FLOPs of one execution of a compiled program, per device.

  Attributes:
    xla: ``cost_analysis()['flops']``: every loop body counted once (None for bare HLO text).
    static: our count of the HLO with every loop body counted once (should equal ``xla``).
    executed: FLOPs that run per step: loop bodies counted trip-count times.
    transcendentals: executed transcendental ops (exp, tanh, ...).
    loops: ``(while instruction name, trip count or None, times its computation runs)``.
  """

  xla: float | None
  static: float
  executed: float
  transcendentals: float
  loops: tuple[tuple[str, int | None, int], ...]

  @property
  def loop_factor(self) -> float:
    """``executed / static``: how much the trip counts multiply the naive count."""
    return self.executed / self.static if self.static else 1.0

  @property
  def loops_without_trip_count(self) -> tuple[str, ...]:
    """Loops XLA proved no trip count for: counted once each, so ``executed`` is a lower bound."""
    return tuple(name for name, trips, _ in self.loops if trips is None)


def convolution_flops(comp: hlo_lib.Computation, ins: hlo_lib.Instruction) -> float:
  """FLOPs of a ``convolution``: 2 x the multiply-adds whose taps land on input elements.

  The TPU compiler writes batched matmuls (attention heads, stacked weights) as convolutions
  whose batch is a spatial dimension with a dilated input (``window={size=8 lhs_dilate=8}``):
  only one tap in 8 meets an input element, the rest meet the holes the dilation inserts. Per
  spatial dimension this counts the (output position, tap) pairs that meet one, with strides,
  padding and both dilations, as XLA's own cost analysis does; each such pair multiplies the
  kernel's input features.
  """
  lhs, kernel = comp.operand_shape(ins, 0), comp.operand_shape(ins, 1)
  out = hlo_lib.parse_shape(ins.shape)
  labels = ins.attr("dim_labels") or ""
  if not (lhs and kernel and out) or "_" not in labels or "->" not in labels:
    return 0.0
  lhs_labels, rest = labels.split("_", 1)
  kernel_labels, out_labels = rest.split("->")
  fields = dict(re.findall(r"(\w+)=([^\s}]+)", ins.attr("window") or ""))
  spatial = [c for c in lhs_labels if c.isdigit()]
  each = lambda key, default: ([int(x) for x in fields[key].split("x")] if key in fields
                               else [default] * len(spatial))
  sizes, strides = each("size", 1), each("stride", 1)
  lhs_dilation, rhs_dilation = each("lhs_dilate", 1), each("rhs_dilate", 1)
  pads = ([int(p.split("_")[0]) for p in fields["pad"].split("x")] if "pad" in fields
          else [0] * len(spatial))
  pairs, out_positions = 1, 1
  for j, dim in enumerate(sorted(spatial)):
    n = lhs[0].dims[lhs_labels.index(dim)]
    o = out[0].dims[out_labels.index(dim)]
    position = (np.arange(o)[:, None] * strides[j] + np.arange(sizes[j])[None, :]
                * rhs_dilation[j] - pads[j])
    meets = ((position >= 0) & (position <= (n - 1) * lhs_dilation[j])
             & (position % lhs_dilation[j] == 0))
    pairs *= int(meets.sum())
    out_positions *= o
  features = kernel[0].dims[kernel_labels.index("i")] if "i" in kernel_labels else 1
  return 2.0 * (out[0].size // max(out_positions, 1)) * pairs * features


class _FlopCounter:
  """Counts FLOPs per computation, with loop bodies counted once or trip-count times."""

  def __init__(self, module: hlo_lib.HloModule, executed: bool):
    self.module = module
    self.executed = executed
    self._cache: dict[str, tuple[float, float]] = {}

  def computation(self, name: str) -> tuple[float, float]:
    """``(flops, transcendentals)`` of one run of computation ``name``."""
    if name not in self._cache:
      comp = self.module.computations[name]
      flops = trans = 0.0
      for ins in comp.instructions:
        f, t = self.instruction(comp, ins)
        flops += f
        trans += t
      self._cache[name] = (flops, trans)
    return self._cache[name]

  def _called(self, name: str | None) -> tuple[float, float]:
    if name is None or name not in self.module.computations:
      return 0.0, 0.0
    return self.computation(name)

  def _reducer_flops(self, ins: hlo_lib.Instruction) -> float:
    name = ins.attr("to_apply")
    return self._called(name.lstrip("%"))[0] if name else 0.0

  def instruction(self, comp, ins) -> tuple[float, float]:
    op = ins.opcode
    out = hlo_lib.parse_shape(ins.shape)
    out_size = out[0].size if out else 0
    if op == "while":
      body = self._called(ins.attr("body").lstrip("%"))
      cond = self._called(ins.attr("condition").lstrip("%"))
      trips = (ins.trip_count or 1) if self.executed else 1
      return trips * (body[0] + cond[0]), trips * (body[1] + cond[1])
    if op == "conditional":
      branches = [self._called(c) for c in ins.called]
      return max(branches, default=(0.0, 0.0), key=lambda ft: ft[0])
    if op in ("fusion", "call", "async-start", "custom-call") and ins.called:
      totals = [self._called(c) for c in ins.called]
      return sum(t[0] for t in totals), sum(t[1] for t in totals)
    if op == "dot":
      lhs = comp.operand_shape(ins, 0)
      dims = ins.attr("lhs_contracting_dims") or "{}"
      contracted = math.prod(lhs[0].dims[int(d)] for d in re.findall(r"\d+", dims)) if lhs else 1
      return 2.0 * out_size * contracted, 0.0
    if op == "convolution":
      return convolution_flops(comp, ins), 0.0
    if op in _ELEMENTWISE:
      return float(out_size), 0.0
    if op in _TRANSCENDENTAL:
      return 0.0, float(out_size)
    if op == "reduce":
      inp = comp.operand_shape(ins, 0)
      in_size = inp[0].size if inp else 0
      return (in_size - out_size) * self._reducer_flops(ins), 0.0
    if op == "reduce-window":
      window = ins.attr("window") or ""
      size = re.search(r"size=([\dx]+)", window)
      window_size = math.prod(int(s) for s in size.group(1).split("x")) if size else 1
      return out_size * window_size * self._reducer_flops(ins), 0.0
    if op in ("all-reduce", "all-reduce-start", "reduce-scatter"):
      return sum(a.size for a in out) * self._reducer_flops(ins), 0.0
    if op == "scatter":
      updates = comp.operand_shape(ins, len(ins.operands) - 1)
      return (updates[0].size if updates else 0) * self._reducer_flops(ins), 0.0
    return 0.0, 0.0


def flop_count(compiled) -> FlopCount:
  """Executed FLOPs per device of a compiled program: loop bodies times their trip counts.

  Args:
    compiled: a :class:`jax.stages.Compiled`, or its HLO text (then ``xla`` is None).

  Returns:
    A :class:`FlopCount`. ``executed`` is XLA's own count plus the extra trips of every loop
    (our count's ``executed - static``), so it equals XLA's figure for loop-free programs.
  """
  module = hlo_lib.module_of(compiled)
  xla = None
  if not isinstance(compiled, (str, hlo_lib.HloModule)):
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax returned one dict per program
      cost = cost[0] if cost else {}
    xla = float((cost or {}).get("flops", 0.0))
  static = _FlopCounter(module, executed=False).computation(module.entry)
  executed = _FlopCounter(module, executed=True).computation(module.entry)
  loops = tuple((loop.instruction.name, loop.trip_count, loop.outer)
                for loop in module.loops())
  base = xla if xla is not None else static[0]
  return FlopCount(xla=xla, static=static[0], executed=base + executed[0] - static[0],
                   transcendentals=executed[1], loops=loops)


# --------------------------------------------------------------------------------------------
# Pipeline: useful FLOPs and bubble.


@dataclasses.dataclass(frozen=True)
class PipelineFlops:
  """Executed, useful and lockstep FLOPs of a pipelined step, per device.

  In lockstep SPMD every device spends every tick, busy or idle, as long as a busy tick takes.
  The executor skips the stage's work on idle ticks (a conditional), so the bubble costs time
  but no FLOPs: ``executed`` is close to ``useful``, and ``lockstep`` (what the step's duration
  is proportional to) exceeds both by the bubble.

  Attributes:
    lockstep: FLOPs as if every tick were busy: conditionals counted as their costliest branch
      on every trip (XLA's convention, times loop trip counts).
    executed: FLOPs that actually run: ``lockstep`` minus the idle share of the conditionals in
      the tick loops.
    useful: ``lockstep`` minus the idle share of everything in the tick loops: the work of the
      busy (tick, stage) slots plus what runs outside the tick loops.
    in_tick_loops: lockstep FLOPs inside the schedule's tick loops (forward and backward).
    gated: lockstep FLOPs inside the tick loops' conditionals (the stage's layers).
    tick_loops: names of the ``while`` loops identified as tick loops (trip count = ticks).
    bubble_fraction: the schedule's idle share of ticks on every stage.
    action_costs: for a fused table, the FLOPs of one action of each kind, mean over the model
      chunks (:meth:`FusedFlops.costs`: what :meth:`tpipe.schedules.FusedSchedule.simulate`
      takes); empty for a forward schedule.
    outside_actions: for a fused table, the FLOPs per device outside its actions (message
      routing, the sums after the loop, the optimizer); 0 for a forward schedule.
  """

  lockstep: float
  executed: float
  useful: float
  in_tick_loops: float
  gated: float
  tick_loops: tuple[str, ...]
  bubble_fraction: float
  action_costs: dict[str, float] = dataclasses.field(default_factory=dict)
  outside_actions: float = 0.0

  @property
  def useful_fraction(self) -> float:
    """``useful / executed``: the share of the executed FLOPs that is not overhead."""
    return self.useful / self.executed if self.executed else 1.0

  @property
  def lockstep_efficiency(self) -> float:
    """``useful / lockstep``: the share of the step's duration spent on useful work,
    ``1 - bubble`` when the per-tick bookkeeping is negligible."""
    return self.useful / self.lockstep if self.lockstep else 1.0


def _gated_flops(counter: _FlopCounter, module: hlo_lib.HloModule, body: str) -> float:
  """FLOPs (costliest branch) of the conditionals directly in a loop body and its calls."""
  total, pending, seen = 0.0, [body], set()
  while pending:
    name = pending.pop()
    if name in seen or name not in module.computations:
      continue
    seen.add(name)
    comp = module.computations[name]
    for ins in comp.instructions:
      if ins.opcode == "conditional":
        total += counter.instruction(comp, ins)[0]
      elif ins.opcode in ("call", "fusion", "async-start") and ins.called:
        pending.extend(ins.called)
  return total


def pipeline_flops(compiled, schedule, flops: FlopCount | None = None,
                   programs=None) -> PipelineFlops:
  """Lockstep, executed and useful FLOPs of a pipelined step.

  The tick loops are found as the outermost ``while`` loops whose trip count equals
  ``schedule.num_ticks`` (the forward loop and the backward loop autodiff makes of it; a fused
  schedule's one loop over its table). Every stage of the forward schedules is idle on the same
  number of ticks, a ``bubble_fraction`` share: that share of the tick loops' conditionals (the
  stage's layers) is skipped, and that share of everything in the tick loops is not useful. For a
  fused schedule the counts are exact, from each action's own branch (:func:`fused_flops`):
  ``lockstep`` sums each tick's costliest action, ``executed`` is the busiest device's actions
  plus the overhead, ``useful`` the mean device's actions.

  Args:
    compiled: a :class:`jax.stages.Compiled` or its HLO text.
    schedule: the :class:`tpipe.schedules.Schedule` or :class:`tpipe.schedules.FusedSchedule`
      the step runs.
    flops: a :class:`FlopCount` already computed for ``compiled`` (recomputed if None).
    programs: for a fused schedule, each model chunk's chunk program (see :func:`fused_flops`).

  Returns:
    A :class:`PipelineFlops`.
  """
  if not hasattr(schedule, "num_ticks") or not hasattr(schedule, "bubble_fraction"):
    raise TypeError(f"schedule must be a tpipe.schedules.Schedule, got "
                    f"{type(schedule).__name__}; build one with "
                    "tpipe.schedules.build(name, S, M, R).")
  flops = flops if flops is not None else flop_count(compiled)
  if isinstance(schedule, schedules_lib.FusedSchedule):
    found = fused_flops(compiled, schedule, programs, flops)
    return PipelineFlops(lockstep=found.lockstep, executed=found.executed, useful=found.useful,
                         in_tick_loops=found.lockstep - found.overhead,
                         gated=float(found.per_stage.max()), tick_loops=(found.tick_loop,),
                         bubble_fraction=float(schedule.bubble_fraction),
                         action_costs=found.costs(), outside_actions=found.overhead)
  module = hlo_lib.module_of(compiled)
  counter = _FlopCounter(module, executed=True)
  inside = module.enclosing_loops()
  loops = module.loops()
  tick_names = {loop.instruction.name for loop in loops
                if loop.trip_count == schedule.num_ticks}
  in_ticks, gated, chosen = 0.0, 0.0, []
  for loop in loops:
    if loop.instruction.name not in tick_names:
      continue
    if any(outer in tick_names for outer in inside.get(loop.computation, ())):
      continue  # nested inside another tick loop: already counted there.
    chosen.append(loop.instruction.name)
    runs = loop.outer * loop.trip_count
    in_ticks += runs * counter.computation(loop.body)[0]
    gated += runs * _gated_flops(counter, module, loop.body)
  if not chosen and schedule.num_ticks > 1:
    raise ValueError(
        f"No while loop with the schedule's {schedule.num_ticks} ticks as its trip count was "
        "found (loops and trip counts: "
        f"{[(loop.instruction.name, loop.trip_count) for loop in loops]}). "
        "Pass the schedule the program was compiled with; if it is, XLA unrolled or rewrote the "
        "tick loop and useful FLOPs cannot be separated from the bubble.")
  bubble = float(schedule.bubble_fraction)
  return PipelineFlops(lockstep=flops.executed, executed=flops.executed - bubble * gated,
                       useful=flops.executed - bubble * in_ticks, in_tick_loops=in_ticks,
                       gated=gated, tick_loops=tuple(chosen), bubble_fraction=bubble)


@dataclasses.dataclass(frozen=True)
class FusedFlops:
  """FLOPs of a step run with a fused schedule (:class:`tpipe.schedules.FusedSchedule`), read
  from the branches of its compiled tick loop, per device.

  Each tick a device runs one branch of a conditional: idle, or action ``F``, ``B``, ``BI`` or
  ``W`` of one model chunk (see :mod:`tpipe.core.loops.fused`). Counting each branch's FLOPs once
  and weighting it by the ticks the table runs it gives exact per-stage totals.

  Attributes:
    actions: per action name, ``[V]`` FLOPs of one such action on model chunk ``v`` (NaN for
      actions the program does not contain).
    per_stage: ``[S]`` FLOPs each stage's actions execute over the step.
    lockstep: the sum over ticks of the costliest action of the tick (in SPMD every device
      waits for it): what the step's duration follows, in FLOPs.
    overhead: FLOPs per device outside the actions (the ticks' message routing, the sums after
      the loop).
    num_stages: S.
    tick_loop: the name of the tick loop's ``while`` instruction.
  """

  actions: dict[str, np.ndarray]
  per_stage: np.ndarray
  lockstep: float
  overhead: float
  num_stages: int
  tick_loop: str = ""

  @property
  def useful(self) -> float:
    """The actions' FLOPs per device, averaged over the stages."""
    return float(self.per_stage.mean())

  @property
  def executed(self) -> float:
    """The FLOPs the busiest device runs: its actions plus the overhead."""
    return float(self.per_stage.max()) + self.overhead

  @property
  def lockstep_efficiency(self) -> float:
    """``useful / lockstep``: 1 minus the bubble measured in FLOPs."""
    return self.useful / self.lockstep if self.lockstep else 1.0

  def costs(self) -> dict[str, float]:
    """Mean FLOPs per action kind over the model chunks: costs for ``FusedSchedule.simulate``."""
    return {name: float(np.mean(f)) for name, f in self.actions.items() if np.all(np.isfinite(f))}


def fused_flops(compiled, schedule, programs=None,
                flops: FlopCount | None = None, overlap: bool | None = None) -> FusedFlops:
  """Per-action and per-stage FLOPs of a step compiled with a fused schedule.

  The tick loop is the ``while`` loop whose trip count is ``schedule.num_ticks``; its
  conditionals (one per lane of a compound tick) hold the idle branch and the actions the table
  runs in that lane (:func:`tpipe.core.loops.tick_rows.lane_switches`): ``F``, ``B``, ``BI``, ``W``
  of the distinct chunk programs. An action the table never runs is in no conditional, and its
  FLOPs are NaN (``B`` of a split backward: compare with a table that runs it).

  Args:
    compiled: a :class:`jax.stages.Compiled` (or its HLO text) of a step that differentiates a
      stack run with ``schedule``.
    schedule: the :class:`tpipe.schedules.FusedSchedule` it runs.
    programs: per model chunk, its chunk program
      (:meth:`tpipe.core.engine.PlannedPipeline.programs`); default one program per model chunk.
    flops: a :class:`FlopCount` already computed for ``compiled`` (recomputed if None).
    overlap: whether the step overlaps micro-batches (``PipelineSpec.overlap_microbatches``:
      a pair's actions run in one conditional, their FLOPs counted on the pair's first row);
      None: whichever layout of conditionals the tick loop has.

  Returns:
    A :class:`FusedFlops`; ``actions`` are per model chunk.
  """

  if not isinstance(schedule, schedules_lib.FusedSchedule):
    raise TypeError(f"schedule must be a tpipe.schedules.FusedSchedule, got "
                    f"{type(schedule).__name__}; use pipeline_flops for forward schedules.")
  module = hlo_lib.module_of(compiled)
  counter = _FlopCounter(module, executed=True)
  loops = [loop for loop in module.loops() if loop.trip_count == schedule.num_ticks]
  num_virtual = schedule.num_stages * schedule.num_chunks
  programs = list(range(num_virtual)) if programs is None else list(programs)
  found = None
  for loop in loops:
    conditionals = conditionals_lib.tick_conditionals(module, loop.body)
    layout = conditionals_lib.lane_layout(schedule, programs, conditionals, overlap)
    if layout is not None and found is None:
      found = (loop, conditionals, layout)
  if found is None:
    expected = conditionals_lib.expected_counts(schedule, programs, overlap)
    raise ValueError(f"No tick loop of {schedule.num_ticks} trips with conditionals of "
                     f"{expected} branches was found; pass the schedule the step was compiled "
                     "with and its pipeline's programs().")
  loop, conditionals, layout = found
  kinds = ("F", "B", "BI", "W")
  costs = conditionals_lib.branch_costs(schedule, programs, conditionals, layout,
                                        lambda name: counter.computation(name)[0])
  action_cost, busiest = costs.actions, costs.busiest
  numbers = tick_rows.BranchNumbers(max(programs) + 1)
  actions = {kind: action_cost[numbers.number(k, np.asarray(programs))]
             for k, kind in enumerate(kinds)}
  table, _ = tick_rows.tick_branches(schedule, programs)
  action_flops = np.where(table > 0, action_cost[table], 0.0)  # Per row.
  if costs.pairs:  # A pair's FLOPs on its first row, none on its second.
    action_flops = conditionals_lib.pair_row_costs(schedule, table, action_flops, costs.pairs)
  per_tick = np.zeros((schedule.num_ticks, schedule.num_stages))
  np.add.at(per_tick, schedule.tick, action_flops)
  total = (flops if flops is not None else flop_count(compiled)).executed
  # The whole-program count takes each conditional's costliest branch on every trip; what is
  # not an action is the rest (the idle branches' own FLOPs count as routing, like every tick's).
  overhead = total - loop.outer * schedule.num_ticks * busiest
  return FusedFlops(actions=actions, per_stage=loop.outer * action_flops.sum(axis=0),
                    lockstep=loop.outer * float(per_tick.max(axis=1).sum()) + overhead,
                    overhead=overhead, num_stages=schedule.num_stages,
                    tick_loop=loop.instruction.name)


def simulated_timing(table, costs=None) -> schedules_lib.Timing:
  """The whole step (forward and backward) of ``table`` simulated under per-action ``costs``
  (default :data:`tpipe.schedules.DEFAULT_COSTS`): a forward schedule as
  :func:`tpipe.schedules.whole_step` writes it."""
  return schedules_lib.whole_step(table).simulate(costs)


def step_flops(table, pipeline, executed: float) -> float:
  """The step's duration in FLOPs per device at the table's neighbour-synchronised time.

  Args:
    table: the table the step runs (forward or fused).
    pipeline: the step's :class:`PipelineFlops`, or None (no tick-loop
      analysis, as for a TPU topology's program).
    executed: the step's executed FLOPs (:attr:`FlopCount.executed`).
  """
  if pipeline is not None and pipeline.action_costs:
    try:
      timing = simulated_timing(table, pipeline.action_costs)
      return timing.neighbour + pipeline.outside_actions
    except ValueError:  # The program's FLOPs miss an action kind the table runs.
      pass
  timing = simulated_timing(table)
  return executed * (timing.neighbour / timing.lockstep if timing.lockstep else 1.0)


def simulated_bubble(table) -> float:
  """The neighbour-synchronised bubble of the whole step under the default costs: the share of
  the tick loop's time a stage is idle or waits for a neighbour."""
  return simulated_timing(table).neighbour_bubble
