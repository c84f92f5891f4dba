"""What the report says about the schedule a step runs: ticks, stash, simulated step time.

:func:`schedule_json` is the schedule's part of ``report.json``, :func:`format_schedule` its
lines of ``report.md`` (:mod:`tpipe.train.cli.report`). The simulated step time is the table's under
the default per-action costs in the three time models of :mod:`tpipe.schedules.simulate`.
Imports of tpipe are deferred to the calls, like the report's own: the command line sets the
emulated device count before JAX starts.
"""

from __future__ import annotations

from typing import Any


def is_fused(schedule) -> bool:
  """Whether ``schedule`` is a fused table (forward and backward in one)."""
  from tpipe import schedules  # pylint: disable=g-import-not-at-top

  return isinstance(schedule, schedules.FusedSchedule)


def _simulated(schedule, costs=None):
  """The whole step (forward and backward) as a fused table, its :class:`Timing` under ``costs``
  and those costs (default: F = 1, B = 2, BI = W = 1)."""
  from tpipe import schedules  # pylint: disable=g-import-not-at-top

  fused = schedules.whole_step(schedule)
  costs = dict(schedules.DEFAULT_COSTS if costs is None else costs)
  return fused, fused.simulate(costs), costs


def _costs_text(costs) -> str:
  return ", ".join(f"{name} = {value:g}" for name, value in costs.items())


def gpipe_timing(schedule, costs=None):
  """GPipe's whole step on the same layers (one chunk per stage, each as costly as the
  ``num_chunks`` chunks a stage of ``schedule`` holds), the same S, M and delays, under the
  same per-action ``costs``: the baseline the report compares the step with."""
  from tpipe import schedules  # pylint: disable=g-import-not-at-top

  costs = dict(schedules.DEFAULT_COSTS if costs is None else costs)
  scaled = {name: value * schedule.num_chunks for name, value in costs.items()}
  gpipe = schedules.build("gpipe", schedule.num_stages, schedule.num_microbatches,
                          delays=schedule.delays)
  return schedules.whole_step(gpipe).simulate(scaled)


def schedule_json(schedule, costs=None) -> dict[str, Any]:
  """The schedule's part of ``report.json``: ticks, bubble, stash, simulated step time.

  ``stash_slots_per_stage`` is what the executor allocates per stage for the backward pass
  (forward schedules: one slot per forward tick, bubble ticks included; fused: the table's peak
  of micro-batches in flight); ``stashed_microbatches_per_stage`` how many hold micro-batches
  at the peak. ``simulated_step`` is the step time of the whole step under per-action ``costs``
  (the compound table's ``tick_costs``; default F = 1, B = 2, BI = W = 1 per chunk) in the
  three time models of :mod:`tpipe.schedules.simulate`: lockstep, neighbour-synchronised (the
  tick loop's constraint) and dependency-driven, with their bubbles. ``steps_per_tick`` is the
  most actions a stage runs in one tick (more than 1: compound ticks).
  """
  fused, timing, costs = _simulated(schedule, costs)
  out = {"name": schedule.name, "fused": is_fused(schedule), "num_ticks": schedule.num_ticks,
         "steps_per_tick": fused.lanes if is_fused(schedule) else 1,
         "bubble_fraction": schedule.bubble_fraction,
         "stash_slots_per_stage": int(schedule.stash_slots().max()),
         "in_flight_per_stage": [int(n) for n in fused.peak_in_flight()],
         "simulated_step": {**{f"{model}{part}": getattr(timing, f"{model}{part}")
                               for model in ("lockstep", "neighbour", "natural")
                               for part in ("", "_bubble")},
                            "costs": costs,
                            "gpipe_neighbour": gpipe_timing(schedule, costs).neighbour}}
  out["stashed_microbatches_per_stage"] = (int(fused.peak_in_flight().max()) if out["fused"]
                                           else int(schedule.stashed_microbatches().max()))
  return out


def format_schedule(schedule, costs=None) -> list[str]:
  """What the schedule keeps in flight and its simulated step time (under ``costs``, see
  :func:`schedule_json`), as markdown lines."""
  from tpipe import schedules  # pylint: disable=g-import-not-at-top

  fused, timing, costs = _simulated(schedule, costs)
  peaks = ", ".join(str(int(n)) for n in fused.peak_in_flight())
  if is_fused(schedule):
    bound = (f"bounded by S and not by M={schedule.num_microbatches}"
             if schedule.name in schedules.FUSED_SCHEDULE_NAMES else "one per micro-batch chunk")
    compound = (f", compound: up to {schedule.lanes} actions per stage in a tick"
                if schedule.is_compound else "")
    stash = (f"Fused schedule {schedule.name!r} ({schedule.num_ticks} ticks of forward and "
             f"backward{compound}): micro-batch chunks in flight per stage at most [{peaks}] "
             f"(stage 0 first), so {int(schedule.stash_slots().max())} stash slots per stage "
             f"hold stage inputs, {bound}.")
  else:
    stash = (f"Backward-pass stash per stage: {schedule.stash_slots().max()} slots (one per "
             f"forward tick), {schedule.stashed_microbatches().max()} of them holding "
             f"micro-batches (in flight per stage: [{peaks}]).")
  gpipe = gpipe_timing(schedule, costs).neighbour
  return [stash, "", f"Simulated step time ({_costs_text(costs)} per chunk and micro-batch): "
          f"neighbour-synchronised (each tick starts when the stage and its neighbours finished "
          f"the last: the tick loop's sends) {timing.neighbour:g}, bubble "
          f"{timing.neighbour_bubble:.1%}; lockstep (each tick as long as its slowest stage) "
          f"{timing.lockstep:g}, bubble {timing.lockstep_bubble:.1%}; dependency-driven "
          f"{timing.natural:g}, bubble {timing.natural_bubble:.1%}. GPipe's "
          f"neighbour-synchronised step on the same layers and costs: {gpipe:g} (this step "
          f"{timing.neighbour / gpipe:.3f}x it)."]
