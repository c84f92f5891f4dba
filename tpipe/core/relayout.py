"""Staged variables to their checkpoint form and back, sharded over the whole mesh.

A checkpoint holds the **logical** variables, ``{"layers_i": tree}`` with a repeated layer's
copies stacked on a leading axis (what :meth:`tpipe.core.layout.StageLayout.to_logical` returns),
so it does not depend on the stages, the split, the schedule, the repeats or the mesh. Here each
logical leaf is also **split over the whole mesh**, so converting never gathers a model:

* a layer with per-leaf stacked copies (a ``Repeat``): each leaf as inside its stage (its own
  ``fsdp``/``tensor`` partition spec, the copy axis whole), and over ``stage`` on one weight
  dimension that stays even;
* a layer held only in packed buffers (an embedding, a head): over ``fsdp`` along the dimension
  its packed pieces are cut (:attr:`~tpipe.core.layout.StageLayout.packed_dims`), and over
  ``stage`` on one even dimension.

A leaf with no dimension that ``stage`` divides evenly stays whole over ``stage`` (small ones in
practice: a bias of odd width). :func:`checkpoint_specs` gives the specs.

The conversions run in one ``jax.shard_map``, manual over every axis. Saving, each device turns the
staged block it holds into its share of each leaf's stage-free block (slices: the pieces are rows
or columns of the weights) and trades the ``stage`` parts with an ``all_to_all`` over ``stage``
(one per stacked leaf, one per packed leaf per chunk). Restoring, a stacked leaf's parts come back
by the inverse ``all_to_all``; a packed leaf's stage-free block is all-gathered over ``stage`` (its
owner keeps it; every stage holds it for that moment). Leaves whose pieces do not line up with the
target (a flat cut, a spec the rules put elsewhere) are gathered whole over their stage's
``fsdp`` and ``tensor`` devices, and a leaf with no dimension ``stage`` divides over ``stage``,
one leaf at a time. Nothing is summed, so both directions are exact. A collection laid out in one
block (BatchNorm's statistics) keeps its packed leaves whole over ``fsdp``.

Example::

  specs = relayout.checkpoint_specs(layout, staged_specs, mesh)
  logical = jax.jit(lambda s: relayout.to_checkpoint(layout, s, staged_specs, mesh))(staged)
  staged = jax.jit(lambda t: relayout.from_checkpoint(layout, t, staged_specs, mesh))(logical)
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from tpipe import axis_rules
from tpipe import mesh as mesh_lib
from tpipe.core import layout as layout_lib

STACKED, PACKED = layout_lib.STACKED, layout_lib.PACKED


def _axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _entries(spec, rank: int) -> list[tuple[str, ...]]:
  entries = [_axes(e) for e in tuple(spec)]
  return entries + [()] * (rank - len(entries))


def _spec(entries) -> P:
  out = [None if not a else a[0] if len(a) == 1 else tuple(a) for a in entries]
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def _is_spec(x) -> bool:
  return isinstance(x, P)


def _leaf_path(path) -> str:
  return jax.tree_util.keystr(path)


# ----------------------------------------------------------------------------------------------
# Where each logical leaf lives.


def _stage_free(layout, staged_specs, mesh) -> dict[str, dict[str, list]]:
  """Per layer, per leaf (keystr), the logical leaf's spec entries without ``stage``."""
  shards = layout.packed_shards
  out = {}
  for name, tree in layout.logical.items():
    index = int(name.split("_")[1])
    leaves = {}
    if index in layout.stacked:
      specs = staged_specs[STACKED][name]
      for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)[0]:
        rank = len(_leaf(tree, path).shape)
        inner = _entries(spec, rank + 2)[3:]  # Staged [R, S, k, ...one copy].
        leaves[_leaf_path(path)] = [()] + inner
    else:
      dims = _packed_dims_of(layout, index)
      names = layout.axes.get(name, {})
      copy_axis = int(_is_repeated(layout, name))
      for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        entries = [()] * len(leaf.shape)
        dim = dims.get(_leaf_path(path), layout_lib.FLAT)
        if shards > 1 and dim != layout_lib.FLAT:
          entries[dim] = (mesh_lib.FSDP_AXIS,)
        tensor = _tensor_dim(leaf.shape[copy_axis:], names.get(_leaf_path(path)), mesh,
                             avoid=None if dim == layout_lib.FLAT else dim - copy_axis)
        if tensor is not None:
          entries[tensor + copy_axis] = (mesh_lib.TENSOR_AXIS,)
        leaves[_leaf_path(path)] = entries
    out[name] = leaves
  return out


def _set_leaf(tree, path, value) -> None:
  for key in path[:-1]:
    tree = tree[key.key if hasattr(key, "key") else key.idx]
  last = path[-1]
  tree[last.key if hasattr(last, "key") else last.idx] = value


def _tensor_dim(shape, names, mesh, avoid) -> int | None:
  """Where a packed-only weight of ``shape`` (one copy) splits over ``tensor`` in a checkpoint:
  where its partition spec puts ``tensor``, else its largest divisible dimension; never the
  dimension ``avoid`` that its pieces are cut along."""
  size = dict(mesh.shape).get(mesh_lib.TENSOR_AXIS, 1)
  if size == 1:
    return None
  spec = axis_rules.weight_spec(shape, names, mesh,
                                reserved=(mesh_lib.STAGE_AXIS, mesh_lib.DATA_AXIS))
  for d, entry in enumerate(tuple(spec)):
    if d != avoid and mesh_lib.TENSOR_AXIS in _axes(entry) and shape[d] % size == 0:
      return d
  fits = [d for d in range(len(shape)) if d != avoid and shape[d] % size == 0]
  return max(fits, key=lambda d: (shape[d], -d)) if fits else None


def _leaf(tree, path):
  for key in path:
    tree = tree[key.key if hasattr(key, "key") else key.idx]
  return tree


def _packed_dims_of(layout, layer: int) -> dict[str, int]:
  """A packed-only layer's cut dimension per leaf (of the logical leaf: a repeated layer's copy
  axis counted), read from the first chunk that packs it."""
  for c in range(layout.num_chunks):
    found = {_leaf_path(path): dim for seg, path, _, dim, *_ in _packed_leaves(layout, c)
             if seg.layer == layer}
    if found:
      return found
  return {}


def _stage_dim(shape, entries, sizes, num_stages: int, skip_first: bool) -> int | None:
  """The dimension that also takes ``stage``: the largest that stays even, else None."""
  best = None
  for d in range(1 if skip_first else 0, len(shape)):
    ways = math.prod(sizes[a] for a in entries[d]) * num_stages
    if shape[d] % ways == 0 and (best is None or shape[d] > shape[best]):
      best = d
  return best


def _placement(layout, staged_specs, mesh):
  """Per layer, per leaf: ``(stage-free entries, stage dim or None)``."""
  sizes = dict(mesh.shape)
  num_stages = layout.num_stages
  free = _stage_free(layout, staged_specs, mesh)
  out = {}
  for name, tree in layout.logical.items():
    repeated = _is_repeated(layout, name)
    leaves = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      entries = free[name][_leaf_path(path)]
      dim = None
      if num_stages > 1:
        dim = _stage_dim(leaf.shape, entries, sizes, num_stages, skip_first=repeated)
      leaves[_leaf_path(path)] = (entries, dim)
    out[name] = leaves
  return out


def checkpoint_specs(layout, staged_specs, mesh, stage_axis: str = mesh_lib.STAGE_AXIS):
  """The logical variables' partition specs in a checkpoint (see the module documentation).

  Args:
    layout: the collection's :class:`~tpipe.core.layout.StageLayout`.
    staged_specs: the staged tree's specs (:meth:`StageLayout.partition_specs`).
    mesh: the mesh (a ``Mesh`` or ``AbstractMesh``).
    stage_axis: the stage axis.

  Returns:
    ``{"layers_i": tree of PartitionSpec}``, shaped like ``layout.logical``.
  """
  placement = _placement(layout, staged_specs, mesh)

  def spec(name):
    def leaf_spec(path, _):
      entries, dim = placement[name][_leaf_path(path)]
      entries = list(entries)
      if dim is not None:
        entries[dim] = entries[dim] + (stage_axis,)
      return _spec(entries)
    return leaf_spec

  return {name: jax.tree_util.tree_map_with_path(spec(name), tree)
          for name, tree in layout.logical.items()}


# ----------------------------------------------------------------------------------------------
# Inside the shard_map: blocks of one device.


def _block_index(axes: Sequence[str], sizes) -> jax.Array | int:
  """The device's block index along a dimension split over ``axes`` (the first major)."""
  index = 0
  for axis in axes:
    index = index * sizes[axis] + lax.axis_index(axis)
  return index


def _slice_block(x, dim: int, axes: Sequence[str], sizes):
  """The device's block of ``x`` along ``dim`` when that dimension is split over ``axes``."""
  if not axes:
    return x
  ways = math.prod(sizes[a] for a in axes)
  size = x.shape[dim] // ways
  return lax.dynamic_slice_in_dim(x, _block_index(axes, sizes) * size, size, axis=dim)


def _gather_block(x, dim: int, axes: Sequence[str]):
  """The inverse of :func:`_slice_block`: the dimension whole over ``axes``."""
  if not axes:
    return x
  return lax.all_gather(x, tuple(axes), axis=dim, tiled=True)


def _lines_up(entries, dim: int, shards: int) -> bool:
  """Whether a packed piece (cut along ``dim`` over fsdp, whole over the rest) contains the
  stage-free block ``entries`` describes, so slices alone get from one to the other."""
  for d, axes in enumerate(entries):
    if mesh_lib.FSDP_AXIS in axes and (shards == 1 or d != dim or
                                       axes[0] != mesh_lib.FSDP_AXIS):
      return False
  if shards > 1 and (dim == layout_lib.FLAT or mesh_lib.FSDP_AXIS not in entries[dim]):
    return False
  return True


def _piece_to_block(piece, dim: int, whole_shape, entries, shards: int, sizes):
  """A packed piece to the device's stage-free block of the leaf."""
  if shards == 1:  # The piece is the whole leaf (a scalar's is flat: give it its shape back).
    piece = piece.reshape(whole_shape)
  if _lines_up(entries, dim, shards):
    for d, axes in enumerate(entries):
      rest = axes[1:] if (shards > 1 and d == dim) else axes
      piece = _slice_block(piece, d, rest, sizes)
    return piece
  if shards > 1:  # Whole over fsdp first (one leaf).
    pieces = lax.all_gather(piece, mesh_lib.FSDP_AXIS, axis=0, tiled=False)
    piece = layout_lib.join_pieces(pieces, dim, whole_shape)
  for d, axes in enumerate(entries):
    piece = _slice_block(piece, d, axes, sizes)
  return piece


def _block_to_piece(block, dim: int, whole_shape, entries, shards: int, sizes):
  """The inverse of :func:`_piece_to_block`."""
  if _lines_up(entries, dim, shards):
    for d, axes in enumerate(entries):
      rest = axes[1:] if (shards > 1 and d == dim) else axes
      block = _gather_block(block, d, rest)
    return block
  for d, axes in enumerate(entries):
    block = _gather_block(block, d, axes)
  if shards == 1:
    return block
  pieces = layout_lib.cut_pieces(block, dim, shards)
  return lax.dynamic_index_in_dim(pieces, lax.axis_index(mesh_lib.FSDP_AXIS), 0, keepdims=False)


def _to_stages(x, dim: int | None, stage_axis: str, num_stages: int):
  """Every stage's part of ``x`` (split along ``dim``) sent to it: ``[S_source, ...part]``;
  without a dimension every stage gets all of ``x``."""
  if dim is None:
    return lax.all_gather(x, stage_axis, axis=0, tiled=False)
  split = x.shape[:dim] + (num_stages, x.shape[dim] // num_stages) + x.shape[dim + 1:]
  parts = jnp.moveaxis(x.reshape(split), dim, 0)
  return lax.all_to_all(parts, stage_axis, 0, 0, tiled=False)


def _from_stages(x, dim: int | None, stage_axis: str, num_stages: int, owner=None):
  """Inverse of :func:`_to_stages` for the data stage ``owner`` (every stage when None) needs:
  ``x`` is the device's part of the leaf (its ``stage`` block along ``dim``) for each target
  ``[S_target, ...]``, or the same for all (``owner`` given); returns the stage-free block."""
  if dim is None:
    return x[lax.axis_index(stage_axis)] if owner is None else x
  if owner is not None:  # Every stage gets the whole (stage-free) block; the owner keeps it.
    return lax.all_gather(x, stage_axis, axis=dim, tiled=True)
  parts = lax.all_to_all(x, stage_axis, 0, 0, tiled=False)  # [S_source, ...part]
  parts = jnp.moveaxis(parts, 0, dim)
  shape = parts.shape[:dim] + (parts.shape[dim] * parts.shape[dim + 1],) + parts.shape[dim + 2:]
  return parts.reshape(shape)


def _packed_leaves(layout, chunk: int):
  """Chunk ``chunk``'s packed leaves: ``(segment, key path, whole shape, cut dim, piece shape,
  dtype key, offset in its block)``, in packing order."""
  pieces = layout.packed_layouts[chunk]
  dims = iter(layout.packed_dims[chunk])
  found = iter(zip(pieces.shapes, pieces.dtypes, pieces.offsets))
  out = []
  for seg in layout.segments[chunk]:
    if seg.stacked:
      continue
    shapes = layout_lib.segment_shapes(layout.logical, seg)
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
      shape, key, offset = next(found)
      out.append((seg, path, tuple(leaf.shape), next(dims), shape, key, offset))
  return out


def _packed_work(layout, placement):
  """Every packed leaf of every chunk, as both directions walk them: ``(r, owner stage, layer
  name, segment, key path, whole shape, cut dim, piece shape, dtype key, offset, (stage-free
  entries, stage dim))``."""
  for c in range(layout.num_chunks):
    r, owner = layout.position(c)
    for seg, path, *rest in _packed_leaves(layout, c):
      name = f"layers_{seg.layer}"
      yield (r, owner, name, seg, path, *rest, placement[name][_leaf_path(path)])


# ----------------------------------------------------------------------------------------------
# The two directions.


def _mapped(fn, mesh, in_specs, out_specs):
  # Without replication checks: a leaf gathered whole over fsdp is the same on every fsdp
  # device, which the checker cannot tell from the gather.
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       axis_names=set(mesh.axis_names), check_vma=False)


def _after(value, state):
  """``(value, state)``, ``value`` not computed before ``state`` is (the outputs so far, threaded
  through): one leaf converted at a time, so a device holds one leaf's transient copies, not
  every leaf's at once, and the outputs are updated in place."""
  return lax.optimization_barrier((value, state))


def _prepare(layout, value, staged_specs, mesh, stage_axis):
  """``(many, trees, placement, checkpoint specs)`` for one conversion of ``value`` (a tree or
  a list of them)."""
  _check_blocks(layout, staged_specs, mesh)
  many = isinstance(value, list)
  return (many, value if many else [value], _placement(layout, staged_specs, mesh),
          checkpoint_specs(layout, staged_specs, mesh, stage_axis))


def to_checkpoint(layout, staged, staged_specs, mesh, stage_axis: str = mesh_lib.STAGE_AXIS):
  """Staged variables to their logical checkpoint form, split as :func:`checkpoint_specs`.

  Args:
    layout: the collection's :class:`~tpipe.core.layout.StageLayout`.
    staged: a staged tree, or a list of them (parameters and optimizer moments: converted one
      leaf at a time, all in one program), inside ``jax.jit``, sharded as ``staged_specs``.
    staged_specs: the staged tree's specs (:meth:`StageLayout.partition_specs`).
    mesh: the mesh.
    stage_axis: the stage axis.

  Returns:
    ``{"layers_i": tree}`` (or a list) equal to ``layout.to_logical(staged)``, bit for bit.
  """
  many, trees, placement, out_specs = _prepare(layout, staged, staged_specs, mesh, stage_axis)
  sizes, num_stages, shards = dict(mesh.shape), layout.num_stages, layout.packed_shards

  def local_zeros(name, path, leaf):
    entries, dim = placement[name][_leaf_path(path)]
    shape = list(leaf.shape)
    for d, axes in enumerate(entries):
      shape[d] //= math.prod(sizes[a] for a in axes)
    if dim is not None:
      shape[dim] //= num_stages
    return jnp.zeros(shape, leaf.dtype)

  def body(trees):
    # Each device's block of every logical leaf, filled in place a piece at a time.
    outs = [{name: jax.tree_util.tree_map_with_path(
        lambda p, a, name=name: local_zeros(name, p, a), tree)
        for name, tree in layout.logical.items()} for _ in trees]

    def write(t, name, path, first, value):
      target = _leaf(outs[t][name], path)
      if not _is_repeated(layout, name):
        new = value
      else:
        new = lax.dynamic_update_slice_in_dim(target, value.astype(target.dtype), first, 0)
      _set_leaf(outs[t][name], path, new)

    for name in (f"layers_{i}" for i in layout.stacked):
      starts = _stacked_starts(layout, int(name.split("_")[1]))
      for t, tree in enumerate(trees):
        for path, local in jax.tree_util.tree_flatten_with_path(tree[STACKED][name])[0]:
          _, dim = placement[name][_leaf_path(path)]
          owned, outs = _after(local[:, 0], outs)  # [R, k, ...stage-free block of one copy]
          got = _to_stages(owned, None if dim is None else dim + 1, stage_axis, num_stages)
          for (r, s), first in starts.items():  # got: [S_source, R, k, ...]
            write(t, name, path, first, got[s, r])
    for (r, owner, name, seg, path, whole, dim, piece_shape, dtype, offset,
         (entries, stage_dim)) in _packed_work(layout, placement):
      for t, tree in enumerate(trees):
        piece = lax.slice_in_dim(tree[PACKED][dtype][r, 0], offset,
                                 offset + math.prod(piece_shape))
        piece, outs = _after(piece, outs)
        piece = piece.reshape(piece_shape)  # Junk unless this device's stage is the owner.
        block = _piece_to_block(piece, dim, whole, entries, shards, sizes)
        write(t, name, path, seg.first_copy,
              _to_stages(block, stage_dim, stage_axis, num_stages)[owner])
    return outs

  outs = _mapped(body, mesh, ([staged_specs] * len(trees),),
                 [out_specs] * len(trees))(list(trees))
  return outs if many else outs[0]


def from_checkpoint(layout, logical, staged_specs, mesh, stage_axis: str = mesh_lib.STAGE_AXIS):
  """The inverse of :func:`to_checkpoint`: logical variables (a tree or a list of them) split as
  :func:`checkpoint_specs` to staged trees split as ``staged_specs``; exact."""
  many, trees, placement, in_specs = _prepare(layout, logical, staged_specs, mesh, stage_axis)
  sizes, num_stages, shards = dict(mesh.shape), layout.num_stages, layout.packed_shards
  lead = (layout.num_repeats, 1)

  def body(trees):
    me = lax.axis_index(stage_axis)
    stacked = [{} for _ in trees]
    done = []  # The staged leaves made so far, threaded through each barrier.
    for name in (f"layers_{i}" for i in layout.stacked):
      index = int(name.split("_")[1])
      starts = _stacked_starts(layout, index)
      k = layout.stacked[index]
      # Per target stage, the copies it holds: [S, R, k] indices into the copy axis.
      order = np.array([[list(range(starts[(r, s)], starts[(r, s)] + k))
                         for r in range(layout.num_repeats)] for s in range(num_stages)])
      for t, tree in enumerate(trees):
        def leaf(path, block, name=name, order=order):
          _, dim = placement[name][_leaf_path(path)]
          block, done[:] = _after(block, list(done))
          if dim is None:
            mine = jnp.take(block, jnp.asarray(order)[me], axis=0)
          else:
            mine = _from_stages(jnp.take(block, order, axis=0), dim + 1, stage_axis, num_stages)
          done.append(mine[:, None])
          return len(done) - 1
        stacked[t][name] = jax.tree_util.tree_map_with_path(leaf, tree[name])
    block_size = {k: n // shards for k, n in layout.packed_sizes.items()}
    buffers = [{k: jnp.zeros(lead + (n,), jnp.dtype(k)) for k, n in block_size.items()}
               for _ in trees]
    for (r, owner, name, seg, path, whole, dim, piece_shape, dtype, offset,
         (entries, stage_dim)) in _packed_work(layout, placement):
      for t, tree in enumerate(trees):
        block, _ = _after(_leaf(tree[name], path), buffers)
        if seg.copies is not None:
          block = block[seg.first_copy:seg.first_copy + seg.copies]
        block = _from_stages(block, stage_dim, stage_axis, num_stages, owner=owner)
        piece = _block_to_piece(block, dim, whole, entries, shards, sizes).reshape(-1)
        # Only the owner's stage changes its buffer (in place: a slice updated).
        buffer, start = buffers[t][dtype], (r, 0, offset)
        old = lax.dynamic_slice(buffer, start, (1, 1, piece.shape[0]))
        buffers[t][dtype] = lax.dynamic_update_slice(
            buffer, jnp.where(me == owner, piece[None, None], old), start)
    stacked = jax.tree.map(lambda i: done[i], stacked)
    return [{STACKED: s, PACKED: b} for s, b in zip(stacked, buffers)]

  outs = _mapped(body, mesh, ([in_specs] * len(trees),),
                 [staged_specs] * len(trees))(list(trees))
  return outs if many else outs[0]


def _check_blocks(layout, staged_specs, mesh) -> None:
  """A device must hold exactly one block of each packed buffer."""
  fsdp = dict(mesh.shape).get(mesh_lib.FSDP_AXIS, 1)
  if layout.packed_shards > 1 and layout.packed_shards != fsdp:
    raise ValueError(
        f"the layout's packed buffers are in {layout.packed_shards} blocks for an fsdp axis of "
        f"that size, but this mesh's fsdp axis has {fsdp} devices; convert on the mesh the "
        "layout was built for.")
  for dtype, spec in staged_specs[PACKED].items():
    entries = tuple(spec)
    split = len(entries) == 3 and mesh_lib.FSDP_AXIS in _axes(entries[2])
    if split != (layout.packed_shards > 1):
      raise ValueError(
          f"the packed {dtype} buffer is laid out in {layout.packed_shards} fsdp blocks but "
          f"its partition spec is {spec}; take the specs from the same layout's "
          "partition_specs(mesh=...) as the layout was built for.")


def _stacked_starts(layout, layer: int) -> dict[tuple[int, int], int]:
  """``{(r, s): first copy}`` of the stacked copies of ``layer`` in each chunk slot."""
  out = {}
  for c, chunk in enumerate(layout.segments):
    for seg in chunk:
      if seg.stacked and seg.layer == layer:
        out[layout.position(c)] = seg.first_copy
  return out


def _is_repeated(layout, name: str) -> bool:
  index = int(name.split("_")[1])
  return any(g.repeated and g.layer == index for chunk in layout.groups for g in chunk)


def staged_specs_of(tree) -> Any:
  """``tree``'s leaves' partition specs (abstract arrays with ``NamedSharding``)."""
  return jax.tree.map(lambda a: a.sharding.spec, tree)
