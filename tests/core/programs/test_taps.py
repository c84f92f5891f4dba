"""The split backward's taps (tpipe.core.programs.taps): BI's gradients plus W's equal one plain
backward.

A linen layer mixing every tapped kind of operation (``nn.Embed``'s lookup, a gather;
``nn.DenseGeneral``, ``nn.Einsum`` (a nested ``jit``), ``nn.Dense`` and a tied embedding's
``attend``, dot_generals; ``nn.Conv``, a convolution), an untapped module (LayerNorm: a product
with its scale), a parameter also used directly (a slice of the embedding table added to the
activations), a tapped module inside the layer's own ``nn.scan`` (one ``scan`` equation in the
jaxpr, so not tapped) and one inside a ``jax.checkpoint`` (``nn.remat``, whose body is
followed) is traced with :func:`tpipe.core.programs.taps.trace` and differentiated three
ways: plainly; as BI (:meth:`~tpipe.core.programs.taps.Program.forward` with zero taps,
differentiated by
the float input, the taps and the parameters through untapped uses); and as W (the VJP of
:meth:`~tpipe.core.programs.taps.Program.weight_outputs` at the taps' gradients, from the recorded
operands). Everything runs in float64 (inside ``jax.enable_x64``, which is switched off again
afterwards), so the sums must agree to rounding.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpipe.core.programs import taps


class ScannedDense(nn.Module):

  @nn.compact
  def __call__(self, h, _):
    return jnp.tanh(nn.Dense(h.shape[-1])(h)), None


class Mixed(nn.Module):

  @nn.compact
  def __call__(self, tokens, x):
    embed = nn.Embed(11, 6, param_dtype=jnp.float64)
    h = embed(tokens) + x                                              # [b, t, 6]
    h = nn.LayerNorm(param_dtype=jnp.float64)(h)
    h = h + jnp.tanh(embed.embedding[0])                               # a direct use
    h = nn.DenseGeneral((2, 4), param_dtype=jnp.float64)(h)            # [b, t, 2, 4]
    h = nn.Einsum((2, 4, 5), "btij,ijk->btk", param_dtype=jnp.float64)(h)
    h = nn.Conv(6, (3,), param_dtype=jnp.float64)(jax.nn.gelu(h))      # [b, t, 6]
    h, _ = nn.scan(ScannedDense, variable_broadcast="params", split_rngs={"params": False},
                   length=2)(name="scanned")(h, None)
    h = nn.remat(nn.Dense)(6, param_dtype=jnp.float64, name="recomputed")(jnp.tanh(h))
    h = nn.Dense(6, param_dtype=jnp.float64)(h)
    return embed.attend(h)                                             # tied: [b, t, 11]


# The tapped operations, in the order the forward meets them, and the parameter each is linear in.
TAPPED = [("gather", "['Embed_0']['embedding']"),
          ("dot_general", "['DenseGeneral_0']['kernel']"),
          ("dot_general", "['Einsum_0']['kernel']"),
          ("conv_general_dilated", "['Conv_0']['kernel']"),
          ("dot_general", "['recomputed']['kernel']"),  # inside a jax.checkpoint
          ("dot_general", "['Dense_0']['kernel']"),
          ("dot_general", "['Embed_0']['embedding']")]


def _setup():
  keys = jax.random.split(jax.random.key(0), 4)
  tokens = jax.random.randint(keys[0], (3, 5), 0, 11)
  x = jax.random.normal(keys[1], (3, 5, 6), jnp.float64)
  model = Mixed()
  params = model.init(keys[2], tokens, x)["params"]
  cotangent = jax.random.normal(keys[3], (3, 5, 11), jnp.float64)
  fn = lambda p, tokens, x: model.apply({"params": p}, tokens, x)
  return fn, params, tokens, x, cotangent


def _split(fn, params, tokens, x):
  """BI's gradients (of x, the taps, the parameters) and W's, from one traced program."""
  program = taps.trace(fn, params, tokens, x)
  param_leaves, others, _ = taps.split_leaves(params, (tokens, x))
  assert len(others) == 2  # tokens and x, the arrays of the other arguments

  def tap_outputs(p):
    return program.forward(p, others)[2]

  zero_taps = [jnp.zeros(o.shape, o.dtype) for o in jax.eval_shape(tap_outputs, param_leaves)]

  def bi(p, x, t):
    out, records, _ = program.forward(p, [others[0], x], t)
    return out, records

  _, vjp, records = jax.vjp(bi, param_leaves, x, zero_taps, has_aux=True)
  return program, vjp, records


def test_the_tapped_operations_are_the_linear_uses_of_one_parameter():
  with jax.enable_x64(True):
    fn, params, tokens, x, _ = _setup()
    program = taps.trace(fn, params, tokens, x)
  paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
  found = [(tap.equation.primitive.name, paths[tap.parameter]) for tap in program.taps]
  # The scanned Dense runs inside a scan equation: not tapped; nor is LayerNorm's scale.
  assert found == TAPPED, found


def test_input_and_weight_gradients_add_up_to_the_plain_backward():
  with jax.enable_x64(True):
    _check_input_and_weight_gradients_add_up()


def _check_input_and_weight_gradients_add_up():
  fn, params, tokens, x, cotangent = _setup()
  plain_params, plain_x = jax.vjp(lambda p, x: fn(p, tokens, x), params, x)[1](cotangent)
  program, vjp, records = _split(fn, params, tokens, x)
  input_leaves, input_x, tap_grads = vjp(cotangent)
  # W: the tapped operations' weight gradients from their recorded operands and output gradients.
  param_leaves = jax.tree.leaves(params)
  weight_leaves = jax.vjp(lambda p: program.weight_outputs(p, records),
                          param_leaves)[1](tap_grads)[0]
  as_params = lambda leaves: jax.tree.unflatten(jax.tree.structure(params), leaves)
  input_grads, weight_grads = as_params(input_leaves), as_params(weight_leaves)

  total = jax.tree.map(jnp.add, input_grads, weight_grads)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12), total,
               plain_params)
  # The input's gradient is BI's alone.
  np.testing.assert_allclose(input_x, plain_x, rtol=1e-12, atol=1e-12)
  assert float(jnp.abs(plain_x).max()) > 0.0
  # The split is real: BI leaves the tapped kernels alone, W touches nothing else.
  for name in ("DenseGeneral_0", "Einsum_0", "Conv_0", "Dense_0"):
    assert float(jnp.abs(input_grads[name]["kernel"]).max()) == 0.0, name
    assert float(jnp.abs(weight_grads[name]["kernel"]).max()) > 0.0, name
  for name, leaf in (("LayerNorm_0", "scale"), ("Dense_0", "bias"), ("Conv_0", "bias")):
    assert float(jnp.abs(weight_grads[name][leaf]).max()) == 0.0, (name, leaf)
  assert float(jnp.abs(weight_grads["scanned"]["Dense_0"]["kernel"]).max()) == 0.0
  assert float(jnp.abs(input_grads["scanned"]["Dense_0"]["kernel"]).max()) > 0.0
  # The tied embedding gets its gradient from both: the lookup and attend in W, the direct use
  # (row 0 only) in BI.
  embedding_bi = input_grads["Embed_0"]["embedding"]
  assert float(jnp.abs(embedding_bi[0]).max()) > 0.0
  assert float(jnp.abs(embedding_bi[1:]).max()) == 0.0
  assert float(jnp.abs(weight_grads["Embed_0"]["embedding"][1:]).max()) > 0.0


def test_the_comparison_is_sharp_without_w():
  """Dropping W's share leaves the tapped kernels without gradients: far from the plain ones."""
  with jax.enable_x64(True):
    _check_sharp_without_w()


def _check_sharp_without_w():
  fn, params, tokens, x, cotangent = _setup()
  plain = jax.vjp(lambda p: fn(p, tokens, x), params)[1](cotangent)[0]
  _, vjp, _ = _split(fn, params, tokens, x)
  input_grads = jax.tree.unflatten(jax.tree.structure(params), vjp(cotangent)[0])
  with pytest.raises(AssertionError):
    np.testing.assert_allclose(input_grads["Dense_0"]["kernel"], plain["Dense_0"]["kernel"])


def test_x64_is_off_again():
  assert not jax.config.jax_enable_x64
