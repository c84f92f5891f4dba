"""Tests for tpipe.train.images: the digits, their split, the training iterator and eval batches.

NumPy only (the layers are tested in test_convnet.py).
"""

import json

import numpy as np
import pytest

from tpipe.train import images

pytestmark = pytest.mark.unit

NUM_EXAMPLES = 1797


@pytest.fixture(scope="module")
def splits():
  return images.DigitsData.load()


@pytest.fixture(scope="module")
def digits():
  from sklearn import datasets  # pylint: disable=g-import-not-at-top

  return datasets.load_digits()


def _rows(x: np.ndarray) -> list[bytes]:
  """Each example as bytes, sorted: compares collections of images regardless of order."""
  return sorted(row.tobytes() for row in np.asarray(x).reshape(len(x), -1))


def test_split_sizes_disjoint_and_faithful(splits, digits):
  train, test = splits
  assert (len(train), len(test)) == (1437, 360)
  assert set(train.indices).isdisjoint(test.indices)
  np.testing.assert_array_equal(np.sort(np.concatenate([train.indices, test.indices])),
                                np.arange(NUM_EXAMPLES))
  for split in splits:
    assert split.images.shape == (len(split), 8, 8, 1) and split.images.dtype == np.float32
    assert split.labels.dtype == np.int32
    np.testing.assert_array_equal(split.images[..., 0], digits.images[split.indices] / 16.0)
    np.testing.assert_array_equal(split.labels, digits.target[split.indices])
  assert train.images.min() == 0.0 and train.images.max() == 1.0


def test_split_is_stratified(splits, digits):
  _, test = splits
  counts = np.bincount(digits.target, minlength=10)
  test_counts = np.bincount(test.labels, minlength=10)
  quotas = 360 * counts / NUM_EXAMPLES
  assert test_counts.sum() == 360
  assert np.all(np.abs(test_counts - quotas) < 1.0)


def test_stratified_split_rounds_by_largest_remainder():
  labels = np.array([0] * 6 + [1] * 3 + [2])
  # Quotas 3, 1.5, 0.5: floors give 4, the one left goes to the tied class with the smaller label.
  train, test = images.stratified_split(labels, num_test=5, seed=0)
  np.testing.assert_array_equal(np.bincount(labels[test], minlength=3), [3, 2, 0])
  np.testing.assert_array_equal(np.bincount(labels[train], minlength=3), [3, 1, 1])


def test_split_is_deterministic_and_seeded(splits):
  train, test = splits
  train2, test2 = images.DigitsData.load()
  np.testing.assert_array_equal(test.indices, test2.indices)
  np.testing.assert_array_equal(train.images, train2.images)
  _, other = images.DigitsData.load(seed=1)
  assert not np.array_equal(test.indices, other.indices)
  np.testing.assert_array_equal(np.bincount(other.labels), np.bincount(test.labels))


def test_epochs_are_permutations_reshuffled(splits):
  train, _ = splits
  # 1437 = 3 * 479: every three batches are one epoch.
  it = images.train_iterator(train, batch_size=479, seed=0, max_shift=0)
  epochs = [np.concatenate([next(it)["images"] for _ in range(3)]) for _ in range(2)]
  for epoch in epochs:
    assert _rows(epoch) == _rows(train.images)
  assert not np.array_equal(epochs[0], epochs[1])
  assert not np.array_equal(epochs[0], train.images)


def test_shifts_move_each_image_by_at_most_one_pixel(splits):
  train, _ = splits
  plain = next(images.train_iterator(train, batch_size=64, seed=5, max_shift=0))
  shifted = next(images.train_iterator(train, batch_size=64, seed=5, max_shift=1))
  np.testing.assert_array_equal(plain["labels"], shifted["labels"])  # Same shuffle.
  padded = np.pad(plain["images"], ((0, 0), (1, 1), (1, 1), (0, 0)))
  seen = set()
  for i in range(64):
    matches = {(dy, dx) for dy in range(3) for dx in range(3)
               if np.array_equal(padded[i, dy:dy + 8, dx:dx + 8], shifted["images"][i])}
    assert matches, f"example {i} is not a shift of the original"
    seen |= matches
  assert len(seen) >= 5  # Shifts vary across examples (9 possible).


def test_iterator_restores_exactly_across_an_epoch_boundary(splits):
  train, _ = splits
  it = images.train_iterator(train, batch_size=500, seed=3, max_shift=1)
  for _ in range(2):
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # What the checkpoint stores.
  expected = [next(it) for _ in range(2)]          # The first of these spans epochs 0 and 1.
  resumed = images.train_iterator(train, batch_size=500, seed=3, max_shift=1)
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    np.testing.assert_array_equal(got["images"], want["images"])
    np.testing.assert_array_equal(got["labels"], want["labels"])
  other = next(images.train_iterator(train, batch_size=500, seed=4, max_shift=1))
  assert not np.array_equal(other["labels"], expected[0]["labels"])


@pytest.mark.parametrize("batch_size, num_batches", [(64, 6), (120, 3), (400, 1)])
def test_eval_batches_cover_the_test_set_once_in_order(splits, batch_size, num_batches):
  _, test = splits
  batches = images.eval_batches(test, batch_size=batch_size)
  assert len(batches) == num_batches
  for b in batches:
    assert b["images"].shape == (batch_size, 8, 8, 1) and b["mask"].shape == (batch_size,)
  mask = np.concatenate([b["mask"] for b in batches])
  assert mask.sum() == len(test) and mask[:len(test)].all()
  np.testing.assert_array_equal(np.concatenate([b["images"] for b in batches])[mask],
                                test.images)
  np.testing.assert_array_equal(np.concatenate([b["labels"] for b in batches])[mask],
                                test.labels)
  assert not np.concatenate([b["images"] for b in batches])[~mask].any()  # Zero padding.


@pytest.mark.parametrize("call, match", [
    (lambda t: images.train_dataset(t, batch_size=0, seed=0), "batch_size"),
    (lambda t: images.train_dataset(t, batch_size=5000, seed=0), "batch_size"),
    (lambda t: images.train_dataset(t, batch_size=8, seed=0, max_shift=8), "max_shift"),
    (lambda t: images.eval_batches(t, batch_size=-1), "batch_size"),
    (lambda t: images.DigitsData.load(num_test=0), "num_test"),
    (lambda t: images.DigitsData.load(num_test=NUM_EXAMPLES), "num_test"),
])
def test_bad_arguments_raise(splits, call, match):
  with pytest.raises(ValueError, match=match):
    call(splits[0])
