"""Packing one chunk: its variables into its window of the packed buffers, and back.

A model chunk's variables are one tree per segment (:mod:`tpipe.core.layout.description`): a
stacked segment's leaves come from the chunk's stacked slot, a packed segment's from its window
of the packed buffers (block ``f`` of ``packed_shards`` holding piece ``f`` of every leaf), and
a plain layer's weight held by a shared leaf from its entry there. These functions convert
between the trees and what the chunk reads; they are exact (slices, reshapes, padding) and run
inside the tick loops as well as in :mod:`tpipe.core.layout.staging`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp

from tpipe.core.base import packing as packing_lib
from tpipe.core.layout import description as desc
from tpipe.core.layout import packed_places as places


def pack_chunk(layout: desc.StageLayout, trees: Sequence[Any],
               chunk: int) -> dict[str, jax.Array]:
  """Model chunk ``chunk``'s packed window ``{dtype: [packed_shards * w]}`` holding ``trees``
  (its packed segments' trees, whole; weights in shared leaves are left out): block ``f``
  holds piece ``f`` of every leaf."""
  segments = layout.segments[chunk]
  packed_segments = [k for k, seg in enumerate(segments) if not seg.stacked]
  full = [None] * len(segments)
  for k, tree in zip(packed_segments, trees):
    full[k] = tree
  without = layout.without_shared(full, chunk)
  trees = [without[k] for k in packed_segments]
  leaves, treedef = jax.tree.flatten(list(trees))
  cut = []
  for leaf, dim in zip(leaves, layout.packed_dims[chunk]):
    cut.append(places.cut_pieces(leaf, dim, layout.packed_shards))
  window = layout.packed_windows[chunk]
  if not cut and not window:
    return {}
  if not cut:
    sizes = {k: w * layout.packed_shards for k, w in window.items()}
    return packing_lib.empty(sizes)
  packing = dataclasses.replace(layout.packed_layouts[chunk], batch_dims=1)
  buffers = packing_lib.pack(jax.tree.unflatten(treedef, cut), packing, window)
  return {k: v.reshape(-1) for k, v in buffers.items()}


def unpack_chunk(layout: desc.StageLayout, buffers: Mapping[str, jax.Array], chunk: int,
                 at: Mapping[str, int] | None = None, blocks: int | None = None) -> list:
  """The inverse of :func:`pack_chunk`: the packed segments' trees from a whole window, or
  from buffers whose blocks hold the window at ``at`` (per dtype). From ``blocks=1`` block of
  several, each leaf's piece in it (see :func:`chunk_trees`)."""
  blocks = layout.packed_shards if blocks is None else blocks
  if blocks not in (1, layout.packed_shards):
    raise ValueError(f"packed buffers hold {layout.packed_shards} blocks; read all or one, "
                     f"not {blocks}.")
  packing = dataclasses.replace(layout.packed_layouts[chunk], batch_dims=1)
  if at is not None:
    offsets = []
    for offset, key in zip(packing.offsets, packing.dtypes):
      offsets.append(offset + at[key])
    packing = dataclasses.replace(packing, offsets=tuple(offsets))
  rows = {k: v.reshape(blocks, -1) for k, v in buffers.items()}
  pieces, treedef = jax.tree.flatten(packing_lib.unpack(rows, packing))
  if blocks != layout.packed_shards:  # One block of several: each leaf's piece in it.
    return jax.tree.unflatten(treedef, [p[0] for p in pieces])
  whole = jax.tree.leaves(layout.packed_shapes(chunk))
  joined = []
  for piece, dim, leaf in zip(pieces, layout.packed_dims[chunk], whole):
    joined.append(places.join_pieces(piece, dim, leaf.shape))
  return jax.tree.unflatten(treedef, joined)


def chunk_trees(layout: desc.StageLayout, local, chunk: int,
                at: Mapping[str, int] | None = None, blocks: int | None = None,
                shared_slots: Mapping | None = None, canonical: bool = False) -> list:
  """Model chunk ``chunk``'s variables, one tree per segment, from what it reads ``local``.

  Args:
    layout: the layout.
    local: what the chunk reads (:meth:`~tpipe.core.layout.description.StageLayout.
      chunk_local`: its stacked slot, packed window and shared leaves' entries); with ``at``,
      the packed buffers that hold the window instead.
    chunk: the model chunk.
    at: per dtype, where the window starts in each block of the packed buffers ``local`` holds.
    blocks: how many fsdp blocks the packed buffers hold (default ``packed_shards``: the whole
      buffers, whose packed leaves come back whole). With one block of several (a device's own,
      inside the tick loops), each packed leaf comes back as that block's piece of it
      (``piece_dims`` says where to gather it whole).
    shared_slots: per ``(group name, layer, path)`` of the chunk's shared weights, the entry to
      read (default its own; traced where a program serves several chunks).
    canonical: shared weights as their entries hold them (a matrix stored transposed stays so),
      else as the layer takes them.
  """
  packed = iter(unpack_chunk(layout, local[desc.PACKED], chunk, at, blocks))
  trees = []
  for seg in layout.segments[chunk]:
    if seg.stacked:
      trees.append(local[desc.STACKED][f"layers_{seg.layer}"])
    else:
      trees.append(next(packed))
  for k, group, member in layout.shared_members(chunk):
    slot = (shared_slots or {}).get((group.name, member.layer, member.path), member.slot)
    value = local[desc.SHARED][group.name][slot]
    if member.transposed and not canonical:
      value = value.T
    trees[k] = desc.with_leaf(trees[k], member.path, value)
  return trees


def chunk_slot(layout: desc.StageLayout, trees: Sequence[Any], chunk: int):
  """The inverse of :func:`chunk_trees`: a slot holding ``trees`` (one per segment); a shared
  leaf's entries that hold none of this chunk's weights are zeros."""
  segments = layout.segments[chunk]
  stacked, packed = {}, []
  for seg, tree in zip(segments, trees):
    if seg.stacked:
      stacked[f"layers_{seg.layer}"] = tree
    else:
      packed.append(tree)
  shared = {}
  for g in layout.shared:
    shared[g.name] = jnp.zeros((g.slots,) + g.shape, jnp.dtype(g.dtype))
  for k, g, m in layout.shared_members(chunk):  # The chunk's entries; the others zeros.
    entries = shared[g.name]
    value = desc.leaf_at(trees[k], m.path)
    if m.transposed:
      value = value.T
    shared[g.name] = entries.at[m.slot].set(value.astype(entries.dtype))
  return {desc.STACKED: stacked, desc.PACKED: pack_chunk(layout, packed, chunk),
          desc.SHARED: shared}
