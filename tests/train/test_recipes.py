"""The fine-tuning recipe's CPU variant (docs/guide/finetune.md) runs as written: a tiny
Llama-family checkpoint and a tokenizer.json made locally, then the trainer (from the JSONL,
starting from the checkpoint), evaluate, generate and export, as a user types them.

Each command of the recipe's shell block is ``python -m PROGRAM FLAGS...`` (checked); it runs in
this process on its flags as the shell splits them (``train_runs.run_cli`` for the trainer,
``train_runs.run_program`` for the others): what is tested is the commands, not the process.
"""

import json
import pathlib
import re
import shlex

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
  outputs = []
  typed = commands.replace(ROOT, str(tmp_path)).replace("\\\n", " ").splitlines()
  for line in filter(str.strip, typed):
    python, dash_m, program, *argv = shlex.split(line)
    assert (python, dash_m) == ("python", "-m"), line
    proc = (train_runs.run_cli(*argv) if program == "tpipe.train"
            else train_runs.run_program(program, *argv))
    assert proc.returncode == 0, (line, proc.stderr[-4000:])
    outputs.append(proc)
  assert [proc.args[0] for proc in outputs] == [
      "tpipe.train", "tpipe.train.cli.evaluate", "tpipe.train.cli.generate",
      "tpipe.train.cli.export"]
  run = tmp_path / "run"
  assert f"Initialised the parameters from {tmp_path}/model (llama)" in outputs[0].stderr
  losses = [r["loss"] for r in metrics.read_metrics(run)]
  assert len(losses) == 20 and losses[-1] < losses[0] - 0.5, losses
  lines = "".join(proc.stdout for proc in outputs).splitlines()
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
