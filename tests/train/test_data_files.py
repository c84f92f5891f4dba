"""Data from files: sources (text, JSONL, Parquet, ArrayRecord), tokenizers (a trained BPE, a
SentencePiece model, bytes), packing with document boundaries, and a resumable iterator."""

import json

import numpy as np
import pytest

from tests.helpers import text_corpus
from tpipe.train import document_packing
from tpipe.train import sources
from tpipe.train import tokenization
from tpipe.train.cli import write_corpus

pytestmark = pytest.mark.unit  # No JAX computation.

TEXTS = text_corpus.documents()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """The same documents in every format, and a BPE tokenizer trained on them."""
  root = tmp_path_factory.mktemp("corpus")
  paths = {"text": text_corpus.write_text_files(root / "txt", TEXTS),
           "jsonl": text_corpus.write_jsonl(root / "docs.jsonl", TEXTS, field="body"),
           "parquet": text_corpus.write_parquet(root / "docs.parquet", TEXTS, field="body")}
  write_corpus.write(TEXTS, root / "docs.arrayrecord")
  paths["arrayrecord"] = str(root / "docs.arrayrecord")
  return paths, text_corpus.bpe_tokenizer(root / "bpe")


@pytest.mark.parametrize("kind", sources.FORMATS)
def test_every_format_reads_the_same_documents_in_order(corpus, kind):
  paths, _ = corpus
  files = sources.expand(paths[kind])
  assert {sources.format_of(f) for f in files} == {kind}
  documents = sources.read(files, text_field="body")
  assert [d.text for d in documents] == TEXTS
  if kind != "text":  # One file: documents named by their index in it.
    assert [d.index for d in documents] == list(range(len(TEXTS)))


def test_globs_join_by_commas_sorted_and_the_format_can_be_forced(corpus, tmp_path):
  paths, _ = corpus
  both = sources.expand(f"{paths['parquet']},{paths['jsonl']},{paths['jsonl']}")
  assert [f.suffix for f in both] == [".jsonl", ".parquet"]  # Sorted, no duplicates.
  renamed = tmp_path / "docs.data"
  renamed.write_text(open(paths["jsonl"]).read())
  assert [d.text for d in sources.read([renamed], "jsonl", "body")] == TEXTS


@pytest.mark.parametrize("make, match", [
    (lambda p: sources.expand(str(p / "none*.jsonl")), "matches no file"),
    (lambda p: sources.format_of(p, "csv"), "data_format='csv' is not one of"),
    (lambda p: sources.read([p / "bad.jsonl"], text_field="text"), r"bad.jsonl:2 has no text "
     r"field 'text' \(it has \['body'\]\); set --config.text_field"),
    (lambda p: sources.read([p / "broken.jsonl"]), r"broken.jsonl:1 is not JSON"),
    (lambda p: sources.split(sources.read([p / "good.jsonl"]), 0.01),
     "leaves the eval split empty"),
])
def test_bad_data_is_a_clear_error(tmp_path, make, match):
  (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
  (tmp_path / "broken.jsonl").write_text("{not json\n")
  (tmp_path / "good.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
  with pytest.raises(ValueError, match=match):
    make(tmp_path)


def test_split_by_fraction_is_stable_and_disjoint(corpus):
  paths, _ = corpus
  documents = sources.read(sources.expand(paths["jsonl"]), text_field="body")
  train, held_out = sources.split(documents, 0.25)
  assert len(train) + len(held_out) == len(documents) and held_out
  assert {d.index for d in train}.isdisjoint({d.index for d in held_out})
  # A document's side depends on its file name and index only, not on the other documents.
  again = sources.split(documents[:len(documents) // 2], 0.25)[1] if len(held_out) > 1 else []
  assert {d.index for d in again} <= {d.index for d in held_out}


def test_bpe_tokenizer_json(corpus, tmp_path):
  _, path = corpus
  tokenizer = tokenization.load(path)
  assert tokenizer.vocab_size == 300  # 256 bytes, <|endoftext|> and 43 merges.
  assert tokenizer.eod_id == 0  # <|endoftext|>, the first special token.
  ids = tokenizer.encode_batch(TEXTS[:2])
  assert tokenizer.decode(ids[0]) == TEXTS[0]
  assert len(ids[0]) < len(TEXTS[0].encode())  # Merges happened.
  # An eos_token named by tokenizer_config.json beside it; eod_token names one explicitly.
  other = tmp_path / "tok"
  other.mkdir()
  (other / "tokenizer.json").write_text(open(path).read())
  vocab = json.loads(open(path).read())["model"]["vocab"]
  merged = sorted(token for token in vocab if len(token) > 2 and token.isalpha())[:2]
  (other / "tokenizer_config.json").write_text(json.dumps({"eos_token": merged[0]}))
  assert tokenization.load(str(other / "tokenizer.json")).eod_id == vocab[merged[0]]
  assert tokenization.load(path, merged[1]).eod_id == vocab[merged[1]]
  with pytest.raises(ValueError, match="eod_token='<missing>' is not in its vocabulary"):
    tokenization.load(path, "<missing>")


def test_sentencepiece_and_bytes_tokenizers(tmp_path):
  sp = tokenization.load(text_corpus.sentencepiece_model(tmp_path))
  assert sp.vocab_size == 100 and sp.eod_id == 2
  ids = sp.encode_batch([TEXTS[0]])[0]
  assert ids[0] == 1 and sp.decode(ids[1:]) == TEXTS[0]  # <s> first.
  raw = tokenization.load("bytes")
  assert raw.vocab_size == 256 and raw.eod_id == 0
  assert raw.encode_batch(["hé"]) == [[104, 195, 169]] and raw.decode([104, 195, 169]) == "hé"


@pytest.mark.parametrize("name, match", [
    ("missing.json", "no such file"), ("", "must be 'bytes' or a path"),
])
def test_bad_tokenizer_is_a_clear_error(name, match):
  with pytest.raises(ValueError, match=match):
    tokenization.load(name)


def test_packing_keeps_documents_apart():
  # Documents of 3, 1 and 5 tokens, each followed by EOD (9): a b c | d | e f g h i.
  packed = document_packing.PackedTokens.of([[1, 2, 3], [4], [5, 6, 7, 8, 10]], 9, seq_len=4)
  np.testing.assert_array_equal(packed.tokens, [1, 2, 3, 9, 4, 9, 5, 6, 7, 8, 10, 9])
  assert len(packed) == 2  # (12 - 1) // 4 windows of 5 tokens with stride 4.
  first, second = packed[0], packed[1]
  np.testing.assert_array_equal(first["inputs"], [1, 2, 3, 9])
  np.testing.assert_array_equal(first["targets"], [2, 3, 9, 4])
  np.testing.assert_array_equal(first["segment_ids"], [1, 1, 1, 1])  # EOD ends document 1.
  np.testing.assert_array_equal(first["positions"], [0, 1, 2, 3])
  np.testing.assert_array_equal(first["loss_mask"], [1, 1, 1, 0])  # Nothing predicts "d".
  np.testing.assert_array_equal(second["inputs"], [4, 9, 5, 6])
  np.testing.assert_array_equal(second["segment_ids"], [1, 1, 2, 2])
  np.testing.assert_array_equal(second["positions"], [0, 1, 0, 1])
  np.testing.assert_array_equal(second["loss_mask"], [1, 0, 1, 1])


def test_loss_weights_average_over_the_unmasked_tokens():
  batch = {"loss_mask": np.array([[1, 1, 1, 0], [1, 0, 1, 1]], np.float32)}
  weights = document_packing.weighted(batch)["loss_weights"]
  losses = np.arange(8, dtype=np.float32).reshape(2, 4)
  # The head's per-example mean of loss * weight, then the trainer's mean over examples.
  mean = (losses * weights).mean(axis=-1).mean()
  np.testing.assert_allclose(mean, losses[batch["loss_mask"] > 0].mean(), rtol=1e-6)


def test_iterator_resumes_mid_epoch_bit_exactly(corpus):
  _, path = corpus
  tokenizer = tokenization.load(path)
  packed = document_packing.PackedTokens.of(tokenizer.encode_batch(TEXTS), tokenizer.eod_id,
                                            seq_len=16)
  batches_per_epoch = len(packed) // 4
  assert batches_per_epoch >= 3
  stop = batches_per_epoch + 1  # Past the first epoch, in the middle of the second.
  reference = document_packing.train_iterator(packed, batch_size=4, seed=3)
  expected = [next(reference) for _ in range(stop + 3)]
  first = document_packing.train_iterator(packed, batch_size=4, seed=3)
  for _ in range(stop):
    next(first)
  state = json.loads(json.dumps(first.get_state()))  # As a checkpoint stores it.
  resumed = document_packing.train_iterator(packed, batch_size=4, seed=3)
  resumed.set_state(state)
  for want in expected[stop:]:
    got = next(resumed)
    assert sorted(got) == ["inputs", "loss_weights", "positions", "segment_ids", "targets"]
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])
  # The epochs are shuffled differently.
  assert not np.array_equal(expected[0]["inputs"], expected[batches_per_epoch]["inputs"])
  for it in (reference, first, resumed):
    it.close()


def test_in_order_batches_cover_every_window_once():
  packed = document_packing.PackedTokens.of([list(range(1, 30))], 0, seq_len=4)
  batches = document_packing.in_order(packed, batch_size=3)
  assert len(packed) == 7 and len(batches) == 3
  assert [int(b["mask"].sum()) for b in batches] == [3, 3, 1]
  np.testing.assert_array_equal(batches[2]["inputs"][0], packed[6]["inputs"])


def test_too_little_data_is_a_clear_error():
  with pytest.raises(ValueError, match="not one training sequence"):
    document_packing.PackedTokens.of([[1, 2]], 0, seq_len=8)


def test_write_corpus_refuses_to_overwrite(tmp_path):
  write_corpus.write(["a"], tmp_path / "c.arrayrecord")
  with pytest.raises(ValueError, match="exists"):
    write_corpus.write(["b"], tmp_path / "c.arrayrecord")
  assert [d.text for d in sources.read([tmp_path / "c.arrayrecord"])] == ["a"]
