"""Checkpoints do not depend on the pipeline layout: resume a run on another mesh.

Parameters are saved in ``nn.scan``'s layout (every layer stacked on axis 0), so a run
checkpointed with 4 stages x 2 replicas continues with 2 stages x 4 replicas and gives the losses
the uninterrupted run gave (as close to float64 as the run on one device is); one layer reads
straight from the files (``checkpointing.read_layer``). The runs are the trainer's command line
in this process (``train_runs.train_here``): what is tested is the checkpoint, not the process.
"""

import ast
import re
import shutil

import jax
import numpy as np
import pytest

from tests.helpers import numerics
from tests.helpers import train_runs
from tests.helpers.train_runs import NUM_STEPS
from tpipe.train import checkpointing


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
  proc = train_runs.train_here(workdir, "--config.num_stages=2", "--config.num_data=4",
                               "--config.num_microbatches=4")
  train_runs.check_ok(proc)
  assert f"Resumed from step {resume_from}" in proc.stderr
  assert sorted(train_runs.losses(workdir)) == list(range(1, NUM_STEPS + 1))
  steps = range(resume_from + 1, NUM_STEPS + 1)
  exact = train_runs.lm_float64_losses()[resume_from:]
  single = train_runs.logged_losses(single_device, steps)
  numerics.assert_as_close_as_plain(train_runs.logged_losses(workdir, steps), single, exact,
                                    what="the losses resumed on the other mesh")


@pytest.mark.slow
def test_a_3d_mesh_trains_as_one_device_and_resumes_on_another_layout(single_device, tmp_path):
  """stage 2 x fsdp 2 x tensor 2 logs the one-device run's losses (16 rows in micro-batches of
  one row, split over fsdp as over data); resumed from its first checkpoint on stage 4 x fsdp 2
  it continues the same run."""
  workdir = tmp_path / "3d"
  proc = train_runs.train_here(workdir, "--config.num_stages=2", "--config.num_data=1",
                               "--config.mesh.fsdp=2", "--config.mesh.tensor=2")
  train_runs.check_ok(proc)
  mesh = ast.literal_eval(re.search(r"mesh (\{.*?\})", proc.stderr).group(1))
  assert {axis: size for axis, size in mesh.items() if size > 1} == {
      "fsdp": 2, "stage": 2, "tensor": 2}, mesh
  steps = range(1, NUM_STEPS + 1)
  exact = train_runs.lm_float64_losses()
  single = train_runs.logged_losses(single_device, steps)
  numerics.assert_as_close_as_plain(train_runs.logged_losses(workdir, steps), single, exact,
                                    what="the 3D run's losses")
  checkpoints = train_runs.checkpoint_steps(workdir)
  # One layer read straight from the files equals that layer of the restored state.
  logical, _ = train_runs.restore(workdir, checkpoints[0])
  for layer, copy in (("layers_1", 2), ("layers_0", None)):
    read = checkpointing.read_layer(workdir / "checkpoints", checkpoints[0], layer, copy=copy)
    want = logical.params[layer]
    want = want if copy is None else jax.tree.map(lambda a: a[copy], want)
    assert jax.tree.structure(read) == jax.tree.structure(want)
    for got, expected in zip(jax.tree.leaves(read), jax.tree.leaves(want)):
      np.testing.assert_array_equal(got, expected)
  moments = checkpointing.read_layer(workdir / "checkpoints", checkpoints[0], "layers_2",
                                     collection=("opt_state", "1", "nu"))
  for got, expected in zip(jax.tree.leaves(moments),
                           jax.tree.leaves(logical.opt_state[1].nu["layers_2"])):
    np.testing.assert_array_equal(got, expected)
  for step in checkpoints[1:]:
    shutil.rmtree(workdir / "checkpoints" / str(step))
  resume_from = checkpoints[0]
  proc = train_runs.train_here(workdir, "--config.num_stages=4", "--config.num_data=1",
                               "--config.mesh.fsdp=2", "--config.mesh.tensor=1")
  train_runs.check_ok(proc)
  assert f"Resumed from step {resume_from}" in proc.stderr
  steps = range(resume_from + 1, NUM_STEPS + 1)
  numerics.assert_as_close_as_plain(train_runs.logged_losses(workdir, steps),
                                    train_runs.logged_losses(single_device, steps),
                                    exact[resume_from:], what="the losses resumed on 4 x 2")
