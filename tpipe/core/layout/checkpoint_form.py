"""Where each logical variable lives in a checkpoint: the partition specs of the checkpoint form
and the facts both conversions (:mod:`tpipe.core.layout.relayout`) walk.

A checkpoint holds the logical variables (``{"layers_i": tree}``, a repeated layer's copies
stacked on a leading axis), each leaf split over the whole mesh: a stacked leaf as inside its stage
(its own ``fsdp``/``tensor`` spec, the copy axis whole) plus ``stage`` on one weight dimension
that stays even; a packed-only leaf over ``fsdp`` along the dimension its packed pieces are cut,
over ``tensor`` where its spec (or its largest divisible dimension) says, and over ``stage`` on
one even dimension; a weight in a shared leaf as its shared leaf splits it (transposed back
where the leaf holds it transposed), plus ``stage`` on one even dimension.
:func:`checkpoint_specs` gives the specs; :func:`placement` the same as per-dimension axes.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from tpipe import axis_rules
from tpipe import mesh as mesh_lib
from tpipe.core.layout import description as desc
from tpipe.core.layout import packed_places as places

STACKED, PACKED, SHARED = desc.STACKED, desc.PACKED, desc.SHARED


def axes_of(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _entries(spec, rank: int) -> list[tuple[str, ...]]:
  entries = [axes_of(e) for e in tuple(spec)]
  return entries + [()] * (rank - len(entries))


def _spec(entries) -> P:
  out = [None if not a else a[0] if len(a) == 1 else tuple(a) for a in entries]
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def _is_spec(x) -> bool:
  return isinstance(x, P)


def leaf_path(path) -> str:
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
        rank = len(get_leaf(tree, path).shape)
        inner = _entries(spec, rank + 2)[3:]  # Staged [R, S, k, ...one copy].
        leaves[leaf_path(path)] = [()] + inner
    else:
      dims = _packed_dims_of(layout, index)
      names = layout.axes.get(name, {})
      copy_axis = int(is_repeated(layout, name))
      shared = {m.path: (g, m) for g in layout.shared for m in g.members if m.layer == index}
      for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if leaf_path(path) in shared:  # As its shared leaf splits it, less [P, S].
          group, member = shared[leaf_path(path)]
          entries = _entries(staged_specs[SHARED][group.name], len(leaf.shape) + 2)[2:]
          leaves[leaf_path(path)] = entries[::-1] if member.transposed else entries
          continue
        entries = [()] * len(leaf.shape)
        dim = dims.get(leaf_path(path), places.FLAT)
        if shards > 1 and dim != places.FLAT:
          entries[dim] = (mesh_lib.FSDP_AXIS,)
        tensor = _tensor_dim(leaf.shape[copy_axis:], names.get(leaf_path(path)), mesh,
                             avoid=None if dim == places.FLAT else dim - copy_axis)
        if tensor is not None:
          entries[tensor + copy_axis] = (mesh_lib.TENSOR_AXIS,)
        leaves[leaf_path(path)] = entries
    out[name] = leaves
  return out


def set_leaf(tree, path, value) -> None:
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
    if d != avoid and mesh_lib.TENSOR_AXIS in axes_of(entry) and shape[d] % size == 0:
      return d
  fits = [d for d in range(len(shape)) if d != avoid and shape[d] % size == 0]
  return max(fits, key=lambda d: (shape[d], -d)) if fits else None


def get_leaf(tree, path):
  for key in path:
    tree = tree[key.key if hasattr(key, "key") else key.idx]
  return tree


def _packed_dims_of(layout, layer: int) -> dict[str, int]:
  """A packed-only layer's cut dimension per leaf (of the logical leaf: a repeated layer's copy
  axis counted), read from the first chunk that packs it."""
  for c in range(layout.num_chunks):
    found = {leaf_path(path): dim for seg, path, _, dim, *_ in _packed_leaves(layout, c)
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


def placement(layout, staged_specs, mesh):
  """Per layer, per leaf: ``(stage-free entries, stage dim or None)``."""
  sizes = dict(mesh.shape)
  num_stages = layout.num_stages
  free = _stage_free(layout, staged_specs, mesh)
  out = {}
  for name, tree in layout.logical.items():
    repeated = is_repeated(layout, name)
    leaves = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      entries = free[name][leaf_path(path)]
      dim = None
      if num_stages > 1:
        dim = _stage_dim(leaf.shape, entries, sizes, num_stages, skip_first=repeated)
      leaves[leaf_path(path)] = (entries, dim)
    out[name] = leaves
  return out


def checkpoint_specs(layout, staged_specs, mesh, stage_axis: str = mesh_lib.STAGE_AXIS):
  """The logical variables' partition specs in a checkpoint (see the module documentation).

  Args:
    layout: the collection's :class:`~tpipe.core.layout.description.StageLayout`.
    staged_specs: the staged tree's specs (:meth:`StageLayout.partition_specs`).
    mesh: the mesh (a ``Mesh`` or ``AbstractMesh``).
    stage_axis: the stage axis.

  Returns:
    ``{"layers_i": tree of PartitionSpec}``, shaped like ``layout.logical``.
  """
  where = placement(layout, staged_specs, mesh)

  def spec(name):
    def leaf_spec(path, _):
      entries, dim = where[name][leaf_path(path)]
      entries = list(entries)
      if dim is not None:
        entries[dim] = entries[dim] + (stage_axis,)
      return _spec(entries)
    return leaf_spec

  return {name: jax.tree_util.tree_map_with_path(spec(name), tree)
          for name, tree in layout.logical.items()}


def _packed_leaves(layout, chunk: int):
  """Chunk ``chunk``'s packed leaves: ``(segment, key path, whole shape, cut dim, piece shape,
  dtype key, offset in its block)``, in packing order."""
  pieces = layout.packed_layouts[chunk]
  dims = iter(layout.packed_dims[chunk])
  found = iter(zip(pieces.shapes, pieces.dtypes, pieces.offsets))
  out = []
  packed = [seg for seg in layout.segments[chunk] if not seg.stacked]
  for seg, shapes in zip(packed, layout.packed_shapes(chunk)):  # Without the shared weights.
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
      shape, key, offset = next(found)
      offset += layout.packed_offsets[chunk][key]  # From the chunk's window to its block.
      out.append((seg, path, tuple(leaf.shape), next(dims), shape, key, offset))
  return out


def packed_work(layout, placement):
  """Every packed leaf of every chunk, as both directions walk them: ``(packed slot, owner
  stage, layer name, segment, key path, whole shape, cut dim, piece shape, dtype key, offset in
  its block, (stage-free entries, stage dim))``."""
  for c in range(layout.num_chunks):
    slot, owner = layout.packed_place(c)
    for seg, path, *rest in _packed_leaves(layout, c):
      name = f"layers_{seg.layer}"
      yield (slot, owner, name, seg, path, *rest, placement[name][leaf_path(path)])


def shared_work(layout, placement):
  """Every weight in a shared leaf: ``(group, member, owner stage, layer name, key path,
  (stage-free entries, stage dim))``."""
  for g in layout.shared:
    for m in g.members:
      name = f"layers_{m.layer}"
      yield g, m, layout.position(m.chunk)[1], name, m.path, placement[name][m.path]


def check_blocks(layout, staged_specs, mesh) -> None:
  """A device must hold exactly one block of each packed buffer."""
  fsdp = dict(mesh.shape).get(mesh_lib.FSDP_AXIS, 1)
  if layout.packed_shards > 1 and layout.packed_shards != fsdp:
    raise ValueError(
        f"the layout's packed buffers are in {layout.packed_shards} blocks for an fsdp axis of "
        f"that size, but this mesh's fsdp axis has {fsdp} devices; convert on the mesh the "
        "layout was built for.")
  for dtype, spec in staged_specs[PACKED].items():
    entries = tuple(spec)
    split = len(entries) == 3 and mesh_lib.FSDP_AXIS in axes_of(entries[2])
    if split != (layout.packed_shards > 1):
      raise ValueError(
          f"the packed {dtype} buffer is laid out in {layout.packed_shards} fsdp blocks but "
          f"its partition spec is {spec}; take the specs from the same layout's "
          "partition_specs(mesh=...) as the layout was built for.")


def stacked_starts(layout, layer: int) -> dict[tuple[int, int], int]:
  """``{(r, s): first copy}`` of the stacked copies of ``layer`` in each chunk slot."""
  out = {}
  for c, chunk in enumerate(layout.segments):
    for seg in chunk:
      if seg.stacked and seg.layer == layer:
        out[layout.position(c)] = seg.first_copy
  return out


def is_repeated(layout, name: str) -> bool:
  """Whether logical layer ``name`` is a ``Repeat`` (its leaves carry a leading copy axis)."""
  index = int(name.split("_")[1])
  return any(g.repeated and g.layer == index for chunk in layout.groups for g in chunk)


def staged_specs_of(tree) -> Any:
  """``tree``'s leaves' partition specs (abstract arrays with ``NamedSharding``)."""
  return jax.tree.map(lambda a: a.sharding.spec, tree)
