"""Trainer runs the tests of :mod:`tpipe.train` share: the trainer's command line in a subprocess
or in the test process, run-once workdirs, and reading a run's metrics and checkpoints back.

A trainer run costs tens of seconds on 2 cores (tracing and compiling its programs; a subprocess
adds several seconds of start-up), so the tests run the trainer in their own process
(:func:`train_here`) unless the process is what they test (a kill, several processes, a process
with one device), and every test reads the few runs made here instead of training its own:
:func:`shared_run` makes a run once per pytest session (a ``DONE`` file in the session's base
temporary directory; a file lock when pytest-xdist workers share the directory), and test modules
wrap it in module-scoped fixtures (:func:`lm_reference`, :func:`convnet_reference`). Tests that
change a run copy its workdir first.

The runs:

* the tiny LM (``configs/lm.py:size=tiny``): data=2 x stage=4, M=8, :data:`NUM_STEPS` steps,
  a log line every step, evaluations and checkpoints every 10 (:data:`LM_ARGS`);
* the same run on one device, the plain (unpipelined) model: the sequential model of the
  numerics rule (:mod:`tests.helpers.numerics`), on the pipelined run's micro-batches (1 row
  each: M = 16 where the pipelined run has data = 2 x M = 8), with :func:`lm_float64_losses` its
  float64 reference;
* the tiny convnet with BatchNorm (``configs/convnet.py:size=tiny``), the same cadence
  (:data:`CONVNET_ARGS`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import io
import logging
import os
import pathlib
import signal
import subprocess
import sys

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.helpers import numerics
from tpipe.train import __main__ as train_main
from tpipe.train import checkpointing
from tpipe.train import models
from tpipe.train.cli import experiment
from tpipe.train.cli import translate
from tpipe.train.cli import metrics
from tpipe.train.cli import startup
from tpipe.train.cli import tasks
from tpipe.train.cli import trainer

REPO = pathlib.Path(__file__).resolve().parents[2]
NUM_STEPS = 20
TIMEOUT = 300
CADENCE = [f"--config.num_steps={NUM_STEPS}", "--config.log_every=1",
           "--config.eval_every=10", "--config.checkpoint_every=10"]
LM_ARGS = [f"--config={REPO / 'configs' / 'lm.py'}:size=tiny", *CADENCE,
           "--config.num_stages=4", "--config.num_data=2", "--config.num_microbatches=8"]
# On one device, the batch of 16 in micro-batches of one row, as each device of the pipelined run
# (data=2, M=8) sees it.
SINGLE_DEVICE = ["--config.num_stages=1", "--config.num_data=1", "--config.num_microbatches=16"]
CONVNET_ARGS = [f"--config={REPO / 'configs' / 'convnet.py'}:size=tiny", *CADENCE]


def env(num_cpu_devices: int | None = None) -> dict:
  """The trainer's environment: CPU, the repository importable, the device count its own."""
  out = dict(os.environ)
  out["JAX_PLATFORMS"] = "cpu"
  out.pop("JAX_NUM_CPU_DEVICES", None)  # Let the trainer emulate num_stages * num_data devices.
  if num_cpu_devices is not None:
    out["JAX_NUM_CPU_DEVICES"] = str(num_cpu_devices)
  out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), out.get("PYTHONPATH")]))
  return out


def command(workdir, *overrides, base=LM_ARGS) -> list[str]:
  """``python -m tpipe.train`` on ``base``'s config (the tiny LM's by default)."""
  return [sys.executable, "-m", "tpipe.train", f"--workdir={workdir}", *base, *overrides]


def train(workdir, *overrides, base=LM_ARGS, num_cpu_devices=None):
  """Runs the trainer to completion; returns the CompletedProcess (check=False)."""
  return subprocess.run(command(workdir, *overrides, base=base), env=env(num_cpu_devices),
                        cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT, check=False)


@contextlib.contextmanager
def captured_log(log_filter=None):
  """The INFO and higher records logged meanwhile (the trainer's log), as a StringIO; only those
  ``log_filter`` passes, if given."""
  stream = io.StringIO()
  handler = logging.StreamHandler(stream)
  if log_filter is not None:
    handler.addFilter(log_filter)
  root = logging.getLogger()
  level = root.level
  root.addHandler(handler)
  root.setLevel(logging.INFO)
  try:
    yield stream
  finally:
    root.removeHandler(handler)
    root.setLevel(level)


def reset_flags() -> None:
  """absl's flags as before a command line was parsed in this process: unparsed, and without the
  config's field flags (``--config.NAME``), which the next parse of ``--config`` defines anew."""
  flags.FLAGS.unparse_flags()
  for name in [name for name in flags.FLAGS if name.startswith("config.")]:
    delattr(flags.FLAGS, name)


def run_cli(*argv) -> subprocess.CompletedProcess:
  """``python -m tpipe.train ARGV`` in this process, on conftest's 8 CPU devices (the trainer's
  command line, flags, ``main`` and error handling; only the interpreter is shared): a
  CompletedProcess whose ``returncode`` is the exit status and whose ``stderr`` holds what was
  printed to stderr, then the log's messages."""
  quiet = trainer._QuietLibraries()  # The trainer's filter. pylint: disable=protected-access
  return _in_process(["tpipe.train", *argv], quiet,
                     lambda: startup.run(trainer.main, doc=train_main.__doc__))


def _in_process(argv, log_filter, run) -> subprocess.CompletedProcess:
  """``run()`` with ``sys.argv = argv``, absl's flags unparsed before and after, on the devices
  that exist (``JAX_NUM_CPU_DEVICES`` says how many, so that no program asks JAX for another
  count), stdout, stderr and the log (what ``log_filter`` passes) captured: a CompletedProcess of
  the exit status, stdout, and stderr followed by the log's messages."""
  out, err = io.StringIO(), io.StringIO()
  saved = sys.argv, os.environ.get("JAX_NUM_CPU_DEVICES")
  sys.argv = list(argv)
  os.environ["JAX_NUM_CPU_DEVICES"] = str(jax.device_count())
  reset_flags()
  try:
    with contextlib.ExitStack() as stack:
      log = stack.enter_context(captured_log(log_filter))
      stack.enter_context(contextlib.redirect_stdout(out))
      stack.enter_context(contextlib.redirect_stderr(err))
      try:
        run()
        code = 0
      except SystemExit as e:
        code = 0 if e.code is None else e.code
  finally:
    reset_flags()
    sys.argv = saved[0]
    if saved[1] is None:
      os.environ.pop("JAX_NUM_CPU_DEVICES", None)
    else:
      os.environ["JAX_NUM_CPU_DEVICES"] = saved[1]
  return subprocess.CompletedProcess(list(argv), code, out.getvalue(),
                                     err.getvalue() + log.getvalue())


def _tpipe_flags() -> dict[str, tuple[flags.Flag, str]]:
  """The absl flags tpipe's modules defined (the trainer's, once imported): ``{name: (flag,
  defining module)}``."""
  found = {}
  for name in list(flags.FLAGS):
    module = flags.FLAGS.find_module_defining_flag(name)
    if module and (module.startswith("tpipe.") or module == "__main__"):
      found[name] = flags.FLAGS[name], module
  return found


def run_program(module: str, *argv) -> subprocess.CompletedProcess:
  """``python -m MODULE ARGV`` for one of tpipe's programs other than the trainer (evaluate,
  generate, export, report), in this process as :func:`run_cli` runs the trainer: the module run
  as ``__main__`` (``runpy``: its ``define_flags()`` and ``startup.run``, as the command line
  runs it), its flags defined in place of the trainer's (which are set aside meanwhile: the
  programs share names such as ``--workdir``)."""
  import runpy  # pylint: disable=g-import-not-at-top
  set_aside = _tpipe_flags()
  reset_flags()
  for name in set_aside:
    delattr(flags.FLAGS, name)
  before = set(flags.FLAGS)
  try:
    return _in_process([module, *argv], None,
                       lambda: runpy.run_module(module, run_name="__main__", alter_sys=False))
  finally:
    reset_flags()
    for name in set(flags.FLAGS) - before:
      delattr(flags.FLAGS, name)
    for name, (flag, defined_by) in set_aside.items():
      flags.FLAGS[name] = flag
      flags.FLAGS.register_flag_by_module(defined_by, flag)


def train_here(workdir, *overrides, base=LM_ARGS) -> subprocess.CompletedProcess:
  """:func:`train` in this process (:func:`run_cli`): for the tests that check a run's results,
  not what a separate process adds (a kill, several processes)."""
  return run_cli(f"--workdir={workdir}", *base, *overrides)


class InterruptAt:
  """A data iterator that raises SIGINT (as Ctrl-C does) when batch ``at`` is read: the trainer
  finishes that step, saves a checkpoint and stops."""

  def __init__(self, inner, at: int):
    self._inner, self._at, self._count = inner, at, 0

  def __next__(self):
    self._count += 1
    if self._count == self._at:
      signal.raise_signal(signal.SIGINT)
    return next(self._inner)

  def __getattr__(self, name):
    return getattr(self._inner, name)


@contextlib.contextmanager
def interrupted_at(config, at: int):
  """Meanwhile the training data of ``config``'s task is an :class:`InterruptAt` ``at``."""
  task = tasks.get_task(config)
  load = task.load_data

  def interrupting(config):
    loaded = load(config)
    return dataclasses.replace(loaded, train=InterruptAt(loaded.train, at))

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(task, "load_data", interrupting)
    yield


def check_ok(proc) -> None:
  assert proc.returncode == 0, f"trainer failed:\n{proc.stderr[-4000:]}"


def losses(workdir) -> dict[int, float]:
  """``{step: training loss}`` from a run's ``metrics.jsonl``."""
  return {r["step"]: r["loss"] for r in metrics.read_metrics(workdir) if "loss" in r}


def checkpoint_steps(workdir) -> list[int]:
  """The steps of a run's complete checkpoints, in order."""
  ckpt_dir = pathlib.Path(workdir) / "checkpoints"
  if not ckpt_dir.exists():
    return []
  return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())


def latest_checkpoint(workdir) -> int | None:
  return max(checkpoint_steps(workdir), default=None)


@contextlib.contextmanager
def locked(path):
  """An exclusive file lock (pytest-xdist workers sharing a run)."""
  with open(path, "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def shared_run(tmp_path_factory, name: str, *overrides, base=LM_ARGS,
               in_process: bool = True) -> pathlib.Path:
  """The workdir of a finished trainer run, made once per session (shared by xdist workers).

  The run is the trainer's command line in the test process (:func:`train_here`, conftest's 8
  devices), or with ``in_process=False`` a subprocess that emulates the devices the config asks
  for. The trainer's stderr (in the test process: what it printed, then its log) is kept beside
  it, as ``<name>.stderr``. Tests must not write into the workdir: copy it first.
  """
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # The session's directory, shared by the workers.
  workdir = root / name
  with locked(root / f"{name}.lock"):
    done = root / f"{name}.DONE"
    if not done.exists():
      proc = (train_here if in_process else train)(workdir, *overrides, base=base)
      check_ok(proc)
      (root / f"{name}.stderr").write_text(proc.stderr)
      done.write_text("ok")
  return workdir


def stderr_of(workdir) -> str:
  """The stderr of a :func:`shared_run`."""
  workdir = pathlib.Path(workdir)
  return (workdir.parent / f"{workdir.name}.stderr").read_text()


def lm_reference(tmp_path_factory) -> pathlib.Path:
  """The uninterrupted tiny LM run (:data:`LM_ARGS`)."""
  return shared_run(tmp_path_factory, "lm_reference")


def lm_single_device(tmp_path_factory) -> pathlib.Path:
  """The tiny LM run on one device (no pipeline, no data parallelism) on the pipelined run's
  micro-batches: the plain float32 run of the numerics rule. A subprocess, so that the process
  has that one device only."""
  return shared_run(tmp_path_factory, "lm_single_device", *SINGLE_DEVICE, in_process=False)


def convnet_reference(tmp_path_factory) -> pathlib.Path:
  """The uninterrupted tiny convnet run (:data:`CONVNET_ARGS`)."""
  return shared_run(tmp_path_factory, "convnet_reference", base=CONVNET_ARGS)


def lm_config():
  """The config of :data:`LM_ARGS`, for experiments built in the test process."""
  from configs import lm  # pylint: disable=g-import-not-at-top
  config = lm.get_config("size=tiny")
  config.num_steps = NUM_STEPS
  config.num_stages, config.num_data, config.num_microbatches = 4, 2, 8
  return config


@functools.cache
def lm_experiment():
  """The tiny LM run's experiment in this process (conftest's 8 CPU devices), built once."""
  return experiment.build(lm_config())


def restore(workdir, step: int, exp=None):
  """A run's checkpoint at ``step`` restored in this process: (logical state on the host, data
  iterator state). ``exp`` is the experiment whose checkpoint layout to read (the tiny LM's by
  default)."""
  exp = exp or lm_experiment()
  ckpt = checkpointing.Checkpointer(pathlib.Path(workdir) / "checkpoints")
  try:
    state, data_state = ckpt.restore(step, exp.abstract_checkpoint())  # The logical layout.
  finally:
    ckpt.close()
  return jax.device_get(state), data_state


def _optimizer_on_logical_params(config, params) -> optax.GradientTransformation:
  """The trainer's optimizer written out with optax on logical parameters (the experiment's
  works on staged ones): AdamW after global-norm clipping, linear warm-up then cosine decay, weight
  decay on matrices and embeddings only (named as ``translate.DECAYED_NAMES`` says)."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate,
      warmup_steps=min(config.warmup_steps, config.num_steps),
      decay_steps=max(config.num_steps, config.warmup_steps + 1),
      end_value=config.learning_rate * 0.1)
  decayed = jax.tree_util.tree_map_with_path(
      lambda path, _: path[-1].key in translate.DECAYED_NAMES, params)
  return optax.chain(optax.clip_by_global_norm(config.grad_clip),
                     optax.scale_by_adam(b1=0.9, b2=0.95),
                     optax.add_decayed_weights(config.weight_decay, decayed),
                     optax.scale_by_learning_rate(schedule))


@functools.cache
def _lm_plain_run():
  """``(run, params, batches)``: the plain LM's training run as a jitted ``run(params, batches)
  -> losses`` (its dtype that of ``params``), the trainer's initial logical parameters and its
  first :data:`NUM_STEPS` batches (stacked)."""
  config = lm_config()
  exp = lm_experiment()
  params = jax.device_get(exp.to_checkpoint(exp.init_state(jax.random.key(config.seed))).params)
  train_iter = exp.task.load_data(config).train
  batches = [next(train_iter) for _ in range(NUM_STEPS)]
  if hasattr(train_iter, "close"):
    train_iter.close()
  batches = {k: np.stack([b[k] for b in batches]) for k in ("inputs", "targets")}

  def run(params, batches):
    dtype = params_dtype(params)
    model = models.decoder_lm(**dict(tasks.lm_arguments(config), dtype=dtype, param_dtype=dtype),
                              num_stages=1, num_microbatches=1)
    optimizer = _optimizer_on_logical_params(config, params)

    def step(carry, batch):
      params, opt_state = carry
      loss, grads = jax.value_and_grad(lambda p: model.apply(
          {"params": p}, batch["inputs"], targets=batch["targets"]).mean())(params)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    return jax.lax.scan(step, (params, optimizer.init(params)), batches)[1]

  return jax.jit(run), params, batches


@functools.cache
def lm_plain_losses() -> np.ndarray:
  """The tiny LM run's training losses (steps 1 to :data:`NUM_STEPS`) from the plain LM (no
  pipeline, the whole batch at once) in float32, in this process: the trainer's initial
  parameters, its batches and its optimizer written out with optax
  (:func:`_optimizer_on_logical_params`)."""
  run, params, batches = _lm_plain_run()
  return np.asarray(run(params, batches))


@functools.cache
def lm_float64_losses() -> np.ndarray:
  """:func:`lm_plain_losses` in float64: the reference of the numerics rule for the trainer
  runs' logged losses."""
  return numerics.float64_reference(*_lm_plain_run())


def params_dtype(params):
  """The dtype of a parameter tree's leaves (float64 inside :func:`numerics.float64_reference`)."""
  dtypes = {jnp.dtype(a.dtype) for a in jax.tree.leaves(params)}
  assert len(dtypes) == 1, dtypes
  return dtypes.pop()


def logged_losses(workdir, steps) -> np.ndarray:
  """A run's logged training losses at ``steps``, as the float32 values the trainer computed."""
  found = losses(workdir)
  return np.asarray([found[step] for step in steps], np.float32)
