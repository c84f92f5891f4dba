"""Settled weights: a split-backward table's ``W`` moved, after packing, to where they cost the
step nothing.

Where ``W`` goes sets most of what a split backward loses to neighbour synchronisation
(:mod:`tpipe.schedules.compound`). :func:`settle_weights` takes a table as packed and moves each
``W`` on the chain of ticks that sets the neighbour-synchronised step to the tick of its stage
with the most slack (:func:`tpipe.schedules.simulate.tick_slack`), which never lengthens the step
(ZB-H1, S = 8, M = 8: bubble 1.24x -> 1.12x its natural one, the optimum of an exact
placement). :func:`tpipe.schedules.compound.build` settles its fastest tables so. Pure NumPy.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from tpipe.schedules import actions as actions_lib
from tpipe.schedules import fused as fused_lib
from tpipe.schedules.simulate import ring_links
from tpipe.schedules.simulate import tick_costs
from tpipe.schedules.simulate import tick_slack

Action = actions_lib.Action


def settle_weights(table: fused_lib.FusedSchedule, costs: Mapping[str, float],
                   weight_slots: int | None = None, transfer=None) -> fused_lib.FusedSchedule:
  """``table`` with its ``W`` moved where they cost the step nothing: one at a time, from an
  entry that sets the neighbour-synchronised step (no slack) to the entry of the same stage
  with the most slack that fits it (:func:`tpipe.schedules.simulate.tick_slack`), never before
  its ``BI``, and never so late that a stage would hold more micro-batch chunks awaiting ``W``
  than ``weight_slots`` or the table's busiest stage does (nor more in flight than the table's
  peak and those extra slots); a tick after the last is free to take them. Each move leaves
  the step as long or shorter (the ``W`` fits its new entry's slack, and taking work off an
  entry lengthens nothing), so the result is never slower. Each ``W`` moves once at most (the
  costliest entries' first); it stops when no ``W`` on the chain can move.

  Args:
    table: a split-backward :class:`~tpipe.schedules.FusedSchedule` (``BI`` and ``W``).
    costs: per-action costs (:func:`~tpipe.schedules.actions.check_costs`).
    weight_slots: how many micro-batch chunks awaiting ``W`` a stage may hold where the
      table's busiest stage holds fewer (else as many as it does); None: as many as it does.
    transfer: per link (or one number): the exchange time, as in
      :func:`~tpipe.schedules.simulate.linked_time`; None: instant.
  """
  costs = actions_lib.check_costs(costs, split=True)
  num_stages, num_ticks = table.num_stages, table.num_ticks + 1
  _, chunk_of = actions_lib.placement_of(table.virtual_stage)
  ticks = [[[] for _ in range(num_stages)] for _ in range(num_ticks)]
  first, back, at = {}, {}, {}  # (s, m, c) -> the tick of its F, its BI, its W.
  for t, s, kind, m, v in table.actions():
    key = (s, m, int(chunk_of[v]))
    ticks[t][s].append((Action[kind], m, key[2]))
    {"F": first, "BI": back, "W": at}[kind][key] = t
  weights = list(at)
  held = np.zeros((num_ticks, num_stages), np.int64)  # In flight (F .. W), ticks included.
  waiting = np.zeros((num_ticks, num_stages), np.int64)  # Awaiting W (BI .. W).
  for key, t in at.items():
    held[first[key]:t + 1, key[0]] += 1
    waiting[back[key]:t + 1, key[0]] += 1
  waiting_cap = max(int(waiting.max()), weight_slots or 0)
  held_cap = held.max() + waiting_cap - waiting.max()
  cost = tick_costs(table, costs)
  cost = np.concatenate([cost, np.zeros((1, num_stages))])
  links = ring_links(num_stages, table.num_chunks > 1)
  weight, moved = costs["W"], set()
  while True:
    slack = tick_slack(cost, links, transfer, table.delays)
    on_chain = [key for key in weights  # Not moved yet, in an entry with no slack.
                if key not in moved and slack[at[key], key[0]] <= 1e-9 * weight]
    move = None
    for key in sorted(on_chain, key=lambda k: (-cost[at[k], k[0]], at[k], k)):
      s, t = key[0], at[key]
      fits = []
      for u in range(back[key], num_ticks):
        if u == t or slack[u, s] < weight * (1 - 1e-9):
          continue
        later = slice(t + 1, u + 1)  # Moved later, the chunk stays held through tick u.
        if u < t or (held[later, s].max() < held_cap and waiting[later, s].max() < waiting_cap):
          fits.append((slack[u, s], -u))
      if fits:
        move = key, t, -max(fits)[1]
        break
    if move is None:
      break
    key, t, u = move
    s, entry = key[0], (Action.W,) + key[1:]
    ticks[t][s].remove(entry)
    ticks[u][s].append(entry)
    ticks[u][s].sort(key=lambda action: action[0] == Action.W)  # W after the tick's BI.
    cost[t, s] -= weight
    cost[u, s] += weight
    step, span = (1, slice(t + 1, u + 1)) if u > t else (-1, slice(u + 1, t + 1))
    held[span, s] += step
    waiting[span, s] += step
    at[key] = u
    moved.add(key)
  while not any(ticks[-1]):
    ticks.pop()
  return fused_lib.from_ticks(table.name, num_stages, table.num_microbatches, table.num_chunks,
                              table.placement, ticks, delays=table.delays)
