"""tpipe.core.layout.relayout: staged variables to the sharded logical checkpoint form and back.

On 8 CPU devices, the LM of ``configs/lm.py`` (embedding and head packed, a Repeat of blocks
stacked per leaf) in layouts that exercise every path: even and uneven splits (copies of the
Repeat in packed buffers), circular and "v" placements, fsdp, tensor and data axes. The
conversion must equal :meth:`StageLayout.to_logical` bit for bit, invert exactly, and leave each
device only its share of every logical leaf, with no collective but all-to-alls over ``stage``
where the pieces line up.
"""

import functools
import re

import jax
import numpy as np
import pytest

from tpipe.core.layout import checkpoint_form
from tpipe.core.layout import relayout
from tests.helpers.shapes import abstract_shapes
from tpipe.core.layout import staging
from tpipe.train.cli import experiment
from configs import lm

# name: (stages, data, fsdp, tensor, schedule, repeats, balance)
LAYOUTS = {
    "stage4_fsdp2": (4, 1, 2, 1, "gpipe", 1, None),
    "stage2_fsdp2_tensor2_uneven": (2, 1, 2, 2, "gpipe", 1, "2,4"),
    "stage2_fsdp2_data2_zbv": (2, 2, 2, 1, "zbv", 2, None),
    "stage2_fsdp2_tensor2_circular": (2, 1, 2, 2, "circular", 2, None),
    "stage1_fsdp8": (1, 1, 8, 1, "gpipe", 1, None),
}


def _experiment(name, **overrides):
  """The tiny LM's experiment in layout ``name``; without overrides built once per test process
  (the tests only read it)."""
  return _build(name, **overrides) if overrides else _shared(name)


@functools.cache
def _shared(name):
  return _build(name)


def _build(name, **overrides):
  stages, data, fsdp, tensor, schedule, repeats, balance = LAYOUTS[name]
  config = lm.get_config("size=tiny")
  config.update(dict(num_stages=stages, num_data=data, schedule=schedule, num_repeats=repeats,
                     batch_size=64))
  if balance:
    config.balance = balance
  config.mesh.update(dict(fsdp=fsdp, tensor=tensor))
  config.update(overrides)
  return experiment.build(config)


def _convert(exp):
  specs = checkpoint_form.staged_specs_of(exp.abstract_state().params)
  save = jax.jit(lambda s: relayout.to_checkpoint(exp.layout, s, specs, exp.mesh))
  load = jax.jit(lambda t: relayout.from_checkpoint(exp.layout, t, specs, exp.mesh))
  return specs, save, load


# The layouts the conversions in small parts run on, with eight blocks (several copies of the
# Repeat per stage; the uneven split 4 | 6 units).
EIGHT_BLOCKS = {
    "stage2_fsdp2_tensor2_uneven": dict(num_layers=8, balance="4,6"),
    "stage2_fsdp2_data2_zbv": dict(num_layers=8),
    "stage4_fsdp2": dict(num_layers=8),
}


@functools.cache
def _saved(name):
  """``(exp, params, specs, load, logical)``: layout ``name``'s experiment (with eight blocks
  where the conversions in small parts run on it), its initial staged parameters and their
  whole conversion to the checkpoint form, built and run once for the tests that read them."""
  exp = _experiment(name, **EIGHT_BLOCKS.get(name, {}))
  params = exp.init_state(jax.random.key(0)).params
  specs, save, load = _convert(exp)
  return exp, params, specs, load, save(params)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_checkpoint_form_equals_to_logical_and_inverts_exactly(name):
  exp, params, specs, load, logical = _saved(name)
  want = jax.jit(functools.partial(staging.to_logical, exp.layout))(params)
  assert jax.tree.structure(logical) == jax.tree.structure(want)
  for (path, got), expected in zip(jax.tree_util.tree_flatten_with_path(logical)[0],
                                   jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected),
                                  err_msg=jax.tree_util.keystr(path))
  back = load(logical)
  for got, staged in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(staged))
    assert got.sharding.is_equivalent_to(staged.sharding, got.ndim)
  # Each leaf is split as checkpoint_specs says, and a device holds only its block of it.
  ckpt_specs = checkpoint_form.checkpoint_specs(exp.layout, specs, exp.mesh)
  sizes = dict(exp.mesh.shape)
  is_spec = lambda s: isinstance(s, jax.sharding.PartitionSpec)
  for leaf, spec in zip(jax.tree.leaves(logical), jax.tree.leaves(ckpt_specs, is_leaf=is_spec)):
    assert leaf.sharding.is_equivalent_to(jax.sharding.NamedSharding(exp.mesh, spec), leaf.ndim)
    ways = int(np.prod([sizes[a] for entry in spec if entry
                        for a in (entry if isinstance(entry, tuple) else (entry,))]))
    assert leaf.addressable_shards[0].data.size * ways == leaf.size


@pytest.mark.parametrize("name", list(EIGHT_BLOCKS))
def test_conversions_in_small_parts_are_exact(name):
  # Parts far smaller than a leaf, in loops: stacked leaves move a copy at a time both ways,
  # packed pieces come back a band of rows at a time (3000 bytes: bands that do not divide the
  # rows, so the last band overlaps the one before it). Eight blocks: several copies of the
  # Repeat per stage. Both part sizes on one experiment (one build, one init, one whole save,
  # those of the checkpoint form's test above).
  exp, params, specs, _, want = _saved(name)
  assert max(exp.layout.stacked.values()) > 1
  for part_bytes in (64, 3000):
    what = f"part_bytes={part_bytes}"
    save_parts = jax.jit(lambda s, n=part_bytes: relayout.to_checkpoint(
        exp.layout, s, specs, exp.mesh, part_bytes=n)).lower(params)
    load_parts = jax.jit(lambda t, n=part_bytes: relayout.from_checkpoint(
        exp.layout, t, specs, exp.mesh, part_bytes=n)).lower(want)
    assert "while" in save_parts.as_text(), what
    assert "while" in load_parts.as_text(), what
    logical = save_parts.compile()(params)
    for got, expected in zip(jax.tree.leaves(logical), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(expected), err_msg=what)
    for got, staged in zip(jax.tree.leaves(load_parts.compile()(logical)),
                           jax.tree.leaves(params)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(staged), err_msg=what)


@pytest.mark.parametrize("part_bytes", [0, -5, 2.5, True])
def test_a_bad_part_size_is_a_clear_error(part_bytes):
  exp = _experiment("stage4_fsdp2")
  staged = exp.abstract_state().params
  specs = checkpoint_form.staged_specs_of(staged)
  logical = jax.eval_shape(functools.partial(staging.to_logical, exp.layout), staged)
  with pytest.raises(ValueError, match=r"part_bytes=.* positive int"):
    relayout.from_checkpoint(exp.layout, logical, specs, exp.mesh, part_bytes=part_bytes)
  with pytest.raises(ValueError, match=r"part_bytes=.* positive int"):
    relayout.to_checkpoint(exp.layout, staged, specs, exp.mesh, part_bytes=part_bytes)


def test_every_block_weight_is_split_over_stages_fsdp_and_tensor():
  exp = _experiment("stage2_fsdp2_tensor2_circular")
  specs, _, _ = _convert(exp)
  ckpt_specs = checkpoint_form.checkpoint_specs(exp.layout, specs, exp.mesh)
  is_spec = lambda s: isinstance(s, jax.sharding.PartitionSpec)
  for path, spec in jax.tree_util.tree_flatten_with_path(ckpt_specs["layers_1"],
                                                         is_leaf=is_spec)[0]:
    if jax.tree_util.keystr(path).endswith("['kernel']"):
      axes = {a for entry in spec if entry
              for a in (entry if isinstance(entry, tuple) else (entry,))}
      assert {"stage", "fsdp"} <= axes, (path, spec)
  embedding = ckpt_specs["layers_0"]["embed"]["embedding"]
  assert {"stage", "fsdp", "tensor"} <= {
      a for entry in embedding if entry for a in (entry if isinstance(entry, tuple) else (entry,))}


def test_lined_up_pieces_move_by_all_to_all_alone():
  # Even split, pieces lined up with the checkpoint blocks: nothing is gathered or summed.
  exp = _experiment("stage4_fsdp2")
  _, save, load = _convert(exp)
  params = exp.abstract_state().params
  hlo = save.lower(params).compile().as_text()
  count = lambda op: len(re.findall(rf"\s{op}(-start)?\(", hlo))  # Results may be tuples.
  assert count("all-to-all") > 0
  assert count("all-gather") == count("all-reduce") == count("reduce-scatter") == 0
  logical = jax.eval_shape(save, params)
  logical = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         logical, jax.tree.map(lambda a: a.sharding, logical))
  hlo = load.lower(logical).compile().as_text()
  assert count("all-reduce") == count("reduce-scatter") == 0


def test_specs_from_another_layout_are_refused():
  exp = _experiment("stage4_fsdp2")
  specs = checkpoint_form.staged_specs_of(exp.abstract_state().params)
  whole = jax.tree.map(lambda s: jax.sharding.PartitionSpec(None, "stage"), specs,
                       is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
  with pytest.raises(ValueError, match="laid out in 2 fsdp blocks"):
    relayout.to_checkpoint(exp.layout, exp.abstract_state().params, whole, exp.mesh)


F32 = np.float32
# A plain layer with a scalar and an odd-sized vector; a Repeat that chunk 0 lacks (all its copies
# packed); a head.
ODD_LAYERS = [{"embedding": ((6, 4), F32), "gate": ((), F32), "odd": ((3,), F32)},
              {"kernel": ((5, 4, 4), F32), "bias": ((5, 4), F32)},
              {"kernel": ((4, 2), F32)}]


@pytest.mark.parametrize("mesh_sizes", [dict(stages=2, fsdp=2, tensor=2),
                                        dict(stages=2, data=2, tensor=2),
                                        dict(stages=4, fsdp=2)])
def test_scalars_odd_leaves_and_a_repeat_some_chunk_lacks_convert_exactly(mesh_sizes):
  import tpipe  # pylint: disable=import-outside-toplevel
  from tpipe.core.layout import description as layout_lib
  from tpipe.core.planning import plan as plan_lib  # pylint: disable=import-outside-toplevel

  mesh = tpipe.make_mesh(**mesh_sizes)
  stages = mesh_sizes["stages"]
  counts = (1, 6) if stages == 2 else (1, 2, 2, 2)  # Chunk 0: the embedding alone.
  groups = plan_lib.group_units([None, 5, None], counts)
  shapes = abstract_shapes(ODD_LAYERS)
  layout = layout_lib.StageLayout.build(groups, shapes, stages, 1, mesh=mesh)
  leaves, treedef = jax.tree.flatten(shapes)
  start, values = 1, []
  for leaf in leaves:  # Every element distinct.
    values.append(np.arange(start, start + leaf.size, dtype=F32).reshape(leaf.shape))
    start += leaf.size
  logical = jax.tree.unflatten(treedef, values)
  specs = layout.partition_specs(mesh=mesh)
  staged = jax.device_put(staging.to_staged(layout, logical), jax.tree.map(
      lambda s: jax.sharding.NamedSharding(mesh, s), specs,
      is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)))
  got = jax.jit(lambda s: relayout.to_checkpoint(layout, s, specs, mesh))(staged)
  assert jax.tree.structure(got) == jax.tree.structure(logical)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(logical)):
    assert a.shape == b.shape, (jax.tree_util.keystr(path), a.shape, b.shape)
    np.testing.assert_array_equal(np.asarray(a), b, err_msg=jax.tree_util.keystr(path))
  for part_bytes in (relayout.PART_BYTES, 8):  # Whole leaves; parts of a few rows.
    back = jax.jit(lambda t, n=part_bytes: relayout.from_checkpoint(layout, t, specs, mesh,
                                                                    part_bytes=n))(got)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(staged)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
