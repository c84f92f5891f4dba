"""What a stage can do in one tick of a fused schedule, where model chunks live, and what each
action waits for.

The model's layers are cut into ``V = S * C`` consecutive model chunks ("virtual stages"): ``C``
per stage, placed by a **placement** (:func:`virtual_stages`). A micro-batch's forward goes
through them in order and its backward in reverse; an :class:`Action` is one of those steps for
one (micro-batch, model chunk). :func:`dependencies` says which actions must be done first.
A message between neighbouring stages crosses one **link** of the ring of stages; a link may be
**delayed** (:func:`link_delays`, :func:`hop_delays`): what is sent over it at tick ``t`` arrives
at ``t + 2`` instead of ``t + 1``, so its transfer overlaps a whole tick of compute (for links
over a slow network, such as the data-centre network between TPU slices). Pure NumPy; the tables
(:mod:`tpipe.schedules.fused`) and the simulation (:mod:`tpipe.schedules.simulate`) build on it.
"""

from __future__ import annotations

import enum
import math
from typing import Mapping

import numpy as np

PLACEMENTS = ("loop", "v")


class Action(enum.IntEnum):
  """What a stage does in one tick of a :class:`FusedSchedule` (``IDLE`` when nothing)."""

  F = 0  # forward of one chunk on one micro-batch; stashes what its backward needs.
  B = 1  # full backward: input and weight gradients; releases the stash slot.
  BI = 2  # backward-input: the input gradient, and the output gradients W will need.
  W = 3  # backward-weight: weight gradients from the slot's contents; releases the slot.


# The action of each value: ``ACTION_OF[i] is Action(i)``, by a tuple lookup (the enum's own call
# is most of a candidate table's validation and simulation time where compound.build tries
# hundreds).
ACTION_OF = tuple(Action)

DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "BI": 1.0, "W": 1.0}


def check_costs(costs, split: bool | None = None) -> dict[str, float]:
  """``costs`` as ``{action name: float}``, each finite and > 0; ``split`` (when known) says
  which actions the table runs: ``F`` and ``BI`` and ``W``, or ``F`` and ``B``.

  Raises:
    TypeError: not a mapping of action names to numbers.
    ValueError: an unknown action, a cost that is not finite and > 0, or a missing one.
  """
  if not isinstance(costs, Mapping):
    raise TypeError(f"costs must map action names {[a.name for a in Action]} to numbers, e.g. "
                    f"{{'F': 1.0, 'B': 3.0, 'BI': 2.0, 'W': 1.0}}; got {costs!r}.")
  out = {}
  for name, value in costs.items():
    if name not in Action.__members__:
      raise ValueError(f"costs has unknown action {name!r}; use {[a.name for a in Action]}.")
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
      raise TypeError(f"costs[{name!r}] must be a number, got {value!r}.")
    if not (math.isfinite(float(value)) and float(value) > 0):
      raise ValueError(f"costs[{name!r}] must be finite and > 0, got {value!r}.")
    out[name] = float(value)
  needed = ("F", "BI", "W") if split else ("F", "B") if split is not None else ()
  missing = [name for name in needed if name not in out]
  if missing:
    raise ValueError(f"costs needs {list(needed)} for this schedule; missing {missing}.")
  return out


# Arrivals at a stage, in the order of :meth:`FusedSchedule.arrival_slots`: from the left
# neighbour (it sent right), from the right neighbour (it sent left), from itself.
ARRIVAL_DIRECTIONS = (1, -1, 0)


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


def link_directions(placement: str, num_stages: int, num_chunks: int) -> np.ndarray:
  """``[V - 1]``: +1 (right), -1 (left) or 0 (same stage) for the hop from model chunk v to v+1."""
  num_virtual = num_stages * num_chunks
  if num_stages == 1:
    return np.zeros(num_virtual - 1, np.int32)
  if placement == "loop":
    return np.ones(num_virtual - 1, np.int32)  # S - 1 -> 0 between chunks: right, round the ring.
  v = np.arange(num_virtual - 1)
  return np.where(v < num_stages - 1, 1, np.where(v == num_stages - 1, 0, -1)).astype(np.int32)


# Dependency bookkeeping: ``B`` and ``BI`` both produce the input gradient ("back").
EVENT = {Action.F: "F", Action.B: "back", Action.BI: "back", Action.W: "W"}


def placement_of(vstage: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """``(stage, local chunk)`` of each model chunk, two ``[V]`` arrays."""
  stage, chunk = np.empty(vstage.size, np.int64), np.empty(vstage.size, np.int64)
  stage[vstage.ravel()] = np.repeat(np.arange(vstage.shape[0]), vstage.shape[1])
  chunk[vstage.ravel()] = np.tile(np.arange(vstage.shape[1]), vstage.shape[0])
  return stage, chunk


def dependencies(kind: Action, m: int, v: int, num_virtual: int) -> list[tuple[str, int, int]]:
  """The actions (bookkeeping keys) that must finish before ``kind`` of (m, model chunk v)."""
  if kind == Action.F:
    return [("F", m, v - 1)] if v > 0 else []
  if kind == Action.W:
    return [("back", m, v)]
  return [("F", m, v)] + ([("back", m, v + 1)] if v < num_virtual - 1 else [])


def link_delays(delays, num_stages: int) -> tuple[int, ...]:
  """``delays`` as one delay (0 or 1 tick) per link of the ring of ``num_stages`` stages.

  Link ``l`` joins stage ``l`` to stage ``(l + 1) % S``, in both directions (activations go
  right over it, gradients left); the last link, ``S - 1``, closes the ring (circular and
  interleaved schedules use it between chunks; with two stages it joins the same two devices as
  link 0, but is a separate send). A one-stage pipeline sends nothing, so it has no delay.

  Args:
    delays: None or 0 (no delay), 1 (every link), or one 0/1 per link (a sequence of length S).
    num_stages: S.

  Raises:
    TypeError, ValueError: not an int or a sequence of S ints each 0 or 1.
  """
  if delays is None:
    return (0,) * num_stages
  if isinstance(delays, (bool, np.bool_)):
    raise TypeError(f"transfer_delay must be 0, 1 or one 0/1 per link, got {delays!r}.")
  if isinstance(delays, (int, np.integer)):
    if delays not in (0, 1):
      raise ValueError(f"transfer_delay={delays}: a transfer is delayed by 0 or 1 tick (1 "
                       "overlaps it with one whole tick of compute).")
    return (int(delays) if num_stages > 1 else 0,) * num_stages
  try:
    values = tuple(delays)
  except TypeError:
    raise TypeError(f"transfer_delay must be 0, 1 or one 0/1 per link, got {delays!r}.") from None
  bad = [v for v in values if isinstance(v, (bool, np.bool_))
         or not isinstance(v, (int, np.integer)) or v not in (0, 1)]
  if len(values) != num_stages or bad:
    raise ValueError(f"transfer_delay={values!r}: give one 0 or 1 per link of the ring of "
                     f"{num_stages} stages (link l joins stage l to stage (l + 1) % "
                     f"{num_stages}), e.g. {(0,) * (num_stages - 1) + (1,)!r}.")
  if num_stages == 1 and values[0]:
    raise ValueError("transfer_delay=(1,): a one-stage pipeline sends nothing to delay; use 0.")
  return tuple(int(v) for v in values)


def link_of(sender: int, direction: int, num_stages: int) -> int:
  """The link a message from stage ``sender`` in ``direction`` (+1 right, -1 left) crosses."""
  return sender if direction == 1 else (sender - 1) % num_stages


def hop_delays(placement: str, num_stages: int, num_chunks: int, delays) -> np.ndarray:
  """``[V - 1]``: the delay of the hop between model chunks v and v + 1 (forward to v + 1,
  backward from it): its link's delay, 0 where both chunks are on the same stage."""
  delays = link_delays(delays, num_stages)
  stage_of, _ = placement_of(virtual_stages(placement, num_stages, num_chunks))
  directions = link_directions(placement, num_stages, num_chunks)
  return np.array([0 if d == 0 else delays[link_of(int(stage_of[v]), int(d), num_stages)]
                   for v, d in enumerate(directions)], np.int64)
