"""The ring: what crosses a chunk boundary, as one type for every boundary.

One micro-batch's activation travels between chunks; when every boundary has one type the ring
is that type, else each boundary's activation is packed per dtype (:mod:`tpipe.core.base.packing`)
into buffers padded to the largest.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from tpipe.core.base import layers as layers_lib
from tpipe.core.base import packing
from tpipe.core.planning import plan as plan_lib


def without_rows(tree):
  """Abstract leaves without their leading (batch) axis."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(a.shape[1:]), a.dtype), tree)


def zeros_with_rows(example, rows: int):
  """Zeros shaped like ``example`` (no batch axis) with ``rows`` rows in front."""
  return jax.tree.map(lambda s: jnp.zeros((rows,) + tuple(s.shape), s.dtype), example)


@dataclasses.dataclass(frozen=True)
class Ring:
  """What crosses a chunk boundary, as one type for every boundary.

  Attributes:
    layouts: per boundary ``c`` (after model chunk ``c``), the packing of its activation; None
      when every boundary has one type and the ring is that type unpacked.
    example: one example of the ring (no batch axis), abstract.
  """

  layouts: tuple[packing.Layout, ...] | None
  example: Any

  @classmethod
  def of(cls, plan: plan_lib.Plan) -> "Ring":
    boundaries = [plan.chunk_output(c) for c in range(plan.num_chunks - 1)]
    if not boundaries:
      return cls(layouts=None, example={})
    if all(layers_lib.same_type(b, boundaries[0]) for b in boundaries):
      return cls(layouts=None, example=without_rows(boundaries[0]))
    layouts = tuple(packing.layout_of(b, batch_dims=1) for b in boundaries)
    sizes = packing.buffer_sizes(layouts)
    return cls(layouts=layouts,
               example={k: jax.ShapeDtypeStruct((n,), jnp.dtype(k)) for k, n in sizes.items()})

  @property
  def packed(self) -> bool:
    return self.layouts is not None

  def matches(self, abstract) -> bool:
    """Whether a value of type ``abstract`` (with batch rows) travels unpacked on the ring."""
    return not self.packed and layers_lib.same_type(without_rows(abstract), self.example)

  def pack(self, value, boundary: int):
    if not self.packed:
      return value
    sizes = {k: s.shape[0] for k, s in self.example.items()}
    return packing.pack(value, self.layouts[boundary], sizes)

  def unpack(self, value, boundary: int):
    return packing.unpack(value, self.layouts[boundary]) if self.packed else value

  def layout(self, boundary: int):
    return self.layouts[boundary] if self.packed else None
