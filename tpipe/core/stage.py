"""One stage's work on one device: a chunk of consecutive layers applied to one micro-batch.

The chunk's parameters are stacked (``[layers, ...]``) and applied with ``lax.scan``, so compile
time does not grow with the number of layers. The whole chunk runs under ``jax.checkpoint`` with
the chosen policy: with ``remat="full"`` only the chunk's input is kept for the backward pass and
everything inside is recomputed (GPipe's re-materialization, sec. 2.3 of the paper).

Idle (bubble) ticks compute nothing, forward or backward: the chunk runs through
:func:`tpipe.core.gated.gated_call` on the tick's busy flag, whose idle branches return zeros.
A block that is undefined at a zero input (an RMS norm without epsilon) therefore never sees one,
and the bubble costs no FLOPs.

Random numbers do not depend on the pipeline layout: every layer gets, for every RNG stream,
``fold_in(fold_in(key, global_layer_index), global_microbatch_index)``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from tpipe.core import gated

# A layer function: (params of one layer, activation, broadcast arrays, this micro-batch's
# per-example arrays, rngs) -> activation.
LayerFn = Callable[[Any, Any, tuple, tuple, dict], Any]

REMAT_NAMES = ("none", "full", "dots")
# The name of a chunk's parameter slice inside the stage function (see make_stage_fn).
CHUNK_PARAMS_NAME = "tpipe_chunk_params"


def resolve_remat(remat) -> Any:
  """Maps a ``remat`` option to a ``jax.checkpoint`` policy.

  Args:
    remat: ``"none"`` (keep every activation), ``"full"`` (keep only the stage input, recompute
      the rest), ``"dots"`` (keep matmul outputs, recompute the cheap element-wise work), or any
      ``jax.checkpoint`` policy callable (e.g. from ``jax.checkpoint_policies``).

  Returns:
    A policy for ``jax.checkpoint`` (``None`` means save nothing). ``"none"`` saves everything
    except the chunk's parameter slice, which is cheap to take again (see :func:`make_stage_fn`).
  """
  if isinstance(remat, str):
    if remat == "none":
      return jax.checkpoint_policies.save_anything_except_these_names(CHUNK_PARAMS_NAME)
    if remat == "full":
      return None
    if remat == "dots":
      return jax.checkpoint_policies.dots_saveable
    raise ValueError(f"Unknown remat {remat!r}; choose one of {REMAT_NAMES} or pass a "
                     "jax.checkpoint policy such as jax.checkpoint_policies.dots_saveable.")
  if callable(remat):
    return remat
  raise TypeError(f"remat must be one of {REMAT_NAMES} or a jax.checkpoint policy callable, "
                  f"got {remat!r} of type {type(remat).__name__}.")


def fold_rngs(rngs: dict, layer_index, microbatch_index) -> dict:
  """Per-layer, per-micro-batch keys: independent of stages, repeats, schedule and remat."""
  return {name: jax.random.fold_in(jax.random.fold_in(key, layer_index), microbatch_index)
          for name, key in rngs.items()}


def check_unroll(unroll) -> None:
  """``unroll`` as ``lax.scan`` takes it: an int >= 1 (layers per loop iteration) or a bool."""
  if isinstance(unroll, bool):
    return
  if not isinstance(unroll, (int, np.integer)) or unroll < 1:
    raise ValueError(f"unroll must be an int >= 1 (layers per iteration of the per-stage layer "
                     f"loop) or True (unroll the whole chunk), got {unroll!r}.")


def make_stage_fn(layer_fn: LayerFn, num_layers: int, remat, unroll: int | bool = 1,
                  granularity="chunk") -> Callable:
  """Builds ``stage_fn(stage_params, busy, repeat, x, broadcast, per_example, rngs, first_layer,
  microbatch) -> y``.

  Args:
    layer_fn: applies one layer: ``layer_fn(params, x, broadcast, per_example, rngs) -> y`` with
      ``y`` of the same structure, shapes and dtypes as ``x``.
    num_layers: layers per chunk.
    remat: a ``remat`` option, see :func:`resolve_remat`.
    unroll: layers per iteration of the chunk's ``lax.scan`` (``True``: all of them), as in
      ``nn.scan``. Unrolling lets XLA fuse across layers at the cost of compile time.
    granularity: what is checkpointed within the chunk: ``"chunk"``, ``"layer"`` or every ``k``
      layers (see :func:`apply_units`).

  Returns:
    A function applying chunk ``repeat`` of this stage's params (leaves ``[R, layers, ...]``) when
    ``busy``, and returning zeros shaped like ``x`` without computing anything otherwise.
    ``first_layer`` is the global index of the chunk's first layer (for RNG folding).

  The chunk is sliced out of the stage's params inside the checkpointed function and the slice
  is never saved for the backward pass: the tick loop's autodiff would otherwise stash a copy of
  the stage's parameters at every tick. So even ``remat="none"`` runs under ``jax.checkpoint``,
  with a policy that saves everything except that slice. The gate around it saves per tick what
  the policy saves and nothing else (the parameters are never copied; see :mod:`tpipe.core.gated`).
  """
  policy = chunk_policy(remat, granularity)

  def apply_chunk(stage_params, repeat, x, broadcast, per_example, rngs, first_layer,
                  microbatch_index):
    chunk = jax.tree.map(lambda p: lax.dynamic_index_in_dim(p, repeat, 0, keepdims=False),
                         stage_params)
    chunk = checkpoint_name(chunk, CHUNK_PARAMS_NAME)

    def one_layer(h, inputs):
      params, j = inputs
      layer_rngs = fold_rngs(rngs, first_layer + j, microbatch_index)
      return layer_fn(params, h, broadcast, per_example, layer_rngs), None

    y, _ = apply_units(x, [(one_layer, (chunk, jnp.arange(num_layers)), num_layers)], remat,
                       granularity, unroll)
    return y

  # prevent_cse=False: the chunk runs inside the tick scan, which already stops XLA from
  # merging the recomputation into the forward pass.
  chunk_fn = jax.checkpoint(apply_chunk, policy=policy, prevent_cse=False)

  def stage_fn(stage_params, busy, *operands):
    return gated.gated_call(busy, chunk_fn, stage_params, *operands)

  return stage_fn


# ----------------------------------------------------------------------------------------------
# Remat granularity: which pieces of a chunk are checkpointed on their own.

GRANULARITY_NAMES = ("chunk", "layer")
# The name of a checkpointed piece's input inside a chunk (see chunk_policy).
PIECE_INPUT_NAME = "tpipe_piece_input"


def check_remat_granularity(granularity) -> int | None:
  """Validates a ``remat_granularity`` option; returns units per checkpointed piece, or ``None``
  for ``"chunk"`` (the whole chunk is the one piece).

  Args:
    granularity: ``"chunk"`` (one checkpoint around the chunk), ``"layer"`` (one per layer unit;
      the same as ``1``) or a positive int ``k`` (one per ``k`` consecutive units).
  """
  if isinstance(granularity, str):
    if granularity == "chunk":
      return None
    if granularity == "layer":
      return 1
    raise ValueError(f"Unknown remat_granularity {granularity!r}; choose one of "
                     f"{GRANULARITY_NAMES} or a positive int k (k layer units per checkpoint).")
  if isinstance(granularity, (int, np.integer)) and not isinstance(granularity, bool):
    if granularity >= 1:
      return int(granularity)
    raise ValueError(f"remat_granularity must be >= 1 layer units per checkpoint, got "
                     f"{granularity!r}; or choose one of {GRANULARITY_NAMES}.")
  raise TypeError(f"remat_granularity must be one of {GRANULARITY_NAMES} or a positive int, got "
                  f"{granularity!r} of type {type(granularity).__name__}.")


def chunk_policy(remat, granularity) -> Any:
  """The ``jax.checkpoint`` policy of the checkpoint around a whole chunk.

  With ``"chunk"`` granularity it is the remat policy (:func:`resolve_remat`). Finer, the chunk
  keeps what its pieces' checkpoints need for their backward passes: each piece's input plus
  what the remat policy saves inside it. So across ticks a chunk keeps one input per piece
  instead of one, and its backward recomputes one piece at a time (the same recompute FLOPs as
  ``"chunk"``) instead of holding every layer's intermediates at once.
  """
  policy = resolve_remat(remat)
  if check_remat_granularity(granularity) is None:
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
    remat: a remat option (see :func:`resolve_remat`); its policy applies within each piece.
    granularity: see :func:`check_remat_granularity`.
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
  k = check_remat_granularity(granularity)
  if k is None:
    outs = []
    for fn, xs, n in runs:
      if n is None:
        h, out = fn(h, xs)
      else:
        h, out = lax.scan(fn, h, xs, length=n, unroll=unroll)
      outs.append(out)
    return h, outs

  policy = resolve_remat(remat)

  def piece(body, in_scan):
    # Outside a scan, the default prevent_cse=True keeps XLA from hoisting every piece's
    # recomputation to the start of the backward pass (which would hold them all at once).
    checkpointed = jax.checkpoint(body, policy=policy, prevent_cse=not in_scan)
    return lambda h, xs: checkpointed(checkpoint_name(h, PIECE_INPUT_NAME), xs)

  def scanned(fn, length):
    return lambda h, xs: lax.scan(fn, h, xs, length=length, unroll=unroll)

  outs: list[Any] = [None] * len(runs)
  pending: list[int] = []  # Indices of single units not yet applied.

  def flush(h):
    if pending:
      fns = [(runs[i][0], i) for i in pending]

      def body(h, xss):
        results = []
        for (fn, _), xs in zip(fns, xss):
          h, out = fn(h, xs)
          results.append(out)
        return h, results

      h, results = piece(body, in_scan=False)(h, [runs[i][1] for i in pending])
      for i, out in zip(pending, results):
        outs[i] = out
      pending.clear()
    return h

  for i, (fn, xs, n) in enumerate(runs):
    if n is None:
      pending.append(i)
      if len(pending) == k:
        h = flush(h)
      continue
    h = flush(h)
    whole, rest = divmod(n, k)
    parts = []
    if whole:
      grouped = jax.tree.map(lambda a: a[:whole * k].reshape((whole, k) + a.shape[1:]), xs)
      h, out = lax.scan(piece(scanned(fn, k), in_scan=True), h, grouped, length=whole)
      parts.append(jax.tree.map(lambda a: a.reshape((whole * k,) + a.shape[2:]), out))
    if rest:
      h, out = piece(scanned(fn, rest), in_scan=False)(h, jax.tree.map(lambda a: a[whole * k:], xs))
      parts.append(out)
    outs[i] = parts[0] if len(parts) == 1 else jax.tree.map(
        lambda *a: jnp.concatenate(a), *parts)
  h = flush(h)
  return h, outs
