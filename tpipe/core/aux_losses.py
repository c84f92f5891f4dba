"""Auxiliary losses: what layers inside the stages add to the loss (a router's balance loss).

A layer may add scalar losses besides the per-example loss the last layer computes (a front end
collects them: ``self.sow("aux_loss", name, value)`` in linen, ``self.sow(tpipe.nnx.AuxLoss,
name, value)`` in NNX). The loss a pipeline minimises is then

    mean over examples of the last layer's loss + mean over micro-batches of the aux losses

(every auxiliary loss of every layer, summed, on each micro-batch): the model run in sequence
on each micro-batch, as gradient accumulation runs it. An auxiliary loss that pools over a
micro-batch's rows (a balance loss counts tokens per expert) pools over the rows a device holds
of it: one data-parallel replica's share, as data-parallel training computes it.

How: planning finds the layers that add auxiliary losses while it traces the sequence
(:attr:`tpipe.core.plan.Traced.adding`), and the auxiliary losses travel with the activations:
:func:`carry` rewrites the layer sequence so that the first layer starts a per-example running
sum of zeros beside its output, each layer adds its own auxiliary losses to every row of it, and
the last layer adds it to its per-example losses. Every schedule then carries the sums stage to
stage as it carries activations (one float per row), and the loss's gradient reaches each
auxiliary loss through them: no schedule needs to know.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tpipe.core import layers as layers_lib
from tpipe.core import spmd


def total(sown, owner: str, where: str):
  """The sum of the auxiliary losses a layer sowed on one call (a float32 scalar), None when it
  sowed none; ValueError for a value that is not a scalar."""
  leaves = jax.tree.leaves(sown)
  if not leaves:
    return None
  for leaf in leaves:
    if jnp.ndim(leaf) != 0 or not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      raise ValueError(f"{owner}: {where} added an auxiliary loss of shape {jnp.shape(leaf)} "
                       f"and dtype {jnp.result_type(leaf)}; an auxiliary loss is a float "
                       "scalar (reduce it over the tokens first, e.g. with jnp.mean).")
  return sum(jnp.asarray(leaf, jnp.float32) for leaf in leaves)


def carry(layers, adding: tuple[int, ...], owner: str,
          with_stats: frozenset = frozenset()) -> tuple[layers_lib.Layer, ...]:
  """``layers`` rewritten to carry the auxiliary losses of the layers ``adding`` to the last
  layer's per-example losses (see the module's docstring); ``layers`` as they are when none adds
  any. ``with_stats``: the indices of the layers that keep running statistics.

  Raises:
    ValueError: the first layer is repeated (the running sum starts at the first layer, which
      maps the input to a new structure; put a plain layer such as the embedding first), or a
      layer adding auxiliary losses also keeps running statistics.
  """
  if not adding:
    return tuple(layers)
  for i in adding:
    if i in with_stats:
      raise ValueError(f"{owner}: layers[{i}] ({layers[i].kind}) keeps running statistics "
                       "(BatchNorm) and adds auxiliary losses; tpipe carries one or the other "
                       "per layer. Move the auxiliary loss to a layer without running "
                       "statistics.")
  if layers[0].copies is not None:
    raise ValueError(
        f"{owner}: layers {list(adding)} add auxiliary losses, which tpipe carries from the "
        f"first layer on, but layers[0] repeats {layers[0].kind}; start the sequence with a "
        "plain layer (the embedding, or any layer before the tpipe.Repeat).")
  last = len(layers) - 1
  return tuple(_carrying(layer, i in adding, i == 0, i == last, owner)
               for i, layer in enumerate(layers))


def _carrying(layer, adds: bool, first: bool, last: bool, owner: str) -> layers_lib.Layer:
  """One layer of :func:`carry`: input ``h`` (the first layer) or ``(h, sums)``, output
  ``(y, sums)`` or (the last layer) ``y + sums``."""

  def step(inner_apply, params, stats, h, kwargs, rngs):
    inner, sums = (h, None) if first else h
    if adds:
      y, statistics, added = layer.apply_with_aux_loss(params, stats, inner, kwargs, rngs)
      rest = ()
    else:
      y, statistics, *rest = inner_apply(params, stats, inner, kwargs, rngs)
      added = None
    if sums is None:
      sums = jnp.zeros((layers_lib.batch_size(inner, owner),), jnp.float32)
    if added is not None:
      sums = sums + jnp.asarray(added, jnp.float32)
    # Inside shard_map the sums vary over the manual axes the output does (a scan over a
    # repeated layer's copies carries both and needs them to agree).
    sums = spmd.cast_to(sums, frozenset().union(*map(spmd.varying_axes, jax.tree.leaves(y))))
    out = _plus_aux_losses(y, sums, layer, owner) if last else (y, sums)
    return (out, statistics, *rest)

  def apply(params, stats, h, kwargs, rngs):
    return step(layer.apply, params, stats, h, kwargs, rngs)

  def apply_with_momenta(params, stats, h, kwargs, rngs):
    return step(layer.apply_with_momenta, params, stats, h, kwargs, rngs)

  return dataclasses.replace(
      layer, apply=apply, apply_with_aux_loss=None,
      apply_with_momenta=apply_with_momenta if layer.apply_with_momenta is not None else None)


def _plus_aux_losses(y, sums, layer, owner: str):
  """The last layer's per-example losses ``y`` plus each row's auxiliary losses."""
  leaves = jax.tree.leaves(y)
  if not (len(leaves) == 1 and leaves[0].shape == sums.shape
          and jnp.issubdtype(leaves[0].dtype, jnp.floating)):
    raise ValueError(
        f"{owner}: layers add auxiliary losses, which tpipe adds to the last layer's "
        f"per-example losses, but the last layer ({layer.kind}) returns "
        f"{layers_lib.types(y)} per micro-batch of {sums.shape[0]} rows; end the layers with "
        "one that returns one float loss per example.")
  return jax.tree.map(lambda a: (a.astype(jnp.float32) + sums).astype(a.dtype), y)
