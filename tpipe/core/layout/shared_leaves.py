"""Which of the plain layers' weights get staged arrays of their own, shared across stages.

Plain (non-repeated) layers, such as an embedding on the first stage and a head on the last,
are packed by default: their leaves flattened into one buffer per stage and dtype
(:mod:`tpipe.core.layout.description`). A flattened weight costs a copy on a TPU each time it is
read as a matrix (the buffer's tiles are not the matrix's) and another for its gradient: for a 128k
vocabulary at width 2048 that is 1 GiB each, per micro-batch.

A **shared leaf** instead keeps weights whole, as a staged array ``[P, S, *shape]`` split over
stages: stage ``s``'s entry ``p`` holds one weight of that stage. Weights of one shape on
different stages share it, a matrix and a transposed one alike (entries keep the first weight's
orientation; a weight of the other is stored transposed): the embedding ``[vocab, width]`` of
stage 0 and the head ``[width, vocab]`` of stage S - 1 are the two entries of one
``[1, S, vocab, width]`` array, as much
memory per device as the packed buffer, with no flattening. Like a stacked block's weights it is
split over ``fsdp`` and ``tensor`` by its logical names and gathered one unit at a time.

:func:`plan` decides which weights move there: a group of same-shaped weights moves when the
arrays it needs (``P`` entries of its shape per stage) cost no more per device than what it
takes out of the fullest stage's packed buffer, so a layout never holds more than packing it
would.

  >>> from tpipe.core.layout import shared_leaves
  >>> leaves = [shared_leaves.Candidate(chunk=0, stage=0, layer=0, path="['embedding']",
  ...                                   shape=(100, 8), dtype="float32", names=("vocab", "embed")),
  ...           shared_leaves.Candidate(chunk=3, stage=3, layer=2, path="['kernel']",
  ...                                   shape=(8, 100), dtype="float32", names=("embed", "vocab"))]
  >>> [group.shape for group in shared_leaves.plan(leaves, num_stages=4)]
  [(100, 8)]
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A plain layer's weight that could move to a shared leaf.

  Attributes:
    chunk: the model chunk that reads it.
    stage: that chunk's stage.
    layer: its layer's index in the sequence.
    path: its key path in the layer's tree (``jax.tree_util.keystr``).
    shape: its shape.
    dtype: its dtype's name.
    names: its logical axis names, or None.
  """

  chunk: int
  stage: int
  layer: int
  path: str
  shape: tuple[int, ...]
  dtype: str
  names: tuple | None = None


@dataclasses.dataclass(frozen=True)
class Member:
  """A weight held by a shared leaf: model chunk ``chunk``'s ``layers_{layer}`` leaf at
  ``path``, in entry ``slot`` of its stage, stored transposed when ``transposed``."""

  chunk: int
  layer: int
  path: str
  slot: int
  transposed: bool


@dataclasses.dataclass(frozen=True)
class Group:
  """One shared leaf: a staged array ``[slots, S, *shape]`` of ``dtype``.

  Attributes:
    name: its key in the staged tree's shared part (``"shared_0"``, ...).
    shape: the canonical shape of one entry.
    dtype: the dtype's name.
    names: the logical axis names of the canonical shape (the first member's), for its split
      over ``fsdp`` and ``tensor``.
    slots: entries per stage (the most weights of the group any stage holds).
    members: the weights it holds.
  """

  name: str
  shape: tuple[int, ...]
  dtype: str
  names: tuple | None
  slots: int
  members: tuple[Member, ...]

  @property
  def entry_bytes(self) -> int:
    return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def canonical(shape: Sequence[int]) -> tuple[tuple[int, ...], bool]:
  """``(shape, transposed)``: a matrix with its larger dimension first; others as they are.
  Weights of one canonical shape can share a leaf (one of them stored transposed)."""
  shape = tuple(int(d) for d in shape)
  if len(shape) == 2 and shape[0] < shape[1]:
    return shape[::-1], True
  return shape, False


def plan(candidates: Sequence[Candidate], num_stages: int) -> tuple[Group, ...]:
  """The shared leaves for ``candidates`` (see the module documentation).

  Only matrices and arrays of higher rank move (a vector costs no copy to read from a packed
  buffer). Groups of weights of one canonical shape and dtype are taken largest first; a group
  moves out
  of the packed buffers when its arrays (``slots`` entries per stage) cost no more per device
  than the bytes it takes out of the fullest stage's packing, which shrinks as groups move.
  """
  nbytes = lambda c: math.prod(c.shape) * np.dtype(c.dtype).itemsize
  packed = np.zeros(num_stages)
  groups = defaultdict(list)
  for c in candidates:
    packed[c.stage] += nbytes(c)
    if len(c.shape) >= 2:  # Matrices and up: vectors and scalars cost no copy to read.
      groups[(canonical(c.shape)[0], c.dtype)].append(c)
  chosen = []
  order = sorted(groups.items(), key=lambda kv: -sum(nbytes(c) for c in kv[1]))
  for (shape, dtype), members in order:
    per_stage = np.zeros(num_stages)
    for c in members:
      per_stage[c.stage] += nbytes(c)
    slots = max(sum(c.stage == s for c in members) for s in range(num_stages))
    cost = slots * math.prod(shape) * np.dtype(dtype).itemsize
    if cost <= packed.max() - (packed - per_stage).max():
      packed -= per_stage
      chosen.append((shape, dtype, members, slots))
  out = []
  for i, (_, dtype, members, slots) in enumerate(chosen):
    # Entries keep the first weight's orientation: only a weight that differs is transposed,
    # so a group of like matrices computes exactly as from a packed buffer.
    first = members[0]
    used = defaultdict(int)
    placed = []
    for c in members:
      placed.append(Member(c.chunk, c.layer, c.path, used[c.stage], c.shape != first.shape))
      used[c.stage] += 1
    names = tuple(first.names) if first.names is not None else None
    out.append(Group(f"shared_{i}", first.shape, dtype, names, slots, tuple(placed)))
  return tuple(out)
