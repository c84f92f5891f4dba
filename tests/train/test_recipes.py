"""The fine-tuning recipe's CPU variant (docs/guide/finetune.md) runs as written: a tiny
Llama-family checkpoint and a tokenizer.json made locally, then the trainer (from the JSONL,
starting from the checkpoint), evaluate, generate and export, as a user types them."""

import json
import pathlib
import re
import subprocess

import numpy as np
import pytest

from tests.helpers import train_runs
from tpipe.train import pretrained
from tpipe.train.cli import metrics

RECIPE = train_runs.REPO / "docs" / "guide" / "finetune.md"
ROOT = "/tmp/tpipe-recipe"

pytest.importorskip("transformers")


def _blocks(language: str) -> list[str]:
  """The recipe's code blocks marked ``<!-- recipe: cpu -->`` in ``language``."""
  return re.findall(rf"<!-- recipe: cpu -->\n```{language}\n(.*?)^```", RECIPE.read_text(),
                    flags=re.S | re.M)


@pytest.mark.slow
def test_cpu_recipe_fine_tunes_evaluates_generates_and_exports(tmp_path):
  setup, = _blocks("python")
  commands, = _blocks("bash")
  code = compile(setup.replace(ROOT, str(tmp_path)), str(RECIPE), "exec")
  exec(code, {})  # pylint: disable=exec-used
  proc = subprocess.run(["bash", "-euo", "pipefail", "-c", commands.replace(ROOT, str(tmp_path))],
                        cwd=train_runs.REPO, env=train_runs.env(), capture_output=True, text=True,
                        timeout=train_runs.TIMEOUT)
  assert proc.returncode == 0, proc.stderr[-4000:]
  run = tmp_path / "run"
  assert f"Initialised the parameters from {tmp_path}/model (llama)" in proc.stderr
  losses = [r["loss"] for r in metrics.read_metrics(run)]
  assert len(losses) == 20 and losses[-1] < losses[0] - 0.5, losses
  lines = proc.stdout.splitlines()
  evaluated = json.loads(next(line for line in lines if line.startswith("{")))
  assert evaluated["tokens"] > 1000
  assert np.isclose(evaluated["perplexity"], np.exp(evaluated["loss"]))
  assert evaluated["loss"] < losses[0]
  assert any(line.startswith("def ") for line in lines)  # The generated continuation.
  exported = tmp_path / "exported"
  written = sorted(p.name for p in exported.iterdir())
  assert written == ["config.json", "model.safetensors", "tokenizer.json"]
  fields = pretrained.architecture_of(exported)
  assert fields["family"] == "llama" and fields["tie_embeddings"]
  np.testing.assert_array_equal(
      pretrained.load_params(exported, fields)["layers_1"]["query"],
      pretrained.load_params(run)["layers_1"]["query"])
  import transformers  # pylint: disable=g-import-not-at-top
  assert transformers.AutoModelForCausalLM.from_pretrained(exported).config.num_hidden_layers == 4
  assert pathlib.Path(exported / "tokenizer.json").read_text() == (
      tmp_path / "model" / "tokenizer.json").read_text()
