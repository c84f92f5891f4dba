"""Layers of a small ResNet-style image classifier, one module per pipeline-able layer.

The network is ``Stem -> ResidualCell x n (some with stride 2) -> PoolHead``. Each is its own
linen module taking the activation first, so ``tpipe.Sequential([...])`` can cut the list into
stages; shapes change between them (a stride-2 cell halves the resolution and, by convention,
doubles the channels: :func:`resnet_layers` builds such a list).

BatchNorm follows Flax's convention: ``train=True`` normalizes with the batch's own statistics and
updates the running averages in the ``batch_stats`` collection (pass ``mutable=["batch_stats"]``);
``train=False`` (evaluation) normalizes with the running averages and changes nothing.
``bn_axis_name`` names a mapped axis to pool the statistics over (None: this batch only).

Example (plain, one layer at a time; ``experiments/digits_baseline.py`` wraps the list in a
module that applies it in order)::

  stem, *cells, head = resnet_layers(width=16, stage_sizes=(1, 1))   # 8x8x16 -> 4x4x32
  variables = stem.init(key, images)          # {"params": ..., "batch_stats": ...}
  x, updates = stem.apply(variables, images, train=True, mutable=["batch_stats"])
  x = stem.apply(variables, images)           # evaluation: running averages, nothing updated
  ...
  losses = head.apply(head_variables, x, labels)    # float32 [batch]; logits without labels

The list is meant for ``tpipe.Sequential(layers, per_example=("labels",), ...)``, which passes
``train`` to the layers that take it and ``labels`` to the head, and carries ``batch_stats``
through the stages (:mod:`tpipe.core.planning.statistics`).

Mixed precision as in :mod:`tpipe.train.models`: ``dtype`` is the computation dtype of the
convolutions, BatchNorm outputs and the classifier; ``param_dtype`` the storage dtype of the
parameters. BatchNorm statistics are computed in at least float32 (Flax's rule) and the head's
logits and losses are float32.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from tpipe.train.model_args import check_float_dtype

NUM_CLASSES = 10


def _check_positive_int(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}.")
  if value < 1:
    raise ValueError(f"{name} must be >= 1, got {value}.")


def _check_image(owner: str, x: jax.Array) -> None:
  if x.ndim != 4:
    raise ValueError(f"{owner} expects NHWC activations [batch, height, width, channels], got "
                     f"shape {x.shape}.")


class _ConvNorm(nn.Module):
  """Shared fields of the convolutional layers (a base class, not a layer)."""

  features: int
  bn_momentum: float = 0.9
  bn_epsilon: float = 1e-5
  bn_axis_name: str | None = None
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    name = type(self).__name__
    _check_positive_int(f"{name}.features", self.features)
    if not 0.0 <= self.bn_momentum < 1.0:
      raise ValueError(f"{name}.bn_momentum must be in [0, 1), got {self.bn_momentum!r}.")
    check_float_dtype(f"{name}.dtype", self.dtype)
    check_float_dtype(f"{name}.param_dtype", self.param_dtype)
    super().__post_init__()

  def _conv(self, features: int, kernel: int, stride: int, name: str) -> nn.Conv:
    # No bias: the BatchNorm that follows every convolution has its own.
    return nn.Conv(features, (kernel, kernel), strides=(stride, stride), padding="SAME",
                   use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, name=name)

  def _norm(self, train: bool, name: str) -> nn.BatchNorm:
    return nn.BatchNorm(use_running_average=not train, momentum=self.bn_momentum,
                        epsilon=self.bn_epsilon, axis_name=self.bn_axis_name, dtype=self.dtype,
                        param_dtype=self.param_dtype, name=name)


class Stem(_ConvNorm):
  """The input layer: a 3x3 convolution to ``features`` channels, BatchNorm, ReLU.

  Attributes:
    features: output channels.
    bn_momentum: BatchNorm running-average momentum (the old value's weight).
    bn_epsilon: BatchNorm epsilon.
    bn_axis_name: mapped axis to pool BatchNorm statistics over, or None.
    dtype: computation dtype.
    param_dtype: parameter dtype.
  """

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
    """Maps images ``[batch, h, w, c]`` to ``[batch, h, w, features]`` in ``dtype``."""
    _check_image("Stem", x)
    x = self._conv(self.features, 3, 1, "conv")(x)
    return nn.relu(self._norm(train, "norm")(x))


class ResidualCell(_ConvNorm):
  """A basic ResNet block: ``relu(shortcut(x) + norm(conv(relu(norm(conv(x))))))``.

  Both convolutions are 3x3; the first has stride ``stride``. The shortcut is the identity when
  the shape is kept (``stride == 1`` and ``features`` equals the input channels), else a 1x1
  convolution with stride ``stride`` and BatchNorm (a projection). The output has the
  computation ``dtype``.

  Attributes:
    features: output channels (conventionally twice the input's when ``stride == 2``).
    stride: 1 keeps the resolution; 2 halves it (``SAME`` padding: ``ceil(h / 2)``).
    bn_momentum: BatchNorm running-average momentum (the old value's weight).
    bn_epsilon: BatchNorm epsilon.
    bn_axis_name: mapped axis to pool BatchNorm statistics over, or None.
    dtype: computation dtype.
    param_dtype: parameter dtype.
  """

  stride: int = 1

  def __post_init__(self):
    if self.stride not in (1, 2):
      raise ValueError(f"ResidualCell.stride must be 1 or 2, got {self.stride!r}.")
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
    """Maps ``[batch, h, w, c]`` to ``[batch, ceil(h / stride), ceil(w / stride), features]``."""
    _check_image("ResidualCell", x)
    h = self._conv(self.features, 3, self.stride, "conv1")(x)
    h = nn.relu(self._norm(train, "norm1")(h))
    h = self._conv(self.features, 3, 1, "conv2")(h)
    h = self._norm(train, "norm2")(h)
    shortcut = x.astype(h.dtype)
    if self.stride != 1 or x.shape[-1] != self.features:
      shortcut = self._conv(self.features, 1, self.stride, "proj_conv")(x)
      shortcut = self._norm(train, "proj_norm")(shortcut)
    return nn.relu(shortcut + h)


class PoolHead(nn.Module):
  """Global average pooling and a Dense classifier; with labels, the per-example loss.

  It has no BatchNorm and so no ``train`` argument (``tpipe.Sequential`` passes a keyword only to
  the layers whose ``__call__`` takes it).

  Attributes:
    num_classes: number of classes.
    dtype: computation dtype of the Dense layer (logits are cast to float32).
    param_dtype: parameter dtype.
  """

  num_classes: int = NUM_CLASSES
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    _check_positive_int("PoolHead.num_classes", self.num_classes)
    check_float_dtype("PoolHead.dtype", self.dtype)
    check_float_dtype("PoolHead.param_dtype", self.param_dtype)
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jax.Array, labels: jax.Array | None = None) -> jax.Array:
    """Classifies ``x`` ``[batch, h, w, c]``.

    Args:
      x: activations.
      labels: optional int ``[batch]`` class labels in ``[0, num_classes)``.

    Returns:
      float32 logits ``[batch, num_classes]`` when ``labels`` is None, else float32 per-example
      softmax cross-entropy losses ``[batch]`` (average them for the training loss).
    """
    _check_image("PoolHead", x)
    pooled = jnp.mean(x.astype(jnp.float32), axis=(1, 2)).astype(self.dtype)
    logits = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype,
                      name="dense")(pooled).astype(jnp.float32)
    if labels is None:
      return logits
    if labels.shape != x.shape[:1]:
      raise ValueError(f"labels must be [batch] = {x.shape[:1]}, got shape {labels.shape}.")
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def resnet_layers(*, width: int, stage_sizes: Sequence[int], num_classes: int = NUM_CLASSES,
                  **kwargs) -> list[nn.Module]:
  """The layer list ``[Stem, cells..., PoolHead]`` of a ResNet-style classifier.

  Args:
    width: channels of the stem and of the first group of cells.
    stage_sizes: cells per resolution; every group after the first starts with a stride-2 cell
      that halves the resolution and doubles the channels. ``(2, 2)`` on 8x8 inputs gives two
      cells at 8x8 x width and two at 4x4 x 2 width.
    num_classes: classifier outputs.
    **kwargs: passed to every ``Stem`` and ``ResidualCell`` (``bn_momentum``, ``bn_axis_name``,
      ``dtype``, ...); ``dtype`` and ``param_dtype`` also reach the head.

  Returns:
    A list of unbound modules, to apply in order.
  """
  if not stage_sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                            for n in stage_sizes):
    raise ValueError(f"stage_sizes must be a non-empty sequence of ints >= 1, got "
                     f"{stage_sizes!r}.")
  layers = [Stem(width, **kwargs)]
  features = width
  for group, size in enumerate(stage_sizes):
    for i in range(size):
      stride = 2 if group > 0 and i == 0 else 1
      features *= stride
      layers.append(ResidualCell(features, stride=stride, **kwargs))
  head_kwargs = {k: v for k, v in kwargs.items() if k in ("dtype", "param_dtype")}
  layers.append(PoolHead(num_classes, **head_kwargs))
  return layers
