"""Orbax checkpoints of the training state and the data iterator position.

A checkpoint at step ``n`` holds two items:

* ``state``: the ``tpipe.TrainState`` after ``n`` updates (params, optimizer state, step), saved
  sharded as it lives on the devices and restored into the layout of an abstract state;
* ``data``: JSON, the trainer's grain iterator state after ``n`` batches (so a resumed run reads
  the same batches an uninterrupted run would) and what it depends on (batch size, sequence
  length, seed, corpus hash, checked on resume).

Saves are asynchronous; Orbax writes to a temporary directory and renames it when complete, so a
crash during a save leaves the previous checkpoint usable. ``reached_preemption`` reports a
preemption notice (TPU maintenance events through ``jax.distributed``, or SIGTERM here).

Example::

  ckpt = Checkpointer("/tmp/lm/checkpoints", max_to_keep=3)
  ckpt.save(100, state, iterator.get_state())
  state, data_state = ckpt.restore(ckpt.latest_step(), exp.abstract_state())
"""

from __future__ import annotations

import os
import signal
from typing import Any

from etils import epath
import jax
import orbax.checkpoint as ocp


def resolve_directory(directory: str | os.PathLike) -> str:
  """The directory as Orbax wants it: local paths made absolute, ``gs://...`` kept as it is.

  Pass remote paths as strings or ``etils.epath.Path``; ``pathlib.Path("gs://b/run")`` has
  already collapsed the ``//`` into ``gs:/b/run``, a local path.
  """
  directory = os.fspath(directory)
  if "://" not in directory:
    directory = os.path.abspath(directory)
  return directory


def checkpoint_directory(workdir: str | os.PathLike) -> str:
  """A run's checkpoint directory, ``workdir/checkpoints``, resolved as :func:`resolve_directory`.

  Args:
    workdir: the run's directory, e.g. ``/tmp/lm`` or ``gs://bucket/run``.

  Returns:
    ``/abs/path/checkpoints`` or ``gs://bucket/run/checkpoints``.
  """
  return resolve_directory(epath.Path(workdir) / "checkpoints")


class Checkpointer:
  """A thin wrapper over ``orbax.checkpoint.CheckpointManager`` for state + iterator.

  Args:
    directory: where step directories go (created if missing): a local path, or a remote one
      such as ``gs://bucket/run/checkpoints`` (a string or ``etils.epath.Path``).
    max_to_keep: how many recent checkpoints to keep.
    async_save: save in a background thread (default True).
    handle_sigterm: in a single-process run, turn SIGTERM into a preemption notice (the trainer
      saves and stops at the next step) instead of dying at once.
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3,
               async_save: bool = True, handle_sigterm: bool = False):
    if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
      raise ValueError(f"max_to_keep must be an int >= 1, got {max_to_keep!r}.")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True)
    self._manager = ocp.CheckpointManager(
        resolve_directory(directory), options=options, item_names=("state", "data"))
    self._sigterm = False
    self._previous_sigterm_handler = None  # Restored by close().
    if handle_sigterm and jax.process_count() == 1:
      try:
        self._previous_sigterm_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
      except ValueError:  # Not the main thread: rely on jax.distributed's notice only.
        pass

  def _on_sigterm(self, signum, frame):
    del signum, frame
    self._sigterm = True

  @property
  def directory(self):
    return self._manager.directory

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, data_state: Any) -> None:
    """Starts saving ``state`` and the iterator state ``data_state`` as step ``step``."""
    self._manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state)),
        force=True)

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, Any]:
    """Restores step ``step`` into the shapes, dtypes and shardings of ``abstract_state``.

    Args:
      step: a step from :meth:`all_steps`.
      abstract_state: a pytree of ``jax.ShapeDtypeStruct`` with shardings (e.g.
        ``Experiment.abstract_state()``).

    Returns:
      ``(state, data_state)``.
    """
    restored = self._manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=ocp.args.JsonRestore()))
    return restored.state, restored.data

  def reached_preemption(self, step: int) -> bool:
    """True when the run should save and stop: a preemption notice or SIGTERM arrived."""
    return self._sigterm or self._manager.reached_preemption(step)

  def wait_until_finished(self) -> None:
    """Blocks until pending asynchronous saves are complete."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves, closes the manager and restores the previous SIGTERM handler."""
    self._manager.wait_until_finished()
    self._manager.close()
    if self._previous_sigterm_handler is not None:
      signal.signal(signal.SIGTERM, self._previous_sigterm_handler)
      self._previous_sigterm_handler = None
