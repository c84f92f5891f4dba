"""Stage layouts of small abstract layer sequences, shared by the layout tests.

Each case names layers (trees of ``(shape, dtype)``), which of them are repeated, the units per
chunk, the stages, repeats and placement; :func:`case` builds its
:class:`tpipe.core.layout.description.StageLayout` from
:func:`tpipe.core.planning.plan.group_units` as the engine does, without tracing a model.
"""

import jax
import jax.numpy as jnp
import numpy as np

from tests.helpers.shapes import abstract_shapes
from tpipe.core.layout import description as desc
from tpipe.core.planning import plan as plan_lib

F32, I32 = jnp.float32, jnp.int32


def embed():
  return {"embedding": ((5, 4), F32), "count": ((3,), I32)}


def block(n):
  return {"Dense_0": {"kernel": ((n, 4, 4), F32), "bias": ((n, 4), F32)}}


def head():
  return {"kernel": ((4, 2), F32), "bias": ((2,), F32)}


def wide_head():
  return {"kernel": ((4, 5), F32), "bias": ((5,), F32)}


# name: (layers, which of them are repeated (index -> copies), counts, num_stages, num_repeats,
# placement).
CASES = {
    # Every chunk two copies: the staged leaf is the logical one reshaped.
    "even_repeat": ([block(8)], {0: 8}, (2, 2, 2, 2), 2, 2, "loop"),
    # Chunks with 2 and 3 copies: 2 stay per leaf, the third goes to the packed buffers.
    "uneven_repeat": ([embed(), block(5), head()], {1: 5}, (3, 4), 2, 1, "loop"),
    # A chunk without copies: the repeated layer is packed whole.
    "repeat_missing_from_a_chunk": ([embed(), block(5), head()], {1: 5}, (1, 6), 2, 1,
                                    "loop"),
    # Plain layers only (one without variables): everything packed.
    "plain_layers": ([embed(), head(), {}, head()], {}, (2, 2), 2, 1, "loop"),
    # Circular, two chunks per stage; 1 or 2 copies per chunk.
    "circular_r2": ([embed(), block(6), head()], {1: 6}, (2, 2, 2, 2), 2, 2, "loop"),
    # ZB-V: chunk 2 on stage 1, chunk 3 (with the head) on stage 0.
    "zbv": ([embed(), block(6), head()], {1: 6}, (2, 2, 2, 2), 2, 2, "v"),
    # An even Repeat in the "v" placement: not a plain reshape any more.
    "even_repeat_v": ([block(8)], {0: 8}, (2, 2, 2, 2), 2, 2, "v"),
    # An embedding on stage 0 and a head (its kernel the embedding's transpose) on stage 1: the
    # two matrices share one leaf; the vectors stay packed.
    "shared_ends": ([embed(), block(4), wide_head()], {1: 4}, (3, 3), 2, 1, "loop"),
    # Two chunks per stage (ZB-V) and two like matrices on stage 0: two entries per stage.
    "shared_zbv": ([wide_head(), block(4), wide_head(), wide_head()], {1: 4},
                   (2, 1, 1, 3), 2, 2, "v"),
}

# fsdp 2 cuts the test leaves along a dimension; fsdp 3 divides none of them (flat pieces).
FSDP = [1, 2, 3]
# A stage's chunks in one packed buffer (parameters), or a buffer per chunk slot (statistics).
PACKINGS = list(desc.PACKINGS)


def fsdp_mesh(fsdp, num_stages):
  """An abstract mesh with ``fsdp`` devices per stage (the packed buffers' blocks)."""
  return jax.sharding.AbstractMesh((1, fsdp, num_stages, 1), ("data", "fsdp", "stage", "tensor"))


def case(name, stacked=None, fsdp=1, packing="stage"):
  """``(layout, abstract logical shapes)`` of case ``name``."""
  layers, repeated, counts, num_stages, num_repeats, placement = CASES[name]
  copies = [repeated.get(i) for i in range(len(layers))]
  groups = plan_lib.group_units(copies, counts)
  shapes = abstract_shapes(layers)
  layout = desc.StageLayout.build(groups, shapes, num_stages, num_repeats,
                                  placement=placement, stacked=stacked,
                                  mesh=fsdp_mesh(fsdp, num_stages), packing=packing)
  return layout, shapes


def values(shapes):
  """Logical values with every element distinct and nonzero (exact in float32 and int32)."""
  leaves, treedef = jax.tree.flatten(shapes)
  out, start = [], 1
  for leaf in leaves:
    size = int(np.prod(leaf.shape))
    out.append(jnp.asarray(np.arange(start, start + size).reshape(leaf.shape), leaf.dtype))
    start += size
  return jax.tree.unflatten(treedef, out)


def assert_equal(got, want):
  """Same structure, and every leaf the same dtype, shape and values."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def drop_empty(tree):
  """``tree`` without layers that hold no variables (Flax omits them)."""
  return {k: v for k, v in tree.items() if jax.tree.leaves(v)}
