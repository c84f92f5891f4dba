"""Where packed elements lie in a stage's buffers (:mod:`tpipe.core.layout.description`'s packed
part).

* **Windows.** Each model chunk reads a window of its packed slot's buffer per dtype: its own
  elements at its own offset (:func:`windows`). With ``packing="stage"`` a stage's chunks lie one
  after the other in one buffer; with ``"slot"`` each chunk has a slot of its own, padded to the
  fullest chunk.
* **FSDP pieces.** On a mesh with ``fsdp`` devices a buffer is ``fsdp`` equal blocks, and block
  ``f`` holds piece ``f`` of every leaf: the leaf cut evenly along one of its own dimensions
  (:func:`cut_dim`), or its flattened elements, padded, where none divides (:data:`FLAT`).
* **Element ranges.** Which elements of the staged buffers belong to chosen leaves, as a few
  comparisons per range rather than a stored mask (:func:`range_mask`).

Everything here is static (shapes and offsets) or exact (reshapes, slices, padding).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from tpipe import axis_rules
from tpipe import mesh as mesh_lib
from tpipe.core.base import packing as packing_lib


def position(chunk: int, num_stages: int, placement: str) -> tuple[int, int]:
  """``(r, s)``: model chunk ``chunk``'s local chunk index and stage."""
  r, s = divmod(chunk, num_stages)
  if placement == "v" and r == 1:
    s = num_stages - 1 - s
  return r, s


def window(buffers, offsets, lengths, blocks) -> dict:
  """Per dtype ``k`` in ``lengths``, the window ``[blocks * lengths[k]]`` of ``buffers[k]``
  (``[blocks * n]``): the same range of each block, from ``offsets[k]`` (an int, or a traced
  scalar). ``blocks`` is one count, or one per dtype."""
  out = {}
  for k, w in lengths.items():
    rows = buffers[k].reshape(blocks if isinstance(blocks, int) else blocks[k], -1)
    start = offsets[k]
    if isinstance(start, (int, np.integer)):
      part = lax.slice_in_dim(rows, int(start), int(start) + w, axis=1)
    else:
      part = lax.dynamic_slice_in_dim(rows, start, w, axis=1)
    out[k] = part.reshape(-1)
  return out


def windows(layouts, num_stages: int, num_repeats: int, placement: str, packing: str):
  """``(offsets, windows, block)``: per chunk and dtype its window's start and length in a
  block, and per dtype a block's length (see
  :class:`tpipe.core.layout.description.StageLayout`)."""
  own = [layout.sizes() for layout in layouts]
  if packing == "slot":
    block = packing_lib.buffer_sizes(layouts)
    return (tuple({k: 0 for k in block} for _ in layouts),
            tuple(dict(block) for _ in layouts), block)
  offsets, block = [None] * len(layouts), {}
  for s in range(num_stages):
    used = {}
    for r in range(num_repeats):
      c = next(c for c in range(len(layouts))
               if position(c, num_stages, placement) == (r, s))
      offsets[c] = {k: used.get(k, 0) for k in own[c]}
      for k, n in own[c].items():
        used[k] = used.get(k, 0) + n
    for k, n in used.items():
      block[k] = max(block.get(k, 0), n)
  return tuple(offsets), tuple(own), dict(sorted(block.items()))


def range_mask(ranges: dict, num_repeats: int, num_stages: int):
  """``mask(shape)``: True at ``[r, s, i]`` where ``i`` is in one of ``ranges[(r, s)]``."""
  count = max([len(v) for v in ranges.values()], default=0)
  bounds = np.zeros((num_repeats, num_stages, max(count, 1), 2), np.int32)
  for (r, s), found in ranges.items():
    bounds[r, s, :len(found)] = found

  def mask(shape):
    position = lax.broadcasted_iota(jnp.int32, shape, 2)
    selected = jnp.zeros(shape, bool)
    for k in range(count):
      start, stop = bounds[:, :, k:k + 1, 0], bounds[:, :, k:k + 1, 1]
      selected = selected | ((position >= start) & (position < stop))
    return selected

  return mask


FLAT = -1  # A packed leaf cut as its flattened elements (no dimension divides evenly).


def cut_dim(shape, names, shards: int, mesh, rules) -> int:
  """The dimension of a weight of ``shape`` that a packed buffer's ``shards`` blocks cut: the
  one its partition spec splits over ``fsdp``, else its largest divisible one, else FLAT."""
  if shards == 1:
    return 0 if shape else FLAT
  spec = axis_rules.weight_spec(shape, names, mesh, rules,
                                reserved=(mesh_lib.STAGE_AXIS, mesh_lib.DATA_AXIS))
  for dim, entry in enumerate(tuple(spec)):
    if mesh_lib.FSDP_AXIS in (entry if isinstance(entry, tuple) else (entry,)):
      return dim
  fits = [d for d in range(len(shape)) if shape[d] % shards == 0]
  return max(fits, key=lambda d: (shape[d], -d)) if fits else FLAT


def piece_shape(shape, dim: int, shards: int) -> tuple[int, ...]:
  """One of ``shards`` pieces of a leaf of ``shape`` cut along ``dim`` (or FLAT)."""
  if dim == FLAT:
    return (-(-int(np.prod(shape)) // shards),)
  return tuple(n // shards if i == dim else n for i, n in enumerate(shape))


def cut_pieces(leaf, dim: int, shards: int):
  """``leaf`` as ``[shards, *piece]``: piece ``f`` is the ``f``-th even part along ``dim`` (or
  of the flattened, zero-padded elements for FLAT)."""
  if dim == FLAT:
    flat = jnp.reshape(leaf, (-1,))
    piece = -(-flat.shape[0] // shards)
    flat = jnp.pad(flat, (0, piece * shards - flat.shape[0]))
    return flat.reshape(shards, piece)
  shape = leaf.shape
  split = shape[:dim] + (shards, shape[dim] // shards) + shape[dim + 1:]
  return jnp.moveaxis(jnp.reshape(leaf, split), dim, 0)


def join_pieces(pieces, dim: int, shape):
  """The inverse of :func:`cut_pieces`: a leaf of ``shape`` from ``[shards, *piece]``."""
  if dim == FLAT:
    return jnp.reshape(jnp.reshape(pieces, (-1,))[:int(np.prod(shape))], shape)
  return jnp.reshape(jnp.moveaxis(pieces, 0, dim), shape)
