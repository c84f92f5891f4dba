"""Training metrics to ``metrics.jsonl`` and TensorBoard event files (tensorboardX, no TensorFlow).

``metrics.jsonl`` holds one JSON object per logged step, e.g.
``{"step": 50, "loss": 2.31, "grad_norm": 0.8, "eval_loss": 2.40}``, for scripts and notebooks.
In a multi-process run only process 0 writes; the others get a writer that does nothing.

Example::

  writer = MetricWriter("/tmp/lm", enabled=jax.process_index() == 0)
  writer.write(10, {"loss": 2.5})
  writer.close()
  read_metrics("/tmp/lm")   # [{"step": 10, "loss": 2.5}]
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any, Mapping

from absl import logging
from etils import epath

METRICS_FILE = "metrics.jsonl"


def is_remote(path: str | os.PathLike) -> bool:
  """True for a path with a scheme such as ``gs://``."""
  return "://" in os.fspath(path)


def tensorboard_logdir(workdir: str | os.PathLike) -> str:
  """Where the TensorBoard event files of ``workdir`` go.

  tensorboardX writes local paths, and ``gs://`` (``s3://``) only with ``google-cloud-storage``
  (``boto3``) installed. Without it, a remote workdir's events go to a local temporary directory,
  and a warning names it.

  Args:
    workdir: the run's directory, local or remote.

  Returns:
    A local directory or ``workdir`` itself, as a string.
  """
  workdir = os.fspath(workdir)
  if not is_remote(workdir):
    return workdir
  from tensorboardX import record_writer  # pylint: disable=g-import-not-at-top
  scheme = workdir.split("://", 1)[0]
  supported = {"gs": record_writer.GCS_ENABLED, "s3": record_writer.S3_ENABLED}
  if supported.get(scheme, False):
    return workdir
  local = tempfile.mkdtemp(prefix="tpipe-tensorboard-")
  logging.warning(
      "TensorBoard events go to the local directory %s: tensorboardX cannot write to %s "
      "without an extra package (pip install google-cloud-storage for gs://, boto3 for s3://). "
      "metrics.jsonl and checkpoints still go to %s.", local, workdir, workdir)
  return local


def _plain(value: Any) -> Any:
  """Converts NumPy/JAX scalars to Python numbers; non-finite floats become strings."""
  if hasattr(value, "item"):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)  # JSON has no NaN/inf; keep the record readable by strict parsers.
  return value


def read_metrics(workdir: str | os.PathLike) -> list[dict[str, Any]]:
  """Returns the records of ``workdir/metrics.jsonl`` in file order ([] if absent).

  A torn last line (a run killed while appending, or a file read while it is written) is
  skipped; an undecodable line before it raises ``json.JSONDecodeError``.
  """
  path = epath.Path(workdir) / METRICS_FILE
  if not path.exists():
    return []
  lines = [line for line in path.read_text().splitlines() if line.strip()]
  records = [json.loads(line) for line in lines[:-1]]
  if lines:
    try:
      records.append(json.loads(lines[-1]))
    except json.JSONDecodeError:
      logging.warning("Skipping the torn last line of %s: %r", path, lines[-1][:80])
  return records


class MetricWriter:
  """Appends step records to ``metrics.jsonl`` and scalars to TensorBoard.

  Args:
    workdir: directory for ``metrics.jsonl`` and the event files; local, or remote such as
      ``gs://bucket/run`` (see :func:`tensorboard_logdir` for where the event files go then).
    enabled: if False (processes other than 0), every method does nothing.
    purge_step: when resuming, the first step this run writes (``start + 1``): TensorBoard then
      hides the events of that step and later ones that an earlier, killed run wrote, instead of
      showing those steps twice.
  """

  def __init__(self, workdir: str | os.PathLike, *, enabled: bool = True,
               purge_step: int | None = None):
    self._enabled = enabled
    self._path = epath.Path(workdir) / METRICS_FILE
    # Object stores cannot append: a remote file is rewritten whole from ``self._records``.
    self._append = not is_remote(self._path)
    self._records = None
    self._tb = None
    if enabled:
      import tensorboardX  # pylint: disable=g-import-not-at-top  # Only process 0 needs it.
      self._path.parent.mkdir(parents=True, exist_ok=True)
      self._tb = tensorboardX.SummaryWriter(logdir=tensorboard_logdir(self._path.parent),
                                            purge_step=purge_step)

  def truncate_after(self, step: int) -> None:
    """Drops records with ``step`` greater than ``step`` (the run resumes from there).

    A run killed after its last checkpoint logged steps that the resumed run repeats; without
    this the file would hold those steps twice.
    """
    if not self._enabled or not self._path.exists():
      return
    kept = [r for r in read_metrics(self._path.parent) if r.get("step", 0) <= step]
    if not self._append:
      self._records = kept
    tmp = self._path.parent / (METRICS_FILE + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(self._path)

  def write(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Writes one record ``{"step": step, **scalars}``.

    Args:
      step: the training step.
      scalars: name -> number.
    """
    if not self._enabled:
      return
    record = {"step": int(step)}
    record.update({k: _plain(v) for k, v in scalars.items()})
    if self._append:
      with self._path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    else:
      if self._records is None:
        self._records = read_metrics(self._path.parent)
      self._records.append(record)
      self._path.write_text("".join(json.dumps(r) + "\n" for r in self._records))
    for name, value in record.items():
      if name != "step" and isinstance(value, (int, float)):
        self._tb.add_scalar(name, value, global_step=int(step))

  def flush(self) -> None:
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
      self._tb = None
