"""Hugging Face checkpoints: Llama, Mistral, Qwen2 and GPT-2 (tied and untied) imported into the
logical form give ``transformers``' logits from the pipelined forward on a stage 2 x fsdp 2 x
tensor 2 mesh, each architecture under one of gpipe, 1f1b and zbv and each schedule with at
least one architecture (tied and untied); export round-trips bit for bit and ``transformers``
loads it."""

import functools
import json

import jax
import numpy as np
import pytest

import tpipe
from configs import lm
from tests.helpers import hf_models
from tests.helpers import numerics
from tpipe.train import architecture
from tpipe.train import models
from tpipe.train import pretrained

pytest.importorskip("transformers")
BATCH, SEQ = 4, 8
# Cases with the same architecture (tied or not) share one compiled program: the case's.
PROGRAMS = {"llama": "llama", "llama_tied": "llama", "mistral": "mistral",
            "qwen2_tied": "qwen2", "qwen2": "qwen2", "gpt2_tied": "gpt2", "gpt2": "gpt2"}
SCHEDULES = {"gpipe": dict(schedule="gpipe"), "1f1b": dict(schedule="1f1b"),
             "zbv": dict(schedule="zbv", num_repeats=2)}
# One pass over each axis (architectures x schedules, pairs checked below): what an architecture
# adds (rotary or learned positions, a sliding window, q/k/v biases, a tied head) lives inside its
# layers, which every schedule runs alike; each schedule's pipeline is checked against the layers
# in sequence under every schedule by tests/core and tests/linen. zbv puts the embedding and the
# head on the same stage, gpipe and 1f1b on the first and last: each runs a tied and an untied
# head.
SCHEDULE_OF = {"llama": "zbv", "mistral": "zbv", "qwen2": "1f1b", "gpt2": "gpipe"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf")
  return {name: hf_models.save(name, root / name) for name in hf_models.CASES}


def _tokens(seed=0):
  return np.random.RandomState(seed).randint(0, hf_models.VOCAB, (BATCH, SEQ)).astype(np.int32)


def lm_config(directory):
  """The LM config that starts from ``directory``."""
  config = lm.get_config("size=tiny")
  config.init_from, config.seq_len = str(directory), SEQ
  return config


@functools.cache
def _forward(directory, schedule):
  mesh = tpipe.make_mesh(stages=2, fsdp=2, tensor=2)
  model = models.decoder_lm(**architecture.lm_arguments(lm_config(directory)), num_stages=2,
                            num_microbatches=2, mesh=mesh, **SCHEDULES[schedule])
  return jax.jit(lambda params, tokens: model.apply({"params": params}, tokens))


def test_the_pairs_cover_every_architecture_and_schedule_tied_and_untied():
  assert set(SCHEDULE_OF) == set(PROGRAMS.values()) and set(SCHEDULE_OF.values()) == set(SCHEDULES)
  tied = {(SCHEDULE_OF[PROGRAMS[name]], hf_models.CASES[name][1]) for name in PROGRAMS}
  assert tied == {(schedule, t) for schedule in SCHEDULES for t in (True, False)}
  assert set(PROGRAMS) == set(hf_models.CASES)


@pytest.mark.parametrize("program", sorted(SCHEDULE_OF))
def test_imported_logits_equal_transformers_under_a_schedule(checkpoints, program):
  schedule = SCHEDULE_OF[program]
  tokens = _tokens()
  cases = {name: directory for name, directory in checkpoints.items()
           if PROGRAMS[name] == program}
  assert cases
  for name, directory in cases.items():
    fields = pretrained.architecture_of(directory)
    assert fields["family"] == hf_models.CASES[name][0]
    assert fields["tie_embeddings"] == hf_models.CASES[name][1]
    params = pretrained.load_params(directory, fields)
    got = _forward(checkpoints[PROGRAMS[name]], schedule)(params, tokens)
    numerics.assert_as_close_as_plain(
        got, hf_models.logits(directory, tokens), hf_models.logits(directory, tokens, "float64"),
        what=f"{name} logits under {schedule}")


@pytest.mark.parametrize("name", sorted(hf_models.CASES))
def test_export_round_trips_bit_for_bit_and_transformers_loads_it(checkpoints, name, tmp_path):
  directory = checkpoints[name]
  fields = pretrained.architecture_of(directory)
  params = pretrained.load_params(directory, fields)
  out = pretrained.export(params, fields, tmp_path / "out")
  hf_models.assert_same_tensors(directory, out)
  assert pretrained.architecture_of(out) == fields
  tokens = _tokens(seed=1)
  np.testing.assert_array_equal(hf_models.logits(out, tokens), hf_models.logits(directory, tokens))
  # Nothing is overwritten.
  with pytest.raises(ValueError, match="is not empty"):
    pretrained.export(params, fields, out)


def test_bad_checkpoints_are_clear_errors(checkpoints, tmp_path):
  with pytest.raises(ValueError, match="has no config.json"):
    pretrained.architecture_of(tmp_path)
  config = json.loads((checkpoints["llama"] / "config.json").read_text())
  for change, match in ((dict(model_type="bert"), "model_type='bert'; tpipe imports"),
                        (dict(hidden_act="gelu"), "hidden_act='gelu'; tpipe supports")):
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=match):
      pretrained.architecture_of(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="no \\*.safetensors file"):
    pretrained.load_params(tmp_path)
  # A config that does not describe the tensors.
  (tmp_path / "model.safetensors").write_bytes(
      (checkpoints["llama"] / "model.safetensors").read_bytes())
  (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
  with pytest.raises(ValueError, match="tensors tpipe does not map: \\['model.layers.1"):
    pretrained.load_params(tmp_path)
  # A model trained from scratch with a LayerNorm head and a bias fits no family.
  fields = architecture.DEFAULTS | dict(num_layers=1, width=8, num_heads=2, mlp_dim=8,
                                        vocab_size=16, block="llama")
  with pytest.raises(ValueError, match="config.head_bias=True \\(export needs False\\)"):
    pretrained.export({}, fields, tmp_path / "x")


def test_bfloat16_export_and_import_are_exact(checkpoints, tmp_path):
  directory = checkpoints["qwen2_tied"]
  fields = pretrained.architecture_of(directory)
  params = pretrained.load_params(directory, fields)
  out = pretrained.export(params, fields, tmp_path / "bf16", dtype="bfloat16")
  assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
  exported = pretrained.read_safetensors(out / "model.safetensors")
  assert {str(t.dtype) for t in exported.values()} == {"bfloat16"}
  # Importing widens bfloat16 exactly: the float32 values are the bfloat16 ones.
  again = pretrained.load_params(out)
  rounded = jax.tree.map(lambda a: np.asarray(a).astype(jax.numpy.bfloat16).astype(np.float32),
                         params)
  jax.tree.map(np.testing.assert_array_equal, again, rounded)
