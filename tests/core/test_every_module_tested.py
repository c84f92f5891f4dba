"""Every module of ``tpipe.core`` has a test file of its own, ``tests/core/test_<module>.py``
(issue 46: the engine's middle is tested directly, not only end to end)."""

import pathlib

import pytest

import tpipe.core

pytestmark = pytest.mark.unit


def test_every_core_module_has_a_test_file():
  package = pathlib.Path(tpipe.core.__file__).parent
  here = pathlib.Path(__file__).parent
  modules = sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__")
  assert len(modules) > 20
  missing = [m for m in modules if not (here / f"test_{m}.py").exists()]
  assert not missing, f"tpipe.core modules without tests/core/test_<module>.py: {missing}"
