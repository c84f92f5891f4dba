"""What is live at a compiled program's memory peak, and why: every buffer with a role.

XLA's buffer assignment knows, for the optimised per-device program, where each value lives
(``*-buffer-assignment.txt``: allocation, offset, size) and when (``*-live-range.txt``: each
value's first and last position in the flattened schedule), next to the optimised HLO text
(``*after_optimizations.txt``), all written with ``--xla_dump_to``. The **peak** is the position
where the most bytes are in use, values that share a buffer counted once
(:func:`busiest_time`); without the assignment, the live-range file's own ``Live ranges at N
(peak):`` list, which sums values one by one and can miss the real peak (a loop's in-place
updates). This module reads them and gives every value live at the peak a **role**:

========================  ==================================================================
role                      what it is
========================  ==================================================================
parameters                the step's parameter arguments (``state.params``)
optimizer state           the optimizer's arguments (``state.opt_state``)
batch and other inputs    every other argument
gradient accumulators     parameter-shaped values in the parameters' dtype that the program
                          computes: the running gradient sums and each tick's gradient; and
                          the sums over devices after the loop (all-reduce, reduce-scatter)
weight casts              parameter-shaped values in another float dtype (bfloat16 copies),
                          and any cast, slice or re-shaping of a parameter argument
parameter copies          slices, re-shapings and copies of a parameter argument in its own
                          dtype (a packed buffer's pieces, a relaid-out weight)
stash                     what the forward tick loop keeps for the backward (its residuals)
mailbox                   stage-to-stage messages (``ppermute``) and the mailboxes holding them
boundary buffers          the pipeline's output, loop-back and micro-batch buffers
logits and loss           values computed by the head and its loss
remat working set         intermediates a checkpointed chunk recomputes in its backward
backward working set      other values of the backward pass
forward working set       other values of the forward pass
other                     what no rule explains
========================  ==================================================================

The role comes from the value's origin: a loop-carried value (a ``while`` loop's parameter or
result) is traced back to the operand that started it, then named by the ``op_name`` metadata of
the instruction that made it, which carries JAX's name stack (``jvp(...)``, ``transpose(...)``,
``checkpoint``, module names and the named scopes tpipe's engine adds, such as
``tpipe_mailbox``). Python and NumPy only; :func:`breakdown_of_lowered` compiles a lowered JAX
program with the dump options and reads the files back.

Example (``text`` and ``hlo`` from one dump)::

  >>> hlo = '''HloModule m
  ...
  ... ENTRY %main (x: f32[4]) -> f32[4] {
  ...   %x = f32[4]{0} parameter(0), metadata={op_name="state.params"}
  ...   ROOT %g = f32[4]{0} negate(f32[4]{0} %x), metadata={op_name="jit(f)/transpose(jvp())/neg"}
  ... }'''
  >>> live = '''  Live ranges at 1 (peak):
  ...     x{}: 16 bytes (cumulative: 16 bytes)
  ...     g{}: 16 bytes (cumulative: 32 bytes)'''
  >>> [(v.name, v.role) for v in peak_values(live, hlo)]  # g: parameter-shaped, float32
  [('x{}', 'parameters'), ('g{}', 'gradient accumulators')]
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile
from typing import Iterable, Sequence

import numpy as np

from tpipe.tools import hlo as hlo_lib

ROLES = ("parameters", "optimizer state", "batch and other inputs", "gradient accumulators",
         "weight casts", "parameter copies", "stash", "mailbox", "boundary buffers",
         "logits and loss", "remat working set", "backward working set", "forward working set",
         "other")
# Roles of the step's arguments (the rest are temporaries).
ARGUMENT_ROLES = ("parameters", "optimizer state", "batch and other inputs")
# The named scopes tpipe's tick loops put around the buffers they allocate.
SCOPE_ROLES = {"tpipe_stash": "stash", "tpipe_mailbox": "mailbox",
               "tpipe_boundary": "boundary buffers", "tpipe_gradients": "gradient accumulators"}
# Name-stack fragments that mark the head and its loss (module names of tpipe's models, jax's
# and optax's loss functions).
DEFAULT_HEAD_SCOPES = ("LMHead", "PoolHead", "log_softmax", "logsumexp", "cross_entropy")

_PEAK = re.compile(r"Live ranges at \d+ \(peak\):")
_BUFFER_RANGES = re.compile(r"^\s*BufferLiveRange:\s*$", re.M)
_RANGE = re.compile(r"^\s*([\w.\-]+)\{([\d,]*)\}:(\d+)-(\d+)\s*$")
_LIVE_VALUE = re.compile(r"^\s*([\w.\-]+)\{([\d,]*)\}:\s*(\d+) bytes")
_ALLOCATION = re.compile(r"^allocation (\d+):")
_ASSIGNED = re.compile(r"value: <\d+ ([\w.\-]+)(?:\{([\d,]*)\})?[^>]*> \(size=(\d+),offset=(\d+)\)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_GTE_INDEX = re.compile(r"index=(\d+)")
_FLOAT_TYPES = ("f64", "f32", "bf16", "f16", "f8e4m3fn", "f8e5m2")
# Collectives that sum over devices (a step's gradient reductions).
_REDUCING = ("all-reduce", "reduce-scatter")
# Instructions that copy, cast, slice or re-shape their one non-constant input.
_COPYING = ("convert", "copy", "bitcast", "reshape", "slice", "dynamic-slice", "transpose",
            "broadcast", "fusion", "get-tuple-element")


@dataclasses.dataclass(frozen=True)
class LiveValue:
  """One value live at the peak.

  Attributes:
    name: the HLO value, ``instruction{index}`` as buffer assignment prints it.
    bytes: its size.
    shape: its array shape as printed (``"bf16[19,2,1024,2048]"``), or ``""`` if unknown.
    origin: the ``op_name`` of the instruction that made it (through loops), or ``""``.
    role: one of :data:`ROLES`.
    in_output: it lives in a buffer the program returns (buffer assignment may put a value
      made during the step in an output's buffer, or a donated argument's, before the output
      is written there), not in the temporaries' allocation; False when the buffer assignment
      was not read.
  """

  name: str
  bytes: int
  shape: str
  origin: str
  role: str
  in_output: bool = False


@dataclasses.dataclass(frozen=True)
class PeakBreakdown:
  """The values live at a program's memory peak, by role.

  Attributes:
    values: every live value, largest first.
    allocated_temporaries: the bytes buffer assignment reserves for temporaries in the default
      memory space (it packs buffers live at different times into them, so they exceed what is
      live at the peak by what the packing could not overlap), or None when not read.
  """

  values: tuple[LiveValue, ...]
  allocated_temporaries: int | None = None

  @property
  def total(self) -> int:
    return sum(v.bytes for v in self.values)

  def by_role(self) -> dict[str, int]:
    """Bytes per role, in :data:`ROLES` order (roles with nothing live left out)."""
    sums = {role: 0 for role in ROLES}
    for v in self.values:
      sums[v.role] += v.bytes
    return {role: n for role, n in sums.items() if n}

  @property
  def arguments(self) -> int:
    return sum(v.bytes for v in self.values if v.role in ARGUMENT_ROLES)

  @property
  def temporaries(self) -> int:
    """Bytes live at the peak that are not arguments."""
    return self.total - self.arguments

  @property
  def in_outputs(self) -> int:
    """Bytes of the temporaries that live in output buffers (counted by ``memory_analysis()``
    as outputs, not temporaries)."""
    return sum(v.bytes for v in self.values if v.in_output and v.role not in ARGUMENT_ROLES)

  @property
  def in_temporaries(self) -> int:
    """Bytes of the temporaries that live in the temporaries' allocation."""
    return self.temporaries - self.in_outputs

  @property
  def unexplained(self) -> int:
    return sum(v.bytes for v in self.values if v.role == "other")

  def largest(self, count: int = 12) -> tuple[LiveValue, ...]:
    return self.values[:count]

  def format(self, count: int = 12) -> str:
    """A table of bytes per role and the ``count`` largest values."""
    gib = _format_bytes
    lines = [f"Live at the peak: {gib(self.total)} (arguments {gib(self.arguments)}, "
             f"temporaries {gib(self.temporaries)}, {gib(self.in_outputs)} of them in output "
             f"buffers; unexplained {gib(self.unexplained)})."]
    if self.allocated_temporaries is not None:
      lines[0] += (f" Buffer assignment reserves {gib(self.allocated_temporaries)} for "
                   "temporaries (buffers live at other times packed around these).")
    lines += ["", "| role | bytes | share |", "|---|---:|---:|"]
    for role, n in self.by_role().items():
      lines.append(f"| {role} | {gib(n)} | {n / max(self.total, 1):.1%} |")
    lines += ["", "| largest values | shape | bytes | role | made by |", "|---|---|---:|---|---|"]
    for v in self.largest(count):
      origin = v.origin if len(v.origin) <= 90 else "..." + v.origin[-87:]
      lines.append(f"| `{v.name}` | `{v.shape}` | {gib(v.bytes)} | {v.role} | "
                   f"`{origin}` |")
    return "\n".join(lines)


def _format_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  return f"{n:.2f} GiB"


def parse_peak(live_range_text: str) -> list[tuple[str, tuple[int, ...], int]]:
  """``(instruction, tuple index, bytes)`` of every value in the peak section of a
  ``*-live-range.txt`` dump."""
  match = _PEAK.search(live_range_text)
  if match is None:
    raise ValueError("no 'Live ranges at N (peak):' section in the live-range text; pass the "
                     "*-live-range.txt file XLA writes with --xla_dump_to.")
  values = []
  for line in live_range_text[match.end():].splitlines()[1:]:
    found = _LIVE_VALUE.match(line)
    if found is None:
      break
    name, index, size = found.groups()
    values.append((name, tuple(int(i) for i in index.split(",") if i), int(size)))
  return values


def parse_live_ranges(live_range_text: str) -> list[tuple[str, tuple[int, ...], int, int]]:
  """``(instruction, tuple index, first, last)`` of every value in the ``BufferLiveRange``
  section of a ``*-live-range.txt`` dump: the positions in the flattened schedule where the
  value is defined and last used; empty if the section is missing."""
  match = _BUFFER_RANGES.search(live_range_text)
  if match is None:
    return []
  ranges = []
  for line in live_range_text[match.end():].splitlines()[1:]:
    found = _RANGE.match(line)
    if found is None:
      break
    name, index, first, last = found.groups()
    ranges.append((name, tuple(int(i) for i in index.split(",") if i), int(first), int(last)))
  return ranges


def busiest_time(ranges, placed: dict) -> int | None:
  """The schedule position at which the most bytes are in use, and None without placed values.

  At a position, what is in use is, per allocation, the union of the byte ranges
  ``[offset, offset + size)`` of the values live there (``ranges``: :func:`parse_live_ranges`;
  ``placed``: :func:`parse_assignment`), so values that share a buffer (a loop's carried value
  and its updates) count once. This is where the buffer assignment's reservation is filled most;
  the dump's own ``(peak)`` section sums values one by one and can miss it by far (a loop's
  in-place updates).
  """
  rows = [(placed[(name, index)], first, last) for name, index, first, last in ranges
          if (name, index) in placed]
  if not rows:
    return None
  # One number line for all allocations, each far past the one before (sizes < 2**40), so a
  # running maximum of range ends never carries from one allocation into the next.
  base = np.array([where[0] for where, _, _ in rows], np.int64) << 42
  lo = base + np.array([where[1] for where, _, _ in rows], np.int64)
  hi = lo + np.array([where[2] for where, _, _ in rows], np.int64)
  first = np.array([r[1] for r in rows])
  last = np.array([r[2] for r in rows])
  order = np.argsort(lo, kind="stable")
  lo, hi, first, last = lo[order], hi[order], first[order], last[order]
  best, best_time = -1, None
  for t in np.unique(first):  # What is in use only grows where a value starts.
    live = (first <= t) & (last >= t)
    a, b = lo[live], hi[live]
    # Each range counts past the furthest end of the ranges before it: the union's length.
    reach = np.maximum.accumulate(np.r_[a[:1], b[:-1]])
    used = int(np.maximum(b - np.maximum(a, reach), 0).sum())
    if used > best:
      best, best_time = used, int(t)
  return best_time


def temporary_allocation(buffer_assignment_text: str) -> int:
  """Bytes of the ``preallocated-temp`` allocations of the default memory space (color 0) in a
  ``*-buffer-assignment.txt`` dump."""
  total = 0
  for line in buffer_assignment_text.splitlines():
    found = re.match(r"^allocation \d+: size (\d+), (.*)$", line)
    if found and "preallocated-temp" in found.group(2) and "color" not in found.group(2):
      total += int(found.group(1))
  return total


def output_allocations(buffer_assignment_text: str) -> set[int]:
  """The allocations of a ``*-buffer-assignment.txt`` dump that may hold the program's
  outputs (``maybe-live-out``: output buffers of their own and donated arguments')."""
  found = (re.match(r"^allocation (\d+): .*maybe-live-out", line)
           for line in buffer_assignment_text.splitlines())
  return {int(m.group(1)) for m in found if m and "preallocated-temp" not in m.group(0)}


def parse_assignment(buffer_assignment_text: str) -> dict:
  """``{(instruction, tuple index): (allocation, offset, bytes)}`` from a
  ``*-buffer-assignment.txt`` dump: where each value lives. Values that alias (a loop's
  initial value, its body parameter and its result) share an allocation and offset; the bytes
  include the target's padding (TPU tiles)."""
  placed, allocation = {}, None
  for line in buffer_assignment_text.splitlines():
    found = _ALLOCATION.match(line)
    if found:
      allocation = int(found.group(1))
      continue
    found = _ASSIGNED.search(line)
    if found and allocation is not None:
      name, index, size, offset = found.groups()
      key = (name, tuple(int(i) for i in (index or "").split(",") if i))
      placed[key] = (allocation, int(offset), int(size))
  return placed


class _Origins:
  """Traces values through tuples, tuple elements, loops and calls to what made them."""

  def __init__(self, module: hlo_lib.HloModule):
    self.by_name: dict[str, tuple[str, hlo_lib.Instruction]] = {}
    self.callers: dict[str, list[hlo_lib.Instruction]] = {}
    self.users: dict[str, list[hlo_lib.Instruction]] = {}
    for comp_name, comp in module.computations.items():
      for ins in comp.instructions:
        self.by_name[ins.name] = (comp_name, ins)
        for called in ins.called:
          self.callers.setdefault(called, []).append(ins)
        for operand in ins.operands:
          self.users.setdefault(operand, []).append(ins)
    self.entry = module.entry

  def named(self, ins: hlo_lib.Instruction | None) -> str:
    """The ``op_name`` of ``ins``, or where it has none (a layout copy XLA inserted), of the
    value it copies or re-shapes; ``""`` if none is found."""
    for _ in range(16):
      if ins is None:
        return ""
      found = _OP_NAME.search(ins.attrs)
      if found:
        return found.group(1)
      if ins.opcode not in ("copy", "bitcast", "reshape", "transpose", "copy-done"):
        return ""
      ins, _ = self.trace(ins.operands[0], ()) if ins.operands else (None, False)
    return ""

  def reduced(self, ins: hlo_lib.Instruction | None, depth: int = 0) -> bool:
    """Whether ``ins`` is a sum over devices (all-reduce, reduce-scatter) or a copy or
    re-shaping of a value on its way to one: a step's gradient reduction, whose buffers carry
    no name stack of their own."""
    if ins is None or depth > 8:
      return False
    if ins.opcode.split("-start")[0] in _REDUCING:
      return True
    return ins.opcode in ("copy", "bitcast", "reshape") and any(
        self.reduced(user, depth + 1) for user in self.users.get(ins.name, ()))

  def instruction(self, name: str) -> hlo_lib.Instruction | None:
    found = self.by_name.get(name)
    return found[1] if found else None

  def trace(self, name: str, index: tuple[int, ...], depth: int = 0):
    """``(instruction, loop_carried)``: the instruction that made value ``name{index}`` (None
    if not found within 64 hops), and whether the value went through a loop."""
    found = self.by_name.get(name)
    if found is None or depth > 64:
      return None, False
    comp, ins = found
    if ins.opcode == "get-tuple-element":
      gte = _GTE_INDEX.search(ins.attrs)
      if gte:
        return self.trace(ins.operands[0], (int(gte.group(1)),) + index, depth + 1)
    if ins.opcode == "tuple" and index:
      return self.trace(ins.operands[index[0]], index[1:], depth + 1)
    if ins.opcode == "while" and ins.operands:
      return self.trace(ins.operands[0], index, depth + 1)[0], True
    if ins.opcode == "parameter" and comp != self.entry:
      number = int(ins.operands[0]) if ins.operands and ins.operands[0].isdigit() else 0
      for caller in self.callers.get(comp, []):
        if caller.opcode == "while":
          return self.trace(caller.operands[0], index, depth + 1)[0], True
        if caller.opcode in ("call", "fusion", "async-start") and number < len(caller.operands):
          return self.trace(caller.operands[number], index, depth + 1)
        if caller.opcode == "conditional" and comp in caller.called:
          # Branch i's only parameter is the conditional's operand i + 1.
          branch = caller.called.index(comp) + 1
          if branch < len(caller.operands):
            return self.trace(caller.operands[branch], index, depth + 1)
    return ins, False

  def copied_from_argument(self, ins: hlo_lib.Instruction | None, depth: int = 0):
    """The entry parameter ``ins`` is a copy, cast, slice or re-shaping of (None if it is
    computed from anything else), following single-input instructions and loop-style fusions."""
    while ins is not None and depth < 64:
      if ins.opcode == "parameter":
        return ins if self.by_name[ins.name][0] == self.entry else None
      inputs = [o for o in ins.operands if o in self.by_name
                and self.by_name[o][1].opcode != "constant"]
      if ins.opcode not in _COPYING or len(inputs) != 1:
        return None
      if ins.opcode == "fusion" and "kind=kLoop" not in ins.attrs:
        return None
      ins, _ = self.trace(inputs[0], ())
      depth += 1
    return None


def _dims(shape: hlo_lib.ArrayShape) -> tuple[int, ...]:
  dims = tuple(shape.dims)
  while dims and dims[0] == 1:
    dims = dims[1:]
  return dims


def _array(ins: hlo_lib.Instruction | None, index: tuple[int, ...]):
  if ins is None:
    return None
  shapes = hlo_lib.parse_shape(ins.shape)
  if not shapes:
    return None
  flat = index[-1] if index else 0
  if len(shapes) == 1:
    return shapes[0]
  return shapes[flat] if flat < len(shapes) else None


def _argument_role(origin: str) -> str:
  if "opt_state" in origin:
    return "optimizer state"
  if re.search(r"(^|[./\[' ])params", origin):
    return "parameters"
  return "batch and other inputs"


def _role(origin: str, array, loop_carried: bool, is_argument: bool, param_dtype: str,
          param_dims: set, head_scopes: Sequence[str],
          copied_from: str | None = None) -> str:
  """One of :data:`ROLES` for a buffer, from what is known of it: the op name that made it
  (``origin``), its array type (or None), whether a loop carries it, whether it is an argument of
  the step, the parameters' dtype and shapes, the head's scopes, and the op name of the argument
  it is a copy of (or None)."""
  if is_argument:
    return _argument_role(origin)
  copy_of_parameter = copied_from is not None and _argument_role(copied_from) == "parameters"
  if copy_of_parameter and array is not None and array.dtype in _FLOAT_TYPES:
    return "parameter copies" if array.dtype == param_dtype else "weight casts"
  for scope, role in SCOPE_ROLES.items():
    if scope in origin:
      return role
  if array is not None and _dims(array) in param_dims and array.dtype in _FLOAT_TYPES:
    return "gradient accumulators" if array.dtype == param_dtype else "weight casts"
  if "ppermute" in origin or "collective-permute" in origin:
    return "mailbox"
  if any(scope in origin for scope in head_scopes):
    return "logits and loss"
  backward = "transpose(" in origin
  if backward and ("rematted_computation" in origin or "checkpoint" in origin):
    return "remat working set"
  if not backward and "jvp(" in origin and (loop_carried or "dynamic_update_slice" in origin):
    return "stash"  # Carried through the forward loop, or written into such a buffer.
  if backward:
    return "backward working set"
  if "jvp(" in origin:
    return "forward working set"
  return "other"


def peak_values(live_range_text: str, hlo_text: str, *, assignment_text: str = "",
                param_dtype: str = "f32",
                head_scopes: Sequence[str] = DEFAULT_HEAD_SCOPES) -> list[LiveValue]:
  """Every buffer live at the peak, largest first, with its role.

  Args:
    live_range_text: a ``*-live-range.txt`` dump.
    hlo_text: the same module's optimised HLO (``*after_optimizations.txt`` of the dump, or
      ``compiled.as_text()``).
    assignment_text: the same module's ``*-buffer-assignment.txt``. With it, the peak is the
      schedule position where the most bytes are in use (:func:`busiest_time`), and values
      that share one buffer (a loop's initial value, its body parameter and its result) count
      once, at the size the target allocates (with its padding); without it, the peak is the
      live-range dump's own ``(peak)`` section, every live value at its logical size.
    param_dtype: the HLO element type parameters are stored in; parameter-shaped values made in
      it are gradients, in other float types weight casts.
    head_scopes: name-stack fragments marking the head and its loss.
  """
  module = hlo_lib.parse_hlo(hlo_text)
  origins = _Origins(module)
  entry = module.computations[module.entry]
  param_dims: set = set()
  for ins in entry.instructions:
    if ins.opcode != "parameter":
      continue
    op_name = (_OP_NAME.search(ins.attrs) or [None, ""])[1]
    if _argument_role(op_name) != "parameters":
      continue
    for shape in hlo_lib.parse_shape(ins.shape):
      dims = _dims(shape)
      param_dims.add(dims)
      if len(dims) > 1:
        param_dims.add(_dims(hlo_lib.ArrayShape(shape.dtype, dims[1:])))  # one unit's slice
      if len(dims) > 2 and dims[1] == 1:  # [R, 1, ...]: a device's view drops the stage axis.
        param_dims.add(_dims(hlo_lib.ArrayShape(shape.dtype, dims[:1] + dims[2:])))
  param_dims.discard(())
  placed = parse_assignment(assignment_text) if assignment_text else {}
  outputs = output_allocations(assignment_text) if assignment_text else set()
  buffers: dict = {}  # one entry per buffer: the values that share it
  live = parse_peak(live_range_text)
  ranges = parse_live_ranges(live_range_text) if placed else []
  when = busiest_time(ranges, placed) if ranges else None
  if when is not None:
    live = [(name, index, placed[(name, index)][2]) for name, index, first, last in ranges
            if first <= when <= last and (name, index) in placed]
  for name, index, size in live:
    where = placed.get((name, index))
    key = where[:2] if where is not None else (name, index)
    size = where[2] if where is not None else size
    made_by, loop_carried = origins.trace(name, index)
    array = _array(origins.instruction(name), index)
    origin = origins.named(made_by)
    is_argument = made_by is not None and made_by.opcode == "parameter" and (
        origins.by_name[made_by.name][0] == module.entry)
    source = None if is_argument else origins.copied_from_argument(made_by)
    copied_from = None
    if source is not None:
      found = _OP_NAME.search(source.attrs)
      copied_from = found.group(1) if found else None
    role = _role(origin, array, loop_carried, is_argument, param_dtype, param_dims,
                 head_scopes, copied_from)
    if role == "other" and array is not None and array.dtype == param_dtype:
      # A sum over devices after the loop, or a copy on its way to one: no name of its own.
      if origins.reduced(origins.instruction(name)):
        role = "gradient accumulators"
    shape = f"{array.dtype}[{','.join(map(str, array.dims))}]" if array is not None else ""
    value = LiveValue(name=f"{name}{{{','.join(map(str, index))}}}", bytes=size, shape=shape,
                      origin=origin, role=role,
                      in_output=where is not None and where[0] in outputs)
    buffers.setdefault(key, []).append(value)
  # Of the values sharing a buffer, the most specific role names it (a loop's carried value is
  # a stash or an accumulator where its initial zeros are only a working set).
  rank = {role: i for i, role in enumerate(ROLES)}
  values = [min(group, key=lambda v: rank[v.role]) for group in buffers.values()]
  values.sort(key=lambda v: -v.bytes)
  return values


def read_dump(directory: str) -> tuple[str, str, str]:
  """``(live_range_text, hlo_text, assignment_text)`` of the largest module in an
  ``--xla_dump_to`` directory."""
  ranges = glob.glob(os.path.join(directory, "*after_optimizations-live-range.txt"))
  if not ranges:
    raise FileNotFoundError(
        f"no *after_optimizations-live-range.txt in {directory!r}: compile with "
        "compiler_options={'xla_dump_to': DIR, 'xla_dump_hlo_as_text': True}.")
  live = max(ranges, key=os.path.getsize)
  texts = []
  for suffix in ("-live-range.txt", ".txt", "-buffer-assignment.txt"):
    with open(live.replace("-live-range.txt", suffix)) as f:
      texts.append(f.read())
  return tuple(texts)


def breakdown_of_lowered(lowered, *, dump_dir: str | None = None, param_dtype: str = "f32",
                         head_scopes: Iterable[str] = DEFAULT_HEAD_SCOPES):
  """Compiles ``lowered`` (a :class:`jax.stages.Lowered`) with XLA's dump options and returns
  ``(compiled, PeakBreakdown)``.

  Args:
    lowered: ``jax.jit(f).lower(...)``, for any backend (a TPU topology's devices included).
    dump_dir: where XLA writes its dump; a temporary directory (removed after) when None.
    param_dtype: as for :func:`peak_values`.
    head_scopes: as for :func:`peak_values`.
  """
  def compile_into(directory):
    options = {"xla_dump_to": directory, "xla_dump_hlo_as_text": True}
    compiled = lowered.compile(compiler_options=options)
    live, text, assignment = read_dump(directory)
    values = peak_values(live, text, assignment_text=assignment, param_dtype=param_dtype,
                         head_scopes=tuple(head_scopes))
    return compiled, PeakBreakdown(tuple(values),
                                   allocated_temporaries=temporary_allocation(assignment))

  if dump_dir is not None:
    return compile_into(dump_dir)
  with tempfile.TemporaryDirectory(prefix="tpipe_peak_") as directory:
    return compile_into(directory)
