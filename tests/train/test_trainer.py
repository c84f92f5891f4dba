"""End-to-end tests of ``python -m tpipe.train`` (subprocesses, the tiny LM config).

One uninterrupted reference run (data=2 x stage=4, M=8, 20 steps) is shared by the equivalence,
resume and multi-host tests; under pytest-xdist the workers share it through a file lock.
"""

import contextlib
import fcntl
import functools
import json
import math
import os
import pathlib
import re
import signal
import socket
import struct
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tpipe.train import checkpointing
from tpipe.train import experiment
from tpipe.train import metrics

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "lm.py"
NUM_STEPS = 20
TINY = [
    f"--config={CONFIG}:size=tiny",
    f"--config.num_steps={NUM_STEPS}",
    "--config.num_stages=4",
    "--config.num_data=2",
    "--config.num_microbatches=8",
    "--config.log_every=1",
    "--config.eval_every=10",
    "--config.checkpoint_every=10",
]
TIMEOUT = 300


def _env(num_cpu_devices=None):
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env.pop("JAX_NUM_CPU_DEVICES", None)  # Let the trainer emulate num_stages * num_data devices.
  if num_cpu_devices is not None:
    env["JAX_NUM_CPU_DEVICES"] = str(num_cpu_devices)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
  return env


def _command(workdir, *overrides):
  return [sys.executable, "-m", "tpipe.train", f"--workdir={workdir}", *TINY, *overrides]


def _train(workdir, *overrides, num_cpu_devices=None):
  """Runs the trainer to completion; returns the CompletedProcess (check=False)."""
  return subprocess.run(_command(workdir, *overrides), env=_env(num_cpu_devices), cwd=REPO,
                        capture_output=True, text=True, timeout=TIMEOUT, check=False)


def _check_ok(proc):
  assert proc.returncode == 0, f"trainer failed:\n{proc.stderr[-4000:]}"


def _losses(workdir):
  return {r["step"]: r["loss"] for r in metrics.read_metrics(workdir) if "loss" in r}


def _tiny_config():
  from configs import lm  # pylint: disable=g-import-not-at-top
  config = lm.get_config("size=tiny")
  config.num_steps = NUM_STEPS
  config.num_stages, config.num_data, config.num_microbatches = 4, 2, 8
  return config


@functools.cache
def _tiny_experiment():
  """The tiny run's experiment in this process (conftest's 8 CPU devices), built once."""
  return experiment.build(_tiny_config())


def _restore(workdir, step):
  """Restores a checkpoint in this process (conftest's 8 CPU devices)."""
  exp = _tiny_experiment()
  ckpt = checkpointing.Checkpointer(pathlib.Path(workdir) / "checkpoints")
  try:
    state, data_state = ckpt.restore(step, exp.abstract_checkpoint())  # The logical layout.
  finally:
    ckpt.close()
  return jax.device_get(state), data_state


def _latest_checkpoint(workdir):
  ckpt_dir = pathlib.Path(workdir) / "checkpoints"
  steps = [int(p.name) for p in ckpt_dir.glob("*") if p.name.isdigit()] if ckpt_dir.exists() else []
  return max(steps, default=None)


@contextlib.contextmanager
def _locked(path):
  with open(path, "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
  """Workdir of the uninterrupted tiny run, made once per session (shared across xdist workers)."""
  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent  # The session's directory, shared by the workers.
  workdir = base / "train_reference"
  with _locked(base / "train_reference.lock"):
    done = workdir / "DONE"
    if not done.exists():
      proc = _train(workdir)
      _check_ok(proc)
      (base / "train_reference.stderr").write_text(proc.stderr)
      done.write_text("ok")
  return workdir


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
  log = (reference.parent / "train_reference.stderr").read_text()
  assert f"step {NUM_STEPS}/{NUM_STEPS} | loss " in log and " steps/s | ETA " in log


@pytest.mark.slow
def test_pipelined_equals_single_device(reference, tmp_path):
  proc = _train(tmp_path, "--config.num_stages=1", "--config.num_data=1")
  _check_ok(proc)
  assert "1 processes, 1 devices" in proc.stderr
  pipelined, single = _losses(reference), _losses(tmp_path)
  assert sorted(single) == list(range(1, NUM_STEPS + 1))
  for step in single:
    np.testing.assert_allclose(pipelined[step], single[step], rtol=1e-4, err_msg=f"step {step}")


@pytest.mark.slow
def test_resume_after_sigkill_matches_uninterrupted(reference, tmp_path):
  # Checkpoint every 5 steps; kill hard once step 5's checkpoint is complete and training has
  # moved past it.
  command = _command(tmp_path, "--config.checkpoint_every=5")
  proc = subprocess.Popen(command, env=_env(), cwd=REPO, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + TIMEOUT
  try:
    while time.monotonic() < deadline and proc.poll() is None:
      latest = _latest_checkpoint(tmp_path)
      if latest is not None and max(_losses(tmp_path), default=0) > latest:
        break
      time.sleep(0.02)
    assert proc.poll() is None, f"run ended before it could be killed:\n{proc.stderr.read()}"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.stderr.close()
  killed_at = _latest_checkpoint(tmp_path)
  assert killed_at is not None and killed_at < NUM_STEPS

  resumed = subprocess.run(command, env=_env(), cwd=REPO, capture_output=True, text=True,
                           timeout=TIMEOUT, check=False)
  _check_ok(resumed)
  assert f"Resumed from step {killed_at}" in resumed.stderr

  # The same losses at every step (the re-run steps replace the killed run's records).
  assert [r["step"] for r in metrics.read_metrics(tmp_path)] == list(range(1, NUM_STEPS + 1))
  ref_losses, losses = _losses(reference), _losses(tmp_path)
  for step in range(1, NUM_STEPS + 1):
    np.testing.assert_allclose(losses[step], ref_losses[step], rtol=1e-6, err_msg=f"step {step}")
  # The same final parameters, optimizer state and data position.
  ref_state, ref_data = _restore(reference, NUM_STEPS)
  state, data_state = _restore(tmp_path, NUM_STEPS)
  assert int(state.step) == NUM_STEPS
  assert data_state == ref_data
  for a, b in zip(jax.tree.leaves(ref_state), jax.tree.leaves(state)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)

  # Resuming with another batch size would read other data: a clear error, not a silent change.
  changed = subprocess.run(command + ["--config.batch_size=32"], env=_env(), cwd=REPO,
                           capture_output=True, text=True, timeout=TIMEOUT, check=False)
  assert changed.returncode == 2
  assert "config.batch_size changed since the checkpoint" in changed.stderr, changed.stderr[-4000:]
  assert "--config.batch_size=16" in changed.stderr


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_two_processes(workdir):
  """Runs the trainer as 2 processes x 4 CPU devices; returns (procs, their stderr)."""
  port = _free_port()
  procs = [
      subprocess.Popen(
          _command(workdir, f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                   f"--process_id={i}"),
          env=_env(num_cpu_devices=4), cwd=REPO, stdout=subprocess.DEVNULL,
          stderr=subprocess.PIPE, text=True)
      for i in range(2)
  ]
  try:
    errors = [p.communicate(timeout=TIMEOUT)[1] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return procs, errors


@pytest.mark.slow
def test_two_processes_log_the_same_losses_as_one(reference, tmp_path):
  workdir = tmp_path / "run"
  procs, errors = _run_two_processes(workdir)
  bind_failed = any(m in e.lower() for e in errors for m in ("already in use", "failed to add port"))
  if any(p.returncode for p in procs) and bind_failed:
    # Another process took the free port before the coordinator bound it: retry once.
    workdir = tmp_path / "retry"
    procs, errors = _run_two_processes(workdir)
  for p, err in zip(procs, errors):
    assert p.returncode == 0, err[-4000:]
  assert "2 processes, 8 devices" in errors[0]
  # Only process 0 writes: one record per step.
  assert [r["step"] for r in metrics.read_metrics(workdir)] == list(range(1, NUM_STEPS + 1))
  ref_losses, losses = _losses(reference), _losses(workdir)
  for step in losses:
    np.testing.assert_allclose(losses[step], ref_losses[step], rtol=1e-5, err_msg=f"step {step}")


@pytest.mark.slow
def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
  proc = _train(tmp_path, "--config.learning_rate=1e12", "--config.checkpoint_every=1")
  assert proc.returncode != 0
  line = next((l for l in proc.stderr.splitlines() if l.startswith("ERROR: Non-finite")), None)
  assert line is not None, proc.stderr[-4000:]
  found = re.search(r" at step (\d+);", line)
  assert found, f"no 'at step N;' in: {line}"
  bad_step = int(found.group(1))
  assert 1 < bad_step <= NUM_STEPS
  last_good = _latest_checkpoint(tmp_path)
  assert last_good == bad_step - 1, (last_good, bad_step)
  assert f"last good checkpoint is step {last_good}" in line
  state, _ = _restore(tmp_path, last_good)
  assert int(state.step) == last_good
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))


@pytest.mark.slow
def test_interrupted_save_leaves_previous_checkpoint_usable(reference, tmp_path):
  # What a crash in the middle of an Orbax save leaves behind: a temporary step directory.
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.copytree(reference / "checkpoints", tmp_path / "checkpoints")
  partial = tmp_path / "checkpoints" / f"{NUM_STEPS + 5}.orbax-checkpoint-tmp"
  (partial / "state.orbax-checkpoint-tmp").mkdir(parents=True)
  (partial / "state.orbax-checkpoint-tmp" / "d").write_bytes(b"\x00" * 10)
  ckpt = checkpointing.Checkpointer(tmp_path / "checkpoints")
  try:
    assert ckpt.latest_step() == NUM_STEPS
  finally:
    ckpt.close()
  state, data_state = _restore(tmp_path, NUM_STEPS)
  ref_state, ref_data = _restore(reference, NUM_STEPS)
  assert data_state == ref_data and int(state.step) == NUM_STEPS
  np.testing.assert_array_equal(state.params["layers_2"]["head"]["kernel"],
                                ref_state.params["layers_2"]["head"]["kernel"])


@pytest.mark.slow
def test_bfloat16_run_learns_and_saves_float32_state(reference, tmp_path):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  proc = _train(tmp_path, "--config.dtype=bfloat16")
  _check_ok(proc)
  losses = _losses(tmp_path)
  assert sorted(losses) == list(range(1, NUM_STEPS + 1))
  assert all(math.isfinite(x) for x in losses.values()), losses
  assert losses[NUM_STEPS] < losses[1] - 1.0, losses
  # It follows the float32 run: bfloat16 rounding (relative 2**-9) of activations moves each
  # step's loss by ~0.01 nats here (measured), far below the ~2 nats the loss falls.
  ref_losses = _losses(reference)
  for step in losses:
    assert abs(losses[step] - ref_losses[step]) < 0.1, (step, losses[step], ref_losses[step])
  assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
  # What was saved (read from the checkpoint's own metadata: restoring into an abstract state
  # would cast to that state's dtypes): float32 parameters and Adam moments, int32 counters,
  # the bool weight-decay mask.
  saved = ocp.StandardCheckpointer().metadata(
      tmp_path / "checkpoints" / str(NUM_STEPS) / "state").item_metadata
  params = jax.tree.leaves(saved["params"], is_leaf=lambda x: hasattr(x, "dtype"))
  assert params and {str(x.dtype) for x in params} == {"float32"}
  everything = jax.tree.leaves(saved, is_leaf=lambda x: hasattr(x, "dtype"))
  assert {str(x.dtype) for x in everything} == {"float32", "int32", "bool"}  # bool: decay mask.


@pytest.mark.slow
@pytest.mark.parametrize("override, message", [
    ("--config.batch_size=12", "num_microbatches"),
    ("--config.eval_every=0", "config.eval_every must be an int >= 1"),
    ("--config.dtype=float16", "config.dtype must be one of ('float32', 'bfloat16')"),
])
def test_bad_config_is_a_clean_error(tmp_path, override, message):
  proc = _train(tmp_path, override)
  assert proc.returncode == 2, proc.stderr[-4000:]
  assert "error: " in proc.stderr and message in proc.stderr, proc.stderr[-4000:]
  assert "Traceback" not in proc.stderr
  assert not (tmp_path / "checkpoints").exists()


def test_fused_schedule_trains_as_gpipe_does():
  """``config.schedule="1f1b"``: from the same states, the train step's loss and gradient norm
  are GPipe's (float64 reference: the plain LM on the logical parameters), and evaluation (the
  forward equivalent on the same staged parameters) is GPipe's, bit for bit."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from tests import numerics  # pylint: disable=g-import-not-at-top
  from tpipe.train import models  # pylint: disable=g-import-not-at-top

  config = _tiny_config()
  gpipe = _tiny_experiment()
  config.schedule = "1f1b"
  fused = experiment.build(config)
  assert fused.model.is_fused() and not experiment.forward_equivalent(fused.model).is_fused()
  assert fused.layout.staged_shapes() == gpipe.layout.staged_shapes()
  plain64 = models.decoder_lm(
      num_layers=config.num_layers, width=config.width, num_heads=config.num_heads,
      mlp_dim=config.mlp_dim, max_len=config.seq_len, dtype=jnp.float64,
      param_dtype=jnp.float64)

  @jax.jit
  def exact(logical, batch):
    loss, grads = jax.value_and_grad(lambda p: plain64.apply(
        {"params": p}, batch["inputs"], targets=batch["targets"]).mean())(logical)
    return {"loss": loss, "grad_norm": optax.tree.norm(grads)}

  rng = np.random.default_rng(0)
  shape = (config.batch_size, config.seq_len)
  copy = lambda state: jax.tree.map(jnp.copy, state)  # The steps donate their state.
  state = gpipe.init_state(jax.random.key(0))
  for step in range(3):
    batch = jax.device_put(
        {k: jnp.asarray(rng.integers(0, 256, shape), jnp.int32) for k in ("inputs", "targets")},
        gpipe.abstract_batch()["inputs"].sharding)
    logical = jax.device_get(gpipe.to_checkpoint(state).params)
    reference = numerics.float64_reference(exact, logical, jax.device_get(batch))
    _, got = fused.train_step(copy(state), batch, jax.random.key(step))
    evaluated = jax.device_get((fused.eval_step(state, batch), gpipe.eval_step(state, batch)))
    assert evaluated[0].keys() == evaluated[1].keys()
    for key in evaluated[1]:
      np.testing.assert_array_equal(evaluated[0][key], evaluated[1][key], err_msg=key)
    state, want = gpipe.train_step(state, batch, jax.random.key(step))
    for name in ("loss", "grad_norm"):
      numerics.assert_as_close_as_plain(float(got[name]), float(want[name]), reference[name],
                                        what=f"step {step + 1} {name}")


def test_remote_workdir_paths_stay_remote(tmp_path, monkeypatch):
  # pathlib would collapse gs://bucket/run to gs:/bucket/run, a local folder named "gs:".
  assert checkpointing.checkpoint_directory("gs://bucket/run") == "gs://bucket/run/checkpoints"
  monkeypatch.chdir(tmp_path)
  assert checkpointing.checkpoint_directory("run") == str(tmp_path / "run" / "checkpoints")
  writer = metrics.MetricWriter("gs://bucket/run", enabled=False)
  assert str(writer._path) == "gs://bucket/run/metrics.jsonl"  # pylint: disable=protected-access
  # Without google-cloud-storage, TensorBoard events go to a local directory instead.
  from tensorboardX import record_writer  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(record_writer, "GCS_ENABLED", False)
  local = metrics.tensorboard_logdir("gs://bucket/run")
  assert not metrics.is_remote(local) and pathlib.Path(local).is_dir()
  monkeypatch.setattr(record_writer, "GCS_ENABLED", True)
  assert metrics.tensorboard_logdir("gs://bucket/run") == "gs://bucket/run"
  assert metrics.tensorboard_logdir(tmp_path) == str(tmp_path)


def _tensorboard_events(workdir):
  """The events of ``workdir``'s TensorBoard files (TFRecord: length, crc, data, crc)."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  events = []
  for path in sorted(pathlib.Path(workdir).glob("events.out.tfevents.*")):
    raw, pos = path.read_bytes(), 0
    while pos + 12 <= len(raw):
      (length,) = struct.unpack("<Q", raw[pos:pos + 8])
      events.append(event_pb2.Event.FromString(raw[pos + 12:pos + 12 + length]))
      pos += 12 + length + 4
  return events


def test_resumed_writer_purges_the_repeated_steps(tmp_path):
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  writer = metrics.MetricWriter(tmp_path, purge_step=11)  # Resuming from step 10.
  writer.write(11, {"loss": 1.0})
  writer.close()
  starts = [e.step for e in _tensorboard_events(tmp_path)
            if e.session_log.status == event_pb2.SessionLog.START]
  assert starts == [11]


def test_read_metrics_skips_a_torn_last_line(tmp_path):
  (tmp_path / metrics.METRICS_FILE).write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
  assert metrics.read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]
  writer = metrics.MetricWriter(tmp_path)
  try:
    writer.truncate_after(1)  # What a resumed run does first.
  finally:
    writer.close()
  assert metrics.read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]


def test_checkpointer_close_restores_the_sigterm_handler(tmp_path):
  def previous(signum, frame):
    del signum, frame
  old = signal.signal(signal.SIGTERM, previous)
  try:
    ckpt = checkpointing.Checkpointer(tmp_path / "checkpoints", handle_sigterm=True)
    ckpt.close()
    assert signal.getsignal(signal.SIGTERM) is previous
  finally:
    signal.signal(signal.SIGTERM, old)
