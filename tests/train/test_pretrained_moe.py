"""Hugging Face Mixtral checkpoints: imported into the logical form (``block="moe"``) they give
``transformers``' logits from the pipelined forward under gpipe, 1f1b and zbv on a stage 2 x
expert 2 x fsdp 2 mesh (the experts split over the expert axis); export round-trips bit for bit
and ``transformers`` loads it, also from a trainer run started from it with the experts split;
what the block does not model is refused by name. Evaluation and generation on it are in
``test_evaluate_generate``."""

import functools
import json

import jax
import numpy as np
import pytest

import tpipe
from configs import lm
from tests.helpers import hf_models
from tests.helpers import numerics
from tests.helpers import text_corpus
from tpipe.train import architecture
from tpipe.train import export
from tpipe.train import models
from tpipe.train import pretrained
from tpipe.train import trainer

pytest.importorskip("transformers")
BATCH, SEQ = 4, 8
SCHEDULES = {"gpipe": dict(schedule="gpipe"), "1f1b": dict(schedule="1f1b"),
             "zbv": dict(schedule="zbv", num_repeats=2)}
MESH = dict(stages=2, expert=2, fsdp=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return hf_models.save("mixtral", tmp_path_factory.mktemp("hf") / "mixtral")


def _tokens(seed=0):
  return np.random.RandomState(seed).randint(0, hf_models.VOCAB, (BATCH, SEQ)).astype(np.int32)


@functools.cache
def _forward(directory, schedule):
  config = lm.get_config("size=tiny")
  config.init_from, config.seq_len = str(directory), SEQ
  config.mesh.expert = MESH["expert"]
  # Logits, not a loss: no router losses to add to one.
  config.router_aux_loss_coef = config.router_z_loss_coef = 0.0
  mesh = tpipe.make_mesh(stages=2, expert=config.mesh.expert, fsdp=MESH["fsdp"])
  model = models.decoder_lm(**architecture.lm_arguments(config), num_stages=2,
                            num_microbatches=2, mesh=mesh, **SCHEDULES[schedule])
  return jax.jit(lambda params, tokens: model.apply({"params": params}, tokens))


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_imported_logits_equal_transformers_under_every_schedule(checkpoint, schedule):
  tokens = _tokens()
  # Top-k routing is discontinuous: the tokens' k-th and k+1-th experts are well apart.
  assert hf_models.routing_margin(checkpoint, tokens) > 1e-5
  fields = pretrained.architecture_of(checkpoint)
  assert fields["block"] == "moe" and fields["family"] == "mixtral"
  assert (fields["num_experts"], fields["experts_per_token"], fields["capacity_factor"],
          fields["sliding_window"], fields["mlp_dim"]) == (
              hf_models.EXPERTS, hf_models.EXPERTS_PER_TOKEN, 0.0, 4, hf_models.MLP)
  params = pretrained.load_params(checkpoint, fields)
  assert params["layers_1"]["moe"]["gate"].shape == (
      hf_models.LAYERS, hf_models.EXPERTS, hf_models.WIDTH, hf_models.MLP)
  got = _forward(checkpoint, schedule)(params, tokens)
  numerics.assert_as_close_as_plain(
      got, hf_models.logits(checkpoint, tokens), hf_models.logits(checkpoint, tokens, "float64"),
      what=f"mixtral logits under {schedule}")


def test_export_round_trips_bit_for_bit_and_transformers_loads_it(checkpoint, tmp_path):
  fields = pretrained.architecture_of(checkpoint)
  params = pretrained.load_params(checkpoint, fields)
  out = pretrained.export(params, fields, tmp_path / "out")
  hf_models.assert_same_tensors(checkpoint, out)
  assert pretrained.architecture_of(out) == fields
  config = json.loads((out / "config.json").read_text())
  assert config["architectures"] == ["MixtralForCausalLM"]
  assert "router_aux_loss_coef" not in config  # Unknown here: transformers' default.
  tokens = _tokens(seed=1)
  np.testing.assert_array_equal(hf_models.logits(out, tokens), hf_models.logits(checkpoint, tokens))
  # A trained model's load-balancing weight goes along; a model from scratch exports too.
  scratch = {k: v for k, v in fields.items() if k != "family"}
  out = pretrained.export(params, {**scratch, "router_aux_loss_coef": 0.02}, tmp_path / "again")
  assert json.loads((out / "config.json").read_text())["router_aux_loss_coef"] == 0.02
  assert pretrained.architecture_of(out) == fields
  # Hugging Face's Mixtral is dropless; a dense family has no experts.
  with pytest.raises(ValueError, match="config.capacity_factor=1.0 \\(export needs 0.0\\)"):
    pretrained.export(params, {**fields, "capacity_factor": 1.0}, tmp_path / "x")
  with pytest.raises(ValueError, match="config.block='moe' \\(export needs 'llama'\\)"):
    pretrained.export(params, {**fields, "family": "llama"}, tmp_path / "x")


def test_what_the_block_does_not_model_is_refused_by_name(checkpoint, tmp_path):
  config = json.loads((checkpoint / "config.json").read_text())
  for change, match in ((dict(router_jitter_noise=0.1), "router_jitter_noise=0.1; tpipe"),
                        (dict(hidden_act="gelu"), "hidden_act='gelu'; tpipe supports")):
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=match):
      pretrained.architecture_of(tmp_path)
  # Fewer experts in the config than in the tensors.
  (tmp_path / "config.json").write_text(json.dumps({**config, "num_local_experts": 3}))
  (tmp_path / "model.safetensors").write_bytes((checkpoint / "model.safetensors").read_bytes())
  with pytest.raises(ValueError, match="tensors tpipe does not map: \\['model.layers.0."
                                       "block_sparse_moe.experts.3"):
    pretrained.load_params(tmp_path)


def test_a_trainer_run_from_a_mixtral_with_its_experts_split_exports_it(checkpoint, tmp_path):
  """The trainer's pretrained path: config.init_from a Mixtral on stage 2 x expert 2 x data 2,
  one step (the warm-up's first, at learning rate 0: the weights unchanged), then the run's
  export is the original checkpoint bit for bit, with the run's router_aux_loss_coef."""
  config = lm.get_config("size=tiny")
  config.init_from, config.seq_len = str(checkpoint), SEQ
  config.data = text_corpus.write_jsonl(tmp_path / "docs.jsonl", text_corpus.documents(60))
  config.tokenizer = text_corpus.word_tokenizer(tmp_path / "words")
  config.num_stages, config.num_data, config.num_microbatches = 2, 2, 2
  config.mesh.expert = 2
  config.batch_size, config.num_steps, config.warmup_steps = 8, 1, 1
  config.checkpoint_every, config.eval_every = 1, 100
  config.router_aux_loss_coef = 0.02
  result = trainer.train(config, str(tmp_path / "run"))
  assert result["step"] == 1 and np.isfinite(result["loss"])
  out = export.export_run(str(tmp_path / "run"), str(tmp_path / "out"))
  original = pretrained.read_safetensors(checkpoint / "model.safetensors")
  exported = pretrained.read_safetensors(out / "model.safetensors")
  assert sorted(exported) == sorted(original)
  for key, tensor in original.items():
    np.testing.assert_array_equal(exported[key], tensor, err_msg=key)
  written = json.loads((out / "config.json").read_text())
  assert written["model_type"] == "mixtral" and written["router_aux_loss_coef"] == 0.02
  assert pretrained.architecture_of(out) == pretrained.architecture_of(checkpoint)
