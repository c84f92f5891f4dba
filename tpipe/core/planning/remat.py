"""Rematerialization: which ``jax.checkpoint`` policy a ``remat`` option means, and how a
chunk's layer units are cut into checkpointed pieces (``remat_granularity``).

A chunk's units are applied by :func:`apply_units`. With ``"chunk"`` granularity the caller
checkpoints the whole chunk with the remat policy (:func:`chunk_policy`): its backward then holds
every unit's intermediates of one micro-batch at once. With a finer granularity every ``k``
consecutive units are checkpointed with the policy, and the chunk's own checkpoint keeps each
piece's input (marked :data:`PIECE_INPUT_NAME`), so the backward recomputes one piece at a time
for the same recompute FLOPs. Under ``remat="none"`` there is nothing to recompute: every
granularity runs as ``"chunk"`` (:func:`tpipe.spec.granularity_in_effect`), since pieces would only
add checkpoints and loops (a run's pieces re-roll ``unroll=True``) and save no memory.

A chunk's parameter slice is marked :data:`CHUNK_PARAMS_NAME` and never saved: it is cheap to
take again from the stage's parameters, and the tick loop's autodiff would otherwise stash a copy
of them at every tick (so even ``remat="none"`` runs under a checkpoint that saves everything
else).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from tpipe import spec as spec_lib

# The name of a chunk's parameter slice inside a tick (never saved for the backward pass).
CHUNK_PARAMS_NAME = "tpipe_chunk_params"
# The name of a checkpointed piece's input inside a chunk (see chunk_policy).
PIECE_INPUT_NAME = "tpipe_piece_input"


def policy_of(remat) -> Any:
  """The ``jax.checkpoint`` policy of a ``remat`` option (validated by
  :func:`tpipe.spec.check_remat`).

  Returns:
    ``None`` for ``"full"`` (save nothing: only the checkpoint's inputs are kept); for
    ``"none"``, everything except the chunk's parameter slice (:data:`CHUNK_PARAMS_NAME`); for
    ``"dots"``, matmul outputs; a callable policy as given.
  """
  spec_lib.check_remat(remat)
  if remat == "none":
    return jax.checkpoint_policies.save_anything_except_these_names(CHUNK_PARAMS_NAME)
  if remat == "full":
    return None
  if remat == "dots":
    return jax.checkpoint_policies.dots_saveable
  return remat


# jax.checkpoint's policy for remat="full" is None; this sentinel asks for that checkpoint, where
# None means no checkpoint at all.
FULL = object()


def tick_policy(spec) -> Any:
  """The checkpoint around a chunk in a forward tick (a :class:`tpipe.PipelineSpec`'s): the
  chunk policy (:func:`chunk_policy`), :data:`FULL` for ``remat="full"`` (the chunk keeps only
  its input)."""
  policy = chunk_policy(spec.remat, spec.remat_granularity)
  return FULL if policy is None else policy


def checkpointed(fn, policy):
  """``fn`` under ``jax.checkpoint`` with ``policy`` (:data:`FULL`: save nothing), or as it is
  for None."""
  if policy is None:
    return fn
  return jax.checkpoint(fn, policy=None if policy is FULL else policy, prevent_cse=False)


def chunk_policy(remat, granularity) -> Any:
  """The ``jax.checkpoint`` policy of the checkpoint around a whole chunk.

  With ``"chunk"`` granularity it is the remat policy (:func:`policy_of`). Finer, the chunk
  keeps what its pieces' checkpoints need for their backward passes: each piece's input plus
  what the remat policy saves inside it. So across ticks a chunk keeps one input per piece
  instead of one, and its backward recomputes one piece at a time (the same recompute FLOPs as
  ``"chunk"``) instead of holding every unit's intermediates at once.

  ``"nested"`` is the remat policy too, around pieces of one unit: across ticks the chunk keeps
  what ``"chunk"`` keeps, and its backward first recomputes the chunk keeping each unit's input
  (the residuals of the units' own checkpoints), then recomputes and differentiates one unit at
  a time: one more forward per unit than ``"chunk"``, one unit's intermediates at a time.

  Under ``remat="none"`` every granularity is ``"chunk"``'s (the remat policy).
  """
  policy = policy_of(remat)
  granularity = spec_lib.granularity_in_effect(remat, granularity)
  if granularity == "nested" or spec_lib.check_remat_granularity(granularity) is None:
    return policy
  inputs = jax.checkpoint_policies.save_only_these_names(PIECE_INPUT_NAME)
  if policy is None:
    return inputs
  return jax.checkpoint_policies.save_from_both_policies(inputs, policy)


def apply_units(h, runs, remat, granularity, unroll: int | bool = 1):
  """Applies a chunk's units in order, checkpointing pieces of them as ``granularity`` says.

  Args:
    h: the chunk's input.
    runs: in order, ``(fn, xs, n)`` for each group of the chunk: ``fn(h, xs) -> (h, out)``
      applies one unit. ``n=None`` is a single unit with inputs ``xs``; an int ``n`` is a run of
      ``n`` units scanned over the leading axis of ``xs``' leaves.
    remat: a remat option (see :func:`policy_of`); its policy applies within each piece.
    granularity: see :func:`tpipe.spec.check_remat_granularity`; ``"chunk"`` under
      ``remat="none"`` whatever is given (:func:`tpipe.spec.granularity_in_effect`).
    unroll: units per iteration of a run's ``lax.scan``.

  Returns:
    ``(h, outs)``: the last unit's output and, per entry of ``runs``, ``fn``'s ``out`` (stacked on
    a leading axis ``n`` for runs).

  ``"chunk"`` applies the units plainly (the caller checkpoints the whole chunk). A granularity
  of ``k`` units checkpoints every ``k`` consecutive units with the remat policy, marking each
  piece's input for the chunk's checkpoint (:func:`chunk_policy`) to keep. Consecutive single
  units are taken ``k`` at a time; a run of ``n`` is scanned over ``n // k`` pieces of ``k``
  units (``lax.scan`` over groups, so compile time stays flat), its ``n % k`` remaining units
  are one shorter piece, and no piece spans the boundary of a run.
  """
  k = spec_lib.check_remat_granularity(spec_lib.granularity_in_effect(remat, granularity))
  if k is None:
    outs = []
    for fn, xs, n in runs:
      if n is None:
        h, out = fn(h, xs)
      else:
        h, out = lax.scan(fn, h, xs, length=n, unroll=unroll)
      outs.append(out)
    return h, outs
  return _Pieces(runs, policy_of(remat), k, unroll).apply(h)


class _Pieces:
  """:func:`apply_units` with pieces of ``k`` units, each under its own checkpoint."""

  def __init__(self, runs, policy, k: int, unroll):
    self.runs, self.policy, self.k, self.unroll = runs, policy, k, unroll
    self.outs: list[Any] = [None] * len(runs)
    self.pending: list[int] = []  # Indices of single units not yet applied.

  def piece(self, body, in_scan: bool):
    # Outside a scan, the default prevent_cse=True keeps XLA from hoisting every piece's
    # recomputation to the start of the backward pass (which would hold them all at once).
    checkpointed = jax.checkpoint(body, policy=self.policy, prevent_cse=not in_scan)
    return lambda h, xs: checkpointed(checkpoint_name(h, PIECE_INPUT_NAME), xs)

  def scanned(self, fn, length: int):
    return lambda h, xs: lax.scan(fn, h, xs, length=length, unroll=self.unroll)

  def flush(self, h):
    """Applies the pending single units as one piece."""
    if not self.pending:
      return h
    fns = [self.runs[i][0] for i in self.pending]

    def body(h, xss):
      results = []
      for fn, xs in zip(fns, xss):
        h, out = fn(h, xs)
        results.append(out)
      return h, results

    h, results = self.piece(body, in_scan=False)(h, [self.runs[i][1] for i in self.pending])
    for i, out in zip(self.pending, results):
      self.outs[i] = out
    self.pending = []
    return h

  def run(self, h, fn, xs, n: int):
    """A run of ``n`` units: ``n // k`` scanned pieces, then one shorter piece."""
    k = self.k
    whole, rest = divmod(n, k)
    parts = []
    if whole:
      grouped = jax.tree.map(lambda a: a[:whole * k].reshape((whole, k) + a.shape[1:]), xs)
      # unroll=True unrolls the loop over pieces too: then no loop keeps XLA from merging a
      # piece's recomputation with its forward, and the pieces keep prevent_cse's barriers.
      whole_unrolled = self.unroll is True
      h, out = lax.scan(self.piece(self.scanned(fn, k), in_scan=not whole_unrolled), h, grouped,
                        length=whole, unroll=whole_unrolled)
      parts.append(jax.tree.map(lambda a: a.reshape((whole * k,) + a.shape[2:]), out))
    if rest:
      tail = jax.tree.map(lambda a: a[whole * k:], xs)
      h, out = self.piece(self.scanned(fn, rest), in_scan=False)(h, tail)
      parts.append(out)
    out = parts[0] if len(parts) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *parts)
    return h, out

  def apply(self, h):
    for i, (fn, xs, n) in enumerate(self.runs):
      if n is None:
        self.pending.append(i)
        if len(self.pending) == self.k:
          h = self.flush(h)
        continue
      h = self.flush(h)
      h, self.outs[i] = self.run(h, fn, xs, n)
    return self.flush(h), self.outs
