"""The fused tick loop: forward and backward interleaved in one table, memory bounded in S.

The forward loop (:mod:`tpipe.core.loops.forward`) gets its backward pass from autodiff through its
tick
scan, so every stage keeps one stage input per forward tick until the backward begins: activation
memory grows with the number of micro-batches M. A fused schedule
(:class:`tpipe.schedules.FusedSchedule`: 1F1B, interleaved 1F1B, ZB-H1, ZB-V) instead says per
``[tick, stage]`` whether a stage runs a forward ``F``, a backward ``B`` or the two halves of a
split backward (``BI``, ``W``) of one micro-batch on one of its chunks, and this module runs that
table as one SPMD program:

* One ``lax.scan`` over the table's ticks inside ``jax.shard_map``. Each tick every device looks
  up its action and runs it as one branch of a ``lax.switch`` (idle, or ``F``, ``B``, ``BI``,
  ``W`` of one chunk program, :class:`tpipe.core.programs.chunks.ChunkSet`), holding only the
  branches
  the table runs there (:func:`tpipe.core.loops.tick_rows.lane_switches`) and no collective; a
  lane's backwards run each in a conditional of their own after its switch of forwards, which
  never holds the gradient sums (:func:`_lane_runner`). A
  compound tick (:mod:`tpipe.schedules.compound`) runs its rows as lanes, one switch after
  another, each reading the mailbox and writing the stash as a tick of its own would; the
  tick's messages leave once, after the last lane. (On one device the work is serial either
  way, and the lanes share one set of chunk programs where combinations would multiply them.)
  With ``overlap_microbatches``, a forward and a backward of two micro-batches in adjacent
  lanes (:func:`tpipe.core.loops.tick_rows.paired`) run together in a two-way conditional of
  their own (:func:`_pair_runner`), every chunk program unrolled: no conditional or loop
  stands between one action's collectives (a mixture of experts' all-to-all) and the other's
  compute, so the compiler can overlap them, as DualPipe overlaps a forward and a backward.
* ``F`` applies the chunk to the micro-batch's input (the data for the first chunk, otherwise an
  activation from the stage's mailbox) and keeps that input in a **stash slot** of the table. A
  stage allocates as many slots as the table's peak of micro-batches in flight (``min(S, M)``
  for 1F1B), never M.
* ``B`` takes the stashed input and the output gradient (from the mailbox; for the last chunk the
  seed ``1 / N`` per example of the mean loss), recomputes the chunk's forward under ``jax.vjp``
  and applies its VJP: ``remat="full"`` at the granularity of a chunk, the remat policy deciding
  only what the chunk keeps *within* the ``B`` tick. Under ``remat="none"`` ``F`` runs the VJP
  instead and keeps its residuals in a **residual slot** beside the stash
  (:mod:`tpipe.core.programs.residuals`), and ``B`` (or ``BI``) applies it without the forward.
  Under
  ``remat="full"`` (the backward plan, :mod:`tpipe.core.planning.backward_plan`), ``B`` runs the
  chunk's
  units backwards one at a time instead and adds each unit's parameter gradient into the running
  sums in place (:func:`tpipe.core.programs.unit_backward.backward_into`), so no tick builds its
  chunk's whole parameter gradient first. What each action does is :mod:`tpipe.core.loops.branches`.
* ``BI`` is ``B`` with the chunk's operations linear in a weight tapped
(:mod:`tpipe.core.programs.taps`):
  it yields the input gradient and those operations' output gradients, filed with their other
  operands in a **weight slot** (packed per stage, as many slots as the table's most
  micro-batches awaiting ``W``); ``W`` forms the weight gradients from the slot. Nothing is
  computed twice. Under ``remat="none"`` ``F`` files the other operands beside its residuals
  instead, so neither ``BI`` nor ``W`` runs the forward. With ``weight_recompute="forward"`` the
  slot holds the output gradients only, and ``W`` runs the chunk's forward again from the stash
  for the other operands; with ``"backward"`` ``BI`` forms input gradients only, the slot holds
  the chunk's output gradient, and ``W`` runs the chunk's forward and backward again.
* Inputs: where the batch is split over the stages, each micro-batch's inputs reach stage 0 in
  the ticks that read them (its ``F`` and backward of chunk 0) over a conveyor of one-stage sends
  (:mod:`tpipe.core.loops.streaming`; one per lane of a compound tick that reads them), else the
  batch is gathered once before the loop.
* Messages: a forward's output goes to the next model chunk, a backward's input gradient to the
  previous one. After the branch, every device issues the same two ``lax.ppermute`` every tick
  (one to each neighbour; zeros when the table sends nothing that way). A message arrives the
  next tick and waits in the receiver's **mailbox** at the slot the table routes it to.
* The scan's carry is one value, :class:`tpipe.core.loops.buffers.Buffers`: the running sums,
  the stash, residual and weight slots, the mailbox and what arrives next tick.
* Parameter gradients accumulate in one running sum per stage (in the carry); gradients of
  per-example inputs are filed per micro-batch. Once, after the loop: the sum over data replicas
  of the parameter gradients (the step's one all-reduce), and sums over stages of the input
  gradients and the loss.

:func:`mean_loss` wraps the run in a ``jax.custom_vjp`` whose forward runs the schedule with a unit
cotangent, so one pass yields the loss and every gradient, and whose backward scales them by the
incoming cotangent. A call that is not differentiated takes the primal path, the table's forward
pass alone (:func:`forward_outputs`, also what a fused schedule's model returns outputs with).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from tpipe import schedules
from tpipe.core.base import float_leaves as floats_lib
from tpipe.core.base import spmd
from tpipe.core.layout import device_view as view_lib
from tpipe.core.loops import branches as branches_lib
from tpipe.core.loops import buffers as buffers_lib
from tpipe.core.loops import streaming
from tpipe.core.loops import tick_rows
from tpipe.core.planning import backward_plan
from tpipe.core.programs import chunks as chunks_lib

Action = schedules.Action


def is_split(schedule: schedules.FusedSchedule) -> bool:
  """Whether the table splits backwards into ``BI`` and ``W``."""
  return bool(np.any(np.isin(schedule.action, [Action.BI, Action.W])))


def _lane_runner(branches: list[Callable], forward_only: list[bool]) -> Callable:
  """``run(position, state, *operands) -> (state, written, send)``: the lane's branch at
  ``position`` (idle at 0). The forwards and idle (``forward_only``,
  :meth:`~tpipe.core.loops.tick_rows.BranchNumbers.is_forward_or_idle`) share one ``lax.switch``,
  which never holds the running gradient sums (:func:`_without_sums`); every branch that writes
  them (the backwards) runs in a conditional of its own after it, which passes the sums through
  where the step runs another branch (:func:`tpipe.core.loops.tick_rows.lane_groups`). XLA copied
  the sums wherever a conditional held them in more than one branch: in every forward beside a
  backward, and in and out of every iteration of two backwards' loops over units; with two
  backwards of a compound lane (``BI`` of two chunk programs, or ``BI`` and ``W``) side by side,
  on XLA:CPU, every sum in every branch, the per-micro-batch gradient of the inputs included (a
  second copy of a buffer sized by M). Alone in its conditional, a backward adds into the sums
  where they lie."""
  together, apart = tick_rows.lane_groups([not flag for flag in forward_only])
  switch = _without_sums(lambda position, *operands: lax.switch(
      position, [branches[p] for p in together], *operands))
  if not apart:
    return switch
  index = np.zeros(len(branches), np.int32)  # Position in the switch; idle for the apart.
  index[together] = np.arange(len(together))

  def run(position, state, *operands):
    out = switch(jnp.asarray(index)[position], state, *operands)
    for p in apart:
      out = lax.cond(position == p, lambda out, *a, p=p: branches[p](out[0], *a),
                     lambda out, *a: out, out, *operands)
    return out

  return run


def _pair_runner(pairs: list[tuple[Callable, Callable]]) -> Callable:
  """``run(pair, state, slots, ats, steps, sends) -> (state, written, sends)``: two lanes' pair
  (:func:`tpipe.core.loops.tick_rows.pair_switches`) where ``pair`` says one runs (0: none).

  Each pair runs in a two-way conditional of its own (false: pass through, as a backward run
  apart does, so the running sums are not copied), its two branches one after the other as the
  lanes run them, the second reading its slots as the first left them; in one conditional, the
  compiler may run one action's collectives while the other computes. ``ats``, ``steps`` and
  ``sends`` are the two lanes' slots, operands and sends (where no pair runs, what their lanes
  sent); ``written`` is what each lane's slots hold after the pair."""

  def run(pair, state, slots, ats, steps, sends):
    written = tuple(branches_lib.as_is(slots, at) for at in ats)
    out = (state, written, sends)
    for position, (first, second) in enumerate(pairs):

      def both(out, ats, steps, first=first, second=second):
        state, (now_0, now_1), _ = out
        state, written_0, send_0 = first(state, _one_slot(now_0), _slot_zero(now_0), steps[0])
        now_1 = {k: jax.tree.map(lambda a, b, k=k: jnp.where(ats[0][k] == ats[1][k], a, b),
                                 written_0[k], now_1[k]) for k in now_1}
        state, written_1, send_1 = second(state, _one_slot(now_1), _slot_zero(now_1), steps[1])
        return state, (written_0, written_1), (send_0, send_1)

      out = lax.cond(pair == 1 + position, both, lambda out, *_: out, out, ats, steps)
    return out

  return run


def _unrolled(chunkset: chunks_lib.ChunkSet) -> chunks_lib.ChunkSet:
  """``chunkset``'s programs with every layer loop unrolled (its spec's ``unroll=True``): the
  same computation as straight-line code, which the compiler can interleave with other work in
  the same conditional."""
  unrolled = copy.copy(chunkset)
  unrolled.spec = chunkset.spec.replace(unroll=True)
  return unrolled


def _one_slot(contents: dict) -> dict:
  """Slot buffers of one slot holding ``contents`` (what a branch reads at :func:`_slot_zero`)."""
  return {k: jax.tree.map(lambda a: a[None], value) for k, value in contents.items()}


def _slot_zero(contents: dict) -> dict:
  return {k: jnp.zeros((), jnp.int32) for k in contents}


# What a forward writes of the running state
# (:meth:`~tpipe.core.loops.branches.Branches.forward_only`).
_FORWARD_STATE = ("loss", "outputs")


def _without_sums(run: Callable) -> Callable:
  """``run(position, state, *operands)`` of a switch whose branches are all forwards (or idle)
  with the running gradient sums kept out of its conditional, which passes on the loss (or
  outputs) alone. Passed through such a switch, XLA copied the sums in every branch (1F1B in
  compound ticks, remat full, on XLA:CPU: one more copy of the stage's parameters)."""

  def wrapped(position, state, *operands):
    kept = {k: v for k, v in state.items() if k in _FORWARD_STATE}
    out, written, send = run(position, kept, *operands)
    return dict(state, **out), written, send

  return wrapped


class Call(NamedTuple):
  """What one call of a fused run fixes from its inputs.

  Attributes:
    global_batch: the batch size of the call.
    over_stages: whether the batch's rows are split over the stages.
    conveyor: the inputs' conveyor to stage 0 (:mod:`tpipe.core.loops.streaming`), or None.
    ticks: what the tick scan reads, one row per tick (the table's, with the conveyor's).
  """

  global_batch: int
  over_stages: bool
  conveyor: Any
  ticks: dict


class _Run:
  """``run(staged, x, broadcast, per_example, rngs)``: a fused table in ``shard_map``.

  In training mode it returns ``(loss, grads)``: the mean loss and the gradient of each float
  leaf of ``(staged, x, broadcast, per_example)`` in leaf order. With a forward-only table
  (:meth:`~tpipe.schedules.FusedSchedule.forward_pass`) it returns the last chunk's outputs.
  """

  def __init__(self, chunkset: chunks_lib.ChunkSet, schedule: schedules.FusedSchedule,
               axes: spmd.Axes, plan: backward_plan.BackwardPlan):
    # Overlapping micro-batches: a stage's forward and backward of one tick in one conditional,
    # every chunk program unrolled (no layer loop stands between one action's collectives and
    # the other's compute; the lanes run the same programs, so what F files for B, residuals
    # included, has one layout).
    overlap = chunkset.spec.overlap_microbatches and not schedule.forward_only
    if overlap:
      chunkset = _unrolled(chunkset)
    self.chunkset, self.schedule, self.axes, self.plan = chunkset, schedule, axes, plan
    self.rows_table = tick_rows.tick_rows(schedule, chunkset.branch_of_chunk, overlap)
    self.switches = tick_rows.lane_switches(schedule, chunkset.branch_of_chunk, overlap)
    self.pair_switches = (tick_rows.pair_switches(schedule, chunkset.branch_of_chunk) if overlap
                          else [()] * schedule.lanes)
    wrap, num_stages, delays = schedule.num_chunks > 1, schedule.num_stages, schedule.delays
    # Pairs over links without delay send at the end of a tick; over delayed links, during the
    # next tick (what a delayed table expects: arrival two ticks after the send).
    self.right = spmd.split_by_delay(spmd.neighbour_pairs(num_stages, 1, wrap), delays, 1,
                                     num_stages)
    self.left = spmd.split_by_delay(spmd.neighbour_pairs(num_stages, -1, wrap), delays, -1,
                                    num_stages)
    self.delayed = any(delays)
    self.branches = branches_lib.Branches(chunkset, plan)

  # ------------------------------------------------------------------------------------------
  # The loop.

  def per_device(self, call: Call, staged, x, broadcast, per_example, rngs):
    device = branches_lib.Device(self.axes, self.schedule, self.chunkset, call,
                                 (staged, x, broadcast, per_example, rngs))
    schedule, axes, branches = self.schedule, self.axes, self.branches
    collect = schedule.forward_only
    learned = branches.learn(device, collect)

    # Each lane switches over the branches the table runs in it only: a split table's B, or
    # the kinds a compound tick runs in its other lanes, are never traced nor compiled.
    lanes = [_lane_runner([branches.branch(n, device, learned, collect) for n in numbers],
                          [branches.numbers.is_forward_or_idle(n) for n in numbers])
             for numbers in self.switches]
    pairs = [_pair_runner([(branches.branch(a, device, learned, collect),
                            branches.branch(b, device, learned, collect)) for a, b in numbers])
             if numbers else None for numbers in self.pair_switches]
    start = buffers_lib.allocate(
        schedule, axes, self._initial_state(device, collect), device.ring_zero,
        learned.weight_sizes, learned.residual_sizes, delayed=self.delayed,
        conveyor=None if call.conveyor is None else call.conveyor.start(device.held))

    def tick(buffers: buffers_lib.Buffers, row):
      stage = device.stage
      buffers = buffers.receive(row["arrival"][stage])
      state, stash, slots, sends = buffers.state, buffers.stash, buffers.slots, []
      conveyed, conveyor = None, buffers.conveyor
      if call.conveyor is not None:  # Every lane's inputs travel once per tick.
        conveyed, conveyor = call.conveyor.tick(device.held, conveyor, row[streaming.ROW][stage])
      taken = []  # Per lane so far: its slots, operands and row.
      for lane in range(schedule.lanes):  # A compound tick's steps, in the table's order.
        step = jax.tree.map(lambda a: a[lane, stage], row["lanes"])
        msg = spmd.read_slot(buffers.mailbox, step["recv_slot"])
        if not collect:
          stash = spmd.write_slot(stash, step["stash"], msg, step["forward"])
        fresh = device.fresh(step["microbatch"], conveyed, lane)
        at = {"weights": step["weight_slot"], "residuals": step["stash"]}
        operands = branches_lib.Step(msg, spmd.read_slot(stash, step["stash"]), fresh,
                                     step["microbatch"], step["chunk"])
        state, written, send = lanes[lane](step["branch"], state, slots, at, operands)
        slots = {k: spmd.write_slot(slots[k], at[k], written[k]) for k in slots}
        sends.append((send, step))
        taken.append((at, operands, step))
        if lane and pairs[lane - 1] is not None:  # Lanes lane - 1 and lane, where they pair.
          (at_0, step_0, row_0), (at_1, step_1, _) = taken[-2:]
          state, written, paired_sends = pairs[lane - 1](
              row_0["pair"], state, slots, (at_0, at_1), (step_0, step_1),
              (sends[-2][0], sends[-1][0]))
          for at_k, written_k in zip((at_0, at_1), written):
            slots = {k: spmd.write_slot(slots[k], at_k[k], written_k[k]) for k in slots}
          sends[-2:] = [(s, r) for s, (_, r) in zip(paired_sends, sends[-2:])]
      arrived, pending = self._send(sends, buffers.pending)
      return dataclasses.replace(
          buffers, state=state, stash=stash, weights=slots["weights"],
          residuals=slots["residuals"], arrived=arrived,
          pending=pending if self.delayed else None, conveyor=conveyor), None

    end, _ = lax.scan(tick, start, call.ticks)
    return self._reduce(device, call, end.state)

  def _initial_state(self, device: branches_lib.Device, collect: bool):
    if collect:
      return {"outputs": spmd.stacked_zeros(device.output_zero,
                                            self.schedule.num_microbatches)}
    # Running sums of the float leaves' gradients: parameters and broadcast arrays whole,
    # per-example inputs per micro-batch.
    zeros = lambda tree: [jnp.zeros_like(a) for a in floats_lib.float_leaves(tree)]
    return {"loss": jnp.zeros((), jnp.float32), "params": zeros(device.staged),
            "broadcast": zeros(device.broadcast),
            "x": zeros(spmd.stacked_zeros(device.x_example, self.schedule.num_microbatches)),
            "per_example": zeros(device.pex_mb)}

  def _send(self, sends, pending):
    """``(arrived, pending)``: what reaches each stage from its left, its right and itself for
    the next tick, and what this tick sent each way (the delayed links carry it next tick).
    ``sends`` holds each step's ``(message, step row)``; a tick sends at most one message each
    way (the table checks it), so each way takes the one step that sends there."""
    zeros = jax.tree.map(jnp.zeros_like, sends[0][0])
    to_right, to_left, own = zeros, zeros, zeros
    for send, step in sends:
      direction, on = step["send_dir"], step["sends"]
      pick = lambda cond, now: jax.tree.map(lambda a, b: jnp.where(cond, a, b), send, now)
      to_right = pick(on & (direction == 1), to_right)
      to_left = pick(on & (direction == -1), to_left)
      own = pick(on & (direction == 0), own)
    stage = self.axes.stage
    pending = pending or (None, None)  # None: no link is delayed, so none is read.
    arrived = (spmd.permute_parts(to_right, stage, *self.right, pending[0]),
               spmd.permute_parts(to_left, stage, *self.left, pending[1]), own)
    return arrived, (to_right, to_left)

  def _reduce(self, device: branches_lib.Device, call: Call, state):
    """Once per step, outside the loop: sums over stages and replicas."""
    axes = self.axes
    if self.schedule.forward_only:
      outputs = spmd.join_microbatches(state["outputs"])
      return (axes.scatter_stages(outputs) if call.over_stages
              else lax.psum(outputs, axes.stage))
    loss = lax.psum(state["loss"], axes.manual) / (device.local_batch * axes.row_shards)
    g_params = state["params"]
    g_broadcast = lax.psum(state["broadcast"], axes.manual)

    # Over row shards: data always; fsdp where a parameter is not split over it (a split one's
    # gathers already summed its gradient over fsdp).
    def over_rows(g, is_split):
      over = tuple(a for a in axes.rows if not (is_split and a == axes.fsdp))
      return lax.psum(g, over) if over else g

    g_params = [over_rows(g, is_split) for g, is_split in
                zip(g_params, self.chunkset.split_over_fsdp(device.staged))]
    g_params = view_lib.with_stage_axis(g_params, device.staged_leaves)
    joined = lambda leaves: [a.reshape((device.local_batch,) + a.shape[2:]) for a in leaves]
    g_x, g_pex = joined(state["x"]), joined(state["per_example"])
    if call.over_stages:  # Each stage's part of the inputs' gradients, as its inputs came.
      g_x, g_pex = axes.scatter_stages((g_x, g_pex))
    else:
      g_x, g_pex = lax.psum((g_x, g_pex), axes.stage)
    return loss, g_params + g_x + g_broadcast + g_pex

  def call_of(self, global_batch: int) -> Call:
    """What a call with a batch of ``global_batch`` rows fixes (:class:`Call`)."""
    # W reading the stashed input again keeps the inputs on the conveyor until then.
    conveyor = streaming.plan(self.schedule, self.axes, global_batch,
                              self.chunkset.spec.stream_inputs, self.plan.w_recomputes)
    ticks = self.rows_table if conveyor is None else dict(self.rows_table, **conveyor.row())
    return Call(global_batch, self.axes.splits_over_stages(global_batch), conveyor, ticks)

  def __call__(self, staged, x, broadcast, per_example, rngs):
    axes = self.axes
    global_batch = jax.tree.leaves(x)[0].shape[0]
    call = self.call_of(global_batch)
    io = axes.io_spec(global_batch)
    in_specs = (self.chunkset.staged_specs(staged), io, P(), io, P())
    operands = (staged, x, tuple(broadcast), tuple(per_example), rngs)
    if self.schedule.forward_only:
      out_specs = io
    else:
      # One gradient per float leaf, in the order of the leaves of (staged, x, broadcast,
      # per_example), each split as its input is.
      grad_specs = self.chunkset.float_specs(staged) + [
          spec for tree, spec in zip(operands[1:4], in_specs[1:4])
          for _ in floats_lib.float_leaves(tree)]
      out_specs = (P(), grad_specs)
    per_device = lambda *operands: self.per_device(call, *operands)
    return axes.shard_map(per_device, in_specs, out_specs)(*operands)


def forward_outputs(chunkset: chunks_lib.ChunkSet, staged, x, broadcast: tuple,
                    per_example: tuple, rngs: dict, *, schedule: schedules.FusedSchedule,
                    axes: spmd.Axes):
  """The last chunk's outputs for the whole batch, by ``schedule``'s forward pass alone
  (:meth:`~tpipe.schedules.FusedSchedule.forward_pass`); not meant to be differentiated."""
  table = schedule if schedule.forward_only else schedule.forward_pass()
  plan = backward_plan.resolve(chunkset.spec, split=False)  # Nothing runs backwards.
  return _Run(chunkset, table, axes, plan)(staged, x, broadcast, per_example, rngs)


def mean_loss(chunkset: chunks_lib.ChunkSet, staged, x, broadcast: tuple, per_example: tuple,
              rngs: dict, *, schedule: schedules.FusedSchedule, axes: spmd.Axes,
              plan: backward_plan.BackwardPlan,
              primal: Callable[..., jax.Array] | None = None
              ) -> jax.Array:
  """The mean over the global batch of the last chunk's per-example losses, run with a fused
  schedule; differentiable (``jax.custom_vjp``) in ``staged`` and in the float leaves of ``x``,
  ``broadcast`` and ``per_example``.

  Callers validate arguments first; this function assumes the batch splits into ``M``
  micro-batches per data replica and that the last chunk returns one float loss per example.

  Args:
    chunkset: the chunk programs.
    staged: ``{"params": staged tree}``, every leaf ``[C, S, ...]``, split over the stage axis.
    x: pytree of arrays ``[N, ...]``, the global batch.
    broadcast: arrays every chunk sees whole.
    per_example: arrays ``[N, ...]`` split into micro-batches like ``x``.
    rngs: ``{stream: key}``.
    schedule: the fused schedule to run.
    axes: the mesh and its manual axes.
    plan: how the backward actions run (:func:`tpipe.core.planning.backward_plan.resolve`).
    primal: ``primal(staged, x, broadcast, per_example, rngs)``, the same mean computed without
      gradients, for calls that are not differentiated; default: the table's forward pass.
  """
  run = _Run(chunkset, schedule, axes, plan)
  if primal is None:
    primal = lambda *args: jnp.mean(forward_outputs(chunkset, *args, schedule=schedule,
                                                    axes=axes))
  inputs = (staged, x, tuple(broadcast), tuple(per_example))
  leaves, treedef = jax.tree.flatten(inputs)
  is_float = [floats_lib.is_float(leaf) for leaf in leaves]

  def merge(floats, others):
    floats, others = iter(floats), iter(others)
    return jax.tree.unflatten(treedef, [next(floats) if f else next(others) for f in is_float])

  @jax.custom_vjp
  def loss_of(floats, others, rngs):
    return primal(*merge(floats, others), rngs)

  def loss_fwd(floats, others, rngs):
    loss, grads = run(*merge(floats, others), rngs)
    return loss, tuple(grads)

  def loss_bwd(grads, cotangent):
    return tuple(g * cotangent.astype(g.dtype) for g in grads), None, None

  loss_of.defvjp(loss_fwd, loss_bwd)
  floats = tuple(leaf for leaf, f in zip(leaves, is_float) if f)
  others = tuple(leaf for leaf, f in zip(leaves, is_float) if not f)
  return loss_of(floats, others, rngs)
