"""tpipe.nnx.shard: a Repeat cut evenly over the stages lives split over 'stage'.

After ``tpipe.nnx.shard(model)``, the LM of :mod:`tests.helpers.nnx_models` (embedding, Repeat
of 6 blocks, head; S=2 with balance [4, 4], so stage s holds copies [3s, 3s + 3)) has its Repeat's
Params annotated and placed ``P('stage', None, ...)`` and its other Params replicated; the Param
state's paths and values are unchanged; outputs and gradients still equal the layers in order
(numerics rule: :mod:`tests.helpers.numerics`), for GPipe and for the fused ZB-H1 (the gradients
of ``model.loss``, with its split backward). The compiled
``nnx.jit`` train step (Adam) then communicates over 'stage' only the neighbour sends inside the
tick loop and one all-reduce of the embedding's and head's gradients (plus the loss), where a
model whose state stays replicated moves every parameter's gradient or update over 'stage'; no
all-gather or all-to-all over 'stage'. Settings that cannot place a Repeat raise clear errors.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import tpipe
from tests.helpers import nnx_models
from tests.helpers import numerics
from tpipe import nnx as tnnx
from tpipe.tools import analysis

BALANCE = [4, 4]  # Embed + copies 0-2 | copies 3-5 + head.
ONE_CHUNK_FUSED = [s for s in tpipe.schedules.FUSED_SCHEDULE_NAMES
                   if nnx_models.fused_repeats(s) == 1]


def _model(schedule="gpipe", data=2, **kwargs):
  mesh = tpipe.make_mesh(stages=2, data=data)
  model, x, inputs = nnx_models.pipelined("lm", num_stages=2, num_microbatches=2,
                                          schedule=schedule, balance=BALANCE, mesh=mesh,
                                          **kwargs)
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


# The forward run and the fused one (ZB-H1: its split backward too); the fused schedules with
# one chunk per stage share the fused run, and each is checked on its own in tests/core and
# tests/nnx/test_sequential.py.
@pytest.mark.parametrize("schedule", ["gpipe", "zb_h1"])
def test_placed_outputs_and_gradients_equal_the_layers_in_order(schedule):
  assert schedule == "gpipe" or schedule in ONE_CHUNK_FUSED
  model, _, (x, inputs) = _model(schedule)
  tnnx.shard(model)
  if schedule == "gpipe":
    (_, y), grads = nnx_models.value_and_grad(model, x, inputs)
    (_, plain_y), plain_grads = nnx_models.plain("lm", 4)
    (_, y64), grads64 = nnx_models.reference("lm")
    numerics.assert_as_close_as_plain(y, plain_y, y64, what="outputs")
  else:
    objective = lambda m, x, kw: nnx_models.objective(m.loss(x, **kw))
    grads = nnx.jit(lambda m, x, kw: nnx.grad(objective)(m, x, kw))(model, x, inputs)
    _, plain_grads = nnx_models.plain_loss(4)
    _, grads64 = nnx_models.plain_loss(1, "float64")
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
    # Unplaced, the state lives replicated and the step keeps it so (tpipe.nnx.homes).
    loss, grads = nnx.value_and_grad(lambda m: m(x, **inputs).mean())(model)
    optimizer.update(model, grads)
    return loss

  compiled = step.lower(model, optimizer, x, inputs).compile()
  found = [c for c in analysis.collectives(compiled, mesh) if c.axes and "stage" in c.axes]
  step(model, optimizer, x, inputs)
  return model, optimizer, found


def test_the_placed_train_step_moves_only_the_replicated_layers_over_stage():
  params = nnx.to_pure_dict(nnx.state(_model()[0], nnx.Param))["layers"]
  replicated = _bytes([params[0], params[2]])  # The embedding and the head.
  assert replicated < _bytes(params) / 4

  # Kept replicated, the state's every parameter (its gradient or its update) crosses 'stage'
  # after the tick loop, every step.
  _, _, before = _stage_collectives(placed=False)
  moved = sum(c.total_bytes for c in before
              if c.kind in ("all-reduce", "all-gather") and not c.in_loop)
  assert moved >= _bytes(params), before

  model, optimizer, after = _stage_collectives(placed=True)
  # Inside the tick loop only the sends between neighbours. Outside it, once per step: the
  # replicated layers' packing into their stages' buffers and its gradient's way back (slices,
  # gathers and their transposes, which XLA partitions), and the batch entering and leaving
  # split over the stages. The placed Repeat's parameters (most of the model) never cross.
  assert all(c.kind == "collective-permute" for c in after if c.in_loop), after
  assert all(c.count == 1 for c in after if not c.in_loop), after
  _, _, (x, inputs) = _model()
  batch_io = max(_bytes((x, inputs)), 4 * nnx_models.BATCH)
  outside = sum(c.total_bytes for c in after if not c.in_loop)
  assert outside <= 2 * replicated + 2 * batch_io < _bytes(params), (outside, after)
  # After an Adam update the Repeat's parameters and moments still live split over 'stage'.
  assert model.layers[1].layer.up.kernel[...].sharding.spec[0] == "stage"
  moment = optimizer.opt_state[0].mu["layers"][1]["layer"]["up"]["kernel"][...]
  assert moment.sharding.spec[0] == "stage"


def test_settings_that_cannot_place_a_repeat_raise_clear_errors():
  mesh = tpipe.make_mesh(stages=2)
  build = lambda **kw: nnx_models.pipelined("lm", num_stages=2, num_microbatches=2,
                                            **{"mesh": mesh, **kw})[0]
  with pytest.raises(ValueError, match=r"computed from costs.*e\.g\. balance=\[4, 4\]"):
    tnnx.shard(build())
  with pytest.raises(ValueError, match=r"cuts no Repeat evenly.*e\.g\. balance=\[4, 4\]"):
    tnnx.shard(build(balance=[3, 5]))
  with pytest.raises(ValueError, match="non-contiguous chunks"):
    tnnx.shard(build(schedule="circular", num_repeats=2, balance=[2, 2, 2, 2]))
  with pytest.raises(ValueError, match="needs the mesh"):
    tnnx.shard(nnx_models.pipelined("lm", num_stages=1, num_microbatches=1, balance=[8])[0])
  with pytest.raises(TypeError, match="tpipe.nnx.Sequential or a tpipe.nnx.pipeline"):
    tnnx.shard(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
