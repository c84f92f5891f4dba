"""tpipe.core.layout.stage_layout.StageLayout: the one entry to a stage layout. Its methods are the
concepts' modules' functions (description, packing one chunk, accounting, staging; each tested
in its own ``test_<module>.py``), and a collection can reuse another layout's stacked copies.

Layouts are built from :func:`tpipe.core.planning.plan.group_units` and abstract shapes
(:mod:`tests.helpers.layout_cases`); no model is traced.
"""

import jax
import numpy as np

from tests.helpers import layout_cases as lc
from tpipe.core.layout import accounting
from tpipe.core.layout import description as desc
from tpipe.core.layout import pack as layout_pack
from tpipe.core.layout import stage_layout as layout_lib
from tpipe.core.layout import staging


def test_stage_layout_is_a_description_with_the_other_concepts_methods():
  layout, shapes = lc.case("shared_ends", fsdp=2)
  assert isinstance(layout, desc.LayoutDescription)
  assert layout_lib.Segment is desc.Segment and layout_lib.PACKINGS == desc.PACKINGS
  assert (layout_lib.STACKED, layout_lib.PACKED, layout_lib.SHARED) == (
      desc.STACKED, desc.PACKED, desc.SHARED)
  logical = lc.values(shapes)
  staged = layout.to_staged(logical)
  lc.assert_equal(staged, staging.to_staged(layout, logical))
  lc.assert_equal(layout.to_logical(staged), staging.to_logical(layout, staged))
  assert layout.chunk_bytes() == accounting.chunk_bytes(layout)
  assert layout.chunk_elements() == accounting.chunk_elements(layout)
  assert layout.stage_bytes() == accounting.stage_bytes(layout)
  is_bias = lambda path: getattr(path[-1], "key", None) == "bias"
  buffer = staged["packed"]["float32"]
  np.testing.assert_array_equal(layout.packed_mask(is_bias)["float32"](buffer.shape),
                                accounting.packed_mask(layout, is_bias)["float32"](buffer.shape))
  (group,) = layout.shared
  np.testing.assert_array_equal(layout.shared_mask(is_bias)[group.name],
                                accounting.shared_mask(layout, is_bias)[group.name])
  local = layout.chunk_local(staged, 1)
  trees = layout.chunk_trees(local, 1)
  lc.assert_equal(trees, layout_pack.chunk_trees(layout, local, 1))
  lc.assert_equal(layout.chunk_slot(trees, 1), layout_pack.chunk_slot(layout, trees, 1))
  window = layout.pack_chunk([logical["layers_2"]], 1)
  lc.assert_equal(window, layout_pack.pack_chunk(layout, [logical["layers_2"]], 1))
  lc.assert_equal(layout.unpack_chunk(window, 1), layout_pack.unpack_chunk(layout, window, 1))


def test_a_collection_can_reuse_another_layouts_stacked_copies():
  params, shapes = lc.case("uneven_repeat")
  everything_packed, _ = lc.case("uneven_repeat", stacked={})
  assert everything_packed.stacked == {} and params.stacked == {1: 2}
  same, _ = lc.case("uneven_repeat", stacked=params.stacked)
  assert same.segments == params.segments
  logical = lc.values(shapes)
  lc.assert_equal(everything_packed.to_logical(everything_packed.to_staged(logical)), logical)
  assert jax.tree.leaves(everything_packed.to_staged(logical)["stacked"]) == []
