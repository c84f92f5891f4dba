"""Accounting of a stage layout: bytes and elements per chunk and stage, and masks of leaves.

Static answers about a :class:`tpipe.core.layout.description.StageLayout`: how many bytes
each chunk's variables hold and each stage occupies (padding included), how many of each staged
leaf's elements are a chunk's own, and which elements of the packed buffers and shared leaves
belong to chosen weights (for optimizer masks such as weight decay).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpipe.core.base import packing as packing_lib
from tpipe.core.layout import description as desc
from tpipe.core.layout import packed_places as places


def _elements(a) -> int:
  return int(np.prod(a.shape))


def tree_bytes(tree) -> int:
  """The bytes of ``tree``'s leaves (arrays or abstract)."""
  total = 0
  for a in jax.tree.leaves(tree):
    total += _elements(a) * jnp.dtype(a.dtype).itemsize
  return total


def chunk_bytes(layout: desc.StageLayout) -> list[int]:
  """Per model chunk, the bytes of variables it holds (without padding)."""
  out = []
  for chunk in layout.segments:
    total = 0
    for seg in chunk:
      total += tree_bytes(desc.segment_shapes(layout.logical, seg))
    out.append(total)
  return out


def chunk_elements(layout: desc.StageLayout) -> list[Any]:
  """Per model chunk, a tree shaped like ``local_shapes()`` holding how many of each leaf's
  elements are the chunk's own (the rest is other chunks' or padding)."""
  out = []
  for c, chunk in enumerate(layout.segments):
    stacked = {}
    for seg in chunk:
      if seg.stacked:
        shapes = desc.segment_shapes(layout.logical, seg)
        stacked[f"layers_{seg.layer}"] = jax.tree.map(_elements, shapes)
    sizes = packing_lib.layout_of(layout.packed_shapes(c)).sizes()
    packed = {k: sizes.get(k, 0) for k in layout.packed_sizes}
    shared = {}
    for g in layout.shared:
      own = [m for m in g.members if m.chunk == c]
      shared[g.name] = len(own) * int(np.prod(g.shape))
    out.append({desc.STACKED: stacked, desc.PACKED: packed, desc.SHARED: shared})
  return out


def stage_bytes(layout: desc.StageLayout) -> int:
  """Bytes of one stage's variables, padding included (what every stage occupies): R chunk
  slots of stacked leaves, P packed slots and each shared leaf's entries."""
  local = layout.local_shapes()
  stacked = layout.num_repeats * tree_bytes(local[desc.STACKED])
  packed = layout.packed_slots * tree_bytes(local[desc.PACKED])
  shared = sum(g.slots * g.entry_bytes for g in layout.shared)
  return stacked + packed + shared


def _leaf_paths(packing: packing_lib.Layout) -> list:
  """The key paths of a packing's leaves, in its order."""
  numbered = jax.tree.unflatten(packing.treedef, list(range(len(packing.shapes))))
  return [path for path, _ in jax.tree_util.tree_flatten_with_path(numbered)[0]]


def _add_range(found: list, start: int, stop: int) -> None:
  """Appends ``[start, stop)`` to ``found``, merged with the last range where they touch."""
  if stop == start:
    return
  if found and found[-1][1] == start:
    found[-1] = (found[-1][0], stop)
  else:
    found.append((start, stop))


def _chunk_ranges(layout: desc.StageLayout, chunk: int, predicate, ranges: dict) -> None:
  """Adds to ``ranges`` (per dtype, per packed place) the element ranges of model chunk
  ``chunk``'s packed leaves that ``predicate`` selects."""
  packing = layout.packed_layouts[chunk]
  paths = _leaf_paths(packing)
  slot = layout.packed_place(chunk)
  whole = [_elements(a) for a in jax.tree.leaves(layout.packed_shapes(chunk))]
  for f in range(layout.packed_shards):  # Block f holds piece f of every leaf.
    leaves = zip(paths, packing.shapes, packing.dtypes, packing.offsets,
                 layout.packed_dims[chunk], whole)
    for path, shape, key, offset, dim, size in leaves:
      if not predicate(path):
        continue
      found = ranges[key].setdefault(slot, [])
      block_start = f * layout.packed_sizes[key] // layout.packed_shards
      start = block_start + layout.packed_offsets[chunk][key] + offset
      piece = int(np.prod(shape))
      if dim == places.FLAT:
        # A flat cut's last pieces end in padding, which is no leaf's.
        piece = min(piece, max(0, size - f * piece))
      _add_range(found, start, start + piece)


def packed_mask(layout: desc.StageLayout, predicate):
  """Which elements of the packed buffers belong to leaves ``predicate(path)`` selects.

  Args:
    layout: the layout.
    predicate: takes a leaf's key path inside its layer's tree (e.g. ending in
      ``DictKey("kernel")``) and returns whether to select it.

  Returns:
    Per dtype, ``mask(shape) -> bool array`` of the staged buffer's shape ``[P, S, n]``,
    computed from the elements' positions (a few comparisons per selected range; no stored
    mask).
  """
  ranges = {k: {} for k in layout.packed_sizes}
  for c in range(len(layout.packed_layouts)):
    _chunk_ranges(layout, c, predicate, ranges)
  out = {}
  for k, found in ranges.items():
    out[k] = places.range_mask(found, layout.packed_slots, layout.num_stages)
  return out


def shared_mask(layout: desc.StageLayout, predicate) -> dict[str, np.ndarray]:
  """Per shared leaf, a bool ``[P, S, 1, ...]`` table (broadcasting over an entry): whether the
  weight in each entry is one ``predicate(path)`` selects (see :func:`packed_mask`)."""
  out = {}
  for g in layout.shared:
    table = np.zeros((g.slots, layout.num_stages) + (1,) * len(g.shape), bool)
    for m in g.members:
      tree = layout.logical[f"layers_{m.layer}"]
      paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
      path = next(p for p in paths if jax.tree_util.keystr(p) == m.path)
      table[m.slot, layout.position(m.chunk)[1]] = predicate(path)
    out[g.name] = table
  return out
