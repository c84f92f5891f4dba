"""Compound ticks: fused tables whose ticks cost about the same on every stage.

In one SPMD program a tick lasts as long as the slowest of the stages it exchanges messages
with, so a table of one action per tick (:mod:`tpipe.schedules.orders`) whose neighbours run an
``F`` beside a ``B`` three times its cost wastes most of the ``F`` stage's tick. A *compound*
tick (:class:`~tpipe.schedules.FusedSchedule`, *Compound ticks*) lets a stage run a forward
*and* a backward of different micro-batches in one tick, and ``W`` work where it fits, so in the
steady state every stage's tick costs ``F + B``: the ticks cost the same everywhere and the
neighbour-synchronised step (:mod:`tpipe.schedules.simulate`) is close to the dependency-driven
one.

:func:`pack` lays a schedule out tick by tick for per-action costs. Each tick, each stage takes:

* at most one backward (``B``, or ``BI`` when the backward is split): the earliest ready
  micro-batch, then the deepest model chunk;
* at most one forward, the next micro-batch of a chunk whose input is there, while the stage
  holds fewer than its cap of micro-batch chunks in flight (deeper chunks first, or shallower
  first); where the forward and the backward would send the same way, one of them waits (the
  forward, or the backward); and, where it fits within the costliest stage's tick, a second
  forward of another chunk that sends the other way (ZB-V: while the first backward travels
  the V, the stages it has not reached yet run a forward of each chunk, not only one);
* ``W`` work (split backward): pending ``W`` while the stage's tick stays within the costliest
  stage's tick (up to :data:`FILL_SLACK` over it, as for a second forward), and more when more
  than ``weight_backlog`` wait (so memory stays bounded); a stage with nothing else runs one.

With a *light ramp* (ZB-V), no stage runs a forward and a backward in one tick until the first
backward is back at model chunk 0: while it travels the V, the stages it has not reached can
run only forwards, two a tick at most, so a backward alone, two forwards or a forward and ``W``
keep every stage's tick about as long as theirs, where ``F + BI`` behind the backward made them
wait (S = 8, M = 32, measured LM costs: neighbour-synchronised bubble 0.071 -> 0.054).

Where ``W`` goes sets most of what a split backward loses to neighbour synchronisation:

* *Held weights* (``weight_hold``): no stage runs ``W`` beside its other work until some
  ticks after the first backward reached model chunk 0, and from then on every stage runs one
  each tick. All stages switch in the same tick, so the steady ticks cost ``F + BI + W``
  everywhere at once; switched on stage by stage, each stage's first such tick waits for its
  neighbour's, a wave that costs a ``W`` per hop (ZB-H1, S = 8, M = 32, measured LM costs: the
  step is the one-action table's natural one; switched by the weight backlog, the bubble was
  1.23x the natural one).
* *Settled weights* (:mod:`tpipe.schedules.weight_settling`): after packing, each ``W`` on the
  chain of ticks that sets the step moves to the tick of its stage with the most slack
  (:func:`tpipe.schedules.simulate.tick_slack`), which never lengthens the step (ZB-H1,
  S = 8, M = 8: bubble 1.24x -> 1.12x its natural one). Where a loop's shortest table is still
  longer than the schedule's natural step, its ``W`` are also *placed* all at once by a
  mixed-integer program (:func:`~tpipe.schedules.weight_settling.place_weights`), which finds
  the moves no single ``W`` gains by (ZB-H1, S = 4, M = 4, ``B / F`` 2, ``W / F`` 1.5: bubble
  1.36x -> 1.13x its natural one).

A message needs an earlier tick (two over a delayed link); the last chunk's backward can follow
its own forward in the same tick. :func:`build` tries a few caps, backlogs, orders and weight
holds, with and without second forwards and the light ramp (:func:`candidates`; for the V, the
fastest of them again with smaller weight backlogs), settles the weights of the fastest
distinct tables (for a loop longer than its natural step, places the shortest one's too), and
keeps the table whose neighbour-synchronised step is shortest, the
one-action-per-tick table of :mod:`tpipe.schedules.orders` included (within 1% of it and 5% of
its bubble, the one that holds the least). Beyond M = 2 S (a V) or 4 S (a loop) it keeps only
tables that hold no more stash, weight and mailbox slots than its table there, so memory stays
flat in M (:data:`REFERENCE_MICROBATCHES`). Pure NumPy.

Example::

  >>> from tpipe.schedules import compound
  >>> f = compound.build("1f1b", 3, 4, costs={"F": 1, "B": 3})
  >>> print(f.describe())
  stage 0:    F0    F1    F2    F3    B0    B1    B2    B3
  stage 1:     .    F0    F1 F2+B0 F3+B1    B2    B3     .
  stage 2:     .     . F0+B0 F1+B1 F2+B2 F3+B3     .     .
  >>> timing = f.simulate({"F": 1, "B": 3})   # GPipe's step, (M + S - 1)(F + B), in one SPMD
  >>> timing.natural, timing.neighbour, timing.lockstep   # program: every tick costs the same
  (24.0, 24.0, 24.0)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Mapping

import numpy as np

from tpipe.schedules import actions as actions_lib
from tpipe.schedules import forward as forward_lib
from tpipe.schedules import fused as fused_lib
from tpipe.schedules import orders as orders_lib
from tpipe.schedules import weight_settling

Action = actions_lib.Action
IDLE = forward_lib.IDLE

# How much longer than the shortest a table's step may be and still win on memory: 1% of the
# step, and at most 5% of the shortest table's bubble (the step less a stage's work), so a table
# that holds less never wins by a bubble much larger than the best one's.
TOLERANCE = 0.01
BUBBLE_TOLERANCE = 0.05
# How much longer than the costliest stage's tick a stage's may grow to fit a W or a second
# forward: sums of measured costs that nearly tie (a GPU's F + BI and BI + W) should not flip
# the packing (S = 8, M = 32 under an H200's timed costs: ZB-V 0.957 -> 0.872x GPipe's step).
FILL_SLACK = 0.05
# Micro-batch chunks per stage a table settled by settle_weights may leave awaiting W, per stage
# of the pipeline, unless the table holds more already (2 S; S = 8: 16).
WEIGHT_SLOTS = 2
# How many of the fastest distinct tables build() settles, per placement: about all of a loop's
# (S = 8, M = 32: 0.04 s each, 1.9 s the whole build); a V's eight (S = 8, M = 32: 200 distinct
# tables of 512 W, about 0.5 s each).
SETTLED = {"loop": 64, "v": 8}
# Per placement, micro-batches per stage of the table whose slots bound every longer table's:
# a compound table at M holds no more stash, weight and mailbox slots than at M = 2 S (a V) or
# 4 S (a loop), so its memory does not grow with M beyond it. Up to 4 S the weights a split
# backward leaves waiting fill a longer cool-down. A loop needs them for its natural bubble
# (ZB-H1, S = 8, M = 32, measured LM costs, remat full: 1.00x it with 23 stash slots, 1.32x
# bounded by M = 16's 16) and holds a few more (S = 4, remat none: 8 -> 10 from M = 8 to 64;
# 1F1B and interleaved 1F1B none); a V holds twice as many for a 1-3% shorter step (ZB-V,
# S = 4, remat none: 11 stash slots at M = 8, 23 at 16 .. 64, neighbour-synchronised step at
# M = 64 387.2 against 390.9 F; measured costs, M = 32: 114557 against 117554; S = 8, M = 32:
# 47 slots against 16 for one action per tick).
REFERENCE_MICROBATCHES = {"loop": 4, "v": 2}
# Per fused schedule: (placement, whether the backward is split into BI and W).
SHAPES = {"1f1b": ("loop", False), "interleaved_1f1b": ("loop", False),
          "zb_h1": ("loop", True), "zbv": ("v", True)}


def pack(name: str, num_stages: int, num_microbatches: int, num_chunks: int,
         costs: Mapping[str, float], *, in_flight: int | None = None,
         weight_backlog: int = 1, deeper_first: bool = True, backward_first: bool = True,
         second_forward: bool = False, light_ramp: bool = False,
         weight_hold: int | None = None, delays=None) -> fused_lib.FusedSchedule:
  """Schedule ``name`` laid out in compound ticks for ``costs`` (see the module docstring). The
  keyword options are the layout's knobs, which :func:`candidates` sweeps and
  :mod:`tpipe.experimental.costs` sets.

  Args:
    name: one of :data:`SHAPES`.
    num_stages: S.
    num_microbatches: M.
    num_chunks: chunks per stage (1; 2 for ``"zbv"``; at least 2 for ``"interleaved_1f1b"``).
    costs: per-action costs of one chunk (:func:`~tpipe.schedules.actions.check_costs`).
    in_flight: how many more micro-batch chunks than ``C (2 (S - s) - 1)`` (``"loop"``) or
      ``2 S`` (``"v"``) stage ``s`` may hold between a forward and the action that releases its
      stash before it takes no new micro-batch (one it holds goes on); None: no cap.
    weight_backlog: ``W`` a stage may leave waiting before it must run one (split backward).
    deeper_first: a stage with forwards of several chunks ready runs the deepest first.
    backward_first: where a stage's forward and backward would send the same way, keep the
      backward (else the forward).
    second_forward: a stage may also run a forward of another chunk, one its other actions
      leave a way to send free, where it fits within the costliest stage's tick (only ZB-V's
      two chunks send different ways).
    light_ramp: until the first backward is back at model chunk 0, a stage runs a forward and a
      backward in different ticks (the loss chunk's backward waits a tick for its forward; any
      other forward waits for the backward), so a backward alone, two forwards, or a forward
      and ``W`` make every stage's tick cost about the same while the stages ahead of the
      backward can run only forwards.
    weight_hold: split backward only: a stage runs no ``W`` beside an ``F`` or a backward
      (unless more than ``weight_backlog`` wait) until the ``weight_hold + 1``-th tick after
      the one in which the first backward reached model chunk 0; from that tick on, every
      stage runs one ``W`` with them each tick, and fills as before. Every stage switches in
      the same tick, so the steady ticks cost ``F + BI + W`` on all stages at once. (Switched
      on stage by stage, each stage's first such tick waits for its neighbour's: a wave that
      costs a ``W`` per hop.) None: ``W`` as the fill rule and ``weight_backlog`` say from the
      start.
    delays: per link, 0 or 1 extra tick (:func:`~tpipe.schedules.actions.link_delays`).

  Returns:
    The validated :class:`~tpipe.schedules.FusedSchedule`.
  """
  placement, split = SHAPES[name]
  costs = actions_lib.check_costs(costs, split)
  if weight_hold is not None and (isinstance(weight_hold, bool) or not isinstance(weight_hold, int)
                                  or weight_hold < 0 or not split):
    raise ValueError(f"weight_hold must be None or an int >= 0, for a split backward (zb_h1, "
                     f"zbv); got weight_hold={weight_hold!r} for {name!r}.")
  knobs = _Knobs(in_flight, weight_backlog, deeper_first, backward_first, second_forward,
                 light_ramp, weight_hold)
  ticks = _Packer(name, (num_stages, num_microbatches, num_chunks), costs, knobs, delays).run()
  return fused_lib.from_ticks(name, num_stages, num_microbatches, num_chunks, placement, ticks,
                              delays=delays)


class _Packings:
  """``packings(**settings) -> (table, step)``: :func:`pack`'s table for one setting of its
  knobs and its neighbour-synchronised step under ``costs``, each distinct packing made into a
  validated table and simulated once (many settings pack alike: at S = 3, M = 48, ZB-V's 256
  give 201 tables, ZB-H1's 64 give 8)."""

  def __init__(self, name: str, sizes: tuple[int, int, int], costs: Mapping[str, float],
               delays):
    self.name, self.sizes, self.costs, self.delays = name, sizes, costs, delays
    self.made = {}

  def __call__(self, **settings) -> tuple[fused_lib.FusedSchedule, float]:
    ticks = _Packer(self.name, self.sizes, self.costs, _Knobs(**settings), self.delays).run()
    key = tuple(tuple(tuple(actions) for actions in work) for work in ticks)
    if key not in self.made:
      table = fused_lib.from_ticks(self.name, *self.sizes, SHAPES[self.name][0], ticks,
                                   delays=self.delays)
      self.made[key] = table, round(table.simulate(self.costs).neighbour, 9)
    return self.made[key]


@dataclasses.dataclass(frozen=True)
class _Knobs:
  """:func:`pack`'s layout settings (see its arguments; the same defaults)."""

  in_flight: int | None = None
  weight_backlog: int = 1
  deeper_first: bool = True
  backward_first: bool = True
  second_forward: bool = False
  light_ramp: bool = False
  weight_hold: int | None = None


class _Packer:
  """One compound packing as it goes, tick by tick (:func:`pack`): each tick every stage
  chooses its forward and backward (:meth:`choose`), they are done (:meth:`commit`), and weight
  work fills the tick (:meth:`fill_weights`)."""

  def __init__(self, name: str, sizes: tuple[int, int, int], costs, knobs: _Knobs, delays):
    placement, self.split = SHAPES[name]
    self.name, self.costs, self.knobs = name, costs, knobs
    self.num_stages, self.num_microbatches, self.num_chunks = sizes
    stages, chunks = self.num_stages, self.num_chunks
    # Nested lists, not arrays: the packer reads them per stage per tick, where a NumPy
    # scalar's indexing costs several times a list's.
    self.vstage = actions_lib.virtual_stages(placement, stages, chunks).tolist()
    self.num_virtual = stages * chunks
    self.hops = actions_lib.hop_delays(placement, stages, chunks, delays).tolist()
    self.links = actions_lib.link_directions(placement, stages, chunks).tolist()
    self.back = Action.BI if self.split else Action.B
    extra = knobs.in_flight if knobs.in_flight is not None else chunks * self.num_microbatches
    self.caps = [(chunks * (2 * (stages - s) - 1) if placement == "loop" else 2 * stages) + extra
                 for s in range(stages)]
    self.done = {}  # (event, m, v) -> tick
    self.next_forward = [[0] * chunks for _ in range(stages)]
    self.forwarded = [[] for _ in range(stages)]  # (m, c) with F done, backward not.
    self.pending_w = [[] for _ in range(stages)]
    self.holding = [0] * stages
    self.remaining = stages * chunks * self.num_microbatches * (3 if self.split else 2)
    self.ramp = knobs.light_ramp  # Until the first backward is back at model chunk 0.
    self.release = None  # With weight_hold: the first tick every stage runs W beside the rest.

  def run(self) -> list:
    """The ticks: per tick, per stage, its ``(action, micro-batch, chunk)`` entries."""
    ticks = []
    limit = 4 * (self.num_virtual + 2) * (self.num_microbatches + self.num_virtual)
    while self.remaining:
      t = len(ticks)
      if t > limit:
        raise RuntimeError(f"{self.name}: compound packing made no progress by tick {t}.")
      chosen = [self.choose(s, t) for s in range(self.num_stages)]
      row = [work for work, _ in chosen]
      spent = [sum(self.costs[kind.name] for kind, _, _ in work) for work in row]
      busiest = self.commit(row, [spare for _, spare in chosen], spent, t)
      self.fill_weights(row, spent, busiest, t)
      ticks.append(row)
    return ticks

  def arrived(self, key, v: int, t: int) -> bool:
    """Whether a message's result is there by tick ``t``."""
    return key in self.done and self.done[key] + 1 + self.hops[min(key[2], v)] <= t

  def direction(self, kind, v: int):
    """Where ``kind`` on model chunk ``v`` sends: +1, -1, 0 (the same stage) or None."""
    if kind == Action.F:
      return self.links[v] if v < self.num_virtual - 1 else None
    return -self.links[v - 1] if v > 0 else None

  def ready_forwards(self, s: int, t: int) -> list:
    """Stage ``s``'s forwards whose input is there, ``(order, m, c)``, in the order taken."""
    forwards = []
    for c in range(self.num_chunks):
      m, v = self.next_forward[s][c], self.vstage[s][c]
      # Over the cap, only a micro-batch the stage already holds goes on (so the oldest one
      # in flight always can: the cap never deadlocks).
      room = self.holding[s] < self.caps[s] or any(m == held for held, _ in self.forwarded[s])
      if m < self.num_microbatches and room and (v == 0 or self.arrived(("F", m, v - 1), v, t)):
        forwards.append((-v if self.knobs.deeper_first else v, m, c))
    return sorted(forwards)

  def ready_backwards(self, s: int, t: int, forwards: list) -> list:
    """Stage ``s``'s backwards whose gradient is there, ``(m, -v, c)``; the loss chunk's
    after its forward (possibly this tick's)."""
    backs = []
    for m, c in self.forwarded[s]:
      v = self.vstage[s][c]
      if v == self.num_virtual - 1 or self.arrived(("back", m, v + 1), v, t):
        backs.append((m, -v, c))
    last = self.num_virtual - 1
    return backs + [(m, -last, c) for _, m, c in forwards if self.vstage[s][c] == last]

  def choose(self, s: int, t: int):
    """Stage ``s``'s forward and backward in tick ``t`` (``[(action, m, c)]``) and the
    second forward it may add where it fits (or None)."""
    forwards = self.ready_forwards(s, t)
    backs = self.ready_backwards(s, t, forwards)
    backward = min(backs) if backs else None
    sends = lambda f: self.direction(Action.F, self.vstage[s][f[2]])
    if self.knobs.backward_first or backward is None:
      taken = {self.direction(self.back, -backward[1])} if backward else set()
      forward = next((f for f in forwards if sends(f) is None or sends(f) not in taken), None)
    else:
      forward = forwards[0] if forwards else None
      clash = lambda b: (forward is not None and sends(forward) is not None
                         and self.direction(self.back, -b[1]) == sends(forward))
      backward = min((b for b in backs if not clash(b)), default=None)
    loss_waits = backward and (backward[0], backward[2]) not in self.forwarded[s] and (
        forward is None or (forward[1], forward[2]) != (backward[0], backward[2]))
    if loss_waits:
      backward = None  # The loss chunk's backward waits for its forward.
    if self.ramp and forward and backward:
      if (forward[1], forward[2]) == (backward[0], backward[2]):
        backward = None  # The loss chunk's backward: next tick.
      else:
        forward = None
    work = ([(Action.F, forward[1], forward[2])] if forward else []) + (
        [(self.back, backward[0], backward[2])] if backward else [])
    spare = None
    if self.knobs.second_forward:  # Another chunk's, sent a way the tick's others leave free.
      used = {sends(forward) if forward else None,
              self.direction(self.back, -backward[1]) if backward else None}
      spare = next((f for f in forwards if f is not forward and sends(f) not in used
                    and (forward is None or f[2] != forward[2])), None)
    return work, spare

  def commit(self, row: list, spare: list, spent: list, t: int) -> float:
    """Does the chosen actions of tick ``t``, then each stage's second forward where it fits
    within the costliest stage's tick; returns that cost (before the second forwards)."""
    busiest = max(spent)
    for s, work in enumerate(row):
      for kind, m, c in work:
        v = self.vstage[s][c]
        self.done[(actions_lib.EVENT[kind], m, v)] = t
        self.remaining -= 1
        first_back = kind == self.back and v == 0
        self.ramp = self.ramp and not first_back
        if self.knobs.weight_hold is not None and self.release is None and first_back:
          self.release = t + 1 + self.knobs.weight_hold
        if kind == Action.F:
          self.next_forward[s][c] += 1
          self.holding[s] += 1
          self.forwarded[s].append((m, c))
        else:
          self.forwarded[s].remove((m, c))
          if self.split:
            self.pending_w[s].append((m, c))
          else:
            self.holding[s] -= 1
      fits = spent[s] + self.costs["F"] <= busiest * (1 + FILL_SLACK)
      if spare[s] and self.holding[s] < self.caps[s] and fits:
        _, m, c = spare[s]
        work.append((Action.F, m, c))
        spent[s] += self.costs["F"]
        self.done[("F", m, self.vstage[s][c])] = t
        self.next_forward[s][c] += 1
        self.holding[s] += 1
        self.forwarded[s].append((m, c))
        self.remaining -= 1
    return busiest

  def run_weight(self, s: int, row: list, spent: list, t: int) -> None:
    """Stage ``s`` runs its oldest pending ``W`` in tick ``t``."""
    m, c = self.pending_w[s].pop(0)
    row[s].append((Action.W, m, c))
    spent[s] += self.costs["W"]
    self.done[("W", m, self.vstage[s][c])] = t
    self.holding[s] -= 1
    self.remaining -= 1

  def fill_weights(self, row: list, spent: list, busiest: float, t: int) -> None:
    """Weight work in tick ``t``: held weights switched on, pending ``W`` where it fits within
    the costliest stage's tick, more where more than the backlog wait, one on an idle stage."""
    worked = [bool(work) for work in row]
    hold = self.knobs.weight_hold
    held = hold is not None and (self.release is None or t < self.release)
    if hold is not None and not held:
      for s in range(self.num_stages):
        if worked[s] and self.pending_w[s]:
          self.run_weight(s, row, spent, t)
      busiest = max(spent)
    for s, work in enumerate(row):
      while self.pending_w[s] and self.takes_weight(s, work, spent[s] + self.costs["W"],
                                                    busiest, held and worked[s]):
        self.run_weight(s, row, spent, t)

  def takes_weight(self, s: int, work: list, cost: float, busiest: float, held: bool) -> bool:
    """Whether stage ``s`` runs another ``W`` in this tick, which would cost it ``cost``: it
    fits within the costliest stage's tick (unless weights are ``held``), more than the
    backlog wait, or the stage has nothing else."""
    fits = cost <= busiest * (1 + FILL_SLACK) and not held
    return fits or len(self.pending_w[s]) > self.knobs.weight_backlog or not work


def slots_held(table: fused_lib.FusedSchedule) -> tuple[int, int, int]:
  """What a table's memory grows with, per stage at its peak: ``(stash slots, weight slots,
  mailbox slots)`` (the executor allocates each buffer for the busiest stage)."""
  return (int(table.stash_slots().max()), int(table.awaiting_weight().max()),
          int(table.mailbox_slots().max()))


@functools.lru_cache(maxsize=64)
def _slots_at(name, num_stages, num_microbatches, costs, num_repeats,
              delays) -> tuple[int, int, int]:
  """:func:`slots_held` of the table :func:`build` gives (arguments hashable)."""
  return slots_held(build(name, num_stages, num_microbatches, dict(costs), num_repeats, delays))


def candidates(name: str, num_stages: int):
  """The settings :func:`build` tries, as :func:`pack` keywords (second forwards and the light
  ramp for the V placement only; weight holds of 0 and V - 1 ticks, V the model's chunks, for
  a split backward). Every cap is set by S, yet under the loosest a table leaves more ``W``
  waiting as M grows (they fill the cool-down): :func:`build` bounds the slots of longer tables
  (:data:`REFERENCE_MICROBATCHES`)."""
  placement, split = SHAPES[name]
  extra = sorted({0, 2, max(1, num_stages // 2), num_stages})
  backlog = sorted({1, 4, 2 * num_stages}) if split else [0]
  v_only = (False, True) if placement == "v" else (False,)
  out = [dict(in_flight=e, weight_backlog=b, deeper_first=d, backward_first=f, second_forward=x,
              light_ramp=r)
         for e, b, d, f, x, r in itertools.product(extra, backlog, (True, False), (True, False),
                                                   v_only, v_only)]
  if split:  # W held for 0 or V - 1 ticks after the ramp (V: chunks of the model).
    chunks = num_stages * (2 if placement == "v" else 1)
    out += [dict(in_flight=e, weight_backlog=2 * chunks + h, deeper_first=d, backward_first=f,
                 second_forward=x, light_ramp=r, weight_hold=h)
            for h, e, d, f, x, r in itertools.product(
                (0, chunks - 1), (chunks, 2 * chunks), (True, False), (True, False), v_only,
                v_only)]
  return out


def build(name: str, num_stages: int, num_microbatches: int, costs: Mapping[str, float],
          num_repeats: int | None = None, delays=None) -> fused_lib.FusedSchedule:
  """The table of fused schedule ``name`` with the shortest neighbour-synchronised step under
  ``costs``, from :func:`pack` with each of :func:`candidates` (for the V, the fastest of them
  again with each smaller weight backlog down to the next one tried) and the one-action-per-tick
  table, and (split backward) the :data:`SETTLED` fastest distinct of them again with their
  weights settled (:func:`~tpipe.schedules.weight_settling.settle_weights`, with up to
  :data:`WEIGHT_SLOTS` S awaiting ``W`` where the table held fewer), and for a loop (ZB-H1)
  whose shortest table so far is longer than the natural step, that table with its weights
  placed (:func:`~tpipe.schedules.weight_settling.place_weights`) where that shortens its step
  by more than :data:`TOLERANCE`; beyond M = 2 S (a V) or 4 S
  (a loop), only tables holding no more slots than the table there (:func:`slots_held`,
  :data:`REFERENCE_MICROBATCHES`), so memory stays flat in M; among the tables within
  :data:`TOLERANCE` of the shortest step and :data:`BUBBLE_TOLERANCE` of its bubble, the one
  with the fewest weight slots (micro-batches awaiting ``W``), then the fewest micro-batch
  chunks in flight, then the fewest ticks.

  Args:
    name: ``"1f1b"``, ``"interleaved_1f1b"``, ``"zb_h1"`` or ``"zbv"``.
    num_stages: S.
    num_microbatches: M.
    costs: per-action costs of one chunk (:func:`~tpipe.schedules.actions.check_costs`).
    num_repeats: chunks per stage (None: the schedule's own; required for
      ``"interleaved_1f1b"``).
    delays: per link, 0 or 1 extra tick.
  """
  placement, split = SHAPES[name]
  costs = actions_lib.check_costs(costs, split)
  chunks = num_repeats or (2 if placement == "v" else 1)
  if name == "interleaved_1f1b":
    plain = orders_lib.interleaved_1f1b(num_stages, num_microbatches, chunks, delays)
  else:
    plain = {"1f1b": orders_lib.one_f_one_b, "zb_h1": orders_lib.zb_h1,
             "zbv": orders_lib.zbv}[name](num_stages, num_microbatches, delays)
  tried = candidates(name, num_stages)
  packings = _Packings(name, (num_stages, num_microbatches, chunks), costs, delays)
  made = [packings(**settings) for settings in tried]
  tables, steps = [table for table, _ in made], [step for _, step in made]
  if placement == "v":
    # The W a V's stages leave waiting fill its cool-down: the fastest settings again with each
    # smaller weight backlog down to the next one tried, so memory can win among equals below.
    fastest = tried[int(np.argmin(steps))]
    lower = max((s["weight_backlog"] for s in tried
                 if s["weight_backlog"] < fastest["weight_backlog"]), default=0)
    for backlog in range(lower + 1, fastest["weight_backlog"]):
      table, step = packings(**dict(fastest, weight_backlog=backlog))
      tables.append(table)
      steps.append(step)
  plain_timing = plain.simulate(costs)
  tables.insert(0, plain)
  steps.insert(0, round(plain_timing.neighbour, 9))
  if split:  # The fastest distinct tables again with their W settled.
    distinct, seen = {}, set()
    for i in sorted(range(len(tables)), key=lambda i: (steps[i], i)):
      if id(tables[i]) not in seen:  # One packing tried under several settings is one table.
        seen.add(id(tables[i]))
        distinct.setdefault(tuple(tables[i].actions()), i)
    fastest = list(distinct.values())[:SETTLED[placement]]
    settled = [weight_settling.settle_weights(tables[i], costs, WEIGHT_SLOTS * num_stages)
               for i in fastest]
    tables += settled
    steps += [round(table.simulate(costs).neighbour, 9) for table in settled]
    best = int(np.argmin(steps))
    if placement == "loop" and steps[best] > plain_timing.natural * (1 + 1e-9):
      # Longer than the natural step: the W of the shortest placed all at once, kept where that
      # gains more than the step's TOLERANCE (less may cost memory: two W in one tick).
      placed = weight_settling.place_weights(tables[best], costs)
      step = round(placed.simulate(costs).neighbour, 9)
      if step < steps[best] * (1 - TOLERANCE):
        tables.append(placed)
        steps.append(step)

  reference = REFERENCE_MICROBATCHES[placement]
  if num_microbatches > reference * num_stages:
    # Memory flat in M: no more slots than the table at M = 2 S (a V) or 4 S holds (the
    # one-action table, whose slots do not change with M, is kept whatever it holds).
    bound = _slots_at(name, num_stages, reference * num_stages, tuple(sorted(costs.items())),
                      num_repeats, actions_lib.link_delays(delays, num_stages))
    keep = [i for i, table in enumerate(tables)
            if i == 0 or all(n <= b for n, b in zip(slots_held(table), bound))]
    tables, steps = [tables[i] for i in keep], [steps[i] for i in keep]

  # Weight slots hold whole activations (a micro-batch awaiting W keeps its operations' inputs
  # and output gradients): among tables within 1% of the shortest step and 5% of its bubble,
  # the fewest of them, then the fewest micro-batch chunks in flight, then the fewest ticks.
  shortest = min(steps)
  work = float(plain_timing.busy.max())  # A stage's work: the same in every table.
  limit = shortest + min(TOLERANCE * shortest, BUBBLE_TOLERANCE * (shortest - work))
  near = [(int(table.awaiting_weight().max()), int(table.peak_in_flight().max()),
           table.num_ticks, step, i) for i, (table, step) in enumerate(zip(tables, steps))
          if step <= limit + 1e-9 * shortest]
  return tables[min(near)[-1]]
