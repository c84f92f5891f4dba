"""tpipe.nnx.pipeline: L copies of one NNX block class, pipelined, equal the copies in order.

The made class takes the block's constructor arguments and holds a ``tpipe.nnx.Repeat``'s state
(the same initial values for the same rngs). Outputs and parameter gradients (through
``nnx.value_and_grad`` under ``nnx.jit``) are compared with the plain Repeat (its copies in order
under ``lax.scan``) against a float64 reference (numerics rule: :mod:`tests.helpers.numerics`),
for a block with a per-example argument given by position and a broadcast one given by keyword,
over a few (schedule, stages, micro-batches, data) cases, two with the copies placed over the
stages by ``tpipe.nnx.shard``. Bad arguments raise clear errors, a bad call the very error
``tpipe.pipeline`` raises for the same linen block.
"""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tpipe
from tests.helpers import numerics
from tpipe import nnx as tnnx

BATCH = 16
SEQ = 3
WIDTH = 8
LENGTH = 8


class MaskedBlock(nnx.Module):
  """A residual MLP whose update each example's ``mask`` gates and a shared ``scale`` weighs."""

  def __init__(self, width, *, rngs):
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, 2 * width, rngs=rngs)
    self.down = nnx.Linear(2 * width, width, rngs=rngs)

  def __call__(self, x, mask, scale=None):
    update = self.down(nnx.gelu(self.up(self.norm(x))))
    return x + mask[:, None, None] * scale * update


def _inputs():
  k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(k1, (BATCH, SEQ, WIDTH))
  mask = jax.random.bernoulli(k2, 0.7, (BATCH,)).astype(jnp.float32)
  scale = 1 + 0.1 * jax.random.normal(k3, (WIDTH,))
  return x, mask, scale


def _weighted(y):
  return jnp.vdot(y, jnp.cos(jnp.arange(y.size, dtype=y.dtype)).reshape(y.shape))


@functools.cache
def _plain_fn(microbatches):
  """``(params, x, mask, scale) -> ((objective, y), grads)`` of the plain Repeat on
  ``microbatches`` contiguous micro-batches."""
  graphdef, _ = nnx.split(tnnx.Repeat(lambda r: MaskedBlock(WIDTH, rngs=r), LENGTH,
                                      rngs=nnx.Rngs(0)), nnx.Param)

  def objective(params, x, mask, scale):
    stack = nnx.merge(graphdef, params)
    split = lambda a: a.reshape(microbatches, -1, *a.shape[1:])
    y = jax.lax.map(lambda xm: stack(xm[0], mask=xm[1], scale=scale), (split(x), split(mask)))
    y = y.reshape(x.shape)
    return _weighted(y), y

  return jax.jit(jax.value_and_grad(objective, has_aux=True))


def _params():
  plain = tnnx.Repeat(lambda r: MaskedBlock(WIDTH, rngs=r), LENGTH, rngs=nnx.Rngs(0))
  return nnx.to_pure_dict(nnx.state(plain, nnx.Param))


@functools.cache
def _reference():
  return numerics.float64_reference(_plain_fn(1), _params(), *_inputs())


@nnx.jit
def _value_and_grad(model, x, mask, scale):

  def objective(model):
    y = model(x, mask, scale=scale)  # mask by position, scale by keyword
    return _weighted(y), y

  return nnx.value_and_grad(objective, has_aux=True)(model)


# (schedule, stages, micro-batches, data, tpipe.nnx.shard?)
CASES = [("gpipe", 1, 1, 1, False), ("gpipe", 2, 4, 2, True), ("gpipe", 4, 2, 1, True),
         ("circular", 2, 2, 2, False)]


@pytest.mark.parametrize("schedule,stages,microbatches,data,placed", CASES)
def test_outputs_and_gradients_equal_the_copies_in_order(schedule, stages, microbatches, data,
                                                         placed):
  mesh = tpipe.make_mesh(stages=stages, data=data)
  stack = tnnx.pipeline(MaskedBlock, length=LENGTH, num_stages=stages,
                        num_microbatches=microbatches, schedule=schedule,
                        num_repeats=2 if schedule == "circular" else 1, per_example=("mask",),
                        mesh=mesh)
  model = stack(WIDTH, rngs=nnx.Rngs(0))
  assert isinstance(model, nnx.Module) and type(model).__name__ == "PipelinedMaskedBlock"
  # The state is the plain Repeat's: the block's Params stacked on a leading axis of LENGTH.
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  jax.tree.map(np.testing.assert_array_equal, params, _params())
  assert params["layer"]["up"]["kernel"].shape == (LENGTH, WIDTH, 2 * WIDTH)
  if placed:  # The copies split evenly over the stages, so all of them can be stage-resident.
    tnnx.shard(model)
    spec = nnx.get_partition_spec(nnx.state(model, nnx.Param))["layer"]["up"]["kernel"]
    assert spec.get_value() == jax.sharding.PartitionSpec("stage", None, None)

  x, mask, scale = _inputs()
  x, mask = jax.device_put((x, mask), tpipe.data_sharding(mesh))
  (_, y), grads = _value_and_grad(model, x, mask, scale)
  (_, plain_y), plain_grads = _plain_fn(microbatches * data)(_params(), *_inputs())
  (_, y64), grads64 = _reference()
  numerics.assert_as_close_as_plain(y, plain_y, y64, what="outputs")
  numerics.assert_as_close_as_plain(nnx.to_pure_dict(grads), plain_grads, grads64,
                                    what="gradients")
  if placed:
    assert grads["layer"]["up"]["kernel"][...].sharding.spec[0] == "stage"


def test_the_check_fails_for_copies_out_of_order():
  model = tnnx.pipeline(MaskedBlock, length=LENGTH, num_stages=2, num_microbatches=2,
                        per_example=("mask",), mesh=tpipe.make_mesh(stages=2))(
                            WIDTH, rngs=nnx.Rngs(0))
  kernel = model.layer.up.kernel
  kernel[...] = kernel[...][::-1]
  (_, y), _ = _value_and_grad(model, *_inputs())
  (_, plain_y), _ = _plain_fn(2)(_params(), *_inputs())
  (_, y64), _ = _reference()
  with pytest.raises(AssertionError):
    numerics.assert_as_close_as_plain(y, plain_y, y64, what="outputs")


def test_bad_arguments_raise_clear_errors():
  settings = dict(length=4, num_stages=2, num_microbatches=2)
  with pytest.raises(TypeError, match="takes an nnx.Module class"):
    tnnx.pipeline(MaskedBlock(WIDTH, rngs=nnx.Rngs(0)), **settings)
  with pytest.raises(TypeError, match="flax.linen class: use tpipe.pipeline"):
    tnnx.pipeline(tpipe.Sequential, **settings)
  with pytest.raises(ValueError, match="cannot be split evenly"):
    tnnx.pipeline(MaskedBlock, length=6, num_stages=4, num_microbatches=2)
  with pytest.raises(TypeError, match="length must be an int"):
    tnnx.pipeline(MaskedBlock, length=4.0, num_stages=2, num_microbatches=2)
  # A fused schedule differentiates a loss, which a stack of blocks does not compute: the fix
  # named is the NNX one (the blocks in a tpipe.nnx.Repeat, a loss layer after them).
  with pytest.raises(ValueError, match=r"^tpipe.nnx.pipeline returns the blocks' activations, "
                                       r"but schedule='1f1b'.*tpipe\.nnx\.Sequential\(.*"
                                       r"tpipe\.nnx\.Repeat\("):
    tnnx.pipeline(MaskedBlock, schedule="1f1b", **settings)
  with pytest.raises(ValueError, match="Unknown schedule|unknown schedule"):
    tnnx.pipeline(MaskedBlock, schedule="gpipe2", **settings)
  with pytest.raises(ValueError, match="not a parameter of MaskedBlock.__call__"):
    tnnx.pipeline(MaskedBlock, per_example=("labels",), **settings)
  with pytest.raises(ValueError, match="'stage' axis of the mesh given has size 4"):
    tnnx.pipeline(MaskedBlock, mesh=tpipe.make_mesh(stages=4), **settings)
  model = tnnx.pipeline(MaskedBlock, per_example=("mask",), mesh=tpipe.make_mesh(stages=2),
                        **settings)(WIDTH, rngs=nnx.Rngs(0))
  x, mask, scale = _inputs()
  # Bound to MaskedBlock.__call__ as tpipe.pipeline binds a linen block's arguments.
  with pytest.raises(TypeError, match=r"do not fit MaskedBlock.__call__\(self, x, mask, "
                                      r"scale=None\): too many positional arguments"):
    model(x, mask, scale, 1.0)
  with pytest.raises(TypeError, match=r"do not fit MaskedBlock.__call__.*multiple values for "
                                      r"argument 'mask'"):
    model(x, mask, mask=mask)
  with pytest.raises(TypeError, match=r"do not fit MaskedBlock.__call__.*unexpected keyword "
                                      r"argument 'colour'"):
    model(x, mask, colour=1)


def _linen_masked_block():
  """The linen twin of :class:`MaskedBlock`: its name and its call's signature."""

  class MaskedBlock(nn.Module):  # pylint: disable=redefined-outer-name

    @nn.compact
    def __call__(self, x, mask, scale=None):
      return x + mask[:, None, None] * scale * nn.Dense(WIDTH)(x)

  return MaskedBlock


def _error(call):
  """``(type, message)`` of the error ``call()`` raises, the front end's name written as linen's."""
  with pytest.raises((TypeError, ValueError)) as caught:
    call()
  return type(caught.value), re.sub(r"tpipe\.nnx\.pipeline(\(MaskedBlock\))?", "tpipe.pipeline",
                                    str(caught.value))


@pytest.mark.parametrize("settings,bad_call", [
    ({}, lambda x, mask, scale: ((x, mask, scale, 1.0), {})),  # Too many positional arguments.
    ({}, lambda x, mask, scale: ((x, mask), {"mask": mask})),  # One given twice.
    ({}, lambda x, mask, scale: ((x, mask), {"colour": 1})),  # An unknown keyword.
    ({}, lambda x, mask, scale: ((x,), {"scale": scale})),  # A missing one.
    ({}, lambda x, mask, scale: ((x[0, 0, 0], mask), {})),  # An input without a batch axis.
    ({"per_example": ("mask",)}, lambda x, mask, scale: ((x, mask[:8]), {})),  # Rows != batch.
    # Broadcast, one row per example: the layer fails, and the hint names the fix.
    ({}, lambda x, mask, scale: ((x, mask), {"scale": scale})),
])
def test_a_bad_call_raises_what_tpipe_pipeline_raises(settings, bad_call):
  settings = dict(length=4, num_stages=2, num_microbatches=2, mesh=tpipe.make_mesh(stages=2),
                  **settings)
  args, kwargs = bad_call(*_inputs())
  linen = tpipe.pipeline(_linen_masked_block(), **settings)()
  nnx_model = tnnx.pipeline(MaskedBlock, **settings)(WIDTH, rngs=nnx.Rngs(0))
  linen_error = _error(lambda: linen.init({"params": jax.random.key(0)}, *args, **kwargs))
  nnx_error = _error(lambda: nnx_model(*args, **kwargs))
  if "failed on one micro-batch" in linen_error[1]:
    # The layer's own failure reads as its front end says it; what tpipe adds is the same.
    linen_error, nnx_error = [(kind, message.splitlines()[-1])
                              for kind, message in (linen_error, nnx_error)]
    assert "pass per_example=('mask',) to tpipe.pipeline." in linen_error[1]
  assert nnx_error == linen_error


@pytest.mark.parametrize("per_example", [("labels",), ("x",), "mask"])
def test_bad_settings_raise_what_tpipe_pipeline_raises(per_example):
  settings = dict(length=4, num_stages=2, num_microbatches=2, per_example=per_example)
  assert (_error(lambda: tnnx.pipeline(MaskedBlock, **settings))
          == _error(lambda: tpipe.pipeline(_linen_masked_block(), **settings)))
