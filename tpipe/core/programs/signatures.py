"""Chunk signatures: which model chunks share one program (one ``lax.switch`` branch).

A chunk's signature is its segments' layers and copy counts, its packed layouts (and where its
packed leaves are cut into fsdp pieces), the shared leaves it reads, where its input comes from
and where its output goes (:mod:`tpipe.core.programs.ring`). Chunks whose programs are the same up
to traced values (which chunk, hence which parameter slot and which unit numbers for the RNG) have
equal signatures and share one branch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tpipe.core.base import packing
from tpipe.core.layout import description as layout_lib
from tpipe.core.planning import plan as plan_lib
from tpipe.core.programs import ring as ring_lib


@dataclasses.dataclass(frozen=True)
class Signature:
  """What decides a chunk's program (chunks with equal signatures share one branch)."""

  segments: tuple[tuple[int, int | None, bool], ...]
  params_layout: packing.Layout
  params_dims: tuple[int, ...]  # Where each packed leaf is cut into fsdp pieces.
  stats_layout: packing.Layout | None
  input_kind: str  # "fresh", "ring" or "select" (model chunk 0 takes the fresh input)
  output_kind: str  # "ring", "output" or "both"
  ring_in: Any
  ring_out: Any
  # Weights read from shared leaves: (segment, shared leaf, path, stored transposed).
  shared: tuple[tuple[int, str, str, bool], ...] = ()


def _signature(plan, layout, stats_layout, ring: ring_lib.Ring, c: int, select: bool,
               both: bool) -> Signature:
  last = c == plan.num_chunks - 1
  input_kind = "select" if select else ("fresh" if c == 0 else "ring")
  output_kind = "both" if both else ("output" if last else "ring")
  segments = tuple((seg.layer, seg.copies, seg.stacked) for seg in layout.segments[c])
  return Signature(
      segments=segments, params_layout=layout.packed_layouts[c],
      params_dims=layout.packed_dims[c],
      stats_layout=stats_layout.packed_layouts[c] if stats_layout is not None else None,
      input_kind=input_kind, output_kind=output_kind,
      ring_in=ring.layout(c - 1) if c and input_kind != "fresh" else None,
      ring_out=ring.layout(c) if not last and output_kind == "ring" else None,
      shared=tuple((k, g.name, m.path, m.transposed) for k, g, m in layout.shared_members(c)))


def signatures(plan: plan_lib.Plan, layout: layout_lib.StageLayout,
               stats_layout: layout_lib.StageLayout | None, ring: ring_lib.Ring | None = None):
  """The distinct chunk programs of a planned sequence: ``(signatures, program of each model
  chunk)``."""
  ring = ring_lib.Ring.of(plan) if ring is None else ring
  num_chunks = plan.num_chunks
  select = ring.matches(plan.layer_inputs[0]) and num_chunks > 1
  both = ring.matches(plan.layer_inputs[-1]) and num_chunks > 1
  found, program = [], []
  for c in range(num_chunks):
    sig = _signature(plan, layout, stats_layout, ring, c, select, both)
    if sig not in found:
      found.append(sig)
    program.append(found.index(sig))
  return found, program
