"""The buffers one device carries from tick to tick of a fused table, as one named value.

The fused tick loop (:mod:`tpipe.core.loops.fused`) is a ``lax.scan`` whose carry is a
:class:`Buffers`: the running sums the branches add into, the slots that hold micro-batches in
flight (stash, residuals, weights), the mailbox messages wait in and what arrives for the next
tick. :func:`allocate` sizes every slot buffer by the table's peak (never by M) under the named
scopes a memory breakdown tells apart (:mod:`tpipe.tools.peak`); :meth:`Buffers.receive` files
the messages of the last tick where the table routes them.

Example::

  >>> import jax.numpy as jnp
  >>> from tpipe.core.loops import buffers
  >>> b = buffers.Buffers(state={}, stash=jnp.zeros((2, 3)), residuals=(), weights=(),
  ...                     mailbox=jnp.zeros((2, 3)),
  ...                     arrived=(jnp.ones(3), 2 * jnp.ones(3), 3 * jnp.ones(3)))
  >>> b.receive(jnp.array([1, -1, 0])).mailbox     # left's to slot 1, right's nowhere, own to 0
  Array([[3., 3., 3.],
         [1., 1., 1.]], dtype=float32)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from tpipe import schedules
from tpipe.core.base import packing
from tpipe.core.base import spmd


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Buffers:
  """What one device carries from one tick of a fused table to the next.

  Attributes:
    state: the running sums the branches read and add into
      (:mod:`tpipe.core.loops.branches`): the loss and the gradient sums, or a forward-only
      table's collected outputs.
    stash: the stash slots, ``[slots, ...]`` of the ring's message: each micro-batch chunk's
      input from its ``F`` until its last backward action.
    residuals: the residual slots beside the stash (packed, ``remat="none"``): a chunk's VJP
      residuals from ``F`` to its backward.
    weights: the weight slots (packed): a split backward's operands from ``BI`` to ``W``.
    mailbox: the mailbox slots: messages from the neighbours (and the stage itself) until the
      action that reads them.
    arrived: what reaches this stage for the next tick from its left, its right and itself.
    pending: over delayed links, what this stage sent each way last tick (None without any).
    conveyor: the inputs' conveyor to stage 0 (:mod:`tpipe.core.loops.streaming`), or None.
  """

  state: dict
  stash: Any
  residuals: Any
  weights: Any
  mailbox: Any
  arrived: tuple
  pending: tuple | None = None
  conveyor: Any = None

  @property
  def slots(self) -> dict:
    """The packed slot buffers a branch writes, by name (the branches' ``slots``)."""
    return {"weights": self.weights, "residuals": self.residuals}

  def receive(self, arrival) -> Buffers:
    """These buffers with last tick's messages filed in the mailbox: ``arrival[k]`` is the slot
    of the message from the left (k = 0), the right (1) and the stage itself (2), or -1 where
    the table routes none."""
    mailbox = self.mailbox
    for k, message in enumerate(self.arrived):
      slot = arrival[k]
      mailbox = spmd.write_slot(mailbox, jnp.maximum(slot, 0), message, slot >= 0)
    return dataclasses.replace(self, mailbox=mailbox)


def allocate(schedule: schedules.FusedSchedule, axes: spmd.Axes, state: dict, message,
             weight_sizes, residual_sizes, *, delayed: bool, conveyor=None) -> Buffers:
  """A device's buffers before the first tick, each varying over every manual axis.

  Args:
    schedule: the fused table; it fixes the slot counts (its peaks, at least one slot each).
    axes: the pipeline's manual axes.
    state: the running sums at zero.
    message: a zero message of the ring (what the stash and the mailbox hold).
    weight_sizes: the packed sizes of one weight slot (:func:`tpipe.core.base.packing.empty`).
    residual_sizes: the packed sizes of one residual slot.
    delayed: whether any link is delayed (then :attr:`Buffers.pending` is carried).
    conveyor: the conveyor's start value, or None.
  """
  slots = lambda zero, count: axes.vary(spmd.stacked_zeros(zero, max(1, int(count))))
  # Named scopes let a memory breakdown (tpipe.tools.peak) tell the buffers apart.
  with jax.named_scope(spmd.GRADIENTS_SCOPE):
    state = axes.vary(state)
  with jax.named_scope(spmd.STASH_SCOPE):
    stash_slots = schedule.stash_slots().max()
    weights = slots(packing.empty(weight_sizes), schedule.awaiting_weight().max())
    stash = slots(message, stash_slots)
    residuals = slots(packing.empty(residual_sizes), stash_slots)
  with jax.named_scope(spmd.MAILBOX_SCOPE):
    mailbox = slots(message, schedule.mailbox_slots().max())
    arrived = axes.vary((message,) * 3)
    pending = axes.vary((message,) * 2) if delayed else None
  return Buffers(state=state, stash=stash, residuals=residuals, weights=weights,
                 mailbox=mailbox, arrived=arrived, pending=pending, conveyor=conveyor)
