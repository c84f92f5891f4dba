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

The trainer saves the state in its **logical** form (``Experiment.to_checkpoint``): parameters
and optimizer moments as ``{"layers_i": tree}``, a repeated layer's copies stacked ``[L, ...]``,
each leaf split over the whole mesh, so a checkpoint restores into any layout and
:func:`read_layer` reads one layer's weights without the model or its mesh.

Example::

  ckpt = Checkpointer("/tmp/lm/checkpoints", max_to_keep=3)
  ckpt.save(100, state, iterator.get_state())
  state, data_state = ckpt.restore(ckpt.latest_step(), exp.abstract_state())

  # One layer, on any machine: copy 5 of the repeated block (layers_1), as NumPy arrays.
  weights = read_layer("/tmp/lm/checkpoints", 100, "layers_1", copy=5)
"""

from __future__ import annotations

import os
import signal
from typing import Any

from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts


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
    handle_sigterm: in a single-process run, turn SIGTERM and SIGINT (Ctrl-C) into a preemption
      notice (the trainer saves and stops at the next step) instead of dying at once; a second
      Ctrl-C stops at once, without saving.
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
    self.signal_name = None  # The signal that asked to stop ("SIGTERM", "SIGINT"), if any.
    self._previous_handlers = {}  # Restored by close().
    if handle_sigterm and jax.process_count() == 1:
      for signum in (signal.SIGTERM, signal.SIGINT):
        try:
          self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        except ValueError:  # Not the main thread: rely on jax.distributed's notice only.
          pass

  def _on_signal(self, signum, frame):
    del frame
    if signum == signal.SIGINT and self._sigterm:  # A second Ctrl-C: stop now.
      signal.signal(signal.SIGINT, signal.default_int_handler)
      raise KeyboardInterrupt
    self._sigterm = True
    self.signal_name = signal.Signals(signum).name

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
    for signum, handler in self._previous_handlers.items():
      signal.signal(signum, handler)
    self._previous_handlers = {}


def read_layer(directory: str | os.PathLike, step: int, layer: str, *, copy: int | None = None,
               collection: tuple[str, ...] = ("params",)) -> dict[str, Any]:
  """One layer's arrays from a checkpoint the trainer wrote, without building the model.

  Reads through TensorStore only the chunks that hold the layer (for a copy of a repeated
  layer, the chunks holding that copy), on the host; no devices, mesh or config needed.

  Args:
    directory: the checkpoint directory (``workdir/checkpoints``).
    step: the checkpoint's step.
    layer: the layer's logical name, ``"layers_i"``.
    copy: for a repeated layer, which copy (its index on the stacked axis); None for the whole
      stack, and always None for a layer that is not repeated (an index there would pick a row
      of each of its arrays).
    collection: where in the state: ``("params",)``, or e.g. ``("opt_state", "1", "mu")`` for
      AdamW's first moments (the path of keys in the saved ``TrainState``).

  Returns:
    The layer's tree of NumPy arrays (``{"mlp_in": {"kernel": ...}, ...}``).

  Raises:
    ValueError: no such step, layer or collection, or ``copy`` out of range.
  """
  root = epath.Path(resolve_directory(directory)) / str(step) / "state"
  if not root.exists():
    raise ValueError(f"No checkpoint of step {step} in {directory} (no {root}).")
  tree = ocp.StandardCheckpointer().metadata(root).item_metadata.tree
  node, where = tree, "the state"
  for key in tuple(collection) + (layer,):
    if isinstance(node, (list, tuple)) and str(key).isdigit() and int(key) < len(node):
      node = node[int(key)]
    elif isinstance(node, dict) and key in node:
      node = node[key]
    else:
      have = (sorted(node) if isinstance(node, dict) else f"{len(node)} entries"
              if isinstance(node, (list, tuple)) else type(node).__name__)
      raise ValueError(f"The checkpoint has no {key!r} in {where}; it has {have}.")
    where = f"{where}/{key}"
  context = ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": 64 << 20}})

  def read(meta):
    info = ocp.type_handlers.ParamInfo(name=meta.name, path=root / meta.name, parent_dir=root,
                                       is_ocdbt_checkpoint=True, ts_context=context)
    array = ts.open(ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=True),
                    context=context).result()
    if copy is None:
      return np.asarray(array.read().result())
    if not array.shape or not 0 <= copy < array.shape[0]:
      raise ValueError(f"copy={copy} is out of range for {meta.name} of shape "
                       f"{tuple(array.shape)} (a repeated layer's copies are its first axis).")
    return np.asarray(array[copy].read().result())

  return jax.tree.map(read, node, is_leaf=lambda x: hasattr(x, "name") and hasattr(x, "shape"))
