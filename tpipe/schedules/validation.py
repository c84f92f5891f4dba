"""Checks of a fused schedule's tables and the routing derived from them.

:class:`tpipe.schedules.FusedSchedule` calls :func:`validate` and :func:`route` on construction:
entries in range, one forward and one backward per (micro-batch, chunk) of every stage, every
action after what it needs (an earlier tick for a message, an earlier row for the stage's own
stash), stash slots never reused while live; then the send and receive tables and each
message's mailbox slot, one message each way per stage and tick. Pure NumPy.
"""

from __future__ import annotations

import numpy as np

from tpipe.schedules import actions as actions_lib
from tpipe.schedules import forward as forward_lib

Action = actions_lib.Action
IDLE = forward_lib.IDLE


def validate(schedule) -> dict:
  """Checks a fused schedule's tables; returns each action's row keyed like
  :func:`~tpipe.schedules.actions.dependencies`."""
  _check_entries(schedule)
  ticks, slots = _action_ticks(schedule)
  events = _events(schedule, ticks, slots)
  _check_dependencies(schedule, events)
  if not schedule.forward_only:
    _check_stash(schedule, events, slots)
  return events


def _check_entries(schedule) -> None:
  """Table shapes, action codes, and indices in range (IDLE exactly where the stage idles)."""
  num_stages, num_micro, num_chunks = (schedule.num_stages, schedule.num_microbatches,
                                       schedule.num_chunks)
  for name, value in (("num_stages", num_stages), ("num_microbatches", num_micro),
                      ("num_chunks", num_chunks)):
    forward_lib.check_count(name, value)
  actions_lib.virtual_stages(schedule.placement, num_stages, num_chunks)  # Raises if unknown.
  act, mb, ch, slot = schedule.action, schedule.microbatch, schedule.chunk, schedule.stash_slot
  for name, table in (("microbatch", mb), ("chunk", ch), ("stash_slot", slot)):
    if table.shape != act.shape:
      raise ValueError(f"{name} table has shape {table.shape}, action table {act.shape}.")
  if act.ndim != 2 or act.shape[1] != num_stages:
    raise ValueError(f"tables must be [ticks, {num_stages}], got {act.shape}.")
  idle = act == IDLE
  if not np.all(idle | np.isin(act, list(Action))):
    raise ValueError(f"action table has codes other than IDLE and {[int(a) for a in Action]}.")
  if schedule.forward_only:
    if np.any(~idle & (act != Action.F)):
      raise ValueError("a forward-only table runs only F actions.")
    if np.any(slot != IDLE):
      raise ValueError("a forward-only table stashes nothing: stash_slot must be IDLE.")
  checked = (("microbatch", mb, num_micro), ("chunk", ch, num_chunks))
  if not schedule.forward_only:
    checked += (("stash_slot", slot, None),)
  for name, table, bound in checked:
    if np.any(table[idle] != IDLE):
      t, s = np.argwhere(idle & (table != IDLE))[0]
      raise ValueError(f"tick {t}, stage {s}: idle slot with a {name} index.")
    bad = ~idle & ((table < 0) | ((table >= bound) if bound else False))
    if np.any(bad):
      t, s = np.argwhere(bad)[0]
      raise ValueError(f"tick {t}, stage {s}: {name} {table[t, s]} out of range.")


def _action_ticks(schedule) -> tuple[dict, dict]:
  """The tick and stash slot of every (action, micro-batch, model chunk); each must be unique."""
  vstage = schedule.virtual_stage
  ticks, slots = {}, {}
  for t, s in zip(*np.nonzero(schedule.busy)):
    kind, m = actions_lib.ACTION_OF[schedule.action[t, s]], int(schedule.microbatch[t, s])
    c = int(schedule.chunk[t, s])
    key = (kind, m, int(vstage[s, c]))
    if key in ticks:
      raise ValueError(f"stage {s} runs {kind.name} of micro-batch {m}, chunk {c} twice "
                       f"(ticks {ticks[key]} and {t}).")
    ticks[key] = int(t)
    slots[key] = int(schedule.stash_slot[t, s])
  return ticks, slots


def _events(schedule, ticks: dict, slots: dict) -> dict:
  """Every (micro-batch, chunk) of every stage has one F and one backward (B, or BI and W) that
  read the forward's stash slot; returns the ticks keyed ``("F" | "back" | "W", m, v)``."""
  events = {}
  vstage = schedule.virtual_stage
  for s in range(schedule.num_stages):
    for c in range(schedule.num_chunks):
      v = int(vstage[s, c])
      for m in range(schedule.num_microbatches):
        where = f"stage {s}, micro-batch {m}, chunk {c}"
        have = {a: ticks.get((a, m, v)) for a in Action}
        if have[Action.F] is None:
          raise ValueError(f"{where}: no forward.")
        events[("F", m, v)] = have[Action.F]
        if schedule.forward_only:
          continue
        split = have[Action.BI] is not None or have[Action.W] is not None
        if split and have[Action.B] is not None:
          raise ValueError(f"{where}: both a full backward B and a split backward BI/W.")
        if split and (have[Action.BI] is None or have[Action.W] is None):
          raise ValueError(f"{where}: a split backward needs both BI and W.")
        if not split and have[Action.B] is None:
          raise ValueError(f"{where}: no backward.")
        back = Action.BI if split else Action.B
        events[("back", m, v)] = have[back]
        if split:
          events[("W", m, v)] = have[Action.W]
        for a in (back, Action.W) if split else (back,):
          if slots[(a, m, v)] != slots[(Action.F, m, v)]:
            raise ValueError(f"{where}: {a.name} reads stash slot {slots[(a, m, v)]} but the "
                             f"forward wrote slot {slots[(Action.F, m, v)]}.")
  return events


def _check_dependencies(schedule, events: dict) -> None:
  """Every action runs after the actions it needs: at a later tick when their result is a
  message (two ticks later across a delayed link), at a later row when it is the stage's own
  stash (the same model chunk)."""
  num_virtual = schedule.num_stages * schedule.num_chunks
  stage_of, chunk_of = actions_lib.placement_of(schedule.virtual_stage)
  hops, tick = schedule.hop_delays, schedule.tick
  for (name, m, v), row in events.items():
    kind = {"F": Action.F, "back": Action.B, "W": Action.W}[name]
    for dep in actions_lib.dependencies(kind, m, v, num_virtual):
      if dep[2] == v:  # The stage's own stash: any earlier row.
        late = events[dep] >= row
      else:
        late = tick[events[dep]] + int(hops[min(dep[2], v)]) >= tick[row]
      if late:
        s, c, ds, dc = stage_of[v], chunk_of[v], stage_of[dep[2]], chunk_of[dep[2]]
        what = "BI/B" if name == "back" else name
        dwhat = "BI/B" if dep[0] == "back" else dep[0]
        delay = 0 if dep[2] == v else int(hops[min(dep[2], v)])
        earlier = ("an earlier row" if dep[2] == v else "an earlier tick" if not delay
                   else f"tick {tick[row] - 2} or earlier (delayed link)")
        raise ValueError(f"tick {tick[row]}, stage {s}: {what} of micro-batch {m}, chunk {c} "
                         f"needs {dwhat} of chunk {dc} on stage {ds} done at {earlier}, but it "
                         f"runs at tick {tick[events[dep]]} (row {events[dep]}, this one row "
                         f"{row}).")


def check_ticks(tick, num_rows: int) -> np.ndarray:
  """``tick`` as int32 ``[R]``: rows grouped into consecutive ticks numbered from 0."""
  if tick is None:
    return np.arange(num_rows, dtype=np.int32)
  tick = np.asarray(tick)
  if tick.shape != (num_rows,) or not np.issubdtype(tick.dtype, np.integer):
    raise ValueError(f"tick must give one integer tick per row ({num_rows}), got "
                     f"{tick.dtype} {tick.shape}.")
  steps = np.diff(tick)
  if num_rows and (tick[0] != 0 or np.any((steps != 0) & (steps != 1))):
    raise ValueError("tick must number rows' ticks from 0 in order, each row in the tick of the "
                     f"row before or the next one; got {tick.tolist()}.")
  return tick.astype(np.int32)


def _check_stash(schedule, events: dict, slots: dict) -> None:
  """Stash slots are numbered below the stage's peak, and none is reused while live."""
  stage_of, chunk_of = actions_lib.placement_of(schedule.virtual_stage)
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


def route(schedule, events: dict):
  """Derives the send/receive tables and assigns each message a slot in its receiver's mailbox.

  A message sent in tick ``t`` arrives at the first row of tick ``t + 1`` (``t + 2`` over a
  delayed link) and holds its mailbox slot until the row that reads it.
  """
  num_stages, num_virtual = schedule.num_stages, schedule.num_stages * schedule.num_chunks
  stage_of, _ = actions_lib.placement_of(schedule.virtual_stage)
  links = actions_lib.link_directions(schedule.placement, num_stages, schedule.num_chunks)
  if np.any((stage_of[:-1] + links) % num_stages != stage_of[1:]):
    raise ValueError(f"placement {schedule.placement!r} needs hops beyond a neighbour.")
  hops, tick, first = schedule.hop_delays, schedule.tick, schedule.first_rows()
  messages = []  # (arrival row, read row, send row, sender, receiver, direction)
  for (name, m, v), r in events.items():
    if name == "F" and v < num_virtual - 1:
      to, direction, hop = v + 1, links[v], hops[v]
    elif name == "back" and v > 0:
      to, direction, hop = v - 1, -links[v - 1], hops[v - 1]
    else:
      continue
    key = ("F" if name == "F" else "back", m, to)
    messages.append((int(first[tick[r] + 1 + hop]), events[key], r, stage_of[v], stage_of[to],
                     direction))
  shape = schedule.action.shape
  send_dir = np.zeros(shape, np.int32)
  send_slot, recv_slot = np.full(shape, IDLE, np.int32), np.full(shape, IDLE, np.int32)
  arrival = np.full(shape + (3,), IDLE, np.int32)
  origin = {d: k for k, d in enumerate(actions_lib.ARRIVAL_DIRECTIONS)}
  sent_in = {}  # (tick, sender, direction) -> row: one message each way per tick.
  free_at = [[] for _ in range(num_stages)]  # per receiver: row each slot is free from.
  for arrive, read, sent, src, dst, direction in sorted(messages):
    way = (int(tick[sent]), int(src), int(direction))
    if way in sent_in:
      side = {1: "right", -1: "left", 0: "to itself"}[int(direction)]
      raise ValueError(f"tick {way[0]}, stage {src}: two messages sent {side} (rows "
                       f"{sent_in[way]} and {sent}); a stage sends at most one each way per "
                       "tick.")
    sent_in[way] = sent
    slots = free_at[dst]
    k = next((i for i, free in enumerate(slots) if free <= arrive), len(slots))
    if k == len(slots):
      slots.append(0)
    slots[k] = read + 1
    send_dir[sent, src], send_slot[sent, src] = direction, k
    recv_slot[read, dst] = k
    arrival[arrive, dst, origin[int(direction)]] = k
  return send_dir, send_slot, recv_slot, arrival
