"""tpipe.nnx.shard: a Repeat cut evenly over the stages lives split over 'stage'.

After ``tpipe.nnx.shard(model)``, the LM of tests/test_nnx.py (embedding, Repeat of 6 blocks,
head; S=2 with balance [4, 4], so stage s holds copies [3s, 3s + 3)) has its Repeat's Params
annotated and placed ``P('stage', None, ...)`` and its other Params replicated; the Param state's
paths and values are unchanged; outputs and gradients still equal the layers in order (numerics
rule: :mod:`tests.numerics`), for GPipe and every one-chunk-per-stage fused schedule. The compiled
``nnx.jit`` train step (Adam) then communicates over 'stage' only the neighbour sends inside the
tick loop and one all-reduce of the embedding's and head's gradients (plus the loss), where the
replicated model all-reduces every parameter's gradient; no all-gather or all-to-all over
'stage'. Settings that cannot place a Repeat raise clear errors.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import tpipe
from tests import numerics
from tests import test_nnx
from tpipe import nnx as tnnx
from tpipe.linen import sequential as linen_sequential
from tpipe.tools import analysis

BALANCE = [4, 4]  # Embed + copies 0-2 | copies 3-5 + head.
ONE_CHUNK_FUSED = [s for s in linen_sequential.FUSED_SCHEDULES if test_nnx._fused_repeats(s) == 1]


def _model(schedule="gpipe", data=2, **kwargs):
  mesh = tpipe.make_mesh(stages=2, data=data)
  model, x, inputs = test_nnx._pipelined("lm", num_stages=2, num_microbatches=2,
                                         schedule=schedule, balance=BALANCE, mesh=mesh, **kwargs)
  return model, mesh, jax.device_put((x, inputs), tpipe.data_sharding(mesh))


def _bytes(tree):
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def test_the_evenly_cut_repeat_is_annotated_and_placed_over_stages():
  model, mesh, _ = _model()
  before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert tnnx.shard(model) is model
  after = nnx.state(model, nnx.Param)
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(after), before)
  values = dict(nnx.to_flat_state(after))
  for path, spec in nnx.to_flat_state(nnx.get_partition_spec(after)):
    value = values[path][...]
    want = (jax.sharding.PartitionSpec("stage", *[None] * (value.ndim - 1))
            if path[:3] == ("layers", 1, "layer") else jax.sharding.PartitionSpec())
    assert spec.get_value() == want, (path, spec.get_value())
    assert value.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, want), value.ndim), path
  kernel = model.layers[1].layer.up.kernel[...]
  assert {tuple(s.data.shape) for s in kernel.addressable_shards} == {(3, 8, 16)}


# The forward executor and the fused one (ZB-H1: its split backward too); the fused schedules
# with one chunk per stage share the executor, and each is checked on its own in test_fused.py.
@pytest.mark.parametrize("schedule", ["gpipe", "zb_h1"])
def test_placed_outputs_and_gradients_equal_the_layers_in_order(schedule):
  assert schedule == "gpipe" or schedule in ONE_CHUNK_FUSED
  model, _, (x, inputs) = _model(schedule)
  tnnx.shard(model)
  if schedule == "gpipe":
    (_, y), grads = test_nnx._value_and_grad(model, x, inputs)
    (_, plain_y), plain_grads = test_nnx._plain("lm", 4)
    (_, y64), grads64 = test_nnx._reference("lm")
    numerics.assert_as_close_as_plain(y, plain_y, y64, what="outputs")
  else:
    grads = nnx.jit(lambda m, x, kw: nnx.grad(lambda m: test_nnx._objective(m(x, **kw)))(m))(
        model, x, inputs)
    _, plain_grads = test_nnx._plain_loss(4)
    _, grads64 = test_nnx._plain_loss(1, "float64")
  numerics.assert_as_close_as_plain(nnx.to_pure_dict(grads)["layers"], plain_grads, grads64,
                                    what="gradients")
  # The gradients come back where the parameters live.
  assert grads["layers"][1]["layer"]["up"]["kernel"][...].sharding.spec[0] == "stage"


def _stage_collectives(placed):
  model, mesh, (x, inputs) = _model()
  if placed:
    tnnx.shard(model)
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, inputs):
    loss, grads = nnx.value_and_grad(lambda m: m(x, **inputs).mean())(model)
    optimizer.update(model, grads)
    return loss

  compiled = step.lower(model, optimizer, x, inputs).compile()
  found = [c for c in analysis.collectives(compiled, mesh) if c.axes and "stage" in c.axes]
  step(model, optimizer, x, inputs)
  return model, optimizer, found


def test_the_placed_train_step_all_reduces_only_the_replicated_layers_over_stage():
  params = nnx.to_pure_dict(nnx.state(_model()[0], nnx.Param))["layers"]
  replicated = _bytes([params[0], params[2]])  # The embedding and the head.
  assert replicated < _bytes(params) / 4

  _, _, before = _stage_collectives(placed=False)
  reduced = sum(c.total_bytes for c in before if c.kind == "all-reduce")
  assert reduced >= _bytes(params), before  # Every parameter's gradient, every step.

  model, optimizer, after = _stage_collectives(placed=True)
  kinds = {c.kind for c in after}
  assert kinds == {"collective-permute", "all-reduce"}, after  # No all-gather or all-to-all.
  assert all(c.in_loop for c in after if c.kind == "collective-permute"), after
  reduced = sum(c.total_bytes for c in after if c.kind == "all-reduce")
  # The embedding's and head's gradients, and the per-example losses (4 bytes each).
  assert replicated <= reduced <= replicated + 4 * test_nnx.BATCH, after
  # After an Adam update the Repeat's parameters and moments still live split over 'stage'.
  assert model.layers[1].layer.up.kernel[...].sharding.spec[0] == "stage"
  moment = optimizer.opt_state[0].mu["layers"][1]["layer"]["up"]["kernel"][...]
  assert moment.sharding.spec[0] == "stage"


def test_settings_that_cannot_place_a_repeat_raise_clear_errors():
  mesh = tpipe.make_mesh(stages=2)
  build = lambda **kw: test_nnx._pipelined("lm", num_stages=2, num_microbatches=2,
                                           **{"mesh": mesh, **kw})[0]
  with pytest.raises(ValueError, match=r"computed from costs.*e\.g\. balance=\[4, 4\]"):
    tnnx.shard(build())
  with pytest.raises(ValueError, match=r"cuts no Repeat evenly.*e\.g\. balance=\[4, 4\]"):
    tnnx.shard(build(balance=[3, 5]))
  with pytest.raises(ValueError, match="non-contiguous chunks"):
    tnnx.shard(build(schedule="circular", num_repeats=2, balance=[2, 2, 2, 2]))
  with pytest.raises(ValueError, match="needs the mesh"):
    tnnx.shard(test_nnx._pipelined("lm", num_stages=1, num_microbatches=1, balance=[8])[0])
  with pytest.raises(TypeError, match="tpipe.nnx.Sequential or a tpipe.nnx.pipeline"):
    tnnx.shard(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
