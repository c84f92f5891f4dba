"""What both tick loops share about running inside ``jax.shard_map``: axes, specs, casts, slots.

* :class:`Axes`: the manual mesh axes of a pipeline on one mesh (``stage``, and ``data`` when
  the mesh has more than one replica), the batch's partition spec, and :meth:`Axes.shard_map`,
  which moves operands to the in-specs first on meshes with Explicit axes. The loops run manual
  over ``stage``, ``data`` and ``fsdp``; other mesh axes (``tensor``) are left to XLA's
  partitioner.
* Varying-axes casts: inside ``shard_map`` every value carries the manual axes it varies over;
  a scan carry or the branches of a ``lax.switch`` must agree on them. :func:`varying_axes`
  reads them, :func:`cast_to` adds missing ones.
* Stage-to-stage pairs for ``lax.ppermute`` (:func:`neighbour_pairs`).
* Micro-batches and slot buffers: :func:`split_microbatches`, :func:`read_slot`,
  :func:`write_slot`, :func:`add_to_slot`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from tpipe import mesh as mesh_lib
from tpipe.schedules import actions as actions_lib


# Named scopes around the tick loops' own buffers, which tpipe.tools.peak reads back from the
# compiled program's metadata: stage-to-stage messages; the pipeline's output and loop-back
# buffers; a fused schedule's stash and weight slots, and its running gradient sums.
MAILBOX_SCOPE = "tpipe_mailbox"
BOUNDARY_SCOPE = "tpipe_boundary"
STASH_SCOPE = "tpipe_stash"
GRADIENTS_SCOPE = "tpipe_gradients"


def varying_axes(leaf) -> frozenset:
  """The manual mesh axes a traced value varies over (empty outside ``shard_map``)."""
  mat = getattr(jax.typeof(leaf), "manual_axis_type", None)
  return frozenset(mat.varying) if mat is not None else frozenset()


def cast_to(leaf, axes: frozenset):
  """``leaf`` made to vary over ``axes`` (a superset of what it varies over)."""
  missing = tuple(sorted(frozenset(axes) - varying_axes(leaf)))
  return lax.pcast(leaf, missing, to="varying") if missing else leaf


def zeros_like_varying(like):
  """Zeros of ``like``'s shape and dtype, varying over the axes ``like`` varies over."""
  return cast_to(jnp.zeros(like.shape, like.dtype), varying_axes(like))


@dataclasses.dataclass(frozen=True)
class Axes:
  """The manual axes of a pipeline on ``mesh``.

  The tick loops run manual over ``stage``, ``data`` and ``fsdp``: each device runs its stage's
  chunks on its own rows of each micro-batch (``data`` and ``fsdp`` split the rows alike; an
  ``fsdp`` device also holds only its share of the stage's weights, gathered one unit at a time,
  :mod:`tpipe.core.programs.fsdp`). Every other mesh axis with more than one device (``tensor``,
  any a user adds) stays **auto**: XLA's partitioner splits what runs inside a stage over it as the
  operands' shardings and the layers' constraints say.

  Attributes:
    mesh: the device mesh.
    stage: the stage axis name.
    data: the data axis name, or None when the mesh has no such axis or one replica (a data
      axis of size 1 is treated as absent: casting over it would leave a no-op all-reduce of
      the whole gradient in the program).
    fsdp: the fsdp axis name, or None when the mesh has none or one device on it.
  """

  mesh: Mesh
  stage: str
  data: str | None
  fsdp: str | None = None

  @classmethod
  def of(cls, mesh: Mesh, stage_axis: str, data_axis: str | None) -> "Axes":
    shape = dict(mesh.shape)
    has_data = data_axis is not None and shape.get(data_axis, 1) > 1
    has_fsdp = shape.get(mesh_lib.FSDP_AXIS, 1) > 1
    return cls(mesh=mesh, stage=stage_axis, data=data_axis if has_data else None,
               fsdp=mesh_lib.FSDP_AXIS if has_fsdp else None)

  @property
  def rows(self) -> tuple[str, ...]:
    """The manual axes a batch's rows are split over: ``data`` and ``fsdp`` where present."""
    return tuple(a for a in (self.data, self.fsdp) if a)

  @property
  def manual(self) -> tuple[str, ...]:
    """The axes the tick loops run manual over: the row axes and ``stage``."""
    return self.rows + (self.stage,)

  @property
  def auto(self) -> tuple[str, ...]:
    """The mesh axes left to XLA's partitioner: those with more than one device that are not
    manual (``tensor``)."""
    return tuple(name for name, size in dict(self.mesh.shape).items()
                 if size > 1 and name not in self.manual)

  def splits_over_stages(self, global_batch: int) -> bool:
    """Whether a pipeline's inputs and outputs of ``global_batch`` rows are split over the
    stages too: each row shard's batch divides evenly among them."""
    stages = self.num_stages
    return stages > 1 and global_batch % (self.row_shards * stages) == 0

  def io_spec(self, global_batch: int) -> P:
    """A pipeline input's or output's spec: rows over the row axes and, where
    :meth:`splits_over_stages`, over ``stage`` as well, so no stage holds the whole batch."""
    rows = self.rows + ((self.stage,) if self.splits_over_stages(global_batch) else ())
    return P(rows if len(rows) > 1 else rows[0]) if rows else P()

  def gather_stages(self, tree):
    """Inside the tick loops: a row shard's whole batch from its stages' parts (an all-gather
    over ``stage`` once per step, outside the loop; its transpose is :meth:`scatter_stages`)."""
    return jax.tree.map(lambda a: lax.all_gather(a, self.stage, axis=0, tiled=True), tree)

  def scatter_stages(self, tree):
    """A row shard's batch summed over the stages and split among them (one reduce-scatter
    over ``stage``): each stage keeps its part of what the others contributed."""
    return jax.tree.map(
        lambda a: lax.psum_scatter(a, self.stage, scatter_dimension=0, tiled=True), tree)

  def manual_spec(self, spec: P) -> P:
    """``spec`` with only the manual axes (what ``shard_map``'s in- and out-specs may name);
    the operand keeps its split over auto axes as its sharding says."""

    def keep(entry):
      names = entry if isinstance(entry, tuple) else (entry,)
      names = tuple(n for n in names if n in self.manual)
      return None if not names else names[0] if len(names) == 1 else names

    return P(*(keep(e) for e in tuple(spec)))

  @property
  def staged_spec(self) -> P:
    """Staged parameters' spec: ``[R, S, ...]`` split over the stage axis."""
    return P(None, self.stage)

  @property
  def row_shards(self) -> int:
    """How many devices of one stage split a batch's rows (data x fsdp)."""
    shape = dict(self.mesh.shape)
    return int(np.prod([shape[a] for a in self.rows], dtype=np.int64))

  @property
  def num_stages(self) -> int:
    return int(dict(self.mesh.shape)[self.stage])

  def vary(self, tree):
    """Every leaf of ``tree`` cast to vary over all manual axes."""
    return jax.tree.map(lambda a: cast_to(a, frozenset(self.manual)), tree)

  def stage_index(self):
    return lax.axis_index(self.stage)

  def data_index(self):
    """This device's row shard: ``data index * fsdp size + fsdp index`` (0 without either), so
    with ``M`` micro-batches its ``m``-th is global micro-batch ``data_index() * M + m``."""
    index = 0
    for axis in self.rows:
      index = index * int(dict(self.mesh.shape)[axis]) + lax.axis_index(axis)
    return index

  def shard_map(self, fn: Callable, in_specs: tuple, out_specs) -> Callable:
    """``jax.shard_map(fn)`` on this mesh; on a mesh with Explicit axes, operands are first
    moved to their in-specs (a no-op when they are there), since arrays there carry their
    sharding in their type and ``shard_map`` takes them only as its in-specs say."""
    manual = frozenset(self.mesh.axis_names) - frozenset(self.auto)
    mapped = jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                           axis_names=set(manual))
    if not any(t == AxisType.Explicit for t in self.mesh.axis_types):
      return mapped

    def place(spec, operand):
      # ``spec`` is a prefix of ``operand``'s tree: one spec for a subtree, or a tree of them.
      move = lambda spec, sub: jax.tree.map(
          lambda a: jax.reshard(a, NamedSharding(self.mesh, spec)), sub)
      return jax.tree.map(move, spec, operand, is_leaf=lambda x: isinstance(x, P))

    def run(*operands):
      return mapped(*(place(spec, op) for op, spec in zip(operands, in_specs)))

    return run


def auto_axes_here() -> tuple[str, ...]:
  """Inside ``shard_map``: the mesh axes with more than one device left to the partitioner."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  return tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types)
               if kind == AxisType.Auto and dict(mesh.shape)[name] > 1)


def whole_over_auto_axes(tree):
  """Every leaf of ``tree`` pinned whole on every device of the partitioner's axes (tensor),
  where there are such axes (inside ``shard_map``). A packed buffer's leaves start anywhere in
  it, and XLA's partitioner, left free, splits it over tensor as some leaf's use suggests;
  cutting the other leaves out of that split (and packing their gradients back) then moves
  pieces between devices with collective-permutes inside the stage's branch, which the devices
  of the other stages never join (emulated CPU devices wait for them). Pinned whole, a cut is
  local, and each leaf takes its own split where its unit runs."""
  if not auto_axes_here():
    return tree
  return jax.tree.map(lambda a: lax.with_sharding_constraint(a, P()), tree)


def expert_devices_here() -> int:
  """The devices of the ``expert`` axis where a pipeline's stage leaves it to XLA's partitioner
  as its only split (inside ``shard_map``: an auto ``expert`` axis and no other auto axis of
  more than one device), else 1. There a stage's rows split over ``expert`` outside the
  mixture-of-experts layers (the expert axis carries data).

  With ``tensor`` beside it, rows split over ``expert`` and heads over ``tensor`` stop the TPU
  compiler's SPMD partitioner on a failed check (``spmd_partitioner_util.cc:497``, jax 0.10.2's
  libtpu; reproduced on ``v5p:2x2x2``), so there the rows stay whole."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or AxisType.Manual not in mesh.axis_types:
    return 1
  if auto_axes_here() != (mesh_lib.EXPERT_AXIS,):
    return 1
  return int(dict(mesh.shape)[mesh_lib.EXPERT_AXIS])


def pieces_per_row(shape: tuple[int, ...], devices: int) -> int | None:
  """How an array of ``shape`` (rows first) splits over ``devices`` of the ``expert`` axis where
  that axis carries data: 1 where the rows divide over the devices (each holds whole rows);
  ``p = devices / rows`` where the devices are a multiple of the rows and ``p`` divides the
  second axis (each device holds one row's ``p``-th of its positions: row ``d // p``, piece
  ``d % p``); None where neither (the array stays whole)."""
  if not shape:
    return None
  rows = shape[0]
  if rows and rows % devices == 0:
    return 1
  if len(shape) < 2 or not rows or devices % rows or shape[1] % (devices // rows):
    return None
  return devices // rows


def split_over_expert(x: jax.Array, devices: int) -> jax.Array | None:
  """``x`` pinned over the ``expert`` axis as :func:`pieces_per_row` splits it: by its rows, or
  by rows and then positions (the two leading axes flattened and split, so that each device's
  elements lie together in ``x``'s order); None where it does not split."""
  pieces = pieces_per_row(x.shape, devices)
  if pieces is None:
    return None
  if pieces == 1:
    return lax.with_sharding_constraint(x, P(mesh_lib.EXPERT_AXIS))
  flat = x.reshape(x.shape[0] * pieces, x.shape[1] // pieces, *x.shape[2:])
  return lax.with_sharding_constraint(flat, P(mesh_lib.EXPERT_AXIS)).reshape(x.shape)


def rows_over_expert_axis(tree):
  """Inside ``shard_map`` where ``expert`` is the one axis left to the partitioner
  (:func:`expert_devices_here`): every leaf of ``tree`` split over it by its leading dimension
  (whole where the axis does not divide that), so that flattening it keeps each device's
  elements together; ``tree`` as it is elsewhere.

  Where the devices outnumber the rows, leaves stay whole here although the layers split them
  by rows and positions (:func:`split_over_expert`): a packed buffer lays its leaves one after
  another (per row where batched), so one device's pieces of several leaves do not lie
  together in it, and the partitioner reorders them with collective-permutes (measured on the
  ZB-H1 weight slots of a small MoE LM on stage 2 x expert 4).

  Left free, the partitioner splits an activation over an expert axis of 4 as 2 x 2 (rows over
  two devices, the width over two, as the MoE layers' rows and the ``embed`` rule suggest);
  flattened to a packed buffer, such a leaf's elements are in no device's order, and the
  partitioner reorders them with collective-permutes inside a stage's branch, which the devices
  of the other stages never join (emulated CPU devices wait for them). Other layouts are left
  as they were measured (a ``tensor`` axis beside ``expert``, where the MoE layers keep rows
  whole, or ``tensor`` alone)."""
  size = expert_devices_here()
  if size == 1:
    return tree

  def pin(leaf):
    rows = pieces_per_row(leaf.shape, size) == 1
    return lax.with_sharding_constraint(leaf, P(mesh_lib.EXPERT_AXIS) if rows else P())

  return jax.tree.map(pin, tree)


def neighbour_pairs(num_stages: int, direction: int, wrap: bool) -> list[tuple[int, int]]:
  """``lax.ppermute`` pairs sending each stage's value one stage over.

  Args:
    num_stages: S.
    direction: +1 (to stage ``s + 1``) or -1 (to ``s - 1``).
    wrap: whether the ends send round the ring (stage ``S - 1`` to 0 going right).
  """
  if direction == 1:
    stages = range(num_stages if wrap else num_stages - 1)
  else:
    stages = range(0 if wrap else 1, num_stages)
  return [(s, (s + direction) % num_stages) for s in stages]


def split_by_delay(pairs, delays, direction: int, num_stages: int):
  """``(now, late)``: the ``pairs`` whose link is not delayed (sent at the end of a tick) and
  those whose link is (sent during the next tick, overlapping its compute); see
  :func:`tpipe.schedules.actions.link_delays`."""
  late = [p for p in pairs if delays[actions_lib.link_of(p[0], direction, num_stages)]]
  return [p for p in pairs if p not in late], late


def permute_parts(value, axis: str, now, late, pending):
  """What arrives when ``value`` goes over the ``now`` pairs and ``pending`` (what was sent a
  tick earlier) over the ``late`` ones: each receiver gets one of them, the other part is zeros
  (``lax.ppermute`` gives zeros where a device receives nothing)."""
  arrived = lax.ppermute(value, axis, now) if now else jax.tree.map(jnp.zeros_like, value)
  if late:
    arrived = jax.tree.map(jnp.add, arrived, lax.ppermute(pending, axis, late))
  return arrived


def split_microbatches(tree, num_microbatches: int):
  """``[local_batch, ...]`` leaves to ``[M, local_batch / M, ...]``."""
  return jax.tree.map(
      lambda a: a.reshape((num_microbatches, a.shape[0] // num_microbatches) + a.shape[1:]), tree)


def join_microbatches(tree):
  """``[M, rows, ...]`` leaves to ``[M * rows, ...]``."""
  return jax.tree.map(lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]), tree)


def read_slot(buffer, index):
  """``buffer[index]`` along the leading axis of every leaf."""
  return jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, index, 0, keepdims=False), buffer)


def write_slot(buffer, index, value, pred=True):
  """``buffer[index] = value if pred`` without copying the whole buffer."""

  def write(b, v):
    if pred is True:
      return lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), index, 0)
    old = lax.dynamic_index_in_dim(b, index, 0, keepdims=False)
    return lax.dynamic_update_index_in_dim(b, jnp.where(pred, v, old), index, 0)

  return jax.tree.map(write, buffer, value)


def add_to_slot(buffer, index, value):
  """``buffer[index] += value``."""

  def add(b, v):
    old = lax.dynamic_index_in_dim(b, index, 0, keepdims=False)
    return lax.dynamic_update_index_in_dim(b, old + v, index, 0)

  return jax.tree.map(add, buffer, value)


def stacked_zeros(tree, count: int) -> Any:
  """Zeros ``[count, ...]`` shaped like every leaf of ``tree`` (arrays or ShapeDtypeStructs)."""
  return jax.tree.map(lambda a: jnp.zeros((count,) + tuple(a.shape), a.dtype), tree)


def select(pred, on_true, on_false):
  """``on_true if pred else on_false``, leaf by leaf, on a traced ``pred``."""
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)
