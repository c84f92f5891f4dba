"""A step-time model from a compiled program's HLO text: roofline per instruction, collectives on
their links, asynchronous ones overlapped with the compute between their start and done.

:func:`estimate` prices any compiled program (a tpipe pipeline's train step, a plain
``jax.jit`` step, another framework's HLO dump) on a chip of :data:`tpipe.tools.chips.CHIPS`:

* **compute and memory** (the roofline): each top-level instruction (a fusion, a dot, a copy...)
  takes ``max(flops / peak, hbm_bytes / hbm_bandwidth)``. FLOPs are counted as
  :mod:`tpipe.tools.flops` counts them (XLA's conventions); HBM bytes are the instruction's
  operand and result bytes (the roofline convention XLA's own cost analysis uses), except arrays
  in an on-chip memory space (``S(1)`` in a TPU layout) and the untouched part of a buffer that a
  dynamic slice reads from or a dynamic update slice writes into (only the slice or update
  counts). An instruction is *compute-bound* or *memory-bound* by which term is larger.
* **collectives**: per-device payload ``b`` over a group of ``n`` devices moves ``2 (n - 1) / n
  * b`` (all-reduce, as a ring), ``(n - 1) / n * b`` (all-gather, reduce-scatter, all-to-all: ``b``
  the larger of operand and result) or ``b`` (collective-permute) over the link of the mesh axes
  it spans (ICI or NVLink inside a slice or node, DCN or InfiniBand across), plus the link's
  latency once. A synchronous collective is exposed whole; an asynchronous pair (``*-start`` ...
  ``*-done``) runs beside the instructions between them and shows only where it outlasts them.
  Asynchronous copies (``copy-start``/``copy-done``, a TPU's prefetches) are priced the same way
  at the HBM bandwidth. Collectives share one network queue, copies one memory queue.
* **loops**: a ``while`` body's time is multiplied by its trip count: the one XLA printed or,
  where it printed none (the TPU compiler), the one read from the loop's counter
  (:mod:`tpipe.tools.trip_counts`). A ``conditional`` costs its slowest branch (SPMD waits).

The program is followed in its printed order, which for a scheduled module (``is_scheduled=true``,
what ``compiled.as_text()`` prints) is the order it runs in. For a pipeline run with a fused
schedule, :func:`tpipe.tools.pipeline_time.fused_action_seconds` prices each action's branch
of the tick loop, and :func:`tpipe.tools.pipeline_time.pipeline_step_time` follows the table
tick by tick as :meth:`tpipe.schedules.FusedSchedule.simulate` does, so the bubble is counted.

Example: a 64 x 128 @ 128 x 256 float32 matmul on TPU v5p (459 TFLOP/s, 2765 GB/s) reads 160
KiB and writes 64 KiB: memory-bound, ``229376 / 2765e9`` seconds::

  >>> text = '''HloModule m, is_scheduled=true
  ...
  ... ENTRY %main (a: f32[64,128], b: f32[128,256]) -> f32[64,256] {
  ...   %a = f32[64,128]{1,0} parameter(0)
  ...   %b = f32[128,256]{1,0} parameter(1)
  ...   ROOT %d = f32[64,256]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ... }'''
  >>> t = estimate(text, "v5p")
  >>> t.flops, t.hbm_bytes, round(t.seconds * 1e9, 1)
  (4194304.0, 229376.0, 83.0)
  >>> {part: round(seconds * 1e9, 1) for part, seconds in t.breakdown().items()}
  {'compute': 0.0, 'memory': 83.0, 'exposed collectives': 0.0}

Limits: one HBM bandwidth and one peak per chip (no separate vector-unit rate, so elementwise
work is priced at the matrix peak, where it is memory-bound anyway); no cache reuse between
instructions; collectives queue one after another on one link; latencies are assumptions
(:mod:`tpipe.experimental.links`). The model is a roofline: a lower bound a real step
approaches, not a measurement.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Mapping

import numpy as np

from tpipe.experimental import links as links_lib
from tpipe.tools import analysis
from tpipe.tools import flops as flops_lib
from tpipe.tools import hlo as hlo_lib
from tpipe.tools.chips import CHIPS  # noqa: F401  (part of this module's surface)
from tpipe.tools.chips import Chip
from tpipe.tools.chips import chip
from tpipe.tools.trip_counts import infer_trip_counts  # noqa: F401
from tpipe.tools.trip_counts import with_trip_counts

# --------------------------------------------------------------------------------------------
# Bytes.

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
# Instructions that move no data themselves (the called computations' instructions are priced).
_NO_TRAFFIC = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "while",
    "conditional", "call",
})


def hbm_bytes(shape: str) -> int:
  """Bytes of an HLO shape string held in HBM: arrays in another memory space (a TPU layout's
  ``S(1)``, on-chip memory) left out."""
  total = 0
  for dtype, dims, layout in _ARRAY.findall(shape):
    space = re.search(r"S\((\d+)\)", layout or "")
    if space and space.group(1) != "0":
      continue
    total += sum(a.nbytes for a in hlo_lib.parse_shape(f"{dtype}[{dims}]"))
  return total


def _operand_shape(comp: hlo_lib.Computation, name: str) -> str:
  ins = comp.by_name.get(name)
  return ins.shape if ins is not None else ""


def _fused_parameter_bytes(fused: hlo_lib.Computation, index: int, full: int) -> int:
  """Bytes a fusion reads of its ``index``-th operand: only the slices where every use (through
  bitcasts) is a slice or dynamic slice of it, or a dynamic update slice into it (the update
  written in place)."""
  param = next((i for i in fused.instructions
                if i.opcode == "parameter" and i.operands and i.operands[0] == str(index)), None)
  if param is None:
    return full
  read, pending = 0, [param.name]
  while pending:
    name = pending.pop()
    for user in (i for i in fused.instructions if name in i.operands):
      if user.opcode == "bitcast":
        pending.append(user.name)
      elif user.opcode in ("dynamic-slice", "slice") and user.operands[0] == name:
        read += hlo_lib.shape_bytes(user.shape)
      elif not (user.opcode == "dynamic-update-slice" and user.operands[0] == name):
        return full
  return min(read, full)


def _written_bytes(comp: hlo_lib.Computation, ins: hlo_lib.Instruction) -> int:
  """Bytes an instruction (or a fusion's root) writes: an in-place dynamic update slice writes
  its update only."""
  if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:  # Into the result's memory.
    return min(hbm_bytes(ins.shape), hlo_lib.shape_bytes(_operand_shape(comp, ins.operands[1])))
  if ins.opcode == "bitcast" and ins.operands and ins.operands[0] in comp.by_name:
    return _written_bytes(comp, comp.by_name[ins.operands[0]])
  if ins.opcode == "tuple":
    return sum(_written_bytes(comp, comp.by_name[o]) if o in comp.by_name else 0
               for o in ins.operands)
  return hbm_bytes(ins.shape)


def instruction_bytes(module: hlo_lib.HloModule, comp: hlo_lib.Computation,
                      ins: hlo_lib.Instruction) -> int:
  """HBM bytes one run of top-level instruction ``ins`` reads and writes (module docstring)."""
  if ins.opcode in _NO_TRAFFIC or ins.opcode.endswith("-done"):
    return 0
  operands = [hbm_bytes(_operand_shape(comp, o)) for o in ins.operands]
  if ins.opcode == "fusion" and ins.called and ins.called[0] in module.computations:
    fused = module.computations[ins.called[0]]
    read = sum(_fused_parameter_bytes(fused, i, b) for i, b in enumerate(operands))
    root = next((i for i in fused.instructions if i.is_root), None)
    if root is not None and root.opcode in ("dynamic-update-slice", "tuple", "bitcast"):
      return read + _written_bytes(fused, root)
    return read + hbm_bytes(ins.shape)
  if ins.opcode == "dynamic-slice":
    return 2 * hbm_bytes(ins.shape) + sum(operands[1:])
  if ins.opcode == "dynamic-update-slice":
    return sum(operands[1:]) + _written_bytes(comp, ins)
  if ins.opcode == "copy-start":  # The copy's one side in HBM (the other is on chip).
    return max(operands[0] if operands else 0, hbm_bytes(ins.shape) - sum(operands))
  return sum(operands) + hbm_bytes(ins.shape)


# --------------------------------------------------------------------------------------------
# Collectives.

COLLECTIVE_OPCODES = analysis.COLLECTIVE_OPCODES


def ring_factor(kind: str, group_size: int) -> float:
  """The share of a collective's per-device payload each device sends over its link: ``2 (n -
  1) / n`` for an all-reduce (a ring's reduce-scatter then all-gather), ``(n - 1) / n`` for an
  all-gather, a reduce-scatter or an all-to-all, 1 for a collective-permute, 0 for a group of
  one device."""
  n = group_size
  if n <= 1:
    return 0.0
  if kind == "all-reduce":
    return 2.0 * (n - 1) / n
  if kind == "collective-permute":
    return 1.0
  return (n - 1) / n


def _axes_spanned(groups, mesh) -> tuple[str, ...]:
  shape = tuple(mesh.devices.shape)
  varying = set()
  for group in groups:
    if len(group) < 2 or max(group) >= math.prod(shape):
      continue
    coords = np.array(np.unravel_index(np.array(group), shape)).T
    varying.update(a for a in range(len(shape)) if len(set(coords[:, a].tolist())) > 1)
  return tuple(mesh.axis_names[a] for a in sorted(varying))


# --------------------------------------------------------------------------------------------
# Convolutions, counted exactly.


# --------------------------------------------------------------------------------------------
# The estimate.

# The name JAX gives the forward ops jax.checkpoint recomputes in the backward pass (in their
# op_name metadata).
_REMAT = "rematted_computation"


@dataclasses.dataclass
class _Time:
  """One run of a computation: seconds by category, and what it moves."""

  compute: float = 0.0
  memory: float = 0.0
  exposed: float = 0.0  # Collectives' (and asynchronous copies') time not hidden.
  hidden: float = 0.0   # Collectives' time that ran beside compute.
  recompute: float = 0.0  # Compute and memory time of rematerialised instructions.
  flops: float = 0.0
  hbm_bytes: float = 0.0
  collective_bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  # The collectives' part of ``exposed``, by ``(kind, mesh axes)``.
  exposed_by: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  @property
  def seconds(self) -> float:
    return self.compute + self.memory + self.exposed

  def add(self, other: "_Time", times: float = 1.0) -> None:
    self.compute += times * other.compute
    self.memory += times * other.memory
    self.exposed += times * other.exposed
    self.hidden += times * other.hidden
    self.recompute += times * other.recompute
    self.flops += times * other.flops
    self.hbm_bytes += times * other.hbm_bytes
    for key, value in other.collective_bytes.items():
      self.collective_bytes[key] += times * value
    for key, value in other.exposed_by.items():
      self.exposed_by[key] += times * value

  def expose(self, seconds: float, key) -> None:
    """Counts ``seconds`` of collective ``key`` (None: an asynchronous copy) as exposed."""
    self.exposed += seconds
    if key is not None:
      self.exposed_by[key] += seconds


@dataclasses.dataclass(frozen=True)
class ComputationCost:
  """One computation's own instructions (not what its loops and branches call), per step.

  Attributes:
    runs: how many times it runs per step (the trip counts of the loops around it; a
      conditional's every branch counts its caller's runs).
    flops, hbm_bytes: per step, ``runs`` times one run's.
    collective_bytes: per step, by ``(kind, mesh axes)`` (axes None without a mesh).
    seconds: per step: one run's roofline and exposed collective time, times ``runs``.
  """

  runs: int
  flops: float
  hbm_bytes: float
  collective_bytes: dict
  seconds: float


@dataclasses.dataclass(frozen=True)
class StepTime:
  """The predicted time of one run of a compiled program, per device (:func:`estimate`).

  Attributes:
    chip: the :class:`Chip` priced.
    seconds: the predicted step time.
    compute_seconds: time of the compute-bound instructions (FLOPs over the peak).
    memory_seconds: time of the memory-bound instructions (bytes over the HBM bandwidth), and of
      asynchronous copies that outlast the work beside them.
    exposed_collective_seconds: collective time the step waits for: synchronous collectives
      whole, asynchronous ones where they outlast the work between start and done.
    exposed_by: that time by ``(kind, mesh axes)`` (axes None without a mesh), for example the
      all-to-alls over ``expert`` alone: ``exposed_by[("all-to-all", ("expert",))]``.
    hidden_collective_seconds: collective time that ran beside other work.
    recompute_seconds: the part of compute and memory time spent on instructions
      ``jax.checkpoint`` rematerialises (``rematted_computation`` in their op_name; a fused
      schedule's backward recomputing its chunk's forward inside its own ``jax.vjp`` is not
      marked so, and counts as backward work).
    flops: FLOPs executed (loop bodies times trip counts; a conditional's costliest branch).
    hbm_bytes: HBM bytes read and written.
    collective_bytes: per ``(kind, mesh axes)``, payload bytes per device per step (axes None
      without a mesh).
    trip_counts: per ``while`` instruction, the trip count used (None: unknown, counted once).
    per_computation: per computation reached, its :class:`ComputationCost`.
  """

  chip: Chip
  seconds: float
  compute_seconds: float
  memory_seconds: float
  exposed_collective_seconds: float
  hidden_collective_seconds: float
  recompute_seconds: float
  flops: float
  hbm_bytes: float
  collective_bytes: dict
  trip_counts: dict
  exposed_by: dict = dataclasses.field(default_factory=dict)
  per_computation: dict = dataclasses.field(repr=False, default_factory=dict)

  def breakdown(self) -> dict[str, float]:
    """Where the time goes: ``compute``, ``memory`` and ``exposed collectives`` seconds."""
    return {"compute": self.compute_seconds, "memory": self.memory_seconds,
            "exposed collectives": self.exposed_collective_seconds}

  def mfu(self, model_flops: float, seconds: float | None = None) -> float:
    """Model FLOPs utilisation: ``model_flops`` (per device) over ``seconds`` (default the
    predicted step) at the chip's peak."""
    return model_flops / ((self.seconds if seconds is None else seconds)
                          * self.chip.flops_per_second)


class _Pricer:
  """Prices computations of one module on one chip, each computation once."""

  def __init__(self, module: hlo_lib.HloModule, chip_: Chip, mesh=None,
               axis_links: Mapping[str, str] | None = None):
    self.module = module
    self.chip = chip_
    self.mesh = mesh
    self.links = dict(axis_links or {})
    self.counter = flops_lib._FlopCounter(module, executed=True)  # pylint: disable=protected-access
    self.num_devices = module.num_partitions * module.num_replicas
    self._cache: dict[str, _Time] = {}
    self.own: dict[str, _Time] = {}  # Each computation's own instructions, one run.

  def collective(self, comp, ins, kind: str) -> tuple[float, tuple, float]:
    """``(seconds, (kind, axes), payload bytes)`` of one run of a collective."""
    operands = sum(hlo_lib.shape_bytes(_operand_shape(comp, o)) for o in ins.operands)
    if ins.opcode.endswith("-start"):  # Its result tuple holds the operand, result, contexts.
      result = max((a.nbytes for a in hlo_lib.parse_shape(ins.shape) if a.dims), default=0)
    else:
      result = hlo_lib.shape_bytes(ins.shape)
    payload = max(operands, result)
    try:
      groups = ins.device_groups(self.num_devices)
    except ValueError:
      groups = [list(range(self.num_devices))]
    size = max((len(g) for g in groups), default=1)
    if kind == "collective-permute":
      size = 2 if any(len(g) == 2 and g[0] != g[1] for g in groups) else 1
    axes = _axes_spanned(groups, self.mesh) if self.mesh is not None else None
    link = self.chip.link("dcn" if any(self.links.get(a) == "dcn" for a in axes or ()) else "ici")
    factor = ring_factor(kind, size)
    seconds = link.latency_seconds + factor * payload / link.bytes_per_second if factor else 0.0
    return seconds, (kind, axes), float(payload)

  def exposed_keys(self) -> set:
    """The ``(kind, mesh axes)`` of every collective that left time exposed in a computation
    priced so far."""
    return {key for t in self._cache.values() for key, seconds in t.exposed_by.items()
            if seconds}

  def _async_kind(self, ins) -> str | None:
    """The collective kind an ``async-start`` wraps, or None."""
    for name in ins.called:
      called = self.module.computations.get(name)
      for inner in called.instructions if called is not None else ():
        if inner.opcode in COLLECTIVE_OPCODES:
          return COLLECTIVE_OPCODES[inner.opcode]
    return None

  def computation(self, name: str) -> _Time:
    """One run of computation ``name``, what it calls included."""
    if name in self._cache:
      return self._cache[name]
    comp = self.module.computations[name]
    total, own = _Time(), _Time()
    now = 0.0  # The compute stream's clock in this run.
    queues = {"network": 0.0, "memory": 0.0}  # When each asynchronous queue is free.
    pending: dict[str, float] = {}  # Started asynchronous work: when it ends.
    what: dict[str, tuple] = {}  # A started collective's (kind, axes).
    for ins in comp.instructions:
      op = ins.opcode
      kind = COLLECTIVE_OPCODES.get(op)
      if op == "async-start":
        kind = self._async_kind(ins)
      if kind is not None:
        seconds, key, payload = self.collective(comp, ins, kind)
        own.collective_bytes[key] += payload
        own.flops += self.counter.instruction(comp, ins)[0]  # An all-reduce's sums.
        if op.endswith("-start"):
          begin = max(now, queues["network"])
          queues["network"] = pending[ins.name] = begin + seconds
          what[ins.name] = key
          own.hidden += seconds  # Moved to exposed below for the part the done waits for.
        else:
          own.expose(seconds, key)
          now += seconds
        continue
      if op == "copy-start":
        seconds = instruction_bytes(self.module, comp, ins) / self.chip.hbm_bytes_per_second
        own.hbm_bytes += instruction_bytes(self.module, comp, ins)
        begin = max(now, queues["memory"])
        queues["memory"] = pending[ins.name] = begin + seconds
        own.hidden += seconds
        continue
      if op.endswith("-done"):
        started = ins.operands[0] if ins.operands else None
        end = pending.pop(started, None)
        if end is not None and end > now:
          wait = end - now
          own.hidden -= wait
          if op == "copy-done":
            own.memory += wait
          else:
            own.expose(wait, what.get(started))
          now = end
        continue
      if op in ("while", "conditional", "call") or (op == "async-start" and ins.called):
        inner = self._control(comp, ins)
        total.add(inner)
        now += inner.seconds
        continue
      flops = self.counter.instruction(comp, ins)[0]
      nbytes = instruction_bytes(self.module, comp, ins)
      compute = flops / self.chip.flops_per_second
      memory = nbytes / self.chip.hbm_bytes_per_second
      own.flops += flops
      own.hbm_bytes += nbytes
      if compute >= memory:
        own.compute += compute
      else:
        own.memory += memory
      if _REMAT in ins.attrs:
        own.recompute += max(compute, memory)
      now += max(compute, memory)
    for started, end in pending.items():  # Never waited for here: the run ends after it.
      if end > now:
        own.expose(end - now, what.get(started))
        own.hidden -= end - now
        now = end
    total.add(own)
    self.own[name] = own
    self._cache[name] = total
    return total

  def _control(self, comp, ins) -> _Time:
    out = _Time()
    if ins.opcode == "while":
      trips = ins.trip_count or 1
      for key in ("body", "condition"):
        out.add(self.computation(ins.attr(key).lstrip("%")), trips)
    elif ins.opcode == "conditional":
      branches = [self.computation(c) for c in ins.called if c in self.module.computations]
      if branches:
        out.add(max(branches, key=lambda t: t.seconds))
    else:
      for c in ins.called:
        if c in self.module.computations:
          out.add(self.computation(c))
    return out


def estimate(hlo, chip_="v5p", *, mesh=None, axis_links: Mapping[str, str] | None = None
             ) -> StepTime:
  """Predicted time of one run of a compiled program on ``chip_`` (see the module docstring).

  Args:
    hlo: a :class:`jax.stages.Compiled`, its HLO text (``compiled.as_text()``, or any
      optimised HLO module's text) or a parsed :class:`tpipe.tools.hlo.HloModule`.
    chip_: a key of :data:`CHIPS` (``"v5p"``, ``"h100"``), a TPU topology name
      (``"v5p:2x2x2"``) or a :class:`Chip`.
    mesh: the :class:`jax.sharding.Mesh` it was compiled for: labels collectives with the mesh
      axes they span and picks their link (:func:`tpipe.experimental.links.axis_links` of the
      mesh unless ``axis_links`` is given). Without it every collective is priced on ICI.
    axis_links: per mesh axis, ``"ici"`` or ``"dcn"``.

  Returns:
    A :class:`StepTime`, per device.

  Raises:
    ValueError: an unknown chip; TypeError: not a compiled program or HLO text.
  """
  spec = chip(chip_)
  module = with_trip_counts(hlo_lib.module_of(hlo))
  if mesh is not None and axis_links is None:
    try:
      axis_links = links_lib.axis_links(mesh)
    except (AttributeError, TypeError, ValueError):
      axis_links = None
  pricer = _Pricer(module, spec, mesh, axis_links)
  total = pricer.computation(module.entry)
  runs = module.multipliers()
  per_computation = {}
  for name, own in pricer.own.items():
    n = runs.get(name, 0)
    per_computation[name] = ComputationCost(
        runs=n, flops=n * own.flops, hbm_bytes=n * own.hbm_bytes,
        collective_bytes={k: n * v for k, v in own.collective_bytes.items()},
        seconds=n * own.seconds)
  trips = {ins.name: ins.trip_count for _, ins in module.instructions() if ins.opcode == "while"}
  return StepTime(chip=spec, seconds=total.seconds, compute_seconds=total.compute,
                  memory_seconds=total.memory, exposed_collective_seconds=total.exposed,
                  hidden_collective_seconds=total.hidden, recompute_seconds=total.recompute,
                  flops=total.flops,
                  hbm_bytes=total.hbm_bytes, collective_bytes=dict(total.collective_bytes),
                  trip_counts=trips, exposed_by=dict(total.exposed_by),
                  per_computation=per_computation)
