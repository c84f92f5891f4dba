r"""Writes documents to an ArrayRecord file once, for fast reuse as ``config.data``.

Usage::

  python -m tpipe.train.cli.write_corpus --data='raw/*.jsonl' --text_field=text \
      --out=data/corpus.arrayrecord
  python -m tpipe.train --config=configs/lm.py --workdir=/tmp/run \
      --config.data=data/corpus.arrayrecord --config.tokenizer=data/tokenizer.json

Each record is one document's UTF-8 text, in the order :func:`tpipe.train.sources.read` reads
the inputs (files sorted by path), so a run on the ArrayRecord file reads the same documents as
a run on the inputs: the JSON or Parquet is parsed once, here, and grain reads the records by
index. The evaluation split by ``eval_fraction`` hashes the file name and record index, so it
differs from the inputs' split; give ``--config.eval_data`` files to fix it.
"""

from __future__ import annotations

import pathlib

from absl import app
from absl import flags

from tpipe.train import sources
from tpipe.train.cli import startup


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines the command line's flags (called when run as a program)."""
  flags.DEFINE_string(
      "data", None,
      "Input files: a path or glob, several separated by commas (text, JSONL, Parquet or "
      "ArrayRecord).")
  flags.DEFINE_string(
      "data_format", "",
      "The inputs' format; '' takes each file's from its suffix.")
  flags.DEFINE_string("text_field", "text", "The JSONL field or Parquet column with the text.")
  flags.DEFINE_string("out", None, "The ArrayRecord file to write (.arrayrecord).")


def write(documents: list[str], out: str | pathlib.Path) -> int:
  """Writes ``documents`` (strings) to the ArrayRecord file ``out``, one record each, and
  returns how many were written. An existing file is refused (nothing is overwritten)."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  out = pathlib.Path(out)
  if out.exists():
    raise ValueError(f"--out={out} exists; choose another path (nothing is overwritten).")
  out.parent.mkdir(parents=True, exist_ok=True)
  writer = array_record_module.ArrayRecordWriter(str(out), "group_size:1")
  try:
    for text in documents:
      writer.write(text.encode("utf-8"))
  finally:
    writer.close()
  return len(documents)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not FLAGS.data or not FLAGS.out:
    raise app.UsageError("--data and --out are required.")
  files = sources.expand(FLAGS.data)
  documents = sources.read(files, FLAGS.data_format, FLAGS.text_field)
  count = write([d.text for d in documents], FLAGS.out)
  print(f"Wrote {count} documents from {len(files)} files to {FLAGS.out}.")


if __name__ == "__main__":
  define_flags()
  startup.run(main)
