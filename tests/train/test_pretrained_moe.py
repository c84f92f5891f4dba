"""Hugging Face Mixtral and Qwen2-MoE checkpoints: imported into the logical form
(``block="moe"``; Qwen2-MoE's with its shared expert and its top-k weights not renormalised)
they give ``transformers``' logits from the pipelined forward on a stage 2 x expert 2 x fsdp 2
mesh (the experts split over the expert axis), each family and each of gpipe, 1f1b and zbv in
at least one pair; export round-trips
bit for bit and ``transformers`` loads it, also (Mixtral) from a trainer run started from it
with the experts split; what the block does not model is refused by name. Evaluation and
generation on Mixtral are in ``test_evaluate_generate``, on Qwen2-MoE here."""

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
from tpipe.train import models
from tpipe.train import pretrained
from tpipe.train.cli import evaluate
from tpipe.train.cli import export
from tpipe.train.cli import generate
from tpipe.train.cli import loading
from tpipe.train.cli import trainer

pytest.importorskip("transformers")
BATCH, SEQ = 4, 8
SCHEDULES = {"gpipe": dict(schedule="gpipe"), "1f1b": dict(schedule="1f1b"),
             "zbv": dict(schedule="zbv", num_repeats=2)}
MESH = dict(stages=2, expert=2, fsdp=2)
QWEN = "qwen2_moe_tied"
# What each case's config becomes: the mixture's fields and those that tell the families apart.
EXPECTED = {
    "mixtral": dict(family="mixtral", num_experts=hf_models.EXPERTS,
                    experts_per_token=hf_models.EXPERTS_PER_TOKEN, capacity_factor=0.0,
                    sliding_window=4, mlp_dim=hf_models.MLP, normalize_expert_weights=True,
                    shared_expert_mlp_dim=0, qkv_bias=False, tie_embeddings=False),
    QWEN: dict(family="qwen2_moe", num_experts=hf_models.EXPERTS,
               experts_per_token=hf_models.EXPERTS_PER_TOKEN, capacity_factor=0.0,
               sliding_window=0, mlp_dim=hf_models.QWEN_MOE_MLP,
               normalize_expert_weights=False, shared_expert_mlp_dim=hf_models.QWEN_SHARED_MLP,
               qkv_bias=True, tie_embeddings=True),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf")
  return {name: hf_models.save(name, root / name) for name in EXPECTED}


@pytest.fixture(scope="module")
def checkpoint(checkpoints):
  return checkpoints["mixtral"]


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


# One pass over each axis (families x schedules): Mixtral (a sliding window) under gpipe, Qwen2-MoE
# (a tied head, q/k/v biases, a shared expert) under 1f1b and under zbv, which puts its tied
# embedding and head on one stage. The schedules' pipelines of a MoE LM on an expert axis are
# checked against the model in sequence under every schedule in test_moe.
PAIRS = [("mixtral", "gpipe"), (QWEN, "1f1b"), (QWEN, "zbv")]


def test_the_pairs_cover_both_families_and_every_schedule():
  assert {name for name, _ in PAIRS} == set(EXPECTED)
  assert {schedule for _, schedule in PAIRS} == set(SCHEDULES)


@pytest.mark.parametrize("name, schedule", PAIRS)
def test_imported_logits_equal_transformers_under_a_schedule(checkpoints, name, schedule):
  checkpoint, tokens = checkpoints[name], _tokens()
  # Top-k routing is discontinuous: the tokens' k-th and k+1-th experts are well apart.
  assert hf_models.routing_margin(checkpoint, tokens) > 1e-5
  fields = pretrained.architecture_of(checkpoint)
  assert fields["block"] == "moe"
  assert {k: fields[k] for k in EXPECTED[name]} == EXPECTED[name]
  params = pretrained.load_params(checkpoint, fields)
  moe = params["layers_1"]["moe"]
  assert moe["gate"].shape == (hf_models.LAYERS, hf_models.EXPERTS, hf_models.WIDTH,
                               fields["mlp_dim"])
  shared = fields["shared_expert_mlp_dim"]
  assert sorted(moe) == sorted(["router", "gate", "up", "down"] + (
      ["shared_gate", "shared_up", "shared_down", "shared_router"] if shared else []))
  if shared:
    assert moe["shared_down"].shape == (hf_models.LAYERS, shared, hf_models.WIDTH)
    assert moe["shared_router"].shape == (hf_models.LAYERS, hf_models.WIDTH, 1)
  got = _forward(checkpoint, schedule)(params, tokens)
  numerics.assert_as_close_as_plain(
      got, hf_models.logits(checkpoint, tokens), hf_models.logits(checkpoint, tokens, "float64"),
      what=f"{name} logits under {schedule}")


def _round_trip(checkpoint, tmp_path, architecture: str):
  """Exports an imported checkpoint and checks what every family must give back: the same
  tensors bit for bit, the same fields, transformers' class and logits; then a model from
  scratch (no family) with a trained load-balancing weight exports as the same family. Returns
  ``(fields, params, exported config, fields without the family)``."""
  fields = pretrained.architecture_of(checkpoint)
  params = pretrained.load_params(checkpoint, fields)
  out = pretrained.export(params, fields, tmp_path / "out")
  hf_models.assert_same_tensors(checkpoint, out)
  assert pretrained.architecture_of(out) == fields
  config = json.loads((out / "config.json").read_text())
  assert config["architectures"] == [architecture]
  tokens = _tokens(seed=1)
  np.testing.assert_array_equal(hf_models.logits(out, tokens), hf_models.logits(checkpoint, tokens))
  scratch = {k: v for k, v in fields.items() if k != "family"}
  again = pretrained.export(params, {**scratch, "router_aux_loss_coef": 0.02}, tmp_path / "again")
  assert json.loads((again / "config.json").read_text())["router_aux_loss_coef"] == 0.02
  assert pretrained.architecture_of(again) == fields
  return fields, params, config, scratch


def test_export_round_trips_bit_for_bit_and_transformers_loads_it(checkpoint, tmp_path):
  fields, params, config, _ = _round_trip(checkpoint, tmp_path, "MixtralForCausalLM")
  assert "router_aux_loss_coef" not in config  # Unknown here: transformers' default.
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


def test_qwen2_moe_export_round_trips_bit_for_bit(checkpoints, tmp_path):
  # A model from scratch with a shared expert exports as Qwen2-MoE (in _round_trip).
  _, params, config, scratch = _round_trip(checkpoints[QWEN], tmp_path, "Qwen2MoeForCausalLM")
  assert (config["norm_topk_prob"], config["shared_expert_intermediate_size"],
          config["moe_intermediate_size"]) == (False, hf_models.QWEN_SHARED_MLP,
                                               hf_models.QWEN_MOE_MLP)
  # What neither Hugging Face mixture has is refused, naming the field.
  for change, match in (
      (dict(sliding_window=4), "Qwen2MoeForCausalLM: config.sliding_window=4 \\(export needs 0\\)"),
      (dict(capacity_factor=1.0), "config.capacity_factor=1.0 \\(export needs 0.0\\)"),
      (dict(shared_expert_mlp_dim=0, family="qwen2_moe"),
       "config.shared_expert_mlp_dim=0 \\(export needs a shared expert, >= 1\\)"),
      (dict(family="mixtral"),
       "MixtralForCausalLM: config.qkv_bias=True \\(export needs False\\); config.shared_expert_"
       "mlp_dim=40 \\(export needs 0\\); config.normalize_expert_weights=False \\(export needs "
       "True\\)"),
      (dict(shared_expert_mlp_dim=0, qkv_bias=False),  # No shared expert: Mixtral's routing.
       "MixtralForCausalLM: config.normalize_expert_weights=False \\(export needs True\\)")):
    with pytest.raises(ValueError, match=match):
      pretrained.export(params, {**scratch, **change}, tmp_path / "x")


def test_what_qwen2_moe_does_not_model_is_refused_by_name(checkpoints, tmp_path):
  config = json.loads((checkpoints[QWEN] / "config.json").read_text())
  refused = (
      (dict(decoder_sparse_step=2), "qwen2_moe checkpoint has decoder_sparse_step=2; tpipe "
                                    "supports decoder_sparse_step in \\(1,\\)"),
      (dict(mlp_only_layers=[1]), "mlp_only_layers=\\[1\\] \\(dense layers among the mixtures\\);"
                                  " tpipe supports mlp_only_layers=\\[\\]"),
      (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0; tpipe "
                                                "supports shared_expert_intermediate_size >= 1"),
      (dict(num_experts=0), "num_experts=0; tpipe supports num_experts >= 1"),
      (dict(use_sliding_window=True), "use_sliding_window=True; tpipe supports"),
      (dict(hidden_act="gelu"), "hidden_act='gelu'; tpipe supports"))
  for change, match in refused:
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=match):
      pretrained.architecture_of(tmp_path)
  # What it does model either way: biases on or off, the top-k weights renormalised or not.
  (tmp_path / "config.json").write_text(json.dumps({**config, "qkv_bias": False,
                                                    "norm_topk_prob": True}))
  fields = pretrained.architecture_of(tmp_path)
  assert (fields["qkv_bias"], fields["normalize_expert_weights"]) == (False, True)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
  return hf_models.packed_documents(tmp_path_factory.mktemp("words"))


def test_a_qwen2_moe_perplexity_is_transformers_loss_on_the_same_tokens(checkpoints, packed):
  # The router losses a run would weigh are training's, no part of a perplexity.
  model = loading.load(init_from=str(checkpoints[QWEN]), seq_len=16, router_aux_loss_coef=0.01,
                       router_z_loss_coef=0.001)
  assert model.config.shared_expert_mlp_dim == hf_models.QWEN_SHARED_MLP
  result = evaluate.perplexity(model.config, model.params, packed, batch_size=4, num_stages=2,
                               num_data=1, num_microbatches=2)
  assert result["tokens"] == int(sum(packed[i]["loss_mask"].sum() for i in range(len(packed))))
  numerics.assert_as_close_as_plain(
      np.float32(result["loss"]),
      np.float32(hf_models.document_loss(checkpoints[QWEN], packed)),
      hf_models.document_loss(checkpoints[QWEN], packed, "float64"), what="qwen2_moe loss")


def test_a_qwen2_moe_generates_greedily_as_transformers(checkpoints):
  prompt = np.random.RandomState(5).randint(0, hf_models.VOCAB, (2, 5)).astype(np.int32)
  expected, margin = hf_models.greedy(checkpoints[QWEN], prompt, 12)
  assert margin > 1e-4  # The greedy path and the experts on it are well defined.
  assert hf_models.routing_margin(checkpoints[QWEN],
                                  np.concatenate([prompt, expected], axis=1)) > 1e-5
  model = loading.load(init_from=str(checkpoints[QWEN]))
  got = generate.Generator(model.config, model.params).generate(prompt, 12)
  np.testing.assert_array_equal(got, expected)
