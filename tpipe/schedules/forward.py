"""Forward schedules: what each stage runs forward at each tick; autodiff gives the backward.

A forward schedule (:class:`Schedule`: ``"gpipe"``, ``"circular"``) is a pair of integer tables
indexed ``[tick, stage]``:

* ``microbatch[t, s]``: the micro-batch stage ``s`` runs forward at tick ``t``, or ``IDLE`` when
  the stage is idle (a bubble);
* ``repeat[t, s]``: which of the stage's ``num_repeats`` layer chunks it applies (always 0 for
  GPipe; ``0..R-1`` for the circular schedule), ``IDLE`` when idle.

Their backward pass comes from automatic differentiation through the tick loop, which replays the
forward ticks in reverse order (:meth:`Schedule.backward_tables`); :mod:`tpipe.core.loops.forward`
runs them. Pure NumPy. The builders here are what :func:`tpipe.schedules.build` calls; make
tables with that, which validates its arguments and caches the table.

Example::

  >>> s = gpipe(num_stages=2, num_microbatches=3)
  >>> s.microbatch.tolist()
  [[0, -1], [1, 0], [2, 1], [-1, 2]]
  >>> round(s.bubble_fraction, 4)   # (S - 1) / (M + S - 1)
  0.25
  >>> s.stash_slots().tolist(), s.stashed_microbatches().tolist()   # per stage
  ([4, 4], [3, 3])
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tpipe.schedules import actions as actions_lib

IDLE = -1

# The forward schedules, as :func:`tpipe.schedules.build` knows them.
NAMES = ("gpipe", "circular")


def check_count(name: str, value) -> None:
  """Raises unless ``value`` is an int >= 1 (a stage, micro-batch, repeat or chunk count)."""
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
    delays: per link of the ring of stages (link ``l``: stage ``l`` to ``(l + 1) % S``), 0 or 1
      extra tick a value sent over it takes (:func:`~tpipe.schedules.actions.link_delays`);
      None: no delays.
  """

  name: str
  num_stages: int
  num_microbatches: int
  num_repeats: int
  microbatch: np.ndarray
  repeat: np.ndarray
  delays: tuple[int, ...] | None = None

  def __post_init__(self):
    for field in ("microbatch", "repeat"):  # Own copies: the tables are made read-only below.
      object.__setattr__(self, field, np.array(getattr(self, field), np.int32))
    if self.microbatch.shape != self.repeat.shape:
      raise ValueError("microbatch and repeat tables must have the same shape.")
    if self.microbatch.ndim != 2 or self.microbatch.shape[1] != self.num_stages:
      raise ValueError(
          f"tables must be [ticks, {self.num_stages}], got {self.microbatch.shape}.")
    object.__setattr__(self, "delays", actions_lib.link_delays(self.delays, self.num_stages))
    _validate_dataflow(self)
    for table in (self.microbatch, self.repeat):
      table.setflags(write=False)  # Tables are shared (tpipe.schedules.build caches them).

  @property
  def num_chunks(self) -> int:
    """Chunks per stage: ``num_repeats`` (the name fused schedules use)."""
    return self.num_repeats

  @property
  def placement(self) -> str:
    """Where model chunks live: chunk ``r * S + s`` on stage ``s`` (``"loop"``)."""
    return "loop"

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
    arrives by a neighbour ``ppermute``), or ``t - 2`` when link ``s - 1`` is delayed.
  * Stage 0 runs repeat ``r > 0`` of a micro-batch only after the last stage's value for
    repeat ``r - 1`` arrived (it waits in a loop-back buffer on stage 0).
  """
  mb, rep, delays = schedule.microbatch, schedule.repeat, schedule.delays
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
      sent = t - 1 - (delays[s - 1] if s > 0 else 0)
      if s > 0 and (sent < 0 or (mb[sent, s - 1], rep[sent, s - 1]) != (mb[t, s], rep[t, s])):
        raise ValueError(f"tick {t}, stage {s}: input was not produced by stage {s - 1} at tick "
                         f"{sent} (the value arrives {1 + delays[s - 1]} tick(s) after it is "
                         "sent).")
      if s == num_stages - 1:
        finished_at[seen[-1]] = t
    if sorted(seen) != sorted(expected):
      raise ValueError(f"stage {s} does not run every (micro-batch, repeat) exactly once.")
  for t in range(num_ticks):
    m, r = int(mb[t, 0]), int(rep[t, 0])
    if m != IDLE and r > 0 and finished_at[(m, r - 1)] + delays[-1] >= t:
      raise ValueError(f"tick {t}: stage 0 starts repeat {r} of micro-batch {m} before the last "
                       f"stage's repeat {r - 1} of it arrived.")


def circular(num_stages: int, num_microbatches: int, num_repeats: int,
             delays=None) -> Schedule:
  """The circular (looping) schedule: each stage holds ``num_repeats`` chunks of layers.

  Micro-batches enter stage 0 one per tick, pass through the S stages, loop back to stage 0 for
  the next chunk, and so on R times. Stage ``s`` at tick ``t`` works on the ``i = t - s``-th
  (micro-batch, repeat) pair in the order ``(repeat 0: mb 0..M-1), (repeat 1: mb 0..M-1), ...``.
  When ``M < S`` a micro-batch would come back to stage 0 before its previous lap finished, so
  each lap is padded to ``P = max(M, S)`` ticks (the padding ticks are bubbles).

  Chunk ``r`` of stage ``s`` holds layer chunk ``r * S + s``: the model's layers in order.

  With delayed links (``delays``), a value takes one more tick over each: stage ``s`` starts
  ``s + (delays of links 0..s-1)`` ticks after stage 0, and a lap takes ``S + sum(delays)``
  ticks (the period when ``M`` is smaller).

  Args:
    num_stages: S.
    num_microbatches: M.
    num_repeats: R, chunks per stage. ``R = 1`` is GPipe.
    delays: per link, 0 or 1 (:func:`~tpipe.schedules.actions.link_delays`); None: none.

  Returns:
    A :class:`Schedule` with ``(R - 1) * P + M + S - 1`` ticks without delays (each delayed link
    between stages adds one).
  """
  check_count("num_stages", num_stages)
  check_count("num_microbatches", num_microbatches)
  check_count("num_repeats", num_repeats)
  delays = actions_lib.link_delays(delays, num_stages)
  start = np.arange(num_stages) + np.concatenate([[0], np.cumsum(delays[:-1])])
  period = max(num_microbatches, num_stages + sum(delays)) if num_repeats > 1 else (
      num_microbatches)
  num_ticks = (num_repeats - 1) * period + num_microbatches + int(start[-1])
  tick = np.arange(num_ticks)[:, None]
  i = tick - start[None, :]
  m, r = np.mod(i, period), np.floor_divide(i, period)
  busy = (i >= 0) & (m < num_microbatches) & (r < num_repeats)
  return Schedule(
      name="circular",
      num_stages=num_stages,
      num_microbatches=num_microbatches,
      num_repeats=num_repeats,
      microbatch=np.where(busy, m, IDLE).astype(np.int32),
      repeat=np.where(busy, r, IDLE).astype(np.int32),
      delays=delays,
  )


def gpipe(num_stages: int, num_microbatches: int, delays=None) -> Schedule:
  """GPipe's fill-drain schedule: micro-batch ``m`` is on stage ``s`` at tick ``m + s``.

  ``M + S - 1`` ticks; bubble fraction ``(S - 1) / (M + S - 1)`` (Huang et al., 2019, sec. 2.3).
  Each delayed link between stages (``delays``) adds one tick.
  """
  schedule = circular(num_stages, num_microbatches, 1, delays)
  return dataclasses.replace(schedule, name="gpipe")
