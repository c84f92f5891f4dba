"""Loop trip counts read from a ``while`` loop's counter, for HLO printed without them.

XLA on CPU and GPU prints the trip count it proved for a loop (``known_trip_count``); the TPU
compiler prints none. A loop ``lax.scan`` or ``fori_loop`` makes keeps a counter in its state
tuple: started from a constant, stepped by a constant in the body, compared with a constant in
the condition. :func:`infer_trip_counts` reads the count off those three constants;
:func:`with_trip_counts` writes it into the module, so every tool reading ``known_trip_count``
(:mod:`tpipe.tools.flops`, ``HloModule.multipliers``) counts a TPU program's loops.
"""

from __future__ import annotations

import dataclasses
import re

from tpipe.tools import hlo as hlo_lib


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
