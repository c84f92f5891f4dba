"""Tests for tpipe.train.data: the stdlib byte corpus, its split, windows and iterator state.

NumPy only (the ``unit`` tier), but for the batch's placement on the mesh.
"""

import json

import jax
import numpy as np
import pytest

import tpipe
from tpipe.train import data

MAX_BYTES = 300_000
SEQ_LEN = 32


@pytest.fixture(scope="module")
def splits():
  return data.TextData.load(seq_len=SEQ_LEN, max_bytes=MAX_BYTES, eval_fraction=0.1)


@pytest.mark.unit
def test_corpus_is_the_stdlib_sorted_without_site_packages():
  files = data.list_source_files()
  assert files == sorted(files)
  assert any(f.name == "functools.py" for f in files)
  root = data.stdlib_root()
  assert not any("site-packages" in f.relative_to(root).parts for f in files)


@pytest.mark.unit
def test_load_is_deterministic_capped_and_splits_files(splits):
  train, evals = splits
  train2, evals2 = data.TextData.load(seq_len=SEQ_LEN, max_bytes=MAX_BYTES, eval_fraction=0.1)
  np.testing.assert_array_equal(train.tokens, train2.tokens)
  np.testing.assert_array_equal(evals.tokens, evals2.tokens)
  assert set(train.files).isdisjoint(evals.files)
  assert train.files and evals.files
  # File bytes are capped at max_bytes (plus one separator byte per file).
  num_files = len(train.files) + len(evals.files)
  assert len(train.tokens) + len(evals.tokens) <= MAX_BYTES + num_files


@pytest.mark.unit
def test_split_of_a_file_does_not_depend_on_the_cap():
  small_train, small_eval = data.TextData.load(seq_len=SEQ_LEN, max_bytes=100_000)
  big_train, big_eval = data.TextData.load(seq_len=SEQ_LEN, max_bytes=MAX_BYTES)
  assert set(small_eval.files) <= set(big_eval.files)
  assert set(small_train.files) <= set(big_train.files)


@pytest.mark.unit
def test_windows_are_shifted_by_one_byte(splits):
  train, _ = splits
  root = data.stdlib_root()
  # The split is its files joined, each followed by a newline (the first may be short).
  joined = b""
  for name in train.files:
    joined += (root / name).read_bytes() + b"\n"
    if len(joined) > SEQ_LEN:
      break
  np.testing.assert_array_equal(train[0], np.frombuffer(joined[:SEQ_LEN + 1], np.uint8))
  np.testing.assert_array_equal(train[1][0], train[0][-1])  # Stride seq_len, overlap one byte.
  assert len(train) == (len(train.tokens) - 1) // SEQ_LEN
  with pytest.raises(IndexError):
    train[len(train)]
  batch = next(data.train_iterator(train, batch_size=4, seed=0))
  assert batch["inputs"].shape == batch["targets"].shape == (4, SEQ_LEN)
  assert batch["inputs"].dtype == np.int32
  np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])


@pytest.mark.unit
def test_iterator_state_resumes_at_the_same_position(splits):
  train, _ = splits
  it = data.train_iterator(train, batch_size=4, seed=3)
  for _ in range(3):
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # What the checkpoint stores.
  expected = [next(it)["inputs"] for _ in range(2)]
  resumed = data.train_iterator(train, batch_size=4, seed=3)
  resumed.set_state(state)
  for want in expected:
    np.testing.assert_array_equal(next(resumed)["inputs"], want)
  other_seed = next(data.train_iterator(train, batch_size=4, seed=4))["inputs"]
  first = next(data.train_iterator(train, batch_size=4, seed=3))["inputs"]
  assert not np.array_equal(first, other_seed)


@pytest.mark.unit
def test_eval_batches_are_fixed(splits):
  _, evals = splits
  a = data.eval_batches(evals, batch_size=4, num_batches=3)
  b = data.eval_batches(evals, batch_size=4, num_batches=3)
  assert len(a) == 3
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["targets"], y["targets"])


def test_to_global_shards_the_batch_over_data():
  mesh = tpipe.make_mesh(stages=4, data=2)
  batch = {"inputs": np.arange(8 * 5, dtype=np.int32).reshape(8, 5)}
  out = data.to_global(batch, tpipe.data_sharding(mesh))
  assert out["inputs"].sharding == tpipe.data_sharding(mesh)
  np.testing.assert_array_equal(jax.device_get(out["inputs"]), batch["inputs"])


@pytest.mark.unit
@pytest.mark.parametrize("kwargs, match", [
    (dict(seq_len=0), "seq_len"),
    (dict(seq_len=8, eval_fraction=1.5), "eval_fraction"),
    (dict(seq_len=64, max_bytes=100), "max_bytes"),
])
def test_bad_arguments_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    data.TextData.load(**kwargs)
