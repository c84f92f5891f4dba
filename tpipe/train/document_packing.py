"""Documents packed into fixed-length training sequences, read through grain.

The tokenized documents are joined, each followed by the end-of-document token, into one
stream, cut like the byte corpus (:mod:`tpipe.train.data`) into windows of ``seq_len + 1``
tokens with stride ``seq_len``. A window gives five arrays of ``seq_len``:

* ``inputs = w[:-1]`` and ``targets = w[1:]``;
* ``segment_ids``: which document each input token belongs to (1, 2, ... within the window; an
  end-of-document token belongs to the document it ends), so attention stays inside a document;
* ``positions``: each token's offset in its document, restarting at 0 where a document starts
  (and at the window's start for a document begun in the window before);
* ``loss_mask``: 1 where input and target belong to the same document, 0 where the input is a
  document's end and the target the next document's first token (nothing predicts it).

Batches carry ``loss_weights = loss_mask * (tokens in the batch / unmasked tokens in the
batch)`` instead of the mask: the LM head averages ``loss * weight`` over each example's
positions and the trainer averages over examples, which is then exactly the mean loss of the
unmasked tokens. Batches come from a grain ``MapDataset`` (shuffled with a seed, reshuffled each
epoch, repeated), so the iterator's state is one integer that a checkpoint saves and a resumed
run restores bit for bit::

  packed = PackedTokens.of(tokenizer.encode_batch(texts), tokenizer.eod_id, seq_len=128)
  iterator = train_iterator(packed, batch_size=32, seed=0)
  batch = next(iterator)   # inputs, targets, segment_ids, positions: int32; loss_weights: f32
"""

from __future__ import annotations

import dataclasses
import hashlib

import grain
import numpy as np

from tpipe.train import tokenization


@dataclasses.dataclass(frozen=True)
class PackedTokens:
  """Documents joined into one token stream, viewed as fixed-length windows.

  Attributes:
    tokens: int32 ``[n]``, each document followed by the end-of-document token.
    starts: int64 ``[documents]``, the offset of each document's first token (increasing).
    seq_len: the model's sequence length; a window holds ``seq_len + 1`` tokens.
  """

  tokens: np.ndarray
  starts: np.ndarray
  seq_len: int

  @classmethod
  def of(cls, ids: list[list[int]], eod_id: int, *, seq_len: int) -> "PackedTokens":
    """Packs tokenized documents (lists of ids, without the end-of-document token).

    Raises:
      ValueError: fewer than ``seq_len + 1`` tokens in all (not one window).
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
      raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}.")
    tokens, starts = tokenization.as_array(ids, eod_id)
    packed = cls(tokens=tokens, starts=starts, seq_len=seq_len)
    if len(packed) < 1:
      raise ValueError(f"{len(ids)} documents make {len(tokens)} tokens, fewer than "
                       f"seq_len + 1 = {seq_len + 1}: not one training sequence. Give more "
                       "data or a shorter --config.seq_len.")
    return packed

  def __len__(self) -> int:
    return max(0, (len(self.tokens) - 1) // self.seq_len)

  def fingerprint(self) -> str:
    """SHA-256 of the tokens and the document starts (a resumed run checks it)."""
    digest = hashlib.sha256(self.tokens.tobytes())
    digest.update(self.starts.tobytes())
    return digest.hexdigest()

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    """Window ``index`` as ``inputs``, ``targets``, ``segment_ids``, ``positions`` (int32) and
    ``loss_mask`` (float32), each ``[seq_len]``."""
    if not 0 <= index < len(self):
      raise IndexError(f"window {index} out of range [0, {len(self)}).")
    begin = int(index) * self.seq_len
    where = np.arange(begin, begin + self.seq_len + 1)
    document = np.searchsorted(self.starts, where, side="right") - 1
    window = self.tokens[begin:begin + self.seq_len + 1]
    first = np.maximum(self.starts[document], begin)
    return {"inputs": window[:-1].astype(np.int32), "targets": window[1:].astype(np.int32),
            "segment_ids": (document[:-1] - document[0] + 1).astype(np.int32),
            "positions": (where[:-1] - first[:-1]).astype(np.int32),
            "loss_mask": (document[:-1] == document[1:]).astype(np.float32)}


def weighted(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A batch with ``loss_mask`` replaced by ``loss_weights``: the mask scaled so the mean over
  the batch's positions of ``loss * weight`` is the mean loss of its unmasked positions."""
  batch = dict(batch)
  mask = batch.pop("loss_mask")
  batch["loss_weights"] = (mask * (mask.size / max(float(mask.sum()), 1.0))).astype(np.float32)
  return batch


def _batched(data: PackedTokens, batch_size: int, seed: int) -> grain.MapDataset:
  return (grain.MapDataset.source(data).shuffle(seed=seed).repeat()
          .batch(batch_size, drop_remainder=True).map(weighted))


def train_iterator(data: PackedTokens, *, batch_size: int, seed: int) -> grain.DatasetIterator:
  """A checkpointable iterator (``get_state``/``set_state``) of shuffled batches, reshuffled
  each epoch, repeated forever."""
  options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)
  return iter(_batched(data, batch_size, seed).to_iter_dataset(read_options=options))


def eval_batches(data: PackedTokens, *, batch_size: int, num_batches: int,
                 seed: int = 0) -> list[dict[str, np.ndarray]]:
  """A fixed list of batches (the same every call), cycling the windows if there are few."""
  dataset = _batched(data, batch_size, seed)
  return [dataset[i] for i in range(num_batches)]


def in_order(data: PackedTokens, *, batch_size: int) -> list[dict[str, np.ndarray]]:
  """Every window once, in order, in batches of ``batch_size`` (the last padded by repeating
  window 0, its rows marked False in a bool ``mask [batch]``); the batches keep
  ``loss_mask`` (no weights), for exact sums over a whole data set."""
  batches = []
  for begin in range(0, len(data), batch_size):
    rows = [data[i] for i in range(begin, min(begin + batch_size, len(data)))]
    real = len(rows)
    rows += [data[0]] * (batch_size - real)
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    batch["mask"] = np.arange(batch_size) < real
    batches.append(batch)
  return batches
