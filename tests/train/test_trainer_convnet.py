"""End to end: ``python -m tpipe.train --config=configs/convnet.py`` (the tiny size).

The pipelined convnet with BatchNorm trains on the digits, reports eval accuracy, saves its
BatchNorm statistics with the checkpoint (in the logical layout), and a run resumed from a
checkpoint continues with the losses of the uninterrupted run.
"""

import json
import math
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.test_train import REPO, _check_ok, _env, _locked, _losses
from tpipe.train import checkpointing
from tpipe.train import experiment
from tpipe.train import metrics

NUM_STEPS = 20
TINY = [f"--config={REPO / 'configs' / 'convnet.py'}:size=tiny",
        f"--config.num_steps={NUM_STEPS}", "--config.log_every=1", "--config.eval_every=10",
        "--config.checkpoint_every=10"]


def _train(workdir, *overrides):
  return subprocess.run([sys.executable, "-m", "tpipe.train", f"--workdir={workdir}", *TINY,
                         *overrides], env=_env(), cwd=REPO, capture_output=True, text=True,
                        timeout=600, check=False)


@pytest.fixture(scope="session")
def convnet_run(tmp_path_factory):
  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent
  workdir = base / "convnet_reference"
  with _locked(base / "convnet_reference.lock"):
    if not (workdir / "DONE").exists():
      proc = _train(workdir)
      _check_ok(proc)
      (workdir / "stderr.txt").write_text(proc.stderr)
      (workdir / "DONE").write_text("ok")
  return workdir


@pytest.mark.slow
def test_convnet_trains_and_reports_accuracy(convnet_run):
  records = metrics.read_metrics(convnet_run)
  assert [r["step"] for r in records] == list(range(1, NUM_STEPS + 1))
  assert all(math.isfinite(r["loss"]) for r in records)
  accuracies = [r["eval_accuracy"] for r in records if "eval_accuracy" in r]
  assert len(accuracies) == 2 and all(0.0 <= a <= 1.0 for a in accuracies)
  # 20 tiny steps already beat chance (10%) on the 360 test digits.
  assert accuracies[-1] > 0.15, accuracies
  log = (convnet_run / "stderr.txt").read_text()
  assert "eval_accuracy" in log and "Done:" in log
  assert json.loads((convnet_run / "config.json").read_text())["task"] == "image_classification"


@pytest.mark.slow
def test_checkpoint_holds_the_batchnorm_statistics_in_the_logical_layout(convnet_run):
  from configs import convnet  # pylint: disable=g-import-not-at-top
  config = convnet.get_config("size=tiny")
  config.num_steps = NUM_STEPS
  exp = experiment.build(config)
  ckpt = checkpointing.Checkpointer(convnet_run / "checkpoints")
  try:
    state, _ = ckpt.restore(NUM_STEPS, exp.abstract_checkpoint())
  finally:
    ckpt.close()
  stats = jax.device_get(state.model_state)
  assert sorted(stats) == ["layers_0", "layers_1", "layers_2"]  # Stem and cells; no head.
  means = [np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(stats)
           if "mean" in jax.tree_util.keystr(path)]
  assert means and all(np.abs(m).max() > 0 for m in means)  # Updated from their zero init.
  # And back into this experiment's stage layout: the same statistics.
  staged = exp.from_checkpoint(state)
  again = jax.device_get(exp.stats_layout.to_logical(staged.model_state["staged"]))
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(stats)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_resumed_run_continues_with_the_same_losses(convnet_run, tmp_path):
  workdir = tmp_path / "resumed"
  shutil.copytree(convnet_run, workdir)
  shutil.rmtree(workdir / "checkpoints" / str(NUM_STEPS))
  (workdir / "DONE").unlink()
  proc = _train(workdir)
  _check_ok(proc)
  assert "Resumed from step 10" in proc.stderr
  resumed, uninterrupted = _losses(workdir), _losses(convnet_run)
  assert sorted(resumed) == list(range(1, NUM_STEPS + 1))
  for step in range(11, NUM_STEPS + 1):
    np.testing.assert_allclose(resumed[step], uninterrupted[step], rtol=1e-6,
                               err_msg=f"step {step}")
