"""The pages of docs/: every Python block runs, page by page in order, and the examples compute
what they say (outputs and gradients equal the layers in order, within the numerics rule)."""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from tests.helpers import blocks
from tests.helpers import markdown
from tests.helpers import numerics

PAGES = sorted(markdown.DOCS.rglob("*.md"))
# Pages whose namespaces a test below checks; the others are run by test_page_runs.
CHECKED = ("linen", "spec", "training-step", "parallelism", "multislice", "nnx")


@functools.lru_cache(maxsize=None)
def _page(name):
  """The namespace of docs/guide/``name``.md, its blocks run in order."""
  return markdown.run_in_order(markdown.DOCS / "guide" / f"{name}.md")


def _number(name, pattern):
  """The number ``pattern``'s group matches in the text of docs/guide/``name``.md."""
  text = (markdown.DOCS / "guide" / f"{name}.md").read_text()
  return int(re.search(pattern, text).group(1))


def _label(path):
  return str(path.relative_to(markdown.DOCS))


@pytest.mark.unit
@pytest.mark.parametrize("page", PAGES, ids=_label)
def test_every_python_block_runs_or_is_marked(page):
  """A ```python block runs here, or is marked as an illustration (``<!-- not run: why -->``) or
  as the recipe's (``<!-- recipe: cpu -->``, tests/train/test_recipes.py runs it)."""
  for block in markdown.python_blocks(page):
    assert block.marker in (None, "not", "recipe"), (page, block.line, block.marker)
    compile(block.code, f"{page}:{block.line}", "exec")  # Even illustrations parse.
  assert page.read_text().count("```python") == len(markdown.python_blocks(page)), page


@pytest.mark.unit
def test_every_page_with_runnable_blocks_is_run():
  run = {path.stem for path in PAGES if markdown.runnable(path)}
  assert run == set(CHECKED) | set(_unchecked()), run


def _unchecked():
  return [path.stem for path in PAGES if markdown.runnable(path) and path.stem not in CHECKED]


@pytest.mark.parametrize("name", _unchecked())
def test_page_runs(name):
  path = next(path for path in PAGES if path.stem == name)
  markdown.run_in_order(path)


def test_linen_stack_equals_the_blocks_in_sequence():
  page = _page("linen")
  y, x, mask = page["y"], page["x"], page["mask"]
  params = page["variables"]["params"]
  assert y.shape == x.shape
  width = _number("linen", r"Stack\(width=(\d+)\)")
  sequential = functools.partial(blocks.apply_in_sequence, page["Block"](width=width))
  microbatches = _number("linen", r"num_microbatches=(\d+)") * page["mesh"].shape["data"]
  plain = jax.jit(functools.partial(sequential, microbatches=microbatches))(params, x, mask)
  exact = numerics.float64_reference(jax.jit(sequential), params, x, mask)
  numerics.assert_as_close_as_plain(y, plain, exact, what="the linen page's y")


def _lm_in_order(page):
  embed, repeat, head = page["layers"]
  residual = repeat.module

  def in_order(params, tokens, targets, microbatches=1):
    def run(chunk):
      tokens, targets = chunk
      h = embed.apply({"params": params["layers_0"]}, tokens)
      h = jax.lax.scan(lambda h, p: (residual.apply({"params": p}, h), None), h,
                       params["layers_1"])[0]
      return head.apply({"params": params["layers_2"]}, h, targets)

    split = lambda a: a.reshape(microbatches, -1, *a.shape[1:])
    return jax.lax.map(run, (split(tokens), split(targets))).reshape(-1)

  return in_order


def _lm_microbatches(page):
  return page["lm"].spec.num_microbatches * page["mesh"].shape["data"]


def test_sequential_example_equals_the_layers_in_order():
  page = _page("linen")
  losses, tokens, targets = page["losses"], page["tokens"], page["targets"]
  params = page["lm_variables"]["params"]
  assert losses.shape == (tokens.shape[0],)
  in_order = _lm_in_order(page)
  plain = jax.jit(functools.partial(in_order, microbatches=_lm_microbatches(page)))(
      params, tokens, targets)
  exact = numerics.float64_reference(jax.jit(in_order), params, tokens, targets)
  numerics.assert_as_close_as_plain(losses, plain, exact, what="the linen page's losses")


def test_zero_bubble_loss_and_gradients_equal_the_layers_in_order():
  page = _page("linen")
  params, tokens, targets = page["lm_variables"]["params"], page["tokens"], page["targets"]
  assert page["zero_bubble"].spec.schedule == "zb_h1"
  in_order = _lm_in_order(page)
  mean_loss = lambda p, t, y, microbatches=1: in_order(p, t, y, microbatches).mean()
  plain = jax.jit(jax.value_and_grad(
      functools.partial(mean_loss, microbatches=_lm_microbatches(page))))(params, tokens, targets)
  exact = numerics.float64_reference(jax.jit(jax.value_and_grad(mean_loss)), params, tokens,
                                     targets)
  numerics.assert_as_close_as_plain((page["loss"], page["grads"]), plain, exact,
                                    what="the linen page's zb_h1 loss and gradients")


def test_spec_example_builds_the_same_stack():
  page = _page("spec")
  spec, same = page["spec"], page["same"]
  assert same.spec is spec and spec.is_fused and spec.num_chunks == 4
  assert page["lm"].spec.replace(schedule="1f1b", balance="flops") == spec


def test_training_step_example_takes_one_step_and_measures_it():
  page = _page("training-step")
  state, metrics = page["state"], page["metrics"]
  assert int(state.step) == 1
  # The step's loss is the mean squared output of the model (targets are 0).
  x, mask = page["x"], page["mask"]
  width = _number("training-step", r"\(width=(\d+)\)")
  sequential = functools.partial(blocks.apply_in_sequence, page["Block"](width=width))
  loss = lambda params, x, mask, microbatches=1: jnp.mean(
      sequential(params, x, mask, microbatches=microbatches) ** 2)
  params = page["params"]["blocks"]
  microbatches = (_number("training-step", r"num_microbatches=(\d+)")
                  * page["mesh"].shape["data"])
  plain = jax.jit(functools.partial(loss, microbatches=microbatches))(params, x, mask)
  exact = numerics.float64_reference(jax.jit(loss), params, x, mask)
  numerics.assert_as_close_as_plain(metrics["loss"], plain, exact, what="the step's loss")
  # The analysis: idle ticks skip the stage, so executed FLOPs are below lockstep, useful below
  # executed.
  pipe = page["result"].pipeline
  assert 0 < pipe.useful <= pipe.executed < pipe.lockstep
  assert page["result"].memory.total > 0
  with open(page["timeline_png"], "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _mlps_in_order(mlp, params, h, microbatches=1):
  def run(h):
    return jax.lax.scan(lambda h, p: (mlp.apply({"params": p}, h), None), h, params)[0]
  return jax.lax.map(run, h.reshape(microbatches, -1, h.shape[-1])).reshape(h.shape)


def test_3d_example_splits_the_weights_and_equals_the_mlps_in_sequence():
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  page = _page("parallelism")
  assert page["specs"]["w_in"] == P(None, "stage", None, "fsdp", "tensor")
  assert page["specs"]["w_out"] == P(None, "stage", None, "tensor", "fsdp")
  params, h = page["wide_params"]["layers_0"], page["h"]
  in_order = functools.partial(_mlps_in_order, page["MLP"]())
  # Rows split over fsdp as over data: fsdp x M micro-batches.
  microbatches = page["wide"].spec.num_microbatches * page["mesh3d"].shape["fsdp"]
  plain = jax.jit(functools.partial(in_order, microbatches=microbatches))(params, h)
  exact = numerics.float64_reference(jax.jit(in_order), params, h)
  numerics.assert_as_close_as_plain(page["wide_out"], plain, exact, what="the 3D example")


def test_multislice_example_equals_the_mlps_in_sequence_with_the_crossing_links_delayed():
  page = _page("multislice")
  sliced, far = page["sliced"], page["far"]
  assert sliced.axis_names == ("stage", "data", "fsdp", "expert", "tensor")
  assert far.spec.delays == (0, 1, 0, 1)
  params, h = page["wide_params"]["layers_0"], page["h"]
  in_order = functools.partial(_mlps_in_order, page["MLP"]())
  microbatches = far.spec.num_microbatches * sliced.shape["data"]
  plain = jax.jit(functools.partial(in_order, microbatches=microbatches))(params, h)
  exact = numerics.float64_reference(jax.jit(in_order), params, h)
  numerics.assert_as_close_as_plain(page["far_out"], plain, exact, what="the multislice example")


def test_nnx_pipeline_and_1f1b_examples_equal_the_layers_in_order():
  from flax import nnx  # pylint: disable=import-outside-toplevel
  page = _page("nnx")
  assert page["nnx_per_example"].shape == (page["nnx_tokens"].shape[0],)

  # The pipelined stack: its copies resident on their stages, its output the copies in order.
  stack, h, y = page["nnx_stack"], page["nnx_h"], page["nnx_stack_y"]
  spec = nnx.get_partition_spec(nnx.state(stack, nnx.Param))["layer"]["mlp"]["kernel"]
  assert spec.get_value() == jax.sharding.PartitionSpec("stage", None, None)
  graphdef, params = nnx.split(stack.layer, nnx.Param)

  def copies_in_order(params, h, microbatches=1):
    step = lambda h, p: (nnx.merge(graphdef, p)(h), None)
    split = lambda a: a.reshape(microbatches, -1, *a.shape[1:])
    run = lambda chunk: jax.lax.scan(step, chunk, params)[0]
    return jax.lax.map(run, split(h)).reshape(h.shape)

  pure = nnx.to_pure_dict(params)
  plain = jax.jit(functools.partial(copies_in_order, microbatches=4 * 2))(pure, h)
  exact = numerics.float64_reference(jax.jit(copies_in_order), pure, h)
  numerics.assert_as_close_as_plain(y, plain, exact, what="the nnx.pipeline output")

  # 1F1B: the mean loss and its gradients.
  model, tokens, targets = page["nnx_fused"], page["nnx_tokens"], page["nnx_targets"]
  graphdef, params = nnx.split(model.layers, nnx.Param)

  def mean_loss(params, tokens, targets, microbatches=1):
    def run(chunk):
      embed, repeat, head = nnx.merge(graphdef, params)
      return head(repeat(embed.embedding[...][chunk[0]]), targets=chunk[1])

    split = lambda a: a.reshape(microbatches, -1, *a.shape[1:])
    return jax.lax.map(run, (split(tokens), split(targets))).mean()

  pure = nnx.to_pure_dict(params)
  grad_fn = jax.value_and_grad(mean_loss)
  plain = jax.jit(functools.partial(grad_fn, microbatches=4 * 2))(pure, tokens, targets)
  exact = numerics.float64_reference(jax.jit(grad_fn), pure, tokens, targets)
  got = (page["nnx_fused_loss"], nnx.to_pure_dict(page["nnx_fused_grads"])["layers"])
  numerics.assert_as_close_as_plain(got, plain, exact, what="the 1F1B loss and grads")
