"""The split backward's taps (tpipe.core.taps): BI's gradients plus W's equal one plain backward.

A layer mixing every tapped module kind (Dense, DenseGeneral, Conv, Einsum, Embed), an untapped
module (LayerNorm), a parameter used both through a tapped call and directly (a tied embedding's
``attend``) and a tapped module inside the layer's own ``nn.scan`` (another trace level, so not
tapped) is differentiated three ways: plainly; as BI (gradients of the input, the taps and the
parameters through untapped uses); and as W (the weight gradients from the recorded inputs and
the taps' gradients). Everything runs in float64 (inside ``jax.enable_x64``, which is switched
off again afterwards), so the sums must agree to rounding.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpipe.core import taps



class ScannedDense(nn.Module):

  @nn.compact
  def __call__(self, h, _):
    return jnp.tanh(nn.Dense(h.shape[-1])(h)), None


class Mixed(nn.Module):

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(11, 6, param_dtype=jnp.float64)
    h = embed(tokens)                                                  # [b, t, 6]
    h = nn.LayerNorm(param_dtype=jnp.float64)(h)
    h = nn.DenseGeneral((2, 4), param_dtype=jnp.float64)(h)            # [b, t, 2, 4]
    h = nn.Einsum((2, 4, 5), "btij,ijk->btk", param_dtype=jnp.float64)(h)
    h = nn.Conv(6, (3,), param_dtype=jnp.float64)(jax.nn.gelu(h))      # [b, t, 6]
    h, _ = nn.scan(ScannedDense, variable_broadcast="params", split_rngs={"params": False},
                   length=2)(name="scanned")(h, None)
    h = nn.Dense(6, param_dtype=jnp.float64)(h)
    return embed.attend(h)                                             # tied: [b, t, 11]


def _setup():
  tokens = jax.random.randint(jax.random.key(0), (3, 5), 0, 11)
  model = Mixed()
  params = model.init(jax.random.key(1), tokens)["params"]
  cotangent = jax.random.normal(jax.random.key(2), (3, 5, 11), jnp.float64)
  return model, params, tokens, cotangent


def test_input_and_weight_gradients_add_up_to_the_plain_backward():
  with jax.enable_x64(True):
    _check_input_and_weight_gradients_add_up()


def _check_input_and_weight_gradients_add_up():
  model, params, tokens, cotangent = _setup()
  plain = jax.vjp(lambda p: model.apply({"params": p}, tokens), params)[1](cotangent)[0]

  recorded = []

  def discover(p):  # Which calls are tapped (the Tapper is entered inside the traced function).
    with taps.Tapper() as tapper:
      model.apply({"params": p}, tokens)
    recorded.extend(tapper.calls)
    return tapper.outputs

  zero_taps = [jnp.zeros(o.shape, o.dtype) for o in jax.eval_shape(discover, params)]
  kinds = [type(call.module).__name__ for call in recorded]
  # The scanned Dense runs under nn.scan's trace: not tapped. The head is attend, not __call__.
  assert kinds == ["Embed", "DenseGeneral", "Einsum", "Conv", "Dense"], kinds

  def differentiable(p, t):
    with taps.Tapper(t) as tapper:
      y = model.apply({"params": p}, tokens)
    return y, tapper.inputs

  (_, vjp, inputs) = jax.vjp(differentiable, params, zero_taps, has_aux=True)
  input_grads, tap_grads = vjp(cotangent)
  calls = recorded
  # W: the tapped calls' weight gradients from their recorded inputs and output gradients.
  weight_grads = jax.vjp(lambda p: [taps.weight_outputs([c], p, [x], stacked=False)[0]
                                    for c, x in zip(calls, inputs)], params)[1](tap_grads)[0]

  total = jax.tree.map(jnp.add, input_grads, weight_grads)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12), total,
               plain)
  # The split is real: BI leaves the tapped kernels alone, W touches nothing else.
  assert float(jnp.abs(input_grads["DenseGeneral_0"]["kernel"]).max()) == 0.0
  assert float(jnp.abs(weight_grads["LayerNorm_0"]["scale"]).max()) == 0.0
  assert float(jnp.abs(weight_grads["scanned"]["Dense_0"]["kernel"]).max()) == 0.0
  # The tied embedding gets its gradient from both: the lookup in W, attend in BI.
  for part in (input_grads, weight_grads):
    assert float(jnp.abs(part["Embed_0"]["embedding"]).max()) > 0.0


def _outputs(model, params, tokens):

  def run(p):
    with taps.Tapper() as tapper:
      model.apply({"params": p}, tokens)
    return tapper.outputs

  return jax.eval_shape(run, params)


def test_the_comparison_is_sharp_without_w():
  """Dropping W's share leaves the tapped kernels without gradients: far from the plain ones."""
  with jax.enable_x64(True):
    _check_sharp_without_w()


def _check_sharp_without_w():
  model, params, tokens, cotangent = _setup()
  plain = jax.vjp(lambda p: model.apply({"params": p}, tokens), params)[1](cotangent)[0]
  zero_taps = [jnp.zeros(o.shape, o.dtype) for o in _outputs(model, params, tokens)]

  def differentiable(p, t):
    with taps.Tapper(t):
      return model.apply({"params": p}, tokens)

  input_grads = jax.vjp(differentiable, params, zero_taps)[1](cotangent)[0]
  with pytest.raises(AssertionError):
    np.testing.assert_allclose(input_grads["Dense_0"]["kernel"], plain["Dense_0"]["kernel"])


def test_x64_is_off_again():
  assert not jax.config.jax_enable_x64
