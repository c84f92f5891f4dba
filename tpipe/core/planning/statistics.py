"""Running statistics under a pipeline (BatchNorm's), updated once per step with GPipe's rule.

Each micro-batch is normalized with its own statistics. Every layer's call reports, shaped like
its running statistics, what it measured in training mode: ``E[x]`` in the place of each mean
and ``E[x^2]`` in the place of each var (zeros where nothing was measured). The tick loop sums
these over busy ticks and replicas; divided by the number of micro-batches they are the step's
pooled ``E[x]`` and ``E[x^2]``, so the pooled variance is ``E[x^2] - E[x]^2`` over the whole
mini-batch, not a mean of per-micro-batch variances. :func:`update` then moves each running
average once: ``momentum * old + (1 - momentum) * pooled``.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp


def _keys(path) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)


def _sibling(tree, keys, name):
  for key in keys:
    tree = tree[key]
  return tree[name]


def update(old: Mapping, pooled: Mapping, momenta: Mapping[tuple[int, tuple], float]) -> dict:
  """The running statistics after one step.

  Args:
    old: logical statistics ``{"layers_i": tree}``, each normalization's ``{"mean", "var"}``
      under its path.
    pooled: the same structure holding the step's pooled ``E[x]`` (for each mean) and
      ``E[x^2]`` (for each var).
    momenta: ``{(layer index, path to the mean/var dict): momentum}`` for every normalization
      that ran in training mode; the others keep their values.

  Returns:
    The updated logical statistics.
  """
  new = {}
  for name, tree in old.items():
    layer = int(name.split("_")[1])

    def one(path, old_value, pooled_value, layer=layer, name=name):
      keys = _keys(path)
      momentum = momenta.get((layer, keys[:-1]))
      if momentum is None:
        return old_value
      if keys[-1] == "mean":
        return momentum * old_value + (1 - momentum) * pooled_value
      mean = _sibling(pooled[name], keys[:-1], "mean")
      variance = jnp.maximum(pooled_value - mean * mean, 0)
      return momentum * old_value + (1 - momentum) * variance

    new[name] = jax.tree_util.tree_map_with_path(one, tree, pooled[name])
  return new
