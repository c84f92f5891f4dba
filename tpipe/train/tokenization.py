"""Tokenizers the trainer reads text with: bytes, a Hugging Face ``tokenizer.json``, or a
SentencePiece model. Nothing is downloaded: a tokenizer is a local path.

``config.tokenizer`` picks one (:func:`load`):

* ``"bytes"``: the 256 byte values of the UTF-8 text (today's byte-level LM); the end of a
  document is byte 0 (NUL), which text does not contain.
* a path ending in ``.json``: a Hugging Face ``tokenizers`` file (``tokenizer.json``), encoded
  with its special tokens (a Llama tokenizer's post-processor adds ``<s>``). The
  end-of-document token is ``eod_token`` if given, else the ``eos_token`` of a
  ``tokenizer_config.json`` beside the file, else the first of :data:`EOD_CANDIDATES` the
  vocabulary has.
* a path ending in ``.model``: a SentencePiece model; documents start with its ``<s>`` (when it
  has one) and end with its ``</s>`` (or ``eod_token``).

The vocabulary size comes from the tokenizer (:attr:`Tokenizer.vocab_size`)::

  tokenizer = load("data/tokenizer.json")
  ids = tokenizer.encode_batch(["first document", "second"])   # lists of ints
  tokenizer.decode(ids[0])                                      # "first document"
"""

from __future__ import annotations

import abc
import functools
import hashlib
import json
import pathlib

import numpy as np

BYTES = "bytes"
# End-of-document tokens tried, in order, when neither eod_token nor tokenizer_config.json
# names one.
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")


class Tokenizer(abc.ABC):
  """Text to token ids and back.

  Attributes:
    vocab_size: the number of token ids (the model's vocabulary is at least this).
    eod_id: the id that ends each document when documents are joined.
    fingerprint: a SHA-256 of what defines the tokenizer (a resumed run checks it).
  """

  vocab_size: int
  eod_id: int
  fingerprint: str

  @abc.abstractmethod
  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    """Each text's token ids (without the end-of-document token)."""

  @abc.abstractmethod
  def decode(self, ids) -> str:
    """The text of ``ids``."""


class ByteTokenizer(Tokenizer):
  """The UTF-8 bytes of the text; document ends are byte 0."""

  vocab_size = 256
  eod_id = 0
  fingerprint = BYTES

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    return [list(text.encode("utf-8")) for text in texts]

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def _file_hash(path: pathlib.Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()


class HuggingFaceTokenizer(Tokenizer):
  """A ``tokenizers`` file (``tokenizer.json``)."""

  def __init__(self, path: pathlib.Path, eod_token: str = ""):
    import tokenizers  # pylint: disable=g-import-not-at-top  # The train extra.
    self._tokenizer = tokenizers.Tokenizer.from_file(str(path))
    self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
    self.fingerprint = _file_hash(path)
    name = eod_token or _configured_eos(path.parent)
    candidates = (name,) if name else EOD_CANDIDATES
    for candidate in candidates:
      found = self._tokenizer.token_to_id(candidate)
      if found is not None:
        self.eod_id = int(found)
        break
    else:
      where = (f"eod_token={name!r} is not in its vocabulary" if name else
               f"it has none of {EOD_CANDIDATES} and no tokenizer_config.json beside it names "
               "an eos_token")
      raise ValueError(f"tokenizer {path}: {where}; set --config.eod_token to the token that "
                       "ends a document.")

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    return [encoding.ids for encoding in
            self._tokenizer.encode_batch(texts, add_special_tokens=True)]

  def decode(self, ids) -> str:
    return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def _configured_eos(directory: pathlib.Path) -> str:
  """The ``eos_token`` of ``directory/tokenizer_config.json`` ("" without one)."""
  config = directory / "tokenizer_config.json"
  if not config.exists():
    return ""
  eos = json.loads(config.read_text()).get("eos_token") or ""
  return eos.get("content", "") if isinstance(eos, dict) else str(eos)


class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece model (``.model``): ``<s>`` first (when it has one), ``</s>`` last."""

  def __init__(self, path: pathlib.Path, eod_token: str = ""):
    import sentencepiece  # pylint: disable=g-import-not-at-top  # The train extra.
    self._processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
    self.vocab_size = int(self._processor.get_piece_size())
    self.fingerprint = _file_hash(path)
    eod = self._processor.piece_to_id(eod_token) if eod_token else self._processor.eos_id()
    if eod < 0 or (eod_token and eod == self._processor.unk_id()):
      raise ValueError(f"tokenizer {path}: it has no end-of-sentence token "
                       f"{eod_token or '</s>'}; set --config.eod_token to one of its pieces.")
    self.eod_id = int(eod)
    self._bos = int(self._processor.bos_id())

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    ids = self._processor.encode(list(texts))
    return [([self._bos] if self._bos >= 0 else []) + list(row) for row in ids]

  def decode(self, ids) -> str:
    return self._processor.decode([int(i) for i in ids])


@functools.cache
def load(name: str, eod_token: str = "") -> Tokenizer:
  """The tokenizer ``config.tokenizer`` names (loaded once per process).

  Args:
    name: ``"bytes"``, a ``tokenizer.json`` path, or a SentencePiece ``.model`` path.
    eod_token: the token that ends a document ("" for the tokenizer's own, see the module
      docstring).

  Returns:
    A :class:`Tokenizer`.

  Raises:
    ValueError: a missing file, an unknown kind, or no end-of-document token.
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f"config.tokenizer must be 'bytes' or a path to a tokenizer.json or a "
                     f"SentencePiece .model file, got {name!r}.")
  if name == BYTES:
    if eod_token:
      raise ValueError(f"config.eod_token={eod_token!r}: the bytes tokenizer ends documents "
                       "with byte 0; leave eod_token empty.")
    return ByteTokenizer()
  path = pathlib.Path(name).expanduser()
  if not path.is_file():
    raise ValueError(f"config.tokenizer={name!r}: no such file. Give 'bytes', a tokenizer.json "
                     "or a SentencePiece .model (a local path; nothing is downloaded).")
  if path.suffix == ".json":
    return HuggingFaceTokenizer(path, eod_token)
  if path.suffix == ".model":
    return SentencePieceTokenizer(path, eod_token)
  raise ValueError(f"config.tokenizer={name!r}: expected a .json (Hugging Face tokenizers) or "
                   "a .model (SentencePiece) file, or 'bytes'.")


def as_array(ids: list[list[int]], eod_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Documents' ids joined, each followed by ``eod_id``: ``(tokens int32 [n], starts int64
  [documents])``, ``starts[d]`` the offset of document ``d``'s first token."""
  lengths = np.fromiter((len(row) + 1 for row in ids), np.int64, len(ids))
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
  tokens = np.full(int(lengths.sum()), eod_id, np.int32)
  for start, row in zip(starts, ids):
    tokens[start:start + len(row)] = row
  return tokens, starts
