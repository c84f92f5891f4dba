"""Fused schedules: forward and backward interleaved in one ``[tick, stage]`` table.

A :class:`FusedSchedule` says, per tick and stage, which :class:`~tpipe.schedules.actions.Action`
(``F``, ``B``, ``BI``, ``W``) the stage runs on which (micro-batch, local chunk), and which stash
slot holds what the backward needs; the message routing (send directions, mailbox slots) is
derived and validated on construction. :func:`place` lays per-stage action orders out on ticks
(the named schedules in :mod:`tpipe.schedules.orders` are orders); :func:`from_forward` writes a
forward schedule and autodiff's backward as one table, so every schedule can be analysed side by
side and run by the fused tick loop (a forward schedule's loss under ``remat="full"`` with
``"chunk"`` or ``"nested"`` granularity). :meth:`FusedSchedule.forward_pass` is the table's
forward actions alone (what a call that is not differentiated runs). :mod:`tpipe.core.loops.fused`
runs these tables. Pure NumPy.

Example::

  >>> from tpipe.schedules import orders
  >>> f = orders.one_f_one_b(num_stages=2, num_microbatches=3)
  >>> print(f.describe())
  stage 0: F0 F1  . B0 F2 B1  . B2
  stage 1:  . F0 B0 F1 B1 F2 B2  .
  >>> f.peak_in_flight().tolist(), round(f.bubble_fraction, 4)   # min(S - s, M); as GPipe
  ([2, 1], 0.25)
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from tpipe.schedules import actions as actions_lib
from tpipe.schedules import forward as forward_lib
from tpipe.schedules import simulate as simulate_lib
from tpipe.schedules import validation

Action = actions_lib.Action
IDLE = forward_lib.IDLE


@dataclasses.dataclass(frozen=True, eq=False)
class FusedSchedule:
  """A fused pipeline schedule: ``[row, stage]`` tables of actions, validated on construction.

  A table per field, one row per step of a tick and one column per stage: each stage does at
  most one action per row on one (micro-batch, local chunk); its output reaches another chunk
  at the next tick (two ticks later over a delayed link). Construction checks every dependency,
  stash slot and mailbox slot and derives the routing. What the fields mean, and how compound
  ticks, stashes and mailboxes work: docs/design/fused-schedules.md.

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
    forward_only: a table of forward actions only (:meth:`forward_pass`): no backward, no stash
      (``stash_slot`` all ``IDLE``).
    delays: per link of the ring of stages, 0 or 1 extra tick a message over it takes (see
      :func:`~tpipe.schedules.actions.link_delays`; None: no delays).
    tick: int32 ``[R]``: the tick each row belongs to (several rows: a compound tick); None: one
      row per tick.
    send_dir, send_slot, recv_slot: int32 ``[R, S]`` routing tables, derived: the direction of the
      message an action sends (+1, -1, 0), its mailbox slot on the receiver, and the slot an action
      reads (``IDLE`` for none).
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
  forward_only: bool = False
  delays: tuple[int, ...] | None = None
  tick: np.ndarray | None = None
  send_dir: np.ndarray = dataclasses.field(init=False, repr=False)
  send_slot: np.ndarray = dataclasses.field(init=False, repr=False)
  recv_slot: np.ndarray = dataclasses.field(init=False, repr=False)

  def __post_init__(self):
    for field in ("action", "microbatch", "chunk", "stash_slot"):
      value = np.asarray(getattr(self, field))
      object.__setattr__(self, field, value.astype(np.int8 if field == "action" else np.int32))
    forward_lib.check_count("num_stages", self.num_stages)
    object.__setattr__(self, "delays", actions_lib.link_delays(self.delays, self.num_stages))
    object.__setattr__(self, "tick", validation.check_ticks(self.tick, self.action.shape[0]))
    events = validation.validate(self)
    send_dir, send_slot, recv_slot, arrival = validation.route(self, events)
    object.__setattr__(self, "send_dir", send_dir)
    object.__setattr__(self, "send_slot", send_slot)
    object.__setattr__(self, "recv_slot", recv_slot)
    object.__setattr__(self, "_arrival", arrival)
    for field in ("action", "microbatch", "chunk", "stash_slot", "tick", "send_dir", "send_slot",
                  "recv_slot", "_arrival"):
      getattr(self, field).setflags(write=False)  # Shared: tpipe.schedules.build caches tables.

  @property
  def num_ticks(self) -> int:
    """Ticks: the trips of the tick loop (rows when no tick is compound)."""
    return int(self.tick[-1]) + 1 if self.tick.size else 0

  @property
  def num_rows(self) -> int:
    """Rows of the tables: steps of ticks (:attr:`num_ticks` when no tick is compound)."""
    return int(self.action.shape[0])

  @property
  def lanes(self) -> int:
    """Most rows in one tick: the steps the tick loop runs each tick (1: no compound tick)."""
    return int(np.bincount(self.tick).max()) if self.tick.size else 1

  @property
  def is_compound(self) -> bool:
    """Whether some tick holds more than one row."""
    return self.lanes > 1

  def first_rows(self) -> np.ndarray:
    """``[num_ticks]``: the first row of each tick."""
    return np.searchsorted(self.tick, np.arange(self.num_ticks)).astype(np.int64)

  def tick_costs(self, costs: Mapping[str, float] | None = None) -> np.ndarray:
    """``[num_ticks, S]``: what each stage's actions cost in each tick, summed over its rows
    (see :func:`~tpipe.schedules.simulate.action_costs` for ``costs``)."""
    return simulate_lib.tick_costs(self, costs)

  @property
  def virtual_stage(self) -> np.ndarray:
    """``[S, C]``: the model chunk each (stage, local chunk) holds (see :func:`virtual_stages`)."""
    return actions_lib.virtual_stages(self.placement, self.num_stages, self.num_chunks)

  @property
  def busy(self) -> np.ndarray:
    """Boolean ``[tick, stage]``: True where the stage does an action."""
    return self.action != IDLE

  def actions(self) -> list[tuple[int, int, str, int, int]]:
    """The table's work as ``(tick, stage, kind, microbatch, model_chunk)`` tuples, by tick,
    then stage, then the order the stage runs them in (several per (tick, stage) where a tick is
    compound): ``kind`` is ``"F"``, ``"B"``, ``"BI"`` or ``"W"``, ``model_chunk`` the chunk of
    the whole model it runs (:attr:`virtual_stage` of the stage's local chunk). Idle entries are
    left out."""
    vstage = self.virtual_stage
    rows, stages = np.nonzero(self.busy)
    order = np.lexsort((rows, stages, self.tick[rows]))
    return [(int(self.tick[r]), int(s), actions_lib.ACTION_OF[self.action[r, s]].name,
             int(self.microbatch[r, s]), int(vstage[s, self.chunk[r, s]]))
            for r, s in zip(rows[order], stages[order])]

  @property
  def bubble_fraction(self) -> float:
    """Fraction of (tick, stage) slots that are idle: the bubble when every action costs the same
    (for compound ticks: when every action costs 1 and a tick lasts its busiest stage).

    For other costs, see :meth:`simulate`.
    """
    per_tick = float(self.tick_costs({a.name: 1.0 for a in Action}).max(axis=1).sum())
    return 1.0 - float(self.busy.sum()) / (self.num_stages * per_tick) if per_tick else 0.0

  @property
  def efficiency(self) -> float:
    return 1.0 - self.bubble_fraction

  def _intervals(self, start: Action, ends: tuple[Action, ...]) -> np.ndarray:
    """``[R, S]`` count of (micro-batch, chunk) between a ``start`` and an ``ends`` action."""
    delta = np.zeros((self.num_rows + 1, self.num_stages), np.int64)
    ticks, stages = np.nonzero(self.action == start)
    np.add.at(delta, (ticks, stages), 1)
    ticks, stages = np.nonzero(np.isin(self.action, ends))
    np.add.at(delta, (ticks + 1, stages), -1)
    return np.cumsum(delta, axis=0)[:-1]

  def in_flight(self) -> np.ndarray:
    """``[R, S]``: micro-batch chunks holding a stash slot during each row (``F`` to release;
    none in a forward-only table)."""
    if self.forward_only:
      return np.zeros(self.action.shape, np.int64)
    return self._intervals(Action.F, (Action.B, Action.W))

  def peak_in_flight(self) -> np.ndarray:
    """``[S]``: most micro-batch chunks in flight on each stage: the stash slots it needs."""
    return self.in_flight().max(axis=0)

  def awaiting_weight(self) -> np.ndarray:
    """``[R, S]``: micro-batch chunks whose ``BI`` is done and ``W`` not (both ticks included)."""
    return self._intervals(Action.BI, (Action.W,))

  def stash_slots(self) -> np.ndarray:
    """``[S]``: stash slots each stage allocates (equal to :meth:`peak_in_flight`)."""
    return self.peak_in_flight()

  def arrival_slots(self) -> np.ndarray:
    """``[R, S, 3]``: mailbox slot written at the start of each row, ``IDLE`` if none (only the
    first row of a tick receives).

    The last axis is the message's origin: the left neighbour (it sent right), the right
    neighbour (it sent left), the stage itself. A message from tick ``t - 1`` arrives at ``t``;
    over a delayed link, one from ``t - 2``.
    """
    return self._arrival.copy()

  @property
  def hop_delays(self) -> np.ndarray:
    """``[V - 1]``: extra ticks of the hop between model chunks v and v + 1 (its link's delay)."""
    return actions_lib.hop_delays(self.placement, self.num_stages, self.num_chunks, self.delays)

  def mailbox_slots(self) -> np.ndarray:
    """``[S]``: receive-buffer slots each stage needs (most messages waiting there at once)."""
    slots = np.maximum(self.arrival_slots().max(axis=(0, 2)), self.recv_slot.max(axis=0))
    return slots.astype(np.int64) + 1

  def simulate(self, costs: Mapping[str, float] | None = None,
               transfer=None) -> simulate_lib.Timing:
    """Step time under per-action costs, lockstep (SPMD) and dependency-driven.

    Args:
      costs: cost of each action kind that occurs, keyed by :class:`Action` name; defaults to
        ``{"F": 1, "B": 2, "BI": 1, "W": 1}`` (a backward costs two forwards, split evenly).
      transfer: per link (or one number), the time one tick's exchange over it takes (see
        :func:`~tpipe.schedules.simulate.linked_time`); None: instant.

    Returns:
      A :class:`~tpipe.schedules.simulate.Timing`.
    """
    return simulate_lib.simulate(self, costs, transfer)

  def critical_path(self, costs: Mapping[str, float] | None = None,
                    transfer=None) -> list[tuple[int, int]]:
    """The ``(tick, stage)`` entries whose costs (with the transfers between them) make up the
    neighbour-synchronised step under ``costs`` and ``transfer`` (as for :meth:`simulate`), in
    tick order: :func:`~tpipe.schedules.simulate.critical_path`."""
    links = simulate_lib.ring_links(self.num_stages, self.num_chunks > 1)
    return simulate_lib.critical_path(self.tick_costs(costs), links, transfer, self.delays)

  def forward_pass(self) -> "FusedSchedule":
    """This table's forward actions alone, each stage running them in this table's order as
    soon as their inputs are there: the forward pass of a call that is not differentiated
    (``forward_only``: no stash, no backward)."""
    orders = [[(Action.F, int(self.microbatch[t, s]), int(self.chunk[t, s]))
               for t in np.nonzero(self.action[:, s] == Action.F)[0]]
              for s in range(self.num_stages)]
    return place(self.name, self.num_stages, self.num_microbatches, self.num_chunks,
                 self.placement, orders, forward_only=True, delays=self.delays)

  def describe(self) -> str:
    """The table as text: one row per stage, one column per tick, ``.`` for idle.

    Cells read ``F3``, ``B3``, ``BI3``, ``W3`` (action and micro-batch), with ``/c`` for the local
    chunk when stages hold several: ``F3/1``; a compound tick's actions are joined by ``+`` in
    the order the stage runs them: ``F5+BI2+W1``.
    """
    cells = np.full((self.num_ticks, self.num_stages), ".", dtype=object)
    for r, s in zip(*np.nonzero(self.busy)):
      text = f"{Action(self.action[r, s]).name}{self.microbatch[r, s]}"
      text += f"/{self.chunk[r, s]}" if self.num_chunks > 1 else ""
      t = self.tick[r]
      cells[t, s] = text if cells[t, s] == "." else f"{cells[t, s]}+{text}"
    width = max(len(c) for c in cells.flat)
    return "\n".join(f"stage {s}: " + " ".join(c.rjust(width) for c in cells[:, s])
                     for s in range(self.num_stages))


def place(name: str, num_stages: int, num_microbatches: int, num_chunks: int, placement: str,
          orders: list[list[tuple[Action, int, int]]], *,
          forward_only: bool = False, delays=None) -> FusedSchedule:
  """Lays per-stage action orders out on ticks and builds the schedule.

  Each tick, each stage runs the next action of its order if that action's inputs were done at an
  earlier tick, and idles otherwise. A forward takes the stage's lowest free stash slot (none in a
  ``forward_only`` table, whose orders hold forwards only).

  Args:
    name: the schedule's name.
    num_stages: S.
    num_microbatches: M.
    num_chunks: C, chunks per stage.
    placement: ``"loop"`` or ``"v"`` (see :func:`~tpipe.schedules.actions.virtual_stages`).
    orders: per stage, its ``(action, micro-batch, local chunk)`` in the order it runs them.
    forward_only: the orders hold forwards only (see :attr:`FusedSchedule.forward_only`).
    delays: per link, 0 or 1 extra tick (:func:`~tpipe.schedules.actions.link_delays`): an
      action waits two ticks for an input that crosses a delayed link.

  Raises:
    ValueError: the orders deadlock, or the table they give fails validation.
  """
  vstage = actions_lib.virtual_stages(placement, num_stages, num_chunks)
  num_virtual = num_stages * num_chunks
  hops = actions_lib.hop_delays(placement, num_stages, num_chunks, delays)
  ready = lambda key, v, t: key in done and done[key] + (
      0 if key[2] == v else int(hops[min(key[2], v)])) < t
  done, ticks, position = {}, [], [0] * num_stages
  while any(position[s] < len(orders[s]) for s in range(num_stages)):
    t = len(ticks)
    work = [[] for _ in range(num_stages)]
    for s in range(num_stages):
      if position[s] == len(orders[s]):
        continue
      kind, m, c = orders[s][position[s]]
      v = int(vstage[s, c])
      if all(ready(key, v, t) for key in actions_lib.dependencies(kind, m, v, num_virtual)):
        work[s].append((kind, m, c))
        done[(actions_lib.EVENT[kind], m, v)] = t
        position[s] += 1
    waiting = {s: orders[s][position[s]] for s in range(num_stages)
               if position[s] < len(orders[s])}
    in_transit = any(all(key in done for key in actions_lib.dependencies(
        kind, m, int(vstage[s, c]), num_virtual)) for s, (kind, m, c) in waiting.items())
    if not any(work) and not in_transit:
      raise ValueError(f"{name}: the action orders deadlock at tick {t}; stages wait on {waiting}.")
    ticks.append(work)
  return from_ticks(name, num_stages, num_microbatches, num_chunks, placement, ticks,
                    forward_only=forward_only, delays=delays)


def from_ticks(name: str, num_stages: int, num_microbatches: int, num_chunks: int,
               placement: str, ticks: list[list[list[tuple[Action, int, int]]]], *,
               forward_only: bool = False, delays=None) -> FusedSchedule:
  """Builds a table from its ticks: ``ticks[t][s]`` lists the ``(action, micro-batch, local
  chunk)`` stage ``s`` runs in tick ``t``, in order (empty: idle). A tick gets as many rows as
  its busiest stage has actions (one row each where every stage runs at most one: no compound
  tick); a forward takes the stage's lowest free stash slot (none in a ``forward_only``
  table), and a slot released by ``B`` or ``W`` is free from the next tick.

  Raises:
    ValueError: the table fails validation (see :class:`FusedSchedule`).
  """
  free = [[] for _ in range(num_stages)]
  held, used = {}, [0] * num_stages
  rows, tick = [], []
  for t, work in enumerate(ticks):
    if len(work) != num_stages:
      raise ValueError(f"tick {t} lists {len(work)} stages, not {num_stages}.")
    lanes = max(1, max(len(actions) for actions in work))
    block = [[(IDLE, IDLE, IDLE, IDLE)] * num_stages for _ in range(lanes)]
    released = []
    for s, actions in enumerate(work):
      for lane, (kind, m, c) in enumerate(actions):
        kind = actions_lib.ACTION_OF[kind]
        if kind == Action.F:
          k = min(free[s]) if free[s] else used[s]
          free[s] = [i for i in free[s] if i != k]
          used[s] = max(used[s], k + 1)
          held[(s, m, c)] = k
        if (s, m, c) not in held:
          raise ValueError(f"tick {t}, stage {s}: {kind.name} of micro-batch {m}, chunk {c} "
                           "before its forward.")
        k = held[(s, m, c)]
        if kind in (Action.B, Action.W):
          released.append((s, k))
        block[lane][s] = (kind, m, c, IDLE if forward_only else k)
    for s, k in released:
      free[s].append(k)
    rows += block
    tick += [t] * lanes
  table = np.array(rows, np.int32).reshape(len(rows), num_stages, 4).transpose(2, 0, 1)
  return FusedSchedule(name=name, num_stages=num_stages, num_microbatches=num_microbatches,
                       num_chunks=num_chunks, placement=placement, action=table[0],
                       microbatch=table[1], chunk=table[2], stash_slot=table[3],
                       forward_only=forward_only, delays=delays, tick=np.array(tick, np.int32))


def whole_step(schedule) -> FusedSchedule:
  """A step's forward and backward as one :class:`FusedSchedule`: a fused table itself, a
  forward schedule's as :func:`from_forward` writes it (what its simulation and in-flight
  analytics read)."""
  return schedule if isinstance(schedule, FusedSchedule) else from_forward(schedule)


def from_forward(schedule: forward_lib.Schedule) -> FusedSchedule:
  """A forward schedule's whole step as a :class:`FusedSchedule`: its forward ticks, then
  autodiff's backward.

  The backward ticks are :meth:`~tpipe.schedules.Schedule.backward_tables` with full backward
  actions ``B``, so the fused analytics (:meth:`FusedSchedule.simulate`,
  :meth:`FusedSchedule.peak_in_flight`) apply to GPipe and circular too. Its stash counts
  micro-batches (``R * M`` per stage), not the ``num_ticks`` slots autodiff through the tick loop
  allocates (:meth:`~tpipe.schedules.Schedule.stash_slots`).

  Example::

    >>> from tpipe.schedules import forward
    >>> step = from_forward(forward.gpipe(num_stages=2, num_microbatches=2))
    >>> print(step.describe())
    stage 0: F0 F1  .  . B1 B0
    stage 1:  . F0 F1 B1 B0  .
  """
  backward_mb, backward_rep = schedule.backward_tables()
  microbatch = np.concatenate([schedule.microbatch, backward_mb])
  chunk = np.concatenate([schedule.repeat, backward_rep])
  action = np.where(microbatch == IDLE, IDLE, Action.F)
  action[schedule.num_ticks:][microbatch[schedule.num_ticks:] != IDLE] = Action.B
  slot = np.full(microbatch.shape, IDLE, np.int32)
  for s in range(schedule.num_stages):  # Stack order: forward k-th uses slot k, backward pops.
    busy = np.nonzero(schedule.microbatch[:, s] != IDLE)[0]
    slot[busy, s] = np.arange(len(busy))
    slot[2 * schedule.num_ticks - 1 - busy, s] = np.arange(len(busy))
  return FusedSchedule(name=schedule.name, num_stages=schedule.num_stages,
                       num_microbatches=schedule.num_microbatches,
                       num_chunks=schedule.num_repeats, placement="loop", action=action,
                       microbatch=microbatch, chunk=chunk, stash_slot=slot,
                       delays=schedule.delays)
