"""tpipe.core.programs.unit_backward: a chunk's backward one unit at a time equals ``jax.vjp`` of
the plain
chunk (its layers applied in order on the logical parameters), for parameter and input gradients,
whether the recomputed forward keeps every unit's residuals or only each unit's input.

The pipeline is :mod:`tests.helpers.core_layers` on 2 stages (chunk 0: the projection and two
block copies, fresh input, ring output; chunk 1: two block copies and the loss, ring input), run
outside ``shard_map`` on one stage's part of the staged parameters, as a device holds it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpipe
from tests.helpers import core_layers as cl
from tpipe.core.base import arguments
from tpipe.core.base import float_leaves as floats_lib
from tpipe.core.layout import device_view as view_lib
from tpipe.core.layout import staging
from tpipe.core.planning import backward_plan
from tpipe.core.programs import chunks as chunks_lib
from tpipe.core.programs import unit_backward

ROWS = cl.BATCH // 2  # Two micro-batches.


def _pipeline(granularity):
  spec = tpipe.PipelineSpec(num_stages=2, num_microbatches=2, schedule="1f1b", balance=[3, 3],
                            per_example=("targets",), remat="full",
                            remat_granularity=granularity)
  return cl.build(spec)


def _stage_part(staged, stage):
  """``staged``'s leaves ``[R, S, ...]`` cut to ``[R, 1, ...]``: what ``shard_map`` hands the
  device of ``stage``."""
  return jax.tree.map(lambda a: a[:, stage:stage + 1], staged)


def _logical_grads(pipeline, staged, sums, stage):
  """The device-view gradient ``sums`` of ``stage`` as logical gradients (zeros elsewhere)."""
  part = _stage_part(staged, stage)
  leaves = view_lib.with_stage_axis(sums, floats_lib.float_leaves(part))
  grads = floats_lib.with_float_leaves(part, leaves)[view_lib.PARAMS]
  num_stages = pipeline.spec.num_stages

  def place(g, whole):
    parts = [g if s == stage else jnp.zeros_like(g) for s in range(num_stages)]
    return jnp.concatenate(parts, axis=1).reshape(whole.shape)

  return staging.to_logical(pipeline.layout, jax.tree.map(place, grads, staged[view_lib.PARAMS]))


def _chunk_backward(pipeline, plan, chunk, targets, g_next, seed):
  """``(backward, staged, view)``: ``backward(view, fresh, incoming, targets)`` runs
  ``backward_into`` of model ``chunk`` on one micro-batch (output cotangents ``g_next`` and
  ``seed``) on ``view``, the device view of ``staged`` (the logical parameters, staged) of the
  chunk's stage."""
  split = arguments.split_keywords({"targets": targets}, per_example=("targets",),
                                   batch_size=cl.BATCH, owner="test")
  chunkset = chunks_lib.ChunkSet(pipeline.layers, pipeline.plan, pipeline.layout, None,
                                 pipeline.spec, split)
  staged = {view_lib.PARAMS: staging.to_staged(pipeline.layout, cl.params())}
  view = view_lib.device_view(_stage_part(staged, pipeline.layout.position(chunk)[1]))
  run = unit_backward.backward_into(chunkset, chunkset.branch_of_chunk[chunk], plan)
  outputs = lambda results: (floats_lib.float_leaves(results[0]), results[1])
  cotangent = lambda out: ([g_next.astype(a.dtype) for a in out[0]], seed)

  def backward(view, fresh, incoming, targets):
    sums = [jnp.zeros_like(a) for a in floats_lib.float_leaves(view)]
    args = unit_backward.ChunkArgs(fresh=fresh, incoming=incoming, broadcast=(),
                                   per_example=(targets,), rngs={}, microbatch=0)
    return run(sums, view, args, chunk, outputs, cotangent)

  return backward, staged, view


def _by_units(pipeline, plan, chunk, x, incoming, targets, g_next, seed):
  """``backward_into`` of model ``chunk`` on one micro-batch: ``(logical parameter gradients,
  g_fresh, g_incoming, g_targets)``."""
  backward, staged, view = _chunk_backward(pipeline, plan, chunk, targets, g_next, seed)
  sums, g_fresh, g_incoming, g_side = jax.jit(backward)(view, x[:ROWS], incoming,
                                                        targets[:ROWS])
  grads = _logical_grads(pipeline, staged, sums, pipeline.layout.position(chunk)[1])
  return grads, g_fresh, g_incoming, g_side


@pytest.mark.parametrize("granularity,keeps", [("chunk", True), ("nested", False),
                                               ("layer", False)])
@pytest.mark.parametrize("chunk", [0, 1])
def test_backward_by_units_equals_vjp_of_the_plain_chunk(granularity, keeps, chunk):
  pipeline = _pipeline(granularity)
  spec = pipeline.spec
  plan = backward_plan.resolve(spec)
  assert plan.by_units and plan.unit_residuals == keeps
  x, targets = cl.inputs()
  rng = np.random.default_rng(7)
  incoming = jnp.asarray(rng.normal(size=(ROWS, cl.WIDTH)), jnp.float32)
  g_next = jnp.asarray(rng.normal(size=(ROWS, cl.WIDTH)), jnp.float32)
  seed = jnp.full((ROWS,), 1.0 / cl.BATCH)
  segments = pipeline.layout.segments[chunk]
  last = chunk == pipeline.plan.num_chunks - 1

  def plain(logical, h, targets):
    return cl.apply_segments(cl.params() | logical, h, segments, targets)

  h_in = x[:ROWS] if chunk == 0 else incoming
  out, vjp = jax.vjp(plain, cl.params(), h_in, targets[:ROWS])
  assert out.shape == ((ROWS,) if last else (ROWS, cl.WIDTH))
  want_params, want_h, want_targets = vjp(seed if last else g_next)
  # The ring carries zeros out of the last chunk, the output zeros out of the others: their
  # cotangents are given but multiply nothing.
  grads, g_fresh, g_incoming, g_side = _by_units(
      pipeline, plan, chunk, x, incoming, targets, jnp.zeros_like(g_next) if last else g_next,
      seed if last else jnp.zeros_like(seed))
  for name in want_params:
    for key in want_params[name]:
      np.testing.assert_allclose(grads[name][key], want_params[name][key], rtol=2e-5,
                                 atol=1e-6, err_msg=f"{name}/{key}")
  used = {seg.layer for seg in segments}
  assert all(np.any(want_params[f"layers_{i}"]["kernel"]) for i in used)
  if chunk == 0:
    np.testing.assert_allclose(g_fresh[0], want_h, rtol=2e-5, atol=1e-6)
    assert not np.any(g_incoming[0])  # The first chunk reads the fresh input only.
  else:
    np.testing.assert_allclose(g_incoming[0], want_h, rtol=2e-5, atol=1e-6)
    assert not np.any(g_fresh[0])
  np.testing.assert_allclose(g_side[0], want_targets, rtol=2e-5, atol=1e-6)
  assert np.any(g_side[0]) == last


@pytest.mark.parametrize("chunk", [0, 1])
def test_an_end_finishes_its_gradient_before_the_units_before_it(chunk):
  """A unit of its own (the projection, the loss) ties its input's gradient to the running
  sums, its parameter gradient added, with one optimization barrier, so the compiler cannot keep
  its whole gradient live through the backward of the units before it; a run's units (the
  blocks) have none."""
  pipeline = _pipeline("nested")
  x, targets = cl.inputs()
  backward, _, view = _chunk_backward(pipeline, backward_plan.resolve(pipeline.spec), chunk,
                                      targets, jnp.ones((ROWS, cl.WIDTH)), jnp.ones(ROWS))
  program = str(jax.make_jaxpr(backward)(view, x[:ROWS], jnp.zeros((ROWS, cl.WIDTH)),
                                         targets[:ROWS]))
  ends = [seg for seg in pipeline.layout.segments[chunk] if seg.copies is None]
  assert len(ends) == 1 and len(pipeline.layout.segments[chunk]) == 2
  assert program.count("optimization_barrier") == len(ends)
