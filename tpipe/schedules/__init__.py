"""Pipeline schedules as data: what each stage does at each clock tick (pure NumPy).

* :mod:`~tpipe.schedules.forward`: forward schedules (:class:`Schedule`: ``"gpipe"``,
  ``"circular"``), whose backward autodiff derives.
* :mod:`~tpipe.schedules.actions`: what a stage can do in a tick of a fused schedule, where model
  chunks live (placements) and what each action waits for.
* :mod:`~tpipe.schedules.fused`: fused schedules (:class:`FusedSchedule`): forward and backward
  interleaved in one validated table, with derived message routing.
* :mod:`~tpipe.schedules.orders`: the named fused schedules (1F1B, interleaved 1F1B, ZB-H1,
  ZB-V) as per-stage action orders.
* :mod:`~tpipe.schedules.compound`: the same schedules in compound ticks (a forward, a backward
  and weight work in one tick) for per-action costs, so ticks cost the same on every stage.

The exact search for a shorter neighbour-synchronised step by a mixed-integer program (research,
seconds to minutes) is :mod:`tpipe.experimental.refine`; :func:`build` runs it when given it.
* :mod:`~tpipe.schedules.streaming`: how micro-batch inputs reach stage 0 one per tick from the
  stages that hold them (the conveyor table).
* :mod:`~tpipe.schedules.simulate`: step time under per-action costs (lockstep,
  neighbour-synchronised and natural), the chain of ticks that sets the step, and how much each
  tick could grow without lengthening it (slack).

:func:`build` is the one factory of tables by name; it caches them (tables are read-only).

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

import numpy as np

from tpipe.schedules.actions import Action
from tpipe.schedules.actions import DEFAULT_COSTS
from tpipe.schedules.actions import PLACEMENTS  # noqa: F401 (internal)
from tpipe.schedules.actions import link_delays  # noqa: F401 (internal)
from tpipe.schedules.actions import virtual_stages  # noqa: F401 (internal)
from tpipe.schedules.forward import IDLE
from tpipe.schedules.forward import Schedule
from tpipe.schedules.forward import circular
from tpipe.schedules.forward import gpipe
from tpipe.schedules.fused import FusedSchedule
from tpipe.schedules.fused import from_forward
from tpipe.schedules.fused import from_ticks  # noqa: F401 (internal)
from tpipe.schedules.fused import place  # noqa: F401 (internal)
from tpipe.schedules.fused import whole_step
from tpipe.schedules.orders import interleaved_1f1b
from tpipe.schedules.orders import one_f_one_b
from tpipe.schedules.orders import zb_h1
from tpipe.schedules.orders import zbv
from tpipe.schedules.simulate import Timing
from tpipe.schedules.simulate import action_costs  # noqa: F401 (internal)
from tpipe.schedules.simulate import critical_path  # noqa: F401 (internal)
from tpipe.schedules.simulate import exchange_partners  # noqa: F401 (internal)
from tpipe.schedules.simulate import linked_time  # noqa: F401 (internal)
from tpipe.schedules.simulate import neighbour_time  # noqa: F401 (internal)
from tpipe.schedules.simulate import ring_links  # noqa: F401 (internal)
from tpipe.schedules.simulate import simulate
from tpipe.schedules.simulate import tick_slack  # noqa: F401 (internal)
from tpipe.schedules.simulate import tick_starts  # noqa: F401 (internal)
from tpipe.schedules.streaming import InputStream  # noqa: F401 (internal)
from tpipe.schedules.streaming import first_stage_reads  # noqa: F401 (internal)
from tpipe.schedules.streaming import input_stream  # noqa: F401 (internal)
from tpipe.schedules.streaming import lane_reads  # noqa: F401 (internal)
from tpipe.schedules import compound as _compound
from tpipe.schedules import forward as _forward
from tpipe.schedules import orders as _orders

# Forward schedules (backward by autodiff through the tick loop).
SCHEDULE_NAMES = _forward.NAMES
# Fused schedules (forward and backward in one table).
FUSED_SCHEDULE_NAMES = _orders.NAMES
NAMES = SCHEDULE_NAMES + FUSED_SCHEDULE_NAMES
# Chunks per stage each fused schedule runs; None: two or more, as num_repeats says.
_FUSED_CHUNKS = {"1f1b": 1, "zb_h1": 1, "zbv": 2, "interleaved_1f1b": None}
_FUSED_BUILDERS = {"1f1b": one_f_one_b, "zb_h1": zb_h1, "zbv": zbv}

# What a user builds or reads: the schedules, their tables and actions, and the analyses a user
# calls. The simulator's and the executor's helpers (tick_slack, ring_links, input_stream, ...)
# stay importable here for tpipe's own layers, from their modules for everyone else.
__all__ = [
    "Action", "DEFAULT_COSTS", "FUSED_SCHEDULE_NAMES", "FusedSchedule", "IDLE", "NAMES",
    "SCHEDULE_NAMES", "Schedule", "Timing", "build", "circular", "from_forward", "gpipe",
    "interleaved_1f1b", "is_fused", "make_fused_schedule", "make_schedule", "one_f_one_b",
    "placement", "simulate", "whole_step", "zb_h1", "zbv",
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
      costs > 0 (:func:`tpipe.schedules.compound.check_costs`).
  """
  if costs is None:
    return None
  if isinstance(costs, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in costs):
    costs = dict(costs)
  return tuple(sorted(_compound.check_costs(costs).items()))


def check_search(search, costs) -> int:
  """``search`` (sweeps of an exact window search such as :func:`tpipe.experimental.refine.refine`
  over a compound table) as an int >= 0.

  Raises:
    TypeError: not an int.
    ValueError: negative, or > 0 without costs (the search minimises the step under them).
  """
  if isinstance(search, bool) or not isinstance(search, (int, np.integer)):
    raise TypeError(f"search (tick_search) must be an int >= 0, sweeps of exact window search; "
                    f"got {search!r}.")
  if search < 0:
    raise ValueError(f"search (tick_search) must be >= 0 sweeps, got {search}.")
  if search and costs is None:
    raise ValueError(f"search={search} re-places a compound table's actions for a shorter step "
                     "under its per-action costs; pass costs (tick_costs) too, or search=0.")
  return int(search)


def _check_name(name) -> None:
  if not isinstance(name, str) or name not in NAMES:
    raise ValueError(f"Unknown schedule {name!r}; choose one of {SCHEDULE_NAMES} (forward) or "
                     f"{FUSED_SCHEDULE_NAMES} (fused).")


def build(name: str, num_stages: int, num_microbatches: int,
          num_repeats: int = 1, delays=None, costs=None, search: int = 0, refine=None
          ) -> Schedule | FusedSchedule:
  """The table of schedule ``name``, cached: the one factory every caller uses.

  Args:
    name: one of :data:`NAMES`.
    num_stages: S.
    num_microbatches: M.
    num_repeats: chunks per stage R: 1 for ``"gpipe"``, ``"1f1b"`` and ``"zb_h1"``; 2 for
      ``"zbv"``; any for ``"circular"``; at least 2 for ``"interleaved_1f1b"``.
    delays: per link of the ring of stages, 0 or 1 extra tick a transfer takes (None or 0:
      none; 1: every link; see :func:`tpipe.schedules.actions.link_delays`). A delayed transfer
      overlaps a whole tick of compute, for links over a slow network (between TPU slices).
    costs: fused schedules only: per-action costs of one chunk (``{"F": .., "B": ..}``, with
      ``"BI"`` and ``"W"`` for the zero-bubble schedules): the table in compound ticks with
      the shortest neighbour-synchronised step under them (:func:`tpipe.schedules.compound.build`);
      None: one action per tick, the papers' tables.
    search: with ``costs``: sweeps of exact window search over that table, which can shorten
      its neighbour-synchronised step where no rule of the builder's finds the table (seconds
      to minutes at S = 8); 0: none.
    refine: with ``search``: the search, ``refine(table, costs, sweeps=search) -> table``
      (:func:`tpipe.experimental.refine.refine`; passed in, so this package does not depend on
      the experimental one).

  Returns:
    A :class:`Schedule` (forward schedules) or a :class:`FusedSchedule`, read-only.

  Raises:
    TypeError, ValueError: an unknown name or a count the schedule does not take; the message
      names the fix.
  """
  # Checked before the cache: 2.0 == 2 and True == 1 hash alike, so a cache keyed on the values
  # alone would hand them the int's table. One key however the arguments are written.
  _check_name(name)
  for count_name, count in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                            ("num_repeats", num_repeats)):
    _forward.check_count(count_name, count)
  delays = link_delays(delays, num_stages)
  costs = check_costs(costs)
  if costs is not None and name in SCHEDULE_NAMES:
    raise ValueError(f"costs lay fused schedules out in compound ticks; schedule={name!r} is a "
                     "forward schedule (its ticks cost the same already): pass costs=None.")
  search = check_search(search, costs)
  if search and not callable(refine):
    raise ValueError(f"search={search} needs the search itself: pass "
                     "refine=tpipe.experimental.refine.refine.")
  return _build(name, num_stages, num_microbatches, num_repeats, delays, costs,
                (search, refine) if search else (0, None))


@functools.lru_cache(maxsize=None)
def _build(name, num_stages, num_microbatches, num_repeats, delays, costs=None,
           search=(0, None)):
  _check_name(name)
  if name == "gpipe":
    if num_repeats != 1:
      raise ValueError(f"schedule='gpipe' runs one chunk per stage, got num_repeats={num_repeats}; "
                       "use schedule='circular' for num_repeats > 1.")
    table = gpipe(num_stages, num_microbatches, delays)
  elif name == "circular":
    table = circular(num_stages, num_microbatches, num_repeats, delays)
  elif name == "interleaved_1f1b":
    table = interleaved_1f1b(num_stages, num_microbatches, num_repeats, delays)
  else:
    chunks = _FUSED_CHUNKS[name]
    if num_repeats != chunks:
      fix = ("pass num_repeats=2" if name == "zbv" else
             "use schedule='interleaved_1f1b' for more")
      raise ValueError(f"schedule={name!r} runs {chunks} chunk(s) per stage, got "
                       f"num_repeats={num_repeats}; {fix}.")
    table = _FUSED_BUILDERS[name](num_stages, num_microbatches, delays)
  if costs is not None:
    table = _compound.build(name, num_stages, num_microbatches, dict(costs), num_repeats, delays)
  sweeps, refine = search
  if sweeps:
    table = refine(table, dict(costs), sweeps=sweeps)
  return table


def make_schedule(name: str, num_stages: int, num_microbatches: int,
                  num_repeats: int = 1, delays=None) -> Schedule:
  """A forward schedule by name (:data:`SCHEDULE_NAMES`); see :func:`build`.

  Raises:
    ValueError: for a fused or unknown name, or counts the schedule does not take.
  """
  if name in FUSED_SCHEDULE_NAMES:
    raise ValueError(f"schedule={name!r} is a fused schedule; build its table with "
                     f"make_fused_schedule() (make_schedule builds {SCHEDULE_NAMES}).")
  return build(name, num_stages, num_microbatches, num_repeats, delays)


def make_fused_schedule(name: str, num_stages: int, num_microbatches: int,
                        num_repeats: int | None = None, delays=None,
                        costs=None, search: int = 0, refine=None) -> FusedSchedule:
  """A fused schedule by name (:data:`FUSED_SCHEDULE_NAMES`); see :func:`build`.

  Args:
    name: the schedule.
    num_stages: S.
    num_microbatches: M.
    num_repeats: chunks per stage; None for the schedule's own (1, or 2 for ``"zbv"``);
      required (at least 2) for ``"interleaved_1f1b"``.
    delays: per link, 0 or 1 extra tick; see :func:`build`.
    costs: per-action costs of one chunk (``{"F", "B", "BI", "W"}``): the table in compound
      ticks built for them; None: one action per tick. See :func:`build`.
    search: with ``costs``: sweeps of exact window search over the table; see :func:`build`.
    refine: with ``search``: the search; see :func:`build`.

  Raises:
    ValueError: for a forward or unknown name, or a chunk count the schedule does not use.
  """
  if name in SCHEDULE_NAMES:
    raise ValueError(f"schedule={name!r} is a forward schedule: build it with make_schedule(), "
                     "and its whole step as a fused table with from_forward().")
  _check_name(name)
  if num_repeats is None:
    num_repeats = _FUSED_CHUNKS[name]
    if num_repeats is None:
      raise ValueError("schedule='interleaved_1f1b' needs num_repeats >= 2 chunks per stage; "
                       "use schedule='1f1b' for one.")
  return build(name, num_stages, num_microbatches, num_repeats, delays, costs, search, refine)
