"""A small reader for XLA's HLO text: computations, instructions, shapes and loop trip counts.

``compiled.as_text()`` (a :class:`jax.stages.Compiled`) prints the optimised, per-device HLO
module that runs. This module parses just enough of that text for :mod:`tpipe.tools.analysis`:

* computations and their instructions (name, result shape, opcode, operands, attributes);
* which computations each instruction calls (fusions, loop bodies, reducers, branches);
* the trip count XLA proved for each ``while`` loop. jax 0.10 on CPU prints it in the loop's
  ``backend_config`` as ``"known_trip_count":{"n":"7"}``;
* how many times each computation runs per call of the module: the product of the trip counts
  of the loops around it (nested loops multiply);
* the device groups of collectives, in every syntax XLA prints
  (:mod:`tpipe.tools.replica_groups`).

Python and NumPy, no JAX. Example (``text`` is usually ``compiled.as_text()``)::

  >>> module = parse_hlo('''HloModule m
  ...
  ... ENTRY %main (p: f32[2]) -> f32[2] {
  ...   %p = f32[2]{0} parameter(0)
  ...   ROOT %n = f32[2]{0} negate(f32[2]{0} %p)
  ... }''')
  >>> module.entry, module.multipliers()[module.entry]
  ('main', 1)
  >>> [i.opcode for i in module.computations[module.entry].instructions]
  ['parameter', 'negate']
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import weakref
from typing import Any

from tpipe.tools import replica_groups

# Bytes per element of each HLO primitive type (sub-byte types round up per element).
_DTYPE_BYTES = {
    "pred": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e3m4": 1, "f8e4m3b11fnuz": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e8m0fnu": 1, "f4e2m1fn": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16,
    "token": 0, "opaque": 0,
}

_ARRAY_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLED = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_CALLED_LIST = re.compile(r"\b(branch_computations|called_computations|calls)=\{([^}]*)\}")
_TRIP_COUNT_JSON = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')
_TRIP_COUNT_ATTR = re.compile(r"known_trip_count=\{n=(\d+)\}")
_MESH_START = re.compile(r"(?:maximal_)?mesh(?=\[)")
_DEVICE_IDS_START = re.compile(r"\s*,\s*device_ids=(?=\()")
_AXES_START = re.compile(r"\s*(?=\{)")


@dataclasses.dataclass(frozen=True)
class ArrayShape:
  """One array in an HLO shape: element type and dimensions."""

  dtype: str
  dims: tuple[int, ...]

  @property
  def size(self) -> int:
    return math.prod(self.dims)

  @property
  def nbytes(self) -> int:
    return self.size * _DTYPE_BYTES.get(self.dtype, 4)


def parse_shape(text: str) -> tuple[ArrayShape, ...]:
  """The arrays in an HLO shape string; a tuple shape gives several, ``pred[]`` gives one.

  Args:
    text: e.g. ``"f32[4,16]{1,0}"`` or ``"(s32[], bf16[2,8]{1,0})"``.

  Returns:
    The arrays in order of appearance (layouts and memory spaces are dropped).
  """
  arrays = []
  for dtype, dims in _ARRAY_SHAPE.findall(text):
    if dtype not in _DTYPE_BYTES:
      continue
    sizes = []
    for d in dims.split(","):
      d = d.strip().lstrip("<=")
      if d:
        sizes.append(int(d))
    arrays.append(ArrayShape(dtype, tuple(sizes)))
  return tuple(arrays)


def shape_bytes(text: str) -> int:
  """Total bytes of an HLO shape string (all tuple elements)."""
  return sum(a.nbytes for a in parse_shape(text))


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction.

  Attributes:
    name: the instruction's name, without ``%``.
    shape: its result shape as printed, e.g. ``"f32[4,16]{1,0}"``.
    opcode: e.g. ``"dot"``, ``"fusion"``, ``"while"``, ``"all-reduce"``.
    operands: operand names (``%`` dropped); literal operands (``constant(3)``) as printed.
    attrs: everything after the operand list, as printed.
    is_root: whether the instruction is its computation's ROOT.
  """

  name: str
  shape: str
  opcode: str
  operands: tuple[str, ...]
  attrs: str
  is_root: bool = False

  @functools.cached_property
  def called(self) -> tuple[str, ...]:
    """Names of the computations this instruction calls (read once: the walks over a module
    ask it of every instruction)."""
    names = [m.group(2) for m in _CALLED.finditer(self.attrs)]
    for m in _CALLED_LIST.finditer(self.attrs):
      names.extend(n.strip().lstrip("%") for n in m.group(2).split(",") if n.strip())
    return tuple(dict.fromkeys(names))

  def attr(self, key: str) -> str | None:
    """The raw text of attribute ``key`` (balanced braces kept), or None."""
    m = re.search(r"\b" + re.escape(key) + r"=", self.attrs)
    if not m:
      return None
    i = m.end()
    if i < len(self.attrs) and self.attrs[i] in "{[":
      return self.attrs[i:_matching(self.attrs, i) + 1]
    j = i
    while j < len(self.attrs) and self.attrs[j] not in ", ":
      j += 1
    return self.attrs[i:j]

  @property
  def trip_count(self) -> int | None:
    """For a ``while``: the trip count XLA proved, or None when it printed none."""
    m = _TRIP_COUNT_JSON.search(self.attrs) or _TRIP_COUNT_ATTR.search(self.attrs)
    return int(m.group(1)) if m else None

  @property
  def replica_groups(self) -> str | None:
    """The raw text of the ``replica_groups`` attribute, in any of its syntaxes, or None.

    Unlike :meth:`attr`, this keeps the whole value of the iota form (``[2,4]<=[4,2]T(1,0)``)
    and of the mesh form (``mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}``), which are not
    one bracketed block.
    """
    m = re.search(r"\breplica_groups=", self.attrs)
    if not m:
      return None
    text, i = self.attrs, m.end()
    if text.startswith("{", i):
      return text[i:_matching(text, i) + 1]
    iota = replica_groups.IOTA_GROUPS.match(text, i)
    if iota:
      return iota.group(0)
    mesh = _MESH_START.match(text, i)
    if mesh:  # mesh[...], then maybe ", device_ids=(...)", then " {...}" (none for maximal).
      end = _matching(text, mesh.end())
      ids = _DEVICE_IDS_START.match(text, end + 1)
      if ids:
        end = _matching(text, ids.end())
      axes = _AXES_START.match(text, end + 1)
      if axes:
        end = _matching(text, axes.end())
      return text[i:end + 1]
    j = i
    while j < len(text) and text[j] not in ", ":
      j += 1
    return text[i:j]

  def device_groups(self, num_devices: int) -> list[list[int]]:
    """The groups of device ids this collective communicates within.

    Args:
      num_devices: devices the module runs on (``num_partitions * replica_count``); an empty
        or absent ``replica_groups`` means one group of all of them.

    Returns:
      For ``collective-permute``: its ``[source, target]`` pairs. For the other collectives:
      the replica groups (see :func:`tpipe.tools.replica_groups.parse_replica_groups`).
    """
    if self.opcode.startswith("collective-permute"):
      pairs = self.attr("source_target_pairs") or "{}"
      return [[int(x) for x in re.findall(r"\d+", g)]
              for g in re.findall(r"\{([\d,\s]*)\}", pairs[1:-1])]
    return replica_groups.parse_replica_groups(self.replica_groups, num_devices)


@dataclasses.dataclass
class Computation:
  """An HLO computation: its instructions in order and a name -> instruction table."""

  name: str
  is_entry: bool
  instructions: list[Instruction]

  def __post_init__(self):
    self.by_name = {i.name: i for i in self.instructions}

  def operand_shape(self, instruction: Instruction, index: int) -> tuple[ArrayShape, ...]:
    """The parsed shape of ``instruction``'s ``index``-th operand."""
    operand = self.by_name.get(instruction.operands[index])
    return parse_shape(operand.shape) if operand is not None else ()


@dataclasses.dataclass(frozen=True)
class Loop:
  """A ``while`` instruction and where it sits.

  Attributes:
    instruction: the ``while`` instruction.
    computation: the computation that contains it.
    trip_count: XLA's proven trip count, or None when unknown (counted as 1).
    outer: how many times the containing computation runs per step.
  """

  instruction: Instruction
  computation: str
  trip_count: int | None
  outer: int

  @property
  def body(self) -> str:
    return self.instruction.attr("body").lstrip("%")


class HloModule:
  """A parsed HLO module: ``computations`` by name and the ``entry`` computation's name."""

  def __init__(self, computations: dict[str, Computation], entry: str,
               num_partitions: int = 1, num_replicas: int = 1):
    self.computations = computations
    self.entry = entry
    self.num_partitions = num_partitions
    self.num_replicas = num_replicas
    self._order: list[str] | None = None  # Callers first; the module is not changed after.

  def instructions(self):
    """Yields ``(computation, instruction)`` for every instruction in the module."""
    for comp in self.computations.values():
      for ins in comp.instructions:
        yield comp, ins

  def multipliers(self) -> dict[str, int]:
    """How many times each computation runs per execution of the entry computation.

    A ``while`` body (and condition) runs ``trip_count`` times per run of the computation holding
    the loop; nested loops multiply. Loops with no proven trip count count once. Every other
    called computation (fusions, reducers, branches, calls) inherits its caller's count; a
    computation called from several places adds up.
    """
    counts: dict[str, int] = {}
    order = self._topological_order()
    counts[self.entry] = 1
    for name in order:
      n = counts.get(name, 0)
      if n == 0:
        continue
      for ins in self.computations[name].instructions:
        factor = (ins.trip_count or 1) if ins.opcode == "while" else 1
        for callee in ins.called:
          if callee in self.computations:
            counts[callee] = counts.get(callee, 0) + n * factor
    return counts

  def loops(self) -> list[Loop]:
    """Every ``while`` loop reachable from the entry, outermost first."""
    mult = self.multipliers()
    found = []
    for name in self._topological_order():
      if mult.get(name, 0) == 0:
        continue
      for ins in self.computations[name].instructions:
        if ins.opcode == "while":
          found.append(Loop(ins, name, ins.trip_count, mult[name]))
    return found

  def enclosing_loops(self) -> dict[str, tuple[str, ...]]:
    """For each computation: the names of the ``while`` instructions it runs inside."""
    return self.enclosing("while")

  def enclosing(self, opcode: str) -> dict[str, tuple[str, ...]]:
    """For each computation: the names of the ``opcode`` instructions (``"while"``,
    ``"conditional"``) it runs inside, outermost first."""
    inside: dict[str, tuple[str, ...]] = {self.entry: ()}
    for name in self._topological_order():
      if name not in inside:
        continue
      for ins in self.computations[name].instructions:
        extra = (ins.name,) if ins.opcode == opcode else ()
        for callee in ins.called:
          if callee in self.computations and callee not in inside:
            inside[callee] = inside[name] + extra
    return inside

  def _topological_order(self) -> list[str]:
    """Computation names, callers before callees, starting from the entry (computed once)."""
    if self._order is None:
      self._order = self._callers_first()
    return list(self._order)

  def _callers_first(self) -> list[str]:
    order, state = [], {}

    def visit(name):
      stack = [(name, iter(self._callees(name)))]
      state[name] = 1
      while stack:
        current, it = stack[-1]
        nxt = next(it, None)
        if nxt is None:
          stack.pop()
          state[current] = 2
          order.append(current)
        elif state.get(nxt, 0) == 0:
          state[nxt] = 1
          stack.append((nxt, iter(self._callees(nxt))))

    visit(self.entry)
    return order[::-1]

  def _callees(self, name: str) -> list[str]:
    comp = self.computations[name]
    return [c for ins in comp.instructions for c in ins.called if c in self.computations]


def _matching(text: str, start: int) -> int:
  """Index of the bracket closing the one at ``text[start]``."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  stack = []
  in_string = False
  for i in range(start, len(text)):
    ch = text[i]
    if in_string:
      if ch == '"' and text[i - 1] != "\\":
        in_string = False
      continue
    if ch == '"':
      in_string = True
    elif ch in pairs:
      stack.append(pairs[ch])
    elif stack and ch == stack[-1]:
      stack.pop()
      if not stack:
        return i
  raise ValueError(f"Unbalanced brackets in HLO text: {text[start:start + 80]!r}")


def _split_top_level(text: str) -> list[str]:
  parts, depth, current = [], 0, []
  for ch in text:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if ch == "," and depth == 0:
      parts.append("".join(current).strip())
      current = []
    else:
      current.append(ch)
  if "".join(current).strip():
    parts.append("".join(current).strip())
  return parts


def _parse_instruction(line: str) -> Instruction | None:
  m = _INSTRUCTION.match(line)
  if not m:
    return None
  is_root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
  if rest.startswith("("):
    end = _matching(rest, 0)
    shape, rest = rest[:end + 1], rest[end + 1:].lstrip()
  else:
    shape, _, rest = rest.partition(" ")
  op = re.match(r"([\w\-]+)\(", rest)
  if not op:
    return None
  opcode = op.group(1)
  open_paren = op.end() - 1
  close = _matching(rest, open_paren)
  operands = []
  for part in _split_top_level(rest[open_paren + 1:close]):
    refs = re.findall(r"%([\w.\-]+)", part)
    operands.append(refs[-1] if refs else part)
  attrs = rest[close + 1:].lstrip(", ")
  return Instruction(name, shape, opcode, tuple(operands), attrs, is_root)


def parse_hlo(text: str) -> HloModule:
  """Parses the HLO text of a module (``compiled.as_text()``).

  Args:
    text: HLO module text as printed by XLA.

  Returns:
    The :class:`HloModule`.

  Raises:
    ValueError: if the text has no ENTRY computation (it is not an HLO module).
  """
  if not isinstance(text, str):
    raise TypeError(f"parse_hlo expects HLO text (str), got {type(text).__name__}; pass "
                    "compiled.as_text().")
  computations: dict[str, Computation] = {}
  entry = None
  current_name, current_entry, current = None, False, []
  for line in text.splitlines():
    if current_name is None:
      m = _HEADER.match(line)
      if m:
        current_name, current_entry, current = m.group(2), bool(m.group(1)), []
      continue
    if line.strip() == "}":
      computations[current_name] = Computation(current_name, current_entry, current)
      if current_entry:
        entry = current_name
      current_name = None
      continue
    ins = _parse_instruction(line)
    if ins is not None:
      current.append(ins)
  if entry is None:
    raise ValueError("No ENTRY computation found: the text is not an HLO module. Pass "
                     "compiled.as_text() of a jax.stages.Compiled.")
  header = re.search(r"^HloModule\s.*$", text, re.MULTILINE)
  header = header.group(0) if header else ""
  partitions = re.search(r"\bnum_partitions=(\d+)", header)
  replicas = re.search(r"\breplica_count=(\d+)", header)
  return HloModule(computations, entry,
                   num_partitions=int(partitions.group(1)) if partitions else 1,
                   num_replicas=int(replicas.group(1)) if replicas else 1)


# Parsed modules of compiled programs, for as long as each program lives.
_PARSED: "weakref.WeakKeyDictionary[Any, HloModule]" = weakref.WeakKeyDictionary()


def module_of(compiled_or_text) -> HloModule:
  """The parsed HLO of a compiled program, of its text, or a module already parsed."""
  if isinstance(compiled_or_text, HloModule):
    return compiled_or_text
  if isinstance(compiled_or_text, str):
    return parse_hlo(compiled_or_text)
  if hasattr(compiled_or_text, "as_text") and hasattr(compiled_or_text, "cost_analysis"):
    try:  # One parse per compiled program: a report reads the same one several times.
      return _PARSED[compiled_or_text]
    except (KeyError, TypeError):
      module = parse_hlo(compiled_or_text.as_text())
    try:
      _PARSED[compiled_or_text] = module
    except TypeError:  # Not weakly referenceable: parsed again next time.
      pass
    return module
  raise TypeError(
      f"Expected a jax.stages.Compiled (jit(f).lower(...).compile()) or its HLO text, got "
      f"{type(compiled_or_text).__name__}. Call .compile() on the lowered function first.")
