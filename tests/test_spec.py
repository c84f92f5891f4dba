"""tpipe.PipelineSpec: defaults, what follows from the settings (the cached table, chunks,
placement), replace(), every validation error (a TypeError or ValueError naming the value and the
fix), tpipe.spec.make / for_stack, and the front ends prefixing errors with the API called."""

import dataclasses
import doctest

import flax.linen as nn
import jax
import numpy as np
import pathlib
import re

import pytest
from flax import nnx

import tpipe
from tests.helpers import blocks
from tpipe import schedules
from tpipe import spec as spec_lib

unit = pytest.mark.unit

SETTINGS = ("num_stages", "num_microbatches", "schedule", "num_repeats", "balance", "remat",
            "remat_granularity", "per_example", "unroll", "mesh", "transfer_delay",
            "stream_inputs", "tick_costs", "weight_recompute", "overlap_microbatches",
            "stage_axis", "data_axis")


@unit
def test_the_docs_list_every_setting():
  page = (pathlib.Path(__file__).parent.parent / "docs" / "guide" / "spec.md").read_text()
  listed = re.search(r"The settings: (.*?)\. Every bad value", page, re.S).group(1)
  assert tuple(re.findall(r"`(\w+)`", listed)) == SETTINGS


@unit
def test_defaults_and_what_follows_from_them():
  spec = tpipe.PipelineSpec(num_stages=2, num_microbatches=4)
  assert spec_lib.field_names() == SETTINGS
  assert (spec.schedule, spec.num_repeats, spec.balance, spec.remat, spec.remat_granularity,
          spec.per_example, spec.unroll, spec.mesh, spec.stage_axis, spec.data_axis) == (
              "gpipe", 1, "params", "full", "nested", (), 1, None, "stage", "data")
  assert (spec.is_fused, spec.num_chunks, spec.placement) == (False, 2, "loop")
  assert spec.table is schedules.build("gpipe", 2, 4, 1)  # The cached table, not a copy.
  with pytest.raises(dataclasses.FrozenInstanceError):
    spec.num_stages = 4


@unit
@pytest.mark.parametrize("name,repeats,fused,placement", [
    ("gpipe", 1, False, "loop"), ("circular", 3, False, "loop"), ("1f1b", 1, True, "loop"),
    ("interleaved_1f1b", 2, True, "loop"), ("zb_h1", 1, True, "loop"), ("zbv", 2, True, "v")])
def test_the_table_comes_from_the_cached_factory(name, repeats, fused, placement):
  spec = tpipe.PipelineSpec(num_stages=2, num_microbatches=4, schedule=name, num_repeats=repeats)
  assert spec.table is schedules.build(name, 2, 4, repeats)
  assert spec.table is spec.replace(balance="flops").table
  assert (spec.is_fused, spec.num_chunks, spec.placement) == (fused, 2 * repeats, placement)
  assert spec.table.num_chunks == repeats and spec.table.placement == placement
  longer = spec.replace(num_microbatches=8)
  assert longer.table is schedules.build(name, 2, 8, repeats)
  assert longer.table.num_microbatches == 8


@unit
def test_settings_are_normalized_so_equal_specs_compare_and_hash_equal():
  spec = tpipe.PipelineSpec(2, 4, balance=[1, np.int64(2)], per_example=["targets"])
  assert spec.balance == (1, 2) and all(type(c) is int for c in spec.balance)
  assert spec.per_example == ("targets",)
  same = tpipe.PipelineSpec(2, 4, balance=(1, 2), per_example=("targets",))
  assert spec == same and hash(spec) == hash(same)
  assert spec != same.replace(remat="dots")


@unit
def test_replace_validates_again_and_leaves_the_original():
  spec = tpipe.PipelineSpec(2, 4)
  fused = spec.replace(schedule="zbv", num_repeats=2, remat="dots")
  assert (fused.schedule, fused.num_repeats, fused.remat, fused.num_chunks) == ("zbv", 2, "dots",
                                                                                4)
  assert (spec.schedule, spec.num_repeats, spec.remat) == ("gpipe", 1, "full")
  assert spec.replace() == spec
  with pytest.raises(ValueError, match="pass num_repeats=2"):
    spec.replace(schedule="zbv")
  with pytest.raises(TypeError, match=r"^Unknown pipeline setting\(s\) \['bogus', 'stages'\]; the "
                                      r"settings are \('num_stages', 'num_microbatches', "):
    spec.replace(stages=4, bogus=1)
  # A balance of counts is for one number of chunks: changing the chunks asks for new counts.
  with pytest.raises(ValueError, match=r"balance=\[1, 1\] has 2 entries but num_stages \* "
                                       r"num_repeats = 4 chunks"):
    spec.replace(balance=[1, 1]).replace(num_stages=4)


# Every setting's bad values: (settings, error, message naming the value and the fix).
_BAD = [
    (dict(num_stages=0), ValueError, r"num_stages must be >= 1, got 0"),
    (dict(num_stages=2.0), TypeError, r"num_stages must be an int, got 2\.0 of type float"),
    (dict(num_microbatches=True), TypeError, r"num_microbatches must be an int, got True"),
    (dict(num_microbatches=-3), ValueError, r"num_microbatches must be >= 1, got -3"),
    (dict(num_repeats=0, schedule="circular"), ValueError, r"num_repeats must be >= 1, got 0"),
    (dict(num_repeats="2"), TypeError, r"num_repeats must be an int, got '2'"),
    (dict(schedule=1), TypeError, r"schedule must be a name, one of \('gpipe', 'circular', "
                                  r"'1f1b', .*got 1"),
    (dict(schedule="zigzag"), ValueError, r"Unknown schedule 'zigzag'; choose one of "
                                          r"\('gpipe', 'circular'\) \(forward\) or"),
    (dict(schedule="gpipe", num_repeats=2), ValueError,
     r"schedule='gpipe' runs one chunk per stage, got num_repeats=2; use schedule='circular' "
     r"for num_repeats > 1"),
    (dict(schedule="1f1b", num_repeats=2), ValueError,
     r"schedule='1f1b' runs 1 chunk\(s\) per stage, got num_repeats=2; use "
     r"schedule='interleaved_1f1b' for more"),
    (dict(schedule="zbv"), ValueError,
     r"schedule='zbv' runs 2 chunk\(s\) per stage, got num_repeats=1; pass num_repeats=2"),
    (dict(schedule="interleaved_1f1b"), ValueError,
     r"schedule='interleaved_1f1b' needs num_repeats >= 2 chunks per stage, got 1; use "
     r"schedule='1f1b' for one"),
    (dict(balance="cost"), ValueError, r"Unknown balance 'cost'; choose one of \('params', "
                                       r"'flops', 'time'\) or pass a list of 2 layer-unit counts"),
    (dict(balance=5), TypeError, r"balance must be one of \('params', 'flops', 'time'\) or a list "
                                 r"with one layer-unit count per chunk, e\.g\. \[3, 3, 2\]; got 5"),
    (dict(balance=np.ones((2, 2), int)), TypeError, r"balance must be one of .* got array\(\[\[1"),
    (dict(balance=[1, 2.5]), TypeError, r"balance\[1\] = 2\.5 is not an int; give each chunk a "
                                        r"whole number of layer units"),
    (dict(balance=[1, True]), TypeError, r"balance\[1\] = True is not an int"),
    (dict(balance=[3, 0]), ValueError, r"balance\[1\] = 0: every chunk needs at least one layer "
                                       r"unit"),
    (dict(balance=[1, 2, 3]), ValueError, r"balance=\[1, 2, 3\] has 3 entries but num_stages \* "
                                          r"num_repeats = 2 chunks; give one layer-unit count "
                                          r"per chunk"),
    (dict(remat="some"), ValueError, r"Unknown remat 'some'; choose one of \('none', 'full', "
                                     r"'dots'\) or pass a jax\.checkpoint policy"),
    (dict(remat=3), TypeError, r"remat must be one of \('none', 'full', 'dots'\) or a "
                               r"jax\.checkpoint policy callable, got 3 of type int"),
    (dict(remat_granularity="block"), ValueError,
     r"Unknown remat_granularity 'block'; choose one of \('chunk', 'layer', 'nested'\) or a "
     r"positive int k"),
    (dict(remat_granularity=0), ValueError,
     r"remat_granularity must be >= 1 layer units per checkpoint, got 0; or choose one of"),
    (dict(remat_granularity=1.5), TypeError,
     r"remat_granularity must be one of \('chunk', 'layer', 'nested'\) or a positive int, "
     r"got 1\.5"),
    (dict(remat_granularity=True), TypeError, r"remat_granularity must be .* got True"),
    (dict(unroll=0), ValueError, r"unroll must be an int >= 1 \(layer units per iteration of a "
                                 r"repeated layer's loop\) or True \(unroll it whole\), got 0"),
    (dict(unroll="all"), ValueError, r"unroll must be an int >= 1 .* got 'all'"),
    (dict(per_example="targets"), TypeError,
     r"per_example must be a sequence of keyword names, got the string 'targets'; write "
     r"per_example=\('targets',\)"),
    (dict(per_example=("targets", 1)), TypeError,
     r"per_example must hold keyword names \(strings\), got \('targets', 1\)"),
    (dict(per_example=None), TypeError, r"per_example must .*got None"),
    (dict(per_example=5), TypeError, r"per_example must .*got 5"),
    (dict(stage_axis=1), TypeError, r"stage_axis must be a mesh axis name \(a string\), got 1"),
    (dict(data_axis=None), TypeError, r"data_axis must be a mesh axis name \(a string\), got None"),
    (dict(stage_axis="data"), ValueError, r"stage_axis and data_axis must differ, both are "
                                          r"'data'"),
    (dict(mesh="mesh"), TypeError, r"mesh must be a jax\.sharding\.Mesh or None, got str"),
    (dict(transfer_delay=2), ValueError, r"transfer_delay=2: a transfer is delayed by 0 or 1 "
                                         r"tick"),
    (dict(transfer_delay=(0, 1, 0)), ValueError, r"transfer_delay=\(0, 1, 0\): give one 0 or 1 "
                                                 r"per link of the ring of 2 stages"),
]


@unit
@pytest.mark.parametrize("settings,error,match", _BAD,
                         ids=[",".join(f"{k}={v!r}" for k, v in s.items()).replace("\n", "")[:40]
                              for s, _, _ in _BAD])
def test_every_bad_setting_is_an_error_naming_the_value_and_the_fix(settings, error, match):
  kwargs = {"num_stages": 2, "num_microbatches": 4, **settings}
  with pytest.raises(error, match=f"^{match}"):
    tpipe.PipelineSpec(**kwargs)
  # The same through replace() and through a front end's make(), which names the API.
  if "num_stages" not in settings and "num_microbatches" not in settings:
    with pytest.raises(error, match=f"^{match}"):
      tpipe.PipelineSpec(2, 4).replace(**settings)
  with pytest.raises(error, match=f"^tpipe.Sequential: {match}"):
    spec_lib.make("tpipe.Sequential", **kwargs)


@unit
def test_a_mesh_must_have_the_stage_axis_of_num_stages():
  mesh = tpipe.make_mesh(stages=4, data=2)
  spec = tpipe.PipelineSpec(4, 2, mesh=mesh)
  assert spec.mesh is mesh and spec.data_size(mesh) == 2
  with pytest.raises(ValueError, match=r"^num_stages=2 but the 'stage' axis of the mesh given "
                                       r"has size 4; make them equal \(e\.g\. "
                                       r"tpipe\.make_mesh\(stages=2, \.\.\.\)\)"):
    tpipe.PipelineSpec(2, 4, mesh=mesh)
  pipe = jax.make_mesh((2,), ("pipe",), axis_types=(jax.sharding.AxisType.Auto,))
  with pytest.raises(ValueError, match=r"^the mesh given has axes \('pipe',\) but no stage axis "
                                       r"'stage'; build one with tpipe\.make_mesh\(stages=2, "
                                       r"data=\.\.\.\) or pass stage_axis=<your axis name>"):
    tpipe.PipelineSpec(2, 4, mesh=pipe)
  renamed = tpipe.PipelineSpec(2, 4, mesh=pipe, stage_axis="pipe")
  assert renamed.data_size(pipe) == 1  # No data axis: one replica.


@unit
def test_the_microbatch_size_has_one_formula():
  mesh = tpipe.make_mesh(stages=2, data=2, fsdp=2)
  spec = tpipe.PipelineSpec(2, 4, mesh=mesh)
  assert spec.row_shards(mesh) == 4  # data x fsdp: the devices of one stage a batch's rows span.
  assert spec.row_shards(tpipe.make_mesh(stages=2, tensor=4)) == 1
  assert spec.microbatch_size(64, spec.row_shards(mesh)) == 4  # 64 rows / 4 shards / M = 4.
  assert spec.microbatch_size(64) == 16  # One device's batch: split into M only.
  assert spec.microbatch_size(2) == 1  # Planning traces a smaller batch with one example.


@unit
def test_make_builds_or_updates_a_spec_and_names_the_api():
  spec = tpipe.PipelineSpec(2, 4)
  assert spec_lib.make("tpipe.X", spec) is spec
  assert spec_lib.make("tpipe.X", spec, schedule="1f1b") == spec.replace(schedule="1f1b")
  assert spec_lib.make("tpipe.X", num_stages=2, num_microbatches=4) == spec
  with pytest.raises(TypeError, match=r"^tpipe\.X: spec must be a tpipe\.PipelineSpec, got "
                                      r"dict"):
    spec_lib.make("tpipe.X", {"num_stages": 2})
  with pytest.raises(TypeError, match=r"^tpipe\.X: unknown pipeline setting\(s\) \['stages'\]; "
                                      r"the settings are \('num_stages', "):
    spec_lib.make("tpipe.X", stages=2, num_microbatches=4)
  with pytest.raises(TypeError, match=r"^tpipe\.X: Unknown pipeline setting\(s\) \['stages'\]"):
    spec_lib.make("tpipe.X", spec, stages=2)
  with pytest.raises(TypeError, match=r"^tpipe\.X: .*num_microbatches"):
    spec_lib.make("tpipe.X", num_stages=2)  # A required setting missing.


@unit
def test_for_stack_cuts_the_blocks_evenly():
  spec = spec_lib.for_stack("tpipe.pipeline", 12, num_stages=2, num_microbatches=4,
                            schedule="circular", num_repeats=3)
  assert spec.balance == (2,) * 6 and spec.num_chunks == 6
  assert spec_lib.for_stack("tpipe.pipeline", 4, tpipe.PipelineSpec(2, 4)).balance == (2, 2)
  assert spec_lib.layers_per_chunk(12, 4, "tpipe.pipeline") == 3


@unit
@pytest.mark.parametrize("length,settings,match", [
    (5, {}, r"^tpipe\.pipeline: length=5 layers cannot be split evenly into num_stages \* "
            r"num_repeats = 2 chunks; choose a length that is a multiple of 2 or change "
            r"num_stages/num_repeats"),
    (4, dict(balance=[1, 3]), r"^tpipe\.pipeline cuts the blocks evenly over the chunks; "
                              r"balance is for tpipe\.Sequential"),
    (4, dict(schedule="zb_h1"), r"^tpipe\.pipeline returns the blocks' activations, but "
                                r"schedule='zb_h1' runs the backward inside the pipeline.*Use "
                                r"tpipe\.Sequential\(\[tpipe\.Repeat\(block, length\), "
                                r"YourLoss\(\)\], schedule='zb_h1', per_example=\('targets',\), "
                                r"\.\.\.\), or schedule='gpipe'/'circular' here"),
    (4, dict(remat="x"), r"^tpipe\.pipeline: Unknown remat 'x'"),
])
def test_for_stack_errors(length, settings, match):
  with pytest.raises(ValueError, match=match):
    spec_lib.for_stack("tpipe.pipeline", length, num_stages=2, num_microbatches=4, **settings)


@unit
def test_check_functions():
  granularities = ("chunk", "layer", "nested", 3, np.int64(2))
  assert [spec_lib.check_remat_granularity(g) for g in granularities] == [None, 1, 1, 3, 2]
  for remat in ("none", "full", "dots", jax.checkpoint_policies.dots_saveable):
    spec_lib.check_remat(remat)
  for unroll in (1, 4, True, False):
    spec_lib.check_unroll(unroll)
  assert spec_lib.BALANCE_NAMES == ("params", "flops", "time")


def _nnx_layer():
  return nnx.Linear(2, 2, rngs=nnx.Rngs(0))


class _NnxBlock(nnx.Module):

  def __init__(self, rngs):
    self.linear = nnx.Linear(2, 2, rngs=rngs)

  def __call__(self, x):
    return self.linear(x)


_FRONT_ENDS = {
    "tpipe.Sequential": lambda **kw: tpipe.Sequential([nn.Dense(2), nn.Dense(2)], **kw),
    "tpipe.pipeline": lambda **kw: tpipe.pipeline(blocks.MLPBlock, length=2, **kw),
    "tpipe.nnx.Sequential": lambda **kw: tpipe.nnx.Sequential([_nnx_layer(), _nnx_layer()],
                                                              **kw),
    "tpipe.nnx.pipeline": lambda **kw: tpipe.nnx.pipeline(_NnxBlock, length=2, **kw),
}


@pytest.mark.parametrize("api", list(_FRONT_ENDS))
@pytest.mark.parametrize("settings,error,match", [
    (dict(remat="x"), ValueError, "Unknown remat 'x'"),
    (dict(remat_granularity=0), ValueError, "remat_granularity must be >= 1"),
    (dict(unroll=0), ValueError, "unroll must be an int >= 1"),
    (dict(num_microbatches=0), ValueError, "num_microbatches must be >= 1"),
    (dict(schedule="zigzag"), ValueError, "Unknown schedule 'zigzag'"),
    (dict(per_example="x"), TypeError, r"per_example must be a sequence of keyword names, got the "
                                       r"string 'x'; write per_example=\('x',\)"),
])
def test_front_ends_prefix_setting_errors_with_the_api_called(api, settings, error, match):
  kwargs = {"num_stages": 1, "num_microbatches": 2, **settings}
  with pytest.raises(error, match=f"^{api}: {match}"):
    _FRONT_ENDS[api](**kwargs)
  # A spec plus settings that override it: the same check, the same prefix.
  with pytest.raises(error, match=f"^{api}: {match}"):
    _FRONT_ENDS[api](spec=tpipe.PipelineSpec(1, 2), **settings)


def test_a_mesh_of_the_wrong_size_is_named_by_the_front_end():
  mesh = tpipe.make_mesh(stages=4)
  for api in ("tpipe.Sequential", "tpipe.nnx.Sequential"):
    with pytest.raises(ValueError, match=f"^{api}: num_stages=2 but the 'stage' axis of the mesh "
                                         "given has size 4"):
      _FRONT_ENDS[api](num_stages=2, num_microbatches=2, mesh=mesh)


def test_linen_sequential_takes_a_spec_or_settings_and_clone_updates_it():
  spec = tpipe.PipelineSpec(1, 2, remat="dots")
  layers = [nn.Dense(2), nn.Dense(2)]
  assert tpipe.Sequential(layers, spec).spec is spec
  assert tpipe.Sequential(layers, spec=spec).spec is spec
  model = tpipe.Sequential(layers, num_stages=1, num_microbatches=2, remat="dots")
  assert model.spec == spec
  fused = model.clone(schedule="1f1b")
  assert fused.spec == spec.replace(schedule="1f1b") and fused.spec.is_fused
  assert model.spec.schedule == "gpipe"
  with pytest.raises(ValueError, match=r"^tpipe\.Sequential: Unknown remat_granularity 'x'"):
    model.clone(remat_granularity="x")


def test_a_spec_that_is_not_a_spec_is_named_by_the_front_end():
  with pytest.raises(TypeError, match=r"^tpipe\.nnx\.Sequential: spec must be a "
                                      r"tpipe\.PipelineSpec, got str"):
    tpipe.nnx.Sequential([_nnx_layer()], spec="gpipe")
  layers = [nn.Dense(2), nn.Dense(2)]
  for make in (lambda: tpipe.Sequential(layers, spec="gpipe"),
               lambda: tpipe.Sequential(layers, "gpipe")):
    with pytest.raises(TypeError, match=r"^tpipe\.Sequential: spec must be a "
                                        r"tpipe\.PipelineSpec, got str"):
      make()


def test_stack_front_ends_prefix_their_own_checks():
  with pytest.raises(ValueError, match=r"^tpipe\.pipeline\b.*length.* must be >= 1, got 0"):
    tpipe.pipeline(blocks.MLPBlock, length=0, num_stages=1, num_microbatches=1)
  with pytest.raises(ValueError, match=r"^tpipe\.nnx\.pipeline\b.*length.* must be >= 1, got 0"):
    tpipe.nnx.pipeline(_NnxBlock, length=0, num_stages=1, num_microbatches=1)
  with pytest.raises(TypeError, match=r"^tpipe\.pipeline\b.*flax\.linen\.Module class"):
    tpipe.pipeline(nn.Dense(2), length=2, num_stages=1, num_microbatches=1)


@unit
def test_module_doctests_pass():
  result = doctest.testmod(spec_lib)
  assert result.attempted >= 4 and result.failed == 0


@unit
def test_transfer_delay_defaults_to_the_links_that_cross_slices_of_the_mesh():
  assert tpipe.PipelineSpec(4, 2).delays == (0, 0, 0, 0)  # No mesh: nothing to tell slices by.
  one_slice = tpipe.make_mesh(stages=4, data=2)
  assert tpipe.PipelineSpec(4, 2, mesh=one_slice).delays == (0, 0, 0, 0)
  devices = jax.devices()[:8]
  two = tpipe.make_mesh(stages=4, data=2, dcn={"stage": 2}, slices=[devices[:4], devices[4:]])
  spec = tpipe.PipelineSpec(4, 2, schedule="1f1b", mesh=two)
  assert spec.delays == (0, 1, 0, 1)
  assert spec.table is schedules.build("1f1b", 4, 2, delays=(0, 1, 0, 1))
  # Given, it wins; a sequence is kept as a tuple (the spec stays hashable).
  assert spec.replace(transfer_delay=0).delays == (0, 0, 0, 0)
  assert spec.replace(transfer_delay=[1, 0, 0, 0]).transfer_delay == (1, 0, 0, 0)
  assert tpipe.PipelineSpec(4, 2, transfer_delay=1).table.delays == (1, 1, 1, 1)


@unit
def test_tick_costs_build_compound_tables_and_are_checked():
  costs = {"F": 1, "B": 3, "BI": 2, "W": 1}
  spec = tpipe.PipelineSpec(num_stages=4, num_microbatches=8, schedule="1f1b", tick_costs=costs)
  assert spec.tick_costs == (("B", 3.0), ("BI", 2.0), ("F", 1.0), ("W", 1.0))
  assert spec.table is schedules.build("1f1b", 4, 8, 1, None, costs)
  assert spec.table.is_compound and not spec.replace(tick_costs=None).table.is_compound
  hash(spec)  # Held as a tuple: the spec stays hashable.
  with pytest.raises(ValueError, match="forward schedule"):
    spec.replace(schedule="gpipe")
  with pytest.raises(ValueError, match=r"costs\['B'\] must be finite and > 0"):
    spec.replace(tick_costs={"F": 1, "B": 0})
  with pytest.raises(ValueError, match="unknown action 'X'"):
    spec.replace(tick_costs={"F": 1, "X": 2})
  with pytest.raises(TypeError, match="must map action names"):
    spec.replace(tick_costs=[1, 3])
  with pytest.raises(ValueError, match=r"needs \['F', 'BI', 'W'\]"):
    spec.replace(schedule="zbv", num_repeats=2, tick_costs={"F": 1, "B": 3})


@unit
def test_overlapped_micro_batches_need_compound_ticks_of_a_fused_schedule():
  spec = tpipe.PipelineSpec(num_stages=2, num_microbatches=4, schedule="1f1b",
                            overlap_microbatches=True)
  assert spec.overlap_microbatches  # In compound ticks for costs derived when it is built.
  assert spec.replace(schedule="zbv", num_repeats=2).overlap_microbatches
  with pytest.raises(ValueError, match="schedule='gpipe' runs its backward apart: use one of"):
    spec.replace(schedule="gpipe")
  with pytest.raises(ValueError, match="tick_costs='plain' runs one action per tick"):
    spec.replace(tick_costs="plain")
  with pytest.raises(TypeError, match="overlap_microbatches must be True or False, got 1"):
    spec.replace(overlap_microbatches=1)
  assert not spec.replace(overlap_microbatches=False, tick_costs="plain").overlap_microbatches


@unit
def test_weight_recompute_is_for_a_split_backward():
  spec = tpipe.PipelineSpec(num_stages=2, num_microbatches=4, schedule="zb_h1",
                            weight_recompute=True)
  assert spec.weight_recompute == "forward"
  assert spec.replace(schedule="zbv", num_repeats=2).weight_recompute == "forward"
  assert spec.replace(weight_recompute="backward").weight_recompute == "backward"
  assert spec.replace(weight_recompute="none").weight_recompute is False
  with pytest.raises(ValueError, match="schedule='1f1b' has none"):
    spec.replace(schedule="1f1b")
  with pytest.raises(ValueError, match=r"weight_recompute must be True, False or one of \('none'"):
    spec.replace(weight_recompute="yes")
  with pytest.raises(TypeError, match="weight_recompute must be"):
    spec.replace(weight_recompute=1)
