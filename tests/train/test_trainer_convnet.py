"""End to end: ``python -m tpipe.train --config=configs/convnet.py`` (the tiny size).

The pipelined convnet with BatchNorm trains on the digits, reports eval accuracy, saves its
BatchNorm statistics with the checkpoint (in the logical layout), and a run resumed from a
checkpoint continues with the losses of the uninterrupted run.
"""

import json
import math
import shutil

import jax
import numpy as np
import pytest

from tests.helpers import train_runs
from tests.helpers.train_runs import NUM_STEPS
from tpipe.core.layout import staging
from tpipe.train.cli import experiment
from tpipe.train.cli import metrics


@pytest.fixture(scope="module")
def convnet_run(tmp_path_factory):
  """Workdir of the uninterrupted tiny convnet run, made once per session."""
  return train_runs.convnet_reference(tmp_path_factory)


@pytest.mark.slow
def test_convnet_trains_and_reports_accuracy(convnet_run):
  records = metrics.read_metrics(convnet_run)
  assert [r["step"] for r in records] == list(range(1, NUM_STEPS + 1))
  assert all(math.isfinite(r["loss"]) for r in records)
  accuracies = [r["eval_accuracy"] for r in records if "eval_accuracy" in r]
  assert len(accuracies) == 2 and all(0.0 <= a <= 1.0 for a in accuracies)
  # 20 tiny steps already beat chance (10%) on the 360 test digits.
  assert accuracies[-1] > 0.15, accuracies
  log = train_runs.stderr_of(convnet_run)
  assert "eval_accuracy" in log and "Done at step " in log
  assert json.loads((convnet_run / "config.json").read_text())["task"] == "image_classification"


@pytest.mark.slow
def test_checkpoint_holds_the_batchnorm_statistics_in_the_logical_layout(convnet_run):
  from configs import convnet  # pylint: disable=g-import-not-at-top
  config = convnet.get_config("size=tiny")
  config.num_steps = NUM_STEPS
  exp = experiment.build(config)
  state, _ = train_runs.restore(convnet_run, NUM_STEPS, exp)
  stats = state.model_state
  assert sorted(stats) == ["layers_0", "layers_1", "layers_2"]  # Stem and cells; no head.
  means = [np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(stats)
           if "mean" in jax.tree_util.keystr(path)]
  assert means and all(np.abs(m).max() > 0 for m in means)  # Updated from their zero init.
  # And back into this experiment's stage layout: the same statistics.
  staged = exp.from_checkpoint(state)
  again = jax.device_get(staging.to_logical(exp.stats_layout, staged.model_state))
  assert again.pop("layers_3") == {}  # The head, whose empty entry the checkpoint leaves out.
  assert jax.tree.structure(again) == jax.tree.structure(stats)
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(stats)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_resumed_run_continues_with_the_same_losses(convnet_run, tmp_path):
  workdir = tmp_path / "resumed"
  shutil.copytree(convnet_run, workdir)
  shutil.rmtree(workdir / "checkpoints" / str(NUM_STEPS))
  proc = train_runs.train_here(workdir, base=train_runs.CONVNET_ARGS)  # In this process.
  train_runs.check_ok(proc)
  assert "Resumed from step 10" in proc.stderr
  resumed, uninterrupted = train_runs.losses(workdir), train_runs.losses(convnet_run)
  assert sorted(resumed) == list(range(1, NUM_STEPS + 1))
  # The same program from the same state: the same numbers, bit for bit.
  for step in range(11, NUM_STEPS + 1):
    assert resumed[step] == uninterrupted[step], (step, resumed[step], uninterrupted[step])
