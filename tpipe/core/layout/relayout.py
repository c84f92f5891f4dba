"""Staged variables to their checkpoint form and back, sharded over the whole mesh.

A checkpoint holds the **logical** variables, ``{"layers_i": tree}`` with a repeated layer's
copies stacked on a leading axis (what
:meth:`tpipe.core.layout.description.StageLayout.to_logical` returns),
so it does not depend on the stages, the split, the schedule, the repeats or the mesh. Each
logical leaf is also split over the whole mesh (:mod:`tpipe.core.layout.checkpoint_form` says
where), so converting never gathers a model.

The conversions run in one ``jax.shard_map``, manual over every axis. Saving, each device turns the
staged block it holds into its share of each leaf's stage-free block (slices: the pieces are rows
or columns of the weights) and trades the ``stage`` parts with an ``all_to_all`` over ``stage``.
Restoring, a stacked leaf's parts come back by the inverse ``all_to_all``; a packed leaf's piece
is all-gathered over ``stage`` (and the axes its block is split over) and written into the
owner's packed buffer. Big leaves move in parts of about :data:`PART_BYTES` in a loop (a stacked
leaf one copy slot at a time both ways; restoring, a packed piece a band of rows at a time), so a
device holds one part in flight rather than a whole leaf, or a whole packed leaf on every stage.
Leaves whose pieces do not line up with the target (a flat cut, a spec the rules put elsewhere)
are gathered whole over their stage's ``fsdp`` and ``tensor`` devices, and a leaf with no
dimension ``stage`` divides over ``stage``, one leaf at a time. Nothing is summed, so both
directions are exact. A collection laid out in one block (BatchNorm's statistics) keeps its
packed leaves whole over ``fsdp``.

Example::

  specs = checkpoint_form.checkpoint_specs(layout, staged_specs, mesh)
  logical = jax.jit(lambda s: relayout.to_checkpoint(layout, s, staged_specs, mesh))(staged)
  staged = jax.jit(lambda t: relayout.from_checkpoint(layout, t, staged_specs, mesh))(logical)
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpipe import mesh as mesh_lib
from tpipe.core.layout import checkpoint_form as form
from tpipe.core.layout import description as desc
from tpipe.core.layout import packed_places as places

STACKED, PACKED, SHARED = desc.STACKED, desc.PACKED, desc.SHARED


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
  if shards > 1 and (dim == places.FLAT or mesh_lib.FSDP_AXIS not in entries[dim]):
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
    piece = places.join_pieces(pieces, dim, whole_shape)
  for d, axes in enumerate(entries):
    piece = _slice_block(piece, d, axes, sizes)
  return piece


def _block_to_piece(block, dim: int, whole_shape, entries, shards: int, sizes):
  """The inverse of :func:`_piece_to_block` for a leaf whose pieces do not line up with its
  blocks (or a scalar): gathered whole, then cut (lined-up leaves: :func:`_restore_packed`)."""
  for d, axes in enumerate(entries):
    block = _gather_block(block, d, axes)
  if shards == 1:
    return block
  pieces = places.cut_pieces(block, dim, shards)
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
  every leaf's at once, and the outputs are updated in place. Never thread a loop's result
  through it: the TPU compiler then copies that result (measured: 70B restore temporaries 7.5
  GiB with, 0.3 GiB without); a loop holds only its own part anyway."""
  return lax.optimization_barrier((value, state))


def _prepare(layout, value, staged_specs, mesh, stage_axis, part_bytes):
  """``(many, trees, placement, checkpoint specs)`` for one conversion of ``value`` (a tree or
  a list of them)."""
  if isinstance(part_bytes, bool) or not isinstance(part_bytes, int) or part_bytes < 1:
    raise ValueError(f"part_bytes={part_bytes!r}: give the bytes a conversion may move per "
                     f"collective as a positive int (default relayout.PART_BYTES = {PART_BYTES}).")
  form.check_blocks(layout, staged_specs, mesh)
  many = isinstance(value, list)
  return (many, value if many else [value], form.placement(layout, staged_specs, mesh),
          form.checkpoint_specs(layout, staged_specs, mesh, stage_axis))


# A conversion moves at most about this many bytes per collective where a leaf's shape allows:
# a big leaf goes in parts (a stacked leaf a copy at a time; on restore, a packed piece a band of
# rows at a time), so a device holds one part in flight, not a whole leaf (or, restoring a
# packed leaf, a whole leaf on every stage).
PART_BYTES = 32 * 2**20


def _save_stacked(local, out, starts, dim, stage_axis: str, num_stages: int, part_bytes: int):
  """``out`` (the device's checkpoint block ``[L, ...]`` of a stacked leaf) with the copies of
  the staged block ``local`` (``[R, 1, k, ...one copy]``) written where ``starts`` says, a slot
  ``j`` at a time when all of them exceed ``part_bytes``."""
  k = local.shape[2]
  moved = local.size * local.dtype.itemsize * (num_stages if dim is None else 1)
  step = k if moved <= part_bytes else 1

  def move(j, out):
    owned = lax.dynamic_slice_in_dim(local, j, step, axis=2)[:, 0]  # [R, step, ...]
    got = _to_stages(owned, None if dim is None else dim + 1, stage_axis, num_stages)
    for (r, s), first in starts.items():  # got: [S_source, R, step, ...]
      out = lax.dynamic_update_slice_in_dim(out, got[s, r].astype(out.dtype), first + j, 0)
    return out

  return move(0, out) if step == k else lax.fori_loop(0, k, move, out)


def to_checkpoint(layout, staged, staged_specs, mesh, stage_axis: str = mesh_lib.STAGE_AXIS,
                  *, part_bytes: int = PART_BYTES):
  """Staged variables to their logical checkpoint form, split as :func:`checkpoint_specs`.

  Args:
    layout: the collection's :class:`~tpipe.core.layout.description.StageLayout`.
    staged: a staged tree, or a list of them (parameters and optimizer moments: converted one
      leaf at a time, all in one program), inside ``jax.jit``, sharded as ``staged_specs``.
    staged_specs: the staged tree's specs (:meth:`StageLayout.partition_specs`).
    mesh: the mesh.
    stage_axis: the stage axis.

  Returns:
    ``{"layers_i": tree}`` (or a list) equal to ``staging.to_logical(layout, staged)``, bit for bit.
  """
  many, trees, placement, out_specs = _prepare(layout, staged, staged_specs, mesh, stage_axis,
                                               part_bytes)
  sizes, num_stages, shards = dict(mesh.shape), layout.num_stages, layout.packed_shards

  def local_zeros(name, path, leaf):
    entries, dim = placement[name][form.leaf_path(path)]
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
      target = form.get_leaf(outs[t][name], path)
      if not form.is_repeated(layout, name):
        new = value
      else:
        new = lax.dynamic_update_slice_in_dim(target, value.astype(target.dtype), first, 0)
      form.set_leaf(outs[t][name], path, new)

    for name in (f"layers_{i}" for i in layout.stacked):
      starts = form.stacked_starts(layout, int(name.split("_")[1]))
      for t, tree in enumerate(trees):
        for path, local in jax.tree_util.tree_flatten_with_path(tree[STACKED][name])[0]:
          _, dim = placement[name][form.leaf_path(path)]
          form.set_leaf(outs[t][name], path, _save_stacked(
              local, form.get_leaf(outs[t][name], path), starts, dim, stage_axis, num_stages,
              part_bytes))
    for (r, owner, name, seg, path, whole, dim, piece_shape, dtype, offset,
         (entries, stage_dim)) in form.packed_work(layout, placement):
      for t, tree in enumerate(trees):
        piece = lax.slice_in_dim(tree[PACKED][dtype][r, 0], offset,
                                 offset + math.prod(piece_shape))
        # Sequenced after the packed leaves before it (not the stacked ones: a barrier on a
        # loop's result would copy it).
        packed_outs = [{n: o[n] for n in o if int(n.split("_")[1]) not in layout.stacked}
                       for o in outs]
        piece, packed_outs = _after(piece, packed_outs)
        for o, p in zip(outs, packed_outs):
          o.update(p)
        piece = piece.reshape(piece_shape)  # Junk unless this device's stage is the owner.
        block = _piece_to_block(piece, dim, whole, entries, shards, sizes)
        write(t, name, path, seg.first_copy,
              _to_stages(block, stage_dim, stage_axis, num_stages)[owner])
    for group, member, owner, name, path, (_, stage_dim) in form.shared_work(layout, placement):
      for t, tree in enumerate(trees):
        entry = tree[SHARED][group.name][member.slot, 0]  # Junk unless this is the owner.
        others = [{n: o[n] for n in o if int(n.split("_")[1]) not in layout.stacked}
                  for o in outs]
        entry, others = _after(entry, others)
        for o, p in zip(outs, others):
          o.update(p)
        block = entry.T if member.transposed else entry
        form.set_leaf(outs[t][name], _keys(outs[t][name], path),
                      _to_stages(block, stage_dim, stage_axis, num_stages)[owner])
    return outs

  outs = _mapped(body, mesh, ([staged_specs] * len(trees),),
                 [out_specs] * len(trees))(list(trees))
  return outs if many else outs[0]


def _gathered_axes(entries, dim: int, shards: int, stage_dim: int | None, stage_axis: str):
  """Per dimension, the axes a lined-up checkpoint block is gathered over (tiled, in this
  order) to become its packed piece: the block's own axes but the piece's fsdp cut, then
  ``stage``."""
  out = []
  for d, axes in enumerate(entries):
    rest = tuple(axes[1:] if (shards > 1 and d == dim) else axes)
    out.append(rest + ((stage_axis,) if d == stage_dim else ()))
  return out


def _restore_stacked(block, order, dim, stage_axis: str, num_stages: int, part_bytes: int):
  """A stacked leaf's staged block ``[R, 1, k, ...one copy]`` from its checkpoint block
  ``[L, ...]`` (``stage`` on ``dim`` of a copy, or nowhere when None); ``order[s, r, j]`` is the
  copy stage ``s`` holds in slot ``(r, j)``."""
  me = lax.axis_index(stage_axis)
  num_slots, k = order.shape[1], order.shape[2]
  if dim is None:  # Every stage holds the whole leaf: take the copies it keeps.
    return jnp.take(block, jnp.asarray(order)[me], axis=0)[:, None]
  copy_shape = block.shape[1:dim] + (block.shape[dim] * num_stages,) + block.shape[dim + 1:]
  out = jnp.zeros((num_slots, 1, k) + copy_shape, block.dtype)
  # One slot j at a time when a copy's parts for every stage exceed the bound: [S, R, ...part].
  per_slot = math.prod(block.shape[1:]) * num_stages * num_slots * block.dtype.itemsize
  step = k if per_slot * k <= part_bytes else 1
  order = jnp.asarray(order)

  def move(j, out):
    copies = lax.dynamic_slice_in_dim(order, j, step, axis=2)  # [S, R, step]
    parts = lax.all_to_all(jnp.take(block, copies, axis=0), stage_axis, 0, 0, tiled=False)
    parts = jnp.moveaxis(parts, 0, dim + 1)  # [R, step, ..., S_source, part along dim, ...]
    shape = parts.shape[:dim + 1] + (-1,) + parts.shape[dim + 3:]
    return lax.dynamic_update_slice_in_dim(out, parts.reshape(shape)[:, None], j, axis=2)

  if step == k:
    return move(0, out)
  return lax.fori_loop(0, k, move, out)


def _restore_packed(buffer, block, start, owner, me, sizes, plan,
                    part_bytes: int):
  """``buffer`` (one dtype's packed block ``[P, 1, n]``) with one lined-up packed leaf's piece
  written at ``start = (packed slot, 0, offset)`` on the owner stage, gathered from the
  checkpoint block over ``plan`` (per dimension, the axes, :func:`_gathered_axes`) a band of
  rows at a time. ``me`` is this device's stage, ``owner`` the piece's; ``sizes`` the mesh's
  axis sizes."""
  rows, row_size = block.shape[0], math.prod(block.shape[1:])
  for d in range(1, block.ndim):
    row_size *= math.prod(sizes[a] for a in plan[d])
  groups = math.prod(sizes[a] for a in plan[0])
  band = max(1, min(rows, part_bytes // max(1, groups * row_size * block.dtype.itemsize)))
  r, _, offset = start

  def write(i, buffer):
    # The last band may overlap the one before it: those rows are written twice, identically.
    first = jnp.minimum(i * band, rows - band)
    x = lax.dynamic_slice_in_dim(block, first, band, axis=0)
    for d in range(1, block.ndim):
      x = _gather_block(x, d, plan[d])
    if plan[0]:  # [groups, band, ...]: group g's rows start at g * rows in the piece.
      x = lax.all_gather(x, tuple(plan[0]), axis=0, tiled=False)
    x = x.reshape(groups, band * row_size)
    for g in range(groups):
      at = (r, 0, offset + (g * rows + first) * row_size)
      old = lax.dynamic_slice(buffer, at, (1, 1, x.shape[1]))
      buffer = lax.dynamic_update_slice(buffer, jnp.where(me == owner, x[g][None, None], old),
                                        at)
    return buffer

  count = -(-rows // band)
  if count == 1:
    return write(0, buffer)
  return lax.fori_loop(0, count, write, buffer)


def from_checkpoint(layout, logical, staged_specs, mesh, stage_axis: str = mesh_lib.STAGE_AXIS,
                    *, part_bytes: int = PART_BYTES):
  """The inverse of :func:`to_checkpoint`: logical variables (a tree or a list of them) split as
  :func:`checkpoint_specs` to staged trees split as ``staged_specs``; exact.

  Each leaf moves in parts of at most about ``part_bytes`` per device where its shape allows
  (:data:`PART_BYTES`), so the program's temporaries stay near one part, not one leaf
  (or, for a packed leaf, one leaf on every stage)."""
  many, trees, placement, in_specs = _prepare(layout, logical, staged_specs, mesh, stage_axis,
                                              part_bytes)
  sizes, num_stages, shards = dict(mesh.shape), layout.num_stages, layout.packed_shards
  lead = (layout.packed_slots, 1)

  def body(trees):
    me = lax.axis_index(stage_axis)
    stacked = [{} for _ in trees]
    done = []  # The staged leaves made so far, threaded through each barrier.
    for name in (f"layers_{i}" for i in layout.stacked):
      index = int(name.split("_")[1])
      starts = form.stacked_starts(layout, index)
      k = layout.stacked[index]
      # Per target stage, the copies it holds: [S, R, k] indices into the copy axis.
      order = np.array([[list(range(starts[(r, s)], starts[(r, s)] + k))
                         for r in range(layout.num_repeats)] for s in range(num_stages)])
      for t, tree in enumerate(trees):
        def leaf(path, block, name=name, order=order):
          _, dim = placement[name][form.leaf_path(path)]
          done.append(_restore_stacked(block, order, dim, stage_axis, num_stages, part_bytes))
          return len(done) - 1
        stacked[t][name] = jax.tree_util.tree_map_with_path(leaf, tree[name])
    block_size = {k: n // shards for k, n in layout.packed_sizes.items()}
    buffers = [{k: jnp.zeros(lead + (n,), jnp.dtype(k)) for k, n in block_size.items()}
               for _ in trees]
    for (r, owner, name, seg, path, whole, dim, piece_shape, dtype, offset,
         (entries, stage_dim)) in form.packed_work(layout, placement):
      for t, tree in enumerate(trees):
        block, _ = _after(form.get_leaf(tree[name], path), buffers)
        if seg.copies is not None:
          block = block[seg.first_copy:seg.first_copy + seg.copies]
        if block.ndim and _lines_up(entries, dim, shards):
          plan = _gathered_axes(entries, dim, shards, stage_dim, stage_axis)
          buffers[t][dtype] = _restore_packed(buffers[t][dtype], block, (r, 0, offset), owner,
                                              me, sizes, plan, part_bytes)
          continue
        block = _from_stages(block, stage_dim, stage_axis, num_stages, owner=owner)
        piece = _block_to_piece(block, dim, whole, entries, shards, sizes).reshape(-1)
        # Only the owner's stage changes its buffer (in place: a slice updated).
        buffer, start = buffers[t][dtype], (r, 0, offset)
        old = lax.dynamic_slice(buffer, start, (1, 1, piece.shape[0]))
        buffers[t][dtype] = lax.dynamic_update_slice(
            buffer, jnp.where(me == owner, piece[None, None], old), start)
    stacked = jax.tree.map(lambda i: done[i], stacked)
    shared = [{g.name: jnp.zeros((g.slots, 1) + _local_shape(g, staged_specs, sizes),
                                 jnp.dtype(g.dtype)) for g in layout.shared} for _ in trees]
    for group, member, owner, name, path, (_, stage_dim) in form.shared_work(layout, placement):
      for t, tree in enumerate(trees):
        block, _ = _after(_leaf_at(tree[name], path), shared)
        block = _from_stages(block, stage_dim, stage_axis, num_stages, owner=owner)
        entry = block.T if member.transposed else block
        target = shared[t][group.name]
        old = target[member.slot, 0]
        shared[t][group.name] = target.at[member.slot, 0].set(
            jnp.where(me == owner, entry.astype(target.dtype), old))
    return [{STACKED: s, PACKED: b, SHARED: h} for s, b, h in zip(stacked, buffers, shared)]

  outs = _mapped(body, mesh, ([in_specs] * len(trees),),
                 [staged_specs] * len(trees))(list(trees))
  return outs if many else outs[0]


def _keys(tree, path: str):
  """The key path (a tuple of keys) of the leaf of ``tree`` at keystr ``path``."""
  return next(p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
              if form.leaf_path(p) == path)


def _leaf_at(tree, path: str):
  return form.get_leaf(tree, _keys(tree, path))


def _local_shape(group, staged_specs, sizes) -> tuple[int, ...]:
  """A device's block of one entry of shared leaf ``group`` (its spec's split of the entry)."""
  entries = form._entries(staged_specs[SHARED][group.name], len(group.shape) + 2)[2:]
  return tuple(n // math.prod(sizes[a] for a in axes) for n, axes in zip(group.shape, entries))
