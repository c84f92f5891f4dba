"""A step-time model from a compiled program's HLO text: roofline per instruction, collectives on
their links, asynchronous ones overlapped with the compute between their start and done.

:func:`estimate` prices any compiled program (a tpipe pipeline's train step, a plain
``jax.jit`` step, another framework's HLO dump) on a chip of :data:`CHIPS`:

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
* **loops**: a ``while`` body's time is multiplied by its trip count: the one XLA printed
  (``known_trip_count``, on CPU and GPU) or, where it printed none (the TPU compiler), the one
  read from the loop's counter (:func:`infer_trip_counts`: its start, step and bound
  constants). A ``conditional`` costs its slowest branch (every device waits for it in SPMD).

The program is followed in its printed order, which for a scheduled module (``is_scheduled=true``,
what ``compiled.as_text()`` prints) is the order it runs in. For a pipeline run with a fused
schedule, :func:`fused_action_seconds` prices each action's branch of the tick loop, and
:func:`pipeline_step_time` follows the table tick by tick as
:meth:`tpipe.schedules.FusedSchedule.simulate` does, so the bubble is counted.

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
from tpipe.tools import flops as flops_lib
from tpipe.tools import hlo as hlo_lib

# --------------------------------------------------------------------------------------------
# Chips.


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator's published figures.

  Attributes:
    name: ``"v5p"``, ``"h100"``, ...
    flops_per_second: dense bfloat16 peak FLOP/s.
    hbm_bytes_per_second: HBM bandwidth.
    ici: the fast link (TPU ICI inside a slice, NVLink inside a GPU node), per device and
      direction for a collective along one mesh axis.
    dcn: the slow link (TPU DCN between slices, InfiniBand between GPU nodes).
    source: where the figures come from.
  """

  name: str
  flops_per_second: float
  hbm_bytes_per_second: float
  ici: links_lib.Link
  dcn: links_lib.Link
  source: str

  def link(self, name: str) -> links_lib.Link:
    return {"ici": self.ici, "dcn": self.dcn}[name]


_TPU_SOURCE = ("Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v4, v5e, v5p, "
               "v6e): bf16 peak and HBM bandwidth per chip; ICI and DCN as "
               "tpipe.experimental.links states them")
# HBM bandwidth per chip, GB/s: v4 1200, v5e 819, v5p 2765, v6e 1640 (the pages above).
_TPU_HBM_GBPS = {"v4": 1200.0, "v5e": 819.0, "v5p": 2765.0, "v6e": 1640.0}


def _tpu(name: str) -> Chip:
  net = links_lib.INTERCONNECTS[name]  # Peak FLOP/s and links shared with the report's pricing.
  return Chip(name, net.flops_per_second, _TPU_HBM_GBPS[name] * 1e9, net.ici, net.dcn,
              _TPU_SOURCE)


def _gpu(name: str, hbm_tbps: float, source: str) -> Chip:
  # NVLink 4: 900 GB/s per GPU, both directions together: 450 GB/s each way. Between nodes one
  # 400 Gb/s InfiniBand NDR adapter per GPU (the DGX H100/H200 layout): 50 GB/s. Latencies are
  # assumptions as for TPUs: 1 us on NVLink, 10 us across nodes.
  return Chip(name, 989e12, hbm_tbps * 1e12, links_lib.Link("ici", 450e9, 1e-6),
              links_lib.Link("dcn", 400e9 / 8, 10e-6), source)


CHIPS: dict[str, Chip] = {
    **{name: _tpu(name) for name in ("v4", "v5e", "v5p", "v6e")},
    # H100 SXM5 datasheet (nvidia.com/en-us/data-center/h100): bf16 dense 989 TFLOP/s (1979
    # with sparsity), HBM3 3.35 TB/s, NVLink 900 GB/s.
    "h100": _gpu("h100", 3.35, "NVIDIA H100 SXM5 datasheet: bf16 dense 989 TFLOP/s, HBM3 "
                 "3.35 TB/s, NVLink 900 GB/s"),
    # H200 SXM datasheet (nvidia.com/en-us/data-center/h200): the H100's compute, HBM3e 4.8
    # TB/s, NVLink 900 GB/s.
    "h200": _gpu("h200", 4.8, "NVIDIA H200 SXM datasheet: bf16 dense 989 TFLOP/s, HBM3e "
                 "4.8 TB/s, NVLink 900 GB/s"),
}


def chip(name) -> Chip:
  """The :class:`Chip` called ``name``: a key of :data:`CHIPS`, a TPU topology
  (``"v5p:2x2x2"``), or a :class:`Chip` (returned as is).

  Raises:
    ValueError: an unknown chip, naming the choices.
  """
  if isinstance(name, Chip):
    return name
  key = str(name).split(":")[0].strip().lower()
  if key not in CHIPS:
    raise ValueError(f"Unknown chip {name!r}; choose one of {tuple(CHIPS)} (a TPU topology "
                     "such as 'v5p:2x2x2' names its chip), or pass a step_time.Chip with your "
                     "own figures.")
  return CHIPS[key]


# --------------------------------------------------------------------------------------------
# Loop trip counts the TPU compiler does not print.


def _constant(comp: hlo_lib.Computation, name: str) -> int | None:
  """The integer value of ``name`` in ``comp`` through copies and converts, or None."""
  for _ in range(8):
    ins = comp.by_name.get(name)
    if ins is None:
      return None
    if ins.opcode == "constant":
      m = re.fullmatch(r"\s*(-?\d+)\s*", ins.operands[0] if ins.operands else "")
      return int(m.group(1)) if m else None
    if ins.opcode not in ("copy", "convert", "bitcast") or not ins.operands:
      return None
    name = ins.operands[0]
  return None


def _tuple_index(comp: hlo_lib.Computation, name: str) -> int | None:
  """``k`` where ``name`` is ``get-tuple-element(parameter, index=k)`` (through copies)."""
  for _ in range(8):
    ins = comp.by_name.get(name)
    if ins is None:
      return None
    if ins.opcode == "get-tuple-element":
      source = comp.by_name.get(ins.operands[0])
      index = ins.attr("index")
      if source is not None and source.opcode == "parameter" and index is not None:
        return int(index)
      return None
    if ins.opcode not in ("copy", "convert", "bitcast") or not ins.operands:
      return None
    name = ins.operands[0]
  return None


_FLIP = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "NE": "NE", "EQ": "EQ"}


def _loop_bound(module: hlo_lib.HloModule, cond_name: str):
  """``(counter index, direction, bound)`` of a loop condition ``counter <op> constant``."""
  comp = module.computations.get(cond_name)
  root = next((i for i in comp.instructions if i.is_root), None) if comp else None
  if root is not None and root.opcode == "fusion" and root.called:
    # The compare fused: read it inside, mapping the fused parameters to the operands.
    inner = module.computations.get(root.called[0])
    inner_root = next((i for i in inner.instructions if i.is_root), None) if inner else None
    if inner_root is None or inner_root.opcode != "compare":
      return None
    outer = []
    for operand in inner_root.operands:
      op = inner.by_name.get(operand)
      if op is not None and op.opcode == "parameter":
        outer.append(root.operands[int(op.operands[0])])
      elif op is not None and op.opcode == "constant":
        outer.append(("constant", _constant(inner, operand)))
      else:
        return None
    compare, operands = inner_root, outer
  elif root is not None and root.opcode == "compare":
    compare, operands = root, list(root.operands)
  else:
    return None
  direction = compare.attr("direction")
  values = []
  for operand in operands:
    if isinstance(operand, tuple):
      values.append(("constant", operand[1]))
    else:
      index = _tuple_index(comp, operand)
      values.append(("counter", index) if index is not None
                    else ("constant", _constant(comp, operand)))
  if [v[0] for v in values] == ["constant", "counter"]:
    values, direction = values[::-1], _FLIP.get(direction)
  if [v[0] for v in values] != ["counter", "constant"] or values[1][1] is None:
    return None
  return values[0][1], direction, values[1][1]


def _trip_count(module: hlo_lib.HloModule, caller: hlo_lib.Computation,
                loop: hlo_lib.Instruction) -> int | None:
  """The trip count of ``while`` ``loop`` read from its counter, or None."""
  bound = _loop_bound(module, (loop.attr("condition") or "").lstrip("%"))
  body = module.computations.get((loop.attr("body") or "").lstrip("%"))
  init = caller.by_name.get(loop.operands[0]) if loop.operands else None
  if bound is None or body is None or init is None or init.opcode != "tuple":
    return None
  index, direction, limit = bound
  start = _constant(caller, init.operands[index]) if index < len(init.operands) else None
  root = next((i for i in body.instructions if i.is_root), None)
  if start is None or root is None or root.opcode != "tuple" or index >= len(root.operands):
    return None
  update = body.by_name.get(root.operands[index])
  if update is None or update.opcode not in ("add", "subtract") or len(update.operands) != 2:
    return None
  a, b = update.operands
  if _tuple_index(body, a) == index and _constant(body, b) is not None:
    step = _constant(body, b)
  elif update.opcode == "add" and _tuple_index(body, b) == index and _constant(body, a) is not None:
    step = _constant(body, a)
  else:
    return None
  step = -step if update.opcode == "subtract" else step
  if step > 0 and direction in ("LT", "LE"):
    span = limit - start + (1 if direction == "LE" else 0)
    return max(0, -(-span // step))
  if step < 0 and direction in ("GT", "GE"):
    span = start - limit + (1 if direction == "GE" else 0)
    return max(0, -(-span // -step))
  if step != 0 and direction == "NE" and (limit - start) % step == 0:
    return (limit - start) // step if (limit - start) // step >= 0 else None
  return None


def infer_trip_counts(module) -> dict[str, int | None]:
  """Per ``while`` instruction: the trip count XLA printed, else the one its counter gives.

  A loop ``lax.scan``/``fori_loop`` makes keeps a counter in its state tuple: started from a
  constant, stepped by a constant in the body, compared with a constant in the condition
  (``i < 5``). The TPU compiler prints no ``known_trip_count``; this reads the same number off
  those three constants. None where the loop has no such counter.

  Args:
    module: a compiled program, its HLO text or an :class:`tpipe.tools.hlo.HloModule`.
  """
  module = hlo_lib.module_of(module)
  out = {}
  for comp in module.computations.values():
    for ins in comp.instructions:
      if ins.opcode == "while":
        out[ins.name] = ins.trip_count if ins.trip_count is not None else _trip_count(
            module, comp, ins)
  return out


def with_trip_counts(module) -> hlo_lib.HloModule:
  """``module`` with the trip counts of :func:`infer_trip_counts` written where XLA printed none,
  so every tool reading ``known_trip_count`` (:func:`tpipe.tools.flops.flop_count`,
  :func:`tpipe.tools.flops.fused_flops`, ``multipliers()``) counts a TPU program's loops."""
  module = hlo_lib.module_of(module)
  counts = infer_trip_counts(module)
  computations = {}
  for name, comp in module.computations.items():
    instructions = []
    for ins in comp.instructions:
      if ins.opcode == "while" and ins.trip_count is None and counts.get(ins.name) is not None:
        ins = dataclasses.replace(
            ins, attrs=ins.attrs + f", known_trip_count={{n={counts[ins.name]}}}")
      instructions.append(ins)
    computations[name] = hlo_lib.Computation(name, comp.is_entry, instructions)
  return hlo_lib.HloModule(computations, module.entry, module.num_partitions, module.num_replicas)


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
  """Bytes a fusion reads of its ``index``-th operand: only the slices where every use is a
  dynamic slice of it or a dynamic update slice into it (the update written in place)."""
  param = next((i for i in fused.instructions
                if i.opcode == "parameter" and i.operands and i.operands[0] == str(index)), None)
  if param is None:
    return full
  users = [i for i in fused.instructions if param.name in i.operands]
  if not users:
    return 0
  read = 0
  for user in users:
    if user.opcode == "dynamic-slice" and user.operands[0] == param.name:
      read += hbm_bytes(user.shape)
    elif user.opcode == "dynamic-update-slice" and user.operands[0] == param.name:
      continue
    else:
      return full
  return read


def _written_bytes(comp: hlo_lib.Computation, ins: hlo_lib.Instruction) -> int:
  """Bytes an instruction (or a fusion's root) writes: an in-place dynamic update slice writes
  its update only."""
  if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:  # Into the result's memory.
    return min(hbm_bytes(ins.shape), hlo_lib.shape_bytes(_operand_shape(comp, ins.operands[1])))
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
    if root is not None and root.opcode in ("dynamic-update-slice", "tuple"):
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

COLLECTIVE_OPCODES = {
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
    "all-to-all": "all-to-all", "ragged-all-to-all": "all-to-all",
}


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
    result = hlo_lib.shape_bytes(ins.shape)
    if ins.opcode.endswith("-start"):  # Its result holds the operands too.
      result = max(0, result - operands)
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
          own.hidden += seconds  # Moved to exposed below for the part the done waits for.
        else:
          own.exposed += seconds
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
        end = pending.pop(ins.operands[0], None) if ins.operands else None
        if end is not None and end > now:
          wait = end - now
          own.hidden -= wait
          if op == "copy-done":
            own.memory += wait
          else:
            own.exposed += wait
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
    for end in pending.values():  # Started and never waited for here: the run ends after it.
      if end > now:
        own.exposed += end - now
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
                  trip_counts=trips, per_computation=per_computation)


# --------------------------------------------------------------------------------------------
# Pipelines: each action priced, the table followed tick by tick.


@dataclasses.dataclass(frozen=True)
class ActionSeconds:
  """Seconds of a fused schedule's actions, read from the branches of its compiled tick loop.

  Attributes:
    actions: per action kind (``F``, ``B``, ``BI``, ``W``), the mean seconds of one such action
      over the model chunks (what :meth:`tpipe.schedules.FusedSchedule.simulate` takes).
    outside: seconds per step outside the actions (each tick's routing, the sums after the
      loop, the optimizer).
    lockstep: the program's own time (:func:`estimate`: each tick as long as its slowest branch).
    tick_loop: the tick loop's ``while`` instruction.
  """

  actions: dict[str, float]
  outside: float
  lockstep: float
  tick_loop: str


def fused_action_seconds(hlo, schedule, chip_="v5p", *, programs=None, mesh=None,
                         axis_links: Mapping[str, str] | None = None) -> ActionSeconds:
  """Each action of a fused schedule's step priced as :func:`estimate` prices a program.

  The tick loop's conditionals hold one branch per action the table runs (idle first), as
  :func:`tpipe.tools.flops.fused_flops` reads them; an action's seconds are its branch's less
  the idle branch's (for an action run apart in a two-way conditional: less the branch passing
  the sums through).

  Args:
    hlo: the compiled step (or its HLO text) of a stack run with ``schedule``.
    schedule: the :class:`tpipe.schedules.FusedSchedule` it runs.
    chip_, mesh, axis_links: as for :func:`estimate`.
    programs: per model chunk, its chunk program (default one per model chunk).

  Raises:
    ValueError: no tick loop matching the schedule.
  """
  from tpipe import schedules as schedules_lib  # pylint: disable=g-import-not-at-top
  from tpipe.core import tick_rows  # pylint: disable=g-import-not-at-top

  module = with_trip_counts(hlo_lib.module_of(hlo))
  found = flops_lib.fused_flops(module, schedule, programs)  # Finds and checks the tick loop.
  spec = chip(chip_)
  if mesh is not None and axis_links is None:
    axis_links = links_lib.axis_links(mesh)
  pricer = _Pricer(module, spec, mesh, axis_links)
  lockstep = pricer.computation(module.entry).seconds
  loop = next(lp for lp in module.loops() if lp.instruction.name == found.tick_loop)
  programs = (list(range(schedule.num_stages * schedule.num_chunks)) if programs is None
              else list(programs))
  count = max(programs) + 1
  switches = tick_rows.lane_switches(schedule, programs)
  adding = lambda n: n > 0 and (n - 1) // count in (schedules_lib.Action.B,
                                                    schedules_lib.Action.W)
  conditionals = [flops_lib._branch_names(ins)  # pylint: disable=protected-access
                  for ins in module.computations[loop.body].instructions
                  if ins.opcode == "conditional"]
  sizes = lambda layout: [size for together, apart in layout
                          for size in [len(together)] * (len(together) > 1) + [2] * len(apart)]
  layout = None
  for flag in (lambda n: False, adding):
    candidate = [tick_rows.lane_groups([flag(n) for n in numbers]) for numbers in switches]
    if layout is None and [len(c) for c in conditionals] == sizes(candidate):
      layout = candidate
  seconds = lambda n: pricer.computation(n).seconds
  cost = np.full(1 + 4 * count, np.nan)
  busiest = 0.0
  branches = iter(conditionals)
  for numbers, (together, apart) in zip(switches, layout):
    if len(together) > 1:
      each = np.array([seconds(n) for n in next(branches)])
      busiest += float(each.max() - each[0])
      cost[[numbers[p] for p in together]] = each - each[0]
    for p in apart:
      passing, running = (seconds(n) for n in next(branches))
      busiest += max(running, passing) - passing
      cost[numbers[p]] = running - passing
  actions = {}
  for k, kind in enumerate(("F", "B", "BI", "W")):
    per_chunk = cost[1 + k * count + np.asarray(programs)]
    if np.all(np.isfinite(per_chunk)):
      actions[kind] = float(np.mean(per_chunk))
  outside = lockstep - loop.outer * schedule.num_ticks * busiest
  return ActionSeconds(actions=actions, outside=outside, lockstep=lockstep,
                       tick_loop=found.tick_loop)


@dataclasses.dataclass(frozen=True)
class PipelineTime:
  """A pipelined step followed tick by tick (:func:`pipeline_step_time`).

  Attributes:
    seconds: the step: the table's neighbour-synchronised time under the actions' seconds, plus
      what runs outside them.
    busy: the mean stage's actions' seconds.
    bubble: ``seconds - outside - busy``: the mean stage's idle and waiting time.
    outside: seconds outside the actions.
    lockstep: the program's time with every tick as long as its slowest branch.
    actions: the per-action seconds used.
  """

  seconds: float
  busy: float
  bubble: float
  outside: float
  lockstep: float
  actions: dict


def pipeline_step_time(hlo, schedule, chip_="v5p", *, programs=None, mesh=None,
                       axis_links: Mapping[str, str] | None = None) -> PipelineTime:
  """A fused schedule's step time with its bubble: :func:`fused_action_seconds` fed to the
  schedule's neighbour-synchronised simulation (:meth:`tpipe.schedules.FusedSchedule.simulate`),
  plus the time outside the actions. Arguments as for :func:`fused_action_seconds`."""
  priced = fused_action_seconds(hlo, schedule, chip_, programs=programs, mesh=mesh,
                                axis_links=axis_links)
  timing = schedule.simulate(priced.actions)
  busy = float(np.mean(timing.busy))
  return PipelineTime(seconds=timing.neighbour + priced.outside, busy=busy,
                      bubble=timing.neighbour - busy, outside=priced.outside,
                      lockstep=priced.lockstep, actions=dict(priced.actions))
