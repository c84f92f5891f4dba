"""A tiny layer sequence written directly as core layers (:class:`tpipe.core.base.layers.Layer`), no
front end: an input projection, a repeated residual block and a per-example squared-error loss.
The unit tests of the engine's middle (``tests/core``) build pipelines of it with
:func:`tpipe.core.engine.build` and compare with :func:`plain_loss`, the layers applied in order.
"""

import jax
import jax.numpy as jnp
import numpy as np

from tpipe.core import engine
from tpipe.core.base import layers as layers_lib

WIDTH = 4
IN_WIDTH = 3
BATCH = 8
COPIES = 4


def _project(params, stats, x, kwargs, rngs):
  del kwargs, rngs
  return jnp.tanh(x @ params["kernel"] + params["bias"]), stats


def _block(params, stats, h, kwargs, rngs):
  del kwargs, rngs
  return h + jnp.tanh(h @ params["kernel"]) * params["scale"], stats


def _loss(params, stats, h, kwargs, rngs):
  del rngs
  out = h @ params["kernel"]
  return jnp.sum((out - kwargs["targets"]) ** 2, axis=-1), stats


LAYERS = (
    layers_lib.Layer(kind="Project", copies=None, apply=_project, keywords=()),
    layers_lib.Layer(kind="Block", copies=COPIES, apply=_block, keywords=()),
    layers_lib.Layer(kind="Loss", copies=None, apply=_loss, keywords=("targets",)),
)


def params(seed: int = 0) -> dict:
  """Logical parameters ``{"layers_i": tree}`` (the block's stacked on a copy axis)."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.5, jnp.float32)
  return {
      "layers_0": {"kernel": normal(IN_WIDTH, WIDTH), "bias": normal(WIDTH)},
      "layers_1": {"kernel": normal(COPIES, WIDTH, WIDTH), "scale": normal(COPIES, WIDTH)},
      "layers_2": {"kernel": normal(WIDTH, 2)},
  }


def inputs(seed: int = 1, batch: int = BATCH):
  """``(x, targets)``: ``[batch, IN_WIDTH]`` and ``[batch, 2]``."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(batch, IN_WIDTH)), jnp.float32)
  targets = jnp.asarray(rng.normal(size=(batch, 2)), jnp.float32)
  return x, targets


def apply_layers(logical, h, first: int, last: int, targets=None):
  """Layers ``first .. last - 1`` applied in order (a repeated layer's copies one by one)."""
  for i in range(first, last):
    layer, tree = LAYERS[i], logical[f"layers_{i}"]
    kwargs = {"targets": targets} if layer.keywords else {}
    if layer.copies is None:
      h = layer.apply(tree, {}, h, kwargs, {})[0]
    else:
      for j in range(layer.copies):
        h = layer.apply(jax.tree.map(lambda a, j=j: a[j], tree), {}, h, kwargs, {})[0]
  return h


def apply_segments(logical, h, segments, targets=None):
  """A model chunk applied plainly: its segments
  (:class:`tpipe.core.layout.description.Segment`) in order on the logical parameters, a
  repeated layer's copies ``first_copy ..`` one by one."""
  for seg in segments:
    layer, tree = LAYERS[seg.layer], logical[f"layers_{seg.layer}"]
    kwargs = {"targets": targets} if layer.keywords else {}
    if seg.copies is None:
      h = layer.apply(tree, {}, h, kwargs, {})[0]
      continue
    for j in range(seg.first_copy, seg.first_copy + seg.copies):
      h = layer.apply(jax.tree.map(lambda a, j=j: a[j], tree), {}, h, kwargs, {})[0]
  return h


def plain_loss(logical, x, targets):
  """The mean per-example loss of the layers in order: what every pipeline must compute."""
  return jnp.mean(apply_layers(logical, x, 0, len(LAYERS), targets))


def build(spec, batch: int = BATCH) -> engine.PlannedPipeline:
  """A :class:`tpipe.core.engine.PlannedPipeline` of :data:`LAYERS` for ``spec`` and a batch of
  ``batch`` rows."""
  x, targets = inputs(batch=batch)
  return engine.build(LAYERS, spec, param_shapes=layers_lib.abstract(params()), stats_shapes={},
                      x=layers_lib.abstract(x), kwargs={"targets": layers_lib.abstract(targets)},
                      owner="test")
