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


def make_stage_fn(layer_fn: LayerFn, num_layers: int, remat, unroll: int | bool = 1) -> Callable:
  """Builds ``stage_fn(stage_params, busy, repeat, x, broadcast, per_example, rngs, first_layer,
  microbatch) -> y``.

  Args:
    layer_fn: applies one layer: ``layer_fn(params, x, broadcast, per_example, rngs) -> y`` with
      ``y`` of the same structure, shapes and dtypes as ``x``.
    num_layers: layers per chunk.
    remat: a ``remat`` option, see :func:`resolve_remat`.
    unroll: layers per iteration of the chunk's ``lax.scan`` (``True``: all of them), as in
      ``nn.scan``. Unrolling lets XLA fuse across layers at the cost of compile time.

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
  policy = resolve_remat(remat)

  def apply_chunk(stage_params, repeat, x, broadcast, per_example, rngs, first_layer,
                  microbatch_index):
    chunk = jax.tree.map(lambda p: lax.dynamic_index_in_dim(p, repeat, 0, keepdims=False),
                         stage_params)
    chunk = checkpoint_name(chunk, CHUNK_PARAMS_NAME)

    def one_layer(h, inputs):
      params, j = inputs
      layer_rngs = fold_rngs(rngs, first_layer + j, microbatch_index)
      return layer_fn(params, h, broadcast, per_example, layer_rngs), None

    y, _ = lax.scan(one_layer, x, (chunk, jnp.arange(num_layers)), length=num_layers,
                    unroll=unroll)
    return y

  # prevent_cse=False: the chunk runs inside the tick scan, which already stops XLA from
  # merging the recomputation into the forward pass.
  chunk_fn = jax.checkpoint(apply_chunk, policy=policy, prevent_cse=False)

  def stage_fn(stage_params, busy, *operands):
    return gated.gated_call(busy, chunk_fn, stage_params, *operands)

  return stage_fn
