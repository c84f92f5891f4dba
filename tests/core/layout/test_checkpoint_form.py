"""tpipe.core.layout.checkpoint_form: where each logical leaf of the tiny core-layer pipeline
(:mod:`tests.helpers.core_layers`) lives in a checkpoint on a stage 2 x fsdp 2 mesh, the checks
on the specs it is given, and the round trip staged -> checkpoint form -> staged
(:mod:`tpipe.core.layout.relayout`) on it."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpipe
from tests.helpers import core_layers as cl
from tpipe.core.layout import checkpoint_form
from tpipe.core.layout import relayout
from tpipe.core.layout import staging


@pytest.fixture(scope="module")
def laid_out():
  mesh = tpipe.make_mesh(stages=2, fsdp=2)
  spec = tpipe.PipelineSpec(num_stages=2, num_microbatches=2, schedule="1f1b", balance=[3, 3],
                            per_example=("targets",), mesh=mesh)
  layout = cl.build(spec).layout
  return layout, layout.partition_specs("stage", mesh=mesh), mesh


def test_spec_entries():
  assert checkpoint_form.axes_of(None) == ()
  assert checkpoint_form.axes_of("fsdp") == ("fsdp",)
  assert checkpoint_form.axes_of(("fsdp", "stage")) == ("fsdp", "stage")
  assert checkpoint_form.staged_specs_of(
      {"a": jax.ShapeDtypeStruct((2,), np.float32,
                                 sharding=NamedSharding(tpipe.make_mesh(stages=2), P("stage")))}
  ) == {"a": P("stage")}


def test_checkpoint_specs(laid_out):
  layout, specs, mesh = laid_out
  # Stacked: one copy's fsdp dimension as inside its stage, plus stage on the largest even
  # dimension after the copy axis. Packed: fsdp where the pieces are cut, plus stage.
  assert checkpoint_form.checkpoint_specs(layout, specs, mesh) == {
      "layers_0": {"bias": P(("fsdp", "stage")), "kernel": P(None, ("fsdp", "stage"))},
      "layers_1": {"kernel": P(None, ("fsdp", "stage")), "scale": P(None, ("fsdp", "stage"))},
      "layers_2": {"kernel": P(("fsdp", "stage"))},
  }
  where = checkpoint_form.placement(layout, specs, mesh)
  assert where["layers_1"]["['kernel']"] == ([(), ("fsdp",), ()], 1)
  assert where["layers_0"]["['kernel']"] == ([(), ("fsdp",)], 1)


def test_stacked_copies_and_repeats(laid_out):
  layout, _, _ = laid_out
  assert checkpoint_form.stacked_starts(layout, 1) == {(0, 0): 0, (0, 1): 2}
  assert checkpoint_form.is_repeated(layout, "layers_1")
  assert not checkpoint_form.is_repeated(layout, "layers_0")


def test_check_blocks_refuses_another_mesh_or_specs(laid_out):
  layout, specs, mesh = laid_out
  checkpoint_form.check_blocks(layout, specs, mesh)
  with pytest.raises(ValueError, match="in 2 blocks for an fsdp axis of that size, but this "
                     "mesh's fsdp axis has 1 devices"):
    checkpoint_form.check_blocks(layout, specs, tpipe.make_mesh(stages=2))
  whole = dict(specs, packed={"float32": P(None, "stage")})
  with pytest.raises(ValueError, match="laid out in 2 fsdp blocks but its partition spec is"):
    checkpoint_form.check_blocks(layout, whole, mesh)


def test_round_trip_through_the_checkpoint_form(laid_out):
  layout, specs, mesh = laid_out
  logical = cl.params()
  is_spec = lambda s: isinstance(s, P)
  staged = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                        staging.to_staged(layout, logical), specs, is_leaf=is_spec)
  saved = jax.jit(lambda s: relayout.to_checkpoint(layout, s, specs, mesh))(staged)
  ckpt_specs = checkpoint_form.checkpoint_specs(layout, specs, mesh)
  for name, tree in logical.items():
    for key, leaf in tree.items():
      np.testing.assert_array_equal(saved[name][key], leaf, err_msg=f"{name}/{key}")
      want = NamedSharding(mesh, ckpt_specs[name][key])
      assert saved[name][key].sharding.is_equivalent_to(want, leaf.ndim)
  back = jax.jit(lambda t: relayout.from_checkpoint(layout, t, specs, mesh))(saved)
  for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(staged)):
    np.testing.assert_array_equal(got, want)
