"""Ahead-of-time measurements of a compiled step: memory, executed FLOPs, collectives, bubble.

Everything here reads a :class:`jax.stages.Compiled` (``jit(f).lower(...).compile()``) and the
per-device HLO text it prints; nothing runs the program. The questions answered:

* **Memory per device** (:func:`memory_breakdown`): XLA's ``memory_analysis()`` split into
  arguments, outputs, temporaries, generated code and donated (aliased) bytes; the argument bytes
  further split into parameters, optimizer state and batch when the abstract inputs are given.
* **Executed FLOPs** (:func:`flop_count`): ``cost_analysis()`` counts the body of every
  ``while`` loop (``lax.scan``, ``fori_loop``) once. Executed FLOPs count each body as many times
  as it runs: its trip count, times those of the loops around it.
* **Collectives per step** (:func:`collectives`): all-reduce, all-gather, reduce-scatter,
  collective-permute and all-to-all, with their per-device bytes, how many times each runs per
  step and which mesh axes they cross (stage-to-stage transfers vs data-parallel reductions).
* **Useful FLOPs and bubble** (:func:`pipeline_flops`): a pipeline's tick loops run the stage
  under a conditional that idle (tick, stage) slots skip. XLA counts a conditional as its
  costliest branch on every trip, which is the time a tick costs in lockstep SPMD; the FLOPs
  actually executed leave out the skipped share (the schedule's bubble fraction).

FLOP conventions follow XLA's ``HloCostAnalysis``: a dot is ``2 * output elements * contracted
size``; each elementwise arithmetic op, compare, select and convert is 1 FLOP per element;
transcendental ops (exp, log, tanh, ...) count as transcendentals, not FLOPs; a reduction is
``(input - output elements)`` applications of its reducer; a conditional counts its most
expensive branch. Our own count of the HLO reproduces ``cost_analysis()['flops']`` (tested on
tiny programs); executed FLOPs add what the loop bodies' extra trips cost on top of XLA's number.
Convolutions are counted approximately (padding taps included).

Example::

  compiled = jax.jit(step).lower(abstract_state, abstract_batch, key).compile()
  a = analyze(compiled, mesh=mesh, schedule=schedule,
              inputs={"params": state.params, "opt_state": state.opt_state, "batch": batch})
  print(a.memory.total, a.flops.executed, a.pipeline.useful_fraction)
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any, Mapping

import numpy as np

from tpipe.tools import hlo as hlo_lib

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
# Collective kinds, with the opcodes that start them (``-done`` halves are not counted).
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
                    "all-to-all")
_COLLECTIVE_OPCODES = {
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
    "all-to-all": "all-to-all", "ragged-all-to-all": "all-to-all",
}


def _module(compiled_or_text) -> hlo_lib.HloModule:
  if isinstance(compiled_or_text, hlo_lib.HloModule):
    return compiled_or_text
  if isinstance(compiled_or_text, str):
    return hlo_lib.parse_hlo(compiled_or_text)
  if hasattr(compiled_or_text, "as_text") and hasattr(compiled_or_text, "cost_analysis"):
    return hlo_lib.parse_hlo(compiled_or_text.as_text())
  raise TypeError(
      f"Expected a jax.stages.Compiled (jit(f).lower(...).compile()) or its HLO text, got "
      f"{type(compiled_or_text).__name__}. Call .compile() on the lowered function first.")


def _check_compiled(compiled) -> None:
  if not (hasattr(compiled, "memory_analysis") and hasattr(compiled, "cost_analysis")):
    raise TypeError(
        f"Expected a jax.stages.Compiled, got {type(compiled).__name__}; use "
        "jax.jit(f).lower(*args).compile().")


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
      kernel = comp.operand_shape(ins, 1)
      labels = ins.attr("dim_labels") or ""
      kernel_labels = labels.split("_")[1].split("->")[0] if "_" in labels else ""
      if kernel and "o" in kernel_labels:
        per_output = kernel[0].size // kernel[0].dims[kernel_labels.index("o")]
      else:
        per_output = kernel[0].size if kernel else 1
      return 2.0 * out_size * per_output, 0.0
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
  module = _module(compiled)
  xla = None
  if not isinstance(compiled, (str, hlo_lib.HloModule)):
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax returned one dict per program
      cost = cost[0] if cost else {}
    xla = float((cost or {}).get("flops", 0.0))
  static = _FlopCounter(module, executed=False).computation(module.entry)
  executed = _FlopCounter(module, executed=True).computation(module.entry)
  loops = tuple((l.instruction.name, l.trip_count, l.outer) for l in module.loops())
  base = xla if xla is not None else static[0]
  return FlopCount(xla=xla, static=static[0], executed=base + executed[0] - static[0],
                   transcendentals=executed[1], loops=loops)


# --------------------------------------------------------------------------------------------
# Collectives.


def _axes_spanned(groups: list[list[int]], mesh_shape: tuple[int, ...],
                  axis_names: tuple[str, ...]) -> tuple[str, ...]:
  """Mesh axes along which the device ids of some group differ."""
  total = math.prod(mesh_shape)
  varying = set()
  for group in groups:
    if not group:
      continue
    if max(group) >= total:
      raise ValueError(f"A collective's groups name device {max(group)}, but the mesh has only "
                       f"{total} devices; pass the mesh the program was compiled for.")
    coords = np.array(np.unravel_index(np.array(group), mesh_shape)).T
    for axis in range(len(mesh_shape)):
      if len(set(coords[:, axis].tolist())) > 1:
        varying.add(axis)
  return tuple(axis_names[a] for a in sorted(varying))


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of the per-device program.

  Attributes:
    kind: one of :data:`COLLECTIVE_KINDS`.
    name: the HLO instruction's name.
    bytes: per-device payload of one execution: the larger of its operands and its result.
    count: how many times it runs per step (product of enclosing loop trip counts).
    in_loop: whether it sits inside a ``while`` loop.
    group_size: devices per replica group (2 for a neighbour permute).
    axes: the mesh axes its groups span, when a mesh was given (e.g. ``("stage",)``); a group
      over part of an axis (2 of 4 stages) counts as that axis, and ``()`` means every group is
      one device.
    op_name: the JAX op name from the metadata, e.g. ``"jit(step)/.../ppermute"``.
  """

  kind: str
  name: str
  bytes: int
  count: int
  in_loop: bool
  group_size: int
  axes: tuple[str, ...] | None
  op_name: str

  @property
  def total_bytes(self) -> int:
    """``bytes * count``: per-device bytes moved by this instruction per step."""
    return self.bytes * self.count


def collectives(compiled, mesh=None) -> list[Collective]:
  """Every collective in the per-device program, with its bytes and executions per step.

  Args:
    compiled: a :class:`jax.stages.Compiled` or its HLO text.
    mesh: optional :class:`jax.sharding.Mesh` the program was compiled for; when given, each
      collective is labelled with the mesh axes it spans (device ids in the HLO are positions
      in ``mesh.devices.flat``).

  Returns:
    A list of :class:`Collective`, in program order.
  """
  module = _module(compiled)
  mult = module.multipliers()
  inside = module.enclosing_loops()
  mesh_shape = tuple(mesh.devices.shape) if mesh is not None else None
  axis_names = tuple(mesh.axis_names) if mesh is not None else None
  num_devices = module.num_partitions * module.num_replicas
  found = []
  for comp, ins in module.instructions():
    kind = _COLLECTIVE_OPCODES.get(ins.opcode)
    if kind is None or mult.get(comp.name, 0) == 0:
      continue
    operand_bytes = 0
    for i in range(len(ins.operands)):
      operand_bytes += sum(a.nbytes for a in comp.operand_shape(ins, i))
    result_bytes = hlo_lib.shape_bytes(ins.shape)
    if ins.opcode.endswith("-start"):
      result_bytes = max(0, result_bytes - operand_bytes)
    groups = ins.device_groups(num_devices)
    group_size = max((len(g) for g in groups), default=0)
    axes = None
    if mesh_shape is not None:
      axes = _axes_spanned(groups, mesh_shape, axis_names)
    op_name = re.search(r'op_name="([^"]*)"', ins.attrs)
    found.append(Collective(
        kind=kind, name=ins.name, bytes=max(operand_bytes, result_bytes), count=mult[comp.name],
        in_loop=bool(inside.get(comp.name)), group_size=group_size, axes=axes,
        op_name=op_name.group(1) if op_name else ""))
  return found


def summarize_collectives(found: list[Collective]) -> dict[tuple[str, tuple[str, ...] | None],
                                                           dict[str, int]]:
  """Totals per (kind, axes): ``{"instructions", "count", "bytes", "in_loop"}`` per step."""
  table: dict[Any, dict[str, int]] = collections.OrderedDict()
  for c in found:
    row = table.setdefault((c.kind, c.axes),
                           {"instructions": 0, "count": 0, "bytes": 0, "in_loop": 0})
    row["instructions"] += 1
    row["count"] += c.count
    row["bytes"] += c.total_bytes
    row["in_loop"] += int(c.in_loop)
  return dict(table)


# --------------------------------------------------------------------------------------------
# Memory.


def _leaf_bytes_per_device(leaf) -> dict[Any, int]:
  """Bytes of ``leaf`` held by each device (from its sharding), or ``{None: bytes}``."""
  shape = tuple(getattr(leaf, "shape", ()))
  dtype = np.dtype(getattr(leaf, "dtype", np.float32))
  itemsize = dtype.itemsize
  sharding = getattr(leaf, "sharding", None)
  if sharding is None:
    return {None: math.prod(shape) * itemsize}
  per_device = {}
  for device, index in sharding.devices_indices_map(shape).items():
    size = 1
    for dim, sl in zip(shape, index):
      start, stop, step = sl.indices(dim)
      size *= len(range(start, stop, step))
    per_device[device] = size * itemsize
  return per_device


def input_bytes(tree) -> tuple[int, int]:
  """Per-device bytes of a pytree of arrays / ``ShapeDtypeStruct`` with shardings.

  Returns:
    ``(bytes on device 0 of the mesh order, bytes on the fullest device)``. Leaves without a
    sharding count in full on every device.
  """
  import jax  # pylint: disable=g-import-not-at-top

  totals: dict[Any, int] = collections.Counter()
  unsharded = 0
  for leaf in jax.tree_util.tree_leaves(tree):
    if not hasattr(leaf, "shape"):
      continue
    if jax.dtypes.issubdtype(getattr(leaf, "dtype", np.float32), jax.dtypes.prng_key):
      unsharded += 8  # a typed key is two uint32 words on CPU/GPU/TPU with threefry.
      continue
    per_device = _leaf_bytes_per_device(leaf)
    if None in per_device:
      unsharded += per_device[None]
    else:
      for device, b in per_device.items():
        totals[device] += b
  if not totals:
    return unsharded, unsharded
  first = next(iter(totals.values()))
  return first + unsharded, max(totals.values()) + unsharded


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
  """Per-device memory of a compiled program, in bytes (XLA's ``memory_analysis()``).

  Attributes:
    arguments: all input buffers.
    outputs: all output buffers.
    temporaries: XLA's temp allocation: activations kept for the backward pass, gradients,
      workspace.
    generated_code: compiled code size.
    aliased: output bytes that reuse donated input buffers.
    inputs: the argument bytes split by the caller's names (e.g. params, opt_state, batch),
      ``"other"`` for the rest; empty when no inputs were given.
    largest_inputs: the same per name for the device holding the most bytes.
  """

  arguments: int
  outputs: int
  temporaries: int
  generated_code: int
  aliased: int
  inputs: Mapping[str, int] = dataclasses.field(default_factory=dict)
  largest_inputs: Mapping[str, int] = dataclasses.field(default_factory=dict)

  @property
  def total(self) -> int:
    """Peak per-device bytes: arguments + outputs - aliased + temporaries + code."""
    return (self.arguments + self.outputs - self.aliased + self.temporaries
            + self.generated_code)

  @property
  def largest_device_total(self) -> int:
    """``total`` with the inputs of the fullest device (equal to ``total`` for even shards)."""
    if not self.largest_inputs:
      return self.total
    extra = sum(self.largest_inputs.values()) - sum(self.inputs.values())
    return self.total + max(0, extra)


def memory_breakdown(compiled, inputs: Mapping[str, Any] | None = None) -> MemoryBreakdown:
  """Per-device memory of a compiled program, optionally splitting the argument bytes.

  Args:
    compiled: a :class:`jax.stages.Compiled`.
    inputs: optional mapping from a label (e.g. ``"params"``, ``"opt_state"``, ``"batch"``) to a
      pytree of the arrays or ``jax.ShapeDtypeStruct`` (with shardings) passed to the program.
      Argument bytes not covered by these are reported as ``"other"``.

  Returns:
    A :class:`MemoryBreakdown`.
  """
  _check_compiled(compiled)
  stats = compiled.memory_analysis()
  if stats is None:
    raise ValueError("compiled.memory_analysis() returned None on this backend; memory "
                     "figures are unavailable.")
  split, largest = {}, {}
  if inputs:
    if not isinstance(inputs, Mapping):
      raise TypeError(f"inputs must be a mapping of label -> pytree, got "
                      f"{type(inputs).__name__}.")
    for label, tree in inputs.items():
      split[label], largest[label] = input_bytes(tree)
    other = int(stats.argument_size_in_bytes) - sum(split.values())
    split["other"] = max(0, other)
    largest["other"] = max(0, other)
  return MemoryBreakdown(
      arguments=int(stats.argument_size_in_bytes),
      outputs=int(stats.output_size_in_bytes),
      temporaries=int(stats.temp_size_in_bytes),
      generated_code=int(stats.generated_code_size_in_bytes),
      aliased=int(stats.alias_size_in_bytes),
      inputs=split,
      largest_inputs=largest,
  )


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
  """

  lockstep: float
  executed: float
  useful: float
  in_tick_loops: float
  gated: float
  tick_loops: tuple[str, ...]
  bubble_fraction: float

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
                    "tpipe.schedules.make_schedule(name, S, M, R).")
  flops = flops if flops is not None else flop_count(compiled)
  from tpipe import schedules as schedules_lib  # pylint: disable=g-import-not-at-top

  if isinstance(schedule, schedules_lib.FusedSchedule):
    found = fused_flops(compiled, schedule, programs, flops)
    return PipelineFlops(lockstep=found.lockstep, executed=found.executed, useful=found.useful,
                         in_tick_loops=found.lockstep - found.overhead,
                         gated=float(found.per_stage.max()), tick_loops=(found.tick_loop,),
                         bubble_fraction=float(schedule.bubble_fraction))
  module = _module(compiled)
  counter = _FlopCounter(module, executed=True)
  inside = module.enclosing_loops()
  loops = module.loops()
  tick_names = {l.instruction.name for l in loops if l.trip_count == schedule.num_ticks}
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
        f"found (loops and trip counts: {[(l.instruction.name, l.trip_count) for l in loops]}). "
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
  ``W`` of one model chunk (see :mod:`tpipe.core.fused`). Counting each branch's FLOPs once and
  weighting it by the ticks the table runs it gives exact per-stage totals.

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
                flops: FlopCount | None = None) -> FusedFlops:
  """Per-action and per-stage FLOPs of a step compiled with a fused schedule.

  The tick loop is the ``while`` loop whose trip count is ``schedule.num_ticks``; its
  conditional has ``1 + k * B`` branches (idle, then ``F``, ``B``, ``BI``, ``W`` for each of
  the ``B`` distinct chunk programs, as :func:`tpipe.core.fused.tick_branches` numbers them; the
  last two only for a split backward).

  Args:
    compiled: a :class:`jax.stages.Compiled` (or its HLO text) of a step that differentiates a
      stack run with ``schedule``.
    schedule: the :class:`tpipe.schedules.FusedSchedule` it runs.
    programs: per model chunk, its chunk program (:meth:`tpipe.core.engine.Pipeline.programs`);
      default one program per model chunk.
    flops: a :class:`FlopCount` already computed for ``compiled`` (recomputed if None).

  Returns:
    A :class:`FusedFlops`; ``actions`` are per model chunk.
  """
  from tpipe import schedules as schedules_lib  # pylint: disable=g-import-not-at-top
  from tpipe.core import fused  # pylint: disable=g-import-not-at-top

  if not isinstance(schedule, schedules_lib.FusedSchedule):
    raise TypeError(f"schedule must be a tpipe.schedules.FusedSchedule, got "
                    f"{type(schedule).__name__}; use pipeline_flops for forward schedules.")
  module = _module(compiled)
  counter = _FlopCounter(module, executed=True)
  loops = [l for l in module.loops() if l.trip_count == schedule.num_ticks]
  num_virtual = schedule.num_stages * schedule.num_chunks
  programs = list(range(num_virtual)) if programs is None else list(programs)
  count = max(programs) + 1
  found = None
  for loop in loops:
    for ins in module.computations[loop.body].instructions:
      if ins.opcode == "conditional":
        names = [n.strip().lstrip("%") for n in
                 (ins.attr("branch_computations") or "").strip("{}").split(",") if n.strip()]
        if len(names) in (1 + 2 * count, 1 + 4 * count):
          found = (loop, ins, names)
  if found is None:
    raise ValueError(f"No tick loop of {schedule.num_ticks} trips with a conditional of "
                     f"{1 + 2 * count} or {1 + 4 * count} branches was found; pass the schedule "
                     "the step was compiled with and its pipeline's programs().")
  loop, _, names = found
  branch = np.array([counter.computation(n)[0] for n in names])
  kinds = ("F", "B", "BI", "W")
  actions = {}
  for k, kind in enumerate(kinds):
    part = branch[1 + k * count:1 + (k + 1) * count]
    actions[kind] = (part[programs] - branch[0] if part.size
                     else np.full(num_virtual, np.nan))
  table, _ = fused.tick_branches(schedule, programs)
  action_flops = np.where(table > 0, branch[table] - branch[0], 0.0)
  total = (flops if flops is not None else flop_count(compiled)).executed
  # The whole-program count takes the conditional's costliest branch on every trip; what is not
  # an action is the rest (the idle branch's own FLOPs count as routing, like every tick's).
  overhead = total - loop.outer * schedule.num_ticks * float(np.max(branch) - branch[0])
  return FusedFlops(actions=actions, per_stage=loop.outer * action_flops.sum(axis=0),
                    lockstep=loop.outer * float(action_flops.max(axis=1).sum()) + overhead,
                    overhead=overhead, num_stages=schedule.num_stages,
                    tick_loop=loop.instruction.name)


# --------------------------------------------------------------------------------------------
# Everything at once.


@dataclasses.dataclass(frozen=True)
class Analysis:
  """All measurements of one compiled step (see :func:`analyze`)."""

  memory: MemoryBreakdown
  flops: FlopCount
  collectives: tuple[Collective, ...]
  pipeline: PipelineFlops | None

  def collective_summary(self):
    return summarize_collectives(list(self.collectives))


def analyze(compiled, *, mesh=None, schedule=None, programs=None,
            inputs: Mapping[str, Any] | None = None) -> Analysis:
  """Memory, FLOPs, collectives and (given a schedule) useful FLOPs of a compiled step.

  Args:
    compiled: a :class:`jax.stages.Compiled`.
    mesh: the mesh it was compiled for (labels collectives with mesh axes).
    schedule: the pipeline schedule it runs (adds :class:`PipelineFlops`).
    programs: each model chunk's chunk program (:meth:`tpipe.core.engine.Pipeline.programs`),
      for a fused schedule.
    inputs: label -> abstract input pytree, to split the argument bytes (see
      :func:`memory_breakdown`).

  Returns:
    An :class:`Analysis`.
  """
  _check_compiled(compiled)
  module = _module(compiled)
  memory = memory_breakdown(compiled, inputs)
  flops = flop_count(compiled)
  found = tuple(collectives(module, mesh))
  pipe = (pipeline_flops(module, schedule, flops, programs) if schedule is not None
          else None)
  return Analysis(memory=memory, flops=flops, collectives=found, pipeline=pipe)


def format_bytes(n: float) -> str:
  """Human-readable bytes: ``1536 -> '1.50 KiB'``."""
  n = float(n)
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  return f"{n:.2f} TiB"
