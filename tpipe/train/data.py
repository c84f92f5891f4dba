"""Deterministic byte-level text from the Python standard library's source files, via grain.

Every machine with Python has this corpus. The recipe, all deterministic:

1. List the ``*.py`` files under ``sysconfig.get_paths()["stdlib"]`` (skipping ``site-packages``),
   sorted by path.
2. Split them by a hash of the path relative to the stdlib root: a file is ``eval`` when its hash
   falls in the first ``eval_fraction`` of the hash range, else ``train``.
3. Read files in the order of a second, independent path hash (a fixed shuffle, so a capped
   corpus still samples the whole library) until ``max_bytes`` are read; join each split's files
   into one byte string.
4. Cut the byte string into windows of ``seq_len + 1`` bytes with stride ``seq_len``; a window
   gives ``inputs = w[:-1]`` and ``targets = w[1:]``.

Training batches come from a grain ``MapDataset`` (shuffle with a seed, reshuffled every epoch,
repeated forever, batched) turned into an iterator whose state (one integer) is saved in the
checkpoint, so a resumed run continues at the same position::

  train = TextData.load(seq_len=128, max_bytes=4_000_000)
  it = train_iterator(train, batch_size=32, seed=0)
  batch = next(it)            # {"inputs": int32 [32, 128], "targets": int32 [32, 128]}
  state = it.get_state()      # JSON-serialisable; it.set_state(state) resumes
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import sysconfig

import grain
import jax
import numpy as np


def stdlib_root() -> pathlib.Path:
  """The directory of the running Python's standard library."""
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: pathlib.Path | None = None) -> list[pathlib.Path]:
  """All ``*.py`` files under ``root`` (default: the stdlib), sorted by path, no site-packages."""
  root = stdlib_root() if root is None else pathlib.Path(root)
  files = []
  for directory, subdirectories, names in os.walk(root):
    subdirectories[:] = [d for d in subdirectories if d != "site-packages"]  # Not walked.
    files += [pathlib.Path(directory, n) for n in names if n.endswith(".py")]
  return sorted(p for p in files if p.is_file())


def _path_hash(relpath: str, salt: str) -> float:
  """A stable hash of a relative path, as a float in [0, 1); ``salt`` makes independent hashes."""
  digest = hashlib.sha256(f"{salt}:{relpath}".encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") / 2.0**64


@dataclasses.dataclass(frozen=True)
class TextData:
  """One split of the corpus as a flat uint8 array, viewed as fixed-length windows.

  Attributes:
    tokens: uint8 ``[n]``, the split's files joined.
    seq_len: model sequence length; a window holds ``seq_len + 1`` bytes.
    files: the relative paths read into this split, in reading order.
  """

  tokens: np.ndarray
  seq_len: int
  files: tuple[str, ...]

  def __len__(self) -> int:
    return max(0, (len(self.tokens) - 1) // self.seq_len)

  def __getitem__(self, index: int) -> np.ndarray:
    """Window ``index``: ``seq_len + 1`` bytes starting at ``index * seq_len``."""
    if not 0 <= index < len(self):
      raise IndexError(f"window {index} out of range [0, {len(self)}).")
    start = int(index) * self.seq_len
    return self.tokens[start:start + self.seq_len + 1]

  @classmethod
  def load(cls, *, seq_len: int, max_bytes: int = 4_000_000, eval_fraction: float = 0.05,
           root: pathlib.Path | None = None) -> tuple["TextData", "TextData"]:
    """Reads the corpus and returns the ``(train, eval)`` splits.

    Args:
      seq_len: the model's sequence length (>= 1).
      max_bytes: stop reading files once this many bytes are read (both splits together).
      eval_fraction: share of files, by path hash, held out for evaluation; in (0, 1).
      root: corpus directory (default: the stdlib).

    Returns:
      ``(train, eval)`` :class:`TextData`.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
      raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}.")
    if not 0.0 < eval_fraction < 1.0:
      raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}.")
    if max_bytes < 16 * (seq_len + 1):
      raise ValueError(
          f"max_bytes={max_bytes} is too small for seq_len={seq_len}; use at least "
          f"{16 * (seq_len + 1)} (a few MB is typical).")
    root = stdlib_root() if root is None else pathlib.Path(root)
    files = list_source_files(root)
    if not files:
      raise ValueError(f"no *.py files found under {root}; pass another root.")
    rel = [f.relative_to(root).as_posix() for f in files]
    order = sorted(range(len(files)), key=lambda i: (_path_hash(rel[i], "order"), rel[i]))
    chunks = {"train": [], "eval": []}
    names = {"train": [], "eval": []}
    total = 0
    for i in order:
      if total >= max_bytes:
        break
      data = files[i].read_bytes()[:max_bytes - total]
      split = "eval" if _path_hash(rel[i], "split") < eval_fraction else "train"
      chunks[split].append(data + b"\n")
      names[split].append(rel[i])
      total += len(data)
    out = []
    for split in ("train", "eval"):
      tokens = np.frombuffer(b"".join(chunks[split]), dtype=np.uint8)
      split_data = cls(tokens=tokens, seq_len=seq_len, files=tuple(names[split]))
      if len(split_data) < 1:
        raise ValueError(
            f"the {split} split has fewer than seq_len+1={seq_len + 1} bytes; raise max_bytes "
            f"(now {max_bytes}) or eval_fraction (now {eval_fraction}).")
      out.append(split_data)
    return out[0], out[1]


def _to_example(windows: np.ndarray) -> dict[str, np.ndarray]:
  windows = np.asarray(windows, dtype=np.int32)
  return {"inputs": windows[..., :-1], "targets": windows[..., 1:]}


def train_dataset(data: TextData, *, batch_size: int, seed: int) -> grain.MapDataset:
  """Shuffled (reshuffled each epoch), infinitely repeated batches of windows.

  Args:
    data: the train split.
    batch_size: the global batch size.
    seed: shuffle seed.

  Returns:
    A ``grain.MapDataset`` of ``{"inputs", "targets"}`` int32 ``[batch_size, seq_len]`` batches.
  """
  return (grain.MapDataset.source(data)
          .shuffle(seed=seed)
          .repeat()
          .batch(batch_size, drop_remainder=True)
          .map(_to_example))


def train_iterator(data: TextData, *, batch_size: int, seed: int) -> grain.DatasetIterator:
  """A checkpointable iterator over :func:`train_dataset` (``get_state``/``set_state``)."""
  options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)
  return iter(train_dataset(data, batch_size=batch_size, seed=seed)
              .to_iter_dataset(read_options=options))


def eval_batches(data: TextData, *, batch_size: int, num_batches: int,
                 seed: int = 0) -> list[dict[str, np.ndarray]]:
  """A fixed list of eval batches (the same every call), cycling the split if it is small.

  Args:
    data: the eval split.
    batch_size: the global batch size.
    num_batches: how many batches.
    seed: shuffle seed for which windows are picked.

  Returns:
    ``num_batches`` dicts of int32 ``[batch_size, seq_len]`` arrays.
  """
  ds = (grain.MapDataset.source(data).shuffle(seed=seed).repeat()
        .batch(batch_size, drop_remainder=True).map(_to_example))
  return [ds[i] for i in range(num_batches)]


def to_global(batch: dict[str, np.ndarray], sharding: jax.sharding.Sharding) -> dict:
  """Places a host batch as global ``jax.Array``s with ``sharding``.

  Every process holds the whole global batch (it is cheap to build: byte windows), and each
  device takes its slice, so single- and multi-process runs see identical data.

  Args:
    batch: dict of NumPy arrays, the global batch.
    sharding: e.g. ``tpipe.data_sharding(mesh)``.

  Returns:
    The same dict with global ``jax.Array`` values.
  """
  return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
          for k, v in batch.items()}
