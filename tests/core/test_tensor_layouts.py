"""A plain annotated Flax model on every 8-device layout with a tensor axis: placed by
``tpipe.shardings`` with the default rules and called under them, every schedule equals the
sequential model, and no collective inside a stage's branch waits for devices of another stage.

Emulated CPU devices run a collective-permute as one rendezvous of every device its pairs name:
inside a stage's branch (an HLO ``conditional``) it waits for the devices of the other stages,
which took another branch, until XLA aborts the process. Collectives with replica groups
(all-reduce, all-gather, reduce-scatter, all-to-all) meet per group, and a group over the
partitioner's axes (tensor) holds devices of one stage only. So the rule the engine keeps: inside
a branch, only grouped collectives over the axes inside a stage.
"""

import flax.linen as nn
import jax
import pytest

import tpipe
from tests.helpers import linen_models as lm
from tests.helpers import numerics
from tpipe.tools import analysis

MESHES = {
    "stage2-tensor2-data2": dict(stages=2, tensor=2, data=2),
    "stage2-fsdp2-tensor2": dict(stages=2, fsdp=2, tensor=2),
    "stage4-tensor2": dict(stages=4, tensor=2),
}
# Each schedule once and each layout twice (two chunks per stage need the 2-stage layouts: the
# model has 6 units).
CASES = [
    ("stage2-tensor2-data2", "gpipe"),
    ("stage2-tensor2-data2", "circular"),
    ("stage2-fsdp2-tensor2", "interleaved_1f1b"),
    ("stage2-fsdp2-tensor2", "zbv"),
    ("stage4-tensor2", "1f1b"),
    ("stage4-tensor2", "zb_h1"),
]


def _placed_params(model, mesh, x, targets):
  boxed = jax.eval_shape(model.init, {"params": jax.random.key(0)}, x, targets=targets)["params"]
  shardings = nn.unbox(tpipe.shardings(boxed, mesh, stacked=("layers_1",),
                                       rules=tpipe.DEFAULT_RULES))
  return jax.device_put(lm.random_params("gpt"), shardings)


@pytest.mark.parametrize("mesh_name,schedule", CASES)
def test_annotated_gpt_placed_under_the_rules_equals_sequential(mesh_name, schedule):
  sizes = MESHES[mesh_name]
  mesh = tpipe.make_mesh(**sizes)
  microbatches = 4 if sizes["stages"] == 4 else 2
  rows = sizes.get("data", 1) * sizes.get("fsdp", 1)
  layers, x, targets, _ = lm.loss_model("gpt")
  model = tpipe.Sequential(layers, num_stages=sizes["stages"], num_microbatches=microbatches,
                           schedule=schedule, per_example=("targets",), mesh=mesh,
                           num_repeats=2 if schedule in lm.TWO_CHUNKS else 1)
  params = _placed_params(model, mesh, x, targets)
  x, targets = jax.device_put((x, targets), tpipe.data_sharding(mesh))
  step = jax.jit(lm.value_and_grad(lm.pipelined_loss(model), False))
  with nn.logical_axis_rules(tpipe.DEFAULT_RULES):
    compiled = step.lower(params, x, targets).compile()
    # Checked before running: a collective-permute in a branch would abort the process.
    assert not analysis.cross_branch_collectives(compiled, mesh)
    assert any(c.in_branch and c.axes == ("tensor",)
               for c in analysis.collectives(compiled, mesh))  # The tensor split is used.
    value, grads = compiled(params, x, targets)
  plain_value, plain_grads = lm.plain("gpt", microbatches * rows)
  ref_value, ref_grads = lm.reference("gpt")
  numerics.assert_as_close_as_plain(value, plain_value, ref_value, what="loss")
  numerics.assert_as_close_as_plain(grads, plain_grads, ref_grads, what="gradients")
