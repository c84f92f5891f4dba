"""Abstract variable trees written compactly, for tests that build layouts without a model."""

import jax


def abstract_shapes(layers):
  """``{"layers_i": tree of ShapeDtypeStruct}`` from one tree of ``(shape, dtype)`` leaves per
  layer."""
  is_pair = lambda s: isinstance(s, tuple) and len(s) == 2 and isinstance(s[0], tuple)
  return {f"layers_{i}": jax.tree.map(lambda s: jax.ShapeDtypeStruct(*s), tree, is_leaf=is_pair)
          for i, tree in enumerate(layers)}
