"""Tests for tpipe.train.checkpointing: remote directories, interrupted saves, SIGTERM."""

import shutil
import signal

import numpy as np
import pytest

from tests.helpers import train_runs
from tests.helpers.train_runs import NUM_STEPS
from tpipe.train import checkpointing


@pytest.mark.unit
def test_remote_checkpoint_directories_stay_remote(tmp_path, monkeypatch):
  # pathlib would collapse gs://bucket/run to gs:/bucket/run, a local folder named "gs:".
  assert checkpointing.checkpoint_directory("gs://bucket/run") == "gs://bucket/run/checkpoints"
  monkeypatch.chdir(tmp_path)
  assert checkpointing.checkpoint_directory("run") == str(tmp_path / "run" / "checkpoints")


@pytest.mark.slow
def test_interrupted_save_leaves_previous_checkpoint_usable(tmp_path_factory, tmp_path):
  reference = train_runs.lm_reference(tmp_path_factory)
  # What a crash in the middle of an Orbax save leaves behind: a temporary step directory.
  shutil.copytree(reference / "checkpoints", tmp_path / "checkpoints")
  partial = tmp_path / "checkpoints" / f"{NUM_STEPS + 5}.orbax-checkpoint-tmp"
  (partial / "state.orbax-checkpoint-tmp").mkdir(parents=True)
  (partial / "state.orbax-checkpoint-tmp" / "d").write_bytes(b"\x00" * 10)
  ckpt = checkpointing.Checkpointer(tmp_path / "checkpoints")
  try:
    assert ckpt.latest_step() == NUM_STEPS
  finally:
    ckpt.close()
  state, data_state = train_runs.restore(tmp_path, NUM_STEPS)
  ref_state, ref_data = train_runs.restore(reference, NUM_STEPS)
  assert data_state == ref_data and int(state.step) == NUM_STEPS
  np.testing.assert_array_equal(state.params["layers_2"]["head"]["kernel"],
                                ref_state.params["layers_2"]["head"]["kernel"])


@pytest.mark.unit
def test_checkpointer_close_restores_the_sigterm_handler(tmp_path):
  def previous(signum, frame):
    del signum, frame
  old = signal.signal(signal.SIGTERM, previous)
  try:
    ckpt = checkpointing.Checkpointer(tmp_path / "checkpoints", handle_sigterm=True)
    assert signal.getsignal(signal.SIGTERM) is not previous  # The checkpointer's own handler.
    ckpt.close()
    assert signal.getsignal(signal.SIGTERM) is previous
  finally:
    signal.signal(signal.SIGTERM, old)
