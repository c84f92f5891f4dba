"""Checkpoints do not depend on the pipeline layout: resume a run on another mesh.

Parameters are saved in ``nn.scan``'s layout (every layer stacked on axis 0), so a run
checkpointed with 4 stages x 2 replicas continues with 2 stages x 4 replicas and gives the losses
the uninterrupted run gave (as close to float64 as the run on one device is).
"""

import shutil

import pytest

from tests.helpers import numerics
from tests.helpers import train_runs
from tests.helpers.train_runs import NUM_STEPS


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  return train_runs.lm_reference(tmp_path_factory)


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
  return train_runs.lm_single_device(tmp_path_factory)


@pytest.mark.slow
def test_resume_on_a_different_mesh_continues_the_same_run(reference, single_device, tmp_path):
  workdir = tmp_path / "relayout"
  shutil.copytree(reference, workdir)
  checkpoints = train_runs.checkpoint_steps(workdir)
  assert checkpoints[-1] == NUM_STEPS and len(checkpoints) >= 2, checkpoints
  for step in checkpoints[1:]:
    shutil.rmtree(workdir / "checkpoints" / str(step))
  resume_from = checkpoints[0]
  # 16 examples over 4 replicas: 4 micro-batches of one example each.
  proc = train_runs.train(workdir, "--config.num_stages=2", "--config.num_data=4",
                          "--config.num_microbatches=4")
  train_runs.check_ok(proc)
  assert f"Resumed from step {resume_from}" in proc.stderr
  assert sorted(train_runs.losses(workdir)) == list(range(1, NUM_STEPS + 1))
  steps = range(resume_from + 1, NUM_STEPS + 1)
  exact = train_runs.lm_float64_losses()[resume_from:]
  single = train_runs.logged_losses(single_device, steps)
  numerics.assert_as_close_as_plain(train_runs.logged_losses(workdir, steps), single, exact,
                                    what="the losses resumed on the other mesh")
