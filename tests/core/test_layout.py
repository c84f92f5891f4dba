"""tpipe.core.layout.StageLayout: the staged tree's structure and shapes, exact round trips
between logical and staged variables (an even Repeat, uneven copies per chunk, plain layers only,
circular R = 2, ZB-V's "v" placement), one chunk's trees and slot, bytes, and the packed mask.

Layouts are built from :func:`tpipe.core.plan.group_units` and abstract shapes, as the engine
builds them; no model is traced.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tpipe.core import layout as layout_lib
from tpipe.core import packed_places as places
from tpipe.core import plan as plan_lib
from tpipe.core import staging
from tests.helpers.shapes import abstract_shapes

StageLayout = layout_lib.StageLayout
F32, I32 = jnp.float32, jnp.int32


def _embed():
  return {"embedding": ((5, 4), F32), "count": ((3,), I32)}


def _block(n):
  return {"Dense_0": {"kernel": ((n, 4, 4), F32), "bias": ((n, 4), F32)}}


def _head():
  return {"kernel": ((4, 2), F32), "bias": ((2,), F32)}


def _wide_head():
  return {"kernel": ((4, 5), F32), "bias": ((5,), F32)}


def _values(shapes):
  """Logical values with every element distinct (exact in float32 and int32)."""
  leaves, treedef = jax.tree.flatten(shapes)
  out, start = [], 1
  for leaf in leaves:
    size = int(np.prod(leaf.shape))
    out.append(jnp.asarray(np.arange(start, start + size).reshape(leaf.shape), leaf.dtype))
    start += size
  return jax.tree.unflatten(treedef, out)


# name: (layers, which of them are repeated (index -> copies), counts, num_stages, num_repeats,
# placement).
CASES = {
    # Every chunk two copies: the staged leaf is the logical one reshaped.
    "even_repeat": ([_block(8)], {0: 8}, (2, 2, 2, 2), 2, 2, "loop"),
    # Chunks with 2 and 3 copies: 2 stay per leaf, the third goes to the packed buffers.
    "uneven_repeat": ([_embed(), _block(5), _head()], {1: 5}, (3, 4), 2, 1, "loop"),
    # A chunk without copies: the repeated layer is packed whole.
    "repeat_missing_from_a_chunk": ([_embed(), _block(5), _head()], {1: 5}, (1, 6), 2, 1,
                                    "loop"),
    # Plain layers only (one without variables): everything packed.
    "plain_layers": ([_embed(), _head(), {}, _head()], {}, (2, 2), 2, 1, "loop"),
    # Circular, two chunks per stage; 1 or 2 copies per chunk.
    "circular_r2": ([_embed(), _block(6), _head()], {1: 6}, (2, 2, 2, 2), 2, 2, "loop"),
    # ZB-V: chunk 2 on stage 1, chunk 3 (with the head) on stage 0.
    "zbv": ([_embed(), _block(6), _head()], {1: 6}, (2, 2, 2, 2), 2, 2, "v"),
    # An even Repeat in the "v" placement: not a plain reshape any more.
    "even_repeat_v": ([_block(8)], {0: 8}, (2, 2, 2, 2), 2, 2, "v"),
    # An embedding on stage 0 and a head (its kernel the embedding's transpose) on stage 1: the
    # two matrices share one leaf; the vectors stay packed.
    "shared_ends": ([_embed(), _block(4), _wide_head()], {1: 4}, (3, 3), 2, 1, "loop"),
    # Two chunks per stage (ZB-V) and two like matrices on stage 0: two entries per stage.
    "shared_zbv": ([_wide_head(), _block(4), _wide_head(), _wide_head()], {1: 4},
                   (2, 1, 1, 3), 2, 2, "v"),
}


def _fsdp_mesh(fsdp, num_stages):
  """An abstract mesh with ``fsdp`` devices per stage (the packed buffers' blocks)."""
  return jax.sharding.AbstractMesh((1, fsdp, num_stages, 1), ("data", "fsdp", "stage", "tensor"))


def _case(name, stacked=None, fsdp=1, packing="stage"):
  layers, repeated, counts, num_stages, num_repeats, placement = CASES[name]
  copies = [repeated.get(i) for i in range(len(layers))]
  groups = plan_lib.group_units(copies, counts)
  shapes = abstract_shapes(layers)
  layout = StageLayout.build(groups, shapes, num_stages, num_repeats, placement=placement,
                             stacked=stacked, mesh=_fsdp_mesh(fsdp, num_stages),
                             packing=packing)
  return layout, shapes


# fsdp 2 cuts the test leaves along a dimension; fsdp 3 divides none of them (flat pieces).
FSDP = [1, 2, 3]
# A stage's chunks in one packed buffer (parameters), or a buffer per chunk slot (statistics).
PACKINGS = list(layout_lib.PACKINGS)


def _assert_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _drop_empty(tree):
  return {k: v for k, v in tree.items() if jax.tree.leaves(v)}


# --------------------------------------------------------------------------------------------
# Structure and shapes (abstract only).


@pytest.mark.unit
def test_even_repeat_is_all_stacked():
  layout, _ = _case("even_repeat")
  assert layout.stacked == {0: 2} and layout.packed_sizes == {}
  assert jax.tree.map(lambda a: a.shape, layout.staged_shapes()) == {
      "stacked": {"layers_0": {"Dense_0": {"kernel": (2, 2, 2, 4, 4), "bias": (2, 2, 2, 4)}}},
      "packed": {}, "shared": {}}
  assert jax.tree.map(lambda a: a.shape, layout.local_shapes())["stacked"] == {
      "layers_0": {"Dense_0": {"kernel": (2, 4, 4), "bias": (2, 4)}}}
  assert staging.is_uniform(layout, 0)


@pytest.mark.unit
def test_uneven_repeat_keeps_the_fewest_copies_per_leaf_and_packs_the_rest():
  layout, _ = _case("uneven_repeat")
  assert layout.stacked == {1: 2}
  seg = layout_lib.Segment
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
  assert not staging.is_uniform(layout, 1)


@pytest.mark.unit
def test_plain_layers_and_a_repeat_some_chunk_lacks_are_packed():
  for name in ("plain_layers", "repeat_missing_from_a_chunk"):
    layout, _ = _case(name)
    assert layout.stacked == {}
    assert layout.local_shapes()["stacked"] == {}
    assert all(not seg.stacked for chunk in layout.segments for seg in chunk)
  layout, _ = _case("repeat_missing_from_a_chunk")
  # Chunk 1 holds the 5 copies (5 x 20 floats) and the head (10).
  assert layout.packed_sizes == {"float32": 110, "int32": 3}


@pytest.mark.unit
def test_a_stage_packs_its_chunks_one_after_the_other_in_one_buffer():
  # Circular R = 2: chunk 0 (stage 0) packs the embedding (20 floats, 3 ints), chunks 1 and 2
  # one copy each (20 floats), chunk 3 (stage 1) the head (10 floats).
  layout, _ = _case("circular_r2")
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
  per_slot, _ = _case("circular_r2", packing="slot")
  assert per_slot.packed_slots == 2 and per_slot.packed_sizes == {"float32": 20, "int32": 3}
  assert [per_slot.packed_place(c) for c in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
  shapes = lambda lay: {k: a.shape for k, a in lay.staged_shapes()["packed"].items()}
  assert shapes(layout) == {"float32": (1, 2, 40), "int32": (1, 2, 3)}
  assert shapes(per_slot) == {"float32": (2, 2, 20), "int32": (2, 2, 3)}
  assert layout.stage_bytes() == 2 * 20 * 4 + (40 + 3) * 4
  assert per_slot.stage_bytes() == 2 * 20 * 4 + 2 * (20 + 3) * 4
  with pytest.raises(ValueError, match=r"packing must be one of \('stage', 'slot'\), got 'x'"):
    _case("circular_r2", packing="x")


@pytest.mark.unit
def test_positions_of_the_loop_and_v_placements():
  loop, _ = _case("circular_r2")
  assert [loop.position(c) for c in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
  v, _ = _case("zbv")
  assert [v.position(c) for c in range(4)] == [(0, 0), (0, 1), (1, 1), (1, 0)]
  for layout in (loop, v):
    for c in range(4):
      assert layout.chunk_at(*layout.position(c)) == c
  assert loop.stacked == v.stacked == {1: 1}


@pytest.mark.unit
def test_partition_specs_split_every_leaf_over_the_stage_axis():
  layout, _ = _case("uneven_repeat")
  specs = layout.partition_specs("pipe")
  assert jax.tree.structure(specs, is_leaf=lambda s: isinstance(s, P)) == jax.tree.structure(
      layout.local_shapes())
  assert set(jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))) == {P(None, "pipe")}


@pytest.mark.unit
def test_chunk_bytes_stage_bytes_and_elements():
  layout, _ = _case("uneven_repeat")
  # Chunk 0: embedding 20 floats + 3 ints, 2 copies of 20 floats; chunk 1: 3 copies and the head.
  assert layout.chunk_bytes() == [(20 + 3 + 2 * 20) * 4, (3 * 20 + 10) * 4]
  # A stage: 2 stacked copies, 30 packed floats and 3 packed ints, whatever its chunk.
  assert layout.stage_bytes() == (2 * 20 + 30 + 3) * 4
  block = {"Dense_0": {"kernel": 32, "bias": 8}}
  assert layout.chunk_elements() == [
      {"stacked": {"layers_1": block}, "packed": {"float32": 20, "int32": 3}, "shared": {}},
      {"stacked": {"layers_1": block}, "packed": {"float32": 30, "int32": 0}, "shared": {}}]
  even, _ = _case("even_repeat")
  assert even.chunk_bytes() == [2 * 20 * 4] * 4 and even.stage_bytes() == 2 * 2 * 20 * 4


@pytest.mark.unit
def test_like_matrices_of_plain_layers_share_a_leaf():
  layout, _ = _case("shared_ends")
  (group,) = layout.shared
  # The embedding [5, 4] (chunk 0, stage 0) and the head's kernel [4, 5] (chunk 1), stored
  # transposed, are the two entries of one [1, 2, 5, 4] leaf; the vectors stay packed.
  assert (group.shape, group.slots) == ((5, 4), 1)
  assert [(m.chunk, m.layer, m.path, m.transposed) for m in group.members] == [
      (0, 0, "['embedding']", False), (1, 2, "['kernel']", True)]
  assert layout.staged_shapes()["shared"][group.name].shape == (1, 2, 5, 4)
  assert [lay.sizes() for lay in layout.packed_layouts] == [{"int32": 3}, {"float32": 5}]
  # Per device what packing them would take: 2 stacked copies, one entry for the matrix of
  # each stage, and the packed vectors (5 floats on stage 1, 3 ints on stage 0).
  assert layout.stage_bytes() == (2 * 20 + 20 + 5 + 3) * 4
  assert [e["shared"] for e in layout.chunk_elements()] == [{group.name: 20}] * 2
  zbv, _ = _case("shared_zbv")
  (group,) = zbv.shared
  # Stage 0 holds chunks 0 (a head) and 3 (two heads): three matrices, so three entries.
  assert group.slots == 3 and [m.slot for m in group.members] == [0, 1, 2]
  assert zbv.staged_shapes()["shared"][group.name].shape == (3, 2, 4, 5)


@pytest.mark.unit
def test_build_errors():
  groups = plan_lib.group_units([None, None, None], (1, 1, 1))
  shapes = abstract_shapes([_head(), _head(), _head()])
  with pytest.raises(ValueError, match=r"3 chunks for 2 stages x 1 repeats"):
    StageLayout.build(groups, shapes, 2, 1)
  with pytest.raises(ValueError, match=r"Unknown placement 'w'"):
    StageLayout.build(groups, shapes, 3, 1, placement="w")
  with pytest.raises(ValueError, match=r"placement='v' puts exactly 2 chunks on each stage"):
    StageLayout.build(groups, shapes, 3, 1, placement="v")


# --------------------------------------------------------------------------------------------
# Values: exact round trips.


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("fsdp", FSDP)
@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_is_exact(name, fsdp, packing):
  layout, shapes = _case(name, fsdp=fsdp, packing=packing)
  logical = _values(shapes)
  staged = layout.to_staged(_drop_empty(logical))  # Flax omits a layer without variables.
  assert jax.tree.map(lambda a: (a.shape, a.dtype), staged) == jax.tree.map(
      lambda a: (a.shape, a.dtype), layout.staged_shapes())
  layout.check_staged(staged)
  _assert_equal(layout.to_logical(staged), logical)
  # Every logical element is somewhere in the staged tree, once (the rest is zero padding).
  staged_values = np.concatenate([np.asarray(a, np.int64).ravel()
                                  for a in jax.tree.leaves(staged)])
  logical_values = np.concatenate([np.asarray(a, np.int64).ravel()
                                   for a in jax.tree.leaves(logical)])
  assert sorted(staged_values[staged_values != 0].tolist()) == sorted(logical_values.tolist())


@pytest.mark.parametrize("name", ["even_repeat", "circular_r2"])
def test_an_even_repeat_is_staged_by_a_reshape(name):
  layout, shapes = _case(name)
  logical = _values(shapes)
  staged = layout.to_staged(logical)
  index = 0 if name == "even_repeat" else 1
  k = layout.stacked[index]
  if name == "even_repeat":
    want = jax.tree.map(lambda a: a.reshape((2, 2, k) + a.shape[1:]), logical["layers_0"])
    _assert_equal(staged["stacked"]["layers_0"], want)
  else:
    # Copies per chunk 1, 2, 2, 1: the first copy of each chunk is stacked, in chunk order.
    firsts = [0, 1, 3, 5]
    want = jax.tree.map(lambda a: a[np.array(firsts)].reshape((2, 2, 1) + a.shape[1:]),
                        logical["layers_1"])
    _assert_equal(staged["stacked"]["layers_1"], want)


def test_zbv_puts_chunk_3_on_stage_0():
  layout, shapes = _case("zbv")
  logical = _values(shapes)
  staged = layout.to_staged(logical)
  kernel = staged["stacked"]["layers_1"]["Dense_0"]["kernel"]
  block = logical["layers_1"]["Dense_0"]["kernel"]
  # Chunks hold copies 0 | 1, 2 | 3, 4 | 5: the first copy of each is stacked.
  np.testing.assert_array_equal(kernel[0, 0, 0], block[0])  # chunk 0: stage 0, local chunk 0
  np.testing.assert_array_equal(kernel[0, 1, 0], block[1])  # chunk 1: stage 1, local chunk 0
  np.testing.assert_array_equal(kernel[1, 1, 0], block[3])  # chunk 2: stage 1, local chunk 1
  np.testing.assert_array_equal(kernel[1, 0, 0], block[5])  # chunk 3: stage 0, local chunk 1
  # The head is in chunk 3's packed slot: stage 0, local chunk 1.
  head = layout.chunk_trees(layout.chunk_local(staged, 3), 3)[-1]
  _assert_equal(head, logical["layers_2"])


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("fsdp", FSDP)
@pytest.mark.parametrize("name", list(CASES))
def test_chunk_trees_and_chunk_slot_are_inverse(name, fsdp, packing):
  layout, shapes = _case(name, fsdp=fsdp, packing=packing)
  logical = _values(shapes)
  staged = layout.to_staged(_drop_empty(logical))
  for c in range(layout.num_chunks):
    local = layout.chunk_local(staged, c)
    assert jax.tree.map(lambda a: a.shape, local) == jax.tree.map(lambda a: a.shape,
                                                                  layout.chunk_shapes(c))
    trees = layout.chunk_trees(local, c)
    assert len(trees) == len(layout.segments[c])
    for seg, tree in zip(layout.segments[c], trees):
      want = logical[f"layers_{seg.layer}"]
      if seg.copies is not None:
        want = jax.tree.map(lambda a, seg=seg: a[seg.first_copy:seg.first_copy + seg.copies],
                            want)
      _assert_equal(tree, want)
    # A stage's shared entries hold its other chunks' matrices too: compare the chunk's own.
    own = {g.name: np.zeros(g.slots, bool) for g in layout.shared}
    for _, g, m in layout.shared_members(c):
      own[g.name][m.slot] = True
    mine = lambda tree: {**tree, "shared": {k: jnp.where(
        own[k].reshape((-1,) + (1,) * (a.ndim - 1)), a, 0) for k, a in tree["shared"].items()}}
    _assert_equal(layout.chunk_slot(trees, c), mine(local))
    # The same trees from the slot's whole buffers, the window's start given.
    p, s = layout.packed_place(c)
    whole = {k: a[p, s] for k, a in staged["packed"].items()}
    at_start = layout.chunk_trees({**local, "packed": whole}, c, at=layout.packed_offsets[c])
    _assert_equal(at_start, trees)


def test_a_collection_can_reuse_another_layouts_stacked_copies():
  params, shapes = _case("uneven_repeat")
  everything_packed, _ = _case("uneven_repeat", stacked={})
  assert everything_packed.stacked == {} and params.stacked == {1: 2}
  same, _ = _case("uneven_repeat", stacked=params.stacked)
  assert same.segments == params.segments
  logical = _values(shapes)
  _assert_equal(everything_packed.to_logical(everything_packed.to_staged(logical)), logical)


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("fsdp", FSDP)
def test_packed_mask_selects_exactly_the_elements_of_the_chosen_leaves(fsdp, packing):
  for name in CASES:
    layout, shapes = _case(name, fsdp=fsdp, packing=packing)
    seen = set()

    def is_kernel(path, seen=seen):
      seen.add(getattr(path[-1], "key", None))
      return getattr(path[-1], "key", None) == "kernel"

    masks = layout.packed_mask(is_kernel)
    assert set(masks) == set(layout.packed_sizes)
    if layout.packed_sizes:
      assert seen <= {"embedding", "count", "kernel", "bias"} and "bias" in seen
    # Kernels hold 1, every other leaf 2, padding 0: the mask is where the buffers hold 1.
    marked = jax.tree_util.tree_map_with_path(
        lambda path, a: jnp.full(a.shape, 1 if path[-1].key == "kernel" else 2, a.dtype), shapes)
    staged = layout.to_staged(_drop_empty(marked))
    for dtype, buffer in staged["packed"].items():
      mask = masks[dtype](buffer.shape)
      assert mask.shape == buffer.shape and mask.dtype == jnp.bool_
      np.testing.assert_array_equal(mask, np.asarray(buffer) == 1, err_msg=f"{name} {dtype}")


def test_packed_blocks_hold_whole_rows_of_each_leaf_on_an_fsdp_mesh():
  # Two fsdp blocks per buffer: block f holds piece f of every packed leaf, cut along the
  # leaf's largest even dimension (embedding [5, 4]: columns; head kernel [4, 2]: rows), or
  # its flattened elements where none divides (head bias [2] divides; count [3] does not).
  layout, shapes = _case("uneven_repeat", fsdp=2)
  assert layout.packed_shards == 2
  assert all(n % 2 == 0 for n in layout.packed_sizes.values())
  logical = _values(shapes)
  staged = layout.to_staged(logical)
  buffer = np.asarray(staged["packed"]["float32"][0, 0])  # Chunk 0 packs the embedding.
  half = buffer.shape[0] // 2
  embedding = np.asarray(logical["layers_0"]["embedding"])
  blocks = [buffer[:half], buffer[half:]]
  for f in range(2):
    assert set(embedding[:, 2 * f:2 * f + 2].ravel()) <= set(blocks[f].tolist())
    assert not set(embedding[:, 2 * (1 - f):2 * (1 - f) + 2].ravel()) & set(blocks[f].tolist())
  dims = dict(zip(["count", "embedding"], layout.packed_dims[0][:2]))
  assert dims == {"count": places.FLAT, "embedding": 1}


def test_check_staged_names_the_fix():
  layout, shapes = _case("uneven_repeat")
  other, _ = _case("repeat_missing_from_a_chunk")
  staged = other.to_staged(_values(shapes))
  with pytest.raises(ValueError, match=r"staged variables have shapes .* but this model's stage "
                                       r"layout needs .*They were made for another split "
                                       r"\(stages, repeats or balance\): convert them with that "
                                       r"model's layout\.to_logical\(\.\.\.\) and this one's "
                                       r"to_staged\(\.\.\.\)"):
    layout.to_logical(staged)
  with pytest.raises(ValueError, match="params have shapes"):
    layout.check_staged({"layers_0": 1}, what="params")


def test_missing_variables_of_a_layer_that_has_some_are_an_error():
  layout, shapes = _case("uneven_repeat")
  logical = _values(shapes)
  del logical["layers_2"]
  with pytest.raises(ValueError, match=r"the variables hold no 'layers_2', which has "
                                       r"\{'bias': \(2,\), 'kernel': \(4, 2\)\}"):
    layout.to_staged(logical)
