"""tpipe.core.layout.packed_places: chunk positions, windows in packed buffers, fsdp pieces of
packed
leaves and element ranges."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpipe
from tpipe.core.base import packing
from tpipe.core.layout import packed_places as places


@pytest.mark.unit
def test_position_in_loop_and_v_placement():
  assert [places.position(c, 3, "loop") for c in range(6)] == [
      (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
  assert [places.position(c, 3, "v") for c in range(6)] == [
      (0, 0), (0, 1), (0, 2), (1, 2), (1, 1), (1, 0)]


def _layouts(*sizes):
  """One packing layout per chunk: a float32 leaf of ``n`` elements and, where given, an int32
  leaf of ``m``."""
  out = []
  for n, m in sizes:
    tree = {"w": jax.ShapeDtypeStruct((n,), jnp.float32)}
    if m:
      tree["i"] = jax.ShapeDtypeStruct((m,), jnp.int32)
    out.append(packing.layout_of(tree))
  return out


@pytest.mark.unit
def test_windows_with_one_buffer_per_stage():
  # Chunks 0, 1 on stages 0, 1 (r = 0); chunks 2, 3 after them on stages 1, 0 (v placement).
  layouts = _layouts((5, 0), (3, 2), (4, 1), (6, 0))
  offsets, windows, block = places.windows(layouts, 2, 2, "v", "stage")
  assert offsets == ({"float32": 0}, {"float32": 0, "int32": 0}, {"float32": 3, "int32": 2},
                     {"float32": 5})
  assert windows == ({"float32": 5}, {"float32": 3, "int32": 2}, {"float32": 4, "int32": 1},
                     {"float32": 6})
  assert block == {"float32": 11, "int32": 3}  # Stage 0: 5 + 6; stage 1: 2 + 1.


@pytest.mark.unit
def test_windows_with_one_slot_per_chunk():
  layouts = _layouts((5, 0), (3, 2))
  offsets, windows, block = places.windows(layouts, 2, 1, "loop", "slot")
  assert block == {"float32": 5, "int32": 2}  # Padded to the fullest chunk.
  assert offsets == ({"float32": 0, "int32": 0},) * 2
  assert windows == (block, block)


def test_window_reads_the_same_range_of_every_block():
  buffers = {"float32": jnp.arange(12.0)}  # 2 blocks of 6.
  part = places.window(buffers, {"float32": 1}, {"float32": 3}, 2)
  np.testing.assert_array_equal(part["float32"], [1, 2, 3, 7, 8, 9])
  traced = jax.jit(lambda start: places.window(buffers, {"float32": start}, {"float32": 2}, 2))
  np.testing.assert_array_equal(traced(4)["float32"], [4, 5, 10, 11])


def test_range_mask():
  mask = places.range_mask({(0, 0): [(1, 3)], (0, 1): [(0, 1), (4, 5)]}, 1, 2)
  np.testing.assert_array_equal(mask((1, 2, 6))[0], [[0, 1, 1, 0, 0, 0], [1, 0, 0, 0, 1, 0]])
  assert not np.any(places.range_mask({}, 1, 1)((1, 1, 3)))


@pytest.mark.unit
def test_piece_shapes():
  assert places.piece_shape((6, 4), 0, 2) == (3, 4)
  assert places.piece_shape((6, 4), 1, 4) == (6, 1)
  assert places.piece_shape((5, 3), places.FLAT, 4) == (4,)  # 15 elements, padded to 16.


@pytest.mark.parametrize("shape,dim,shards", [((6, 4), 0, 2), ((6, 4), 1, 4), ((2, 3, 4), 2, 2),
                                              ((5, 3), places.FLAT, 4), ((7,), places.FLAT, 2)])
def test_cut_and_join_pieces_round_trip(shape, dim, shards):
  leaf = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
  pieces = places.cut_pieces(leaf, dim, shards)
  assert pieces.shape == (shards,) + places.piece_shape(shape, dim, shards)
  np.testing.assert_array_equal(places.join_pieces(pieces, dim, shape), leaf)
  if dim != places.FLAT:  # Piece f is the f-th even part along dim.
    np.testing.assert_array_equal(pieces[1], np.split(np.asarray(leaf), shards, axis=dim)[1])
  else:  # The flattened elements, zero-padded at the end.
    np.testing.assert_array_equal(pieces.reshape(-1)[:leaf.size], np.arange(leaf.size))
    assert not np.any(pieces.reshape(-1)[leaf.size:])


def test_cut_dim():
  mesh = tpipe.make_mesh(stages=1, fsdp=2)
  assert places.cut_dim((6, 4), None, 1, mesh, None) == 0
  assert places.cut_dim((), None, 1, mesh, None) == places.FLAT
  # Unnamed: the largest dimension that divides evenly (the first of equals).
  assert places.cut_dim((3, 8), None, 2, mesh, None) == 1
  assert places.cut_dim((4, 4), None, 2, mesh, None) == 0
  assert places.cut_dim((3, 5), None, 2, mesh, None) == places.FLAT
  # Named: where the weight's partition spec puts fsdp.
  rules = (("embed", "fsdp"), ("mlp", None))
  assert places.cut_dim((8, 4), ("mlp", "embed"), 2, mesh, rules) == 1
