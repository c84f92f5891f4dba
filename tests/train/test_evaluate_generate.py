"""Evaluation and generation against ``transformers``: the perplexity of an imported model on
packed documents is ``transformers``' loss on the same tokens (each document run alone), and
greedy generation with the key/value cache continues a prompt as ``transformers`` does: Llama,
GPT-2 and Mixtral (a mixture of experts, whose router losses are no part of the perplexity)."""

import numpy as np
import pytest

from tests.helpers import hf_models
from tests.helpers import numerics
from tests.helpers import text_corpus
from tpipe.train import evaluate
from tpipe.train import generate
from tpipe.train import loading
from tpipe.train import packing
from tpipe.train import tokenization

pytest.importorskip("transformers")
NEW_TOKENS = 16
NAMES = ("llama", "gpt2_tied", "mixtral")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf")
  return {name: hf_models.save(name, root / name) for name in NAMES}


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
  tokenizer = tokenization.load(text_corpus.word_tokenizer(tmp_path_factory.mktemp("words")))
  assert tokenizer.vocab_size <= hf_models.VOCAB
  ids = tokenizer.encode_batch(text_corpus.documents(12, seed=1))
  return packing.PackedTokens.of(ids, tokenizer.eod_id, seq_len=16)


def _transformers_loss(directory, packed, dtype):
  """Mean cross-entropy of ``transformers`` over the windows' unmasked targets, each document
  piece of a window run by itself (positions from 0, as tpipe's restart per document)."""
  total = count = 0.0
  for i in range(len(packed)):
    window = packed[i]
    for segment in np.unique(window["segment_ids"]):
      where = window["segment_ids"] == segment
      logits = hf_models.logits(directory, window["inputs"][where][None], dtype)[0]
      logits = logits.astype(np.float64)
      top = logits.max(axis=-1)
      log_total = top + np.log(np.exp(logits - top[:, None]).sum(axis=-1))
      picked = logits[np.arange(len(logits)), window["targets"][where]]
      total += float(((log_total - picked) * window["loss_mask"][where]).sum())
      count += float(window["loss_mask"][where].sum())
  return np.float64(total / count)


@pytest.mark.parametrize("name", NAMES)
def test_perplexity_is_transformers_loss_on_the_same_tokens(checkpoints, packed, name):
  # A run's router losses (block="moe") would add to its training loss, not to a perplexity.
  model = loading.load(init_from=str(checkpoints[name]), seq_len=16, router_aux_loss_coef=0.01,
                       router_z_loss_coef=0.001)
  result = evaluate.perplexity(model.config, model.params, packed, batch_size=4, num_stages=2,
                               num_data=1, num_microbatches=2)
  assert result["tokens"] == int(sum(packed[i]["loss_mask"].sum() for i in range(len(packed))))
  assert result["perplexity"] == pytest.approx(np.exp(result["loss"]))
  numerics.assert_as_close_as_plain(
      np.float32(result["loss"]), np.float32(_transformers_loss(checkpoints[name], packed,
                                                                "float32")),
      _transformers_loss(checkpoints[name], packed, "float64"), what=f"{name} loss")


def _transformers_greedy(directory, prompt):
  import torch  # pylint: disable=g-import-not-at-top
  model = hf_models.load(str(directory))
  model.generation_config.eos_token_id = None
  out = model.generate(torch.as_tensor(prompt), max_new_tokens=NEW_TOKENS, do_sample=False,
                       pad_token_id=0)
  return out[:, prompt.shape[1]:].numpy()


def _smallest_margin(directory, prompt, continuation) -> float:
  """The smallest gap, in float64, between the top two logits along the greedy path: greedy
  decoding is only well defined (the same in any float32 arithmetic) where it is not tiny."""
  sequence = np.concatenate([prompt, continuation], axis=1)
  logits = hf_models.logits(directory, sequence, "float64")[:, prompt.shape[1] - 1:-1]
  top_two = np.sort(logits, axis=-1)[..., -2:]
  return float((top_two[..., 1] - top_two[..., 0]).min())


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_equals_transformers(checkpoints, name):
  prompt = np.random.RandomState(5).randint(0, hf_models.VOCAB, (2, 5)).astype(np.int32)
  expected = _transformers_greedy(checkpoints[name], prompt)
  assert _smallest_margin(checkpoints[name], prompt, expected) > 1e-4
  if name in hf_models.MOE_CASES:  # And the experts each token goes to are well defined.
    sequence = np.concatenate([prompt, expected], axis=1)
    assert hf_models.routing_margin(checkpoints[name], sequence) > 1e-5
  model = loading.load(init_from=str(checkpoints[name]))
  generator = generate.Generator(model.config, model.params)
  got = generator.generate(prompt, NEW_TOKENS)
  np.testing.assert_array_equal(got, expected)
  # A temperature near 0 samples the most likely token; at 1 a seed fixes the sample.
  np.testing.assert_array_equal(generator.generate(prompt, NEW_TOKENS, temperature=1e-6), got)
  sampled = generator.generate(prompt, NEW_TOKENS, temperature=1.0, seed=3)
  np.testing.assert_array_equal(sampled, generator.generate(prompt, NEW_TOKENS,
                                                            temperature=1.0, seed=3))
  assert sampled.shape == got.shape and (sampled < hf_models.VOCAB).all()
  assert not np.array_equal(sampled, got)
  with pytest.raises(ValueError, match="exceed the model's 32 positions"):
    generator.generate(prompt, 30)
