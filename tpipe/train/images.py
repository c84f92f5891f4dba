"""The UCI handwritten digits (bundled with scikit-learn) as a grain image-classification pipeline.

``sklearn.datasets.load_digits`` reads 1,797 grayscale 8x8 images of the digits 0-9 (pixel values
0-16) from a file shipped inside scikit-learn: nothing is downloaded. The recipe, all
deterministic:

1. Images become float32 ``[N, 8, 8, 1]`` scaled to [0, 1] (divided by 16); labels int32 ``[N]``.
2. A stratified split holds out ``num_test`` images (default 360, 20%): each class gives its share
   of the test set in proportion to its size (largest remainders settle the rounding), picked by a
   seeded permutation within the class. Both splits keep the original order of the images.
3. Training batches come from a grain ``MapDataset``: shuffled with a seed (reshuffled every
   epoch), repeated forever, each image shifted by up to ``max_shift`` pixels with zero fill, and
   batched. A shift is drawn from a generator seeded by ``(seed, position in the stream)``, so the
   stream is a pure function of the seed and the iterator's state (one integer) restores exactly.
4. Evaluation batches cover every test image exactly once, in order; the last batch is padded to
   the batch size with zero images and ``mask`` False, so every batch has the same shape.

Example::

  train, test = DigitsData.load()
  it = train_iterator(train, batch_size=64, seed=0)
  batch = next(it)            # {"images": float32 [64, 8, 8, 1], "labels": int32 [64]}
  state = it.get_state()      # JSON-serialisable; it.set_state(state) resumes
  for batch in eval_batches(test, batch_size=64):   # + "mask": bool [64]
    ...

Like the text batches, every process builds the whole global batch and :func:`to_global` places
it on the mesh.
"""

from __future__ import annotations

import dataclasses

import grain
import numpy as np

from tpipe.train import data as _text_data

NUM_CLASSES = 10
IMAGE_SHAPE = (8, 8, 1)
# load_digits pixels are integers in [0, 16].
_PIXEL_MAX = 16.0

# Places a host batch as global arrays on a mesh: the same for images as for text.
to_global = _text_data.to_global


def _check_int(name: str, value, minimum: int = 0) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}.")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}.")


def stratified_split(labels: np.ndarray, *, num_test: int,
                     seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Splits indices ``0..len(labels)-1`` into train and test, stratified by label.

  Class ``c`` with ``n_c`` examples gives ``num_test * n_c / N`` test examples, rounded by
  largest remainder (ties to the smaller label) so the test set has exactly ``num_test``. Within a
  class the test examples are the first of a permutation drawn from ``seed``.

  Args:
    labels: int ``[N]`` class labels.
    num_test: size of the test split, in ``[1, N - 1]``.
    seed: permutation seed.

  Returns:
    ``(train_indices, test_indices)``, each sorted ascending, disjoint, together all indices.
  """
  labels = np.asarray(labels)
  classes, counts = np.unique(labels, return_counts=True)
  _check_int("num_test", num_test, minimum=1)
  if num_test >= len(labels):
    raise ValueError(f"num_test={num_test} leaves no training examples; use at most "
                     f"{len(labels) - 1} (of {len(labels)}).")
  quotas = num_test * counts / len(labels)
  shares = np.floor(quotas).astype(np.int64)
  # Stable sort on the negated remainder: ties go to the earlier (smaller) class.
  order = np.argsort(-(quotas - shares), kind="stable")
  shares[order[:num_test - shares.sum()]] += 1
  rng = np.random.default_rng(seed)
  test = []
  for label, share in zip(classes, shares):
    members = np.flatnonzero(labels == label)
    test.append(rng.permutation(members)[:share])
  test = np.sort(np.concatenate(test))
  train = np.setdiff1d(np.arange(len(labels)), test)
  return train, test


@dataclasses.dataclass(frozen=True)
class DigitsData:
  """One split of the digits: images, labels and where each came from.

  Attributes:
    images: float32 ``[n, 8, 8, 1]`` in [0, 1].
    labels: int32 ``[n]`` in ``[0, 10)``.
    indices: int64 ``[n]``, each image's position in ``load_digits()``'s order.
  """

  images: np.ndarray
  labels: np.ndarray
  indices: np.ndarray

  def __len__(self) -> int:
    return len(self.labels)

  def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Example ``index``: ``(image float32 [8, 8, 1], label int32 [])``."""
    if not 0 <= index < len(self):
      raise IndexError(f"example {index} out of range [0, {len(self)}).")
    return self.images[index], self.labels[index]

  @classmethod
  def load(cls, *, num_test: int = 360, seed: int = 0) -> tuple["DigitsData", "DigitsData"]:
    """Reads the digits from scikit-learn's bundled copy and returns ``(train, test)``.

    Args:
      num_test: test split size (the default, 360 of 1,797, is 20%; 360 = 2^3 * 3^2 * 5 divides
        evenly by many eval batch sizes).
      seed: seed of the split.

    Returns:
      ``(train, test)`` :class:`DigitsData`, stratified by label (see :func:`stratified_split`).
    """
    from sklearn import datasets  # pylint: disable=g-import-not-at-top  (an optional extra)

    digits = datasets.load_digits()
    images = (digits.images.astype(np.float32) / _PIXEL_MAX)[..., None]
    labels = digits.target.astype(np.int32)
    out = []
    for idx in stratified_split(labels, num_test=num_test, seed=seed):
      out.append(cls(images=images[idx], labels=labels[idx], indices=idx))
    return out[0], out[1]


def random_shift(image: np.ndarray, rng: np.random.Generator, max_shift: int) -> np.ndarray:
  """``image`` ``[h, w, c]`` moved by ``(dy, dx)``, each uniform in ``[-max_shift, max_shift]``.

  Pixels moved out are dropped and the uncovered border is zero (black background).
  """
  if max_shift == 0:
    return image
  h, w = image.shape[:2]
  dy, dx = rng.integers(-max_shift, max_shift + 1, size=2)
  padded = np.pad(image, ((max_shift, max_shift), (max_shift, max_shift), (0, 0)))
  return padded[max_shift - dy:max_shift - dy + h, max_shift - dx:max_shift - dx + w]


def _to_batch(batch: tuple[np.ndarray, np.ndarray]) -> dict[str, np.ndarray]:
  images, labels = batch
  return {"images": np.asarray(images, np.float32), "labels": np.asarray(labels, np.int32)}


def _augment_seed(seed: int) -> int:
  """A seed for the shifts independent of the shuffle's (both come from ``seed``)."""
  return int(np.random.SeedSequence([seed, 1]).generate_state(1)[0])


def train_dataset(data: DigitsData, *, batch_size: int, seed: int,
                  max_shift: int = 1) -> grain.MapDataset:
  """Shuffled (reshuffled each epoch), randomly shifted, infinitely repeated batches.

  Args:
    data: the train split.
    batch_size: the global batch size, at most ``len(data)``.
    seed: seed of the shuffle and of the shifts.
    max_shift: largest shift in pixels along each axis; 0 turns augmentation off.

  Returns:
    A ``grain.MapDataset`` of ``{"images": float32 [batch_size, 8, 8, 1], "labels": int32
    [batch_size]}``. Batches run across epoch boundaries (an epoch is not a whole number of
    batches); element ``i`` of the stream is shifted by a draw seeded by ``(seed, i)``.
  """
  _check_int("batch_size", batch_size, minimum=1)
  _check_int("max_shift", max_shift, minimum=0)
  if batch_size > len(data):
    raise ValueError(f"batch_size={batch_size} exceeds the {len(data)} training examples.")
  if max_shift >= min(IMAGE_SHAPE[:2]):
    raise ValueError(f"max_shift={max_shift} would shift an 8x8 image out of view; use 0-2.")
  ds = grain.MapDataset.source(data).shuffle(seed=seed).repeat()
  if max_shift:
    ds = ds.random_map(lambda ex, rng: (random_shift(ex[0], rng, max_shift), ex[1]),
                       seed=_augment_seed(seed))
  return ds.batch(batch_size, drop_remainder=True).map(_to_batch)


def train_iterator(data: DigitsData, *, batch_size: int, seed: int,
                   max_shift: int = 1) -> grain.DatasetIterator:
  """A checkpointable iterator over :func:`train_dataset` (``get_state``/``set_state``)."""
  options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)
  return iter(train_dataset(data, batch_size=batch_size, seed=seed, max_shift=max_shift)
              .to_iter_dataset(read_options=options))


def eval_batches(data: DigitsData, *, batch_size: int) -> list[dict[str, np.ndarray]]:
  """Every example of ``data`` exactly once, in order, in batches of ``batch_size``.

  The last batch is padded with zero images (label 0) up to ``batch_size``, so every batch has the
  same shape (one compile, divisible by the mesh); ``mask`` is False on the padding. Count an
  example's result only where ``mask`` is True: ``accuracy = sum(correct & mask) / sum(mask)``.

  Args:
    data: the test split.
    batch_size: the global batch size.

  Returns:
    ``ceil(len(data) / batch_size)`` dicts of ``images`` float32 ``[batch_size, 8, 8, 1]``,
    ``labels`` int32 ``[batch_size]`` and ``mask`` bool ``[batch_size]``.
  """
  _check_int("batch_size", batch_size, minimum=1)

  def pad(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    n = len(batch["labels"])
    out = {k: np.concatenate([v, np.zeros((batch_size - n,) + v.shape[1:], v.dtype)])
           for k, v in batch.items()}
    out["mask"] = np.arange(batch_size) < n
    return out

  ds = (grain.MapDataset.source(data).batch(batch_size, drop_remainder=False)
        .map(_to_batch).map(pad))
  return [ds[i] for i in range(len(ds))]
