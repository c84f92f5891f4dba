"""Documents from files: plain text, JSONL, Parquet and ArrayRecord, in a fixed order.

``config.data`` is one glob or several separated by commas (``"data/*.jsonl"``,
``"a.parquet,b.parquet"``); the files are read sorted by path. The format comes from the
suffix, or from ``config.data_format`` for every file:

* ``text`` (``.txt``, ``.md``, ``.py``, ...): each file is one document;
* ``jsonl`` (``.jsonl``, ``.json``): one JSON object per line, the document in its
  ``text_field``;
* ``parquet`` (``.parquet``, via pyarrow): one document per row of the ``text_field`` column;
* ``arrayrecord`` (``.arrayrecord``, ``.array_record``, read with grain's
  ``ArrayRecordDataSource``): one UTF-8 document per record, as
  ``python -m tpipe.train.cli.write_corpus`` writes them.

Each document is named by its file and its index there (:class:`Document`), which
:func:`split` hashes to hold out an evaluation share that does not depend on the order or number
of files::

  documents = read(expand("data/*.jsonl"), text_field="text")
  train, held_out = split(documents, eval_fraction=0.05)
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import pathlib
from typing import Iterator

FORMATS = ("text", "jsonl", "parquet", "arrayrecord")
_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet",
             ".arrayrecord": "arrayrecord", ".array_record": "arrayrecord"}


@dataclasses.dataclass(frozen=True)
class Document:
  """One document: its text, the file it came from and its index in that file."""

  text: str
  file: str
  index: int


def expand(patterns: str) -> list[pathlib.Path]:
  """The files ``patterns`` (globs separated by commas) match, sorted, without duplicates.

  Raises:
    ValueError: a pattern matches no file.
  """
  if not isinstance(patterns, str) or not patterns.strip():
    raise ValueError(f"config.data must be 'stdlib' or a path or glob of data files, got "
                     f"{patterns!r}.")
  files = set()
  for pattern in filter(None, (p.strip() for p in patterns.split(","))):
    found = [pathlib.Path(p) for p in glob.glob(str(pathlib.Path(pattern).expanduser()),
                                                recursive=True)]
    found = [p for p in found if p.is_file()]
    if not found:
      raise ValueError(f"data pattern {pattern!r} matches no file; give a path or glob of "
                       f"{'/'.join(FORMATS)} files (several separated by commas).")
    files.update(found)
  return sorted(files)


def format_of(path: pathlib.Path | None, data_format: str = "") -> str:
  """The format of ``path``: ``data_format`` when given, else from the suffix (text when the
  suffix is none of the others). ``path`` None only checks ``data_format``."""
  if data_format:
    if data_format not in FORMATS:
      raise ValueError(f"config.data_format={data_format!r} is not one of {FORMATS} (or '' to "
                       "take each file's format from its suffix).")
    return data_format
  if path is None:
    return ""
  return _SUFFIXES.get(path.suffix.lower(), "text")


def _jsonl(path: pathlib.Path, text_field: str) -> Iterator[str]:
  with path.open(encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{number} is not JSON ({error.msg}); a JSONL file holds one "
                         "object per line.") from None
      if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{path}:{number} has no text field {text_field!r} (it has {keys}); "
                         "set --config.text_field.")
      yield record[text_field]


def _parquet(path: pathlib.Path, text_field: str) -> Iterator[str]:
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top  # The train extra.
  names = pq.read_schema(path).names
  if text_field not in names:
    raise ValueError(f"{path} has no column {text_field!r} (it has {names}); set "
                     "--config.text_field.")
  for value in pq.read_table(path, columns=[text_field]).column(text_field).to_pylist():
    yield value or ""


def _arrayrecord(path: pathlib.Path) -> Iterator[str]:
  import grain  # pylint: disable=g-import-not-at-top
  source = grain.sources.ArrayRecordDataSource([str(path)])
  for i in range(len(source)):
    yield source[i].decode("utf-8")


def read_file(path: pathlib.Path, data_format: str = "", text_field: str = "text"
              ) -> Iterator[str]:
  """The documents of one file, in order."""
  kind = format_of(path, data_format)
  if kind == "text":
    yield path.read_text(encoding="utf-8", errors="replace")
  elif kind == "jsonl":
    yield from _jsonl(path, text_field)
  elif kind == "parquet":
    yield from _parquet(path, text_field)
  else:
    yield from _arrayrecord(path)


def read(files: list[pathlib.Path], data_format: str = "", text_field: str = "text"
         ) -> list[Document]:
  """Every document of ``files``, file by file in order."""
  return [Document(text, str(path), i) for path in files
          for i, text in enumerate(read_file(path, data_format, text_field))]


def _hash(document: Document) -> float:
  """A stable hash of the document's file name and index, in [0, 1)."""
  name = f"{pathlib.Path(document.file).name}:{document.index}"
  digest = hashlib.sha256(name.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") / 2.0**64


def split(documents: list[Document], eval_fraction: float
          ) -> tuple[list[Document], list[Document]]:
  """``(train, eval)``: a document is held out when the hash of its file name and index falls in
  the first ``eval_fraction`` of the hash range (order kept in each part).

  Raises:
    ValueError: ``eval_fraction`` not in (0, 1), or a part left empty.
  """
  if not 0.0 < eval_fraction < 1.0:
    raise ValueError(f"config.eval_fraction must be in (0, 1), got {eval_fraction!r}.")
  held = [_hash(d) < eval_fraction for d in documents]
  train = [d for d, h in zip(documents, held) if not h]
  evaluation = [d for d, h in zip(documents, held) if h]
  if not train or not evaluation:
    raise ValueError(f"eval_fraction={eval_fraction} of {len(documents)} documents leaves the "
                     f"{'train' if not train else 'eval'} split empty; change "
                     "--config.eval_fraction or give --config.eval_data files.")
  return train, evaluation
