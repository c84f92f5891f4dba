"""The action branches of a fused table: what ``F``, ``B``, ``BI`` and ``W`` do on one device,
one small function per action and backward plan (:mod:`tpipe.core.loops.fused` runs the loop).

A branch is ``fn(state, slots, at, step) -> (state, written, send)``: it reads the running
sums ``state`` and the step's operands (:class:`Step`: the message from the mailbox, the stashed
chunk input, the micro-batch's inputs), and returns the new sums, what its slot of each slot
buffer holds after the step (``written``) and the message it sends.

Which function runs an action is decided by the step's
:class:`~tpipe.core.planning.backward_plan.BackwardPlan` alone (:meth:`Branches.branch`):

* ``F`` runs the chunk program (:class:`tpipe.core.programs.chunks.ChunkSet`); where the plan keeps
  residuals it runs the chunk's VJP and files the residuals that depend on the micro-batch in
  its residual slot (:mod:`tpipe.core.programs.residuals`), in a split table with the tapped
  operations' inputs.
* ``B`` differentiates the chunk at the stashed input: by units
  (:func:`tpipe.core.programs.unit_backward.backward_into`), or by one ``jax.vjp`` (with ``F``'s
  residuals in place of its own forward's, where ``F`` kept them).
* ``BI`` is ``B`` with the operations linear in a weight tapped (:mod:`tpipe.core.programs.taps`):
it
  files their output gradients (and their other operands, where the plan says so) in a weight
  slot, and ``W`` forms the weight gradients from the slot; or, where ``W`` reruns the
  backward, ``BI`` forms input gradients only and files the chunk's output gradient.

What the slots hold for a call (their layouts, the units' traced programs) is learned once per
call from one device's inputs and returned as a :class:`Slots` value.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from tpipe import schedules
from tpipe.core.base import float_leaves as floats_lib
from tpipe.core.base import packing
from tpipe.core.base import spmd
from tpipe.core.layout import device_view as view_lib
from tpipe.core.loops import tick_rows
from tpipe.core.planning import backward_plan
from tpipe.core.planning import remat as remat_lib
from tpipe.core.programs import chunks as chunks_lib
from tpipe.core.programs import residuals as residuals_lib
from tpipe.core.programs import ring as ring_lib
from tpipe.core.programs import unit_backward

Action = schedules.Action


def _split_grads(grads: list, trees) -> list[list]:
  """Cuts the flat list of float-leaf gradients of ``trees`` (in order) into one list per tree."""
  parts = []
  for tree in trees:
    count = len(floats_lib.float_leaves(tree))
    parts.append(grads[:count])
    grads = grads[count:]
  return parts


def as_is(slots: dict, at: dict) -> dict:
  """What the step's slot of each buffer in ``slots`` holds (``at``: the step's slot in each)."""
  return {k: spmd.read_slot(buffer, at[k]) for k, buffer in slots.items()}


class Device:
  """One device's view of a fused run: its inputs, seeds and zeros, as the branches read them.

  Attributes (besides the inputs): ``axes`` (:class:`~tpipe.core.base.spmd.Axes`), ``schedule``
  (the fused table), ``microbatch_size`` (this device's rows per micro-batch), ``local_batch``
  (its row shard's batch), ``stage`` and ``data_index`` (where it sits on the mesh).
  """

  def __init__(self, axes: spmd.Axes, schedule: schedules.FusedSchedule,
               chunkset: chunks_lib.ChunkSet, call, inputs: tuple):
    """``call``: what the call fixes (``fused.Call``: global batch, inputs' conveyor);
    ``inputs``: this device's ``(staged, x, broadcast, per_example, rngs)``."""
    staged, x, broadcast, per_example, rngs = inputs
    self.axes, self.schedule = axes, schedule
    self.conveyor = call.conveyor
    self.num_virtual = schedule.num_stages * schedule.num_chunks
    # [C, 1, ...]: where the view drops the stage axis.
    self.staged_leaves = floats_lib.float_leaves(staged)
    staged = view_lib.device_view(staged)  # [C, ...]; packed parameters [C, 1, n]
    m = schedule.num_microbatches
    self.local_batch = call.global_batch // axes.row_shards  # The row shard's batch.
    self.microbatch_size = chunkset.spec.microbatch_size(self.local_batch)
    if call.conveyor is not None:  # The inputs reach stage 0 one micro-batch per tick.
      per_example = axes.gather_stages(per_example)
    elif call.over_stages:  # Each stage holds part of the batch: the row shard's whole, once.
      x, per_example = axes.gather_stages((x, per_example))
    # Everything varies over every manual axis from here on, so no vjp below needs a reduction
    # over a mesh axis (that would put a collective inside a branch); the sums are explicit,
    # after the loop.
    self.staged, self.x, self.broadcast, self.per_example = axes.vary(
        (staged, x, broadcast, per_example))
    self.rngs = rngs
    self.stage, self.data_index = axes.stage_index(), axes.data_index()
    if call.conveyor is not None:
      self.held, self.x_mb = call.conveyor.hold(self.x), None
    else:
      self.x_mb = spmd.split_microbatches(self.x, m)
    # One micro-batch's inputs, as a branch sees them (for shapes).
    self.x_example = jax.tree.map(
        lambda a: jnp.zeros((self.microbatch_size,) + a.shape[1:], a.dtype), self.x)
    self.pex_mb = spmd.split_microbatches(self.per_example, m)
    self.seed = jnp.full((self.microbatch_size,), 1.0 / (self.local_batch * axes.row_shards))
    self.ring_zero = ring_lib.zeros_with_rows(chunkset.ring.example, self.microbatch_size)
    self.output_zero = ring_lib.zeros_with_rows(chunkset.output_example,
                                                self.microbatch_size)

  def fresh(self, microbatch, conveyed, lane: int):
    """Micro-batch ``microbatch``'s inputs where lane ``lane`` of this tick reads them: from the
    batch, or (when the inputs stream) what the lane's conveyor brought this tick, ``conveyed``
    being the tick's :meth:`tpipe.core.loops.streaming.Conveyor.tick` values (zeros in a lane that
    never reads inputs; what ticks that do not read get is not read)."""
    if self.conveyor is None:
      return spmd.read_slot(self.x_mb, microbatch)
    value = self.conveyor.value_for(conveyed, lane)
    return self.axes.vary(self.x_example) if value is None else value

  def inputs(self, mb, msg, fresh):
    """A chunk program's arguments after the parameters, for micro-batch ``mb``, the input
    message ``msg`` and the inputs ``fresh``: ``(fresh, incoming, broadcast, per_example, rngs,
    global micro-batch)``."""
    return (fresh, msg, self.broadcast, spmd.read_slot(self.pex_mb, mb),
            self.rngs, self.data_index * self.schedule.num_microbatches + mb)

  def is_last(self, chunk):
    return chunk == self.num_virtual - 1

  def cotangent(self, chunk, msg, ring_out, losses):
    """The output cotangent of a chunk: the loss seed for the last model chunk, the gradient
    from the next chunk for the others (the outputs vary over every manual axis)."""
    last = self.is_last(chunk)
    vary = self.axes.vary
    ring = [jnp.where(last, jnp.zeros_like(a), vary(g.astype(a.dtype)))
            for g, a in zip(floats_lib.float_leaves(msg), ring_out)]
    seed = jnp.where(last, vary(self.seed.astype(losses.dtype)), jnp.zeros_like(losses))
    return ring, seed

  def send_of(self, stashed, g_in):
    g_in = floats_lib.with_float_leaves(stashed, g_in)
    return self.axes.vary(jax.tree.map(lambda g, z: g if floats_lib.is_float(z) else z, g_in,
                                       self.ring_zero))


@dataclasses.dataclass(frozen=True)
class Slots:
  """What one call's slot buffers hold, learned from one device's inputs (:meth:`Branches.learn`).

  Attributes:
    weight_layouts: per chunk program, the packed layout of what ``BI`` hands to ``W``.
    weight_sizes: the weight slots' buffer sizes (shared by all programs).
    tap_shapes: per chunk program, the tapped operations' outputs (``BI``'s taps are zeros of
      these).
    record_shapes: per chunk program, the tapped operations' other operands.
    unit_programs: per chunk program, its units' traced programs (``W`` forms weight gradients
      with them).
    residual_plans: per chunk program, what ``F`` keeps of its VJP
    (:mod:`tpipe.core.programs.residuals`).
    residual_layouts: per chunk program, the packed layout of what ``F`` keeps.
    residual_sizes: the residual slots' buffer sizes.
  """

  weight_layouts: tuple = ()
  weight_sizes: dict = dataclasses.field(default_factory=dict)
  tap_shapes: tuple = ()
  record_shapes: tuple = ()
  unit_programs: tuple = ()
  residual_plans: tuple = ()
  residual_layouts: tuple = ()
  residual_sizes: dict = dataclasses.field(default_factory=dict)


class Step(NamedTuple):
  """One lane step's operands, as a branch reads them: the message ``msg`` from the mailbox,
  the stashed chunk input ``stashed``, the micro-batch's inputs ``fresh``, the micro-batch
  ``mb`` and the model chunk ``chunk``."""

  msg: Any
  stashed: Any
  fresh: Any
  mb: Any
  chunk: Any


class Branches:
  """The action branches of one fused table's chunk programs under one backward plan.

  Per call, inside ``shard_map``, :meth:`learn` returns the slots' layouts (:class:`Slots`) from
  one device's inputs; :meth:`branch` gives the branch a lane switch runs for a branch number
  of :func:`tpipe.core.loops.tick_rows.tick_branches`, as ``fn(state, slots, at, step) -> (state,
  written, send)``: it reads the running sums ``state``, the slot buffers ``slots``
  (``"weights"``: what ``BI`` hands to ``W``; ``"residuals"``: what ``F`` keeps for ``B``) at
  the step's slot ``at`` of each, and the step's operands (:class:`Step`), and returns the
  new sums, what its slot of each buffer holds after the step (``written``; the loop writes
  them after the switch: a branch updating a buffer in place would make XLA copy all of it)
  and the message it sends.
  """

  def __init__(self, chunkset: chunks_lib.ChunkSet, plan: backward_plan.BackwardPlan):
    self.chunkset, self.plan = chunkset, plan
    policy = remat_lib.tick_policy(chunkset.spec)
    # A backward tick recomputes its chunk's forward from the stashed input under jax.vjp: that
    # is remat="full" already, and checkpointing the chunk again inside the tick would run the
    # forward twice for the same peak. Other policies decide what the tick keeps.
    inner = None if policy is remat_lib.FULL else policy
    count = chunkset.num_branches
    self.numbers = tick_rows.BranchNumbers(count)
    self.programs = [chunkset.branch(b, inner) for b in range(count)]
    self.backward_into = ([unit_backward.backward_into(chunkset, b, plan) for b in range(count)]
                          if plan.by_units else [])
    tapped = plan.split and plan.weight_grads != backward_plan.RERUN_BACKWARD
    self.tapped = [chunkset.tapped_branch(b, inner) for b in range(count)] if tapped else []

  # ------------------------------------------------------------------------------------------
  # Choosing a branch.

  def branch(self, number: int, device: Device, slots: Slots, collect: bool):
    """Branch ``number`` (:class:`tpipe.core.loops.tick_rows.BranchNumbers`); ``collect``: a
    forward-only table."""
    decoded = self.numbers.decode(number)
    if decoded is None:
      return lambda state, slots_, at, step: (state, as_is(slots_, at),
                                              device.axes.vary(device.ring_zero))
    action, b = decoded
    plan = self.plan
    if action == Action.F:
      keeps = plan.keeps_residuals and not collect
      make = self._forward_keeping_residuals if keeps else self._forward
      return make(b, device, slots, collect)
    if action == Action.B:
      make = self._backward_by_units if plan.by_units else self._backward_by_vjp
    elif action == Action.BI:
      rerun = plan.weight_grads == backward_plan.RERUN_BACKWARD
      make = self._input_backward_only if rerun else self._input_backward_filing_taps
    else:
      make = {backward_plan.FILED_TAPS: self._weights_from_filed_taps,
              backward_plan.RECOMPUTED_OPERANDS: self._weights_recomputing_operands,
              backward_plan.OPERANDS_FROM_F: self._weights_with_operands_from_f,
              backward_plan.RERUN_BACKWARD: (self._weights_rerun_by_units if plan.by_units
                                             else self._weights_rerun_by_vjp)}[plan.weight_grads]
    return make(b, device, slots)

  # ------------------------------------------------------------------------------------------
  # F.

  def _forward(self, b: int, device: Device, slots: Slots, collect: bool):
    del slots

    def branch(state, slots, at, step):
      msg, stashed, fresh, mb, chunk = step
      to_next, output = self.programs[b](device.staged, *device.inputs(mb, msg, fresh), chunk)
      return _finish_forward(device, state, mb, chunk, output, collect), as_is(slots, at), \
          device.axes.vary(to_next)

    return branch

  def _forward_keeping_residuals(self, b: int, device: Device, slots: Slots, collect: bool):
    """``F`` running the chunk's VJP, its residuals (and in a split table the tapped operations'
    inputs) filed in the residual slot for the backward."""

    def branch(state, slots_, at, step):
      msg, stashed, fresh, mb, chunk = step
      written = as_is(slots_, at)
      (_, output), vjp, (records, to_next), _ = self._vjp(b, device, slots, step, msg,
                                                          tapped=self.plan.split)
      kept = residuals_lib.kept(slots.residual_plans[b], vjp)
      written["residuals"] = device.axes.vary(packing.pack(
          (kept, records) if self.plan.split else kept, slots.residual_layouts[b],
          slots.residual_sizes))
      return _finish_forward(device, state, mb, chunk, output, collect), written, \
          device.axes.vary(to_next)

    return branch

  # ------------------------------------------------------------------------------------------
  # B and BI.

  def _backward_by_units(self, b: int, device: Device, slots: Slots):
    del slots

    def branch(state, slots, at, step):
      msg, stashed, fresh, mb, chunk = step
      sums, g_fresh, g_in, g_broadcast, g_pex = self._by_units(b, device, state, step)
      state = _file_grads(dict(state, params=sums), None, (g_fresh, g_broadcast, g_pex), mb)
      return state, as_is(slots, at), device.send_of(stashed, g_in)

    return branch

  def _backward_by_vjp(self, b: int, device: Device, slots: Slots):

    def branch(state, slots_, at, step):
      msg, stashed, fresh, mb, chunk = step
      written = as_is(slots_, at)
      (ring_out, losses), vjp, _, diff = self._backward_vjp(b, device, slots, written, step,
                                                            tapped=False)
      grads = list(vjp(device.cotangent(chunk, msg, ring_out, losses)))
      g_params, g_fresh, g_in, g_broadcast, g_pex, _ = _split_grads(grads, diff)
      state = _file_grads(state, g_params, (g_fresh, g_broadcast, g_pex), mb)
      return state, written, device.send_of(stashed, g_in)

    return branch

  def _input_backward_filing_taps(self, b: int, device: Device, slots: Slots):
    """``BI``: the chunk's VJP with its weight operations tapped; their output gradients (with
    their other operands where the plan says ``W`` reads them from here) go to the weight
    slot."""

    def branch(state, slots_, at, step):
      msg, stashed, fresh, mb, chunk = step
      written = as_is(slots_, at)
      (ring_out, losses), vjp, records, diff = self._backward_vjp(b, device, slots, written,
                                                                  step, tapped=True)
      grads = list(vjp(device.cotangent(chunk, msg, ring_out, losses)))
      g_params, g_fresh, g_in, g_broadcast, g_pex, g_taps = _split_grads(grads, diff)
      state = _file_grads(state, g_params, (g_fresh, g_broadcast, g_pex), mb)
      output_grads = floats_lib.with_float_leaves(diff[-1], g_taps)
      filed = (records, output_grads) if self.plan.bi_files_operands else output_grads
      written["weights"] = device.axes.vary(packing.pack(
          filed, slots.weight_layouts[b], slots.weight_sizes))
      return state, written, device.send_of(stashed, g_in)

    return branch

  def _input_backward_only(self, b: int, device: Device, slots: Slots):
    """``BI`` where ``W`` reruns the backward: the chunk's VJP in its inputs alone (no weight
    gradient is formed), the chunk's output gradient filed for ``W``."""

    def branch(state, slots_, at, step):
      msg, stashed, fresh, mb, chunk = step
      written = as_is(slots_, at)
      (ring_out, losses), vjp, _, diff = self._vjp(b, device, slots, step, stashed,
                                                   wrt="inputs")
      grads = list(vjp(device.cotangent(chunk, msg, ring_out, losses)))
      g_fresh, g_in, g_broadcast, g_pex, _ = _split_grads(grads, diff[1:])
      state = _file_grads(state, None, (g_fresh, g_broadcast, g_pex), mb)
      written["weights"] = device.axes.vary(packing.pack(
          floats_lib.float_leaves(msg), slots.weight_layouts[b], slots.weight_sizes))
      return state, written, device.send_of(stashed, g_in)

    return branch

  # ------------------------------------------------------------------------------------------
  # W.

  def _weights_from_filed_taps(self, b: int, device: Device, slots: Slots):
    """``W`` from the operands and output gradients ``BI`` filed."""

    def records_and_grads(written, step):
      del step
      return packing.unpack(written["weights"], slots.weight_layouts[b])

    return self._weights_from(b, device, slots, records_and_grads)

  def _weights_recomputing_operands(self, b: int, device: Device, slots: Slots):
    """``W`` from the output gradients ``BI`` filed, the tapped operations' operands computed
    again from the stashed input."""

    def records_and_grads(written, step):
      fresh, _, broadcast, pex, rngs, microbatch = device.inputs(step.mb, step.msg, step.fresh)
      _, (records, _) = self.tapped[b](device.staged, fresh, step.stashed, broadcast, pex, rngs,
                                       microbatch, step.chunk, None)
      return records, packing.unpack(written["weights"], slots.weight_layouts[b])

    return self._weights_from(b, device, slots, records_and_grads)

  def _weights_with_operands_from_f(self, b: int, device: Device, slots: Slots):
    """``W`` from the output gradients ``BI`` filed and the operands ``F`` filed beside its
    residuals."""

    def records_and_grads(written, step):
      del step
      _, records = packing.unpack(written["residuals"], slots.residual_layouts[b])
      return records, packing.unpack(written["weights"], slots.weight_layouts[b])

    return self._weights_from(b, device, slots, records_and_grads)

  def _weights_from(self, b: int, device: Device, slots: Slots, records_and_grads):
    weights = self.chunkset.weight_branch(b, slots.unit_programs[b])

    def branch(state, slots_, at, step):
      msg, stashed, fresh, mb, chunk = step
      written = as_is(slots_, at)
      records, output_grads = records_and_grads(written, step)
      grads = weights(device.staged, step.chunk, records, output_grads)
      state = dict(state, params=[u + w for u, w in
                                  zip(state["params"], floats_lib.float_leaves(grads))])
      return state, written, device.axes.vary(device.ring_zero)

    return branch

  def _weights_rerun_by_units(self, b: int, device: Device, slots: Slots):
    """``W`` running the chunk's backward again by units from the stashed input and the output
    gradient ``BI`` filed, keeping the parameter gradients only (the others are ``BI``'s)."""

    def branch(state, slots_, at, step):
      msg, stashed, fresh, mb, chunk = step
      written = as_is(slots_, at)
      msg = floats_lib.with_float_leaves(
          msg, packing.unpack(written["weights"], slots.weight_layouts[b]))
      sums, *_ = self._by_units(b, device, state, step._replace(msg=msg))
      return dict(state, params=sums), written, device.axes.vary(device.ring_zero)

    return branch

  def _weights_rerun_by_vjp(self, b: int, device: Device, slots: Slots):
    """``W`` running the chunk's VJP in its parameters alone again from the stashed input and
    the output gradient ``BI`` filed."""

    def branch(state, slots_, at, step):
      msg, stashed, fresh, mb, chunk = step
      written = as_is(slots_, at)
      msg = floats_lib.with_float_leaves(
          msg, packing.unpack(written["weights"], slots.weight_layouts[b]))
      outputs, vjp, _, _ = self._vjp(b, device, slots, step._replace(msg=msg), stashed,
                                     wrt="params")
      g_params = vjp(device.cotangent(chunk, msg, *outputs))
      state = dict(state, params=[u + w for u, w in zip(state["params"], g_params)])
      return state, written, device.axes.vary(device.ring_zero)

    return branch

  # ------------------------------------------------------------------------------------------
  # The differentiated chunk programs.

  def _by_units(self, b: int, device: Device, state, step: Step):
    """Program ``b``'s backward one unit at a time
    (:func:`tpipe.core.programs.unit_backward.backward_into`)
    from the stashed input and the output gradient ``msg`` carries: ``(parameter gradient sums
    with this micro-batch's added, g_fresh, g_in, g_broadcast, g_per_example)``."""
    fresh, _, broadcast, pex, rngs, microbatch = device.inputs(step.mb, step.msg, step.fresh)
    outputs = lambda results: device.axes.vary((floats_lib.float_leaves(results[0]),
                                                results[1]))
    cotangent = lambda out: device.cotangent(step.chunk, step.msg, *out)
    args = unit_backward.ChunkArgs(fresh, step.stashed, broadcast, pex, rngs, microbatch)
    sums, g_fresh, g_in, g_side = self.backward_into[b](
        state["params"], device.staged, args, step.chunk, outputs, cotangent)
    count = len(floats_lib.float_leaves(broadcast))
    return sums, g_fresh, g_in, g_side[:count], g_side[count:]

  def _backward_vjp(self, b: int, device: Device, slots: Slots, written: dict, step: Step,
                    tapped: bool):
    """``(outputs, vjp, records, diff)`` of program ``b`` at the stashed input, with ``F``'s
    residuals in place of this trace's where the plan keeps them (its forward is then dead)."""
    outputs, vjp, (records, _), diff = self._vjp(b, device, slots, step, step.stashed,
                                                 tapped=tapped)
    if self.plan.keeps_residuals:
      kept = packing.unpack(written["residuals"], slots.residual_layouts[b])
      vjp = residuals_lib.substitute(slots.residual_plans[b], vjp,
                                     kept[0] if self.plan.split else kept)
    return outputs, vjp, records, diff

  def _chunk_fn(self, b: int, device: Device, diff, call_args: tuple, tapped: bool):
    """Program ``b`` as a function of the float leaves of ``diff`` (parameters, fresh inputs,
    message, broadcast, per-example, taps), ``call_args`` being ``(rngs, microbatch, chunk)``:
    ``(ring floats, losses), (records, to_next)``."""
    rngs, microbatch, chunk = call_args

    def fn(*floats):
      p, f, s, bc, e, t = floats_lib.with_float_leaves(diff, floats)
      if tapped:
        (to_next, losses), (records, _) = self.tapped[b](p, f, s, bc, e, rngs, microbatch,
                                                         chunk, t)
      else:
        (to_next, losses), records = self.programs[b](p, f, s, bc, e, rngs, microbatch,
                                                      chunk), ()
      # Every output varies over every manual axis (zeros too), so cotangents have their types.
      return device.axes.vary((floats_lib.float_leaves(to_next), losses)), (records, to_next)

    return fn

  def _vjp(self, b: int, device: Device, slots: Slots, step: Step, incoming, tapped=False,
           wrt="all"):
    """``(outputs, vjp, (records, to_next), diff)``: ``jax.vjp`` of program ``b`` on the step's
    micro-batch with chunk input ``incoming``, in the float leaves of ``diff``: all of them, the
    ``"params"`` only or the ``"inputs"`` only (the others held constant, so no gradient of
    theirs is formed)."""
    fresh, _, broadcast, pex, rngs, microbatch = device.inputs(step.mb, step.msg, step.fresh)
    chunk = step.chunk
    taps = _zero_taps(slots.tap_shapes[b], device) if tapped else None
    diff = (device.staged, fresh, incoming, broadcast, pex, taps)
    fn = self._chunk_fn(b, device, diff, (rngs, microbatch, chunk), tapped)
    floats = floats_lib.float_leaves(diff)
    num_params = len(floats_lib.float_leaves(device.staged))
    params, inputs = floats[:num_params], floats[num_params:]
    if wrt == "params":
      outputs, vjp, aux = jax.vjp(lambda *p: fn(*p, *inputs), *params, has_aux=True)
    elif wrt == "inputs":
      outputs, vjp, aux = jax.vjp(lambda *i: fn(*params, *i), *inputs, has_aux=True)
    else:
      outputs, vjp, aux = jax.vjp(fn, *floats, has_aux=True)
    return outputs, vjp, aux, diff

  # ------------------------------------------------------------------------------------------
  # Learning the slots' layouts.

  def learn(self, device: Device, collect: bool) -> Slots:
    """The slots' layouts for this call (:class:`Slots`); ``collect``: a forward-only table,
    which keeps nothing for a backward."""
    slots = Slots()
    if self.plan.split:
      slots = self._learn_taps(device)
    if self.plan.keeps_residuals and not collect:
      slots = self._learn_residuals(device, slots)
    return slots

  def _learn_taps(self, device: Device) -> Slots:
    """The weight slots' layouts: per chunk program, what BI hands to W (the tapped operations'
    other operands and output gradients; only the gradients where W recomputes the operands or
    F files them; the chunk's output gradient where W reruns the backward), packed into buffers
    shared by all programs; and the units' traced programs W uses."""
    msg = device.axes.vary(device.ring_zero)
    count = self.chunkset.num_branches
    if self.plan.weight_grads == backward_plan.RERUN_BACKWARD:  # A message's float leaves.
      layouts = (packing.layout_of(floats_lib.float_leaves(msg)),) * count
      return Slots(weight_layouts=layouts, weight_sizes=packing.buffer_sizes(layouts))
    layouts, taps, records, programs = [], [], [], []
    for b in range(count):
      chunk = self.chunkset.chunks_of[b][0]
      inputs = device.inputs(0, msg, device.x_example)
      _, (recorded, outputs) = jax.eval_shape(
          lambda: self.tapped[b](device.staged, *inputs, chunk, None))
      filed = (recorded, outputs) if self.plan.bi_files_operands else outputs
      layouts.append(packing.layout_of(filed))
      taps.append(outputs)
      records.append(recorded)
      programs.append(self.chunkset.unit_programs(b, device.staged, inputs, chunk))
    return Slots(weight_layouts=tuple(layouts), weight_sizes=packing.buffer_sizes(layouts),
                 tap_shapes=tuple(taps), record_shapes=tuple(records),
                 unit_programs=tuple(programs))

  def _learn_residuals(self, device: Device, slots: Slots) -> Slots:
    """Per chunk program, what F keeps of its VJP's residuals for B or BI (those computed from
    the micro-batch's inputs, :mod:`tpipe.core.programs.residuals`; a split table's also the tapped
    operations' inputs for W), and the residual slots' layouts and sizes."""
    msg = device.axes.vary(device.ring_zero)
    plans, layouts = [], []
    for b in range(self.chunkset.num_branches):
      chunk = device.stage * 0 + self.chunkset.chunks_of[b][0]  # Traced, as the loop's is.
      fresh, _, broadcast, pex, rngs, microbatch = device.inputs(  # Varying, as the loop's.
          0, msg, device.axes.vary(device.x_example))
      taps = _zero_taps(slots.tap_shapes[b], device) if self.plan.split else None
      diff = (device.staged, fresh, msg, broadcast, pex, taps)
      fn_of = lambda tree, b=b, args=(rngs, microbatch, chunk): self._chunk_fn(
          b, device, tree, args, self.plan.split)
      moving = [False, True, True, False, True, False]  # Per tree of diff: the micro-batch's.
      plan = residuals_lib.plan_of(fn_of, diff, moving, has_aux=True)
      plans.append(plan)
      # A split table's F also files its weight operations' inputs (the records) for W.
      layouts.append(packing.layout_of(
          (plan.kept_shapes, slots.record_shapes[b]) if self.plan.split else plan.kept_shapes))
    return dataclasses.replace(slots, residual_plans=tuple(plans),
                               residual_layouts=tuple(layouts),
                               residual_sizes=packing.buffer_sizes(layouts))


def _finish_forward(device: Device, state, mb, chunk, output, collect: bool):
  """The running state after ``F`` of ``chunk`` on ``mb``: the last chunk's output filed (a
  forward-only table) or its losses summed."""
  last = device.is_last(chunk)
  if collect:
    return dict(state, outputs=spmd.write_slot(state["outputs"], mb, output, last))
  loss = jnp.where(last, jnp.sum(output).astype(jnp.float32), 0.0)
  return dict(state, loss=state["loss"] + loss)


def _file_grads(state, g_params, inputs, mb):
  """``state`` with a backward's gradients added: the parameters' (None: already summed), and
  ``inputs``' ``(g_fresh, g_broadcast, g_per_example)``."""
  g_fresh, g_broadcast, g_pex = inputs
  add = lambda total, g: [u + w for u, w in zip(total, g)]
  params = state["params"] if g_params is None else add(state["params"], g_params)
  return dict(state, params=params,
              broadcast=add(state["broadcast"], g_broadcast),
              x=spmd.add_to_slot(state["x"], mb, g_fresh),
              per_example=spmd.add_to_slot(state["per_example"], mb, g_pex))


def _zero_taps(tap_shapes, device: Device):
  return device.axes.vary(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tap_shapes))
