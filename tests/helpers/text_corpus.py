"""Small local text corpora and tokenizers for the data tests: documents made from a fixed word
list, written as text files, JSONL, Parquet or ArrayRecord, and a BPE ``tokenizer.json`` or a
SentencePiece model trained on them in milliseconds (nothing downloaded)."""

from __future__ import annotations

import json
import pathlib

import numpy as np

WORDS = ("the pipeline splits layers into stages and each stage runs its micro batches in turn "
         "while gradients flow back through the schedule tokens pack into sequences documents "
         "end with a special token and attention stays inside each document").split()
EOD = "<|endoftext|>"


def documents(count: int = 40, seed: int = 0) -> list[str]:
  """``count`` documents of 3 to 60 words drawn from :data:`WORDS` (deterministic)."""
  rng = np.random.RandomState(seed)
  return [" ".join(rng.choice(WORDS, size=rng.randint(3, 61))) for _ in range(count)]


def write_text_files(directory: pathlib.Path, texts: list[str]) -> str:
  """One ``doc_NNN.txt`` per document; returns the glob."""
  directory.mkdir(parents=True, exist_ok=True)
  for i, text in enumerate(texts):
    (directory / f"doc_{i:03d}.txt").write_text(text)
  return str(directory / "*.txt")


def write_jsonl(path: pathlib.Path, texts: list[str], field: str = "text") -> str:
  """One JSON object per document, the text under ``field`` beside an ``id``."""
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts)))
  return str(path)


def write_parquet(path: pathlib.Path, texts: list[str], field: str = "text") -> str:
  """A Parquet table with columns ``id`` and ``field``."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  path.parent.mkdir(parents=True, exist_ok=True)
  pq.write_table(pa.table({"id": list(range(len(texts))), field: texts}), path)
  return str(path)


def bpe_tokenizer(directory: pathlib.Path, vocab_size: int = 300,
                  texts: list[str] | None = None) -> str:
  """Trains a byte-level BPE on ``texts`` (default :func:`documents`) with ``<|endoftext|>``
  as its one special token and saves ``directory/tokenizer.json``; returns its path."""
  # pylint: disable=g-import-not-at-top
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  path = directory / "tokenizer.json"
  if path.exists():
    return str(path)
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(texts or documents(), trainer)
  tokenizer.save(str(path))
  return str(path)


def sentencepiece_model(directory: pathlib.Path, vocab_size: int = 100) -> str:
  """Trains a SentencePiece BPE on :func:`documents`; returns ``directory/sp.model``."""
  import io  # pylint: disable=g-import-not-at-top
  import sentencepiece  # pylint: disable=g-import-not-at-top
  path = directory / "sp.model"
  directory.mkdir(parents=True, exist_ok=True)
  model = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(documents()), model_writer=model, vocab_size=vocab_size,
      model_type="bpe", minloglevel=2)
  path.write_bytes(model.getvalue())
  return str(path)


def word_tokenizer(directory: pathlib.Path) -> str:
  """A word-level ``tokenizer.json`` over :data:`WORDS` (about 45 ids, so it fits the tiny
  Hugging Face models of :mod:`tests.helpers.hf_models`), ``<|endoftext|>`` its id 0."""
  # pylint: disable=g-import-not-at-top
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  path = directory / "tokenizer.json"
  if not path.exists():
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {EOD: 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(sorted(set(WORDS)))}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # Joins words with spaces.
    tokenizer.save(str(path))
  return str(path)
