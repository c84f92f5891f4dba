"""Tests for tpipe.train.cli.metrics: remote workdirs, the resumed writer and a torn metrics
file."""

import pathlib
import struct

import pytest

from tpipe.train.cli import metrics

pytestmark = pytest.mark.unit


def test_remote_workdir_paths_stay_remote(tmp_path, monkeypatch):
  # pathlib would collapse gs://bucket/run to gs:/bucket/run, a local folder named "gs:".
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
