"""Every module of ``tpipe.core`` has a test file of its own: ``tpipe/core/<layer>/<module>.py``
is tested by ``tests/core/<layer>/test_<module>.py`` (the engine's middle is tested directly, not
only end to end)."""

import pathlib

import pytest

import tpipe.core

pytestmark = pytest.mark.unit


def test_every_core_module_has_a_test_file():
  package = pathlib.Path(tpipe.core.__file__).parent
  here = pathlib.Path(__file__).parent
  modules = sorted(p.relative_to(package) for p in package.rglob("*.py")
                   if p.stem != "__init__")
  assert len(modules) > 20
  missing = [str(m) for m in modules
             if not (here / m.parent / f"test_{m.stem}.py").exists()]
  assert not missing, f"tpipe.core modules without tests/core/<layer>/test_<module>.py: {missing}"
