"""What each pipeline stage holds and costs, and the memory floor of a pipelined step.

A stage of a :class:`tpipe.Sequential` holds ``R`` chunks (``c = r * S + s``) of the layer
sequence. Per stage this module gathers:

* the layers it holds, named by groups (``layers_1[0..5] TransformerBlock``: copies 0 to 5 of the
  repeated layer 1, both ends included);
* its parameter bytes, and what its parameter buffers occupy: every chunk's slot holds the copies
  a repeated layer keeps per leaf, and the stage's packed buffers are padded to the fullest
  stage's (:meth:`tpipe.core.layout.description.StageLayout.stage_bytes`), so a stage lighter than
  the heaviest pays the difference as padding;
* its optimizer state (the stage's share of every optimizer leaf laid out like the staged
  parameters, e.g. Adam's moments) and its FLOPs (forward and backward of one micro-batch);
* what its backward pass keeps in flight: the schedule's stash slots times the stage's input
  (one micro-batch at a chunk boundary), and the working set of one chunk on one micro-batch.

**The memory floor** of a stage is what a pipeline of this split must hold at once, whatever its
implementation: (parameters + optimizer state + gradients) of the stage + the schedule's in-flight
stage inputs (stash slots x input bytes) + the working set of its largest chunk's forward and
backward on one micro-batch (the temporaries of that chunk compiled alone, see
:func:`compile_forward_backward`). The step's floor is its largest stage's. The real peak (the
compiled step's per-device memory) over the floor says how much an implementation adds on top:
padding, whole-batch buffers, copies, fragmentation.

Nothing here reads a config: the functions take layouts, schedules, abstract shapes and compiled
programs (see :mod:`tpipe.train.cli.report` for the glue).

Example::

  fn, args = pipeline.chunk_program(c, tokens, {"targets": tokens})
  work = working_set_bytes(compile_forward_backward(fn, *args))
  floor = memory_floor(state_bytes=..., stash_bytes=..., working_set_bytes=work)
  print(floor.total, floor.ratio(peak))
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import numpy as np

from tpipe.core.base import packing
from tpipe.core.layout import accounting
from tpipe.core.planning import unit_cost
from tpipe.tools import analysis


# --------------------------------------------------------------------------------------------
# The floor.


@dataclasses.dataclass(frozen=True)
class MemoryFloor:
  """The memory a pipeline stage cannot do without, in bytes per device.

  Attributes:
    stage: the stage it is the floor of (None when not tied to a stage).
    state_bytes: parameters + optimizer state + gradients of the stage's own layers (no padding).
    stash_bytes: the schedule's in-flight stage inputs: stash slots x one micro-batch's input.
    working_set_bytes: temporaries of one chunk's forward and backward on one micro-batch.
  """

  stage: int | None
  state_bytes: int
  stash_bytes: int
  working_set_bytes: int

  @property
  def total(self) -> int:
    return self.state_bytes + self.stash_bytes + self.working_set_bytes

  def ratio(self, peak_bytes: float) -> float:
    """``peak_bytes / total``: 1.0 means the implementation holds nothing beyond the floor."""
    return float(peak_bytes) / self.total if self.total else float("inf")

  def to_json(self, peak_bytes: float | None = None) -> dict[str, Any]:
    out = {"stage": self.stage, "state": self.state_bytes, "stash": self.stash_bytes,
           "working_set": self.working_set_bytes, "total": self.total}
    if peak_bytes is not None:
      out.update(peak=int(peak_bytes), peak_over_floor=self.ratio(peak_bytes))
    return out


def memory_floor(*, state_bytes: int, stash_bytes: int, working_set_bytes: int,
                 stage: int | None = None) -> MemoryFloor:
  """A :class:`MemoryFloor` from its three parts (each a byte count >= 0)."""
  for name, value in (("state_bytes", state_bytes), ("stash_bytes", stash_bytes),
                      ("working_set_bytes", working_set_bytes)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
      raise ValueError(f"{name} must be a byte count >= 0, got {value!r}.")
  return MemoryFloor(stage=stage, state_bytes=int(state_bytes), stash_bytes=int(stash_bytes),
                     working_set_bytes=int(working_set_bytes))


def compile_forward_backward(fn: Callable, *args):
  """AOT-compiles ``fn``'s forward and backward pass for abstract ``args``; runs nothing.

  The program computes ``fn(*args)`` and its VJP with respect to every floating leaf of
  ``args`` (integer leaves, such as token ids, are held fixed), for an output cotangent that is
  an argument of the program, so XLA cannot fold the backward pass away
  (:func:`tpipe.core.planning.unit_cost.forward_backward`, what balancing by FLOPs measures).

  Args:
    fn: a JAX-traceable function.
    *args: its arguments as ``jax.ShapeDtypeStruct`` (or arrays).

  Returns:
    The :class:`jax.stages.Compiled` program.
  """
  program, abstract = unit_cost.forward_backward(fn, *args)
  return program.lower(*abstract).compile()


def working_set_bytes(compiled) -> int:
  """The temporaries of a compiled program (``memory_analysis().temp_size_in_bytes``): for a
  chunk's forward and backward, what it needs beyond its inputs and outputs."""
  return analysis.memory_breakdown(compiled).temporaries


# --------------------------------------------------------------------------------------------
# Per stage.


def tree_bytes(tree) -> int:
  """Bytes of every array leaf of ``tree`` (arrays or ``jax.ShapeDtypeStruct``), in full."""
  return sum(math.prod(np.shape(a)) * np.dtype(a.dtype).itemsize
             for a in jax.tree.leaves(tree) if hasattr(a, "dtype"))


def group_names(layout, unit_names: Sequence[str]) -> list[tuple[str, ...]]:
  """Per chunk, a name per layer group: ``layers_1[0..5] TransformerBlock``, ``layers_0 Embed``.

  Args:
    layout: a :class:`tpipe.core.layout.description.StageLayout`.
    unit_names: a name per layer unit, ``"layers_{i}[{j}] Kind"`` or ``"layers_{i} Kind"``
      (:attr:`tpipe.core.planning.plan.Plan.unit_names`).
  """
  names = []
  for chunk in layout.groups:
    row = []
    for g in chunk:
      kind = unit_names[g.first_unit].partition(" ")[2]
      if g.repeated:
        copies = f"[{g.start}]" if g.stop - g.start == 1 else f"[{g.start}..{g.stop - 1}]"
      else:
        copies = ""
      row.append(f"layers_{g.layer}{copies} {kind}".rstrip())
    names.append(tuple(row))
  return names


def chunk_optimizer_bytes(opt_state, layout) -> list[int]:
  """Per chunk, the bytes of optimizer state that belong to its own parameters (no padding).

  Optimizer subtrees laid out like the staged parameters (Adam's moments) count the chunk's own
  elements of each leaf at the leaf's item size; other leaves (step counts) are left out.
  """
  staged = jax.tree.structure(layout.staged_shapes())
  elements = accounting.chunk_elements(layout)
  per_chunk = [0] * layout.num_chunks
  matches = lambda t: jax.tree.structure(t) == staged
  for tree in jax.tree.leaves(opt_state, is_leaf=matches):
    if not matches(tree):
      continue
    itemsizes = [np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)]
    for c in range(layout.num_chunks):
      per_chunk[c] += sum(n * size for n, size in zip(jax.tree.leaves(elements[c]), itemsizes))
  return per_chunk


@dataclasses.dataclass(frozen=True)
class StageCost:
  """One stage's layers, bytes, FLOPs and memory floor (bytes are per device).

  Attributes:
    stage: the stage index s.
    chunks: its chunk indices ``r * S + s``.
    chunk_layers: per chunk, the layer groups it holds, in order (see :func:`group_names`).
    param_bytes: its own parameters' bytes.
    buffer_bytes: what its parameter buffers occupy, as large as the fullest stage's
      (:meth:`tpipe.core.layout.description.StageLayout.stage_bytes`).
    optimizer_bytes: its own share of the optimizer state.
    flops: forward and backward FLOPs of one micro-batch through all its chunks (per-unit costs,
      without remat's recomputation).
    input_bytes: the largest input of its chunks on one micro-batch (what a stash slot holds).
    stash_slots: the schedule's stash slots on this stage.
    working_set_bytes: the largest temporaries of its chunks' forward and backward compiled alone
      on one micro-batch.
  """

  stage: int
  chunks: tuple[int, ...]
  chunk_layers: tuple[tuple[str, ...], ...]
  param_bytes: int
  buffer_bytes: int
  optimizer_bytes: int
  flops: float
  input_bytes: int
  stash_slots: int
  working_set_bytes: int

  @property
  def layers(self) -> tuple[str, ...]:
    """The layer groups of all its chunks, in chunk order."""
    return tuple(name for chunk in self.chunk_layers for name in chunk)

  @property
  def padding_bytes(self) -> int:
    return self.buffer_bytes - self.param_bytes

  @property
  def padding_fraction(self) -> float:
    """Padding over the stage's own bytes (0.0: no padding)."""
    return self.padding_bytes / self.param_bytes if self.param_bytes else 0.0

  @property
  def gradient_bytes(self) -> int:
    return self.param_bytes

  @property
  def floor(self) -> MemoryFloor:
    return memory_floor(
        stage=self.stage,
        state_bytes=self.param_bytes + self.optimizer_bytes + self.gradient_bytes,
        stash_bytes=self.stash_slots * self.input_bytes,
        working_set_bytes=self.working_set_bytes)

  def to_json(self) -> dict[str, Any]:
    return {"stage": self.stage, "chunks": list(self.chunks),
            "layers": [list(chunk) for chunk in self.chunk_layers],
            "param_bytes": self.param_bytes, "buffer_bytes": self.buffer_bytes,
            "padding_bytes": self.padding_bytes, "padding_fraction": self.padding_fraction,
            "optimizer_bytes": self.optimizer_bytes, "gradient_bytes": self.gradient_bytes,
            "flops_per_microbatch": self.flops, "input_bytes": self.input_bytes,
            "stash_slots": self.stash_slots, "working_set_bytes": self.working_set_bytes,
            "floor": self.floor.to_json()}


def stage_costs(layout, schedule, *, unit_names: Sequence[str], unit_flops: Sequence[float],
                chunk_inputs: Sequence[Any], chunk_working_sets: Sequence[int],
                opt_state=None) -> list[StageCost]:
  """Per stage, its layers, bytes, FLOPs and floor parts.

  Args:
    layout: the model's :class:`tpipe.core.layout.description.StageLayout`.
    schedule: the :class:`tpipe.schedules.Schedule` the step runs (its stash slots).
    unit_names: a name per layer unit (``Plan.unit_names``).
    unit_flops: forward-and-backward FLOPs of one micro-batch per layer unit (the ``costs`` of a
      ``balance="flops"`` plan).
    chunk_inputs: per chunk, its input on one micro-batch (abstract pytree).
    chunk_working_sets: per chunk, the working set of its forward and backward alone (bytes).
    opt_state: the optimizer state (abstract), for its per-stage share; None counts none.

  Returns:
    A :class:`StageCost` per stage, in stage order.
  """
  num_chunks, num_stages = layout.num_chunks, layout.num_stages
  for name, seq in (("chunk_inputs", chunk_inputs), ("chunk_working_sets", chunk_working_sets)):
    if len(seq) != num_chunks:
      raise ValueError(f"{name} has {len(seq)} entries; the layout has {num_chunks} chunks.")
  counts = [sum(g.size for g in chunk) for chunk in layout.groups]
  if len(unit_flops) != sum(counts) or len(unit_names) != sum(counts):
    raise ValueError(f"unit_flops ({len(unit_flops)}) and unit_names ({len(unit_names)}) need "
                     f"one entry per layer unit ({sum(counts)}).")
  repeats = chunks_per_stage(schedule)
  if schedule.num_stages != num_stages or repeats != layout.num_repeats:
    raise ValueError(f"schedule {schedule.name!r} has S={schedule.num_stages}, "
                     f"R={repeats}; the layout has S={num_stages}, R={layout.num_repeats}.")
  bounds = np.concatenate([[0], np.cumsum(counts)])
  chunk_flops = [float(sum(unit_flops[bounds[c]:bounds[c + 1]])) for c in range(num_chunks)]
  names = group_names(layout, unit_names)
  own = accounting.chunk_bytes(layout)
  optimizer = (chunk_optimizer_bytes(opt_state, layout) if opt_state is not None
               else [0] * num_chunks)
  slots = schedule.stash_slots()
  rows = []
  for s in range(num_stages):
    chunks = stage_chunks(schedule, s)
    rows.append(StageCost(
        stage=s, chunks=chunks, chunk_layers=tuple(names[c] for c in chunks),
        param_bytes=sum(own[c] for c in chunks),
        buffer_bytes=accounting.stage_bytes(layout),
        optimizer_bytes=sum(optimizer[c] for c in chunks),
        flops=sum(chunk_flops[c] for c in chunks),
        input_bytes=max(tree_bytes(chunk_inputs[c]) for c in chunks),
        stash_slots=int(slots[s]),
        working_set_bytes=max(int(chunk_working_sets[c]) for c in chunks)))
  return rows


def chunks_per_stage(schedule) -> int:
  """R: layer chunks each stage holds (``num_repeats`` of a forward schedule, ``num_chunks`` of
  a :class:`tpipe.schedules.FusedSchedule`)."""
  return int(getattr(schedule, "num_repeats", None) or schedule.num_chunks)


def stage_chunks(schedule, stage: int) -> tuple[int, ...]:
  """The model chunks (layout chunk indices, in layer order) ``stage`` holds under ``schedule``:
  ``stage, stage + S, ...`` for the forward schedules and the fused ones placed the same way
  (``"loop"``), the table's own placement otherwise (ZB-V's V)."""
  if hasattr(schedule, "virtual_stage"):
    return tuple(int(v) for v in schedule.virtual_stage[stage])
  return tuple(range(stage, schedule.num_stages * schedule.num_repeats, schedule.num_stages))


def largest_floor(stages: Sequence[StageCost]) -> MemoryFloor:
  """The step's floor: the largest of its stages' floors (every device runs one stage)."""
  if not stages:
    raise ValueError("stages is empty; pass the StageCost of every stage.")
  return max((s.floor for s in stages), key=lambda f: f.total)


def ring_bytes(chunk_inputs: Sequence[Any]) -> int:
  """Bytes of one micro-batch in the format that crosses stage boundaries: every chunk input but
  the first, as it is when all have one type, else packed per dtype and padded to the largest
  (:class:`tpipe.core.programs.ring.Ring`)."""
  boundaries = list(chunk_inputs[1:])
  if not boundaries:
    return 0
  first = boundaries[0]
  same = all(jax.tree.structure(b) == jax.tree.structure(first) and
             [(np.shape(a), a.dtype) for a in jax.tree.leaves(b)] ==
             [(np.shape(a), a.dtype) for a in jax.tree.leaves(first)] for b in boundaries)
  if same:
    return tree_bytes(first)
  rows = jax.tree.leaves(first)[0].shape[0]
  sizes = packing.buffer_sizes([packing.layout_of(b, batch_dims=1) for b in boundaries])
  return sum(rows * n * np.dtype(k).itemsize for k, n in sizes.items())
