"""tpipe.core.layout.pack: one chunk's variables packed into its window of the packed buffers
and back (whole, from the slot's whole buffers at the window's offset, or one fsdp block's
pieces), and a chunk's trees from what it reads and the slot holding them; all exact, on the
small layouts of :mod:`tests.helpers.layout_cases`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import layout_cases as lc
from tpipe.core.layout import pack as layout_pack
from tpipe.core.layout import packed_places as places
from tpipe.core.layout import staging


def _segment_trees(layout, logical, chunk):
  """Model chunk ``chunk``'s logical trees, one per segment."""
  trees = []
  for seg in layout.segments[chunk]:
    tree = logical[f"layers_{seg.layer}"]
    if seg.copies is not None:
      tree = jax.tree.map(lambda a, seg=seg: a[seg.first_copy:seg.first_copy + seg.copies], tree)
    trees.append(tree)
  return trees


def _packed_trees(layout, logical, chunk):
  """Model chunk ``chunk``'s packed segments' trees, whole, and the same without the weights
  that shared leaves hold (None there)."""
  trees = _segment_trees(layout, logical, chunk)
  without = layout.without_shared(trees, chunk)
  packed = [not seg.stacked for seg in layout.segments[chunk]]
  return ([t for t, p in zip(trees, packed) if p], [t for t, p in zip(without, packed) if p])


@pytest.mark.parametrize("fsdp", lc.FSDP)
def test_pack_chunk_and_unpack_chunk_are_inverse(fsdp):
  for name in ("uneven_repeat", "circular_r2", "plain_layers"):
    layout, shapes = lc.case(name, fsdp=fsdp)
    logical = lc.values(shapes)
    for c in range(layout.num_chunks):
      trees, without = _packed_trees(layout, logical, c)
      window = layout_pack.pack_chunk(layout, trees, c)
      # The window: per dtype, fsdp blocks of the chunk's window width each.
      want = {k: (fsdp * w,) for k, w in layout.packed_windows[c].items()}
      assert {k: a.shape for k, a in window.items()} == want, (name, c)
      lc.assert_equal(layout_pack.unpack_chunk(layout, window, c), without)
      # Nothing but the chunk's packed elements and zero padding.
      flat = np.concatenate([np.asarray(a, np.int64) for a in window.values()] + [[0]])
      leaves = [np.asarray(a, np.int64).ravel() for a in jax.tree.leaves(without)] + [[]]
      assert sorted(flat[flat != 0].tolist()) == sorted(np.concatenate(leaves).tolist())


def test_block_f_holds_piece_f_of_every_leaf():
  # Two fsdp blocks: chunk 0 packs the embedding [5, 4] (cut along its columns) and count [3]
  # (no dimension divides: flat pieces of 2, the second padded).
  layout, shapes = lc.case("uneven_repeat", fsdp=2)
  logical = lc.values(shapes)
  dims = dict(zip(["count", "embedding"], layout.packed_dims[0]))
  assert dims == {"count": places.FLAT, "embedding": 1}
  window = layout_pack.pack_chunk(layout, [logical["layers_0"]], 0)
  embedding = np.asarray(logical["layers_0"]["embedding"])
  floats = np.asarray(window["float32"]).reshape(2, -1)
  ints = np.asarray(window["int32"]).reshape(2, -1)
  np.testing.assert_array_equal(floats[0], embedding[:, :2].ravel())
  np.testing.assert_array_equal(floats[1], embedding[:, 2:].ravel())
  np.testing.assert_array_equal(ints, [[1, 2], [3, 0]])
  # Read from one block, each leaf comes back as that block's piece.
  for f in range(2):
    one = {k: a.reshape(2, -1)[f] for k, a in window.items()}
    (piece,) = layout_pack.unpack_chunk(layout, one, 0, blocks=1)
    np.testing.assert_array_equal(piece["embedding"], embedding[:, 2 * f:2 * f + 2])
    np.testing.assert_array_equal(piece["count"], [[1, 2], [3, 0]][f])
  # Read as three blocks: neither all nor one, refused before any buffer is read.
  with pytest.raises(ValueError, match="packed buffers hold 2 blocks; read all or one, not 3"):
    layout_pack.unpack_chunk(layout, window, 0, blocks=3)


def test_a_chunk_without_packed_leaves_has_an_empty_window():
  layout, _ = lc.case("even_repeat")
  assert layout_pack.pack_chunk(layout, [], 0) == {}
  assert layout_pack.unpack_chunk(layout, {}, 0) == []


def test_shared_weights_are_left_out_of_the_window_and_read_from_their_entry():
  layout, shapes = lc.case("shared_ends")
  logical = lc.values(shapes)
  head = logical["layers_2"]
  (group,) = layout.shared
  window = layout_pack.pack_chunk(layout, [head], 1)
  np.testing.assert_array_equal(window["float32"], head["bias"])  # The kernel is shared.
  slot = layout_pack.chunk_slot(layout, [{"Dense_0": {}}, head], 1)
  # Chunk 1's slot: its kernel transposed in its entry, the other entries zeros.
  entries = np.asarray(slot["shared"][group.name])
  assert entries.shape == (1, 5, 4)
  np.testing.assert_array_equal(entries[0], np.asarray(head["kernel"]).T)
  local = {"stacked": {}, "packed": window, "shared": slot["shared"]}
  local["stacked"] = {"layers_1": jax.tree.map(lambda a: a[:2], logical["layers_1"])}
  trees = layout_pack.chunk_trees(layout, local, 1)
  lc.assert_equal(trees[1], head)
  canonical = layout_pack.chunk_trees(layout, local, 1, canonical=True)
  np.testing.assert_array_equal(canonical[1]["kernel"], np.asarray(head["kernel"]).T)
  # Another entry given for the weight (a program that serves several chunks).
  moved = {**local, "shared": {group.name: jnp.stack([jnp.ones((5, 4)), entries[0]])}}
  slots = {(group.name, 2, "['kernel']"): 0}
  other = layout_pack.chunk_trees(layout, moved, 1, shared_slots=slots)
  np.testing.assert_array_equal(other[1]["kernel"], np.ones((4, 5)))


@pytest.mark.parametrize("packing", lc.PACKINGS)
@pytest.mark.parametrize("fsdp", lc.FSDP)
@pytest.mark.parametrize("name", list(lc.CASES))
def test_chunk_trees_and_chunk_slot_are_inverse(name, fsdp, packing):
  layout, shapes = lc.case(name, fsdp=fsdp, packing=packing)
  logical = lc.values(shapes)
  staged = staging.to_staged(layout, lc.drop_empty(logical))
  for c in range(layout.num_chunks):
    local = layout.chunk_local(staged, c)
    assert jax.tree.map(lambda a: a.shape, local) == jax.tree.map(lambda a: a.shape,
                                                                  layout.chunk_shapes(c))
    trees = layout_pack.chunk_trees(layout, local, c)
    lc.assert_equal(trees, _segment_trees(layout, logical, c))
    # A stage's shared entries hold its other chunks' matrices too: compare the chunk's own.
    own = {g.name: np.zeros(g.slots, bool) for g in layout.shared}
    for _, g, m in layout.shared_members(c):
      own[g.name][m.slot] = True
    mine = lambda tree: {**tree, "shared": {k: jnp.where(
        own[k].reshape((-1,) + (1,) * (a.ndim - 1)), a, 0) for k, a in tree["shared"].items()}}
    lc.assert_equal(layout_pack.chunk_slot(layout, trees, c), mine(local))
    # The same trees from the slot's whole buffers, the window's start given.
    p, s = layout.packed_place(c)
    whole = {k: a[p, s] for k, a in staged["packed"].items()}
    at_start = layout_pack.chunk_trees(layout, {**local, "packed": whole}, c,
                                       at=layout.packed_offsets[c])
    lc.assert_equal(at_start, trees)
