"""Pipeline schedules as data: what each stage does at each clock tick (pure NumPy).

* :mod:`~tpipe.schedules.forward`: forward schedules (:class:`Schedule`: ``"gpipe"``,
  ``"circular"``), whose backward autodiff derives.
* :mod:`~tpipe.schedules.actions`: what a stage can do in a tick of a fused schedule, what each
  costs (checked), where model chunks live (placements) and what each action waits for.
* :mod:`~tpipe.schedules.fused`: fused schedules (:class:`FusedSchedule`): forward and backward
  interleaved in one validated table, with derived message routing.
* :mod:`~tpipe.schedules.orders`: the named fused schedules (1F1B, interleaved 1F1B, ZB-H1,
  ZB-V) as per-stage action orders.
* :mod:`~tpipe.schedules.compound`: the same schedules in compound ticks (a forward, a backward
  and weight work in one tick) for per-action costs, so ticks cost the same on every stage.
* :mod:`~tpipe.schedules.weight_settling`: a split backward's ``W`` moved, after packing, where
  they cost the step nothing.
* :mod:`~tpipe.schedules.streaming`: how micro-batch inputs reach stage 0 one per tick from the
  stages that hold them (the conveyor table).
* :mod:`~tpipe.schedules.simulate`: step time under per-action costs (lockstep,
  neighbour-synchronised and natural), the chain of ticks that sets the step, and how much each
  tick could grow without lengthening it (slack).

:func:`build` is the one way to make a table by name: it validates the arguments and caches the
table (tables are read-only). The builders in the modules above are what it calls. The exact
search for a shorter neighbour-synchronised step (research, seconds to minutes) re-places a
built table's actions: :mod:`tpipe.experimental.refine`.

Example::

  >>> from tpipe import schedules
  >>> s = schedules.build("gpipe", num_stages=2, num_microbatches=3)
  >>> s.microbatch.tolist()
  [[0, -1], [1, 0], [2, 1], [-1, 2]]
  >>> f = schedules.build("1f1b", num_stages=2, num_microbatches=3)
  >>> print(f.describe())
  stage 0: F0 F1  . B0 F2 B1  . B2
  stage 1:  . F0 B0 F1 B1 F2 B2  .
"""

from __future__ import annotations

import functools

from tpipe.schedules import actions as _actions
from tpipe.schedules import compound as _compound
from tpipe.schedules import forward as _forward
from tpipe.schedules import orders as _orders
from tpipe.schedules.actions import Action
from tpipe.schedules.actions import DEFAULT_COSTS
from tpipe.schedules.forward import IDLE
from tpipe.schedules.forward import Schedule
from tpipe.schedules.fused import FusedSchedule
from tpipe.schedules.fused import whole_step
from tpipe.schedules.simulate import Timing

# Forward schedules (backward by autodiff through the tick loop).
SCHEDULE_NAMES = _forward.NAMES
# Fused schedules (forward and backward in one table).
FUSED_SCHEDULE_NAMES = _orders.NAMES
NAMES = SCHEDULE_NAMES + FUSED_SCHEDULE_NAMES
# Chunks per stage each schedule runs when build is not told; None: the caller must say (two or
# more for interleaved 1F1B).
_OWN_CHUNKS = {"gpipe": 1, "circular": 1, "1f1b": 1, "zb_h1": 1, "zbv": 2,
               "interleaved_1f1b": None}
_FUSED_BUILDERS = {"1f1b": _orders.one_f_one_b, "zb_h1": _orders.zb_h1, "zbv": _orders.zbv}

# What a user builds or reads: the one factory, the names it takes, the tables and their
# actions, and a step's timing. Helpers of tpipe's own layers are imported from their modules.
__all__ = [
    "Action",
    "DEFAULT_COSTS",
    "FUSED_SCHEDULE_NAMES",
    "FusedSchedule",
    "IDLE",
    "NAMES",
    "SCHEDULE_NAMES",
    "Schedule",
    "Timing",
    "build",
    "is_fused",
    "placement",
    "whole_step",
]


def is_fused(name: str) -> bool:
  """Whether ``name`` is a fused schedule; raises ValueError for an unknown name."""
  _check_name(name)
  return name in FUSED_SCHEDULE_NAMES


def placement(name: str) -> str:
  """Where the schedule puts model chunks: ``"v"`` for ZB-V, ``"loop"`` for every other."""
  _check_name(name)
  return "v" if name == "zbv" else "loop"


def check_costs(costs) -> tuple[tuple[str, float], ...] | None:
  """Per-action costs for compound ticks as a sorted tuple of ``(action, cost)`` pairs (how
  :func:`build` caches them and :class:`tpipe.PipelineSpec` holds them), None for None.

  Raises:
    TypeError, ValueError: not a mapping of ``"F"``, ``"B"``, ``"BI"``, ``"W"`` to finite
      costs > 0 (:func:`tpipe.schedules.actions.check_costs`).
  """
  if costs is None:
    return None
  if isinstance(costs, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in costs):
    costs = dict(costs)
  return tuple(sorted(_actions.check_costs(costs).items()))


def _check_name(name) -> None:
  if not isinstance(name, str) or name not in NAMES:
    raise ValueError(f"Unknown schedule {name!r}; choose one of {SCHEDULE_NAMES} (forward) or "
                     f"{FUSED_SCHEDULE_NAMES} (fused).")


def build(name: str, num_stages: int, num_microbatches: int, num_repeats: int | None = None,
          delays=None, costs=None) -> Schedule | FusedSchedule:
  """The table of schedule ``name``, validated and cached: the one way to make a table.

  Args:
    name: one of :data:`NAMES`.
    num_stages: S.
    num_microbatches: M.
    num_repeats: chunks per stage R: 1 for ``"gpipe"``, ``"1f1b"`` and ``"zb_h1"``; 2 for
      ``"zbv"``; any for ``"circular"``; at least 2 for ``"interleaved_1f1b"``. None: the
      schedule's own (1, or 2 for ``"zbv"``; ``"interleaved_1f1b"`` needs it given).
    delays: per link of the ring of stages, 0 or 1 extra tick a transfer takes (None or 0:
      none; 1: every link; see :func:`tpipe.schedules.actions.link_delays`). A delayed transfer
      overlaps a whole tick of compute, for links over a slow network (between TPU slices).
    costs: fused schedules only: per-action costs of one chunk (``{"F": .., "B": ..}``, with
      ``"BI"`` and ``"W"`` for the zero-bubble schedules): the table in compound ticks with
      the shortest neighbour-synchronised step under them (:func:`tpipe.schedules.compound.build`);
      None: one action per tick, the papers' tables.

  Returns:
    A :class:`Schedule` (forward schedules) or a :class:`FusedSchedule`, read-only. A forward
    schedule's whole step as a fused table (for its simulation) is :func:`whole_step`.

  Raises:
    TypeError, ValueError: an unknown name or a count the schedule does not take; the message
      names the fix.
  """
  # Checked before the cache: 2.0 == 2 and True == 1 hash alike, so a cache keyed on the values
  # alone would hand them the int's table. One key however the arguments are written.
  _check_name(name)
  if num_repeats is None:
    num_repeats = _OWN_CHUNKS[name]
    if num_repeats is None:
      raise ValueError(f"schedule={name!r} needs num_repeats >= 2 chunks per stage; "
                       "use schedule='1f1b' for one.")
  for count_name, count in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                            ("num_repeats", num_repeats)):
    _forward.check_count(count_name, count)
  delays = _actions.link_delays(delays, num_stages)
  costs = check_costs(costs)
  if costs is not None and name in SCHEDULE_NAMES:
    raise ValueError(f"costs lay fused schedules out in compound ticks; schedule={name!r} is a "
                     "forward schedule (its ticks cost the same already): pass costs=None.")
  return _build(name, int(num_stages), int(num_microbatches), int(num_repeats), delays, costs)


@functools.lru_cache(maxsize=None)
def _build(name, num_stages, num_microbatches, num_repeats, delays, costs):
  if name == "gpipe":
    if num_repeats != 1:
      raise ValueError(f"schedule='gpipe' runs one chunk per stage, got num_repeats={num_repeats}; "
                       "use schedule='circular' for num_repeats > 1.")
    table = _forward.gpipe(num_stages, num_microbatches, delays)
  elif name == "circular":
    table = _forward.circular(num_stages, num_microbatches, num_repeats, delays)
  elif name == "interleaved_1f1b":
    table = _orders.interleaved_1f1b(num_stages, num_microbatches, num_repeats, delays)
  else:
    chunks = _OWN_CHUNKS[name]
    if num_repeats != chunks:
      fix = ("pass num_repeats=2" if name == "zbv" else
             "use schedule='interleaved_1f1b' for more")
      raise ValueError(f"schedule={name!r} runs {chunks} chunk(s) per stage, got "
                       f"num_repeats={num_repeats}; {fix}.")
    table = _FUSED_BUILDERS[name](num_stages, num_microbatches, delays)
  if costs is not None:
    table = _compound.build(name, num_stages, num_microbatches, dict(costs), num_repeats, delays)
  return table
