"""End-to-end tests of ``python -m tpipe.train`` (the tiny LM config): a subprocess where the
process is what is tested (killed by SIGKILL, two processes), else the same command line run in
this process (``train_runs.train_here``: flags, ``main`` and its error handling as in a process
of its own; the 8 devices are conftest's, as many as the trainer would emulate).

One uninterrupted reference run (data=2 x stage=4, M=8, 20 steps; :mod:`tests.helpers.train_runs`)
is shared by the equivalence, resume and multi-host tests (and by the relayout and checkpointing
tests of this directory).
"""

import json
import math
import re
import signal
import socket
import subprocess
import time

import jax
import numpy as np
import pytest

from tests.helpers import numerics
from tests.helpers import train_runs
from tests.helpers.train_runs import NUM_STEPS
from tpipe.train.cli import metrics


STEPS = range(1, NUM_STEPS + 1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """Workdir of the uninterrupted tiny run, made once per session."""
  return train_runs.lm_reference(tmp_path_factory)


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
  """Workdir of the same run on one device, made once per session."""
  return train_runs.lm_single_device(tmp_path_factory)


@pytest.mark.slow
def test_reference_run_logs_every_step_and_learns(reference):
  records = metrics.read_metrics(reference)
  assert [r["step"] for r in records] == list(range(1, NUM_STEPS + 1))
  losses = [r["loss"] for r in records]
  assert all(math.isfinite(x) for x in losses)
  assert losses[-1] < losses[0] - 1.0, losses
  evals = [r["eval_loss"] for r in records if "eval_loss" in r]
  assert len(evals) == 2 and evals[-1] < 5.0, evals
  assert list((reference / "checkpoints").iterdir()), "no checkpoint written"
  assert list(reference.glob("events.out.tfevents.*")), "no TensorBoard event file"
  assert json.loads((reference / "config.json").read_text())["num_steps"] == NUM_STEPS
  log = train_runs.stderr_of(reference)
  assert f"step {NUM_STEPS}/{NUM_STEPS} | loss " in log and " steps/s | ETA " in log


@pytest.mark.slow
def test_pipelined_equals_single_device(reference, single_device):
  """The pipelined run (data=2 x stage=4) logs the losses of the run on one device, as close to
  float64 as that one is; and the one-device run is the plain LM trained with optax."""
  assert "1 processes, 1 devices" in train_runs.stderr_of(single_device)
  assert sorted(train_runs.losses(single_device)) == list(STEPS)
  exact = train_runs.lm_float64_losses()
  single = train_runs.logged_losses(single_device, STEPS)
  numerics.assert_as_close_as_plain(single, train_runs.lm_plain_losses(), exact,
                                    what="the one-device run's losses")
  numerics.assert_as_close_as_plain(train_runs.logged_losses(reference, STEPS), single, exact,
                                    what="the pipelined run's losses")


@pytest.mark.slow
def test_resume_after_sigkill_matches_uninterrupted(reference, tmp_path):
  # Checkpoint every 5 steps; kill hard once step 5's checkpoint is complete and training has
  # moved past it.
  command = train_runs.command(tmp_path, "--config.checkpoint_every=5")
  proc = subprocess.Popen(command, env=train_runs.env(), cwd=train_runs.REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + train_runs.TIMEOUT
  try:
    while time.monotonic() < deadline and proc.poll() is None:
      latest = train_runs.latest_checkpoint(tmp_path)
      if latest is not None and max(train_runs.losses(tmp_path), default=0) > latest:
        break
      time.sleep(0.02)
    assert proc.poll() is None, f"run ended before it could be killed:\n{proc.stderr.read()}"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.stderr.close()
  killed_at = train_runs.latest_checkpoint(tmp_path)
  assert killed_at is not None and killed_at < NUM_STEPS

  # The same command again, in this process (the resume is not what needs a process).
  resumed = train_runs.train_here(tmp_path, "--config.checkpoint_every=5")
  train_runs.check_ok(resumed)
  assert f"Resumed from step {killed_at}" in resumed.stderr

  # The same losses at every step (the re-run steps replace the killed run's records).
  assert [r["step"] for r in metrics.read_metrics(tmp_path)] == list(range(1, NUM_STEPS + 1))
  ref_losses, losses = train_runs.losses(reference), train_runs.losses(tmp_path)
  # The same program from the same state: the same numbers, bit for bit.
  for step in STEPS:
    assert losses[step] == ref_losses[step], (step, losses[step], ref_losses[step])
  # The same final parameters, optimizer state and data position.
  ref_state, ref_data = train_runs.restore(reference, NUM_STEPS)
  state, data_state = train_runs.restore(tmp_path, NUM_STEPS)
  assert int(state.step) == NUM_STEPS
  assert data_state == ref_data
  for a, b in zip(jax.tree.leaves(ref_state), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # Resuming with another batch size would read other data: a clear error, not a silent change.
  changed = train_runs.train_here(tmp_path, "--config.checkpoint_every=5",
                                  "--config.batch_size=32")
  assert changed.returncode == 2
  assert "config.batch_size 16 -> 32" in changed.stderr, changed.stderr[-4000:]
  assert "--config.batch_size=16" in changed.stderr and "Traceback" not in changed.stderr


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# The two-process run's steps: the reference run's first four. Its learning rate warms up over
# the first 2 updates (the tiny config's warmup_steps, fixed by its size, not by num_steps) and
# is at its peak on the third whatever num_steps is, so a 4-step run logs the losses the 20-step
# run logs at steps 1-4; its one evaluation and checkpoint come at step 4.
TWO_PROCESS_STEPS = range(1, 5)
SHORT = [f"--config.num_steps={len(TWO_PROCESS_STEPS)}", "--config.eval_every=4",
         "--config.checkpoint_every=4"]


def _run_two_processes(workdir):
  """Runs the trainer (4 steps) as 2 processes x 4 CPU devices; returns (procs, their stderr)."""
  port = _free_port()
  procs = [
      subprocess.Popen(
          train_runs.command(workdir, *SHORT, f"--coordinator_address=127.0.0.1:{port}",
                             "--num_processes=2", f"--process_id={i}"),
          env=train_runs.env(num_cpu_devices=4), cwd=train_runs.REPO, stdout=subprocess.DEVNULL,
          stderr=subprocess.PIPE, text=True)
      for i in range(2)
  ]
  try:
    errors = [p.communicate(timeout=train_runs.TIMEOUT)[1] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return procs, errors


@pytest.mark.slow
def test_two_processes_train_as_one_does(reference, tmp_path):
  workdir = tmp_path / "run"
  procs, errors = _run_two_processes(workdir)
  bind_failed = any(m in e.lower() for e in errors
                    for m in ("already in use", "failed to add port"))
  if any(p.returncode for p in procs) and bind_failed:
    # Another process took the free port before the coordinator bound it: retry once.
    workdir = tmp_path / "retry"
    procs, errors = _run_two_processes(workdir)
  for p, err in zip(procs, errors):
    assert p.returncode == 0, err[-4000:]
  assert "2 processes, 8 devices" in errors[0]
  # Only process 0 writes: one record per step; both processes evaluated and saved.
  assert [r["step"] for r in metrics.read_metrics(workdir)] == list(TWO_PROCESS_STEPS)
  assert "eval_loss" in metrics.read_metrics(workdir)[-1]
  assert train_runs.checkpoint_steps(workdir) == [TWO_PROCESS_STEPS[-1]]
  # The same program on the same mesh, split over two processes. Its all-reduces cross a process
  # boundary and may add in another order, so the losses agree to rounding, not bit for bit: as
  # close to the float64 run as the one-process run's are.
  numerics.assert_as_close_as_plain(
      train_runs.logged_losses(workdir, TWO_PROCESS_STEPS),
      train_runs.logged_losses(reference, TWO_PROCESS_STEPS),
      train_runs.lm_float64_losses()[:len(TWO_PROCESS_STEPS)],
      what="the two-process run's losses")


@pytest.mark.slow
def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
  proc = train_runs.train_here(tmp_path, "--config.learning_rate=1e12",
                               "--config.checkpoint_every=1")
  assert proc.returncode != 0
  line = next((line for line in proc.stderr.splitlines()
               if line.startswith("ERROR: Non-finite")), None)
  assert line is not None, proc.stderr[-4000:]
  found = re.search(r" at step (\d+);", line)
  assert found, f"no 'at step N;' in: {line}"
  bad_step = int(found.group(1))
  assert 1 < bad_step <= NUM_STEPS
  last_good = train_runs.latest_checkpoint(tmp_path)
  assert last_good == bad_step - 1, (last_good, bad_step)
  assert f"last good checkpoint is step {last_good}" in line
  state, _ = train_runs.restore(tmp_path, last_good)
  assert int(state.step) == last_good
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))


@pytest.mark.slow
def test_bfloat16_run_learns_and_saves_float32_state(reference, tmp_path):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  proc = train_runs.train_here(tmp_path, "--config.dtype=bfloat16")
  train_runs.check_ok(proc)
  losses = train_runs.losses(tmp_path)
  assert sorted(losses) == list(range(1, NUM_STEPS + 1))
  assert all(math.isfinite(x) for x in losses.values()), losses
  assert losses[NUM_STEPS] < losses[1] - 1.0, losses
  # It follows the float32 run: bfloat16 rounding (relative 2**-9) of activations moves each
  # step's loss by ~0.01 nats here (measured), far below the ~2 nats the loss falls.
  ref_losses = train_runs.losses(reference)
  for step in losses:
    assert abs(losses[step] - ref_losses[step]) < 0.1, (step, losses[step], ref_losses[step])
  assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
  # What was saved (read from the checkpoint's own metadata: restoring into an abstract state
  # would cast to that state's dtypes): float32 parameters and Adam moments, int32 counters, and
  # nothing else (the weight-decay mask is computed in the update, not stored).
  saved = ocp.StandardCheckpointer().metadata(
      tmp_path / "checkpoints" / str(NUM_STEPS) / "state").item_metadata
  params = jax.tree.leaves(saved["params"], is_leaf=lambda x: hasattr(x, "dtype"))
  assert params and {str(x.dtype) for x in params} == {"float32"}
  everything = jax.tree.leaves(saved, is_leaf=lambda x: hasattr(x, "dtype"))
  assert {str(x.dtype) for x in everything} == {"float32", "int32"}


@pytest.mark.slow
@pytest.mark.parametrize("override, message", [
    ("--config.batch_size=12", "num_microbatches"),
    ("--config.eval_every=0", "config.eval_every must be an int >= 1"),
    ("--config.dtype=float16", "config.dtype must be one of ('float32', 'bfloat16')"),
])
def test_bad_config_is_a_clean_error(tmp_path, override, message):
  proc = train_runs.train_here(tmp_path, override)
  assert proc.returncode == 2, proc.stderr[-4000:]
  assert "error: " in proc.stderr and message in proc.stderr, proc.stderr[-4000:]
  assert "Traceback" not in proc.stderr
  assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_two_emulated_slices_train_as_one_slice_does(reference, single_device, tmp_path):
  """The README's multislice command on this machine: the stages over two emulated slices, the
  links between them delayed, logs the losses of the one-slice run."""
  proc = train_runs.train_here(tmp_path / "ms", "--config.mesh.dcn.stage=2",
                               "--config.mesh.emulate_slices=True")
  train_runs.check_ok(proc)
  assert ("2 slices; stage links crossing them (False, True, False, True); transfers delayed "
          "per link (0, 1, 0, 1)") in proc.stderr
  exact = train_runs.lm_float64_losses()
  numerics.assert_as_close_as_plain(
      train_runs.logged_losses(tmp_path / "ms", STEPS),
      train_runs.logged_losses(single_device, STEPS), exact, what="the two-slice run's losses")
