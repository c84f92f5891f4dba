"""tpipe.core.programs.signatures: which model chunks share a program. Chunks alike up to which
chunk they are (layers, packed layouts, where their input comes from and their output goes) get one
program number; on hand-written plans (:mod:`tests.helpers.stub_plans`) with the circular
layout of :mod:`tests.helpers.layout_cases`, and on an engine-built interleaved pipeline."""

import jax
import jax.numpy as jnp
import pytest

import tpipe
from tests.helpers import core_layers as cl
from tests.helpers import layout_cases as lc
from tests.helpers import stub_plans
from tests.helpers.shapes import abstract_shapes
from tpipe.core.layout import description as layout_lib
from tpipe.core.programs import ring as ring_lib
from tpipe.core.programs import signatures as signatures_lib

rows = stub_plans.rows


def _circular(*inputs):
  """The layers of the ``circular_r2`` layout (embedding, 6 copies of a block, head) in 4
  chunks of 2 units on 2 stages; ``inputs`` every layer's input and the output."""
  plan = stub_plans.plan([None, 6, None], (2, 2, 2, 2), inputs, num_stages=2)
  layout, _ = lc.case("circular_r2")
  return plan, layout


@pytest.mark.unit
def test_the_middle_chunks_share_a_program():
  plan, layout = _circular(rows((3,)), rows((4,)), rows((4,)), rows(()))
  found, program = signatures_lib.signatures(plan, layout, None)
  # Chunk 0: the embedding and a copy; 1 and 2: a stacked copy and a packed one; 3: a copy
  # and the head.
  assert program == [0, 1, 1, 2]
  assert [s.segments for s in found] == [((0, None, False), (1, 1, True)),
                                         ((1, 1, True), (1, 1, False)),
                                         ((1, 1, True), (2, None, False))]
  assert [(s.input_kind, s.output_kind) for s in found] == [("fresh", "ring"), ("ring", "ring"),
                                                            ("ring", "output")]
  assert [s.params_layout.sizes() for s in found] == [{"float32": 20, "int32": 3},
                                                      {"float32": 20}, {"float32": 10}]
  assert all(s.ring_in is None and s.ring_out is None and s.stats_layout is None
             for s in found)
  assert all(s.shared == () for s in found)


@pytest.mark.unit
def test_ring_typed_input_and_output_make_every_chunk_select_and_give_both():
  # The fresh input and the output have the ring's type: every chunk may take either input
  # and hand back either output, so the first and last chunks' kinds match the middle ones'.
  h = rows((4,))
  plan, layout = _circular(h, h, h, h)
  found, program = signatures_lib.signatures(plan, layout, None)
  assert program == [0, 1, 1, 2]  # Still three programs: their layers differ.
  assert {(s.input_kind, s.output_kind) for s in found} == {("select", "both")}


@pytest.mark.unit
def test_a_packed_ring_tells_apart_chunks_that_read_or_write_other_packings():
  # Layers A, B (4 copies, input [4]), C, D (2 copies, input [5]), E in 6 chunks on 6 stages:
  # A B0 | B1 | B2 | B3 C | D0 | D1 E. Boundaries 0-2 carry [4] floats, 3 and 4 [5]: a packed
  # ring. Chunks 1 and 2 hold a copy of B each and read and write the [4] packing: one program.
  inputs = [rows((3,)), rows((4,)), rows((4,)), rows((5,)), rows((5,)), rows(())]
  plan = stub_plans.plan([None, 4, None, 2, None], (2, 1, 1, 2, 1, 2), inputs, num_stages=6)
  bias = {"b": ((4,), lc.F32)}
  shapes = abstract_shapes([bias, {"w": ((4, 4), lc.F32)}, bias, {"w": ((2, 5), lc.F32)}, bias])
  layout = layout_lib.StageLayout.build(plan.groups, shapes, 6, 1)
  ring = ring_lib.Ring.of(plan)
  assert ring.packed and ring.layout(0) == ring.layout(2) != ring.layout(3)
  found, program = signatures_lib.signatures(plan, layout, None, ring=ring)
  assert program == [0, 1, 1, 2, 3, 4]
  assert [(s.input_kind, s.output_kind) for s in found] == [
      ("fresh", "ring")] + [("ring", "ring")] * 3 + [("ring", "output")]
  assert [s.ring_in for s in found] == [None] + [ring.layout(c) for c in (0, 2, 3, 4)]
  assert [s.ring_out for s in found] == [ring.layout(c) for c in (0, 1, 3, 4)] + [None]


@pytest.mark.unit
def test_statistics_layouts_take_part():
  plan, layout = _circular(rows((3,)), rows((4,)), rows((4,)), rows(()))
  stats, _ = lc.case("circular_r2", packing="slot")
  found, _ = signatures_lib.signatures(plan, layout, stats)
  assert [s.stats_layout for s in found] == [stats.packed_layouts[c] for c in (0, 1, 3)]


def test_signatures_of_an_interleaved_pipeline():
  # 4 model chunks on 2 stages: projection + block 0 | block 1 | block 2 | block 3 + loss.
  spec = tpipe.PipelineSpec(num_stages=2, num_microbatches=2, schedule="circular",
                            num_repeats=2, balance=[2, 1, 1, 2], per_example=("targets",))
  pipeline = cl.build(spec)
  found, program = signatures_lib.signatures(pipeline.plan, pipeline.layout, None)
  assert program == [0, 1, 1, 2] == pipeline.programs()
  assert [(s.input_kind, s.output_kind) for s in found] == [("fresh", "ring"), ("ring", "ring"),
                                                            ("ring", "output")]
  assert [s.segments for s in found] == [((0, None, False), (1, 1, True)), ((1, 1, True),),
                                         ((1, 1, True), (2, None, False))]
  ring = ring_lib.Ring.of(pipeline.plan)  # One type at every boundary: unpacked.
  assert not ring.packed and ring.example == jax.ShapeDtypeStruct((cl.WIDTH,), jnp.float32)
