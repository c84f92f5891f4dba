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
import pathlib
from typing import Any, Mapping

METRICS_FILE = "metrics.jsonl"


def _plain(value: Any) -> Any:
  """Converts NumPy/JAX scalars to Python numbers; non-finite floats become strings."""
  if hasattr(value, "item"):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)  # JSON has no NaN/inf; keep the record readable by strict parsers.
  return value


def read_metrics(workdir: str | os.PathLike) -> list[dict[str, Any]]:
  """Returns the records of ``workdir/metrics.jsonl`` in file order ([] if absent)."""
  path = pathlib.Path(workdir) / METRICS_FILE
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricWriter:
  """Appends step records to ``metrics.jsonl`` and scalars to TensorBoard.

  Args:
    workdir: directory for ``metrics.jsonl`` and the event files.
    enabled: if False (processes other than 0), every method does nothing.
  """

  def __init__(self, workdir: str | os.PathLike, *, enabled: bool = True):
    self._enabled = enabled
    self._path = pathlib.Path(workdir) / METRICS_FILE
    self._tb = None
    if enabled:
      import tensorboardX  # Imported lazily: only process 0 needs it.
      self._path.parent.mkdir(parents=True, exist_ok=True)
      self._tb = tensorboardX.SummaryWriter(logdir=str(self._path.parent))

  def truncate_after(self, step: int) -> None:
    """Drops records with ``step`` greater than ``step`` (the run resumes from there).

    A run killed after its last checkpoint logged steps that the resumed run repeats; without
    this the file would hold those steps twice.
    """
    if not self._enabled or not self._path.exists():
      return
    kept = [r for r in read_metrics(self._path.parent) if r.get("step", 0) <= step]
    tmp = self._path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, self._path)

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
    with self._path.open("a") as f:
      f.write(json.dumps(record) + "\n")
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
