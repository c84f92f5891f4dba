"""tpipe.core.chunks: float leaves, a device's view of the staged tree, chunk signatures (which
chunks share a program) and the chunk programs themselves against the plain layers, on the tiny
core-layer pipeline (:mod:`tests.helpers.core_layers`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpipe
from tests.helpers import core_layers as cl
from tpipe.core import arguments
from tpipe.core import chunks as chunks_lib
from tpipe.core import remat as remat_lib


def test_float_leaves_and_back():
  tree = {"a": jnp.ones(2), "b": jnp.arange(3), "c": (jnp.zeros(1, jnp.bfloat16), True)}
  floats = chunks_lib.float_leaves(tree)
  assert [a.dtype for a in floats] == [jnp.float32, jnp.bfloat16]
  back = chunks_lib.with_float_leaves(tree, [a + 5 for a in floats])
  np.testing.assert_array_equal(back["a"], [6, 6])
  np.testing.assert_array_equal(back["b"], [0, 1, 2])  # Integer leaves untouched.
  assert back["c"][0].dtype == jnp.bfloat16 and float(back["c"][0][0]) == 5.0
  assert back["c"][1] is True
  assert chunks_lib.is_float(jnp.complex64(1)) and not chunks_lib.is_float(jnp.int8(1))


def test_device_view_keeps_the_stage_axis_of_packed_parameters_only():
  staged = {chunks_lib.PARAMS: {"packed": {"float32": jnp.zeros((2, 1, 8))},
                                "stacked": {"layers_1": {"w": jnp.zeros((2, 1, 3, 4))}}},
            chunks_lib.STATS: {"packed": {"float32": jnp.zeros((2, 1, 5))}}}
  view = chunks_lib.device_view(staged)
  assert view[chunks_lib.PARAMS]["packed"]["float32"].shape == (2, 1, 8)
  assert view[chunks_lib.PARAMS]["stacked"]["layers_1"]["w"].shape == (2, 3, 4)
  assert view[chunks_lib.STATS]["packed"]["float32"].shape == (2, 5)
  back = chunks_lib.with_stage_axis(chunks_lib.float_leaves(view),
                                    chunks_lib.float_leaves(staged))
  assert [a.shape for a in back] == [a.shape for a in chunks_lib.float_leaves(staged)]


def test_tick_policy():
  spec = lambda remat, granularity: tpipe.PipelineSpec(
      num_stages=2, num_microbatches=2, remat=remat, remat_granularity=granularity)
  assert chunks_lib.tick_policy(spec("full", "nested")) is chunks_lib.FULL
  # Other settings: the chunk's own remat policy (a checkpoint policy function), never FULL.
  policy = chunks_lib.tick_policy(spec("none", "nested"))
  assert remat_lib.chunk_policy("none", "nested") is not None
  assert callable(policy) and policy is not chunks_lib.FULL


def _interleaved():
  """4 model chunks on 2 stages: projection + block 0 | block 1 | block 2 | block 3 + loss."""
  spec = tpipe.PipelineSpec(num_stages=2, num_microbatches=2, schedule="circular",
                            num_repeats=2, balance=[2, 1, 1, 2], per_example=("targets",))
  return cl.build(spec)


def test_signatures_share_a_program_between_like_chunks():
  pipeline = _interleaved()
  found, program = chunks_lib.signatures(pipeline.plan, pipeline.layout, None)
  assert program == [0, 1, 1, 2] == pipeline.programs()
  assert [(s.input_kind, s.output_kind) for s in found] == [("fresh", "ring"), ("ring", "ring"),
                                                            ("ring", "output")]
  assert [s.segments for s in found] == [((0, None, False), (1, 1, True)), ((1, 1, True),),
                                         ((1, 1, True), (2, None, False))]
  ring = chunks_lib.Ring.of(pipeline.plan)  # One type at every boundary: unpacked.
  assert not ring.packed and ring.example == jax.ShapeDtypeStruct((cl.WIDTH,), jnp.float32)


@pytest.mark.parametrize("chunk", [0, 1, 2, 3])
def test_each_chunk_program_equals_the_plain_chunk(chunk):
  pipeline = _interleaved()
  x, targets = cl.inputs()
  rows = cl.BATCH // 2
  split = arguments.split_keywords({"targets": targets}, per_example=("targets",),
                                   batch_size=cl.BATCH, owner="test")
  chunkset = chunks_lib.ChunkSet(pipeline.layers, pipeline.plan, pipeline.layout, None,
                                 pipeline.spec, split)
  logical = cl.params()
  stage = pipeline.layout.position(chunk)[1]
  staged = {chunks_lib.PARAMS: pipeline.layout.to_staged(logical)}
  view = chunks_lib.device_view(jax.tree.map(lambda a: a[:, stage:stage + 1], staged))
  incoming = jnp.asarray(np.random.default_rng(3).normal(size=(rows, cl.WIDTH)), jnp.float32)
  program = chunkset.branch(chunkset.branch_of_chunk[chunk])
  to_next, output = jax.jit(program, static_argnums=7)(
      view, x[:rows], incoming, (), (targets[:rows],), {}, 0, chunk)
  h = x[:rows] if chunk == 0 else incoming
  want = cl.apply_segments(logical, h, pipeline.layout.segments[chunk], targets[:rows])
  last = chunk == pipeline.plan.num_chunks - 1
  np.testing.assert_allclose(output if last else to_next, want, rtol=1e-6, atol=1e-6)
  assert not np.any(to_next if last else output)  # The other result is zeros.
  assert output.shape == (rows,) and to_next.shape == (rows, cl.WIDTH)
