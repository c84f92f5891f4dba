r"""Trains a pipelined model from an ml_collections config file.

Usage::

  python -m tpipe.train --config=configs/lm.py --workdir=/tmp/lm
  python -m tpipe.train --config=configs/lm.py:size=tiny --workdir=/tmp/t --config.num_steps=50

  # Several processes (CPU/GPU cluster, or locally, see scripts/launch_local.sh):
  python -m tpipe.train --config=configs/lm.py --workdir=/tmp/mh \
      --coordinator_address=127.0.0.1:12345 --num_processes=2 --process_id=0   # and =1

On a CPU-only machine the trainer emulates the mesh's devices (``num_stages * num_data *
mesh.fsdp * mesh.expert * mesh.tensor``, 8 by default) unless ``JAX_NUM_CPU_DEVICES`` is set. On
a Cloud TPU VM, ``jax.distributed`` is initialised automatically, so the same command runs on
every worker of a pod slice.

Re-running the same command with the same workdir resumes from the latest checkpoint, including
the data iterator's position. A non-finite loss stops the run (exit status 1) with a message that
names the step; the poisoned state is never checkpointed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import time

from absl import app
from absl import flags
from absl import logging
from etils import epath
import jax
import ml_collections
import numpy as np
from ml_collections import config_flags

import tpipe
from tpipe.train import architecture
from tpipe.train import checkpointing
from tpipe.train import data
from tpipe.train import pretrained
from tpipe.train.cli import experiment
from tpipe.train.cli import translate
from tpipe.train.cli import metrics as metrics_lib
from tpipe.train.cli import startup
from tpipe.train.cli import step_log
from tpipe.train.cli import tasks

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file, e.g. configs/lm.py:size=tiny.", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for checkpoints and metrics: local, or e.g. gs://bucket/run "
    "(a multi-host run needs one that every host shares).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "host:port of process 0, for multi-process runs on CPU/GPU clusters (TPU VMs auto-detect).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes (with "
                                      "--coordinator_address).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's id in [0, num_processes).")
flags.mark_flags_as_required(["config", "workdir"])


class NonFiniteLossError(RuntimeError):
  """The training loss (or gradient norm) became NaN or infinite."""


# ------------------------------------------------------------------------------------------------
# Start-up: devices and processes. Must run before the first JAX computation.


def _setup_jax(config) -> None:
  """Emulates CPU devices if needed and joins the multi-process group."""
  distributed = _COORDINATOR.value is not None
  if distributed and (_NUM_PROCESSES.value is None or _PROCESS_ID.value is None):
    raise app.UsageError(
        "--coordinator_address needs --num_processes and --process_id as well.")
  if not distributed and (_NUM_PROCESSES.value is not None or _PROCESS_ID.value is not None):
    raise app.UsageError("--num_processes/--process_id need --coordinator_address=HOST:PORT.")
  # The CPU backend's device count only matters when CPU is the platform; on TPU/GPU hosts it is
  # harmless. Each process emulates its share of the mesh.
  if startup.user_cpu_device_count() is None:
    num_processes = _NUM_PROCESSES.value or 1
    needed = startup.num_devices(config)
    if needed % num_processes:
      raise app.UsageError(
          f"num_stages * num_data * mesh.fsdp * mesh.expert * mesh.tensor = {needed} devices "
          "do not split "
          "evenly over "
          f"--num_processes={num_processes}.")
    jax.config.update("jax_num_cpu_devices", needed // num_processes)
  startup.quiet_absent_tpu()
  if distributed:
    jax.distributed.initialize(
        coordinator_address=_COORDINATOR.value,
        num_processes=_NUM_PROCESSES.value,
        process_id=_PROCESS_ID.value)
  elif importlib.util.find_spec("libtpu") is not None and startup.tpu_host():
    # A Cloud TPU VM: a no-op on one host, joins all workers on a pod slice.
    try:
      jax.distributed.initialize()
    except (RuntimeError, ValueError) as e:  # libtpu installed but no TPU cluster here.
      logging.warning("jax.distributed.initialize() failed (%s); running single-process.", e)


# ------------------------------------------------------------------------------------------------
# Helpers.


class _QuietLibraries:
  """absl log filter: drops INFO records from Orbax and Grain (one line per file they touch)."""

  def filter(self, record) -> bool:
    noisy = any(f"/{lib}/" in record.pathname for lib in ("orbax", "grain", "etils"))
    return record.levelno >= 30 or not noisy  # 30 = WARNING.


def _non_finite(what: str, step: int, last_checkpoint: int | None,
                ckpt_dir) -> NonFiniteLossError:
  where = (f"the last good checkpoint is step {last_checkpoint} in {ckpt_dir}"
           if last_checkpoint is not None else "no checkpoint was written")
  return NonFiniteLossError(
      f"Non-finite {what} at step {step}; stopping without checkpointing this state ({where}). "
      f"Lower the learning rate or check the data.")


def _check_finite(step: int, metrics: dict, last_checkpoint: int | None, ckpt_dir) -> None:
  for name in ("loss", "grad_norm"):
    value = float(metrics[name])
    if not math.isfinite(value):
      raise _non_finite(f"{name} ({value})", step, last_checkpoint, ckpt_dir)


def validate_train_config(config) -> None:
  """Checks the fields the training loop reads; raises ValueError naming the fix.

  It needs no devices, so ``main`` calls it before anything else. ``translate.validate_config``
  checks the model, mesh and task fields.

  Args:
    config: an experiment config (``configs/lm.py``, ``configs/convnet.py``).
  """
  for name in ("log_every", "eval_every", "checkpoint_every", "keep_checkpoints"):
    value = config.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"config.{name} must be an int >= 1, got {value!r}.")
  profile = startup.parse_profile_steps(config.get("profile_steps", ""))
  if profile and profile[1] > config.num_steps:
    raise ValueError(f"config.profile_steps={config.profile_steps!r} ends after "
                     f"config.num_steps={config.num_steps}; profile steps up to num_steps.")
  peak = config.get("peak_tflops", 0.0)
  if isinstance(peak, bool) or not isinstance(peak, (int, float)) or peak < 0:
    raise ValueError(f"config.peak_tflops must be a number >= 0 (0: from the device kind), "
                     f"got {peak!r}.")
  tasks.get_task(config).validate(config)


def _check_same_data(saved: dict, current: dict, ckpt_dir) -> None:
  """Raises ValueError if a checkpoint's data spec differs from this run's."""
  for name, was in saved.items():
    now = current.get(name)
    if now == was:
      continue
    if name in ("corpus_sha256", "data_sha256"):
      raise ValueError(
          f"the training corpus differs from the one the checkpoint in {ckpt_dir} was trained "
          f"on (another Python's standard library?), so resuming would not continue the same "
          f"data stream. Use a new --workdir, or resume with the original Python.")
    raise ValueError(
        f"config.{name} changed since the checkpoint in {ckpt_dir} was saved (was {was!r}, now "
        f"{now!r}), so resuming would not continue the same data stream. Use a new --workdir, "
        f"or resume with --config.{name}={was!r}.")


def _plain(value):
  """A config value as JSON has it (tuples as lists), for comparing with ``config.json``."""
  return json.loads(json.dumps(value))


def _has_checkpoint(workdir) -> bool:
  directory = workdir / "checkpoints"
  return directory.exists() and any(p.name.isdigit() for p in directory.iterdir())


def check_workdir(config, workdir) -> None:
  """Refuses to resume a workdir whose run had other model or data fields.

  The run's ``config.json`` holds the (resolved) config it started with; every model and data
  field (:meth:`resume_fields`) must be the same, or the checkpoint would not fit the model or
  the data stream would not continue. One error names each changed field, old -> new, and the
  ways out.

  Raises:
    ValueError: a field changed.
  """
  config_file = workdir / "config.json"
  if not config_file.exists() or not _has_checkpoint(workdir):
    return
  saved = json.loads(config_file.read_text())
  changed = [(name, saved[name], _plain(config.get(name)))
             for name in resume_fields(config)
             if name in saved and saved[name] != _plain(config.get(name))]
  if not changed:
    return
  listed = ", ".join(f"config.{name} {old!r} -> {new!r}" for name, old, new in changed)
  keep = " ".join(f"--config.{name}={old!r}" if isinstance(old, str) else
                  f"--config.{name}={old}" for name, old, _ in changed)
  raise ValueError(
      f"the workdir {workdir} holds a run with other model or data fields: {listed}. Use a new "
      f"--workdir, or start a new run from this one's weights with --workdir=NEW "
      f"--config.init_from={workdir} (resuming here needs the old values: {keep}).")


def resume_fields(config) -> tuple[str, ...]:
  """The config fields a resumed run must keep: the model's and the data's."""
  task = tasks.get_task(config)
  if task.name == "lm":
    return tuple(dict.fromkeys(architecture.FIELDS + task.data_fields + task.file_data_fields))
  return tuple(dict.fromkeys(task.fields + task.data_fields))


# ------------------------------------------------------------------------------------------------
# The training loop.


def _restore_or_init(exp, ckpt, train_iter, data_spec, is_chief: bool):
  """The state to start from and its step: the latest checkpoint's (the data iterator moved to
  its position), else a new state at step 0."""
  start = ckpt.latest_step()
  if start is None:
    state = exp.init_state(jax.random.key(exp.config.seed))
    source = exp.config.get("init_from", "")
    if source:
      state = _with_pretrained_params(exp, state, source)
      if is_chief:
        logging.info("Initialised the parameters from %s (%s).", source,
                     exp.config.get("family", "") or "a tpipe run")
    return state, 0
  # Checkpoints hold the logical layout, so a run resumes on another mesh or split.
  logical_state, data_state = ckpt.restore(start, exp.abstract_checkpoint())
  state = exp.from_checkpoint(logical_state)
  del logical_state
  if "iterator" in data_state:  # Checkpoints from before the data spec hold the state alone.
    _check_same_data(data_state["spec"], data_spec, ckpt.directory)
    data_state = data_state["iterator"]
  train_iter.set_state(data_state)
  if int(state.step) != start:
    raise RuntimeError(f"checkpoint {start} holds state.step={int(state.step)}.")
  if is_chief:
    logging.info("Resumed from step %d (%s).", start, ckpt.directory)
  return state, start


def _with_pretrained_params(exp, state, source: str):
  """``state`` with the parameters of the model in ``source`` (a Hugging Face checkpoint
  directory or a workdir), which must have the shapes of this experiment's."""
  params = pretrained.load_params(source, pretrained.architecture_of(source))
  expected = exp.layout.logical
  shapes = lambda tree: {jax.tree_util.keystr(path): tuple(leaf.shape)
                         for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}
  found, wanted = shapes(params), shapes(expected)
  wrong = sorted(k for k in set(found) | set(wanted) if found.get(k) != wanted.get(k))
  if wrong:
    listed = "; ".join(f"{k}: {found.get(k)} there, {wanted.get(k)} in the model"
                       for k in wrong[:3])
    raise ValueError(f"the parameters in config.init_from={source!r} do not fit the model "
                     f"({listed}).")
  logical = exp.to_checkpoint(state)
  params = jax.tree.map(lambda a, s: np.asarray(a, s.dtype), params, expected)
  return exp.from_checkpoint(logical.replace(params=params))


def resumed_config(config, workdir):
  """``config``, or, when it resumes a run that started from ``config.init_from``, a copy
  whose ``init_from`` is the workdir itself: the checkpoint holds the weights and the workdir's
  ``config.json`` the architecture, so the directory the run started from is only read when a
  run starts (it may be gone by the time the run resumes)."""
  resuming = ("://" not in str(workdir) and _has_checkpoint(workdir)
              and (workdir / "config.json").exists())
  if not config.get("init_from", "") or not resuming:
    return config
  resumed = ml_collections.ConfigDict(config.to_dict())
  resumed.init_from = str(workdir)
  return resumed


def _write_config(config, workdir, start: int) -> None:
  """``config.json``: the config the run started with (a resumed run keeps it)."""
  config_file, config_json = workdir / "config.json", config.to_json(indent=2)
  without_source = lambda text: {k: v for k, v in json.loads(text).items() if k != "init_from"}
  if start == 0 or not config_file.exists():
    config_file.write_text(config_json)
  elif without_source(config_file.read_text()) != without_source(config_json):
    logging.warning("This run's config differs from %s, the config the run in this workdir "
                    "started with; keeping that file.", config_file)


@jax.jit
def _all_finite(tree) -> jax.Array:
  """Whether every element of ``tree`` is finite."""
  return jax.tree.reduce(lambda a, b: a & b,
                         jax.tree.map(lambda x: jax.numpy.isfinite(x).all(), tree))


def _start_profile(profile, profile_dir, is_chief: bool) -> None:
  """Starts the profiler trace of steps ``profile[0]`` to ``profile[1]``."""
  jax.profiler.start_trace(str(profile_dir))
  if is_chief:
    logging.info("Profiling steps %d to %d into %s (XProf: tensorboard --logdir=%s).",
                 profile[0], profile[1], profile_dir, profile_dir)


def _stop_preempted(ckpt, step: int, is_chief: bool) -> None:
  """After a preemption's checkpoint: waits for it and says how to resume."""
  ckpt.wait_until_finished()
  if is_chief:
    why = f"Stopped by {ckpt.signal_name}" if ckpt.signal_name else "Preempted"
    logging.warning("%s at step %d; checkpoint saved in %s/%d. Re-run the same command to "
                    "resume.", why, step, ckpt.directory, step)


def _load_data(exp, config, sharding):
  """``(train iterator, its data spec, eval batches)``: every process builds the whole global
  batch; devices take their slices."""
  task_data = exp.task.load_data(config)
  eval_set = [data.to_global(b, sharding) for b in task_data.eval_batches]
  return task_data.train, task_data.spec, eval_set


def _check_pending(pending: list, last_checkpoint, directory) -> dict:
  """The host's sync point: every pending step's metrics checked, in order, before anything
  is saved; the last one's loss and gradient norm. Empties ``pending``."""
  host = jax.device_get([m for _, m in pending])
  for (step, _), metrics in zip(pending, host):
    _check_finite(step, metrics, last_checkpoint, directory)
  pending.clear()
  return {"loss": float(host[-1]["loss"]), "grad_norm": float(host[-1]["grad_norm"])}


def _close_run(profiling: bool, ckpt, writer, train_iter) -> None:
  """Stops a profile still running, waits for pending saves (so the last good checkpoint is
  complete) and closes the writer and the data iterator."""
  if profiling:
    jax.profiler.stop_trace()  # Stopped inside the profiled steps.
  ckpt.close()
  writer.close()
  if hasattr(train_iter, "close"):  # Releases grain's prefetch threads (grain 0.2.18 has it).
    train_iter.close()


def train(config, workdir: str) -> dict:
  """Trains (or resumes) the experiment ``config`` in ``workdir``.

  Args:
    config: an experiment config (``configs/lm.py``).
    workdir: directory for checkpoints, ``metrics.jsonl`` and TensorBoard events; local, or
      remote such as ``gs://bucket/run`` (which every host of a multi-host run can reach).

  Returns:
    The last logged metrics record.
  """
  validate_train_config(config)
  workdir = epath.Path(workdir)  # Unlike pathlib, keeps gs://bucket/... intact.
  if tasks.get_task(config).name == "lm":
    config = architecture.resolve(resumed_config(config, workdir))
  translate.validate_config(config)
  is_chief = jax.process_index() == 0
  check_workdir(config, workdir)
  exp = experiment.build(config)
  sharding = tpipe.data_sharding(exp.mesh)
  if is_chief:
    step_log.log_pipeline(exp, config)

  train_iter, data_spec, eval_set = _load_data(exp, config, sharding)

  ckpt = checkpointing.Checkpointer(checkpointing.checkpoint_directory(workdir),
                                    max_to_keep=config.keep_checkpoints, handle_sigterm=True)
  rates = step_log.rates(exp)
  if is_chief:
    step_log.log_setup(exp, workdir, ckpt.directory, rates)
  profile = startup.parse_profile_steps(config.get("profile_steps", ""))
  profile_dir = workdir / "profile"
  state, start = _restore_or_init(exp, ckpt, train_iter, data_spec, is_chief)
  last_checkpoint = start or None
  writer = metrics_lib.MetricWriter(workdir, enabled=is_chief,
                                    purge_step=start + 1 if start else None)
  writer.truncate_after(start)
  if is_chief:
    _write_config(exp.config, workdir, start)

  step_key = jax.random.key(config.seed + 1)
  pending = []  # (step, device metrics) not yet checked on the host.
  record = {}
  t_last, step_last = None, start

  if start == 0:  # A baseline for the eval curve (in the log only).
    step_log.log_initial_eval(exp, state, eval_set, is_chief)

  eval_seconds = 0.0  # Evaluating and saving since the last logged step (not in the rates).
  try:
    for step in range(start + 1, config.num_steps + 1):
      if profile and step == profile[0]:
        _start_profile(profile, profile_dir, is_chief)
      batch = data.to_global(next(train_iter), sharding)
      rng = jax.random.fold_in(step_key, step)
      terms = None
      if exp.loss_terms_step is not None and step_log.logs_at(step, config):
        # The loss's terms on the step's batch and parameters, before the step donates them.
        terms = exp.loss_terms_step(state, batch, rng)
      state, step_metrics = exp.train_step(state, batch, rng)
      pending.append((step, step_metrics))
      if profile and step == profile[1]:
        jax.block_until_ready(state)
        jax.profiler.stop_trace()

      is_last = step == config.num_steps
      do_eval = step % config.eval_every == 0 or is_last
      do_ckpt = step % config.checkpoint_every == 0 or is_last
      preempted = ckpt.reached_preemption(step)
      do_ckpt = do_ckpt or preempted
      do_log = step % config.log_every == 0 or do_eval or do_ckpt
      if not do_log:
        continue

      record = _check_pending(pending, last_checkpoint, ckpt.directory)
      if terms is not None:
        record.update(step_log.loss_terms_record(terms, config))
      if do_eval:
        began = time.perf_counter()
        record.update(exp.evaluate(state, eval_set))
        eval_seconds += time.perf_counter() - began

      now = time.perf_counter()
      step_log.log_step(writer, record, step, config.num_steps,
                        (t_last, step_last, now, eval_seconds), is_chief, rates)
      t_last, step_last, eval_seconds = now, step, 0.0

      if do_ckpt:
        if not bool(_all_finite(state.params)):
          raise _non_finite("parameters", step, last_checkpoint, ckpt.directory)
        began = time.perf_counter()
        ckpt.save(step, exp.to_checkpoint(state),
                  {"iterator": train_iter.get_state(), "spec": data_spec})
        eval_seconds += time.perf_counter() - began  # Left out of the next step rate too.
        last_checkpoint = step
        if is_chief:
          logging.info("Saving the checkpoint of step %d to %s/%d.", step, ckpt.directory, step)
      if preempted:
        _stop_preempted(ckpt, step, is_chief)
        break
  finally:
    profiling = bool(profile) and profile[0] <= step_last < profile[1]
    _close_run(profiling, ckpt, writer, train_iter)
  record["step"] = step_last
  record["checkpoint"] = last_checkpoint
  return record


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  logging.get_absl_handler().addFilter(_QuietLibraries())
  validate_train_config(config)  # Before any work; a ValueError exits 2 (startup.run).
  _setup_jax(config)
  try:
    final = train(config, _WORKDIR.value)
  except NonFiniteLossError as e:
    logging.error("%s", e)
    print(f"ERROR: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
  if jax.process_index() == 0:
    saved = (f"the last checkpoint is step {final['checkpoint']} in "
             f"{checkpointing.checkpoint_directory(_WORKDIR.value)}"
             if final.get("checkpoint") else "no checkpoint was written")
    summary = " | ".join(f"{k} {final[k]:.4f}" for k in ("loss", "eval_loss", "eval_accuracy")
                         if k in final)
    logging.info("Done at step %d of %d: %s; %s.", final["step"], config.num_steps,
                 summary or "no step run", saved)
