"""Auxiliary losses and metrics: what layers inside the stages add to the loss (a router's balance
loss) or report beside it (a router's expert load).

A layer may add scalar losses besides the per-example loss the last layer computes (a front end
collects them: ``self.sow("aux_loss", name, value)`` in linen, ``self.sow(tpipe.nnx.AuxLoss,
name, value)`` in NNX). The loss a pipeline minimises is then

    mean over examples of the last layer's loss + mean over micro-batches of the aux losses

(every auxiliary loss of every layer, summed, on each micro-batch): the model run in sequence
on each micro-batch, as gradient accumulation runs it. An auxiliary loss that pools over a
micro-batch's rows (a balance loss counts tokens per expert) pools over the rows a device holds
of it: one data-parallel replica's share, as data-parallel training computes it. A layer may
also sow *auxiliary metrics* (``"aux_metric"``, ``tpipe.nnx.AuxMetric``): carried the same way,
never added to the loss, reported by a pipeline's ``loss_terms``.

Every value has a name, ``"<kind>/<path>"``: its kind (:data:`LOSS` or :data:`METRIC`) and where
the layer sowed it (``aux_loss/moe/router_balance``). Values of one name add up over the layers
and repeated copies that sow it, as the loss adds them up.

How: planning finds the layers that add auxiliary values, and their names, while it traces the
sequence (:attr:`tpipe.core.planning.plan.Traced.adding`,
:attr:`~tpipe.core.planning.plan.Traced.aux_names`),
and the values travel with the activations: :func:`carry` rewrites the layer sequence so that the
first layer starts a per-example running sum of zeros beside its output (one float per name),
each layer adds its own values to every row of it, and the last layer adds the auxiliary losses
to its per-example losses (or, for :func:`carry`'s ``terms``, returns the sums beside them).
Every schedule then carries the sums stage to stage as it carries activations (a few floats per
row), and the loss's gradient reaches each auxiliary loss through them: no schedule needs to
know.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tpipe.core.base import layers as layers_lib
from tpipe.core.base import spmd


# The kinds of auxiliary values: added to the loss, or only reported.
LOSS = "aux_loss"
METRIC = "aux_metric"


def named(sown: dict, owner: str, where: str) -> dict[str, jax.Array] | None:
  """The auxiliary values a layer sowed on one call, ``{"<kind>/<path>": float32 scalar}``
  (values sown under one name on one call add up), None when it sowed none.

  Args:
    sown: ``{kind: tree}``, what the layer sowed of each kind (:data:`LOSS`, :data:`METRIC`);
      the tree's dict keys and attribute names make the path (sequence indices, the tuple
      ``sow`` appends to, do not).
    owner: the API the user called, for messages.
    where: the layer, for messages.

  Raises:
    ValueError: a value that is not a float scalar.
  """
  values = {}
  for kind in sorted(sown):
    for path, leaf in jax.tree_util.tree_flatten_with_path(sown[kind])[0]:
      if jnp.ndim(leaf) != 0 or not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
        raise ValueError(f"{owner}: {where} sowed an auxiliary value ({kind}) of shape "
                         f"{jnp.shape(leaf)} and dtype {jnp.result_type(leaf)}; auxiliary "
                         "losses and metrics are float scalars (reduce over the tokens first, "
                         "e.g. with jnp.mean).")
      keys = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path
              if not isinstance(k, jax.tree_util.SequenceKey)]
      name = "/".join([kind] + [k for k in keys if k])
      values[name] = values.get(name, 0.0) + jnp.asarray(leaf, jnp.float32)
  return values or None


def is_loss(name: str) -> bool:
  """Whether the auxiliary value ``name`` (``"<kind>/<path>"``) joins the loss."""
  return name.startswith(LOSS + "/")


def carried(names: tuple[str, ...], output) -> tuple[str, ...]:
  """The auxiliary values a pipeline carries, of those the layers sow (``names``), for the last
  layer's abstract ``output`` on a micro-batch: all of them where the output is one float per
  example (a loss) or an auxiliary loss is among them (:func:`carry` then asks for a loss);
  none where only metrics are sown and the output is not a loss (a model run for its logits:
  its metrics have no loss to be reported beside, and are dropped)."""
  if layers_lib.is_per_example_loss(output) or any(map(is_loss, names)):
    return tuple(names)
  return ()


def carry(layers, adding: tuple[int, ...], names: tuple[str, ...], owner: str,
          with_stats: frozenset = frozenset(), terms: bool = False
          ) -> tuple[layers_lib.Layer, ...]:
  """``layers`` rewritten to carry the auxiliary values of the layers ``adding`` to the last
  layer (see the module's docstring); ``layers`` as they are when none adds any.

  Args:
    layers: the sequence.
    adding: the indices of the layers that sow auxiliary values.
    names: every name they sow (:func:`named`), in the order of the carried columns.
    owner: the API the user called, for messages.
    with_stats: the indices of the layers that keep running statistics.
    terms: the last layer returns ``(losses, sums)``, its own per-example losses and the
      ``[rows, len(names)]`` auxiliary sums apart
      (:meth:`tpipe.core.engine.PlannedPipeline.loss_terms`); else its losses plus the auxiliary
      losses.

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
  return tuple(_carrying(layer, i in adding, i == 0, i == last, tuple(names), owner, terms)
               for i, layer in enumerate(layers))


def _carrying(layer, adds: bool, first: bool, last: bool, names: tuple[str, ...], owner: str,
              terms: bool) -> layers_lib.Layer:
  """One layer of :func:`carry`: input ``h`` (the first layer) or ``(h, sums)``, output
  ``(y, sums)`` or (the last layer) ``y`` plus the auxiliary losses (``(y, sums)`` for
  ``terms``), ``sums`` being ``[rows, len(names)]``."""

  def step(inner_apply, params, stats, h, kwargs, rngs):
    inner, sums = (h, None) if first else h
    if adds:
      y, statistics, added = layer.apply_with_aux_values(params, stats, inner, kwargs, rngs)
      rest = ()
    else:
      y, statistics, *rest = inner_apply(params, stats, inner, kwargs, rngs)
      added = None
    if sums is None:
      sums = jnp.zeros((layers_lib.batch_size(inner, owner), len(names)), jnp.float32)
    if added:
      row = jnp.stack([jnp.asarray(added.get(name, 0.0), jnp.float32) for name in names])
      sums = sums + row[None, :]
    # Inside shard_map the sums vary over the manual axes the output does (a scan over a
    # repeated layer's copies carries both and needs them to agree).
    sums = spmd.cast_to(sums, frozenset().union(*map(spmd.varying_axes, jax.tree.leaves(y))))
    if last:
      _check_losses(y, sums, layer, owner)
      losses = [j for j, name in enumerate(names) if is_loss(name)]
      out = (y, sums) if terms else jax.tree.map(
          lambda a: (a.astype(jnp.float32) + sums[:, losses].sum(-1)).astype(a.dtype), y)
    else:
      out = (y, sums)
    return (out, statistics, *rest)

  def apply(params, stats, h, kwargs, rngs):
    return step(layer.apply, params, stats, h, kwargs, rngs)

  def apply_with_momenta(params, stats, h, kwargs, rngs):
    return step(layer.apply_with_momenta, params, stats, h, kwargs, rngs)

  return dataclasses.replace(
      layer, apply=apply, apply_with_aux_values=None,
      apply_with_momenta=apply_with_momenta if layer.apply_with_momenta is not None else None)


def _check_losses(y, sums, layer, owner: str) -> None:
  """Raises unless the last layer's output ``y`` is one float loss per row of ``sums``."""
  leaves = jax.tree.leaves(y)
  if not (len(leaves) == 1 and leaves[0].shape == sums.shape[:1]
          and jnp.issubdtype(leaves[0].dtype, jnp.floating)):
    raise ValueError(
        f"{owner}: layers add auxiliary losses, which tpipe adds to the last layer's "
        f"per-example losses, but the last layer ({layer.kind}) returns "
        f"{layers_lib.types(y)} per micro-batch of {sums.shape[0]} rows; end the layers with "
        "one that returns one float loss per example.")


def means(names: tuple[str, ...], losses, sums) -> dict[str, jax.Array]:
  """``{"loss": mean of losses, name: mean of its column of sums}``: a terms pipeline's
  per-example outputs (:func:`carry`'s ``terms``) as the means the loss takes of them."""
  out = {"loss": jnp.mean(jnp.asarray(losses, jnp.float32))}
  for j, name in enumerate(names):
    out[name] = jnp.mean(sums[:, j])
  return out
