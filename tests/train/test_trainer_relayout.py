"""Checkpoints do not depend on the pipeline layout: resume a run on another mesh.

Parameters are saved in ``nn.scan``'s layout (every layer stacked on axis 0), so a run
checkpointed with 4 stages x 2 replicas continues with 2 stages x 4 replicas and gives the losses
the uninterrupted run gave.
"""

import shutil

import numpy as np
import pytest

from tests.test_train import NUM_STEPS, _check_ok, _losses, _train, reference  # noqa: F401


@pytest.mark.slow
def test_resume_on_a_different_mesh_continues_the_same_run(reference, tmp_path):  # noqa: F811
  workdir = tmp_path / "relayout"
  shutil.copytree(reference, workdir)
  checkpoints = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()
                       if p.name.isdigit())
  assert checkpoints[-1] == NUM_STEPS and len(checkpoints) >= 2, checkpoints
  for step in checkpoints[1:]:
    shutil.rmtree(workdir / "checkpoints" / str(step))
  resume_from = checkpoints[0]
  # 16 examples over 4 replicas: 4 micro-batches of one example each.
  proc = _train(workdir, "--config.num_stages=2", "--config.num_data=4",
                "--config.num_microbatches=4")
  _check_ok(proc)
  assert f"Resumed from step {resume_from}" in proc.stderr
  resumed, uninterrupted = _losses(workdir), _losses(reference)
  assert sorted(resumed) == list(range(1, NUM_STEPS + 1))
  for step in range(resume_from + 1, NUM_STEPS + 1):
    np.testing.assert_allclose(resumed[step], uninterrupted[step], rtol=1e-4,
                               err_msg=f"step {step}")
