"""The fused executor: forward and backward interleaved in one tick loop, memory bounded in S.

The forward executor (:mod:`tpipe.core.executor`) gets its backward pass from autodiff through
its tick scan, so every stage keeps one stage input per forward tick until the backward begins:
activation memory grows with the number of micro-batches M. A fused schedule
(:class:`tpipe.schedules.FusedSchedule`: 1F1B, interleaved 1F1B, ZB-H1, ZB-V) instead says per
``[tick, stage]`` whether a stage runs a forward ``F``, a backward ``B`` or the two halves of a
split backward (``BI``, ``W``) of one micro-batch on one of its chunks, and this module runs that
table as one SPMD program:

* One ``lax.scan`` over the table's ticks inside ``jax.shard_map``. Each tick every device looks
  up its action and runs it as one branch of a ``lax.switch`` (idle, or ``F``, ``B``, ``BI``,
  ``W`` of model chunk ``v``); the branches hold no collective.
* ``F`` applies the chunk to the micro-batch's input (the data for the first chunk, otherwise an
  activation from the stage's mailbox) and keeps that input in a **stash slot** of the table
  (``stash_slot``). A stage allocates as many slots as the table's peak of micro-batches in
  flight (``min(S, M)`` for 1F1B), never M.
* ``B`` takes the stashed input and the output gradient (from the mailbox; for the last chunk the
  seed ``1 / N`` per example of the mean loss), recomputes the chunk's forward under ``jax.vjp``
  and applies its VJP. That is ``remat="full"`` at the granularity of a chunk whatever the
  stack's remat policy (the caller does not checkpoint the chunk again for ``"full"``, which would
  run its forward twice): the policy only decides what the chunk keeps *within* the ``B`` tick
  between its recomputed forward and its backward, so it changes the tick's peak, not what is
  kept across ticks.
* Messages: a forward's output goes to the next model chunk, a backward's input gradient to the
  previous one. After the branch, every device issues the same two ``lax.ppermute`` every tick
  (one to the right neighbour, one to the left; zeros when the table sends nothing that way).
  A message arrives the next tick and waits in the receiver's **mailbox** at the slot the table
  routes it to (``arrival_slots``, ``recv_slot``) until the action that reads it.
* Parameter gradients accumulate in one running sum per stage (the scan's carry); gradients of
  per-example inputs (a float ``x``) are filed per micro-batch into a buffer shaped like the
  input. Once, after the loop: the sum over data replicas of the parameter gradients (the
  step's one all-reduce), and sums over stages of the input gradients and the loss.

Zero-bubble schedules (ZB-H1, ZB-V) split the backward into ``BI`` and ``W``
(:mod:`tpipe.core.taps`): ``BI`` runs the chunk's VJP with zero "taps" added to the outputs of
the modules linear in their weights, which yields the input gradient and those modules' output
gradients but not their weight gradients; it files the output gradients and the modules' inputs
in a **weight slot** (a packed buffer per stage, as many slots as the table's most micro-batches
awaiting ``W``). ``W`` forms the weight gradients from the slot, by the VJP of each module with
respect to its weights alone. Nothing is computed twice.

The whole run is wrapped in a ``jax.custom_vjp`` (:func:`fused_loss`): its forward runs the
schedule with a unit cotangent, so one pass yields the loss and every gradient, and its backward
multiplies the stored gradients by the incoming cotangent of the loss. ``jax.grad`` of any
function of the loss therefore works, and costs one fused run. A call that is not differentiated
(evaluation, ``init``) takes the custom_vjp's primal path: the caller's forward-only loss when it
gives one (``loss_only``; :class:`tpipe.Sequential` runs GPipe's forward ticks there), else the
fused run with its gradients dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from tpipe import schedules as schedules_lib
from tpipe.core import executor
from tpipe.core import gated
from tpipe.core import packing

# chunk(params, fresh, incoming, broadcast, per_example, rngs, microbatch) -> (to_next, losses):
# one model chunk on one micro-batch. ``params`` is the device's parameter tree (leading axis:
# its local chunks), ``fresh`` the micro-batch of the pipeline's input (read by the first chunk),
# ``incoming`` the ring-format value from the previous chunk; ``to_next`` is the ring value for
# the next chunk and ``losses`` the per-example losses ``[rows]`` (zeros except from the last).
ChunkFn = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class SplitChunk:
  """A model chunk whose backward splits into ``BI`` and ``W`` (see :mod:`tpipe.core.taps`).

  Attributes:
    forward: ``forward(params, fresh, incoming, broadcast, per_example, rngs, microbatch, taps)
      -> ((to_next, losses), (inputs, outputs))``: the chunk as :data:`ChunkFn`, with ``taps``
      (None, or a pytree shaped like ``outputs``) added to the outputs of its tapped module
      calls, whose weights it does not differentiate; ``inputs`` are those calls' array inputs.
    weight_grads: ``weight_grads(params, inputs, output_grads) -> grads`` shaped like
      ``params``: the tapped calls' weight gradients at their output gradients.
  """

  forward: Callable[..., Any]
  weight_grads: Callable[..., Any]

_A = schedules_lib.Action


def _is_float(leaf) -> bool:
  return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


def _floats(tree) -> list:
  return [leaf for leaf in jax.tree.leaves(tree) if _is_float(leaf)]


def _with_floats(tree, floats):
  """``tree`` with its float leaves replaced, in order, by ``floats``."""
  floats = iter(floats)
  return jax.tree.map(lambda leaf: next(floats) if _is_float(leaf) else leaf, tree)


def _add(buffer, index, value):
  """``buffer[index] += value``."""

  def add(b, v):
    old = lax.dynamic_index_in_dim(b, index, 0, keepdims=False)
    return lax.dynamic_update_index_in_dim(b, old + v, index, 0)

  return jax.tree.map(add, buffer, value)


def _zeros_as(like):
  """Zeros of ``like``'s shape, dtype and varying mesh axes."""
  return gated._cast_to(jnp.zeros(like.shape, like.dtype), gated._varying_axes(like))


def _as(value, like):
  """``value`` made to vary over the mesh axes ``like`` varies over (at least its own)."""
  return gated._cast_to(value, gated._varying_axes(like))


def _stacked(tree, count: int):
  """Zeros ``[count, ...]`` shaped like every leaf of ``tree``."""
  return jax.tree.map(lambda a: jnp.zeros((count,) + a.shape, a.dtype), tree)


def _tick_tables(schedule: schedules_lib.FusedSchedule) -> dict[str, np.ndarray]:
  """The per-tick rows the scan consumes, each ``[T, S, ...]``.

  ``branch`` numbers the ``lax.switch`` branches: 0 idle, ``1 + k * V + v`` action ``k``
  (``F``, ``B``, ``BI``, ``W``) of model chunk ``v``.
  """
  num_virtual = schedule.num_stages * schedule.num_chunks
  vstage = schedule.virtual_stage
  stage = np.arange(schedule.num_stages)[None, :]
  v = vstage[stage, np.maximum(schedule.chunk, 0)]
  branch = np.where(schedule.action >= 0, 1 + schedule.action.astype(np.int64) * num_virtual + v,
                    0)
  return {
      "branch": branch.astype(np.int32),
      "microbatch": np.maximum(schedule.microbatch, 0),
      "stash": np.maximum(schedule.stash_slot, 0),
      "forward": (schedule.action == _A.F),
      "send_dir": schedule.send_dir,
      "sends": schedule.send_slot != schedules_lib.IDLE,
      "send_slot": np.maximum(schedule.send_slot, 0),
      "recv_slot": np.maximum(schedule.recv_slot, 0),
      "arrival": schedule.arrival_slots(),
      "weight_slot": weight_slots(schedule),
  }


def weight_slots(schedule: schedules_lib.FusedSchedule) -> np.ndarray:
  """``[T, S]``: the weight slot each ``BI`` fills and its ``W`` empties (0 elsewhere).

  A slot is taken from ``BI`` to ``W``, both ticks included, and reused from the next tick; each
  stage uses as many slots as its most micro-batches awaiting ``W``
  (:meth:`~tpipe.schedules.FusedSchedule.awaiting_weight`).
  """
  slots = np.zeros(schedule.action.shape, np.int32)
  for s in range(schedule.num_stages):
    held: dict[tuple[int, int], int] = {}
    for t in range(schedule.num_ticks):
      key = (int(schedule.microbatch[t, s]), int(schedule.chunk[t, s]))
      if schedule.action[t, s] == _A.BI:
        busy = set(held.values())
        slots[t, s] = held[key] = min(k for k in range(len(busy) + 1) if k not in busy)
      elif schedule.action[t, s] == _A.W:
        slots[t, s] = held.pop(key)
  return slots


def is_split(schedule: schedules_lib.FusedSchedule) -> bool:
  """Whether the table splits backwards into ``BI`` and ``W``."""
  return bool(np.any(np.isin(schedule.action, [_A.BI, _A.W])))


def fused_loss(chunks: Sequence[ChunkFn], params: Any, x: Any, broadcast: tuple,
               per_example: tuple, rngs: dict, *, ring_example: Any,
               schedule: schedules_lib.FusedSchedule, mesh: Mesh, stage_axis: str = "stage",
               data_axis: str | None = "data",
               loss_only: Callable[..., jax.Array] | None = None,
               split_chunks: Sequence[SplitChunk] | None = None) -> jax.Array:
  """The mean over the global batch of the last chunk's per-example losses, run with a fused
  schedule; differentiable (``jax.custom_vjp``) in ``params`` and in the float leaves of ``x``,
  ``broadcast`` and ``per_example``.

  Callers validate arguments first; this function assumes the batch splits into ``M``
  micro-batches per data replica and that the last chunk returns one float loss per example.

  Args:
    chunks: one function per model chunk ``v = 0..V-1`` (see :data:`ChunkFn`), each pure and
      free of collectives; model chunk ``v`` runs on the stage and local chunk the schedule's
      placement gives it.
    params: parameters in stage layout, every leaf ``[C, S, ...]``; split over ``stage_axis``.
    x: pytree of arrays ``[N, ...]``, the global batch.
    broadcast: tuple of arrays every chunk sees whole.
    per_example: tuple of arrays ``[N, ...]`` split into micro-batches like ``x``.
    rngs: dict of RNG stream name to key.
    ring_example: pytree of ``jax.ShapeDtypeStruct`` (no batch axis): what crosses a chunk
      boundary, in both directions (an activation, or its gradient).
    schedule: the fused schedule to run.
    mesh: a mesh with ``stage_axis`` of size ``schedule.num_stages``.
    stage_axis: the mesh axis of pipeline stages.
    data_axis: the mesh axis of data-parallel replicas, or None.
    loss_only: None, or ``loss_only(params, x, broadcast, per_example, rngs)``, the same mean
      loss computed without gradients (the forward executor): it then serves calls that are not
      differentiated, which otherwise run the whole fused schedule and drop the gradients.
    split_chunks: per model chunk, its :class:`SplitChunk`; required when the schedule splits
      the backward into ``BI`` and ``W``.

  Returns:
    The scalar mean loss.
  """
  if is_split(schedule) and (split_chunks is None or len(split_chunks) != len(chunks)):
    raise ValueError(f"schedule {schedule.name!r} splits the backward into BI and W; pass one "
                     "SplitChunk per model chunk as split_chunks.")
  run = _make_run(chunks, split_chunks if is_split(schedule) else None,
                  ring_example=ring_example, schedule=schedule, mesh=mesh,
                  stage_axis=stage_axis, data_axis=data_axis)
  inputs = (params, x, tuple(broadcast), tuple(per_example))
  leaves, treedef = jax.tree.flatten(inputs)
  is_float = [_is_float(leaf) for leaf in leaves]
  split = lambda leaves: (tuple(l for l, f in zip(leaves, is_float) if f),
                          tuple(l for l, f in zip(leaves, is_float) if not f))

  def merge(floats, others):
    floats, others = iter(floats), iter(others)
    return jax.tree.unflatten(treedef, [next(floats) if f else next(others) for f in is_float])

  @jax.custom_vjp
  def loss_of(floats, others, rngs):
    if loss_only is not None:
      return loss_only(*merge(floats, others), rngs)
    return run(*merge(floats, others), rngs)[0]

  def loss_fwd(floats, others, rngs):
    loss, grads = run(*merge(floats, others), rngs)
    return loss, tuple(grads)

  def loss_bwd(grads, cotangent):
    return tuple(g * cotangent.astype(g.dtype) for g in grads), None, None

  loss_of.defvjp(loss_fwd, loss_bwd)
  floats, others = split(leaves)
  return loss_of(floats, others, rngs)


def _split_grads(grads: list, trees: Sequence[Any]) -> list[list]:
  """Cuts the flat list of float-leaf gradients of ``trees`` (in order) into one list per tree."""
  parts = []
  for tree in trees:
    count = len(_floats(tree))
    parts.append(grads[:count])
    grads = grads[count:]
  return parts


def _make_run(chunks, split_chunks, *, ring_example, schedule, mesh, stage_axis, data_axis):
  """``run(params, x, broadcast, per_example, rngs) -> (loss, grads)``: the fused schedule in
  ``shard_map``; ``grads`` lists the gradient of each float leaf of ``(params, x, broadcast,
  per_example)``, in leaf order."""
  num_stages, num_microbatches = schedule.num_stages, schedule.num_microbatches
  num_virtual = num_stages * schedule.num_chunks
  if len(chunks) != num_virtual:
    raise ValueError(f"{len(chunks)} chunk functions for {num_virtual} model chunks.")
  has_data = data_axis is not None and dict(mesh.shape).get(data_axis, 1) > 1
  manual_axes = (data_axis, stage_axis) if has_data else (stage_axis,)
  batch_spec = P(data_axis) if has_data else P()
  num_slots = max(1, int(schedule.stash_slots().max()))
  num_mailbox = max(1, int(schedule.mailbox_slots().max()))
  num_weight_slots = max(1, int(schedule.awaiting_weight().max()))
  wrap = schedule.num_chunks > 1
  right = [(s, (s + 1) % num_stages) for s in range(num_stages if wrap else num_stages - 1)]
  left = [(s, (s - 1) % num_stages) for s in range(0 if wrap else 1, num_stages)]
  tables = _tick_tables(schedule)
  replicas = dict(mesh.shape).get(data_axis, 1) if has_data else 1

  def per_device(params, x, broadcast, per_example, rngs):
    params = jax.tree.map(lambda p: p[:, 0], params)  # [C, ...]
    # Everything varies over every manual axis from here on, so no vjp below needs a reduction
    # over a mesh axis (that would put a collective inside a branch); the sums are explicit,
    # after the loop.
    all_axes = frozenset(manual_axes)
    vary = lambda tree: jax.tree.map(lambda a: gated._cast_to(a, all_axes), tree)
    params, x, broadcast, per_example = vary((params, x, broadcast, per_example))
    stage = lax.axis_index(stage_axis)
    data_index = lax.axis_index(data_axis) if has_data else 0
    local_batch = jax.tree.leaves(x)[0].shape[0]
    rows = local_batch // num_microbatches
    split = lambda tree: jax.tree.map(
        lambda a: a.reshape((num_microbatches, rows) + a.shape[1:]), tree)
    x_mb, pex_mb = split(x), split(per_example)
    seed = jnp.full((rows,), 1.0 / (local_batch * replicas))
    ring_zero = jax.tree.map(lambda s: jnp.zeros((rows,) + tuple(s.shape), s.dtype),
                             ring_example)

    # The split backward's weight slots: per model chunk, the layout of what BI hands to W
    # (the tapped calls' inputs and output gradients), packed into buffers shared by all chunks.
    weight_layouts, tap_shapes = [], []
    if split_chunks is not None:
      one = (params, executor.read_slot(x_mb, 0), vary(ring_zero), broadcast,
             executor.read_slot(pex_mb, 0), rngs, 0)
      for v in range(num_virtual):
        _, (inputs, outputs) = jax.eval_shape(
            lambda *a, v=v: split_chunks[v].forward(*a, None), *one)
        weight_layouts.append(packing.layout_of((inputs, outputs)))
        tap_shapes.append(outputs)
      weight_sizes = packing.buffer_sizes(weight_layouts)
    weight_zero = {} if split_chunks is None else packing.empty(weight_sizes)

    def cotangent_of(v, msg, ring_out, losses):
      """The output cotangent of model chunk ``v``: the loss seed for the last chunk (whose ring
      output is empty), the gradient from the next chunk for the others. Constant outputs vary
      over no mesh axis, so their zeros are cast to match."""
      if v == num_virtual - 1:
        return [_zeros_as(a) for a in ring_out], _as(seed.astype(losses.dtype), losses)
      return [_as(g, a) for g, a in zip(_floats(msg), ring_out)], _zeros_as(losses)

    def file_input_grads(state, parts, microbatch):
      """Adds the gradients of the broadcast and per-example inputs (and of the micro-batch's
      data, for the first chunk) to the running sums."""
      g_fresh, g_broadcast, g_pex = parts
      mb = microbatch - data_index * num_microbatches
      add = lambda total, g: [u + w for u, w in zip(total, g)]
      return dict(state, broadcast=add(state["broadcast"], g_broadcast),
                  x=_add(state["x"], mb, g_fresh),
                  per_example=_add(state["per_example"], mb, g_pex))

    def send_of(stashed, g_in):
      g_in = _with_floats(stashed, g_in)
      return vary(jax.tree.map(lambda g, z: g if _is_float(z) else z, g_in, ring_zero))

    def add_params(state, g_params):
      return dict(state, params=[u + w for u, w in zip(state["params"], g_params)])

    def forward_branch(v):

      def branch(state, weights, params, fresh, msg, stashed, broadcast, pex, rngs, microbatch,
                 weight_slot):
        del stashed, weight_slot
        to_next, losses = chunks[v](params, fresh, msg, broadcast, pex, rngs, microbatch)
        state = dict(state, loss=state["loss"] + jnp.sum(losses).astype(jnp.float32))
        send = to_next if v < num_virtual - 1 else ring_zero
        return state, weights, vary(send)

      return branch

    def backward_branch(v):

      def branch(state, weights, params, fresh, msg, stashed, broadcast, pex, rngs, microbatch,
                 weight_slot):
        del weight_slot
        diff = (params, fresh, stashed, broadcast, pex)

        def fn(*floats):
          p, f, s, b, e = _with_floats(diff, floats)
          to_next, losses = chunks[v](p, f, s, b, e, rngs, microbatch)
          return _floats(to_next), losses

        (ring_out, losses), vjp = jax.vjp(fn, *_floats(diff))
        grads = list(vjp(cotangent_of(v, msg, ring_out, losses)))
        g_params, g_fresh, g_in, g_broadcast, g_pex = _split_grads(grads, diff)
        state = file_input_grads(add_params(state, g_params), (g_fresh, g_broadcast, g_pex),
                                 microbatch)
        return state, weights, send_of(stashed, g_in)

      return branch

    def backward_input_branch(v):

      def branch(state, weights, params, fresh, msg, stashed, broadcast, pex, rngs, microbatch,
                 weight_slot):
        taps = vary(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tap_shapes[v]))
        diff = (params, fresh, stashed, broadcast, pex, taps)

        def fn(*floats):
          p, f, s, b, e, t = _with_floats(diff, floats)
          (to_next, losses), (inputs, _) = split_chunks[v].forward(p, f, s, b, e, rngs,
                                                                   microbatch, t)
          return (_floats(to_next), losses), inputs

        (ring_out, losses), vjp, inputs = jax.vjp(fn, *_floats(diff), has_aux=True)
        grads = list(vjp(cotangent_of(v, msg, ring_out, losses)))
        g_params, g_fresh, g_in, g_broadcast, g_pex, g_taps = _split_grads(grads, diff)
        state = file_input_grads(add_params(state, g_params), (g_fresh, g_broadcast, g_pex),
                                 microbatch)
        filed = packing.pack((inputs, _with_floats(taps, g_taps)), weight_layouts[v],
                             weight_sizes)
        weights = executor.write_slot(weights, weight_slot, vary(filed), True)
        return state, weights, send_of(stashed, g_in)

      return branch

    def weight_branch(v):

      def branch(state, weights, params, fresh, msg, stashed, broadcast, pex, rngs, microbatch,
                 weight_slot):
        del fresh, msg, stashed, broadcast, pex, rngs, microbatch
        inputs, output_grads = packing.unpack(executor.read_slot(weights, weight_slot),
                                              weight_layouts[v])
        grads = split_chunks[v].weight_grads(params, inputs, output_grads)
        return add_params(state, _floats(grads)), weights, vary(ring_zero)

      return branch

    def idle(state, weights, *args):
      del args
      return state, weights, vary(ring_zero)

    branches = [idle] + [make(v) for make in (forward_branch, backward_branch,
                                              backward_input_branch, weight_branch)
                         for v in range(num_virtual)]
    if split_chunks is None:  # Only F and B occur; BI and W could not be traced.
      branches = branches[:1 + 2 * num_virtual]
    # Running sums of the float leaves' gradients: params and broadcast arrays whole, per-example
    # inputs per micro-batch.
    zeros = lambda tree: [jnp.zeros_like(a) for a in _floats(tree)]
    state = vary({"loss": jnp.zeros((), jnp.float32), "params": zeros(params),
                  "broadcast": zeros(broadcast), "x": zeros(x_mb),
                  "per_example": zeros(pex_mb)})
    carry = {"state": state,
             "stash": vary(_stacked(ring_zero, num_slots)),
             "weights": vary(_stacked(weight_zero, num_weight_slots)),
             "mailbox": vary(_stacked(ring_zero, num_mailbox)),
             "arrived": vary((ring_zero, ring_zero, ring_zero))}

    def tick(carry, row):
      row = jax.tree.map(lambda a: a[stage], row)
      mailbox = carry["mailbox"]
      for k, message in enumerate(carry["arrived"]):  # from the left, from the right, own
        slot = row["arrival"][k]
        mailbox = executor.write_slot(mailbox, jnp.maximum(slot, 0), message, slot >= 0)
      mb = row["microbatch"]
      msg = executor.read_slot(mailbox, row["recv_slot"])
      stash = executor.write_slot(carry["stash"], row["stash"], msg, row["forward"])
      state, weights, send = lax.switch(
          row["branch"], branches, carry["state"], carry["weights"], params,
          executor.read_slot(x_mb, mb), msg, executor.read_slot(stash, row["stash"]), broadcast,
          executor.read_slot(pex_mb, mb), rngs, data_index * num_microbatches + mb,
          row["weight_slot"])
      direction, sends = row["send_dir"], row["sends"]
      pick = lambda cond: jax.tree.map(lambda a: jnp.where(cond, a, jnp.zeros_like(a)), send)
      to_right = pick(sends & (direction == 1))
      to_left = pick(sends & (direction == -1))
      own = pick(sends & (direction == 0))
      arrived = (lax.ppermute(to_right, stage_axis, right) if right else to_right,
                 lax.ppermute(to_left, stage_axis, left) if left else to_left,
                 own)
      return {"state": state, "stash": stash, "weights": weights, "mailbox": mailbox,
              "arrived": arrived}, None

    carry, _ = lax.scan(tick, carry, tables)
    state = carry["state"]
    # Once per step, outside the loop.
    loss = lax.psum(state["loss"], manual_axes) / (local_batch * replicas)
    g_params = state["params"]
    g_broadcast = lax.psum(state["broadcast"], manual_axes)
    if has_data:
      g_params = lax.psum(g_params, data_axis)
    g_x, g_pex = lax.psum((state["x"], state["per_example"]), stage_axis)
    unsplit = lambda leaves: [a.reshape((local_batch,) + a.shape[2:]) for a in leaves]
    g_params = [a[:, None] for a in g_params]
    return loss, g_params + unsplit(g_x) + g_broadcast + unsplit(g_pex)

  in_specs = (P(None, stage_axis), batch_spec, P(), batch_spec, P())

  def run(params, x, broadcast, per_example, rngs):
    operands = (params, x, broadcast, per_example, rngs)
    if any(t == AxisType.Explicit for t in mesh.axis_types):
      operands = tuple(
          jax.tree.map(lambda a, spec=spec: jax.reshard(a, NamedSharding(mesh, spec)), operand)
          for operand, spec in zip(operands, in_specs))
    # One gradient per float leaf, in the order of the leaves of (params, x, broadcast,
    # per_example), each split as its input is.
    grad_specs = [spec for tree, spec in zip(operands[:4], in_specs)
                  for _ in _floats(tree)]
    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=in_specs,
                           out_specs=(P(), grad_specs))
    return mapped(*operands)

  return run
