"""tpipe.schedules.build, the one way to make a table by name: validation, caching, read-only
tables, each schedule's own chunk count by default, and errors that name the fix."""

import doctest

import numpy as np
import pytest

from tpipe import schedules
from tpipe.schedules import forward
from tpipe.schedules import orders

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name,repeats", [("gpipe", 1), ("circular", 3), ("1f1b", 1),
                                          ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2)])
def test_build_caches_one_read_only_table_per_arguments(name, repeats):
  table = schedules.build(name, 3, 4, repeats)
  assert schedules.build(name, 3, 4, repeats) is table
  assert schedules.build(name, 3, 5, repeats) is not table
  assert (table.name, table.num_stages, table.num_microbatches, table.num_chunks) == (
      name, 3, 4, repeats)
  assert isinstance(table, schedules.FusedSchedule) == schedules.is_fused(name)
  assert table.placement == schedules.placement(name)
  # Shared tables cannot be changed by one of their users.
  arrays = [value for value in vars(table).values() if isinstance(value, np.ndarray)]
  assert len(arrays) == (2 if name in schedules.SCHEDULE_NAMES else 9)
  for array in arrays:
    assert not array.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
      array[(0,) * array.ndim] = 0


def test_one_cached_table_however_the_arguments_are_written():
  # Keywords, positional arguments and the default num_repeats name the same table.
  table = schedules.build("gpipe", 3, 4, 1)
  assert schedules.build("gpipe", 3, 4) is table
  assert schedules.build("gpipe", num_stages=3, num_microbatches=4) is table
  assert schedules.build("gpipe", 3, num_microbatches=4, num_repeats=1) is table
  fused = schedules.build("zbv", 3, 4, 2)
  assert schedules.build(name="zbv", num_stages=3, num_microbatches=4, num_repeats=2) is fused
  assert schedules.build("zbv", np.int64(3), 4, 2) is fused
  assert schedules.build("zbv", 3, 4) is fused  # The schedule's own chunk count.


def test_build_matches_the_builders():
  pairs = [(schedules.build("gpipe", 2, 3), forward.gpipe(2, 3)),
           (schedules.build("circular", 2, 3, 2), forward.circular(2, 3, 2)),
           (schedules.build("1f1b", 2, 3), orders.one_f_one_b(2, 3)),
           (schedules.build("zb_h1", 2, 3), orders.zb_h1(2, 3)),
           (schedules.build("zbv", 2, 3), orders.zbv(2, 3)),
           (schedules.build("interleaved_1f1b", 2, 4, 2), orders.interleaved_1f1b(2, 4, 2))]
  for built, direct in pairs:
    assert built.describe() == direct.describe()


def test_the_package_offers_one_way_to_make_a_table():
  for name in ("make_schedule", "make_fused_schedule", "gpipe", "circular", "one_f_one_b",
               "zb_h1", "zbv", "interleaved_1f1b", "from_forward", "place", "from_ticks"):
    assert not hasattr(schedules, name), name


def test_names_kinds_and_placements():
  assert schedules.SCHEDULE_NAMES == ("gpipe", "circular")
  assert schedules.NAMES == schedules.SCHEDULE_NAMES + schedules.FUSED_SCHEDULE_NAMES
  assert [schedules.is_fused(n) for n in schedules.NAMES] == [False, False] + [True] * 4
  assert [schedules.placement(n) for n in schedules.NAMES] == ["loop"] * 5 + ["v"]
  assert schedules.actions.PLACEMENTS == ("loop", "v")
  for function in (schedules.is_fused, schedules.placement):
    with pytest.raises(ValueError, match=r"Unknown schedule 'pipedream'; choose one of "
                                         r"\('gpipe', 'circular'\) \(forward\) or \('1f1b', "):
      function("pipedream")


@pytest.mark.parametrize("args,error,match", [
    (("zigzag", 2, 2), ValueError, r"Unknown schedule 'zigzag'; choose one of \('gpipe', "
                                   r"'circular'\) \(forward\) or \('1f1b', 'interleaved_1f1b', "
                                   r"'zb_h1', 'zbv'\) \(fused\)"),
    ((None, 2, 2), ValueError, "Unknown schedule None; choose one of"),
    (("gpipe", 2, 2, 2), ValueError, "schedule='gpipe' runs one chunk per stage, got "
                                     "num_repeats=2; use schedule='circular' for num_repeats > 1"),
    (("1f1b", 2, 2, 2), ValueError, r"schedule='1f1b' runs 1 chunk\(s\) per stage, got "
                                    "num_repeats=2; use schedule='interleaved_1f1b' for more"),
    (("zb_h1", 2, 2, 3), ValueError, "use schedule='interleaved_1f1b' for more"),
    (("zbv", 2, 2, 1), ValueError, r"schedule='zbv' runs 2 chunk\(s\) per stage, got "
                                   "num_repeats=1; pass num_repeats=2"),
    (("interleaved_1f1b", 2, 2, 1), ValueError, "needs num_repeats >= 2 chunks per stage, got "
                                                "1; use schedule='1f1b' for one"),
    (("circular", 0, 2, 2), ValueError, "num_stages must be >= 1, got 0"),
    (("1f1b", 2, -1), ValueError, "num_microbatches must be >= 1, got -1"),
    (("circular", 2, 2, 0), ValueError, "num_repeats must be >= 1, got 0"),
    (("circular", 2, 2, 1.5), TypeError, "num_repeats must be an int, got 1.5"),
])
def test_build_errors_name_the_fix(args, error, match):
  with pytest.raises(error, match=match):
    schedules.build(*args)


@pytest.mark.parametrize("name,repeats", [("gpipe", 1), ("circular", 2), ("1f1b", 1),
                                          ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2)])
def test_a_count_of_the_wrong_type_is_refused_even_when_an_equal_int_is_cached(name, repeats):
  # 2.0 == 2 and True == 1 hash alike, so a cache keyed on the values alone would hand the
  # int's table to them: build refuses them whatever was built before.
  schedules.build(name, 2, 1, repeats)
  for args in ((2.0, 1, repeats), (2, 1.0, repeats), (2, True, repeats)):
    with pytest.raises(TypeError, match=r"must be an int, got (2\.0|1\.0|True)"):
      schedules.build(name, *args)
  if name in ("circular", "interleaved_1f1b"):  # The schedules whose chunk count is free.
    with pytest.raises(TypeError, match=r"num_repeats must be an int, got 2\.0"):
      schedules.build(name, 2, 1, float(repeats))


@pytest.mark.parametrize("args,kwargs,error,match", [
    (("pipedream", 2, 2), {}, ValueError, "Unknown schedule 'pipedream'"),
    (("1f1b", 2, 2), dict(num_repeats=2), ValueError, "use schedule='interleaved_1f1b'"),
    (("zbv", 2, 2), dict(num_repeats=3), ValueError, "schedule='zbv' runs 2 chunk"),
    (("interleaved_1f1b", 2, 2), {}, ValueError,
     r"schedule='interleaved_1f1b' needs num_repeats >= 2 chunks per stage; use "
     r"schedule='1f1b' for one"),
    (("interleaved_1f1b", 2, 2), dict(num_repeats=2.5), TypeError, "num_repeats must be an int"),
    (("gpipe", 2.5, 2), {}, TypeError, "num_stages must be an int"),
    (("zbv", 2, 2.5), {}, TypeError, "num_microbatches must be an int"),
    (("gpipe", 2, 2), dict(costs={"F": 1, "B": 2}), ValueError,
     "schedule='gpipe' is a forward schedule .*: pass costs=None"),
])
def test_keyword_arguments_and_defaults_are_checked(args, kwargs, error, match):
  with pytest.raises(error, match=match):
    schedules.build(*args, **kwargs)


def test_default_and_explicit_chunk_counts_name_one_table():
  for name, chunks in (("gpipe", 1), ("circular", 1), ("1f1b", 1), ("zb_h1", 1), ("zbv", 2)):
    default = schedules.build(name, 3, 4)
    assert default.num_chunks == chunks
    assert default is schedules.build(name, 3, 4, num_repeats=chunks)  # One cached table.


def test_package_doctests_pass():
  result = doctest.testmod(schedules)
  assert result.attempted >= 5 and result.failed == 0
