"""Pictures of a pipeline schedule: stages as rows, clock ticks as columns.

Each busy (tick, stage) slot is a box coloured by its micro-batch and labelled with it (``m`` for
GPipe, ``m/r`` with repeat ``r`` for the circular schedule, whose repeats are also hatched);
bubbles are left blank. The title gives the analytic bubble fraction. With ``backward=True`` the
backward ticks autodiff runs (the forward table in reverse) follow the forward ones, in lighter
boxes, as in Figure 2(c) of the GPipe paper.

A fused schedule (:class:`tpipe.schedules.FusedSchedule`: 1F1B, ZB-H1, ...) already holds its
backward: its boxes are coloured by action (forward, full backward, backward-input,
backward-weight), labelled with the micro-batch (``m/c`` with chunk ``c``, chunks also hatched),
with a legend. A compound tick (several actions of a stage in one tick,
:mod:`tpipe.schedules.compound`) splits its box into the actions, in the order the stage runs
them, inside a dark outline. Given per-action ``costs``, a fused schedule is drawn in time
instead of ticks: each stage's tick starts where the neighbour-synchronised model starts it
(:func:`tpipe.schedules.simulate.tick_starts`) and each action's box is as wide as its cost,
so the waits a tick loop pays for unequal ticks show as gaps.

matplotlib is imported only when a picture is drawn (Agg backend, no display needed)::

  from tpipe import schedules
  from tpipe.tools import timeline
  timeline.save_timeline(schedules.build("gpipe", 4, 8), "/tmp/gpipe.png", backward=True)
  timeline.save_timeline(schedules.build("zb_h1", 4, 8), "/tmp/zb_h1.png")
  costs = {"F": 1, "B": 3, "BI": 2, "W": 1}
  timeline.save_timeline(schedules.build("zbv", 4, 8, costs=costs),
                         "/tmp/zbv_compound.png", costs=costs)
"""

from __future__ import annotations

import os

import numpy as np

from tpipe import schedules as schedules_lib
from tpipe.schedules import simulate as simulate_lib

_HATCHES = ("", "///", "...", "xxx", "\\\\\\", "ooo", "---", "+++")

# Fused schedules: one colour per action, in the order of tpipe.schedules.Action.
_ACTION_COLOURS = {"F": "#4c72b0", "B": "#c44e52", "BI": "#dd8452", "W": "#55a868"}
_ACTION_LABELS = {"F": "forward", "B": "backward", "BI": "backward-input", "W": "backward-weight"}


def _pyplot():
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("tpipe.tools.timeline draws with matplotlib, which is not installed; "
                      "`pip install matplotlib` (or `pip install tpipe[train]`).") from e
  matplotlib.use("Agg", force=False)
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def _check_schedule(schedule) -> None:
  if not isinstance(schedule, (schedules_lib.Schedule, schedules_lib.FusedSchedule)):
    raise TypeError(f"Expected a tpipe.schedules.Schedule or FusedSchedule, got "
                    f"{type(schedule).__name__}; build one with tpipe.schedules.build"
                    "(name, num_stages, num_microbatches).")


def _colours(num_microbatches: int):
  plt = _pyplot()
  if num_microbatches <= 10:
    cmap = plt.get_cmap("tab10")
    return [cmap(i) for i in range(num_microbatches)]
  if num_microbatches <= 20:
    cmap = plt.get_cmap("tab20")
    return [cmap(i) for i in range(num_microbatches)]
  cmap = plt.get_cmap("turbo")
  return [cmap(0.08 + 0.84 * i / (num_microbatches - 1)) for i in range(num_microbatches)]


def title(schedule) -> str:
  """The picture's title: schedule, sizes, ticks and bubble fraction."""
  if isinstance(schedule, schedules_lib.FusedSchedule):
    repeats = f", {schedule.num_chunks} chunks/stage" if schedule.num_chunks > 1 else ""
  else:
    repeats = f", R={schedule.num_repeats}" if schedule.num_repeats > 1 else ""
  return (f"{schedule.name}: S={schedule.num_stages}, M={schedule.num_microbatches}{repeats}, "
          f"{schedule.num_ticks} ticks, bubble {schedule.bubble_fraction:.1%}")


def _new_axes(plt, ticks: int, stages: int, ax):
  """``(figure, axes, cell width)`` for a table of ``ticks`` columns and ``stages`` rows."""
  cell_w = float(np.clip(18.0 / ticks, 0.12, 0.45))
  if ax is None:
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 + cell_w * ticks), 1.3 + 0.42 * stages))
  else:
    fig = ax.figure
  return fig, ax, cell_w


def _finish_axes(ax, schedule, ticks: int, top: float) -> None:
  stages = schedule.num_stages
  ax.set_xlim(0, ticks)
  ax.set_ylim(stages, top)
  ax.set_yticks(np.arange(stages) + 0.5)
  ax.set_yticklabels([f"stage {s}" for s in range(stages)])
  step = max(1, int(np.ceil(ticks / 40)))
  ax.set_xticks(np.arange(0, ticks, step) + 0.5)
  ax.set_xticklabels([str(t) for t in range(0, ticks, step)], fontsize=7)
  ax.set_xlabel("clock tick (blank = bubble)")
  ax.set_title(title(schedule), fontsize=10)
  for spine in ("top", "right"):
    ax.spines[spine].set_visible(False)


def _fused_boxes(schedule: schedules_lib.FusedSchedule, costs):
  """``[(x, stage, width, action, micro-batch, chunk, tick)]``, and each compound (tick, stage)
  cell as ``(x, stage, width)``: in ticks (``costs`` None; a tick's actions share its column)
  or in neighbour-synchronised time (each action as wide as its cost)."""
  cost = simulate_lib.action_costs(schedule, costs) if costs else None
  if costs:
    per_tick = schedule.tick_costs(costs)
    links = simulate_lib.ring_links(schedule.num_stages, schedule.num_chunks > 1)
    starts = simulate_lib.tick_starts(per_tick, links, None, schedule.delays)
  boxes, cells = [], []
  for t in range(schedule.num_ticks):
    rows = np.nonzero(schedule.tick == t)[0]
    for s in range(schedule.num_stages):
      busy = [r for r in rows if schedule.busy[r, s]]
      x = float(starts[t, s]) if costs else float(t)
      for r in busy:
        width = float(cost[r, s]) if costs else 1.0 / len(busy)
        boxes.append((x, s, width, schedules_lib.Action(schedule.action[r, s]).name,
                      int(schedule.microbatch[r, s]), int(schedule.chunk[r, s]), t))
        x += width
      if len(busy) > 1:
        start = float(starts[t, s]) if costs else float(t)
        cells.append((start, s, x - start))
  return boxes, cells


def _draw_fused(schedule: schedules_lib.FusedSchedule, ax, costs=None):
  """A fused schedule: boxes coloured by action, hatched by chunk, labelled by micro-batch."""
  plt = _pyplot()
  from matplotlib.patches import Patch  # pylint: disable=g-import-not-at-top
  from matplotlib.patches import Rectangle  # pylint: disable=g-import-not-at-top

  boxes, cells = _fused_boxes(schedule, costs)
  span = max((x + w for x, _, w, *_ in boxes), default=1.0)
  unit = span / schedule.num_ticks if costs else 1.0  # Width of an average tick.
  stages = schedule.num_stages
  fig, ax, cell_w = _new_axes(plt, schedule.num_ticks, stages, ax)
  chunked = schedule.num_chunks > 1
  for x, s, width, action, m, c, _ in boxes:
    ax.add_patch(Rectangle((x, s), width, 1, facecolor=_ACTION_COLOURS[action],
                           edgecolor="white", linewidth=0.8,
                           hatch=_HATCHES[c % len(_HATCHES)] if chunked else None))
    if cell_w * width / unit >= 0.22:
      ax.text(x + width / 2, s + 0.5, f"{m}/{c}" if chunked else f"{m}", ha="center",
              va="center", fontsize=7 if chunked else 8, color="white")
  for x, s, width in cells:  # Compound ticks: one outline round the tick's actions.
    ax.add_patch(Rectangle((x, s + 0.04), width, 0.92, fill=False, edgecolor="black",
                           linewidth=1.1))
  _finish_axes(ax, schedule, schedule.num_ticks, top=0)
  if costs:
    ax.set_xlim(0, span)
    step = 10 ** np.floor(np.log10(max(span, 1e-12) / 4))
    ticks = np.arange(0, span + step / 2, step)
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{v:g}" for v in ticks], fontsize=7)
    shown = ", ".join(f"{k}={v:.3g}" for k, v in sorted(dict(costs).items()))
    ax.set_xlabel(f"time, neighbour-synchronised (costs {shown}; blank = waiting)")
  present = [a.name for a in schedules_lib.Action if np.any(schedule.action == a)]
  handles = [Patch(facecolor=_ACTION_COLOURS[a], label=f"{a}: {_ACTION_LABELS[a]}")
             for a in present]
  if cells:
    handles.append(Patch(facecolor="white", edgecolor="black", label="one compound tick"))
  if chunked:
    handles += [Patch(facecolor="white", edgecolor="grey", hatch=_HATCHES[c % len(_HATCHES)],
                      label=f"chunk {c}") for c in range(schedule.num_chunks)]
  ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7,
            frameon=False, title="label m/c" if chunked else "label m", title_fontsize=7)
  fig.tight_layout()
  return fig


def draw_timeline(schedule, *, backward: bool = False, ax=None, costs=None):
  """Draws ``schedule`` on a matplotlib axes.

  Args:
    schedule: the :class:`tpipe.schedules.Schedule` or :class:`tpipe.schedules.FusedSchedule`
      to draw.
    backward: also draw the backward ticks (the forward table reversed) after the forward ones;
      a fused schedule's table has them already, so it takes only ``False``.
    ax: axes to draw on; a new figure sized to the table is made when None.
    costs: fused schedules only: per-action costs (``{"F": .., "B": .., ...}``) to draw the
      schedule in neighbour-synchronised time instead of ticks.

  Returns:
    The matplotlib ``Figure``.
  """
  _check_schedule(schedule)
  if isinstance(schedule, schedules_lib.FusedSchedule):
    if backward:
      raise ValueError(f"The fused schedule {schedule.name!r} already has its backward actions "
                       "in its table; drop backward=True.")
    if costs is not None:
      simulate_lib.action_costs(schedule, costs)  # Raises for bad costs.
    return _draw_fused(schedule, ax, costs)
  if costs is not None:
    raise ValueError(f"costs draw a fused schedule in time; {schedule.name!r} is a forward "
                     "schedule, whose ticks cost the same: drop costs.")
  plt = _pyplot()
  from matplotlib.patches import Patch  # pylint: disable=g-import-not-at-top
  from matplotlib.patches import Rectangle  # pylint: disable=g-import-not-at-top

  phases = [("F", schedule.microbatch, schedule.repeat)]
  if backward:
    phases.append(("B", *schedule.backward_tables()))
  ticks = sum(p[1].shape[0] for p in phases)
  stages = schedule.num_stages
  fig, ax, cell_w = _new_axes(plt, ticks, stages, ax)
  colours = _colours(schedule.num_microbatches)
  label_ok = cell_w >= 0.22
  circular = schedule.num_repeats > 1
  offset = 0
  for phase, mb, rep in phases:
    light = phase == "B"
    for t in range(mb.shape[0]):
      for s in range(stages):
        m, r = int(mb[t, s]), int(rep[t, s])
        if m == schedules_lib.IDLE:
          continue
        face = colours[m]
        rect = Rectangle((offset + t, s), 1, 1, facecolor=face, alpha=0.45 if light else 0.95,
                         edgecolor="white", linewidth=0.8,
                         hatch=_HATCHES[r % len(_HATCHES)] if circular else None)
        ax.add_patch(rect)
        if label_ok:
          text = f"{m}/{r}" if circular else f"{m}"
          ax.text(offset + t + 0.5, s + 0.5, text, ha="center", va="center",
                  fontsize=7 if circular else 8, color="black")
    offset += mb.shape[0]
  if backward:
    ax.axvline(schedule.num_ticks, color="black", linewidth=1.2)
    ax.text(schedule.num_ticks / 2, -0.15, "forward", ha="center", va="bottom", fontsize=9)
    ax.text(schedule.num_ticks * 1.5, -0.15, "backward (autodiff, reversed)", ha="center",
            va="bottom", fontsize=9)
  _finish_axes(ax, schedule, ticks, top=-0.6 if backward else 0)
  if circular:
    handles = [Patch(facecolor="white", edgecolor="grey", hatch=_HATCHES[r % len(_HATCHES)],
                     label=f"repeat {r}") for r in range(schedule.num_repeats)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7,
              frameon=False, title="label m/r", title_fontsize=7)
  fig.tight_layout()
  return fig


def save_timeline(schedule, path: str | os.PathLike, *, backward: bool = False,
                  dpi: int = 110, costs=None) -> str:
  """Draws ``schedule`` and saves it as an image (PNG unless ``path`` names another format).

  Args:
    schedule: the :class:`tpipe.schedules.Schedule` or :class:`tpipe.schedules.FusedSchedule`
      to draw.
    path: output file, e.g. ``"timeline.png"``; its directory is created if missing.
    backward: also draw the backward ticks after the forward ones.
    dpi: resolution.
    costs: draw a fused schedule in neighbour-synchronised time (see :func:`draw_timeline`).

  Returns:
    The path written, as a string.
  """
  _check_schedule(schedule)
  path = os.fspath(path)
  if not os.path.splitext(path)[1]:
    raise ValueError(f"path {path!r} has no file extension; use e.g. {path + '.png'!r}.")
  directory = os.path.dirname(path)
  if directory:
    os.makedirs(directory, exist_ok=True)
  plt = _pyplot()
  fig = draw_timeline(schedule, backward=backward, costs=costs)
  try:
    fig.savefig(path, dpi=dpi)
  finally:
    plt.close(fig)
  return path
