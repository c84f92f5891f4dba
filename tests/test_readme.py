"""The README's Python examples run as written, in order, and compute what they say."""

import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

from tests.helpers import blocks
from tests.helpers import numerics

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _code_blocks():
  """The README's top-level Python blocks (indented ones inside a list are illustrations)."""
  return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


@pytest.fixture(scope="module")
def readme():
  """Every Python block of the README executed in order in one namespace (as a reader would
  paste them into one session). ``Block`` is the first example's linen block (the NNX example
  names its own ``Block`` later)."""
  namespace = {}
  for i, code in enumerate(_code_blocks()):
    exec(compile(code, f"README.md block {i}", "exec"), namespace)  # pylint: disable=exec-used
    if i == 0:
      linen_block = namespace["Block"]
  return {**namespace, "Block": linen_block}


def test_pipeline_example_equals_the_blocks_in_sequence(readme):
  code = _code_blocks()[0]
  y, x, mask = readme["y"], readme["x"], readme["mask"]
  params = readme["variables"]["params"]
  assert y.shape == x.shape
  # The plain model runs on the pipeline's micro-batches (see tests.helpers.numerics).
  microbatches = int(re.search(r"num_microbatches=(\d+)", code).group(1))
  data = int(re.search(r"make_mesh\(stages=\d+, data=(\d+)\)", code).group(1))
  sequential = functools.partial(blocks.apply_in_sequence, readme["Block"](width=64))
  plain = jax.jit(functools.partial(sequential, microbatches=microbatches * data))(params, x, mask)
  exact = numerics.float64_reference(jax.jit(sequential), params, x, mask)
  numerics.assert_as_close_as_plain(y, plain, exact, what="the README's y")


def _lm_in_order(readme):
  embed, repeat, head = readme["layers"]
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


def test_sequential_example_equals_the_layers_in_order(readme):
  losses, tokens, targets = readme["losses"], readme["tokens"], readme["targets"]
  params = readme["lm_variables"]["params"]
  assert losses.shape == (tokens.shape[0],)
  in_order = _lm_in_order(readme)
  plain = jax.jit(functools.partial(in_order, microbatches=8 * 2))(params, tokens, targets)
  exact = numerics.float64_reference(jax.jit(in_order), params, tokens, targets)
  numerics.assert_as_close_as_plain(losses, plain, exact, what="the README's losses")


def test_zero_bubble_loss_and_gradients_equal_the_layers_in_order(readme):
  params, tokens, targets = readme["lm_variables"]["params"], readme["tokens"], readme["targets"]
  in_order = _lm_in_order(readme)
  mean_loss = lambda p, t, y, microbatches=1: in_order(p, t, y, microbatches).mean()
  plain = jax.jit(jax.value_and_grad(functools.partial(mean_loss, microbatches=8 * 2)))(
      params, tokens, targets)
  exact = numerics.float64_reference(jax.jit(jax.value_and_grad(mean_loss)), params, tokens,
                                     targets)
  numerics.assert_as_close_as_plain((readme["loss"], readme["grads"]), plain, exact,
                                    what="the README's zb_h1 loss and gradients")


def test_spec_example_builds_the_same_stack(readme):
  spec, same_lm = readme["spec"], readme["same_lm"]
  assert same_lm.spec is spec and spec.is_fused and spec.num_chunks == 4
  assert readme["lm"].spec.replace(schedule="1f1b", balance="flops") == spec


def test_training_step_example_takes_one_step(readme):
  state, metrics = readme["state"], readme["metrics"]
  assert int(state.step) == 1
  # The step's loss is the mean squared output of the first example's model (targets are 0).
  sequential = functools.partial(blocks.apply_in_sequence, readme["Block"](width=64))
  loss = lambda params, x, mask, microbatches=1: jnp.mean(
      sequential(params, x, mask, microbatches=microbatches) ** 2)
  params, x, mask = readme["variables"]["params"], readme["x"], readme["mask"]
  plain = jax.jit(functools.partial(loss, microbatches=16 * 2))(params, x, mask)
  exact = numerics.float64_reference(jax.jit(loss), params, x, mask)
  numerics.assert_as_close_as_plain(metrics["loss"], plain, exact, what="the step's loss")


def test_nnx_example_trains_and_equals_the_layers_in_order(readme):
  losses = [float(loss) for loss in readme["nnx_losses"]]
  assert losses[-1] < losses[0]
  model, tokens, targets = readme["nnx_model"], readme["nnx_tokens"], readme["nnx_targets"]
  from flax import nnx  # pylint: disable=import-outside-toplevel
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


def test_nnx_pipeline_and_1f1b_examples_equal_the_layers_in_order(readme):
  from flax import nnx  # pylint: disable=import-outside-toplevel

  # The pipelined stack: its copies resident on their stages, its output the copies in order.
  stack, h, y = readme["nnx_stack"], readme["nnx_h"], readme["nnx_stack_y"]
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
  numerics.assert_as_close_as_plain(y, plain, exact, what="the README's nnx.pipeline output")

  # 1F1B: the mean loss and its gradients.
  model, tokens, targets = readme["nnx_fused"], readme["nnx_tokens"], readme["nnx_targets"]
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
  got = (readme["nnx_fused_loss"], nnx.to_pure_dict(readme["nnx_fused_grads"])["layers"])
  numerics.assert_as_close_as_plain(got, plain, exact, what="the README's 1F1B loss and grads")


def test_tools_example_measures_the_training_step(readme):
  result = readme["result"]
  pipe = result.pipeline
  # Idle ticks skip the stage: executed FLOPs are below lockstep, useful below executed.
  assert 0 < pipe.useful <= pipe.executed < pipe.lockstep
  assert result.memory.total > 0
  with open(readme["timeline_png"], "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_3d_example_splits_the_weights_and_equals_the_mlps_in_sequence(readme):
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  assert readme["specs"]["w_in"] == P(None, "stage", None, "fsdp", "tensor")
  assert readme["specs"]["w_out"] == P(None, "stage", None, "tensor", "fsdp")
  mlp, params, h = readme["MLP"](), readme["wide_params"]["layers_0"], readme["h"]

  def in_order(params, h, microbatches=1):
    def run(h):
      return jax.lax.scan(lambda h, p: (mlp.apply({"params": p}, h), None), h, params)[0]
    return jax.lax.map(run, h.reshape(microbatches, -1, h.shape[-1])).reshape(h.shape)

  # Rows split over fsdp as over data: 2 x 4 micro-batches.
  plain = jax.jit(functools.partial(in_order, microbatches=8))(params, h)
  exact = numerics.float64_reference(jax.jit(in_order), params, h)
  numerics.assert_as_close_as_plain(readme["wide_out"], plain, exact, what="the 3D example")


def test_multislice_example_equals_the_mlps_in_sequence_with_the_crossing_links_delayed(readme):
  sliced, far = readme["sliced"], readme["far"]
  assert sliced.axis_names == ("stage", "data", "fsdp", "tensor")
  assert far.spec.delays == (0, 1, 0, 1)
  mlp, params, h = readme["MLP"](), readme["wide_params"]["layers_0"], readme["h"]

  def in_order(params, h, microbatches=1):
    def run(h):
      return jax.lax.scan(lambda h, p: (mlp.apply({"params": p}, h), None), h, params)[0]
    return jax.lax.map(run, h.reshape(microbatches, -1, h.shape[-1])).reshape(h.shape)

  plain = jax.jit(functools.partial(in_order, microbatches=8))(params, h)  # 4 x 2 replicas
  exact = numerics.float64_reference(jax.jit(in_order), params, h)
  numerics.assert_as_close_as_plain(readme["far_out"], plain, exact, what="the multislice example")
