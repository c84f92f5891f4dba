"""tpipe.core.layout.staging: whole logical trees to the staged tree and back, bit for bit (every
case of :mod:`tests.helpers.layout_cases`, with and without fsdp blocks, and on a mesh of 4 CPU
devices), where the stacked leaves come from (a reshape for an even split), and the error for
variables that lack a layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import tpipe
from tests.helpers import layout_cases as lc
from tpipe.core.layout import description as desc
from tpipe.core.layout import pack as layout_pack
from tpipe.core.layout import staging


@pytest.mark.unit
def test_is_uniform_only_for_an_even_loop_split():
  assert staging.is_uniform(lc.case("even_repeat")[0], 0)
  # Uneven copies, a circular split with 1 or 2 copies per chunk, or the "v" placement.
  assert not staging.is_uniform(lc.case("uneven_repeat")[0], 1)
  assert not staging.is_uniform(lc.case("circular_r2")[0], 1)
  assert not staging.is_uniform(lc.case("even_repeat_v")[0], 0)


@pytest.mark.parametrize("packing", lc.PACKINGS)
@pytest.mark.parametrize("fsdp", lc.FSDP)
@pytest.mark.parametrize("name", list(lc.CASES))
def test_round_trip_is_exact(name, fsdp, packing):
  layout, shapes = lc.case(name, fsdp=fsdp, packing=packing)
  logical = lc.values(shapes)
  staged = staging.to_staged(layout, lc.drop_empty(logical))  # Flax omits empty layers.
  assert jax.tree.map(lambda a: (a.shape, a.dtype), staged) == jax.tree.map(
      lambda a: (a.shape, a.dtype), layout.staged_shapes())
  lc.assert_equal(staging.to_logical(layout, staged), logical)
  # Every logical element is somewhere in the staged tree, once (the rest is zero padding).
  staged_values = np.concatenate([np.asarray(a, np.int64).ravel()
                                  for a in jax.tree.leaves(staged)])
  logical_values = np.concatenate([np.asarray(a, np.int64).ravel()
                                   for a in jax.tree.leaves(logical)])
  assert sorted(staged_values[staged_values != 0].tolist()) == sorted(logical_values.tolist())


def _random(shapes, seed):
  """Random normal floats (every bit pattern matters) and random integers."""
  rng = np.random.default_rng(seed)

  def draw(a):
    if jnp.issubdtype(a.dtype, jnp.integer):
      return jnp.asarray(rng.integers(-100, 100, a.shape), a.dtype)
    return jnp.asarray(rng.normal(size=a.shape), a.dtype)

  return jax.tree.map(draw, shapes)


@pytest.mark.parametrize("name", ["uneven_repeat", "shared_zbv"])
def test_round_trip_on_a_mesh_is_bit_exact(name):
  mesh = tpipe.make_mesh(stages=2, fsdp=2)
  layout, shapes = lc.case(name, fsdp=2)
  logical = _random(shapes, seed=0)
  specs = layout.partition_specs("stage", mesh=mesh)
  shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
  staged = jax.jit(lambda t: staging.to_staged(layout, t), out_shardings=shardings)(logical)
  for leaf, sharding in zip(jax.tree.leaves(staged), jax.tree.leaves(shardings)):
    assert leaf.sharding == sharding
  back = jax.jit(lambda t: staging.to_logical(layout, t))(staged)
  for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(logical)):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                  np.asarray(want).view(np.uint32))


@pytest.mark.parametrize("name", ["even_repeat", "circular_r2"])
def test_an_even_repeat_is_staged_by_a_reshape(name):
  layout, shapes = lc.case(name)
  logical = lc.values(shapes)
  staged = staging.to_staged(layout, logical)
  index = 0 if name == "even_repeat" else 1
  k = layout.stacked[index]
  if name == "even_repeat":
    want = jax.tree.map(lambda a: a.reshape((2, 2, k) + a.shape[1:]), logical["layers_0"])
    lc.assert_equal(staged[desc.STACKED]["layers_0"], want)
  else:
    # Copies per chunk 1, 2, 2, 1: the first copy of each chunk is stacked, in chunk order.
    firsts = [0, 1, 3, 5]
    want = jax.tree.map(lambda a: a[np.array(firsts)].reshape((2, 2, 1) + a.shape[1:]),
                        logical["layers_1"])
    lc.assert_equal(staged[desc.STACKED]["layers_1"], want)


def test_zbv_puts_chunk_3_on_stage_0():
  layout, shapes = lc.case("zbv")
  logical = lc.values(shapes)
  staged = staging.to_staged(layout, logical)
  kernel = staged[desc.STACKED]["layers_1"]["Dense_0"]["kernel"]
  block = logical["layers_1"]["Dense_0"]["kernel"]
  # Chunks hold copies 0 | 1, 2 | 3, 4 | 5: the first copy of each is stacked.
  np.testing.assert_array_equal(kernel[0, 0, 0], block[0])  # chunk 0: stage 0, local chunk 0
  np.testing.assert_array_equal(kernel[0, 1, 0], block[1])  # chunk 1: stage 1, local chunk 0
  np.testing.assert_array_equal(kernel[1, 1, 0], block[3])  # chunk 2: stage 1, local chunk 1
  np.testing.assert_array_equal(kernel[1, 0, 0], block[5])  # chunk 3: stage 0, local chunk 1
  # The head is in chunk 3's packed slot: stage 0, local chunk 1.
  head = layout_pack.chunk_trees(layout, layout.chunk_local(staged, 3), 3)[-1]
  lc.assert_equal(head, logical["layers_2"])


def test_missing_variables_of_a_layer_that_has_some_are_an_error():
  layout, shapes = lc.case("uneven_repeat")
  logical = lc.values(shapes)
  del logical["layers_2"]
  with pytest.raises(ValueError, match=r"the variables hold no 'layers_2', which has "
                                       r"\{'bias': \(2,\), 'kernel': \(4, 2\)\}"):
    staging.to_staged(layout, logical)


def test_to_logical_checks_the_staged_shapes():
  layout, shapes = lc.case("uneven_repeat")
  other, _ = lc.case("repeat_missing_from_a_chunk")
  staged = staging.to_staged(other, lc.values(shapes))
  with pytest.raises(ValueError, match=r"staged variables have shapes .* convert them with "
                                       r"tpipe\.staging\.to_logical\(that model's layout"):
    staging.to_logical(layout, staged)
