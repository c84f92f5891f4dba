"""The README's usage examples run as written and compute what they say."""

import functools
import pathlib
import re

import jax

from tests import blocks
from tests import numerics

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs_and_equals_the_sequential_blocks():
  code = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)[0]
  namespace = {}
  exec(compile(code, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  y, x, mask = namespace["y"], namespace["x"], namespace["mask"]
  params = namespace["variables"]["params"]
  assert y.shape == x.shape
  # The plain model runs on the pipeline's micro-batches (see tests.numerics).
  microbatches = int(re.search(r"num_microbatches=(\d+)", code).group(1))
  data = int(re.search(r"make_mesh\(stages=\d+, data=(\d+)\)", code).group(1))
  sequential = functools.partial(blocks.apply_in_sequence, namespace["Block"](width=64))
  plain = jax.jit(functools.partial(sequential, microbatches=microbatches * data))(params, x, mask)
  exact = numerics.float64_reference(jax.jit(sequential), params, x, mask)
  numerics.assert_as_close_as_plain(y, plain, exact, what="the README's y")


def test_readme_sequential_example_runs_and_equals_the_layers_in_order():
  code_blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
  first = code_blocks[0]
  sequential_example = next(b for b in code_blocks if "tpipe.Sequential(layers" in b)
  namespace = {}
  exec(compile(first, "README.md", "exec"), namespace)  # the imports and the mesh
  exec(compile(sequential_example, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  losses, tokens, targets = namespace["losses"], namespace["tokens"], namespace["targets"]
  params = namespace["lm_variables"]["params"]
  assert losses.shape == (tokens.shape[0],)
  embed, repeat, head = namespace["layers"]
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

  plain = jax.jit(functools.partial(in_order, microbatches=8 * 2))(params, tokens, targets)
  exact = numerics.float64_reference(jax.jit(in_order), params, tokens, targets)
  numerics.assert_as_close_as_plain(losses, plain, exact, what="the README's losses")
  # The zero-bubble schedule's mean loss and gradients.
  mean_loss = lambda p, t, y, microbatches=1: in_order(p, t, y, microbatches).mean()
  plain = jax.jit(jax.value_and_grad(functools.partial(mean_loss, microbatches=8 * 2)))(
      params, tokens, targets)
  exact = numerics.float64_reference(jax.jit(jax.value_and_grad(mean_loss)), params, tokens,
                                     targets)
  numerics.assert_as_close_as_plain((namespace["loss"], namespace["grads"]), plain, exact,
                                    what="the README's zb_h1 loss and gradients")


def test_readme_nnx_example_trains_and_equals_the_layers_in_order():
  code = next(b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
              if "tpipe.nnx.Sequential(" in b)
  namespace = {}
  exec(compile(code, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  losses = [float(loss) for loss in namespace["nnx_losses"]]
  assert losses[-1] < losses[0]
  model, tokens, targets = namespace["nnx_model"], namespace["nnx_tokens"], namespace["nnx_targets"]
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


def test_readme_nnx_pipeline_and_1f1b_examples_equal_the_layers_in_order():
  code_blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
  first_nnx = next(b for b in code_blocks if "tpipe.nnx.Sequential(" in b)
  example = next(b for b in code_blocks if "tpipe.nnx.pipeline(" in b)
  namespace = {}
  exec(compile(first_nnx, "README.md", "exec"), namespace)  # The NNX layers and tokens.
  exec(compile(example, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  from flax import nnx  # pylint: disable=import-outside-toplevel

  # The pipelined stack: its copies resident on their stages, its output the copies in order.
  stack, h, y = namespace["nnx_stack"], namespace["nnx_h"], namespace["nnx_stack_y"]
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
  model, tokens, targets = namespace["nnx_fused"], namespace["nnx_tokens"], namespace["nnx_targets"]
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
  got = (namespace["nnx_fused_loss"], nnx.to_pure_dict(namespace["nnx_fused_grads"])["layers"])
  numerics.assert_as_close_as_plain(got, plain, exact, what="the README's 1F1B loss and grads")
