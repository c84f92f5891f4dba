"""The SPMD executor: runs a schedule's table on every device at once inside ``jax.shard_map``.

Every device runs the same program. A ``lax.scan`` walks the schedule's ticks; at each tick a
device looks up in the table which (micro-batch, repeat) it works on, chooses its input (a fresh
micro-batch or one coming back for another lap on stage 0, otherwise what its left neighbour sent
last tick), applies its chunk of layers, and sends the result to its right neighbour with one
``lax.ppermute`` on the ring of stages. The last stage files finished micro-batches into an output
buffer. Idle (bubble) ticks compute nothing: the stage runs only when the table's busy flag says
so (:mod:`tpipe.core.gated`, a conditional with its own VJP), and outside that conditional every
device issues the same ``ppermute``.

Autodiff through the scan gives the backward pass (forward ticks replayed in reverse), which
accumulates parameter gradients over micro-batches in the scan's carry.

Side inputs: broadcast arrays (a mask) reach every layer whole; per-example arrays (a padding
mask ``[batch, ...]``) are split into micro-batches like ``x`` and read at the tick's micro-batch.

Data parallelism: the batch is split over the ``data`` mesh axis and parameters are replicated
on it. Parameters and broadcast arrays are marked as varying over ``data`` once, at entry
(``lax.pcast``); the transpose of that cast is the one all-reduce (a ``psum`` over ``data`` of
each replica's share of the mean loss's gradient) of the whole step, outside the tick loop. In
the same way everything is cast to vary over ``stage`` at entry, so no gradient is summed over
stages inside the loop.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from tpipe import partition
from tpipe import schedules as schedules_lib
from tpipe.core import stage as stage_lib


def _select(pred, on_true, on_false):
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def read_slot(buffer, index):
  """``buffer[index]`` along the leading axis of every leaf."""
  return jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, index, 0, keepdims=False), buffer)


def write_slot(buffer, index, value, pred):
  """``buffer[index] = value if pred`` without copying the whole buffer."""

  def write(b, v):
    old = lax.dynamic_index_in_dim(b, index, 0, keepdims=False)
    return lax.dynamic_update_index_in_dim(b, jnp.where(pred, v, old), index, 0)

  return jax.tree.map(write, buffer, value)


def _tick_inputs(schedule: schedules_lib.Schedule) -> dict[str, np.ndarray]:
  """The per-tick rows the scan consumes: the table plus what the last stage ran one tick ago."""
  last_mb = np.concatenate([[schedules_lib.IDLE], schedule.microbatch[:-1, -1]])
  last_rep = np.concatenate([[schedules_lib.IDLE], schedule.repeat[:-1, -1]])
  return {
      "microbatch": schedule.microbatch,
      "repeat": schedule.repeat,
      "arriving_microbatch": last_mb.astype(np.int32),
      "arriving_repeat": last_rep.astype(np.int32),
  }


def _split_microbatches(tree, num_microbatches: int):
  """``[local_batch, ...]`` leaves to ``[M, local_batch / M, ...]``."""
  return jax.tree.map(
      lambda a: a.reshape((num_microbatches, a.shape[0] // num_microbatches) + a.shape[1:]), tree)


def stage_ring(num_stages: int, num_repeats: int) -> list[tuple[int, int]]:
  """The ``ppermute`` pairs: each stage to the next, and the last back to 0 only when laps
  repeat (circular)."""
  last = num_stages if num_repeats > 1 else num_stages - 1
  return [(s, (s + 1) % num_stages) for s in range(last)]


# apply_chunk(busy, stage, repeat, stage_params, fresh, incoming, broadcast, per_example, rngs,
#             microbatch) -> (to_next, output): one device's work at one tick. ``stage_params`` is
# the device's slice of the staged parameters (leading axis: repeats); ``fresh`` is the tick's
# micro-batch of the pipeline's input (what the first chunk reads) and ``incoming`` what arrived
# from the previous chunk (``to_next``'s format); ``output`` is the last chunk's result (zeros
# from the other chunks).
ChunkFn = Callable[..., Any]


def _with_rows(example_shapes, rows: int):
  """Zeros ``[rows, ...]`` for each per-example ``jax.ShapeDtypeStruct``."""
  return jax.tree.map(lambda s: jnp.zeros((rows,) + tuple(s.shape), s.dtype), example_shapes)


def run_schedule(apply_chunk: ChunkFn, staged: Any, x: Any, broadcast: tuple,
                 per_example: tuple, rngs: dict, *, ring_example: Any, output_example: Any,
                 schedule: schedules_lib.Schedule, mesh: Mesh, stage_axis: str = "stage",
                 data_axis: str | None = "data", sum_example: Any = None) -> Any:
  """Runs a schedule's ticks on every device of ``mesh`` at once.

  Callers validate arguments first; this function assumes the batch splits into ``M``
  micro-batches per data replica.

  Three formats meet here, so that no buffer is larger than what it holds: the input ``x`` (read
  by the first chunk only), the **ring** format that crosses stage boundaries (a packed buffer for
  heterogeneous stages) and the **output** format of the last chunk (per-example losses for a
  stack that ends in its loss). The carry holds one micro-batch in the ring format, the finished
  outputs (``[M, ...]`` of the output format) and, for circular schedules, the micro-batches
  waiting on stage 0 for their next lap (``[M, ...]`` of the ring format).

  Args:
    apply_chunk: a device's work at one tick (see :data:`ChunkFn`); it must compute nothing
      when ``busy`` is False (:mod:`tpipe.core.gated`).
    staged: parameters in stage layout, every leaf ``[R, S, ...]``; split over ``stage_axis``.
    x: pytree of arrays ``[N, ...]``, the global batch.
    broadcast: tuple of arrays every layer sees whole.
    per_example: tuple of arrays ``[N, ...]`` split into micro-batches like ``x``.
    rngs: dict of RNG stream name to key.
    ring_example: pytree of ``jax.ShapeDtypeStruct``, one example of what crosses a stage
      boundary (without the batch axis).
    output_example: the same for the last chunk's output.
    schedule: the schedule to run.
    mesh: a mesh with ``stage_axis`` of size ``schedule.num_stages``.
    stage_axis: the mesh axis of pipeline stages.
    data_axis: the mesh axis of data-parallel replicas, or None. Ignored when absent from the
      mesh or of size 1.
    sum_example: None, or a pytree of ``jax.ShapeDtypeStruct`` (no batch axis): then
      ``apply_chunk`` returns a third value of this format, which is summed per chunk over the
      busy ticks (all micro-batches) and over data replicas (statistics such as BatchNorm's).

  Returns:
    The last chunk's outputs for the whole batch, in the output format with a batch axis; with
    ``sum_example``, also the sums, every leaf ``[R, S, ...]`` (chunk ``r * S + s`` at
    ``[r, s]``), split over ``stage_axis``.
  """
  num_stages, num_microbatches = schedule.num_stages, schedule.num_microbatches
  num_repeats = schedule.num_repeats
  # A data axis of size 1 is treated as absent: casting over it would leave a no-op all-reduce
  # of the whole gradient in the program.
  has_data = data_axis is not None and dict(mesh.shape).get(data_axis, 1) > 1
  manual_axes = (data_axis, stage_axis) if has_data else (stage_axis,)
  batch_spec = P(data_axis) if has_data else P()
  ring = stage_ring(num_stages, num_repeats)
  tick_inputs = _tick_inputs(schedule)

  def per_device(staged, x, per_example, broadcast, rngs):
    staged = jax.tree.map(lambda p: p[:, 0], staged)  # [R, ...]
    # Once per step, outside the tick loop: the transposes of these casts are the gradient sums
    # over data replicas (parameters, broadcast arrays) and over stages (inputs, side inputs).
    # What each input varies over already follows from its in_spec: params over stages, the
    # batch and per-example arrays over data replicas, broadcast arrays over nothing.
    if has_data:
      staged = lax.pcast(staged, (data_axis,), to="varying")
    x, per_example = lax.pcast((x, per_example), (stage_axis,), to="varying")
    broadcast = lax.pcast(broadcast, manual_axes, to="varying")
    stage = lax.axis_index(stage_axis)
    data_index = lax.axis_index(data_axis) if has_data else 0
    local_batch = jax.tree.leaves(x)[0].shape[0]
    rows = local_batch // num_microbatches
    microbatches = _split_microbatches(x, num_microbatches)
    per_example = _split_microbatches(per_example, num_microbatches)
    vary = lambda tree: lax.pcast(tree, manual_axes, to="varying")
    carry = {"incoming": vary(_with_rows(ring_example, rows)),
             "outputs": vary(jax.tree.map(lambda a: jnp.zeros((num_microbatches,) + a.shape,
                                                                a.dtype),
                                          _with_rows(output_example, rows)))}
    if sum_example is not None:
      carry["sums"] = vary(jax.tree.map(lambda s: jnp.zeros((num_repeats,) + tuple(s.shape),
                                                            s.dtype), sum_example))
    if num_repeats > 1:
      carry["loop_back"] = vary(jax.tree.map(
          lambda a: jnp.zeros((num_microbatches,) + a.shape, a.dtype),
          _with_rows(ring_example, rows)))

    def tick(carry, row):
      carry = dict(carry)
      mb, rep = row["microbatch"][stage], row["repeat"][stage]
      busy = mb >= 0
      mb, rep = jnp.maximum(mb, 0), jnp.maximum(rep, 0)
      incoming = carry["incoming"]
      if num_repeats > 1:
        # Stage 0 parks what the last stage finished last tick until its next lap starts.
        arriving_mb, arriving_rep = row["arriving_microbatch"], row["arriving_repeat"]
        park = (stage == 0) & (arriving_mb >= 0) & (arriving_rep < num_repeats - 1)
        carry["loop_back"] = write_slot(carry["loop_back"], jnp.maximum(arriving_mb, 0),
                                         incoming, park)
        incoming = _select((stage == 0) & (rep > 0), read_slot(carry["loop_back"], mb),
                           incoming)
      results = apply_chunk(busy, stage, rep, staged, read_slot(microbatches, mb),
                            incoming, broadcast, read_slot(per_example, mb), rngs,
                            data_index * num_microbatches + mb)
      to_next, output = results[:2]
      if sum_example is not None:  # An idle tick's contribution is zeros.
        carry["sums"] = jax.tree.map(
            lambda total, c: lax.dynamic_update_index_in_dim(
                total, lax.dynamic_index_in_dim(total, rep, 0, keepdims=False) + c, rep, 0),
            carry["sums"], results[2])
      finished = busy & (stage == num_stages - 1) & (rep == num_repeats - 1)
      carry["outputs"] = write_slot(carry["outputs"], mb, output, finished)
      carry["incoming"] = lax.ppermute(to_next, stage_axis, ring) if ring else to_next
      return carry, None

    carry, _ = lax.scan(tick, carry, tick_inputs)
    # Only the last stage wrote outputs (the others hold zeros): the sum hands them to every stage.
    outputs = lax.psum(carry["outputs"], stage_axis)
    outputs = jax.tree.map(lambda a: a.reshape((local_batch,) + a.shape[2:]), outputs)
    if sum_example is None:
      return outputs
    sums = lax.psum(carry["sums"], data_axis) if has_data else carry["sums"]
    return outputs, jax.tree.map(lambda a: a[:, None], sums)

  operands = (staged, x, tuple(per_example), tuple(broadcast), rngs)
  in_specs = (P(None, stage_axis), batch_spec, batch_spec, P(), P())
  if any(t == AxisType.Explicit for t in mesh.axis_types):
    # Arrays on a mesh with Explicit axes carry their sharding in their type, and shard_map
    # takes them only as its in_specs say: move them there first (a no-op when they are).
    operands = tuple(
        jax.tree.map(lambda a, spec=spec: jax.reshard(a, NamedSharding(mesh, spec)), operand)
        for operand, spec in zip(operands, in_specs))
  out_specs = batch_spec if sum_example is None else (batch_spec, P(None, stage_axis))
  run = jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
  return run(*operands)


def run_pipeline(layer_fn: stage_lib.LayerFn, params: Any, x: Any, broadcast: tuple,
                 per_example: tuple, rngs: dict, *, length: int,
                 schedule: schedules_lib.Schedule, mesh: Mesh, remat="full",
                 remat_granularity="chunk", unroll: int | bool = 1, stage_axis: str = "stage",
                 data_axis: str | None = "data") -> Any:
  """Applies ``L`` stacked, identical, shape-preserving layers to a batch with a schedule.

  Callers validate arguments first (:mod:`tpipe.linen.transform` does); this function assumes
  ``L`` splits into ``S * R`` chunks and the batch into ``M`` micro-batches per data replica.

  Args:
    layer_fn: ``layer_fn(params_of_one_layer, x, broadcast, per_example, rngs) -> y``, ``y``
      shaped like ``x``; ``per_example`` holds the micro-batch's slices.
    params: pytree, every leaf ``[L, ...]`` (layer ``l`` at index ``l``).
    x: pytree of arrays ``[N, ...]``, the global batch.
    broadcast: tuple of arrays every layer sees whole.
    per_example: tuple of arrays ``[N, ...]`` split into micro-batches like ``x``.
    rngs: dict of RNG stream name to key; folded per layer and micro-batch.
    length: number of layers L.
    schedule: the schedule to run.
    mesh: a mesh with ``stage_axis`` of size ``schedule.num_stages``.
    remat: a remat option (see :func:`tpipe.core.stage.resolve_remat`).
    remat_granularity: ``"chunk"``, ``"layer"`` or an int ``k`` (see
      :func:`tpipe.core.stage.apply_units`).
    unroll: layers per iteration of each chunk's layer loop (see
      :func:`tpipe.core.stage.make_stage_fn`).
    stage_axis: the mesh axis of pipeline stages.
    data_axis: the mesh axis of data-parallel replicas, or None.

  Returns:
    The pytree ``y``, shaped like ``x``: every layer applied in order.
  """
  num_stages, num_repeats = schedule.num_stages, schedule.num_repeats
  per_chunk = partition.layers_per_chunk(length, num_stages, num_repeats)
  stage_fn = stage_lib.make_stage_fn(layer_fn, per_chunk, remat, unroll, remat_granularity)

  def apply_chunk(busy, stage, repeat, staged, fresh, incoming, broadcast, per_example, rngs,
                  microbatch):
    first_layer = (repeat * num_stages + stage) * per_chunk
    h = _select((stage == 0) & (repeat == 0), fresh, incoming)
    y = stage_fn(staged, busy, repeat, h, broadcast, per_example, rngs, first_layer, microbatch)
    return y, y

  staged = partition.to_stage_layout(params, num_stages, num_repeats)
  example = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), x)
  return run_schedule(apply_chunk, staged, x, broadcast, per_example, rngs,
                      ring_example=example, output_example=example, schedule=schedule,
                      mesh=mesh, stage_axis=stage_axis, data_axis=data_axis)
