"""A trainer that helps: each friction point a new user met, reproduced and checked fixed.

One in-process run (shared by the module) on 6 of the 8 devices, from a JSONL file with a BPE
tokenizer, profiling a step and stopped by SIGINT, gives the log, metrics, TensorBoard events and
trace most tests read; the command-line errors and ``--help`` run ``startup.run`` in-process too.
"""

import io
import logging
import os
import pathlib
import shutil
import signal
import struct
import subprocess
import sys

from absl import flags
import jax
import numpy as np
import pytest

from configs import lm
from tests.helpers import text_corpus
from tests.helpers import train_runs
from tpipe.train import __main__ as train_main
from tpipe.train import architecture
from tpipe.train import checkpointing
from tpipe.train import pretrained
from tpipe.train.cli import metrics
from tpipe.train.cli import startup
from tpipe.train.cli import trainer

STOP_AT, NUM_STEPS, PEAK = 4, 6, 0.5


def _config(root: pathlib.Path):
  config = lm.get_config("size=tiny")
  config.data = text_corpus.write_jsonl(root / "docs.jsonl", text_corpus.documents(120))
  config.tokenizer = text_corpus.bpe_tokenizer(root / "tokenizer")
  config.num_stages, config.num_data, config.num_microbatches = 3, 2, 8  # 6 of 8 devices.
  config.num_steps, config.log_every, config.checkpoint_every = NUM_STEPS, 1, 2
  config.eval_every, config.profile_steps, config.peak_tflops = 3, "2,2", PEAK
  return config


_SIGINT_BEFORE_THE_RUN = []  # The SIGINT handler when the interrupted run starts.


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
  """``(config, workdir, result, log)`` of the run stopped by SIGINT at step STOP_AT."""
  root = tmp_path_factory.mktemp("helps")
  config = _config(root)
  stream = io.StringIO()
  handler = logging.StreamHandler(stream)
  root_logger = logging.getLogger()
  level = root_logger.level
  root_logger.addHandler(handler)
  root_logger.setLevel(logging.INFO)
  _SIGINT_BEFORE_THE_RUN.append(signal.getsignal(signal.SIGINT))
  try:
    with train_runs.interrupted_at(config, STOP_AT):
      result = trainer.train(config, str(root / "run"))
  finally:
    root_logger.removeHandler(handler)
    root_logger.setLevel(level)
  return config, root / "run", result, stream.getvalue()


def test_sigint_saves_like_sigterm_and_says_how_to_resume(interrupted):
  _, workdir, result, log = interrupted
  assert result["step"] == STOP_AT and result["checkpoint"] == STOP_AT
  assert train_runs.checkpoint_steps(workdir) == [2, STOP_AT]
  assert (f"Stopped by SIGINT at step {STOP_AT}; checkpoint saved in {workdir}/checkpoints/"
          f"{STOP_AT}. Re-run the same command to resume.") in log
  # The handler the run found is back (Python's default_int_handler, or SIG_IGN where the
  # suite was started in the background).
  assert signal.getsignal(signal.SIGINT) is _SIGINT_BEFORE_THE_RUN[-1]


def test_the_log_names_where_everything_goes_and_each_save(interrupted):
  _, workdir, _, log = interrupted
  assert (f"Workdir {workdir}: checkpoints in {workdir}/checkpoints, metrics in "
          f"{workdir}/metrics.jsonl, TensorBoard events in {workdir} "
          f"(tensorboard --logdir={workdir}).") in log
  for step in (2, STOP_AT):
    assert f"Saving the checkpoint of step {step} to {workdir}/checkpoints/{step}." in log


def test_a_mesh_leaving_devices_idle_says_so(interrupted):
  log = interrupted[3]
  assert ("The mesh uses 6 of the 8 devices (num_stages 3 x num_data 2 x mesh.fsdp 1 x "
          "mesh.expert 1 x mesh.tensor 1); 2 stay idle. Make the product 8 to use them all.") in log


def _tensorboard_tags(workdir) -> set[str]:
  """The scalar tags of a run's TensorBoard event files (TFRecord framing, Event protos)."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  tags = set()
  for path in pathlib.Path(workdir).glob("events.out.tfevents.*"):
    data = path.read_bytes()
    while data:
      (length,) = struct.unpack("<Q", data[:8])
      event = event_pb2.Event.FromString(data[12:12 + length])
      tags.update(value.tag for value in event.summary.value)
      data = data[12 + length + 4:]
  return tags


def test_throughput_in_the_log_metrics_and_tensorboard(interrupted):
  config, workdir, _, log = interrupted
  records = metrics.read_metrics(workdir)
  timed = [r for r in records if "steps_per_sec" in r]
  assert [r["step"] for r in timed] == list(range(2, STOP_AT + 1))  # Step 1 has compilation.
  tokens = config.batch_size * config.seq_len
  for record in timed:
    assert record["tokens_per_s"] == pytest.approx(tokens * record["steps_per_sec"])
    assert record["mfu"] == pytest.approx(record["tflops_per_device"] / PEAK)
    assert record["tflops_per_device"] > 0
  assert " tokens/s | " in log and " TFLOP/s/device | MFU " in log
  assert {"tokens_per_s", "tflops_per_device", "mfu"} <= _tensorboard_tags(workdir)


def test_profile_steps_write_an_xprof_trace(interrupted):
  workdir = interrupted[1]
  assert list((workdir / "profile").rglob("*.xplane.pb")), "no XProf trace written"
  assert f"Profiling steps 2 to 2 into {workdir}/profile" in interrupted[3]


def test_a_changed_model_or_data_field_names_each_change_and_the_ways_out(interrupted):
  config, workdir, _, _ = interrupted
  changed = config.copy_and_resolve_references()
  changed.width, changed.batch_size = 64, 32
  with pytest.raises(ValueError) as error:
    trainer.train(changed, str(workdir))
  message = str(error.value)
  assert "\n" not in message
  assert (f"the workdir {workdir} holds a run with other model or data fields: config.width "
          "32 -> 64, config.batch_size 16 -> 32.") in message
  assert f"Use a new --workdir, or start a new run from this one's weights with --workdir=NEW " \
         f"--config.init_from={workdir}" in message
  assert "--config.width=32 --config.batch_size=16" in message


def _run_cli(monkeypatch, capsys, *argv):
  """``python -m tpipe.train ARGV`` in this process: (exit status, stdout, stderr)."""
  monkeypatch.setattr(sys, "argv", ["tpipe.train", *argv])
  try:
    with pytest.raises(SystemExit) as exit_:
      startup.run(trainer.main, doc=train_main.__doc__)
  finally:
    flags.FLAGS.unparse_flags()
  out = capsys.readouterr()
  return exit_.value.code, out.out, out.err


@pytest.mark.parametrize("argv, message", [
    (["--config=configs/lm.py", "--config.num_stage=4"],
     "error: --config.num_stage: the config (configs/lm.py) has no such field; did you mean "
     "--config.num_stages? (--config=configs/lm.py --help lists its fields)."),
    (["--config=configs/nope.py"], "error: --config=configs/nope.py: no such config file "
     "'configs/nope.py'"),
    (["--config={broken}"], "error: --config={broken}: the config file could not be loaded "
     "(line 2): SyntaxError"),
    (["--config={undefined}"], "error: --config={undefined}: the config file could not be "
     "loaded (line 2): NameError: name 'undefined' is not defined"),
])
def test_config_errors_are_one_line(monkeypatch, capsys, tmp_path, argv, message):
  (tmp_path / "broken.py").write_text("def get_config():\n  return (\n")
  (tmp_path / "undefined.py").write_text("def get_config():\n  return undefined\n")
  monkeypatch.chdir(train_runs.REPO)
  paths = {"broken": tmp_path / "broken.py", "undefined": tmp_path / "undefined.py"}
  argv = [a.format(**paths) for a in argv] + [f"--workdir={tmp_path / 'w'}"]
  status, _, err = _run_cli(monkeypatch, capsys, *argv)
  assert status == 2
  assert err.startswith(message.format(**paths)), err
  assert len(err.strip().splitlines()) == 1, err
  assert not (tmp_path / "w").exists()


def test_help_lists_the_config_fields_with_defaults_and_meanings(monkeypatch, capsys):
  monkeypatch.chdir(train_runs.REPO)
  status, out, _ = _run_cli(monkeypatch, capsys, "--config=configs/lm.py:size=tiny", "--help")
  assert status == 0
  assert ":mod:" not in out and "``" not in out  # Plain text, no Sphinx markup.
  assert "  --workdir: Directory for checkpoints and metrics" in out
  assert "Config fields of configs/lm.py:size=tiny (set any with --config.NAME=VALUE):" in out
  assert "  --config.num_stages=4\n      Pipeline and mesh:" in out
  assert "  --config.data='stdlib'\n      Data: \"stdlib\"" in out
  assert "  --config.tokenizer='bytes'\n      \"bytes\", a Hugging Face tokenizer.json" in out
  config = lm.get_config("size=tiny")
  listed = [line.split("=")[0][len("  --config."):] for line in out.splitlines()
            if line.startswith("  --config.")]
  flat = []
  for key, value in config.items():
    flat += [f"{key}.{k}" for k in value] if hasattr(value, "items") else [key]
  assert set(listed) >= {k for k in flat if "." not in k}
  undocumented = [line for line, after in zip(out.splitlines(), out.splitlines()[1:] + [""])
                  if line.startswith("  --config.") and not after.startswith("      ")]
  assert undocumented == ["  --config.size='tiny'"] or not undocumented, undocumented


@pytest.mark.skipif(startup.tpu_host(), reason="a TPU host: JAX should start its TPU backend")
def test_no_libtpu_noise_on_a_cpu_only_machine():
  import importlib.util  # pylint: disable=g-import-not-at-top
  if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu is not installed: there is no noise to keep out")
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_WORKER_HOSTNAMES")}
  run = lambda code: subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                    text=True, timeout=120, cwd=train_runs.REPO)
  noisy = run("import jax; jax.devices()")  # What a run without the fix prints.
  assert "jellyfish" in noisy.stderr or "libtpu" in noisy.stderr, noisy.stderr[-2000:]
  quiet = run("from tpipe.train.cli import startup; startup.quiet_absent_tpu(); import jax; "
              "print(jax.devices()[0].platform)")
  assert quiet.returncode == 0 and quiet.stdout.strip() == "cpu", quiet.stderr[-2000:]
  for noise in ("jellyfish", "INVALID_ARGUMENT", "libtpu", "TPU"):
    assert noise not in quiet.stderr, quiet.stderr[-2000:]


def _fake_gcloud(directory: pathlib.Path) -> pathlib.Path:
  """A ``gcloud`` that records its arguments (and copies what ``scp`` ships) instead."""
  script = directory / "gcloud"
  script.write_text('#!/usr/bin/env bash\necho "$*" >> "$GCLOUD_LOG"\n'
                    'for a in "$@"; do [[ "$a" == *.tar.gz ]] && cp "$a" "$SHIPPED"; done\n'
                    "exit 0\n")
  script.chmod(0o755)
  return directory


@pytest.mark.unit
def test_tpu_vm_setup_refuses_a_dirty_tree_or_ships_it_and_says_which(tmp_path):
  repo = tmp_path / "repo"
  (repo / "scripts").mkdir(parents=True)
  shutil.copy(train_runs.REPO / "scripts" / "tpu_vm.sh", repo / "scripts")
  git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)
  git("init", "-q")
  git("-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
  env = dict(os.environ, PATH=f"{_fake_gcloud(tmp_path)}:{os.environ['PATH']}",
             GCLOUD_LOG=str(tmp_path / "log"), SHIPPED=str(tmp_path / "shipped.tar.gz"))
  setup = lambda **extra: subprocess.run(["bash", "scripts/tpu_vm.sh", "setup"], cwd=repo,
                                         env={**env, **extra}, capture_output=True, text=True)
  clean = setup()
  assert clean.returncode == 0, clean.stderr
  assert "Shipping commit " in clean.stdout
  (repo / "scripts" / "edited.py").write_text("print('uncommitted')\n")
  dirty = setup()
  assert dirty.returncode != 0
  assert "uncommitted changes" in dirty.stderr and "SHIP=worktree" in dirty.stderr
  shipped = setup(SHIP="worktree")
  assert shipped.returncode == 0, shipped.stderr
  assert "Shipping the working tree (uncommitted changes included)" in shipped.stdout
  listing = subprocess.run(["tar", "-tzf", str(tmp_path / "shipped.tar.gz")],
                           capture_output=True, text=True, check=True).stdout
  assert "scripts/edited.py" in listing


def test_init_from_a_workdir_reads_its_architecture_and_latest_weights(interrupted):
  """The second way out of a changed field: a new run from the old run's weights."""
  config, workdir, _, _ = interrupted
  fields = pretrained.architecture_of(workdir)
  resolved = architecture.resolve(config)
  assert fields == {name: architecture.value(resolved, name) for name in architecture.FIELDS}
  params = pretrained.load_params(workdir)
  saved = checkpointing.read_layer(workdir / "checkpoints", STOP_AT, "layers_1")
  jax.tree.map(np.testing.assert_array_equal, params["layers_1"], saved)
  assert params["layers_0"]["embed"]["embedding"].shape == (resolved.vocab_size, config.width)


def test_a_resumed_fine_tuning_run_needs_not_its_initial_checkpoint(interrupted, tmp_path):
  """Resuming a run started from config.init_from reads the architecture from the workdir:
  the directory it started from may be gone."""
  config, workdir, _, _ = interrupted
  started = config.copy_and_resolve_references()
  started.init_from = str(tmp_path / "deleted")
  resumed = trainer.resumed_config(started, workdir)
  assert resumed.init_from == str(workdir)
  assert architecture.resolve(resumed).width == config.width
  assert trainer.resumed_config(started, tmp_path) is started  # No checkpoint: a new run.
