"""Tests for tpipe.core.base.packing: exact round trips, padding, gradients, transforms,
validation."""

import doctest
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpipe.core.base import packing
from tpipe.core.base.packing import buffer_sizes, empty, layout_of, pack, unpack

DTYPES = ["float32", "bfloat16", "float16", "int32", "int8", "uint8", "bool"]


def _random(shape, dtype, seed=0):
  rng = np.random.default_rng(seed)
  dtype = jnp.dtype(dtype)
  if dtype == jnp.bool_:
    return jnp.asarray(rng.random(shape) < 0.5)
  if jnp.issubdtype(dtype, jnp.integer):
    info = jnp.iinfo(dtype)
    return jnp.asarray(rng.integers(info.min, info.max, shape, endpoint=True), dtype)
  return jnp.asarray(rng.standard_normal(shape), dtype)


def _assert_trees_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _nested(batch=None, seed=0):
  lead = () if batch is None else (batch,)
  return {
      "a": [_random(lead + (2, 3), "float32", seed), None, (_random(lead, "int32", seed + 1),)],
      "b": {"m": _random(lead + (4,), "bool", seed + 2), "e": jnp.zeros(lead + (0, 3), "int8")},
      "c": _random(lead + (1, 2, 2), "bfloat16", seed + 3),
  }


@pytest.mark.parametrize("batch_dims", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_dtype(dtype, batch_dims):
  tree = {"x": _random((3, 4), dtype), "y": (_random((3,), dtype, 1), _random((3, 0), dtype))}
  if not batch_dims:
    tree["s"] = _random((), dtype, 2)
  layout = layout_of(tree, batch_dims)
  buffers = pack(tree, layout)
  assert list(buffers) == [dtype]
  assert buffers[dtype].shape == ((3, 5) if batch_dims else (3 * 4 + 3 + 1,))
  _assert_trees_equal(unpack(buffers, layout), tree)


@pytest.mark.parametrize("batch_dims", [0, 1])
def test_round_trip_float64(batch_dims):
  with jax.enable_x64(True):
    tree = (_random((2, 3), "float64"), _random((2,), "float32"))
    layout = layout_of(tree, batch_dims)
    buffers = pack(tree, layout)
    assert {k: v.dtype for k, v in buffers.items()} == {"float32": jnp.float32,
                                                        "float64": jnp.float64}
    _assert_trees_equal(unpack(buffers, layout), tree)


@pytest.mark.unit
def test_float64_without_x64_is_rejected():
  with pytest.raises(TypeError, match="jax_enable_x64"):
    layout_of({"w": np.zeros(3, np.float64)})


def test_round_trip_nested_unbatched():
  tree = _nested()
  layout = layout_of(tree)
  assert layout.sizes() == {"bfloat16": 4, "bool": 4, "float32": 6, "int32": 1, "int8": 0}
  buffers = pack(tree, layout)
  assert list(buffers) == sorted(buffers)
  _assert_trees_equal(unpack(buffers, layout), tree)


def test_one_batched_layout_serves_every_batch_size():
  layout = layout_of(_nested(batch=2), batch_dims=1)
  assert layout == layout_of(_nested(batch=5), batch_dims=1)
  assert layout.shapes[0] == (2, 3)  # [B, 2, 3] becomes 6 columns.
  for batch in (1, 2, 7):
    tree = _nested(batch=batch, seed=batch)
    buffers = pack(tree, layout)
    assert {k: v.shape for k, v in buffers.items()} == {
        "bfloat16": (batch, 4), "bool": (batch, 4), "float32": (batch, 6), "int32": (batch, 1),
        "int8": (batch, 0)}
    np.testing.assert_array_equal(buffers["float32"], tree["a"][0].reshape(batch, 6))
    _assert_trees_equal(unpack(buffers, layout), tree)


def test_layout_is_hashable_static_data():
  layout = layout_of(_nested())
  assert hash(layout) == hash(layout_of(_nested(seed=3)))
  assert layout != packing.Layout(layout.treedef, layout.shapes, layout.dtypes, layout.offsets,
                                  batch_dims=1)
  assert layout != layout_of({"a": jnp.zeros(3)})
  assert layout_of(jax.eval_shape(_nested)) == layout
  round_trip = jax.jit(lambda t, lay: unpack(pack(t, lay), lay), static_argnums=1)
  _assert_trees_equal(round_trip(_nested(), layout), _nested())


@pytest.mark.parametrize("batch", [None, 3])
def test_pack_pads_with_zeros_and_fills_missing_dtypes(batch):
  lead = () if batch is None else (batch,)
  tree = {"w": _random(lead + (2, 2), "float32"), "m": _random(lead + (1,), "bool")}
  layout = layout_of(tree, batch_dims=int(batch is not None))
  sizes = {"int8": 2, "float32": 7, "bool": 1}
  buffers = pack(tree, layout, sizes)
  assert list(buffers) == ["bool", "float32", "int8"]
  assert {k: v.shape for k, v in buffers.items()} == {k: lead + (n,) for k, n in sizes.items()}
  assert {k: v.dtype.name for k, v in buffers.items()} == {k: k for k in sizes}
  np.testing.assert_array_equal(buffers["float32"][..., 4:], 0)
  np.testing.assert_array_equal(buffers["int8"], 0)
  _assert_trees_equal(unpack(buffers, layout), tree)
  zeros = empty(sizes, batch)
  assert jax.tree.structure(zeros) == jax.tree.structure(buffers)
  assert all(not np.any(z) for z in jax.tree.leaves(zeros))
  assert jax.tree.map(lambda a: (a.shape, a.dtype), zeros) == jax.tree.map(
      lambda a: (a.shape, a.dtype), buffers)


def test_unpack_ignores_extra_dtypes():
  tree = {"x": jnp.arange(3.0)}
  layout = layout_of(tree)
  buffers = {"int32": jnp.ones(5, jnp.int32), "float32": jnp.arange(4.0)}
  _assert_trees_equal(unpack(buffers, layout), tree)


def test_buffer_sizes_is_the_largest_per_dtype():
  layouts = [
      layout_of({"h": jnp.zeros((8, 16))}, batch_dims=1),
      layout_of({"h": jnp.zeros((8, 4)), "ids": jnp.zeros((8, 3), jnp.int32)}, batch_dims=1),
      layout_of((jnp.zeros((8, 2, 5), jnp.bfloat16), jnp.zeros((8, 20))), batch_dims=1),
  ]
  assert buffer_sizes(layouts) == {"bfloat16": 10, "float32": 20, "int32": 3}
  assert list(buffer_sizes(layouts)) == ["bfloat16", "float32", "int32"]
  assert buffer_sizes([]) == {}
  stacked = [pack(jax.tree.map(jnp.ones_like, unpack(empty(lay.sizes(), 8), lay)), lay,
                  buffer_sizes(layouts)) for lay in layouts]
  assert len({str(jax.tree.map(lambda a: (a.shape, a.dtype), s)) for s in stacked}) == 1
  with pytest.raises(ValueError, match="mix batch_dims"):
    buffer_sizes([layouts[0], layout_of(jnp.zeros(3))])


@pytest.mark.parametrize("batch_dims", [0, 1])
def test_gradient_is_identity_and_padding_gets_none(batch_dims):
  tree = {"a": _random((2, 3), "float32"), "b": (_random((2,), "float32", 1),
                                                 _random((2,), "int32", 2))}
  layout = layout_of(tree, batch_dims)
  sizes = {"float32": 12, "int32": 4}
  weights = jax.tree.map(lambda x: _random(x.shape, "float32", 5), tree)

  def loss(floats):
    out = unpack(pack({"a": floats["a"], "b": (floats["b"], tree["b"][1])}, layout, sizes), layout)
    return sum(jnp.sum(w * o) for w, o in zip(jax.tree.leaves(weights), jax.tree.leaves(out))
               if o.dtype == jnp.float32)

  grads = jax.grad(loss)({"a": tree["a"], "b": tree["b"][0]})
  np.testing.assert_array_equal(grads["a"], weights["a"])
  np.testing.assert_array_equal(grads["b"], weights["b"][0])

  def loss_of_buffer(buffer):
    out = unpack({"float32": buffer, "int32": pack(tree, layout, sizes)["int32"]}, layout)
    return jnp.sum(out["a"] ** 2) + jnp.sum(out["b"][0])

  buffer = pack(tree, layout, sizes)["float32"]
  grad = jax.grad(loss_of_buffer)(buffer)
  used = layout.sizes()["float32"]
  np.testing.assert_array_equal(grad[..., used:], 0)
  np.testing.assert_array_equal(grad[..., :used], pack(
      {"a": 2 * tree["a"], "b": (jnp.ones_like(tree["b"][0]), tree["b"][1])}, layout)["float32"])


def test_jit_and_vmap():
  tree = _nested()
  layout = layout_of(tree)
  sizes = {**layout.sizes(), "float32": 9, "uint8": 2}
  buffers = jax.jit(lambda t: pack(t, layout, sizes))(tree)
  np.testing.assert_array_equal(buffers["float32"], pack(tree, layout, sizes)["float32"])
  _assert_trees_equal(jax.jit(lambda b: unpack(b, layout))(buffers), tree)

  batched = _nested(batch=3)  # vmap over the batch with a per-example (unbatched) layout.
  per_example = jax.vmap(lambda t: pack(t, layout, sizes))(batched)
  assert per_example["float32"].shape == (3, 9)
  _assert_trees_equal(per_example, pack(batched, layout_of(batched, batch_dims=1), sizes))
  _assert_trees_equal(jax.vmap(lambda b: unpack(b, layout))(per_example), batched)


def test_shard_map_round_trip_per_stage_layouts():
  mesh = jax.make_mesh((4,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))
  spec = jax.sharding.PartitionSpec("stage")
  params = [
      {"w": _random((3, 2), "float32", i), "n": _random((i,), "int32", i)}
      if i % 2 else (_random((i + 1,), "float32", i), _random((2, 2), "bfloat16", i))
      for i in range(4)
  ]
  layouts = [layout_of(p) for p in params]
  sizes = buffer_sizes(layouts)
  stacked = jax.tree.map(lambda *b: jnp.stack(b), *[pack(p, l, sizes)
                                                    for p, l in zip(params, layouts)])
  stacked = jax.device_put(stacked, jax.sharding.NamedSharding(mesh, spec))

  def stage(buffers):  # Each branch unpacks its own stage's tree, doubles it, repacks.
    def branch(layout):
      def run(row):
        tree = unpack(row, layout)
        return pack(jax.tree.map(lambda x: x + x, tree), layout, sizes)
      return run
    row = jax.tree.map(lambda b: b[0], buffers)
    out = jax.lax.switch(jax.lax.axis_index("stage"), [branch(lay) for lay in layouts], row)
    return jax.tree.map(lambda b: b[None], out)

  out = jax.jit(jax.shard_map(stage, mesh=mesh, in_specs=(spec,), out_specs=spec))(stacked)
  assert out["float32"].sharding.spec == spec
  for i, (p, layout) in enumerate(zip(params, layouts)):
    _assert_trees_equal(unpack(jax.tree.map(lambda b, i=i: b[i], out), layout),
                        jax.tree.map(lambda x: x + x, p))


# HLO instructions and StableHLO ops that index with traced values (the text also names the test
# functions in its stack-frame tables, so match the op syntax, not the bare words).
_INDEXING_OPS = (r"\s(gather|scatter|dynamic-slice|dynamic-update-slice)\("
                 r"|stablehlo\.(gather|scatter|dynamic_)")


def test_compiled_round_trip_has_no_gather_or_scatter():
  tree = _nested(batch=4)
  layout = layout_of(tree, batch_dims=1)
  sizes = {**layout.sizes(), "float32": 16}

  def round_trip(t):
    buffers = pack(t, layout, sizes)
    buffers = jax.tree.map(lambda b: b * 2 if b.dtype != jnp.bool_ else b, buffers)
    return unpack(buffers, layout)

  for fn in (round_trip, lambda t: pack(t, layout, sizes),
             lambda t: unpack(pack(t, layout, sizes), layout)):
    lowered = jax.jit(fn).lower(tree)
    for text in (lowered.as_text(), lowered.compile().as_text()):
      assert not re.search(_INDEXING_OPS, text), text


@pytest.mark.unit
def test_rejects_non_array_leaves():
  with pytest.raises(TypeError, match=r"\['lr'\] is a float, not an array"):
    layout_of({"lr": 0.1, "w": np.zeros(2, np.float32)})
  with pytest.raises(TypeError, match="str, not an array"):
    layout_of(["name"])
  with pytest.raises(TypeError, match="ShapeDtypeStruct, which has no values"):
    pack(jax.ShapeDtypeStruct((2,), jnp.float32), layout_of(np.zeros(2, np.float32)))


def test_rejects_prng_keys():
  with pytest.raises(TypeError, match="keys cannot be packed, pass them as RNG streams"):
    layout_of({"rng": jax.random.key(0)})
  layout = layout_of({"rng": jnp.zeros((), jnp.uint32)})
  with pytest.raises(TypeError, match="keys cannot be packed"):
    pack({"rng": jax.random.key(0)}, layout)


def test_rejects_mismatched_batch_sizes():
  tree = {"x": jnp.zeros((4, 3)), "mask": jnp.zeros((5,), bool)}
  with pytest.raises(ValueError, match=r"leaf \['mask'\] has shape \(5,\) and leaf \['x'\] has "
                     r"shape \(4, 3\)"):
    layout_of(tree, batch_dims=1)
  layout = layout_of({"x": jnp.zeros((5, 3)), "mask": jnp.zeros((5,), bool)}, batch_dims=1)
  with pytest.raises(ValueError, match="same leading"):
    pack(tree, layout)
  with pytest.raises(ValueError, match=r"leaf \['s'\] is a scalar"):
    layout_of({"s": jnp.zeros(())}, batch_dims=1)
  with pytest.raises(ValueError, match="batch_dims must be 0 or 1"):
    layout_of(tree, batch_dims=2)


def test_rejects_trees_that_do_not_match_the_layout():
  layout = layout_of({"x": jnp.zeros((2, 3))})
  with pytest.raises(ValueError, match="structure"):
    pack({"y": jnp.zeros((2, 3))}, layout)
  with pytest.raises(ValueError, match=r"\['x'\] has shape \(3, 2\).*expects \(2, 3\) float32"):
    pack({"x": jnp.zeros((3, 2))}, layout)
  with pytest.raises(ValueError, match="dtype int32"):
    pack({"x": jnp.zeros((2, 3), jnp.int32)}, layout)
  with pytest.raises(ValueError, match="needs 6 float32 elements but sizes gives 5"):
    pack({"x": jnp.zeros((2, 3))}, layout, {"float32": 5})
  with pytest.raises(ValueError, match="sizes gives none"):
    pack({"x": jnp.zeros((2, 3))}, layout, {"int32": 8})
  with pytest.raises(ValueError, match="no batch size"):
    pack({}, layout_of({}, batch_dims=1), {"float32": 2})


def test_unpack_rejects_bad_buffers():
  layout = layout_of({"x": jnp.zeros((2, 3)), "i": jnp.zeros(2, jnp.int32)})
  good = pack({"x": jnp.zeros((2, 3)), "i": jnp.zeros(2, jnp.int32)}, layout)
  with pytest.raises(ValueError, match="fewer than the 6 the layout needs"):
    unpack({**good, "float32": jnp.zeros(5)}, layout)
  with pytest.raises(ValueError, match=r"needs buffer 'int32'; the buffers have \['float32'\]"):
    unpack({"float32": good["float32"]}, layout)
  with pytest.raises(TypeError, match="has dtype float16"):
    unpack({**good, "float32": jnp.zeros(6, jnp.float16)}, layout)
  with pytest.raises(ValueError, match="rank 1"):
    unpack({**good, "float32": jnp.zeros((1, 6))}, layout)


def test_module_doctests_pass():
  result = doctest.testmod(packing)
  assert result.attempted > 0 and result.failed == 0
