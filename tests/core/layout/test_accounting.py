"""tpipe.core.layout.accounting: bytes per chunk and stage (padding included), each chunk's own
elements of the staged leaves, and the masks of chosen leaves in the packed buffers and shared
leaves, as exact counts on small layouts (:mod:`tests.helpers.layout_cases`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import layout_cases as lc
from tpipe.core.layout import accounting
from tpipe.core.layout import staging


def _key(path):
  return getattr(path[-1], "key", None)


@pytest.mark.unit
def test_tree_bytes_counts_each_leaf_by_its_dtype():
  tree = {"a": jax.ShapeDtypeStruct((3, 4), jnp.float32), "b": np.zeros(5, jnp.bfloat16),
          "c": np.zeros((2,), np.int8)}
  assert accounting.tree_bytes(tree) == 3 * 4 * 4 + 5 * 2 + 2
  assert accounting.tree_bytes({}) == 0


@pytest.mark.unit
def test_chunk_bytes_stage_bytes_and_elements():
  layout, _ = lc.case("uneven_repeat")
  # Chunk 0: embedding 20 floats + 3 ints, 2 copies of 20 floats; chunk 1: 3 copies and the head.
  assert accounting.chunk_bytes(layout) == [(20 + 3 + 2 * 20) * 4, (3 * 20 + 10) * 4]
  # A stage: 2 stacked copies, 30 packed floats and 3 packed ints, whatever its chunk.
  assert accounting.stage_bytes(layout) == (2 * 20 + 30 + 3) * 4
  block = {"Dense_0": {"kernel": 32, "bias": 8}}
  assert accounting.chunk_elements(layout) == [
      {"stacked": {"layers_1": block}, "packed": {"float32": 20, "int32": 3}, "shared": {}},
      {"stacked": {"layers_1": block}, "packed": {"float32": 30, "int32": 0}, "shared": {}}]
  even, _ = lc.case("even_repeat")
  assert accounting.chunk_bytes(even) == [2 * 20 * 4] * 4
  assert accounting.stage_bytes(even) == 2 * 2 * 20 * 4


@pytest.mark.unit
def test_stage_bytes_of_one_buffer_per_stage_or_per_slot():
  # Circular R = 2: 2 stacked copies per stage; stage 0 packs 40 floats and 3 ints in one
  # buffer, or each of its 2 slots 20 floats and 3 ints.
  layout, _ = lc.case("circular_r2")
  per_slot, _ = lc.case("circular_r2", packing="slot")
  assert accounting.stage_bytes(layout) == 2 * 20 * 4 + (40 + 3) * 4
  assert accounting.stage_bytes(per_slot) == 2 * 20 * 4 + 2 * (20 + 3) * 4


@pytest.mark.unit
def test_shared_leaves_in_bytes_and_elements():
  layout, _ = lc.case("shared_ends")
  (group,) = layout.shared
  # Per device: 2 stacked copies, one entry for the matrix of each stage, and the packed
  # vectors (5 floats on stage 1, 3 ints on stage 0).
  assert accounting.stage_bytes(layout) == (2 * 20 + 20 + 5 + 3) * 4
  assert [e["shared"] for e in accounting.chunk_elements(layout)] == [{group.name: 20}] * 2


@pytest.mark.unit
def test_shared_mask_marks_the_entries_holding_chosen_weights():
  layout, _ = lc.case("shared_ends")
  (group,) = layout.shared
  # One entry per stage: the embedding's on stage 0, the head's kernel on stage 1.
  masks = accounting.shared_mask(layout, lambda path: _key(path) == "kernel")
  assert masks[group.name].shape == (1, 2, 1, 1) and masks[group.name].dtype == bool
  np.testing.assert_array_equal(masks[group.name].reshape(-1), [False, True])
  zbv, _ = lc.case("shared_zbv")
  (group,) = zbv.shared
  # Three head kernels, all on stage 0 (chunks 0 and 3), one entry each; stage 1 holds none.
  masks = accounting.shared_mask(zbv, lambda path: _key(path) == "kernel")
  assert masks[group.name].shape == (3, 2, 1, 1)
  np.testing.assert_array_equal(masks[group.name][:, :, 0, 0], [[True, False]] * 3)
  assert not accounting.shared_mask(zbv, lambda path: False)[group.name].any()


@pytest.mark.parametrize("packing", lc.PACKINGS)
@pytest.mark.parametrize("fsdp", lc.FSDP)
def test_packed_mask_selects_exactly_the_elements_of_the_chosen_leaves(fsdp, packing):
  for name in lc.CASES:
    layout, shapes = lc.case(name, fsdp=fsdp, packing=packing)
    seen = set()

    def is_kernel(path, seen=seen):
      seen.add(_key(path))
      return _key(path) == "kernel"

    masks = accounting.packed_mask(layout, is_kernel)
    assert set(masks) == set(layout.packed_sizes)
    if layout.packed_sizes:
      assert seen <= {"embedding", "count", "kernel", "bias"} and "bias" in seen
    # Kernels hold 1, every other leaf 2, padding 0: the mask is where the buffers hold 1.
    marked = jax.tree_util.tree_map_with_path(
        lambda path, a: jnp.full(a.shape, 1 if path[-1].key == "kernel" else 2, a.dtype), shapes)
    staged = staging.to_staged(layout, lc.drop_empty(marked))
    for dtype, buffer in staged["packed"].items():
      mask = masks[dtype](buffer.shape)
      assert mask.shape == buffer.shape and mask.dtype == jnp.bool_
      np.testing.assert_array_equal(mask, np.asarray(buffer) == 1, err_msg=f"{name} {dtype}")
