"""Pipeline schedules as data: what each stage does at each clock tick.

Two kinds of schedule live here, both pure NumPy (nothing imports JAX):

**Forward schedules** (:class:`Schedule`: ``"gpipe"``, ``"circular"``) are a pair of integer tables
indexed ``[tick, stage]``:

* ``microbatch[t, s]``: the micro-batch stage ``s`` runs forward at tick ``t``, or ``-1`` when the
  stage is idle (a bubble);
* ``repeat[t, s]``: which of the stage's ``num_repeats`` layer chunks it applies (always 0 for
  GPipe; ``0..R-1`` for the circular schedule), ``-1`` when idle.

Their backward pass comes from automatic differentiation through the tick loop, which replays the
forward ticks in reverse order (:meth:`Schedule.backward_tables`). The executor
(:mod:`tpipe.core.executor`) interprets these tables; :data:`SCHEDULE_NAMES` is what it runs.
The fused executor (:mod:`tpipe.core.fused`) runs every fused table, with a full backward ``B``
or one split into ``BI`` and ``W`` (:mod:`tpipe.core.taps`).

**Fused schedules** (:class:`FusedSchedule`: :data:`FUSED_SCHEDULE_NAMES`, built by
:func:`make_fused_schedule`) interleave forward and backward work, so each tick a stage does one
:class:`Action`: a forward ``F``, a full backward ``B`` (input and weight gradients), a
backward-input ``BI`` or a backward-weight ``W`` of one micro-batch on one of its chunks. They are a
separate class, not ``Schedule`` with an extra column, because everything the executor and the
analysis code read from a ``Schedule`` (one forward table, autodiff's reversed backward, a stash of
``num_ticks`` slots) is false for them. ``[tick, stage]`` tables: ``action``, ``microbatch``,
``chunk`` (the stage's local chunk) and ``stash_slot``, plus the routing tables derived from them
(``send_dir``, ``send_slot``, ``recv_slot``). :meth:`Schedule.with_backward` turns a forward
schedule into the same form, so every schedule can be analysed side by side.

Example::

  >>> s = gpipe(num_stages=2, num_microbatches=3)
  >>> s.microbatch.tolist()
  [[0, -1], [1, 0], [2, 1], [-1, 2]]
  >>> round(s.bubble_fraction, 4)   # (S - 1) / (M + S - 1)
  0.25
  >>> s.stash_slots().tolist(), s.stashed_microbatches().tolist()   # per stage
  ([4, 4], [3, 3])
  >>> f = make_fused_schedule("1f1b", num_stages=2, num_microbatches=3)
  >>> print(f.describe())
  stage 0: F0 F1  . B0 F2 B1  . B2
  stage 1:  . F0 B0 F1 B1 F2 B2  .
  >>> f.peak_in_flight().tolist(), round(f.bubble_fraction, 4)   # min(S - s, M); as GPipe
  ([2, 1], 0.25)
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping

import numpy as np

IDLE = -1

SCHEDULE_NAMES = ("gpipe", "circular")


def _check_positive_int(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}.")
  if value < 1:
    raise ValueError(f"{name} must be >= 1, got {value}.")


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
  """A forward pipeline schedule: ``[tick, stage]`` tables of micro-batch and repeat indices.

  Attributes:
    name: the schedule's name (``"gpipe"`` or ``"circular"``).
    num_stages: S, the number of pipeline stages (devices along the stage axis).
    num_microbatches: M, the number of micro-batches a mini-batch is split into.
    num_repeats: R, the number of layer chunks each stage holds (1 for GPipe).
    microbatch: int32 array ``[num_ticks, S]``; micro-batch index or ``IDLE``.
    repeat: int32 array ``[num_ticks, S]``; chunk (repeat) index or ``IDLE``.
  """

  name: str
  num_stages: int
  num_microbatches: int
  num_repeats: int
  microbatch: np.ndarray
  repeat: np.ndarray

  def __post_init__(self):
    if self.microbatch.shape != self.repeat.shape:
      raise ValueError("microbatch and repeat tables must have the same shape.")
    if self.microbatch.ndim != 2 or self.microbatch.shape[1] != self.num_stages:
      raise ValueError(
          f"tables must be [ticks, {self.num_stages}], got {self.microbatch.shape}.")
    _validate_dataflow(self)

  @property
  def num_ticks(self) -> int:
    """Clock ticks in the forward pass."""
    return int(self.microbatch.shape[0])

  @property
  def busy(self) -> np.ndarray:
    """Boolean ``[tick, stage]``: True where the stage does useful work."""
    return self.microbatch != IDLE

  @property
  def bubble_fraction(self) -> float:
    """Fraction of (tick, stage) slots that are idle: the time lost to filling and draining.

    Equals ``(S - 1) / (R * M + S - 1)`` whenever ``M >= S`` (``R = 1`` for GPipe).
    """
    return 1.0 - float(self.busy.sum()) / self.busy.size

  @property
  def efficiency(self) -> float:
    """``1 - bubble_fraction``: the ideal speed-up over one device divided by S."""
    return 1.0 - self.bubble_fraction

  def backward_tables(self) -> tuple[np.ndarray, np.ndarray]:
    """The backward pass autodiff runs: the forward tables with the tick order reversed."""
    return self.microbatch[::-1].copy(), self.repeat[::-1].copy()

  def stashed_microbatches(self) -> np.ndarray:
    """Micro-batch activations each stage holds for its backward pass at its peak, ``[S]``.

    Autodiff through the tick loop finishes every forward tick before the first backward tick,
    so at the turn a stage holds the stage input of every (micro-batch, repeat) it ran forward:
    ``R * M``. These are the live entries of the executor's stash; :meth:`stash_slots` is what it
    allocates. Schedules that interleave forward and backward (1F1B) will hold fewer; the count
    is read from the table rather than assumed.
    """
    return self.busy.sum(axis=0).astype(np.int64)

  def stash_slots(self) -> np.ndarray:
    """Stash slots the executor allocates per stage for the backward pass, ``[S]``.

    The executor differentiates through a ``lax.scan`` over the forward ticks, and the scan saves
    what the stage's remat policy keeps (its input, with ``remat="full"``) at every tick, bubble
    ticks included: ``num_ticks`` slots per stage, of which :meth:`stashed_microbatches` hold
    real micro-batches and the rest hold the placeholder of idle ticks. Activation memory scales
    with this number, not with ``R * M``: e.g. ``M + S - 1`` slots for GPipe.
    """
    return np.full(self.num_stages, self.num_ticks, dtype=np.int64)

  def with_backward(self) -> FusedSchedule:
    """The whole step as a :class:`FusedSchedule`: these forward ticks, then autodiff's backward.

    The backward ticks are :meth:`backward_tables` with full backward actions ``B``, so the
    fused analytics (:meth:`FusedSchedule.simulate`, :meth:`FusedSchedule.peak_in_flight`) apply
    to GPipe and circular too. Its stash counts micro-batches (``R * M`` per stage), not the
    ``num_ticks`` slots autodiff through the tick loop allocates (:meth:`stash_slots`).
    """
    backward_mb, backward_rep = self.backward_tables()
    microbatch = np.concatenate([self.microbatch, backward_mb])
    chunk = np.concatenate([self.repeat, backward_rep])
    action = np.where(microbatch == IDLE, IDLE, Action.F)
    action[self.num_ticks:][microbatch[self.num_ticks:] != IDLE] = Action.B
    slot = np.full(microbatch.shape, IDLE, np.int32)
    for s in range(self.num_stages):  # Stack order: forward k-th uses slot k, backward pops.
      busy = np.nonzero(self.microbatch[:, s] != IDLE)[0]
      slot[busy, s] = np.arange(len(busy))
      slot[2 * self.num_ticks - 1 - busy, s] = np.arange(len(busy))
    return FusedSchedule(name=self.name, num_stages=self.num_stages,
                         num_microbatches=self.num_microbatches, num_chunks=self.num_repeats,
                         placement="loop", action=action, microbatch=microbatch, chunk=chunk,
                         stash_slot=slot)

  def describe(self) -> str:
    """The table drawn as text: one row per stage, one column per tick, ``.`` for idle."""
    width = max(2, len(str(self.num_microbatches - 1)) + (2 if self.num_repeats > 1 else 0))
    rows = []
    for s in range(self.num_stages):
      cells = []
      for t in range(self.num_ticks):
        m, r = self.microbatch[t, s], self.repeat[t, s]
        if m == IDLE:
          cells.append(".".rjust(width))
        elif self.num_repeats > 1:
          cells.append(f"{m}:{r}".rjust(width))
        else:
          cells.append(str(m).rjust(width))
      rows.append(f"stage {s}: " + " ".join(cells))
    return "\n".join(rows)


def _validate_dataflow(schedule: Schedule) -> None:
  """Checks the properties the executor relies on.

  * Every (micro-batch, repeat) pair runs exactly once on every stage.
  * Stage ``s > 0`` runs at tick ``t`` what stage ``s - 1`` ran at tick ``t - 1`` (the value
    arrives by a neighbour ``ppermute``).
  * Stage 0 runs repeat ``r > 0`` of a micro-batch only after the last stage finished repeat
    ``r - 1`` of it (the value waits in a loop-back buffer on stage 0).
  """
  mb, rep = schedule.microbatch, schedule.repeat
  num_ticks, num_stages = mb.shape
  expected = {(m, r) for m in range(schedule.num_microbatches)
              for r in range(schedule.num_repeats)}
  finished_at = {}
  for s in range(num_stages):
    seen = []
    for t in range(num_ticks):
      if mb[t, s] == IDLE:
        if rep[t, s] != IDLE:
          raise ValueError(f"tick {t}, stage {s}: idle slot with a repeat index.")
        continue
      seen.append((int(mb[t, s]), int(rep[t, s])))
      if s > 0 and (t == 0 or (mb[t - 1, s - 1], rep[t - 1, s - 1]) != (mb[t, s], rep[t, s])):
        raise ValueError(f"tick {t}, stage {s}: input was not produced by stage {s - 1} at the "
                         "previous tick.")
      if s == num_stages - 1:
        finished_at[seen[-1]] = t
    if sorted(seen) != sorted(expected):
      raise ValueError(f"stage {s} does not run every (micro-batch, repeat) exactly once.")
  for t in range(num_ticks):
    m, r = int(mb[t, 0]), int(rep[t, 0])
    if m != IDLE and r > 0 and finished_at[(m, r - 1)] >= t:
      raise ValueError(f"tick {t}: stage 0 starts repeat {r} of micro-batch {m} before the last "
                       f"stage finished repeat {r - 1}.")


def circular(num_stages: int, num_microbatches: int, num_repeats: int) -> Schedule:
  """The circular (looping) schedule: each stage holds ``num_repeats`` chunks of layers.

  Micro-batches enter stage 0 one per tick, pass through the S stages, loop back to stage 0 for
  the next chunk, and so on R times. Stage ``s`` at tick ``t`` works on the ``i = t - s``-th
  (micro-batch, repeat) pair in the order ``(repeat 0: mb 0..M-1), (repeat 1: mb 0..M-1), ...``.
  When ``M < S`` a micro-batch would come back to stage 0 before its previous lap finished, so
  each lap is padded to ``P = max(M, S)`` ticks (the padding ticks are bubbles).

  Chunk ``r`` of stage ``s`` holds layer chunk ``r * S + s``: the model's layers in order.

  Args:
    num_stages: S.
    num_microbatches: M.
    num_repeats: R, chunks per stage. ``R = 1`` is GPipe.

  Returns:
    A :class:`Schedule` with ``(R - 1) * P + M + S - 1`` ticks.
  """
  _check_positive_int("num_stages", num_stages)
  _check_positive_int("num_microbatches", num_microbatches)
  _check_positive_int("num_repeats", num_repeats)
  period = max(num_microbatches, num_stages)
  num_ticks = (num_repeats - 1) * period + num_microbatches + num_stages - 1
  tick = np.arange(num_ticks)[:, None]
  stage = np.arange(num_stages)[None, :]
  i = tick - stage
  m, r = np.mod(i, period), np.floor_divide(i, period)
  busy = (i >= 0) & (m < num_microbatches) & (r < num_repeats)
  return Schedule(
      name="circular",
      num_stages=num_stages,
      num_microbatches=num_microbatches,
      num_repeats=num_repeats,
      microbatch=np.where(busy, m, IDLE).astype(np.int32),
      repeat=np.where(busy, r, IDLE).astype(np.int32),
  )


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
  """GPipe's fill-drain schedule: micro-batch ``m`` is on stage ``s`` at tick ``m + s``.

  ``M + S - 1`` ticks; bubble fraction ``(S - 1) / (M + S - 1)`` (Huang et al., 2019, sec. 2.3).
  """
  schedule = circular(num_stages, num_microbatches, 1)
  return dataclasses.replace(schedule, name="gpipe")


def make_schedule(name: str, num_stages: int, num_microbatches: int,
                  num_repeats: int = 1) -> Schedule:
  """Builds a schedule by name.

  Args:
    name: ``"gpipe"`` or ``"circular"``.
    num_stages: S.
    num_microbatches: M.
    num_repeats: R; must be 1 for ``"gpipe"``.

  Raises:
    ValueError: for an unknown name, or ``num_repeats != 1`` with ``"gpipe"``.
  """
  if name == "gpipe":
    if num_repeats != 1:
      raise ValueError(
          f"schedule='gpipe' runs one chunk per stage, got num_repeats={num_repeats}; use "
          "schedule='circular' for num_repeats > 1.")
    return gpipe(num_stages, num_microbatches)
  if name == "circular":
    return circular(num_stages, num_microbatches, num_repeats)
  if name in FUSED_SCHEDULE_NAMES:
    raise ValueError(f"schedule={name!r} is a fused schedule: make_fused_schedule() builds and "
                     "analyses its table, and the fused executor (tpipe.core.fused) runs it in "
                     "tpipe.Sequential ('1f1b'); the forward executor runs only "
                     f"{SCHEDULE_NAMES}.")
  raise ValueError(f"Unknown schedule {name!r}; choose one of {SCHEDULE_NAMES}.")


# --------------------------------------------------------------------------------------------
# Fused schedules: forward and backward interleaved in one table.

FUSED_SCHEDULE_NAMES = ("1f1b", "interleaved_1f1b", "zb_h1", "zbv")

PLACEMENTS = ("loop", "v")


class Action(enum.IntEnum):
  """What a stage does in one tick of a :class:`FusedSchedule` (``IDLE`` when nothing)."""

  F = 0  # forward of one chunk on one micro-batch; stashes what its backward needs.
  B = 1  # full backward: input and weight gradients; releases the stash slot.
  BI = 2  # backward-input: the input gradient, and the output gradients W will need.
  W = 3  # backward-weight: weight gradients from the slot's contents; releases the slot.


DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "BI": 1.0, "W": 1.0}

# Arrivals at a stage, in the order of :meth:`FusedSchedule.arrival_slots`: from the left
# neighbour (it sent right), from the right neighbour (it sent left), from itself.
_ARRIVAL_DIRECTIONS = (1, -1, 0)


def virtual_stages(placement: str, num_stages: int, num_chunks: int) -> np.ndarray:
  """Which model chunk each (stage, local chunk) holds, ``[S, C]``: a permutation of ``0..S*C-1``.

  The model's layers are cut into ``V = S * C`` consecutive chunks ("virtual stages"); a
  micro-batch's forward goes through them in order ``0..V-1`` and its backward in reverse.

  Args:
    placement: ``"loop"``: local chunk ``c`` of stage ``s`` is model chunk ``c * S + s`` (GPipe,
      1F1B and ZB-H1 with ``C = 1``; circular and interleaved 1F1B with ``C = R``): activations
      always move right, from the last stage back round to stage 0 between chunks. ``"v"``
      (ZB-V, ``C = 2``): chunk 0 of stage ``s`` is model chunk ``s`` (going down the stages) and
      chunk 1 is model chunk ``2S - 1 - s`` (coming back up): the hand-off between the two is
      local to stage ``S - 1`` and the last model chunk, with the loss, is on stage 0.
    num_stages: S.
    num_chunks: C, chunks per stage.
  """
  if placement == "loop":
    return (np.arange(num_chunks)[None, :] * num_stages + np.arange(num_stages)[:, None]).astype(
        np.int32)
  if placement == "v":
    if num_chunks != 2:
      raise ValueError(f"placement='v' puts exactly 2 chunks on each stage, got {num_chunks}.")
    s = np.arange(num_stages)
    return np.stack([s, 2 * num_stages - 1 - s], axis=1).astype(np.int32)
  raise ValueError(f"Unknown placement {placement!r}; choose one of {PLACEMENTS}.")


def _link_directions(placement: str, num_stages: int, num_chunks: int) -> np.ndarray:
  """``[V - 1]``: +1 (right), -1 (left) or 0 (same stage) for the hop from model chunk v to v+1."""
  num_virtual = num_stages * num_chunks
  if num_stages == 1:
    return np.zeros(num_virtual - 1, np.int32)
  if placement == "loop":
    return np.ones(num_virtual - 1, np.int32)  # S - 1 -> 0 between chunks: right, round the ring.
  v = np.arange(num_virtual - 1)
  return np.where(v < num_stages - 1, 1, np.where(v == num_stages - 1, 0, -1)).astype(np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class Timing:
  """Step time of a :class:`FusedSchedule` under per-action costs (:meth:`FusedSchedule.simulate`).

  Attributes:
    lockstep: SPMD step time: every stage waits for the slowest action of each tick, so it is the
      sum over ticks of the most expensive action in the tick.
    natural: dependency-driven step time: each stage runs its actions in the table's order, each
      as soon as the stage is free and its inputs are done (no tick barrier, no transfer time).
    busy: ``[S]`` total cost of the actions of each stage.
  """

  lockstep: float
  natural: float
  busy: np.ndarray

  @property
  def lockstep_bubble(self) -> float:
    """Share of the stages' lockstep time spent idle or waiting for a slower stage."""
    return 1.0 - float(self.busy.sum()) / (self.busy.size * self.lockstep)

  @property
  def natural_bubble(self) -> float:
    """Share of the stages' natural time spent idle."""
    return 1.0 - float(self.busy.sum()) / (self.busy.size * self.natural)


@dataclasses.dataclass(frozen=True, eq=False)
class FusedSchedule:
  """A fused pipeline schedule: ``[tick, stage]`` tables of actions, validated on construction.

  **Ticks.** Each tick every stage does at most one :class:`Action` on one (micro-batch, local
  chunk). What an action produces for another model chunk is a message: a forward's output goes to
  the next model chunk, a backward's (``B`` or ``BI``) input gradient to the previous one. A
  message sent at tick ``t`` arrives at tick ``t + 1`` (also when it stays on the same stage, as in
  ZB-V's turn at stage ``S - 1``), so:

  * ``F`` of (m, model chunk v) runs after ``F`` of (m, v - 1);
  * ``B``/``BI`` of (m, v) runs after ``B``/``BI`` of (m, v + 1), and after ``F`` of (m, v); the
    last model chunk's backward starts from its own loss and needs only its forward;
  * ``W`` of (m, v) runs after ``BI`` of (m, v), on the same stage;

  each at a strictly earlier tick. Every (micro-batch, chunk) of every stage has exactly one ``F``
  and either one ``B`` or one ``BI`` and one ``W``.

  **Stash ("in flight").** ``F`` writes what the backward needs (the chunk's input, or its layer
  inputs with per-layer remat) into ``stash_slot[t, s]``; the micro-batch is *in flight* on that
  stage from its ``F`` to the action that releases the slot, both ticks included. ``B`` releases
  it. With split backward, ``W`` releases it, not ``BI``: with the "taps" design ``W`` forms
  weight gradients as outer products of the layer inputs (in the slot) and the output gradients
  ``BI`` computed (stored next to them, under the same slot index), so nothing can be freed at
  ``BI`` without copying the inputs elsewhere. A slot freed at tick ``t`` is reused from ``t + 1``.
  Slots are numbered ``0..peak - 1``, ``peak`` being the stage's most micro-batches in flight
  (:meth:`peak_in_flight`); :meth:`awaiting_weight` counts the ones only ``W`` still needs.

  **Receive buffer.** A message is not always consumed the tick it arrives (in 1F1B a stage can
  receive an activation and a gradient in the same tick and use one of them later), so each
  stage has a small mailbox: a message occupies a mailbox slot from its arrival tick to the tick
  of the action that reads it. The routing is derived on construction: ``send_dir[t, s]`` is
  ``+1`` (to stage ``s + 1`` mod S), ``-1`` (to ``s - 1`` mod S) or ``0`` (to itself) for the
  message the action sends, ``send_slot[t, s]`` its mailbox slot on the receiver (``IDLE`` when
  nothing is sent), ``recv_slot[t, s]`` the slot the action reads (``IDLE`` when its input is the
  data or its own loss, and for ``W``); :meth:`mailbox_slots` gives the sizes,
  :meth:`arrival_slots` where each tick's arrivals go. Every message has exactly one reader.

  Attributes:
    name: the schedule's name.
    num_stages: S.
    num_microbatches: M.
    num_chunks: C, layer chunks per stage (the ``num_repeats`` of the interleaved schedules).
    placement: ``"loop"`` or ``"v"``; see :func:`virtual_stages`.
    action: int8 ``[T, S]``: an :class:`Action` or ``IDLE``.
    microbatch: int32 ``[T, S]``: micro-batch index or ``IDLE``.
    chunk: int32 ``[T, S]``: the stage's local chunk index or ``IDLE``.
    stash_slot: int32 ``[T, S]``: the stash slot of (micro-batch, chunk) or ``IDLE``.
    send_dir, send_slot, recv_slot: int32 ``[T, S]`` routing tables, derived (see above).
  """

  name: str
  num_stages: int
  num_microbatches: int
  num_chunks: int
  placement: str
  action: np.ndarray
  microbatch: np.ndarray
  chunk: np.ndarray
  stash_slot: np.ndarray
  send_dir: np.ndarray = dataclasses.field(init=False, repr=False)
  send_slot: np.ndarray = dataclasses.field(init=False, repr=False)
  recv_slot: np.ndarray = dataclasses.field(init=False, repr=False)

  def __post_init__(self):
    for field in ("action", "microbatch", "chunk", "stash_slot"):
      value = np.asarray(getattr(self, field))
      object.__setattr__(self, field, value.astype(np.int8 if field == "action" else np.int32))
    events = _validate_fused(self)
    send_dir, send_slot, recv_slot = _route_messages(self, events)
    object.__setattr__(self, "send_dir", send_dir)
    object.__setattr__(self, "send_slot", send_slot)
    object.__setattr__(self, "recv_slot", recv_slot)

  @property
  def num_ticks(self) -> int:
    return int(self.action.shape[0])

  @property
  def virtual_stage(self) -> np.ndarray:
    """``[S, C]``: the model chunk each (stage, local chunk) holds (see :func:`virtual_stages`)."""
    return virtual_stages(self.placement, self.num_stages, self.num_chunks)

  @property
  def busy(self) -> np.ndarray:
    """Boolean ``[tick, stage]``: True where the stage does an action."""
    return self.action != IDLE

  @property
  def bubble_fraction(self) -> float:
    """Fraction of (tick, stage) slots that are idle: the bubble when every action costs the same.

    For other costs, see :meth:`simulate`.
    """
    return 1.0 - float(self.busy.sum()) / self.busy.size

  @property
  def efficiency(self) -> float:
    return 1.0 - self.bubble_fraction

  def _intervals(self, start: Action, ends: tuple[Action, ...]) -> np.ndarray:
    """``[T, S]`` count of (micro-batch, chunk) between a ``start`` and an ``ends`` action."""
    delta = np.zeros((self.num_ticks + 1, self.num_stages), np.int64)
    ticks, stages = np.nonzero(self.action == start)
    np.add.at(delta, (ticks, stages), 1)
    ticks, stages = np.nonzero(np.isin(self.action, ends))
    np.add.at(delta, (ticks + 1, stages), -1)
    return np.cumsum(delta, axis=0)[:-1]

  def in_flight(self) -> np.ndarray:
    """``[T, S]``: micro-batch chunks holding a stash slot during each tick (``F`` to release)."""
    return self._intervals(Action.F, (Action.B, Action.W))

  def peak_in_flight(self) -> np.ndarray:
    """``[S]``: most micro-batch chunks in flight on each stage: the stash slots it needs."""
    return self.in_flight().max(axis=0)

  def awaiting_weight(self) -> np.ndarray:
    """``[T, S]``: micro-batch chunks whose ``BI`` is done and ``W`` not (both ticks included)."""
    return self._intervals(Action.BI, (Action.W,))

  def stash_slots(self) -> np.ndarray:
    """``[S]``: stash slots each stage allocates (equal to :meth:`peak_in_flight`)."""
    return self.peak_in_flight()

  def arrival_slots(self) -> np.ndarray:
    """``[T, S, 3]``: mailbox slot written at the start of each tick, ``IDLE`` if none.

    The last axis is the message's origin: the left neighbour (it sent right), the right
    neighbour (it sent left), the stage itself. A message from tick ``t - 1`` arrives at ``t``.
    """
    out = np.full((self.num_ticks, self.num_stages, 3), IDLE, np.int32)
    for k, direction in enumerate(_ARRIVAL_DIRECTIONS):
      for t, src in zip(*np.nonzero((self.send_dir[:-1] == direction) &
                                    (self.send_slot[:-1] != IDLE))):
        out[t + 1, (src + direction) % self.num_stages, k] = self.send_slot[t, src]
    return out

  def mailbox_slots(self) -> np.ndarray:
    """``[S]``: receive-buffer slots each stage needs (most messages waiting there at once)."""
    slots = np.maximum(self.arrival_slots().max(axis=(0, 2)), self.recv_slot.max(axis=0))
    return slots.astype(np.int64) + 1

  def simulate(self, costs: Mapping[str, float] | None = None) -> Timing:
    """Step time under per-action costs, lockstep (SPMD) and dependency-driven.

    Args:
      costs: cost of each action kind that occurs, keyed by :class:`Action` name; defaults to
        ``{"F": 1, "B": 2, "BI": 1, "W": 1}`` (a backward costs two forwards, split evenly).

    Returns:
      A :class:`Timing`.
    """
    costs = dict(DEFAULT_COSTS if costs is None else costs)
    unknown = set(costs) - {a.name for a in Action}
    if unknown:
      raise ValueError(f"costs has unknown actions {sorted(unknown)}; use "
                       f"{[a.name for a in Action]}.")
    per_code = np.zeros(len(Action) + 1)  # index -1 (IDLE) stays 0.
    for a in Action:
      if np.any(self.action == a):
        if a.name not in costs:
          raise ValueError(f"costs has no entry for {a.name!r}, which {self.name!r} runs.")
        if not costs[a.name] >= 0:
          raise ValueError(f"costs[{a.name!r}] must be >= 0, got {costs[a.name]!r}.")
        per_code[a] = float(costs[a.name])
    cost = per_code[self.action]
    lockstep = float(cost.max(axis=1).sum())
    finish, stage_free = {}, np.zeros(self.num_stages)
    vstage = self.virtual_stage
    for t in range(self.num_ticks):
      for s in np.nonzero(self.busy[t])[0]:
        kind, m = Action(self.action[t, s]), int(self.microbatch[t, s])
        v = int(vstage[s, self.chunk[t, s]])
        ready = max([finish[key] for key in _inputs(kind, m, v, self.num_stages * self.num_chunks)],
                    default=0.0)
        start = max(stage_free[s], ready)
        stage_free[s] = finish[(_EVENT[kind], m, v)] = start + cost[t, s]
    return Timing(lockstep=lockstep, natural=float(stage_free.max()), busy=cost.sum(axis=0))

  def describe(self) -> str:
    """The table as text: one row per stage, one column per tick, ``.`` for idle.

    Cells read ``F3``, ``B3``, ``BI3``, ``W3`` (action and micro-batch), with ``/c`` for the local
    chunk when stages hold several: ``F3/1``.
    """
    cells = np.full(self.action.shape, ".", dtype=object)
    for t, s in zip(*np.nonzero(self.busy)):
      text = f"{Action(self.action[t, s]).name}{self.microbatch[t, s]}"
      cells[t, s] = text + (f"/{self.chunk[t, s]}" if self.num_chunks > 1 else "")
    width = max(len(c) for c in cells.flat)
    return "\n".join(f"stage {s}: " + " ".join(c.rjust(width) for c in cells[:, s])
                     for s in range(self.num_stages))


# Dependency bookkeeping: ``B`` and ``BI`` both produce the input gradient ("back").
_EVENT = {Action.F: "F", Action.B: "back", Action.BI: "back", Action.W: "W"}


def _placement_of(vstage: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """``(stage, local chunk)`` of each model chunk, two ``[V]`` arrays."""
  stage, chunk = np.empty(vstage.size, np.int64), np.empty(vstage.size, np.int64)
  stage[vstage.ravel()] = np.repeat(np.arange(vstage.shape[0]), vstage.shape[1])
  chunk[vstage.ravel()] = np.tile(np.arange(vstage.shape[1]), vstage.shape[0])
  return stage, chunk


def _inputs(kind: Action, m: int, v: int, num_virtual: int) -> list[tuple[str, int, int]]:
  """The actions (bookkeeping keys) that must finish before ``kind`` of (m, model chunk v)."""
  if kind == Action.F:
    return [("F", m, v - 1)] if v > 0 else []
  if kind == Action.W:
    return [("back", m, v)]
  return [("F", m, v)] + ([("back", m, v + 1)] if v < num_virtual - 1 else [])


def _validate_fused(schedule: FusedSchedule) -> dict:
  """Checks a fused schedule's tables; returns its ticks keyed like :func:`_inputs`."""
  num_stages, num_micro, num_chunks = (schedule.num_stages, schedule.num_microbatches,
                                       schedule.num_chunks)
  for name, value in (("num_stages", num_stages), ("num_microbatches", num_micro),
                      ("num_chunks", num_chunks)):
    _check_positive_int(name, value)
  vstage = virtual_stages(schedule.placement, num_stages, num_chunks)
  act, mb, ch, slot = schedule.action, schedule.microbatch, schedule.chunk, schedule.stash_slot
  for name, table in (("microbatch", mb), ("chunk", ch), ("stash_slot", slot)):
    if table.shape != act.shape:
      raise ValueError(f"{name} table has shape {table.shape}, action table {act.shape}.")
  if act.ndim != 2 or act.shape[1] != num_stages:
    raise ValueError(f"tables must be [ticks, {num_stages}], got {act.shape}.")
  idle = act == IDLE
  if not np.all(idle | np.isin(act, list(Action))):
    raise ValueError(f"action table has codes other than IDLE and {[int(a) for a in Action]}.")
  for name, table, bound in (("microbatch", mb, num_micro), ("chunk", ch, num_chunks),
                             ("stash_slot", slot, None)):
    if np.any(table[idle] != IDLE):
      t, s = np.argwhere(idle & (table != IDLE))[0]
      raise ValueError(f"tick {t}, stage {s}: idle slot with a {name} index.")
    bad = ~idle & ((table < 0) | ((table >= bound) if bound else False))
    if np.any(bad):
      t, s = np.argwhere(bad)[0]
      raise ValueError(f"tick {t}, stage {s}: {name} {table[t, s]} out of range.")

  ticks, slots = {}, {}
  for t, s in zip(*np.nonzero(~idle)):
    kind, m, c = Action(act[t, s]), int(mb[t, s]), int(ch[t, s])
    key = (kind, m, int(vstage[s, c]))
    if key in ticks:
      raise ValueError(f"stage {s} runs {kind.name} of micro-batch {m}, chunk {c} twice "
                       f"(ticks {ticks[key]} and {t}).")
    ticks[key] = int(t)
    slots[key] = int(slot[t, s])
  events = {}
  num_virtual = num_stages * num_chunks
  stage_of, chunk_of = _placement_of(vstage)
  for s in range(num_stages):
    for c in range(num_chunks):
      v = int(vstage[s, c])
      for m in range(num_micro):
        where = f"stage {s}, micro-batch {m}, chunk {c}"
        have = {a: ticks.get((a, m, v)) for a in Action}
        if have[Action.F] is None:
          raise ValueError(f"{where}: no forward.")
        split = have[Action.BI] is not None or have[Action.W] is not None
        if split and have[Action.B] is not None:
          raise ValueError(f"{where}: both a full backward B and a split backward BI/W.")
        if split and (have[Action.BI] is None or have[Action.W] is None):
          raise ValueError(f"{where}: a split backward needs both BI and W.")
        if not split and have[Action.B] is None:
          raise ValueError(f"{where}: no backward.")
        back = Action.BI if split else Action.B
        events[("F", m, v)] = have[Action.F]
        events[("back", m, v)] = have[back]
        if split:
          events[("W", m, v)] = have[Action.W]
        for a in (back, Action.W) if split else (back,):
          if slots[(a, m, v)] != slots[(Action.F, m, v)]:
            raise ValueError(f"{where}: {a.name} reads stash slot {slots[(a, m, v)]} but the "
                             f"forward wrote slot {slots[(Action.F, m, v)]}.")
  for (name, m, v), t in events.items():
    kind = {"F": Action.F, "back": Action.B, "W": Action.W}[name]
    for dep in _inputs(kind, m, v, num_virtual):
      if events[dep] >= t:
        s, c, ds, dc = stage_of[v], chunk_of[v], stage_of[dep[2]], chunk_of[dep[2]]
        what = "BI/B" if name == "back" else name
        dwhat = "BI/B" if dep[0] == "back" else dep[0]
        raise ValueError(f"tick {t}, stage {s}: {what} of micro-batch {m}, chunk {c} needs "
                         f"{dwhat} of chunk {dc} on stage {ds} done at an earlier tick, but it "
                         f"runs at tick {events[dep]}.")
  # Stash: slots numbered below the stage's peak, none reused while live.
  peak = schedule.peak_in_flight()
  live = {}
  for (name, m, v), t in sorted(events.items(), key=lambda item: item[1]):
    s, c = int(stage_of[v]), int(chunk_of[v])
    k = slots[(Action.F, m, v)]
    if name == "F":
      if k >= peak[s]:
        raise ValueError(f"stage {s}: stash slot {k} used but at most {peak[s]} micro-batch "
                         f"chunks are in flight there; number slots 0..{peak[s] - 1}.")
      if (s, k) in live:
        held_m, held_c = live[(s, k)]
        raise ValueError(f"tick {t}, stage {s}: forward of micro-batch {m}, chunk {c} writes "
                         f"stash slot {k}, still held by micro-batch {held_m}, chunk {held_c}.")
      live[(s, k)] = (m, c)
    elif name == "W" or ("W", m, v) not in events:
      del live[(s, k)]
  return events


def _route_messages(schedule: FusedSchedule, events: dict):
  """Derives the send/receive tables and assigns each message a slot in its receiver's mailbox."""
  num_stages, num_virtual = schedule.num_stages, schedule.num_stages * schedule.num_chunks
  stage_of, _ = _placement_of(schedule.virtual_stage)
  links = _link_directions(schedule.placement, num_stages, schedule.num_chunks)
  if np.any((stage_of[:-1] + links) % num_stages != stage_of[1:]):
    raise ValueError(f"placement {schedule.placement!r} needs hops beyond a neighbour.")
  messages = []  # (arrival tick, read tick, sender, receiver, direction)
  for (name, m, v), t in events.items():
    if name == "F" and v < num_virtual - 1:
      messages.append((t + 1, events[("F", m, v + 1)], stage_of[v], stage_of[v + 1], links[v]))
    elif name == "back" and v > 0:
      messages.append((t + 1, events[("back", m, v - 1)], stage_of[v], stage_of[v - 1],
                       -links[v - 1]))
  shape = schedule.action.shape
  send_dir = np.zeros(shape, np.int32)
  send_slot, recv_slot = np.full(shape, IDLE, np.int32), np.full(shape, IDLE, np.int32)
  free_at = [[] for _ in range(num_stages)]  # per receiver: tick each slot is free from.
  for arrive, read, src, dst, direction in sorted(messages):
    slots = free_at[dst]
    k = next((i for i, free in enumerate(slots) if free <= arrive), len(slots))
    if k == len(slots):
      slots.append(0)
    slots[k] = read + 1
    send_dir[arrive - 1, src], send_slot[arrive - 1, src] = direction, k
    recv_slot[read, dst] = k
  return send_dir, send_slot, recv_slot


def _place(name: str, num_stages: int, num_microbatches: int, num_chunks: int, placement: str,
           orders: list[list[tuple[Action, int, int]]]) -> FusedSchedule:
  """Lays per-stage action orders out on ticks and builds the schedule.

  Each tick, each stage runs the next action of its order if that action's inputs were done at an
  earlier tick, and idles otherwise. A forward takes the stage's lowest free stash slot.
  """
  vstage = virtual_stages(placement, num_stages, num_chunks)
  num_virtual = num_stages * num_chunks
  done, rows, position = {}, [], [0] * num_stages
  free = [[] for _ in range(num_stages)]  # per stage: slots released so far.
  held, used = {}, [0] * num_stages
  while any(position[s] < len(orders[s]) for s in range(num_stages)):
    t = len(rows)
    row = [(IDLE, IDLE, IDLE, IDLE)] * num_stages
    for s in range(num_stages):
      if position[s] == len(orders[s]):
        continue
      kind, m, c = orders[s][position[s]]
      v = int(vstage[s, c])
      if all(done.get(key, t) < t for key in _inputs(kind, m, v, num_virtual)):
        if kind == Action.F:
          k = min(free[s]) if free[s] else used[s]
          free[s] = [i for i in free[s] if i != k]
          used[s] = max(used[s], k + 1)
          held[(s, m, c)] = k
        k = held[(s, m, c)]
        if kind in (Action.B, Action.W):
          free[s].append(k)
        row[s] = (kind, m, c, k)
        done[(_EVENT[kind], m, v)] = t
        position[s] += 1
    if all(r[0] == IDLE for r in row):
      waiting = {s: orders[s][position[s]] for s in range(num_stages)
                 if position[s] < len(orders[s])}
      raise ValueError(f"{name}: the action orders deadlock at tick {t}; stages wait on {waiting}.")
    rows.append(row)
  table = np.array(rows, np.int32).transpose(2, 0, 1)
  return FusedSchedule(name=name, num_stages=num_stages, num_microbatches=num_microbatches,
                       num_chunks=num_chunks, placement=placement, action=table[0],
                       microbatch=table[1], chunk=table[2], stash_slot=table[3])


def _order_1f1b(num_stages: int, num_microbatches: int, stage: int):
  """PipeDream-Flush: ``S - 1 - s`` warm-up forwards, then one forward and one backward in turn."""
  warmup = min(num_stages - 1 - stage, num_microbatches)
  order = [(Action.F, m, 0) for m in range(warmup)]
  for i in range(num_microbatches - warmup):
    order += [(Action.F, warmup + i, 0), (Action.B, i, 0)]
  return order + [(Action.B, m, 0) for m in range(num_microbatches - warmup, num_microbatches)]


def _order_zb_h1(num_stages: int, num_microbatches: int, stage: int):
  """ZB-H1: 1F1B's order with ``B`` split into ``BI`` and ``W``, stage ``s`` deferring ``s`` W's.

  ``W`` of micro-batch ``k - s`` follows ``BI`` of ``k``, the last ``s`` come at the end: every
  stage holds up to ``S`` micro-batches (1F1B's stage 0), and the deferred ``W`` fill the tail.
  """
  order = []
  for kind, m, c in _order_1f1b(num_stages, num_microbatches, stage):
    if kind == Action.F:
      order.append((kind, m, c))
    else:
      order.append((Action.BI, m, c))
      if m >= stage:
        order.append((Action.W, m - stage, c))
  pending = range(max(0, num_microbatches - stage), num_microbatches)
  return order + [(Action.W, m, 0) for m in pending]


def _order_interleaved(num_stages: int, num_microbatches: int, num_chunks: int, stage: int):
  """Interleaved 1F1B (Megatron-LM): groups of S micro-batches go through the chunks in turn.

  Forward order: for each group, chunk 0 of its micro-batches, then chunk 1, ...; backward order
  the same with the chunks reversed. ``2 (S - 1 - s) + (C - 1) S`` warm-up forwards, then one
  forward and one backward in turn.
  """
  forward, backward = [], []
  for start in range(0, num_microbatches, num_stages):
    group = range(start, min(start + num_stages, num_microbatches))
    forward += [(m, c) for c in range(num_chunks) for m in group]
    backward += [(m, c) for c in reversed(range(num_chunks)) for m in group]
  total = len(forward)
  warmup = min(2 * (num_stages - 1 - stage) + (num_chunks - 1) * num_stages, total)
  order = [(Action.F, m, c) for m, c in forward[:warmup]]
  for (fm, fc), (bm, bc) in zip(forward[warmup:], backward):
    order += [(Action.F, fm, fc), (Action.B, bm, bc)]
  return order + [(Action.B, m, c) for m, c in backward[total - warmup:]]


def _order_zbv(num_stages: int, num_microbatches: int, stage: int):
  """ZB-V (Qi et al., 2024, sec. 6), chunk 0 going down the stages and chunk 1 coming back.

  The pattern is written for at least ``2S - 1`` micro-batches; with fewer, the actions of the
  missing ones are left out (the rest keep their order).
  """
  count = max(num_microbatches, 2 * num_stages - 1)
  nxt = {a: [0, 0] for a in Action}
  order = []

  def do(kind, c):
    order.append((kind, nxt[kind][c], c))
    nxt[kind][c] += 1

  for _ in range(2 * (num_stages - stage) - 1):  # Fill the way down.
    do(Action.F, 0)
  for _ in range(stage):
    do(Action.F, 1)
    do(Action.F, 0)
  for _ in range(num_stages - stage):  # The first micro-batches turn back up.
    do(Action.F, 1)
    do(Action.BI, 1)
    do(Action.W, 1)
  while nxt[Action.F][1] < nxt[Action.F][0] or nxt[Action.F][0] < count:  # Steady state.
    if nxt[Action.F][0] < count:
      do(Action.F, 0)
    do(Action.BI, 0)
    do(Action.W, 0)
    do(Action.F, 1)
    do(Action.BI, 1)
    do(Action.W, 1)
  for _ in range(stage):  # Drain: input gradients first, weight passes fill in behind.
    do(Action.BI, 0)
    do(Action.BI, 1)
  for _ in range(num_stages - stage):
    do(Action.BI, 0)
    do(Action.W, 0)
  for c in (1, 0):
    while nxt[Action.W][c] < nxt[Action.BI][c]:
      do(Action.W, c)
  return [(kind, m, c) for kind, m, c in order if m < num_microbatches]


def one_f_one_b(num_stages: int, num_microbatches: int) -> FusedSchedule:
  """1F1B, PipeDream-Flush (Narayanan et al., ICML 2021): one forward, one backward in turn.

  Stage ``s`` runs ``S - 1 - s`` warm-up forwards, so at most ``min(S - s, M)`` micro-batches are
  in flight there. ``2 (M + S - 1)`` ticks: GPipe's bubble ``(S - 1) / (M + S - 1)``.
  """
  _check_positive_int("num_stages", num_stages)
  _check_positive_int("num_microbatches", num_microbatches)
  orders = [_order_1f1b(num_stages, num_microbatches, s) for s in range(num_stages)]
  return _place("1f1b", num_stages, num_microbatches, 1, "loop", orders)


def interleaved_1f1b(num_stages: int, num_microbatches: int, num_repeats: int) -> FusedSchedule:
  """Interleaved 1F1B (Narayanan et al., SC 2021): ``num_repeats`` chunks per stage.

  Chunks are placed as the circular schedule places them (``"loop"``). When S divides M:
  ``2 (R M + S - 1)`` ticks, bubble ``(S - 1) / (R M + S - 1)``, and up to
  ``2 (S - 1 - s) + (R - 1) S + 1`` micro-batch chunks in flight on stage ``s``. Other M run too,
  with a few more ticks.
  """
  _check_positive_int("num_stages", num_stages)
  _check_positive_int("num_microbatches", num_microbatches)
  _check_positive_int("num_repeats", num_repeats)
  if num_repeats < 2:
    raise ValueError(f"schedule='interleaved_1f1b' needs num_repeats >= 2 chunks per stage, got "
                     f"{num_repeats}; use schedule='1f1b' for one.")
  orders = [_order_interleaved(num_stages, num_microbatches, num_repeats, s)
            for s in range(num_stages)]
  return _place("interleaved_1f1b", num_stages, num_microbatches, num_repeats, "loop", orders)


def zb_h1(num_stages: int, num_microbatches: int) -> FusedSchedule:
  """ZB-H1 (Qi et al., ICLR 2024, sec. 2.1): 1F1B with the backward split into ``BI`` and ``W``.

  Every stage holds up to ``min(S, M)`` micro-batches. With ``M >= S``: ``3M + S - 1`` ticks, so
  with F, BI and W of equal cost each stage idles ``S - 1`` against ``3M`` of work, a third of
  1F1B's ``3 (S - 1)`` (F = 1, B = 2).
  """
  _check_positive_int("num_stages", num_stages)
  _check_positive_int("num_microbatches", num_microbatches)
  orders = [_order_zb_h1(num_stages, num_microbatches, s) for s in range(num_stages)]
  return _place("zb_h1", num_stages, num_microbatches, 1, "loop", orders)


def zbv(num_stages: int, num_microbatches: int) -> FusedSchedule:
  """ZB-V (Qi et al., 2024, sec. 6): two chunks per stage placed in a V, split backward.

  With ``M >= 2S``: ``6M + S - 1`` ticks, each stage idle ``S - 1`` of them whatever M (the
  bubble fraction tends to zero), and ``2S`` micro-batch chunks (half a stage each) in flight.
  """
  _check_positive_int("num_stages", num_stages)
  _check_positive_int("num_microbatches", num_microbatches)
  orders = [_order_zbv(num_stages, num_microbatches, s) for s in range(num_stages)]
  return _place("zbv", num_stages, num_microbatches, 2, "v", orders)


def make_fused_schedule(name: str, num_stages: int, num_microbatches: int,
                        num_repeats: int | None = None) -> FusedSchedule:
  """Builds a fused schedule by name.

  Args:
    name: one of :data:`FUSED_SCHEDULE_NAMES`.
    num_stages: S.
    num_microbatches: M.
    num_repeats: chunks per stage: 1 (the default) for ``"1f1b"`` and ``"zb_h1"``, 2 (the
      default) for ``"zbv"``, at least 2 (required) for ``"interleaved_1f1b"``.

  Raises:
    ValueError: for an unknown name or a chunk count the schedule does not use.
  """
  natural = {"1f1b": 1, "zb_h1": 1, "zbv": 2}
  if name in natural:
    if num_repeats not in (None, natural[name]):
      raise ValueError(f"schedule={name!r} runs {natural[name]} chunk(s) per stage, got "
                       f"num_repeats={num_repeats}"
                       + ("; use schedule='interleaved_1f1b' for more." if name != "zbv"
                          else "; pass num_repeats=2."))
    builder = {"1f1b": one_f_one_b, "zb_h1": zb_h1, "zbv": zbv}[name]
    return builder(num_stages, num_microbatches)
  if name == "interleaved_1f1b":
    if num_repeats is None:
      raise ValueError("schedule='interleaved_1f1b' needs num_repeats >= 2 chunks per stage; use "
                       "schedule='1f1b' for one.")
    return interleaved_1f1b(num_stages, num_microbatches, num_repeats)
  hint = (" It is a forward schedule: build it with make_schedule(), and its fused table with "
          ".with_backward()." if name in SCHEDULE_NAMES else "")
  raise ValueError(f"Unknown fused schedule {name!r}; choose one of {FUSED_SCHEDULE_NAMES}.{hint}")
