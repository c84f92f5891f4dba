"""Tied input and output embeddings in a pipeline: two copies kept equal, exactly.

A tied LM (GPT-2, the small Qwen2 and Llama 3.2 models) uses one matrix twice: the embedding
looks tokens up in it on the first stage, and the head projects onto its transpose on the last.
tpipe keeps **two copies** (the embedding's ``layers_0/embed/embedding [vocab, width]`` and the
head's ``layers_<last>/head/kernel [width, vocab]``), each on the stage that uses it, and keeps
them bit for bit equal:

* they start equal (:func:`synchronized`, and an imported checkpoint writes its one matrix to
  both);
* every step, :func:`tied_clip_by_global_norm` replaces each copy's gradient with the sum of
  both (the gradient of the one tied matrix: the only data that crosses between the first and
  last stage) and clips by the global norm counting that gradient once, as a model with one
  matrix would;
* Adam and weight decay are elementwise, so equal parameters with equal gradients and equal
  moments get equal updates.

Checkpoints hold both copies (the logical form); :mod:`tpipe.train.pretrained` exports one.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from tpipe import staging
from tpipe.core.layout import description as layout_lib


def _paths(params) -> tuple[tuple[str, ...], tuple[str, ...]]:
  last = max(params, key=lambda name: int(name.split("_")[1]))
  return ("layers_0", "embed", "embedding"), (last, "head", "kernel")


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree, path, value):
  if not path:
    return value
  return {**tree, path[0]: _set(tree[path[0]], path[1:], value)}


def synchronized(params: dict[str, Any]) -> dict[str, Any]:
  """Logical parameters with the head's kernel set to the embedding's transpose.

  Raises:
    ValueError: the head has a bias or the shapes do not fit (not a tieable LM).
  """
  embedding_path, head_path = _paths(params)
  embedding = _get(params, embedding_path)
  head = _get(params, head_path[:-1])
  if "bias" in head or head["kernel"].shape != embedding.shape[::-1]:
    raise ValueError("config.tie_embeddings=True needs a head without a bias "
                     "(config.head_bias=False) whose kernel is the embedding's transpose.")
  return _set(params, head_path, embedding.T)


def are_equal(params: dict[str, Any]) -> bool:
  """Whether the head's kernel is exactly the embedding's transpose (logical parameters)."""
  embedding_path, head_path = _paths(params)
  return bool(jnp.array_equal(_get(params, embedding_path).T, _get(params, head_path)))


def tied_clip_by_global_norm(max_norm: float, layout: layout_lib.StageLayout
                             ) -> optax.GradientTransformation:
  """``optax.clip_by_global_norm`` for staged gradients of a tied LM: each copy's gradient
  becomes the sum of both, and the norm counts it once.

  Args:
    max_norm: the largest global norm.
    layout: the parameters' stage layout.
  """
  embedding_path, head_path = _paths(layout.logical)

  def update(updates, state, params=None):
    del params
    logical = staging.to_logical(layout, updates)
    summed = _get(logical, embedding_path) + _get(logical, head_path).T
    logical = _set(_set(logical, embedding_path, summed), head_path, summed.T)
    # The copies sit in packed buffers or shared leaves.
    staged = staging.to_staged(layout, logical)
    updates = {layout_lib.STACKED: updates[layout_lib.STACKED],
               layout_lib.PACKED: staged[layout_lib.PACKED],
               layout_lib.SHARED: staged[layout_lib.SHARED]}
    squares = optax.tree.norm(updates, squared=True) - jnp.sum(jnp.square(summed))
    norm = jnp.sqrt(jnp.maximum(squares, 0.0))
    clip = lambda t: jax.lax.select(norm < max_norm, t, (t / norm.astype(t.dtype)) * max_norm)
    return jax.tree.map(clip, updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
