"""tpipe.core.layout.description.StageLayout: which leaves a split keeps stacked, packs
or shares, their staged and local shapes, the chunks' places and windows, and the partition
specs of the staged tree.

Layouts are built from :func:`tpipe.core.planning.plan.group_units` and abstract shapes
(:mod:`tests.helpers.layout_cases`); no value is made.
"""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from tests.helpers import layout_cases as lc
from tests.helpers.shapes import abstract_shapes
from tpipe.core.layout import description as desc
from tpipe.core.layout import packed_places as places
from tpipe.core.layout import staging
from tpipe.core.planning import plan as plan_lib

pytestmark = pytest.mark.unit

F32, I32 = lc.F32, lc.I32


def _shapes(tree):
  return jax.tree.map(lambda a: a.shape, tree)


def test_even_repeat_is_all_stacked():
  layout, _ = lc.case("even_repeat")
  assert layout.stacked == {0: 2} and layout.packed_sizes == {}
  assert _shapes(layout.staged_shapes()) == {
      "stacked": {"layers_0": {"Dense_0": {"kernel": (2, 2, 2, 4, 4), "bias": (2, 2, 2, 4)}}},
      "packed": {}, "shared": {}}
  assert _shapes(layout.local_shapes())["stacked"] == {
      "layers_0": {"Dense_0": {"kernel": (2, 4, 4), "bias": (2, 4)}}}


def test_uneven_repeat_keeps_the_fewest_copies_per_leaf_and_packs_the_rest():
  layout, _ = lc.case("uneven_repeat")
  assert layout.stacked == {1: 2}
  seg = desc.Segment
  assert layout.segments == (
      (seg(group=0, layer=0, first_unit=0, first_copy=0, copies=None, stacked=False),
       seg(group=1, layer=1, first_unit=1, first_copy=0, copies=2, stacked=True)),
      (seg(group=0, layer=1, first_unit=3, first_copy=2, copies=2, stacked=True),
       seg(group=0, layer=1, first_unit=5, first_copy=4, copies=1, stacked=False),
       seg(group=1, layer=2, first_unit=6, first_copy=0, copies=None, stacked=False)))
  # Chunk 0 packs the embedding (20 floats, 3 ints); chunk 1 copy 4 (16 + 4) and the head (10).
  assert [lay.sizes() for lay in layout.packed_layouts] == [{"float32": 20, "int32": 3},
                                                            {"float32": 30}]
  assert layout.packed_sizes == {"float32": 30, "int32": 3}
  assert jax.tree.map(lambda a: (a.shape, a.dtype), layout.staged_shapes()) == {
      "stacked": {"layers_1": {"Dense_0": {"kernel": ((1, 2, 2, 4, 4), F32),
                                           "bias": ((1, 2, 2, 4), F32)}}},
      "packed": {"float32": ((1, 2, 30), F32), "int32": ((1, 2, 3), I32)}, "shared": {}}
  # What chunk 1 packs, whole: its third copy (a run of one) and the head.
  assert _shapes(layout.packed_shapes(1)) == [
      {"Dense_0": {"kernel": (1, 4, 4), "bias": (1, 4)}}, {"kernel": (4, 2), "bias": (2,)}]


def test_plain_layers_and_a_repeat_some_chunk_lacks_are_packed():
  for name in ("plain_layers", "repeat_missing_from_a_chunk"):
    layout, _ = lc.case(name)
    assert layout.stacked == {}
    assert layout.local_shapes()["stacked"] == {}
    assert all(not seg.stacked for chunk in layout.segments for seg in chunk)
  layout, _ = lc.case("repeat_missing_from_a_chunk")
  # Chunk 1 holds the 5 copies (5 x 20 floats) and the head (10).
  assert layout.packed_sizes == {"float32": 110, "int32": 3}


def test_a_stage_packs_its_chunks_one_after_the_other_in_one_buffer():
  # Circular R = 2: chunk 0 (stage 0) packs the embedding (20 floats, 3 ints), chunks 1 and 2
  # one copy each (20 floats), chunk 3 (stage 1) the head (10 floats).
  layout, _ = lc.case("circular_r2")
  assert [lay.sizes() for lay in layout.packed_layouts] == [
      {"float32": 20, "int32": 3}, {"float32": 20}, {"float32": 20}, {"float32": 10}]
  # Stage 0 holds chunks 0 then 2 (40 floats, 3 ints), stage 1 chunks 1 then 3 (30 floats).
  assert layout.packed_slots == 1 and layout.packed_sizes == {"float32": 40, "int32": 3}
  assert layout.packed_offsets == ({"float32": 0, "int32": 0}, {"float32": 0},
                                   {"float32": 20}, {"float32": 20})
  assert layout.packed_windows == ({"float32": 20, "int32": 3}, {"float32": 20},
                                   {"float32": 20}, {"float32": 10})
  assert [layout.packed_place(c) for c in range(4)] == [(0, 0), (0, 1), (0, 0), (0, 1)]
  # A buffer per slot pads each of the R slots to the fullest chunk: 2 x (20 floats, 3 ints).
  per_slot, _ = lc.case("circular_r2", packing="slot")
  assert per_slot.packed_slots == 2 and per_slot.packed_sizes == {"float32": 20, "int32": 3}
  assert [per_slot.packed_place(c) for c in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
  shapes = lambda lay: {k: a.shape for k, a in lay.staged_shapes()["packed"].items()}
  assert shapes(layout) == {"float32": (1, 2, 40), "int32": (1, 2, 3)}
  assert shapes(per_slot) == {"float32": (2, 2, 20), "int32": (2, 2, 3)}
  with pytest.raises(ValueError, match=r"packing must be one of \('stage', 'slot'\), got 'x'"):
    lc.case("circular_r2", packing="x")


def test_chunk_shapes_are_a_window_of_the_packed_buffers():
  layout, _ = lc.case("circular_r2", fsdp=2)
  # Two fsdp blocks: each window is the chunk's elements, rounded up to whole blocks, twice.
  assert layout.packed_shards == 2
  for c in range(4):
    packed = _shapes(layout.chunk_shapes(c)["packed"])
    assert packed == {k: (2 * w,) for k, w in layout.packed_windows[c].items()}
    assert all(2 * w >= n for w, n in zip(layout.packed_windows[c].values(),
                                          layout.packed_layouts[c].sizes().values()))


def test_positions_of_the_loop_and_v_placements():
  loop, _ = lc.case("circular_r2")
  assert [loop.position(c) for c in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
  v, _ = lc.case("zbv")
  assert [v.position(c) for c in range(4)] == [(0, 0), (0, 1), (1, 1), (1, 0)]
  for layout in (loop, v):
    for c in range(4):
      assert layout.chunk_at(*layout.position(c)) == c
  assert loop.stacked == v.stacked == {1: 1}


def test_partition_specs_split_every_leaf_over_the_stage_axis():
  layout, _ = lc.case("uneven_repeat")
  specs = layout.partition_specs("pipe")
  is_spec = lambda s: isinstance(s, P)
  assert jax.tree.structure(specs, is_leaf=is_spec) == jax.tree.structure(layout.local_shapes())
  assert set(jax.tree.leaves(specs, is_leaf=is_spec)) == {P(None, "pipe")}


def test_like_matrices_of_plain_layers_share_a_leaf():
  layout, _ = lc.case("shared_ends")
  (group,) = layout.shared
  # The embedding [5, 4] (chunk 0, stage 0) and the head's kernel [4, 5] (chunk 1), stored
  # transposed, are the two entries of one [1, 2, 5, 4] leaf; the vectors stay packed.
  assert (group.shape, group.slots) == ((5, 4), 1)
  assert [(m.chunk, m.layer, m.path, m.transposed) for m in group.members] == [
      (0, 0, "['embedding']", False), (1, 2, "['kernel']", True)]
  assert layout.staged_shapes()["shared"][group.name].shape == (1, 2, 5, 4)
  assert [lay.sizes() for lay in layout.packed_layouts] == [{"int32": 3}, {"float32": 5}]
  assert [[(k, m.path) for k, _, m in layout.shared_members(c)] for c in range(2)] == [
      [(0, "['embedding']")], [(1, "['kernel']")]]
  # The shared weight is None where the chunk's packed trees would hold it.
  assert layout.without_shared([{"embedding": 1, "count": 2}, {"w": 3}], 0) == [
      {"embedding": None, "count": 2}, {"w": 3}]
  zbv, _ = lc.case("shared_zbv")
  (group,) = zbv.shared
  # Stage 0 holds chunks 0 (a head) and 3 (two heads): three matrices, so three entries.
  assert group.slots == 3 and [m.slot for m in group.members] == [0, 1, 2]
  assert zbv.staged_shapes()["shared"][group.name].shape == (3, 2, 4, 5)


def test_partition_specs_on_an_fsdp_mesh_split_stacked_packed_and_shared_leaves():
  layout, _ = lc.case("shared_ends", fsdp=2)
  (group,) = layout.shared
  specs = layout.partition_specs("stage", mesh=lc.fsdp_mesh(2, 2))
  # Stacked [R, S, k, ...] and shared [P, S, 5, 4] over fsdp on their last (even) axis; packed
  # buffers [P, S, n] in fsdp blocks.
  assert specs == {
      "stacked": {"layers_1": {"Dense_0": {"kernel": P(None, "stage", None, "fsdp"),
                                           "bias": P(None, "stage", None, "fsdp")}}},
      "packed": {"float32": P(None, "stage", "fsdp"), "int32": P(None, "stage", "fsdp")},
      "shared": {group.name: P(None, "stage", None, "fsdp")}}
  # Without fsdp devices only the stage axis splits.
  alone = layout.partition_specs("stage", mesh=lc.fsdp_mesh(1, 2))
  assert set(jax.tree.leaves(alone, is_leaf=lambda s: isinstance(s, P))) == {P(None, "stage")}
  # Packed leaves that no fsdp size divides are cut flat: count [3] and the head's bias [5].
  assert layout.piece_dims(0) == [{"count": places.FLAT, "embedding": None}]
  assert layout.piece_dims(1) == [{"bias": places.FLAT, "kernel": None}]


def test_check_staged_names_the_fix():
  layout, _ = lc.case("uneven_repeat")
  other, _ = lc.case("repeat_missing_from_a_chunk")
  layout.check_staged(layout.staged_shapes())
  with pytest.raises(ValueError, match=r"staged variables have shapes .* but this model's stage "
                                       r"layout needs .*They were made for another split "
                                       r"\(stages, repeats or balance\): convert them with "
                                       r"tpipe\.staging\.to_logical\(that model's layout, \.\.\.\) "
                                       r"and tpipe\.staging\.to_staged\(this one's layout"):
    layout.check_staged(other.staged_shapes())
  with pytest.raises(ValueError, match="params have shapes"):
    layout.check_staged({"layers_0": 1}, what="params")


def test_build_errors():
  groups = plan_lib.group_units([None, None, None], (1, 1, 1))
  shapes = abstract_shapes([lc.head(), lc.head(), lc.head()])
  with pytest.raises(ValueError, match=r"3 chunks for 2 stages x 1 repeats"):
    desc.StageLayout.build(groups, shapes, 2, 1)
  with pytest.raises(ValueError, match=r"Unknown placement 'w'"):
    desc.StageLayout.build(groups, shapes, 3, 1, placement="w")
  with pytest.raises(ValueError, match=r"placement='v' puts exactly 2 chunks on each stage"):
    desc.StageLayout.build(groups, shapes, 3, 1, placement="v")


def test_a_collection_can_reuse_another_layouts_stacked_copies():
  params, shapes = lc.case("uneven_repeat")
  everything_packed, _ = lc.case("uneven_repeat", stacked={})
  assert everything_packed.stacked == {} and params.stacked == {1: 2}
  same, _ = lc.case("uneven_repeat", stacked=params.stacked)
  assert same.segments == params.segments
  logical = lc.values(shapes)
  staged = staging.to_staged(everything_packed, logical)
  lc.assert_equal(staging.to_logical(everything_packed, staged), logical)
  assert jax.tree.leaves(staging.to_staged(everything_packed, logical)["stacked"]) == []
