"""Packing pytrees of arrays into fixed-size flat buffers, one buffer per dtype.

A pipeline runs every stage's layers as one branch of a ``lax.switch``, and all branches must take
and return values of one type. What crosses a stage boundary, and each stage's parameters, are
pytrees that differ per stage, so they travel packed: every leaf is flattened into the buffer of
its dtype, and every buffer is zero-padded to the largest size any stage needs.

A :class:`Layout` is the static description of one pytree's packing (hashable, so it can be
static data of jitted code). With ``batch_dims=0`` leaves are packed whole into 1-D buffers
``[n]``; with ``batch_dims=1`` leaves share a leading batch axis ``B`` that is kept, so a leaf
``[B, d1, d2]`` becomes ``d1 * d2`` columns of a ``[B, n]`` buffer. The batch size is not part of
the layout, so one layout serves any batch or micro-batch size.

Packing is a reshape and one concatenate per dtype; unpacking is static slices and reshapes.

Example::

  >>> import jax.numpy as jnp
  >>> a = {"h": jnp.ones((2, 3)), "ids": jnp.arange(2, dtype=jnp.int32)}
  >>> b = {"h": jnp.ones((2, 5))}
  >>> la, lb = layout_of(a, batch_dims=1), layout_of(b, batch_dims=1)
  >>> la.sizes(), lb.sizes()
  ({'float32': 3, 'int32': 1}, {'float32': 5})
  >>> sizes = buffer_sizes([la, lb])
  >>> sizes
  {'float32': 5, 'int32': 1}
  >>> packed = pack(b, lb, sizes)
  >>> {k: v.shape for k, v in packed.items()}
  {'float32': (2, 5), 'int32': (2, 1)}
  >>> unpack(pack(a, la, sizes), la)["ids"]
  Array([0, 1], dtype=int32)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from tpipe.core.base import spmd

_BATCH_DIMS = (0, 1)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each leaf of one pytree lives in the per-dtype buffers.

  Attributes:
    treedef: the pytree structure.
    shapes: per leaf, its shape without the batch axis (the whole shape when ``batch_dims=0``).
    dtypes: per leaf, the name of its dtype, which is also the key of its buffer.
    offsets: per leaf, its first element in its buffer (a column when ``batch_dims=1``).
    batch_dims: 0 for 1-D buffers ``[n]``; 1 for ``[B, n]`` buffers with a shared batch axis.
  """
  treedef: Any
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]
  offsets: tuple[int, ...]
  batch_dims: int = 0

  def sizes(self) -> dict[str, int]:
    """Elements per dtype buffer this layout needs (per batch row when batched), sorted by key."""
    sizes = {}
    for shape, dtype in zip(self.shapes, self.dtypes):
      sizes[dtype] = sizes.get(dtype, 0) + math.prod(shape)
    return dict(sorted(sizes.items()))


def dtype_key(dtype) -> str:
  """The stable buffer key of a dtype: ``np.dtype(dtype).name`` (``'bfloat16'`` for bfloat16)."""
  return np.dtype(dtype).name


def _leaf_name(path) -> str:
  return jax.tree_util.keystr(path) or "<root>"


def _check_leaf(path, leaf) -> None:
  """Rejects leaves that are not arrays, key arrays and dtypes JAX cannot hold exactly."""
  if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
    raise TypeError(f"Leaf {_leaf_name(path)} is a {type(leaf).__name__}, not an array; only "
                    "arrays (jax.Array, np.ndarray or jax.ShapeDtypeStruct) can be packed.")
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    raise TypeError(f"Leaf {_leaf_name(path)} is a PRNG key array; keys cannot be packed, pass "
                    "them as RNG streams instead.")
  if jax.dtypes.canonicalize_dtype(leaf.dtype) != leaf.dtype:
    raise TypeError(f"Leaf {_leaf_name(path)} has dtype {dtype_key(leaf.dtype)}, which JAX turns "
                    f"into {dtype_key(jax.dtypes.canonicalize_dtype(leaf.dtype))}; enable "
                    "jax_enable_x64 to pack it exactly.")


def _check_batch_dims(batch_dims) -> None:
  if batch_dims not in _BATCH_DIMS:
    raise ValueError(f"batch_dims must be 0 or 1, got {batch_dims!r}.")


def _batch_size(paths, leaves) -> int | None:
  """The common leading size of batched leaves (None for no leaves); errors name the leaves."""
  batch = None
  for path, leaf in zip(paths, leaves):
    if len(leaf.shape) < 1:
      raise ValueError(f"With batch_dims=1 every leaf needs a leading batch axis, but leaf "
                       f"{_leaf_name(path)} is a scalar (shape ()).")
    if batch is None:
      batch, first = leaf.shape[0], (path, leaf.shape)
    elif leaf.shape[0] != batch:
      raise ValueError(f"With batch_dims=1 every leaf must have the same leading (batch) size, "
                       f"but leaf {_leaf_name(first[0])} has shape {tuple(first[1])} and leaf "
                       f"{_leaf_name(path)} has shape {tuple(leaf.shape)}.")
  return batch


def layout_of(tree, batch_dims: int = 0) -> Layout:
  """The layout of a pytree of arrays or ``jax.ShapeDtypeStruct``s.

  Args:
    tree: the pytree to describe; only its structure, shapes and dtypes are read.
    batch_dims: 0 to pack leaves whole; 1 to keep a leading batch axis that every leaf shares
      (its size is not recorded).

  Returns:
    The layout; leaves are placed in flattening order within the buffer of their dtype.

  Raises:
    TypeError: a leaf is not an array, is a PRNG key array, or is 64-bit without x64 enabled.
    ValueError: bad ``batch_dims``, or with ``batch_dims=1`` a scalar leaf or leaves whose
      leading sizes differ.

  Example::

    >>> import numpy as np
    >>> layout = layout_of({"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)})
    >>> layout.offsets, layout.sizes()
    ((0, 3), {'float32': 9})
  """
  _check_batch_dims(batch_dims)
  path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  paths = [p for p, _ in path_leaves]
  leaves = [leaf for _, leaf in path_leaves]
  for path, leaf in zip(paths, leaves):
    _check_leaf(path, leaf)
  if batch_dims:
    _batch_size(paths, leaves)
  shapes, dtypes, offsets, used = [], [], [], {}
  for leaf in leaves:
    shape = tuple(int(d) for d in leaf.shape[batch_dims:])
    key = dtype_key(leaf.dtype)
    shapes.append(shape)
    dtypes.append(key)
    offsets.append(used.get(key, 0))
    used[key] = offsets[-1] + math.prod(shape)
  return Layout(treedef, tuple(shapes), tuple(dtypes), tuple(offsets), batch_dims)


def buffer_sizes(layouts: Iterable[Layout]) -> dict[str, int]:
  """Per dtype, the largest size any of ``layouts`` needs: the common buffer sizes.

  Raises:
    ValueError: the layouts mix ``batch_dims`` (their sizes count different things).

  Example::

    >>> import numpy as np
    >>> a = layout_of(np.zeros(4, np.float32))
    >>> b = layout_of((np.zeros(2, np.float32), np.zeros(3, np.int8)))
    >>> buffer_sizes([a, b])
    {'float32': 4, 'int8': 3}
  """
  layouts = tuple(layouts)
  batch_dims = {layout.batch_dims for layout in layouts}
  if len(batch_dims) > 1:
    raise ValueError(f"Layouts mix batch_dims {sorted(batch_dims)}; buffers shared by several "
                     "layouts need one packed format.")
  sizes = {}
  for layout in layouts:
    for key, size in layout.sizes().items():
      sizes[key] = max(sizes.get(key, 0), size)
  return dict(sorted(sizes.items()))


def empty(sizes: Mapping[str, int], batch: int | None = None) -> dict[str, jax.Array]:
  """Zero buffers in the packed format: ``[n]`` per dtype, or ``[batch, n]`` when batched.

  Example::

    >>> {k: v.shape for k, v in empty({"int32": 2, "float32": 3}, batch=4).items()}
    {'float32': (4, 3), 'int32': (4, 2)}
  """
  lead = () if batch is None else (batch,)
  return {key: jnp.zeros(lead + (n,), jnp.dtype(key)) for key, n in sorted(sizes.items())}


def _check_matches(tree, layout: Layout):
  """Flattens ``tree``, checking it has ``layout``'s structure, shapes and dtypes."""
  path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  if treedef != layout.treedef:
    raise ValueError(f"The tree's structure {treedef} differs from the layout's "
                     f"{layout.treedef}.")
  paths = [p for p, _ in path_leaves]
  leaves = [leaf for _, leaf in path_leaves]
  for path, leaf, shape, dtype in zip(paths, leaves, layout.shapes, layout.dtypes):
    _check_leaf(path, leaf)
    if isinstance(leaf, jax.ShapeDtypeStruct):
      raise TypeError(f"Leaf {_leaf_name(path)} is a ShapeDtypeStruct, which has no values to "
                      "pack; pass arrays (ShapeDtypeStructs only describe a layout).")
    got = (tuple(leaf.shape[layout.batch_dims:]), dtype_key(leaf.dtype))
    if got != (shape, dtype):
      raise ValueError(f"Leaf {_leaf_name(path)} has shape {tuple(leaf.shape)} and dtype "
                       f"{got[1]}, but the layout expects {shape} {dtype}"
                       f"{' after the batch axis' if layout.batch_dims else ''}.")
  batch = _batch_size(paths, leaves) if layout.batch_dims else None
  return leaves, batch


def pack(tree, layout: Layout, sizes: Mapping[str, int] | None = None) -> dict[str, jax.Array]:
  """Packs ``tree`` into one zero-padded buffer per dtype.

  Args:
    tree: a pytree with ``layout``'s structure, shapes and dtypes (any batch size if batched).
    layout: its layout, from :func:`layout_of`.
    sizes: elements per dtype buffer (per row if batched), at least what the layout needs, e.g.
      from :func:`buffer_sizes`; dtypes the tree lacks get all-zero buffers. Default: the
      layout's own sizes.

  Returns:
    Buffers ``[n]`` (or ``[B, n]``) keyed by dtype name, sorted by key. Inside ``shard_map`` every
    buffer, zero-filled ones included, varies over the union of the mesh axes the leaves vary
    over, so that packed values of different ``lax.switch`` branches have equal types.

  Raises:
    ValueError: the tree does not match the layout, ``sizes`` is too small or lacks a dtype, or a
      batched tree with no leaves must fill buffers (its batch size is unknown).
  """
  leaves, batch = _check_matches(tree, layout)
  needed = layout.sizes()
  sizes = needed if sizes is None else dict(sizes)
  for key, n in needed.items():
    if sizes.get(key, -1) < n:
      per_row = " per row" if layout.batch_dims else ""
      raise ValueError(f"The layout needs {n} {key} elements{per_row} but sizes gives "
                       f"{sizes.get(key, 'none')}.")
  if layout.batch_dims and batch is None and sizes:
    raise ValueError("A batched tree with no leaves has no batch size; use empty(sizes, batch).")
  lead = () if batch is None else (batch,)
  parts = {key: [] for key in sizes}
  for leaf, shape, key in zip(spmd.rows_over_expert_axis(leaves), layout.shapes,
                              layout.dtypes):
    parts[key].append(jnp.reshape(leaf, lead + (math.prod(shape),)))
  buffers = {}
  for key in sorted(sizes):
    pad = sizes[key] - needed.get(key, 0)
    if pad or not parts[key]:
      parts[key].append(jnp.zeros(lead + (pad,), jnp.dtype(key)))
    buffers[key] = parts[key][0] if len(parts[key]) == 1 else jnp.concatenate(parts[key], -1)
  varying = frozenset().union(*map(spmd.varying_axes, leaves))
  return {key: spmd.cast_to(buffer, varying) for key, buffer in buffers.items()}


def unpack(buffers: Mapping[str, jax.Array], layout: Layout):
  """Rebuilds the tree of ``layout`` from packed buffers; padding and extra dtypes are ignored.

  Raises:
    ValueError: a buffer the layout needs is missing, has the wrong rank or is too small.
    TypeError: a buffer's dtype differs from its key.
  """
  lead_rank = layout.batch_dims
  for key, n in layout.sizes().items():
    if key not in buffers:
      raise ValueError(f"The layout needs buffer {key!r}; the buffers have {sorted(buffers)}.")
    buffer = buffers[key]
    if dtype_key(buffer.dtype) != key:
      raise TypeError(f"Buffer {key!r} has dtype {dtype_key(buffer.dtype)}.")
    if buffer.ndim != 1 + lead_rank:
      raise ValueError(f"Buffer {key!r} has shape {tuple(buffer.shape)}; with batch_dims="
                       f"{lead_rank} buffers have rank {1 + lead_rank}.")
    if buffer.shape[-1] < n:
      raise ValueError(f"Buffer {key!r} has {buffer.shape[-1]} elements"
                       f"{' per row' if lead_rank else ''}, fewer than the {n} the layout needs.")
  leaves = []
  # Whole over the partitioner's axes where the leaves are cut: left free, it may split a buffer
  # (as an expert- or tensor-split leaf in it suggests) at places that are no leaf's boundary,
  # and fetch the pieces a slice needs with collective-permutes inside a stage's branch
  # (spmd.whole_over_auto_axes). Pinned, the cut is local after one grouped all-gather at most.
  buffers = spmd.whole_over_auto_axes({key: buffers[key] for key in layout.sizes()})
  for shape, key, offset in zip(layout.shapes, layout.dtypes, layout.offsets):
    buffer = buffers[key]
    part = jax.lax.slice_in_dim(buffer, offset, offset + math.prod(shape), axis=lead_rank)
    leaves.append(jnp.reshape(part, buffer.shape[:lead_rank] + shape))
  return jax.tree_util.tree_unflatten(layout.treedef, leaves)
