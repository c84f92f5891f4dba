"""What both tick loops share about running inside ``jax.shard_map``: axes, specs, casts, slots.

* :class:`Axes`: the manual mesh axes of a pipeline on one mesh (``stage``, and ``data`` when
  the mesh has more than one replica), the batch's partition spec, and :meth:`Axes.shard_map`,
  which moves operands to the in-specs first on meshes with Explicit axes.
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
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P


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


def cast_like(value, like):
  """``value`` made to vary over the axes ``like`` varies over (at least its own)."""
  return cast_to(value, varying_axes(like))


def zeros_like_varying(like):
  """Zeros of ``like``'s shape and dtype, varying over the axes ``like`` varies over."""
  return cast_to(jnp.zeros(like.shape, like.dtype), varying_axes(like))


@dataclasses.dataclass(frozen=True)
class Axes:
  """The manual axes of a pipeline on ``mesh``.

  Attributes:
    mesh: the device mesh.
    stage: the stage axis name.
    data: the data axis name, or None when the mesh has no such axis or one replica (a data
      axis of size 1 is treated as absent: casting over it would leave a no-op all-reduce of
      the whole gradient in the program).
  """

  mesh: Mesh
  stage: str
  data: str | None

  @classmethod
  def of(cls, mesh: Mesh, stage_axis: str, data_axis: str | None) -> "Axes":
    has_data = data_axis is not None and dict(mesh.shape).get(data_axis, 1) > 1
    return cls(mesh=mesh, stage=stage_axis, data=data_axis if has_data else None)

  @property
  def manual(self) -> tuple[str, ...]:
    """The axes the tick loops run manual over: ``(data, stage)`` or ``(stage,)``."""
    return (self.data, self.stage) if self.data else (self.stage,)

  @property
  def batch_spec(self) -> P:
    """A batch's partition spec: its leading axis split over the data axis."""
    return P(self.data) if self.data else P()

  @property
  def staged_spec(self) -> P:
    """Staged parameters' spec: ``[R, S, ...]`` split over the stage axis."""
    return P(None, self.stage)

  @property
  def replicas(self) -> int:
    return int(dict(self.mesh.shape)[self.data]) if self.data else 1

  @property
  def num_stages(self) -> int:
    return int(dict(self.mesh.shape)[self.stage])

  def vary(self, tree):
    """Every leaf of ``tree`` cast to vary over all manual axes."""
    return jax.tree.map(lambda a: cast_to(a, frozenset(self.manual)), tree)

  def stage_index(self):
    return lax.axis_index(self.stage)

  def data_index(self):
    return lax.axis_index(self.data) if self.data else 0

  def shard_map(self, fn: Callable, in_specs: tuple, out_specs) -> Callable:
    """``jax.shard_map(fn)`` on this mesh; on a mesh with Explicit axes, operands are first
    moved to their in-specs (a no-op when they are there), since arrays there carry their
    sharding in their type and ``shard_map`` takes them only as its in-specs say."""
    mapped = jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)
    if not any(t == AxisType.Explicit for t in self.mesh.axis_types):
      return mapped

    def run(*operands):
      operands = tuple(
          jax.tree.map(lambda a, spec=spec: jax.reshard(a, NamedSharding(self.mesh, spec)), op)
          for op, spec in zip(operands, in_specs))
      return mapped(*operands)

    return run


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
