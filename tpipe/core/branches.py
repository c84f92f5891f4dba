"""What each action of a fused table does on one device: the ``F``, ``B``, ``BI`` and ``W``
branches of the tick loop's switches (:mod:`tpipe.core.fused` runs the loop).

A branch is ``fn(state, slots, at, msg, stashed, fresh, mb, chunk) -> (state, written, send)``:
it reads the running sums ``state``, the message ``msg`` from the mailbox, the stashed chunk
input ``stashed`` and the micro-batch's inputs ``fresh``, and returns the new sums, what its
slot of each slot buffer holds after the step (``written``) and the message it sends.

* ``F`` runs the chunk program (:class:`tpipe.core.chunks.ChunkSet`); under ``remat="none"`` it
  runs the chunk's VJP and files the residuals that depend on the micro-batch in its residual
  slot (:mod:`tpipe.core.residuals`), in a split table with the tapped operations' inputs.
* ``B`` differentiates the chunk at the stashed input: by units under ``remat="full"``
  (:func:`tpipe.core.unit_backward.backward_into`), else by one ``jax.vjp`` (with ``F``'s
  residuals in place of its own forward's, where ``F`` kept them).
* ``BI`` is ``B`` with the operations linear in a weight tapped (:mod:`tpipe.core.taps`): it
  files their output gradients (and their other operands, unless ``F`` filed them or ``W``
  recomputes them) in a weight slot; ``W`` forms the weight gradients from the slot. Under
  ``weight_recompute="backward"`` ``BI`` forms input gradients only and files the chunk's
  output gradient, and ``W`` runs the chunk's backward again for the weight gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpipe import schedules
from tpipe.core import chunks as chunks_lib
from tpipe.core import packing
from tpipe.core import residuals as residuals_lib
from tpipe.core import spmd
from tpipe.core import unit_backward

Action = schedules.Action

# Short names for the float-leaf helpers the branches use at every step.
_is_float = chunks_lib.is_float
_floats = chunks_lib.float_leaves
_with_floats = chunks_lib.with_float_leaves


def _split_grads(grads: list, trees) -> list[list]:
  """Cuts the flat list of float-leaf gradients of ``trees`` (in order) into one list per tree."""
  parts = []
  for tree in trees:
    count = len(_floats(tree))
    parts.append(grads[:count])
    grads = grads[count:]
  return parts


def as_is(slots: dict, at: dict) -> dict:
  """What the step's slot of each buffer in ``slots`` holds (``at``: the step's slot in each)."""
  return {k: spmd.read_slot(buffer, at[k]) for k, buffer in slots.items()}


class Device:
  """One device's view of a fused run (:class:`tpipe.core.fused` ``_Run``): its inputs, seeds and
  zeros, as the branches read them."""

  def __init__(self, run, staged, x, broadcast, per_example, rngs):
    self.run, axes, schedule = run, run.axes, run.schedule
    self.num_virtual = schedule.num_stages * schedule.num_chunks
    self.staged_leaves = _floats(staged)  # [C, 1, ...]: where the view drops the stage axis.
    staged = chunks_lib.device_view(staged)  # [C, ...]; packed parameters [C, 1, n]
    m = schedule.num_microbatches
    self.local_batch = run.global_batch // axes.replicas  # The row shard's batch.
    self.rows = self.local_batch // m
    if run.conveyor is not None:  # The inputs reach stage 0 one micro-batch per tick.
      per_example = axes.gather_stages(per_example)
    elif run.over_stages:  # Each stage holds part of the batch: the row shard's whole, once.
      x, per_example = axes.gather_stages((x, per_example))
    # Everything varies over every manual axis from here on, so no vjp below needs a reduction
    # over a mesh axis (that would put a collective inside a branch); the sums are explicit,
    # after the loop.
    self.staged, self.x, self.broadcast, self.per_example = axes.vary(
        (staged, x, broadcast, per_example))
    self.rngs = rngs
    self.stage, self.data_index = axes.stage_index(), axes.data_index()
    if run.conveyor is not None:
      self.held, self.x_mb = run.conveyor.hold(self.x), None
    else:
      self.x_mb = spmd.split_microbatches(self.x, m)
    # One micro-batch's inputs, as a branch sees them (for shapes).
    self.x_example = jax.tree.map(lambda a: jnp.zeros((self.rows,) + a.shape[1:], a.dtype),
                                  self.x)
    self.pex_mb = spmd.split_microbatches(self.per_example, m)
    self.seed = jnp.full((self.rows,), 1.0 / (self.local_batch * axes.replicas))
    self.ring_zero = chunks_lib.zeros_with_rows(run.chunkset.ring.example, self.rows)
    self.output_zero = chunks_lib.zeros_with_rows(run.chunkset.output_example, self.rows)

  def fresh(self, carry: dict, microbatch, conveyor_row):
    """``(fresh, carry)``: micro-batch ``microbatch``'s inputs where this tick reads them (over
    the conveyor when it streams, ``conveyor_row`` being its tick's row; what other ticks get
    is not read)."""
    if self.run.conveyor is None:
      return spmd.read_slot(self.x_mb, microbatch), carry
    fresh, conveyed = self.run.conveyor.tick(self.held, carry["conveyor"], conveyor_row)
    return fresh, dict(carry, conveyor=conveyed)

  def inputs(self, mb, msg, fresh):
    """A chunk program's arguments after the parameters, for micro-batch ``mb``, the input
    message ``msg`` and the inputs ``fresh``: ``(fresh, incoming, broadcast, per_example, rngs,
    global micro-batch)``."""
    return (fresh, msg, self.broadcast, spmd.read_slot(self.pex_mb, mb),
            self.rngs, self.data_index * self.run.schedule.num_microbatches + mb)

  def is_last(self, chunk):
    return chunk == self.num_virtual - 1

  def cotangent(self, chunk, msg, ring_out, losses):
    """The output cotangent of a chunk: the loss seed for the last model chunk, the gradient
    from the next chunk for the others (the outputs vary over every manual axis)."""
    last = self.is_last(chunk)
    vary = self.run.axes.vary
    ring = [jnp.where(last, jnp.zeros_like(a), vary(g.astype(a.dtype)))
            for g, a in zip(_floats(msg), ring_out)]
    seed = jnp.where(last, vary(self.seed.astype(losses.dtype)), jnp.zeros_like(losses))
    return ring, seed

  def send_of(self, stashed, g_in):
    g_in = _with_floats(stashed, g_in)
    return self.run.axes.vary(jax.tree.map(lambda g, z: g if _is_float(z) else z, g_in,
                                           self.ring_zero))


class Branches:
  """The action branches of one fused table's chunk programs: :meth:`branch` gives the one a
  lane switch runs for a branch number of :func:`tpipe.core.tick_rows.tick_branches`.

  Per call, inside ``shard_map``, :meth:`learn` first finds the slots' layouts from one
  device's inputs (what ``BI`` hands to ``W``; what ``F`` keeps for ``B`` under
  ``remat="none"``); the loop allocates the slot buffers from :attr:`weight_sizes` and
  :attr:`residual_sizes`.
  """

  def __init__(self, chunkset: chunks_lib.ChunkSet, split: bool):
    self.chunkset, self.split = chunkset, split
    policy = chunks_lib.tick_policy(chunkset.spec)
    # A backward tick recomputes its chunk's forward from the stashed input under jax.vjp: that
    # is remat="full" already, and checkpointing the chunk again inside the tick would run the
    # forward twice for the same peak. Other policies decide what the tick keeps.
    inner = None if policy is chunks_lib.FULL else policy
    count = chunkset.num_branches
    self.programs = [chunkset.branch(b, inner) for b in range(count)]
    # B runs its units backwards one at a time, their parameter gradients added into the
    # running sums in place, without first building the chunk's whole parameter gradient.
    self.unitwise = unit_backward.by_units(chunkset.spec)
    self.backward_into = ([unit_backward.backward_into(chunkset, b) for b in range(count)]
                          if self.unitwise else [])
    recompute = chunkset.spec.weight_recompute if self.split else False
    # W reads the micro-batch's inputs and stashed input again (weight_recompute): "forward"
    # for the tapped operations' inputs, so BI files only their output gradients; "backward"
    # for the whole chunk backward, so BI forms input gradients only and files the chunk's
    # output gradient.
    self.recompute = bool(recompute)
    self.rerun_backward = recompute == "backward"
    taps = self.split and not self.rerun_backward
    self.tapped = [chunkset.tapped_branch(b, inner) for b in range(count)] if taps else []
    self.weights = [chunkset.weight_branch(b) for b in range(count)] if taps else []
    # Under remat="none" F keeps what B (or BI) needs of its VJP, so the backward runs without
    # the forward; a split table's F also files its weight operations' inputs for W, so W runs
    # no forward either (unless weight_recompute asks W to recompute).
    self.keeps_residuals = chunkset.spec.remat == "none" and not self.recompute
    # Whether BI files its weight operations' inputs for W (else W recomputes them, or F filed
    # them beside its residuals).
    self.files_records = taps and not self.recompute and not self.keeps_residuals

  # ------------------------------------------------------------------------------------------
  # Branches: fn(state, slots, at, msg, stashed, fresh, mb, chunk) -> (state, written, send).
  # ``slots``: buffers of slots ("weights": what BI hands to W, "residuals": what F keeps for
  # B); ``at``: the step's slot in each; ``written``: what those slots hold after the step (BI's
  # and F's filings, else the slot as it is). The loop writes them after the switch: a branch
  # updating a buffer in place would make XLA copy all of it.

  def forward_branch(self, b: int, device: Device, collect: bool):

    def branch(state, slots, at, msg, stashed, fresh, mb, chunk):
      written = as_is(slots, at)
      if self.residual_plans:  # The chunk's VJP, keeping its residuals for the backward.
        (_, output), vjp, (records, to_next), _ = self._vjp(b, device, mb, msg, msg, fresh,
                                                            chunk, tapped=self.split)
        kept = residuals_lib.kept(self.residual_plans[b], vjp)
        written["residuals"] = device.run.axes.vary(packing.pack(
            (kept, records) if self.split else kept, self.residual_layouts[b],
            self.residual_sizes))
      else:
        to_next, output = self.programs[b](device.staged, *device.inputs(mb, msg, fresh),
                                           chunk)
      last = device.is_last(chunk)
      if collect:
        state = dict(state, outputs=spmd.write_slot(state["outputs"], mb, output, last))
      else:
        loss = jnp.where(last, jnp.sum(output).astype(jnp.float32), 0.0)
        state = dict(state, loss=state["loss"] + loss)
      # The last chunk sends nothing: the routing tables zero its message.
      return state, written, device.run.axes.vary(to_next)

    return branch

  def backward_branch(self, b: int, device: Device, tapped: bool):
    if tapped and self.rerun_backward:
      return self.input_backward_branch(b, device)

    def branch(state, slots, at, msg, stashed, fresh, mb, chunk):
      written = as_is(slots, at)
      if self.unitwise and not tapped:
        sums, g_fresh, g_in, g_broadcast, g_pex = self._by_units(b, device, state, msg,
                                                                 stashed, fresh, mb, chunk)
        state = self._file_grads(device, dict(state, params=sums), None,
                                 (g_fresh, g_broadcast, g_pex), mb)
        return state, written, device.send_of(stashed, g_in)
      (ring_out, losses), vjp, (records, _), diff = self._vjp(b, device, mb, msg, stashed,
                                                              fresh, chunk, tapped)
      if self.residual_plans:  # F's residuals in place of this trace's: its forward is dead.
        kept = packing.unpack(written["residuals"], self.residual_layouts[b])
        vjp = residuals_lib.substitute(self.residual_plans[b], vjp,
                                       kept[0] if self.split else kept)
      grads = list(vjp(device.cotangent(chunk, msg, ring_out, losses)))
      g_params, g_fresh, g_in, g_broadcast, g_pex, g_taps = _split_grads(grads, diff)
      state = self._file_grads(device, state, g_params, (g_fresh, g_broadcast, g_pex), mb)
      if tapped:
        output_grads = _with_floats(diff[-1], g_taps)
        written["weights"] = device.run.axes.vary(packing.pack(
            (records, output_grads) if self.files_records else output_grads,
            self.weight_layouts[b], self.weight_sizes))
      return state, written, device.send_of(stashed, g_in)

    return branch

  def input_backward_branch(self, b: int, device: Device):
    """``BI`` under ``weight_recompute="backward"``: the chunk's VJP in its inputs alone (no
    weight gradient is formed), the chunk's output gradient filed for ``W``."""

    def branch(state, slots, at, msg, stashed, fresh, mb, chunk):
      written = as_is(slots, at)
      (ring_out, losses), vjp, _, diff = self._vjp(b, device, mb, msg, stashed, fresh, chunk,
                                                   wrt="inputs")
      grads = list(vjp(device.cotangent(chunk, msg, ring_out, losses)))
      g_fresh, g_in, g_broadcast, g_pex, _ = _split_grads(grads, diff[1:])
      state = self._file_grads(device, state, None, (g_fresh, g_broadcast, g_pex), mb)
      written["weights"] = device.run.axes.vary(packing.pack(
          _floats(msg), self.weight_layouts[b], self.weight_sizes))
      return state, written, device.send_of(stashed, g_in)

    return branch

  def weight_backward_branch(self, b: int, device: Device):
    """``W`` under ``weight_recompute="backward"``: the chunk's backward again from the stashed
    input and the filed output gradient, keeping the parameter gradients only (by units under
    ``remat="full"``, as ``B`` runs)."""

    def branch(state, slots, at, msg, stashed, fresh, mb, chunk):
      written = as_is(slots, at)
      msg = _with_floats(msg, packing.unpack(written["weights"], self.weight_layouts[b]))
      if self.unitwise:  # The other gradients are BI's: only the sums are kept.
        sums, *_ = self._by_units(b, device, state, msg, stashed, fresh, mb, chunk)
        state = dict(state, params=sums)
      else:
        outputs, vjp, _, _ = self._vjp(b, device, mb, msg, stashed, fresh, chunk, wrt="params")
        g_params = vjp(device.cotangent(chunk, msg, *outputs))
        state = dict(state, params=[u + w for u, w in zip(state["params"], g_params)])
      return state, written, device.run.axes.vary(device.ring_zero)

    return branch

  def weight_branch(self, b: int, device: Device):
    if self.rerun_backward:
      return self.weight_backward_branch(b, device)

    def branch(state, slots, at, msg, stashed, fresh, mb, chunk):
      written = as_is(slots, at)
      unpacked = packing.unpack(written["weights"], self.weight_layouts[b])
      if self.recompute:  # The tapped operations' inputs again, from the stashed input.
        fresh, _, broadcast, pex, rngs, microbatch = device.inputs(mb, msg, fresh)
        _, (records, _) = self.tapped[b](device.staged, fresh, stashed, broadcast, pex, rngs,
                                         microbatch, chunk, None)
        output_grads = unpacked
      elif self.residual_plans:  # F filed them beside its residuals.
        _, records = packing.unpack(written["residuals"], self.residual_layouts[b])
        output_grads = unpacked
      else:
        records, output_grads = unpacked
      grads = self.weights[b](device.staged, chunk, records, output_grads)
      state = dict(state, params=[u + w for u, w in zip(state["params"], _floats(grads))])
      return state, written, device.run.axes.vary(device.ring_zero)

    return branch

  def _by_units(self, b: int, device: Device, state, msg, stashed, fresh, mb, chunk):
    """Program ``b``'s backward one unit at a time (:func:`tpipe.core.unit_backward.backward_into`)
    from the stashed input and the output gradient ``msg`` carries: ``(parameter gradient sums
    with this micro-batch's added, g_fresh, g_in, g_broadcast, g_per_example)``."""
    fresh, _, broadcast, pex, rngs, microbatch = device.inputs(mb, msg, fresh)
    outputs = lambda results: device.run.axes.vary((_floats(results[0]), results[1]))
    cotangent = lambda out: device.cotangent(chunk, msg, *out)
    sums, g_fresh, g_in, g_side = self.backward_into[b](
        state["params"], device.staged, fresh, stashed, broadcast, pex, rngs, microbatch, chunk,
        outputs, cotangent)
    count = len(_floats(broadcast))
    return sums, g_fresh, g_in, g_side[:count], g_side[count:]

  def _chunk_fn(self, b: int, device: Device, diff, rngs, microbatch, chunk, tapped: bool):
    """Program ``b`` as a function of the float leaves of ``diff`` (parameters, fresh inputs,
    message, broadcast, per-example, taps): ``(ring floats, losses), (records, to_next)``."""

    def fn(*floats):
      p, f, s, bc, e, t = _with_floats(diff, floats)
      if tapped:
        (to_next, losses), (records, _) = self.tapped[b](p, f, s, bc, e, rngs, microbatch,
                                                         chunk, t)
      else:
        (to_next, losses), records = self.programs[b](p, f, s, bc, e, rngs, microbatch,
                                                      chunk), ()
      # Every output varies over every manual axis (zeros too), so cotangents have their types.
      return device.run.axes.vary((_floats(to_next), losses)), (records, to_next)

    return fn

  def _vjp(self, b: int, device: Device, mb, msg, incoming, fresh, chunk, tapped=False,
           wrt="all"):
    """``(outputs, vjp, (records, to_next), diff)``: ``jax.vjp`` of program ``b`` on ``mb`` in
    the float leaves of ``diff``: all of them, the ``"params"`` only or the ``"inputs"`` only
    (the others held constant, so no gradient of theirs is formed)."""
    fresh, _, broadcast, pex, rngs, microbatch = device.inputs(mb, msg, fresh)
    taps = self._zero_taps(b, device) if tapped else None
    diff = (device.staged, fresh, incoming, broadcast, pex, taps)
    fn = self._chunk_fn(b, device, diff, rngs, microbatch, chunk, tapped)
    floats = _floats(diff)
    num_params = len(_floats(device.staged))
    params, inputs = floats[:num_params], floats[num_params:]
    if wrt == "params":
      outputs, vjp, aux = jax.vjp(lambda *p: fn(*p, *inputs), *params, has_aux=True)
    elif wrt == "inputs":
      outputs, vjp, aux = jax.vjp(lambda *i: fn(*params, *i), *inputs, has_aux=True)
    else:
      outputs, vjp, aux = jax.vjp(fn, *floats, has_aux=True)
    return outputs, vjp, aux, diff

  def learn_residuals(self, device: Device):
    """Per chunk program, what F keeps of its VJP's residuals for B or BI (those computed from
    the micro-batch's inputs, :mod:`tpipe.core.residuals`; a split table's also the tapped
    operations' inputs for W), and the residual slots' layouts and sizes."""
    msg = device.run.axes.vary(device.ring_zero)
    for b in range(self.chunkset.num_branches):
      chunk = device.stage * 0 + self.chunkset.chunks_of[b][0]  # Traced, as the loop's is.
      fresh, _, broadcast, pex, rngs, microbatch = device.inputs(  # Varying, as the loop's.
          0, msg, device.run.axes.vary(device.x_example))
      taps = self._zero_taps(b, device) if self.split else None
      diff = (device.staged, fresh, msg, broadcast, pex, taps)
      fn_of = lambda tree, b=b, chunk=chunk, rngs=rngs, microbatch=microbatch: self._chunk_fn(
          b, device, tree, rngs, microbatch, chunk, self.split)
      moving = [False, True, True, False, True, False]  # Per tree of diff: the micro-batch's.
      plan = residuals_lib.plan_of(fn_of, diff, moving, has_aux=True)
      self.residual_plans.append(plan)
      # A split table's F also files its weight operations' inputs (the records) for W.
      self.residual_layouts.append(packing.layout_of(
          (plan.kept_shapes, self.record_shapes[b]) if self.split else plan.kept_shapes))
    self.residual_sizes = packing.buffer_sizes(self.residual_layouts)

  def _file_grads(self, device: Device, state, g_params, inputs, mb):
    g_fresh, g_broadcast, g_pex = inputs
    add = lambda total, g: [u + w for u, w in zip(total, g)]
    params = state["params"] if g_params is None else add(state["params"], g_params)
    return dict(state, params=params,
                broadcast=add(state["broadcast"], g_broadcast),
                x=spmd.add_to_slot(state["x"], mb, g_fresh),
                per_example=spmd.add_to_slot(state["per_example"], mb, g_pex))

  def _zero_taps(self, b, device):
    return device.run.axes.vary(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                             self.tap_shapes[b]))

  def learn_taps(self, device: Device):
    """The weight slots' layouts: per chunk program, what BI hands to W (the tapped operations'
    other operands and output gradients; only the gradients with ``weight_recompute="forward"``
    or where F files the operands; the chunk's output gradient with ``"backward"``), packed
    into buffers shared by all programs."""
    self.weight_layouts, self.tap_shapes, self.record_shapes = [], [], []
    msg = device.run.axes.vary(device.ring_zero)
    if self.rerun_backward:  # The chunk's output gradient: a message's float leaves.
      self.weight_layouts = [packing.layout_of(_floats(msg))] * self.chunkset.num_branches
      self.weight_sizes = packing.buffer_sizes(self.weight_layouts)
      return
    for b in range(self.chunkset.num_branches):
      chunk = self.chunkset.chunks_of[b][0]
      _, (records, outputs) = jax.eval_shape(
          lambda: self.tapped[b](device.staged, *device.inputs(0, msg, device.x_example),
                                 chunk, None))
      self.weight_layouts.append(packing.layout_of((records, outputs) if self.files_records
                                                   else outputs))
      self.tap_shapes.append(outputs)
      self.record_shapes.append(records)
    self.weight_sizes = packing.buffer_sizes(self.weight_layouts)

  def learn(self, device: Device, collect: bool) -> None:
    """The slots' layouts for this call (see the class docstring); ``collect``: a forward-only
    table, which keeps nothing for a backward."""
    self.residual_plans, self.residual_layouts, self.residual_sizes = [], [], {}
    self.weight_layouts, self.weight_sizes, self.tap_shapes, self.record_shapes = [], {}, [], []
    if self.split:
      self.learn_taps(device)
    if self.keeps_residuals and not collect:
      self.learn_residuals(device)

  def adds_in_place(self, number: int) -> bool:
    """Whether branch ``number`` (numbered as :meth:`branch`) adds its parameter gradients into
    the running sums inside a loop over units (:func:`tpipe.core.unit_backward.backward_into`):
    ``B`` by units, and ``W`` running the backward again by units."""
    if number == 0 or not self.unitwise:
      return False
    action = (number - 1) // self.chunkset.num_branches
    return action == Action.B or (action == Action.W and self.rerun_backward)

  def branch(self, number: int, device: Device, collect: bool):
    """Branch ``number`` (:func:`tpipe.core.tick_rows.tick_branches`' numbering: idle, then
    ``action * count + program``) as ``fn(state, slots, at, msg, stashed, fresh, mb, chunk) ->
    (state, written, send)``."""
    count = self.chunkset.num_branches
    if number == 0:
      return lambda state, slots, at, *a: (state, as_is(slots, at),
                                           device.run.axes.vary(device.ring_zero))
    action, b = divmod(number - 1, count)
    if action == Action.F:
      return self.forward_branch(b, device, collect)
    if action == Action.W:
      return self.weight_branch(b, device)
    return self.backward_branch(b, device, tapped=action == Action.BI)
