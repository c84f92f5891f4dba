"""The stage layout: where a layer sequence's variables live on the stages, and the way back.

At the API boundary variables are **logical**: ``{"layers_0": tree, "layers_1": tree, ...}``, one
entry per layer as ``nn.Sequential`` names them, a repeated layer's copies stacked on a leading
axis (``nn.scan``'s layout). The tick loops read them **staged**: every leaf has leading
``[R, S]`` axes (stage ``s``'s ``r``-th chunk at ``[r, s]``) split over the mesh's ``stage``
axis, so each device holds its own chunks only. A :class:`StageLayout` describes the staged tree
of one collection (parameters, or BatchNorm's statistics) for one split::

  {"stacked": {"layers_i": tree of [R, S, k_i, ...]},   # per leaf, a repeated layer's copies
   "packed": {dtype: [P, S, n]}}                        # everything else, one buffer per dtype

* **Stacked, per leaf.** A repeated layer with copies in every chunk keeps ``k_i`` copies per
  chunk (the fewest any chunk has) as real leaves, with the layer's own names and shapes, so
  optimizer masks, per-weight partition specs and checkpoints see them. For an even split (every
  chunk the same number of copies, ``tpipe.pipeline``) that is all of them and the staged leaf is
  the logical one reshaped, ``[L, ...] -> [R, S, L / (S R), ...]``.
* **Packed.** Plain layers (an embedding, a head), a chunk's copies beyond ``k_i``, and repeated
  layers that some chunk lacks, packed per dtype (:mod:`tpipe.core.base.packing`): the one buffer a
  ``lax.switch`` branch can read whatever its layers are. Each chunk reads a **window** of its
  stage's buffer: its own elements, at its own offset. With ``packing="stage"`` (parameters) a
  stage's R chunks lie one after the other in one buffer (``P = 1``), padded to the fullest
  stage's: circular repeats with the embedding on stage 0's first chunk and the head on the last
  stage's last chunk hold each once, where a buffer per slot would pad every slot to the
  embedding. With ``packing="slot"`` (running statistics, which a branch hands back as a whole
  slot) each chunk has a slot of its own (``P = R``) padded to the fullest chunk. With R = 1 the
  two are the same. Splitting a chunk's copies this way pads no stage beyond the fullest. On a
  mesh with ``fsdp``
  devices a buffer is ``fsdp`` equal blocks, and block ``f`` holds piece ``f`` of every leaf: the
  leaf cut evenly along one of its own dimensions (the one its partition spec splits over
  ``fsdp``, else its largest divisible one; the flattened elements, padded, where none divides),
  so the device holding block ``f`` holds whole rows or columns of each weight; a chunk's window
  is the same range of every block.

Every conversion is exact (slices, reshapes, concatenations; no arithmetic).

Example::

  layout = StageLayout.build(plan.groups, param_shapes, num_stages=4, num_repeats=1)
  staged = layout.to_staged(params)           # {"stacked": {...}, "packed": {...}}
  params_again = layout.to_logical(staged)    # == params, bit for bit
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np

from tpipe.core.layout import accounting
from tpipe.core.layout import description as desc
from tpipe.core.layout import pack as layout_pack
from tpipe.core.layout import staging

STACKED = desc.STACKED
PACKED = desc.PACKED
SHARED = desc.SHARED
PACKINGS = desc.PACKINGS
Segment = desc.Segment
segment_shapes = desc.segment_shapes


class StageLayout(desc.LayoutDescription):
  """The staged tree of one collection for one split (see the module documentation).

  Its description (attributes, :meth:`build`, places, shapes and partition specs) is
  :class:`~tpipe.core.layout.description.LayoutDescription`'s; the methods here are the other
  concepts' entries, each defined in its own module: packing one chunk
  (:mod:`tpipe.core.layout.pack`), accounting (:mod:`tpipe.core.layout.accounting`) and the
  whole tree's conversions (:mod:`tpipe.core.layout.staging`).
  """

  # Packing one chunk.

  def chunk_trees(self, local, chunk: int, at: Mapping[str, int] | None = None,
                  blocks: int | None = None, shared_slots: Mapping | None = None,
                  canonical: bool = False) -> list:
    """Model chunk ``chunk``'s variables, one tree per segment
    (:func:`tpipe.core.layout.pack.chunk_trees`)."""
    return layout_pack.chunk_trees(self, local, chunk, at=at, blocks=blocks,
                                   shared_slots=shared_slots, canonical=canonical)

  def chunk_slot(self, trees: Sequence[Any], chunk: int):
    """A slot holding ``trees`` (:func:`tpipe.core.layout.pack.chunk_slot`)."""
    return layout_pack.chunk_slot(self, trees, chunk)

  def pack_chunk(self, trees: Sequence[Any], chunk: int) -> dict[str, jax.Array]:
    """Model chunk ``chunk``'s packed window (:func:`tpipe.core.layout.pack.pack_chunk`)."""
    return layout_pack.pack_chunk(self, trees, chunk)

  def unpack_chunk(self, buffers: Mapping[str, jax.Array], chunk: int,
                   at: Mapping[str, int] | None = None, blocks: int | None = None) -> list:
    """The packed segments' trees (:func:`tpipe.core.layout.pack.unpack_chunk`)."""
    return layout_pack.unpack_chunk(self, buffers, chunk, at=at, blocks=blocks)

  # Accounting.

  def chunk_bytes(self) -> list[int]:
    """Per model chunk, its variables' bytes (:func:`tpipe.core.layout.accounting.chunk_bytes`)."""
    return accounting.chunk_bytes(self)

  def chunk_elements(self) -> list[Any]:
    """Per model chunk, its own elements of each staged leaf
    (:func:`tpipe.core.layout.accounting.chunk_elements`)."""
    return accounting.chunk_elements(self)

  def stage_bytes(self) -> int:
    """Bytes of one stage's variables, padding included
    (:func:`tpipe.core.layout.accounting.stage_bytes`)."""
    return accounting.stage_bytes(self)

  def packed_mask(self, predicate):
    """Per dtype, a mask of the packed elements of selected leaves
    (:func:`tpipe.core.layout.accounting.packed_mask`)."""
    return accounting.packed_mask(self, predicate)

  def shared_mask(self, predicate) -> dict[str, np.ndarray]:
    """Per shared leaf, which entries hold selected weights
    (:func:`tpipe.core.layout.accounting.shared_mask`)."""
    return accounting.shared_mask(self, predicate)

  # The whole tree.

  def to_staged(self, logical: Mapping[str, Any]):
    """Logical ``{"layers_i": tree}`` to the staged tree; exact
    (:func:`tpipe.core.layout.staging.to_staged`)."""
    return staging.to_staged(self, logical)

  def to_logical(self, staged) -> dict[str, Any]:
    """The staged tree back to logical ``{"layers_i": tree}``; exact
    (:func:`tpipe.core.layout.staging.to_logical`)."""
    return staging.to_logical(self, staged)
