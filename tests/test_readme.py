"""The README: at most 200 lines, links inside the repository, and its two examples (linen,
NNX) run as pasted, each on its own, and compute what they say."""

import functools
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

from tests.helpers import blocks
from tests.helpers import markdown
from tests.helpers import numerics

README = markdown.REPO / "README.md"


def _examples():
  """The README's runnable Python blocks: the linen example, then the NNX example."""
  examples = markdown.runnable(README)
  assert len(examples) == 2, [block.line for block in examples]
  return examples


@functools.lru_cache(maxsize=None)
def _run(index):
  """The namespace of the README's example ``index`` run on its own (nothing from the other)."""
  return markdown.run_in_order(README, [_examples()[index]])


@pytest.mark.unit
def test_the_readme_is_short_and_links_only_inside_the_repository():
  text = README.read_text()
  assert len(text.splitlines()) <= 200
  assert "://" not in text  # No link outside the repository.
  for target in re.findall(r"\]\(([^)#\s]+)", text):
    path = (README.parent / target).resolve()
    assert path.is_relative_to(markdown.REPO), target
    assert path.exists(), target


@pytest.mark.unit
def test_the_quick_start_keeps_its_two_commands():
  """CI runs the README's test command (.ci/run); the quick start has exactly these two."""
  commands = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1).splitlines()
  assert commands == [
      "pip install -e '.[train]' && python -m tpipe.train --config=configs/lm.py "
      "--workdir=/tmp/tpipe_lm",
      "pip install -e '.[test]' && python -m pytest -n 2"]


@pytest.mark.unit
def test_each_example_sets_the_device_count_before_importing_jax():
  for block in _examples():
    setting = block.code.index('os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")')
    assert setting < block.code.index("import jax"), block.line


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1], ids=["linen", "nnx"])
def test_each_example_runs_in_a_fresh_interpreter_with_no_device_settings(index, tmp_path):
  """As pasted into a fresh ``python`` on a CPU-only machine: no ``JAX_NUM_CPU_DEVICES`` or
  ``XLA_FLAGS`` in the environment (``JAX_PLATFORMS`` stays as the test run has it, so nothing
  tries to open an accelerator)."""
  env = {key: value for key, value in os.environ.items()
         if key not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
  script = tmp_path / "example.py"
  script.write_text(_examples()[index].code)
  proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]


def test_linen_example_equals_the_blocks_in_sequence():
  readme = _run(0)
  code = _examples()[0].code
  y, x, mask = readme["y"], readme["x"], readme["mask"]
  params = readme["variables"]["params"]
  assert y.shape == x.shape
  # The plain model runs on the pipeline's micro-batches (see tests.helpers.numerics).
  microbatches = int(re.search(r"num_microbatches=(\d+)", code).group(1))
  data = int(re.search(r"make_mesh\(stages=\d+, data=(\d+)\)", code).group(1))
  width = int(re.search(r"Stack\(width=(\d+)\)", code).group(1))
  sequential = functools.partial(blocks.apply_in_sequence, readme["Block"](width=width))
  plain = jax.jit(functools.partial(sequential, microbatches=microbatches * data))(params, x, mask)
  exact = numerics.float64_reference(jax.jit(sequential), params, x, mask)
  numerics.assert_as_close_as_plain(y, plain, exact, what="the README's y")


def test_nnx_example_trains_and_equals_the_layers_in_order():
  readme = _run(1)
  from flax import nnx  # pylint: disable=import-outside-toplevel
  losses = [float(loss) for loss in readme["losses"]]
  assert losses[-1] < losses[0]
  model, tokens, targets = readme["model"], readme["tokens"], readme["targets"]
  assert model.spec.schedule == "1f1b"
  graphdef, params = nnx.split(model.layers, nnx.Param)

  def in_order(params, tokens, targets, microbatches=1):
    def run(chunk):
      embed, repeat, head = nnx.merge(graphdef, params)
      # The table lookup nnx.Embed does, in the table's dtype (nnx.Embed computes in float32).
      return head(repeat(embed.embedding[...][chunk[0]]), targets=chunk[1])

    split = lambda a: a.reshape(microbatches, -1, *a.shape[1:])
    return jax.lax.map(run, (split(tokens), split(targets))).reshape(-1)

  pipelined = nnx.jit(lambda m: m(tokens, targets=targets))(model)
  pure = nnx.to_pure_dict(params)
  plain = jax.jit(functools.partial(in_order, microbatches=4 * 2))(pure, tokens, targets)
  exact = numerics.float64_reference(jax.jit(in_order), pure, tokens, targets)
  numerics.assert_as_close_as_plain(pipelined, plain, exact, what="the README's NNX losses")


def test_readme_python_blocks_are_the_two_examples():
  """No other Python block hides in the README (a marked illustration would be allowed by the
  docs' rule, but the README has none)."""
  assert [block.marker for block in markdown.python_blocks(README)] == [None, None]
  assert pathlib.Path(README).read_text().count("```python") == 2
