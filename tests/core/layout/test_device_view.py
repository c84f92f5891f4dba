"""tpipe.core.layout.device_view: a device's part of the staged variables without the stage axis
(except the parameters' packed buffers, which keep it), and per-device leaves with the stage
axis put back (on NumPy arrays: both only slice and index)."""

import numpy as np
import pytest

from tpipe.core.base import float_leaves as floats_lib
from tpipe.core.layout import device_view as view_lib

pytestmark = pytest.mark.unit


def _staged():
  """A device's part of a staged tree: every leaf [R, 1, ...] (R = 2)."""
  return {view_lib.PARAMS: {"packed": {"float32": np.zeros((2, 1, 8))},
                            "stacked": {"layers_1": {"w": np.zeros((2, 1, 3, 4))}},
                            "shared": {"shared_0": np.zeros((2, 1, 5, 4))}},
          view_lib.STATS: {"packed": {"float32": np.zeros((2, 1, 5))}}}


def test_device_view_keeps_the_stage_axis_of_packed_parameters_only():
  staged = _staged()
  view = view_lib.device_view(staged)
  assert view[view_lib.PARAMS]["packed"]["float32"] is staged[view_lib.PARAMS]["packed"][
      "float32"]
  assert view[view_lib.PARAMS]["stacked"]["layers_1"]["w"].shape == (2, 3, 4)
  assert view[view_lib.PARAMS]["shared"]["shared_0"].shape == (2, 5, 4)
  assert view[view_lib.STATS]["packed"]["float32"].shape == (2, 5)


def test_device_view_reads_the_values_of_the_stage():
  stacked = np.arange(24.0).reshape(2, 1, 3, 4)
  view = view_lib.device_view({view_lib.PARAMS: {"stacked": {"w": stacked}}})
  np.testing.assert_array_equal(view[view_lib.PARAMS]["stacked"]["w"], stacked[:, 0])


def test_with_stage_axis_puts_back_what_the_view_dropped():
  staged = _staged()
  view = view_lib.device_view(staged)
  staged_leaves = floats_lib.float_leaves(staged)
  back = view_lib.with_stage_axis(floats_lib.float_leaves(view), staged_leaves)
  assert [a.shape for a in back] == [a.shape for a in staged_leaves]
  values = [np.arange(6.0).reshape(2, 3), np.ones((2, 1, 8))]
  like = [np.zeros((2, 1, 3)), np.zeros((2, 1, 8))]
  put_back = view_lib.with_stage_axis(values, like)
  np.testing.assert_array_equal(put_back[0], np.arange(6.0).reshape(2, 1, 3))
  assert put_back[1] is values[1]  # Already with its stage axis.
