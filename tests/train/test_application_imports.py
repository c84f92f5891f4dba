"""The command-line programs (tpipe/train/cli) reach the engine through the public API only:
no module there imports ``tpipe.core`` (at the top or inside a function), so the engine's inside
can be reorganised without touching the application."""

import ast
import pathlib

import pytest

import tpipe.train.cli

pytestmark = pytest.mark.unit


def _imported_modules(path: pathlib.Path) -> set[str]:
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      found.add(node.module)
      found.update(f"{node.module}.{a.name}" for a in node.names)
  return found


def test_the_programs_import_no_engine_internals():
  package = pathlib.Path(tpipe.train.cli.__file__).parent
  modules = sorted(package.glob("*.py"))
  assert len(modules) > 15
  offenders = {p.name: sorted(m for m in _imported_modules(p)
                              if m == "tpipe.core" or m.startswith("tpipe.core."))
               for p in modules}
  offenders = {k: v for k, v in offenders.items() if v}
  assert not offenders, f"tpipe/train/cli imports engine internals (use tpipe, tpipe.staging, " \
                        f"tpipe.training, tpipe.schedules): {offenders}"


def test_the_check_sees_an_engine_import(tmp_path):
  source = tmp_path / "x.py"
  source.write_text("def f():\n  from tpipe.core.base import spmd\n  return spmd\n")
  assert "tpipe.core.base.spmd" in _imported_modules(source)
