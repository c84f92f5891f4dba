"""The Python blocks of the README and of docs/, and running them as a reader pastes them.

A fenced ```python block is code a reader runs. A block meant as an illustration only is marked
by an HTML comment on the line before it: ``<!-- not run: why -->``; a block the fine-tuning
recipe's test runs is marked ``<!-- recipe: cpu -->``. Shell, text and console blocks are never
run.
"""

import contextlib
import dataclasses
import os
import pathlib
import re
import textwrap

REPO = pathlib.Path(__file__).resolve().parent.parent.parent
DOCS = REPO / "docs"

_BLOCK = re.compile(r"^(?:(?P<marker>[ \t]*<!-- (?P<kind>[\w-]+)[^\n]*-->)\n)?"
                    r"(?P<indent>[ \t]*)```python\n(?P<code>.*?)^(?P=indent)```[ \t]*$",
                    flags=re.S | re.M)


@dataclasses.dataclass(frozen=True)
class Block:
  """One ```python block: its code (dedented), the marker before it (None, "not", "recipe")
  and the line it starts on."""
  code: str
  marker: str | None
  line: int


def python_blocks(path: pathlib.Path) -> list[Block]:
  """Every ```python block of ``path``, top-level or indented inside a list, in order."""
  text = path.read_text()
  blocks = []
  for match in _BLOCK.finditer(text):
    code = textwrap.dedent(match.group("code"))
    line = text.count("\n", 0, match.start("indent")) + 1
    blocks.append(Block(code, match.group("kind"), line))
  return blocks


def runnable(path: pathlib.Path) -> list[Block]:
  """The blocks of ``path`` a reader runs (no marker), in order."""
  return [block for block in python_blocks(path) if block.marker is None]


@contextlib.contextmanager
def _environment_kept():
  """Restores ``os.environ`` afterwards: the examples set ``JAX_NUM_CPU_DEVICES`` (a no-op once
  JAX has started, as in the tests), which must not leak into later subprocesses."""
  saved = dict(os.environ)
  try:
    yield
  finally:
    os.environ.clear()
    os.environ.update(saved)


def run_in_order(path: pathlib.Path, blocks: list[Block] | None = None) -> dict:
  """Runs ``blocks`` (default: every runnable block of ``path``) in order in one namespace, as
  a reader pastes a page's blocks into one session; returns the namespace."""
  namespace = {}
  name = path.relative_to(REPO)
  with _environment_kept():
    for block in runnable(path) if blocks is None else blocks:
      code = compile(block.code, f"{name}, the block at line {block.line}", "exec")
      exec(code, namespace)  # pylint: disable=exec-used
  return namespace
