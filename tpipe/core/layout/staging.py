"""Staging: whole variable trees converted between the logical and the staged forms, exactly.

Logical variables are ``{"layers_i": tree}`` (a repeated layer's copies stacked on a leading
axis); the staged tree is what a :class:`tpipe.core.layout.description.StageLayout`
describes (stacked leaves ``[R, S, k, ...]``, packed buffers ``[P, S, n]``, shared leaves
``[P_g, S, ...]``). Both directions are slices, gathers, reshapes and concatenations: no
arithmetic, so a round trip is bit for bit.

The forward direction builds each staged leaf with one operation over the whole tree (one gather
per stacked leaf, one concatenation of every stage's packed blocks): per-chunk or per-stage
pieces stacked afterwards would each be padded by XLA (CPU) to the whole staged leaf, ``S``
copies live at once.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from tpipe.core.layout import description as desc
from tpipe.core.layout import pack as layout_pack


def is_uniform(layout: desc.StageLayout, layer: int) -> bool:
  """Whether repeated ``layer`` is cut evenly in loop placement (staged = a reshape)."""
  k = layout.stacked[layer]
  copies = jax.tree.leaves(layout.logical[f"layers_{layer}"])[0].shape[0]
  if layout.placement != "loop" or copies != k * layout.num_chunks:
    return False
  for c, chunk in enumerate(layout.segments):
    for seg in chunk:
      if seg.stacked and seg.layer == layer and seg.first_copy != c * k:
        return False
  return True


def _slot_order(layout: desc.StageLayout) -> list[int]:
  """The model chunks in staged order: local chunk ``r`` major, stage ``s`` minor."""
  order = []
  for r in range(layout.num_repeats):
    for s in range(layout.num_stages):
      order.append(layout.chunk_at(r, s))
  return order


def _stacked_rows(layout: desc.StageLayout, layer: int) -> np.ndarray:
  """The copies of repeated ``layer`` each chunk slot keeps per leaf, in staged order."""
  k = layout.stacked[layer]
  rows = []
  for c in _slot_order(layout):
    for seg in layout.segments[c]:
      if seg.stacked and seg.layer == layer:
        rows.append(np.arange(seg.first_copy, seg.first_copy + k))
  return np.concatenate(rows)


def _stacked_leaves(layout: desc.StageLayout, logical) -> dict[str, Any]:
  """The staged stacked leaves ``{"layers_i": tree of [R, S, k, ...]}``."""
  lead = (layout.num_repeats, layout.num_stages)
  stacked = {}
  for layer, k in layout.stacked.items():
    name = f"layers_{layer}"
    if is_uniform(layout, layer):

      def reshape(a, k=k):
        return a.reshape(lead + (k,) + a.shape[1:])

      stacked[name] = jax.tree.map(reshape, logical[name])
      continue
    # One gather: a stack of slices keeps a padded copy of the whole per slice (XLA CPU).
    rows = _stacked_rows(layout, layer)

    def gather(a, rows=rows, k=k):
      taken = jnp.take(a, rows, axis=0, unique_indices=True)
      return taken.reshape(lead + (k,) + a.shape[1:])

    stacked[name] = jax.tree.map(gather, logical[name])
  return stacked


def _segment_values(values, logical, seg: desc.Segment):
  """A segment's slice of logical ``values`` (a layer without variables may be absent: Flax
  omits empty collections)."""
  name = f"layers_{seg.layer}"
  if name not in values:
    if jax.tree.leaves(logical[name]):
      shapes = jax.tree.map(lambda a: tuple(a.shape), logical[name])
      raise ValueError(f"the variables hold no {name!r}, which has {shapes}.")
    return logical[name]
  tree = values[name]
  if seg.copies is None:
    return tree
  start, stop = seg.first_copy, seg.first_copy + seg.copies
  return jax.tree.map(lambda a: a[start:stop], tree)


def _chunk_window(layout: desc.StageLayout, logical, chunk: int) -> dict[str, jax.Array]:
  """Model chunk ``chunk``'s packed window ``{dtype: [n]}`` from logical trees."""
  trees = []
  for seg in layout.segments[chunk]:
    if not seg.stacked:
      trees.append(_segment_values(logical, layout.logical, seg))
  return layout_pack.pack_chunk(layout, trees, chunk)


def _packed_buffers(layout: desc.StageLayout, logical) -> dict[str, jax.Array]:
  """Per dtype, every packed slot's buffer ``[P, S, n]``: each slot's chunks' windows (in local
  order) block by block, each block padded with zeros, all made by one concatenation."""
  shards = layout.packed_shards
  places = [(p, s) for p in range(layout.packed_slots) for s in range(layout.num_stages)]
  chunks = {}  # Per (packed slot, stage), its chunks in local order.
  for p, s in places:
    local = [layout.chunk_at(r, s) for r in range(layout.num_repeats)]
    chunks[(p, s)] = [c for c in local if layout.packed_place(c)[0] == p]
  windows = {}
  for place in places:
    for c in chunks[place]:
      windows[c] = _chunk_window(layout, logical, c)
  out = {}
  for k, n in layout.packed_sizes.items():
    pieces = []
    for place in places:
      rows = []
      for c in chunks[place]:
        if k in windows[c]:
          rows.append(windows[c][k].reshape(shards, -1))
      used = sum(row.shape[1] for row in rows)
      pad = jnp.zeros((n // shards - used,), jnp.dtype(k))
      for b in range(shards):  # Block b of this slot: each chunk's block b, then padding.
        pieces.extend(row[b] for row in rows)
        pieces.append(pad)
    flat = jnp.concatenate(pieces)
    out[k] = flat.reshape(layout.packed_slots, layout.num_stages, -1)
  return out


def _shared_arrays(layout: desc.StageLayout, logical) -> dict[str, jax.Array]:
  """Each shared leaf ``[P, S, ...]`` from the logical weights it holds (zeros elsewhere)."""
  out = {}
  for g in layout.shared:
    zeros = jnp.zeros(g.shape, jnp.dtype(g.dtype))
    entries = [[zeros] * layout.num_stages for _ in range(g.slots)]
    for m in g.members:
      value = desc.leaf_at(logical[f"layers_{m.layer}"], m.path)
      if m.transposed:
        value = value.T
      entries[m.slot][layout.position(m.chunk)[1]] = value.astype(zeros.dtype)
    out[g.name] = jnp.stack([jnp.stack(row) for row in entries])
  return out


def to_staged(layout: desc.StageLayout, logical: Mapping[str, Any]):
  """Logical ``{"layers_i": tree}`` to the staged tree; exact."""
  return {desc.STACKED: _stacked_leaves(layout, logical),
          desc.PACKED: _packed_buffers(layout, logical),
          desc.SHARED: _shared_arrays(layout, logical)}


def _join(layout: desc.StageLayout, layer: str, tree, pieces, staged):
  """Logical ``layer`` (abstract ``tree``) from its segments' ``pieces`` ``(first copy,
  copies, tree)`` (or from its stacked leaves where they are a reshape of it)."""
  index = int(layer.split("_")[1])
  if index in layout.stacked and is_uniform(layout, index):
    return jax.tree.map(lambda a: a.reshape((-1,) + a.shape[3:]), staged[desc.STACKED][layer])
  if index not in pieces or not jax.tree.leaves(tree):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)
  if pieces[index][0][1] is None:  # A plain layer: its one segment's tree.
    return pieces[index][0][2]
  parts = [p[2] for p in sorted(pieces[index], key=lambda p: p[0])]
  return jax.tree.map(lambda *a: jnp.concatenate(a, 0), *parts)


def to_logical(layout: desc.StageLayout, staged) -> dict[str, Any]:
  """The staged tree back to logical ``{"layers_i": tree}``; exact."""
  layout.check_staged(staged)
  pieces: dict[int, list] = {}
  for c in range(layout.num_chunks):
    trees = layout_pack.chunk_trees(layout, layout.chunk_local(staged, c), c)
    for seg, tree in zip(layout.segments[c], trees):
      pieces.setdefault(seg.layer, []).append((seg.first_copy, seg.copies, tree))
  logical = {}
  for layer, tree in layout.logical.items():
    logical[layer] = _join(layout, layer, tree, pieces, staged)
  return logical
