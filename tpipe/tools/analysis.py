"""Ahead-of-time measurements of a compiled step: memory, collectives, and (from
:mod:`tpipe.tools.flops`) executed FLOPs and the bubble, all at once with :func:`analyze`.

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
A convolution counts the taps that meet input elements, as XLA does.

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
# The FLOP measurements, part of this module's one-stop surface (see tpipe.tools.flops).
from tpipe.tools.flops import FlopCount
from tpipe.tools.flops import FusedFlops
from tpipe.tools.flops import PipelineFlops
from tpipe.tools.flops import flop_count
from tpipe.tools.flops import fused_flops
from tpipe.tools.flops import pipeline_flops

# Collective opcodes and the kind each starts (an async pair's ``-done`` half is not listed).
COLLECTIVE_OPCODES = {
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
    "all-to-all": "all-to-all", "all-to-all-start": "all-to-all",
    "ragged-all-to-all": "all-to-all",
}
# The collective kinds counted.
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
                    "all-to-all")


def _check_compiled(compiled) -> None:
  if not (hasattr(compiled, "memory_analysis") and hasattr(compiled, "cost_analysis")):
    raise TypeError(
        f"Expected a jax.stages.Compiled, got {type(compiled).__name__}; use "
        "jax.jit(f).lower(*args).compile().")


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
    in_branch: whether it sits inside a ``conditional``'s branch (then only the devices that
      take that branch run it: a collective whose groups span devices that take another branch
      waits forever).
  """

  kind: str
  name: str
  bytes: int
  count: int
  in_loop: bool
  group_size: int
  axes: tuple[str, ...] | None
  op_name: str
  in_branch: bool = False

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
  module = hlo_lib.module_of(compiled)
  mult = module.multipliers()
  inside = module.enclosing_loops()
  branches = module.enclosing("conditional")
  mesh_shape = tuple(mesh.devices.shape) if mesh is not None else None
  axis_names = tuple(mesh.axis_names) if mesh is not None else None
  num_devices = module.num_partitions * module.num_replicas
  found = []
  for comp, ins in module.instructions():
    kind = COLLECTIVE_OPCODES.get(ins.opcode)
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
        op_name=op_name.group(1) if op_name else "", in_branch=bool(branches.get(comp.name))))
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


def cross_branch_collectives(compiled, mesh=None, stage_axis: str = "stage") -> list[Collective]:
  """The collectives inside a ``conditional``'s branch that wait for devices taking another
  branch: what a pipeline must never hold, since its stages take different branches.

  A collective with replica groups (all-reduce, all-gather, reduce-scatter, all-to-all) meets
  per group, so one whose groups stay inside a stage (over ``tensor``, ``fsdp`` or ``expert``)
  runs in that stage's branch. A collective-permute meets as one rendezvous of every device its
  pairs name on emulated CPU devices (all of them, for a permute the partitioner made for the
  whole mesh), so inside a branch it waits for devices that never come and XLA aborts the
  process; on a TPU it is point-to-point. Both kinds are reported: a collective-permute anywhere
  in a branch, and any collective in a branch whose groups span ``stage_axis`` (with ``mesh``).

  Args:
    compiled: a :class:`jax.stages.Compiled` or its HLO text.
    mesh: the :class:`jax.sharding.Mesh` it was compiled for (to name the axes groups span).
    stage_axis: the pipeline's mesh axis.

  Returns:
    The offending :class:`Collective` list, empty when every device can run the program.
  """
  return [c for c in collectives(compiled, mesh) if c.in_branch and (
      c.kind == "collective-permute" or stage_axis in (c.axes or ()))]


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
    programs: each model chunk's chunk program (:meth:`tpipe.core.engine.PlannedPipeline.programs`),
      for a fused schedule.
    inputs: label -> abstract input pytree, to split the argument bytes (see
      :func:`memory_breakdown`).

  Returns:
    An :class:`Analysis`.
  """
  _check_compiled(compiled)
  module = hlo_lib.module_of(compiled)
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


__all__ = ["Analysis", "COLLECTIVE_KINDS", "Collective", "FlopCount", "FusedFlops",
           "MemoryBreakdown", "PipelineFlops", "analyze", "collectives", "flop_count",
           "format_bytes", "fused_flops", "input_bytes", "memory_breakdown", "pipeline_flops",
           "summarize_collectives"]


def axis_split(tree, mesh) -> tuple[dict[str, Any], ...]:
  """Per mesh axis, how much of ``tree`` (arrays or abstract arrays with a ``NamedSharding``)
  splits over it: ``{"axis", "devices", "split_bytes", "whole_bytes"}``, global bytes of the
  leaves whose partition spec names the axis and of those every device along it holds whole.
  Axes of one device are left out."""
  import jax  # pylint: disable=g-import-not-at-top

  leaves = jax.tree.leaves(tree)
  sizes = [leaf.size * leaf.dtype.itemsize for leaf in leaves]
  named = []
  for leaf in leaves:
    axes = set()
    for entry in tuple(leaf.sharding.spec):
      axes.update(entry if isinstance(entry, tuple) else (entry,))
    named.append(axes)
  rows = []
  for axis, devices in mesh.shape.items():
    if devices == 1:
      continue
    split = sum(n for n, axes in zip(sizes, named) if axis in axes)
    rows.append({"axis": axis, "devices": int(devices), "split_bytes": split,
                 "whole_bytes": sum(sizes) - split})
  return tuple(rows)
