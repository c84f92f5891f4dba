"""tpipe.core.programs.chunks: the tick's remat policy and the chunk programs themselves against the
plain layers, on the tiny core-layer pipeline (:mod:`tests.helpers.core_layers`). Float leaves,
the device view, the ring and chunk signatures have test files of their own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpipe
from tests.helpers import core_layers as cl
from tpipe.core.base import arguments
from tpipe.core.layout import device_view as view_lib
from tpipe.core.layout import staging
from tpipe.core.programs import chunks as chunks_lib


def _interleaved():
  """4 model chunks on 2 stages: projection + block 0 | block 1 | block 2 | block 3 + loss."""
  spec = tpipe.PipelineSpec(num_stages=2, num_microbatches=2, schedule="circular",
                            num_repeats=2, balance=[2, 1, 1, 2], per_example=("targets",))
  return cl.build(spec)


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
  staged = {view_lib.PARAMS: staging.to_staged(pipeline.layout, logical)}
  view = view_lib.device_view(jax.tree.map(lambda a: a[:, stage:stage + 1], staged))
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
