"""Evaluation and generation against ``transformers``: the perplexity of an imported model on
packed documents is ``transformers``' loss on the same tokens (each document run alone), and
greedy generation with the key/value cache continues a prompt as ``transformers`` does: Llama,
GPT-2 and Mixtral (a mixture of experts, whose router losses are no part of the perplexity)."""

import numpy as np
import pytest

from tests.helpers import hf_models
from tests.helpers import numerics
from tpipe.train.cli import evaluate
from tpipe.train.cli import generate
from tpipe.train.cli import loading

pytest.importorskip("transformers")
NEW_TOKENS = 16
NAMES = ("llama", "gpt2_tied", "mixtral")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf")
  return {name: hf_models.save(name, root / name) for name in NAMES}


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
  return hf_models.packed_documents(tmp_path_factory.mktemp("words"))


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
      np.float32(result["loss"]), np.float32(hf_models.document_loss(checkpoints[name], packed)),
      hf_models.document_loss(checkpoints[name], packed, "float64"), what=f"{name} loss")


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_equals_transformers(checkpoints, name):
  prompt = np.random.RandomState(5).randint(0, hf_models.VOCAB, (2, 5)).astype(np.int32)
  expected, margin = hf_models.greedy(checkpoints[name], prompt, NEW_TOKENS)
  assert margin > 1e-4
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
