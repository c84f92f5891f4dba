"""Which layers live on which stage: the uniform split of a layer stack into chunks.

The body's ``L`` layers are cut into ``S * R`` equal chunks of ``L / (S * R)`` consecutive layers.
Chunk ``c = r * S + s`` runs on stage ``s`` as its ``r``-th repeat, so a micro-batch that visits
stages ``0..S-1`` ``R`` times in a row meets the layers in their original order.

The user-facing parameter layout is ``nn.scan``'s: every leaf stacked along a leading axis of
length ``L``. :func:`to_stage_layout` and :func:`from_stage_layout` convert losslessly to the
executor's ``[R, S, L / (S * R), ...]`` layout, so checkpoints do not depend on the pipeline.

  >>> layers_per_chunk(length=8, num_stages=2, num_repeats=2)
  2
  >>> stage_layers(stage=1, length=8, num_stages=2, num_repeats=2)
  [2, 3, 6, 7]
"""

from __future__ import annotations

import jax


def layers_per_chunk(length: int, num_stages: int, num_repeats: int) -> int:
  """Layers in each chunk; raises ValueError unless ``length`` splits evenly."""
  chunks = num_stages * num_repeats
  if length % chunks:
    raise ValueError(
        f"length={length} layers cannot be split evenly into num_stages * num_repeats = "
        f"{num_stages} * {num_repeats} = {chunks} chunks; choose a length that is a multiple "
        f"of {chunks} or change num_stages/num_repeats.")
  return length // chunks


def stage_layers(stage: int, length: int, num_stages: int, num_repeats: int) -> list[int]:
  """The global indices of the layers stage ``stage`` applies, in the order it applies them."""
  per_chunk = layers_per_chunk(length, num_stages, num_repeats)
  return [(r * num_stages + stage) * per_chunk + j
          for r in range(num_repeats) for j in range(per_chunk)]


def to_stage_layout(stacked, num_stages: int, num_repeats: int):
  """``[L, ...]`` leaves to ``[R, S, L / (S * R), ...]``: ``out[r, s, j]`` is layer
  ``(r * S + s) * L / (S * R) + j``."""

  def split(leaf):
    per_chunk = layers_per_chunk(leaf.shape[0], num_stages, num_repeats)
    return leaf.reshape((num_repeats, num_stages, per_chunk) + leaf.shape[1:])

  return jax.tree.map(split, stacked)


def from_stage_layout(staged):
  """Inverse of :func:`to_stage_layout`."""
  return jax.tree.map(lambda leaf: leaf.reshape((-1,) + leaf.shape[3:]), staged)
