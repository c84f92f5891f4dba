"""The experiments: every script is run by experiments/run_all.sh and has a --smoke variant,
every result file names a command that exists, and archived results say their commit.

Cheap checks (no script runs here): reading the scripts' source and run_all.sh. The smoke runs
themselves take far longer than a test may (``bash experiments/run_all.sh --smoke``).
"""

import ast
import importlib.util
import pathlib
import re
import shlex
import sys

import pytest

pytestmark = pytest.mark.unit

EXPERIMENTS = pathlib.Path(__file__).resolve().parent.parent / "experiments"


def _load_common():
  """experiments/_common.py alone: importing the experiments package would run its preamble,
  which sets the device count in the environment (for the scripts, not for this test session)."""
  spec = importlib.util.spec_from_file_location("experiments_common", EXPERIMENTS / "_common.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # Its dataclasses look their module up.
  spec.loader.exec_module(module)
  return module


_common = _load_common()
SCRIPTS = sorted(p.stem for p in EXPERIMENTS.glob("*.py") if not p.stem.startswith("_"))
RESULTS = EXPERIMENTS / "results"


def _run_all_scripts():
  text = (EXPERIMENTS / "run_all.sh").read_text()
  return re.search(r"^SCRIPTS=\((.*?)\)", text, re.S | re.M).group(1).split()


def _start_call(name):
  """The script's ``_common.start(...)`` call."""
  tree = ast.parse((EXPERIMENTS / f"{name}.py").read_text())
  calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
           and isinstance(node.func, ast.Attribute) and node.func.attr == "start"
           and isinstance(node.func.value, ast.Name) and node.func.value.id == "_common"]
  assert len(calls) == 1, name
  return calls[0]


def test_run_all_runs_every_script_once():
  listed = _run_all_scripts()
  assert sorted(listed) == SCRIPTS
  assert len(listed) == len(set(listed))


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_has_a_smoke_variant(name):
  call = _start_call(name)
  assert call.args and call.args[0].value == name  # Its results/<name>.md, its --help prog.
  assert "smoke" in [keyword.arg for keyword in call.keywords], name


def test_a_smoke_variant_is_the_smoke_flag_and_writes_outside_the_results():
  run = _common.start("remat", "Doc.", smoke="a tiny model", argv=["--smoke"])
  assert run.smoke and run.out.startswith(_common.SMOKE_RESULTS)
  assert not _common.start("remat", "Doc.", smoke="a tiny model", argv=[]).smoke


def _flags(name):
  """The long options the script accepts: its own, those of _common.start, and --rows where it
  adds _common's."""
  source = (EXPERIMENTS / f"{name}.py").read_text()
  rows = {"--rows"} if "_common.add_rows_argument" in source else set()
  return set(re.findall(r"\"(--[\w-]+)\"", source)) | {"--out", "--smoke", "--quick"} | rows


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.md")), ids=lambda p: p.name)
def test_every_result_names_a_command_that_exists(path):
  command = re.search(r"Command \(from the repository root\): `([^`]*)`", path.read_text())
  assert command, f"{path.name} does not say the command that produced it"
  words = shlex.split(command.group(1))
  while re.fullmatch(r"[A-Z_]+=.*", words[0]):  # An environment setting before the command.
    words = words[1:]
  assert words[:2] == ["python", "-m"] and words[2].startswith("experiments."), words
  name = words[2][len("experiments."):]
  assert name in SCRIPTS, name
  for word in words[3:]:
    if word.startswith("--"):
      assert word.split("=")[0] in _flags(name), (path.name, word)


@pytest.mark.parametrize("path", sorted((RESULTS / "archive").glob("*.md")), ids=lambda p: p.name)
def test_every_archived_result_says_its_commit(path):
  assert re.search(r"Archived: produced at commit [0-9a-f]{7,}", path.read_text()), path.name


def test_the_index_lists_every_script_with_its_command():
  index = (EXPERIMENTS / "README.md").read_text()
  for name in SCRIPTS:
    assert f"`python -m experiments.{name}" in index, name
