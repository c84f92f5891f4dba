"""Tests for tpipe.tools.timeline: one box per busy slot, and a title with the bubble."""

import matplotlib.pyplot as plt
import pytest
from matplotlib.patches import Rectangle

from tpipe import schedules
from tpipe.tools import timeline

pytestmark = pytest.mark.unit  # Tables and matplotlib: no JAX computation.


def _boxes(fig):
  return [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]


def test_one_box_per_busy_slot_coloured_by_microbatch():
  schedule = schedules.build("gpipe", num_stages=3, num_microbatches=4)
  fig = timeline.draw_timeline(schedule)
  boxes = _boxes(fig)
  assert len(boxes) == int(schedule.busy.sum()) == 12
  # Box at (tick t, stage s) has micro-batch m's colour; micro-batch 0 starts stage 2 at tick 2.
  by_position = {(int(b.get_x()), int(b.get_y())): b.get_facecolor() for b in boxes}
  assert (0, 1) not in by_position and (0, 2) not in by_position  # bubbles stay blank.
  assert by_position[(2, 2)] == by_position[(0, 0)]
  assert by_position[(1, 0)] != by_position[(0, 0)]
  assert "bubble 33.3%" in fig.axes[0].get_title()
  plt.close(fig)


def test_backward_doubles_the_boxes_and_circular_hatches_repeats():
  schedule = schedules.build("circular", num_stages=2, num_microbatches=2, num_repeats=2)
  fig = timeline.draw_timeline(schedule, backward=True)
  boxes = _boxes(fig)
  assert len(boxes) == 2 * int(schedule.busy.sum())
  hatches = {b.get_hatch() for b in boxes}
  assert len(hatches) == 2  # one per repeat.
  assert "R=2" in fig.axes[0].get_title()
  plt.close(fig)


def test_save_timeline_writes_a_png(tmp_path):
  path = timeline.save_timeline(schedules.build("gpipe", 4, 8), tmp_path / "sub" / "t.png",
                                backward=True)
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  small = timeline.save_timeline(schedules.build("gpipe", 2, 1), tmp_path / "small.png")
  assert (tmp_path / "sub" / "t.png").stat().st_size > (tmp_path / "small.png").stat().st_size
  assert small.endswith("small.png")


def test_bad_arguments():
  with pytest.raises(TypeError, match=r"tpipe.schedules.build\(name, num_stages"):
    timeline.save_timeline("gpipe", "/tmp/x.png")
  with pytest.raises(ValueError, match="extension"):
    timeline.save_timeline(schedules.build("gpipe", 2, 2), "/tmp/no_extension")


def test_fused_schedule_boxes_are_coloured_by_action_with_a_legend():
  schedule = schedules.build("1f1b", num_stages=2, num_microbatches=3)
  fig = timeline.draw_timeline(schedule)
  boxes = _boxes(fig)
  assert len(boxes) == int(schedule.busy.sum()) == 12
  by_position = {(int(b.get_x()), int(b.get_y())): b.get_facecolor() for b in boxes}
  # Stage 0: F0 F1 . B0 F2 B1 . B2 -- forwards share a colour, backwards another.
  assert (2, 0) not in by_position and (6, 0) not in by_position
  assert by_position[(0, 0)] == by_position[(1, 0)] == by_position[(4, 0)]
  assert by_position[(3, 0)] == by_position[(5, 0)] != by_position[(0, 0)]
  legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
  assert legend == ["F: forward", "B: backward"]
  assert "1f1b: S=2, M=3, 8 ticks, bubble 25.0%" in fig.axes[0].get_title()
  plt.close(fig)


def test_zbv_draws_three_actions_and_hatches_its_two_chunks():
  schedule = schedules.build("zbv", num_stages=2, num_microbatches=2)
  fig = timeline.draw_timeline(schedule)
  boxes = _boxes(fig)
  assert len(boxes) == int(schedule.busy.sum()) == 24
  assert len({b.get_facecolor() for b in boxes}) == 3  # F, BI, W.
  assert len({b.get_hatch() for b in boxes}) == 2  # one per chunk.
  legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
  assert legend == ["F: forward", "BI: backward-input", "W: backward-weight", "chunk 0",
                    "chunk 1"]
  assert "2 chunks/stage" in fig.axes[0].get_title()
  plt.close(fig)


def test_fused_schedule_saves_and_rejects_backward(tmp_path):
  schedule = schedules.build("zb_h1", 4, 8)
  path = timeline.save_timeline(schedule, tmp_path / "zb_h1.png")
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  with pytest.raises(ValueError, match="already has its backward"):
    timeline.draw_timeline(schedule, backward=True)


def test_forward_pass_draws_forward_boxes_only():
  schedule = schedules.build("zbv", num_stages=2, num_microbatches=2)
  forward = schedule.forward_pass()
  fig = timeline.draw_timeline(forward)
  boxes = _boxes(fig)
  assert len(boxes) == int(forward.busy.sum()) == 8
  assert len({b.get_facecolor() for b in boxes}) == 1
  legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
  assert legend == ["F: forward", "chunk 0", "chunk 1"]
  assert "zbv: S=2, M=2, 2 chunks/stage, 6 ticks" in fig.axes[0].get_title()
  plt.close(fig)


def test_a_compound_tick_splits_its_box_into_its_actions_inside_an_outline():
  costs = {"F": 1.0, "B": 3.0}
  table = schedules.build("1f1b", 3, 4, costs=costs)
  fig = timeline.draw_timeline(table)
  filled = [b for b in _boxes(fig) if b.get_fill()]
  outlines = [b for b in _boxes(fig) if not b.get_fill()]
  assert len(filled) == int(table.busy.sum()) == 2 * 3 * 4
  compound = {(int(t), int(s)) for t, s, *_ in table.actions()
              if sum(1 for u, v, *_ in table.actions() if (u, v) == (t, s)) > 1}
  assert len(outlines) == len(compound) > 0
  # Stage 2's tick 2 holds F0 then B0, each half a tick wide, in that order.
  on_tick = sorted((b.get_x(), b.get_width()) for b in filled
                   if int(b.get_y()) == 2 and 2 <= b.get_x() < 3)
  assert on_tick == [(2.0, 0.5), (2.5, 0.5)]
  plt.close(fig)


def test_costs_draw_a_fused_table_in_neighbour_synchronised_time(tmp_path):
  costs = {"F": 1.0, "B": 3.0}
  table = schedules.build("1f1b", 3, 4, costs=costs)
  fig = timeline.draw_timeline(table, costs=costs)
  widths = sorted({round(b.get_width(), 6) for b in _boxes(fig) if b.get_fill()})
  assert widths == [1.0, 3.0]  # Each action as wide as its cost.
  right = max(b.get_x() + b.get_width() for b in _boxes(fig))
  assert right == table.simulate(costs).neighbour == 24.0
  assert "neighbour-synchronised" in fig.axes[0].get_xlabel()
  plt.close(fig)
  path = timeline.save_timeline(table, tmp_path / "timed.png", costs=costs)
  assert (tmp_path / "timed.png").stat().st_size > 0 and path.endswith("timed.png")
  with pytest.raises(ValueError, match="forward schedule"):
    timeline.draw_timeline(schedules.build("gpipe", 2, 2), costs=costs)
  with pytest.raises(ValueError, match="costs has no entry for 'B'"):
    timeline.draw_timeline(table, costs={"F": 1.0})
