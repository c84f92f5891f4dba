"""A device's view of the staged variables inside ``shard_map``, and the stage axis put back.

Inside the tick loops each device holds its own stage's part of the staged tree
(``{"params": tree[, "stats": tree]}``, :mod:`tpipe.core.layout.staging`): every leaf ``[R, 1,
...]``
or ``[P, 1, n]``. The tick loops read it without the stage axis (:func:`device_view`) and hand
gradients back with it (:func:`with_stage_axis`).
"""

from __future__ import annotations

import jax

from tpipe.core.layout import description as layout_description

# The staged variables' collections: the parameters and the running statistics.
PARAMS = "params"
STATS = "stats"


def device_view(staged: dict) -> dict:
  """A device's part of ``staged`` (``{"params": tree[, "stats": tree]}``, every leaf
  ``[R, 1, ...]`` or ``[P, 1, n]`` inside ``shard_map``) as the tick loops read it: without the
  stage axis, except the parameters' packed buffers, which keep it (``[P, 1, n]``; a slot is
  read as ``[1, n]``, :class:`tpipe.core.programs.chunks.ChunkSet`). Squeezed, ``[P, n]`` with ``P
  > 1`` (a
  buffer per chunk slot) takes the TPU a relayout of the whole buffer (its tiles span rows),
  which the tick loop then held for the whole step."""
  view = {}
  for collection, tree in staged.items():
    view[collection] = {}
    for part, sub in tree.items():
      if (collection, part) == (PARAMS, layout_description.PACKED):
        view[collection][part] = sub  # Keeps its stage axis (see above).
      else:
        view[collection][part] = jax.tree.map(lambda a: a[:, 0], sub)
  return view


def with_stage_axis(view_leaves: list, staged_leaves: list) -> list:
  """Per-device leaves (:func:`device_view`'s, or values shaped like them) with the stage axis
  back, ``[R, 1, ...]``, where the view dropped it; ``staged_leaves`` are the same leaves of
  the staged tree."""
  return [a if a.ndim == b.ndim else a[:, None] for a, b in zip(view_leaves, staged_leaves)]
