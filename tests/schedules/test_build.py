"""tpipe.schedules.build, the one cached factory of tables by name (and make_schedule /
make_fused_schedule over it): caching, read-only tables, and errors that name the fix."""

import doctest

import numpy as np
import pytest

from tpipe import schedules

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
  # The makers by kind hand out the same cached table.
  if schedules.is_fused(name):
    assert schedules.make_fused_schedule(name, 3, 4, num_repeats=repeats) is table
  else:
    assert schedules.make_schedule(name, 3, 4, num_repeats=repeats) is table
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


def test_build_matches_the_builders():
  pairs = [(schedules.build("gpipe", 2, 3), schedules.gpipe(2, 3)),
           (schedules.build("circular", 2, 3, 2), schedules.circular(2, 3, 2)),
           (schedules.build("1f1b", 2, 3), schedules.one_f_one_b(2, 3)),
           (schedules.build("zb_h1", 2, 3), schedules.zb_h1(2, 3)),
           (schedules.build("zbv", 2, 3, 2), schedules.zbv(2, 3)),
           (schedules.build("interleaved_1f1b", 2, 4, 2), schedules.interleaved_1f1b(2, 4, 2))]
  for built, direct in pairs:
    assert built.describe() == direct.describe()


def test_names_kinds_and_placements():
  assert schedules.SCHEDULE_NAMES == ("gpipe", "circular")
  assert schedules.NAMES == schedules.SCHEDULE_NAMES + schedules.FUSED_SCHEDULE_NAMES
  assert [schedules.is_fused(n) for n in schedules.NAMES] == [False, False] + [True] * 4
  assert [schedules.placement(n) for n in schedules.NAMES] == ["loop"] * 5 + ["v"]
  assert schedules.PLACEMENTS == ("loop", "v")
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
    (("zbv", 2, 2), ValueError, r"schedule='zbv' runs 2 chunk\(s\) per stage, got "
                                "num_repeats=1; pass num_repeats=2"),
    (("interleaved_1f1b", 2, 2), ValueError, "needs num_repeats >= 2 chunks per stage, got 1; "
                                             "use schedule='1f1b' for one"),
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


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(name="1f1b", num_stages=2, num_microbatches=2), ValueError,
     r"schedule='1f1b' is a fused schedule; build its table with make_fused_schedule\(\)"),
    (dict(name="zigzag", num_stages=2, num_microbatches=2), ValueError,
     "Unknown schedule 'zigzag'"),
    (dict(name="gpipe", num_stages=2, num_microbatches=2, num_repeats=2), ValueError,
     "schedule='circular'"),
    (dict(name="gpipe", num_stages=0, num_microbatches=2), ValueError, "num_stages must be >= 1"),
    (dict(name="circular", num_stages=2, num_microbatches=-1), ValueError,
     "num_microbatches must be >= 1"),
    (dict(name="gpipe", num_stages=2.5, num_microbatches=2), TypeError,
     "num_stages must be an int"),
])
def test_make_schedule_bad_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    schedules.make_schedule(**kwargs)


@pytest.mark.parametrize("args,kwargs,error,match", [
    (("pipedream", 2, 2), {}, ValueError, "Unknown schedule 'pipedream'"),
    (("gpipe", 2, 2), {}, ValueError,
     r"forward schedule: build it with make_schedule\(\), and its whole step as a fused table "
     r"with from_forward\(\)"),
    (("1f1b", 2, 2), dict(num_repeats=2), ValueError, "use schedule='interleaved_1f1b'"),
    (("zbv", 2, 2), dict(num_repeats=3), ValueError, "schedule='zbv' runs 2 chunk"),
    (("interleaved_1f1b", 2, 2), {}, ValueError, "needs num_repeats >= 2"),
    (("interleaved_1f1b", 2, 2), dict(num_repeats=1), ValueError, "use schedule='1f1b'"),
    (("interleaved_1f1b", 2, 2), dict(num_repeats=2.5), TypeError, "num_repeats must be an int"),
    (("zb_h1", 0, 2), {}, ValueError, "num_stages must be >= 1"),
    (("zbv", 2, 2.5), {}, TypeError, "num_microbatches must be an int"),
])
def test_make_fused_schedule_bad_arguments(args, kwargs, error, match):
  with pytest.raises(error, match=match):
    schedules.make_fused_schedule(*args, **kwargs)


def test_make_fused_schedule_defaults_and_explicit_chunks_agree():
  for name, chunks in (("1f1b", 1), ("zb_h1", 1), ("zbv", 2)):
    default = schedules.make_fused_schedule(name, 3, 4)
    explicit = schedules.make_fused_schedule(name, 3, 4, num_repeats=chunks)
    assert default.num_chunks == chunks
    assert default is explicit  # One cached table.
    np.testing.assert_array_equal(default.action, explicit.action)


def test_package_doctests_pass():
  result = doctest.testmod(schedules)
  assert result.attempted >= 5 and result.failed == 0
