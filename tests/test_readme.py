"""The README's usage example runs as written and computes what it says."""

import pathlib
import re

import jax
import numpy as np

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs_and_equals_the_sequential_blocks():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
  namespace = {}
  exec(compile(blocks[0], "README.md", "exec"), namespace)  # pylint: disable=exec-used
  y, x, mask = namespace["y"], namespace["x"], namespace["mask"]
  params = namespace["variables"]["params"]
  block = namespace["Block"](width=64)
  expected = x
  for layer in range(24):
    expected = block.apply({"params": jax.tree.map(lambda p: p[layer], params)}, expected, mask)
  assert np.linalg.norm(y - expected) <= 1e-5 * np.linalg.norm(expected)
  assert y.shape == x.shape
