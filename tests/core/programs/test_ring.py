"""tpipe.core.programs.ring: what crosses a chunk boundary. One type at every boundary travels as
it is; boundaries of different types are packed per dtype into buffers padded to the largest, and
unpacked exactly. Plans are written by hand (:mod:`tests.helpers.stub_plans`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import stub_plans
from tpipe.core.programs import ring as ring_lib

rows = stub_plans.rows


def _three_layers(*inputs):
  """Three plain layers, one per chunk, on 3 stages; ``inputs`` every layer's input and the
  output."""
  return stub_plans.plan([None, None, None], (1, 1, 1), inputs, num_stages=3)


@pytest.mark.unit
def test_without_rows():
  tree = {"h": rows((5,)), "ids": rows((), jnp.int32)}
  assert ring_lib.without_rows(tree) == {"h": jax.ShapeDtypeStruct((5,), jnp.float32),
                                         "ids": jax.ShapeDtypeStruct((), jnp.int32)}


def test_zeros_with_rows():
  example = {"h": jax.ShapeDtypeStruct((5,), jnp.float32),
             "ids": jax.ShapeDtypeStruct((), jnp.int32)}
  zeros = ring_lib.zeros_with_rows(example, 3)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), zeros) == {
      "h": ((3, 5), jnp.float32), "ids": ((3,), jnp.int32)}
  assert not any(np.any(a) for a in jax.tree.leaves(zeros))


@pytest.mark.unit
def test_one_type_at_every_boundary_travels_unpacked():
  plan = _three_layers(rows((3,)), rows((4,)), rows((4,)), rows(()))
  ring = ring_lib.Ring.of(plan)
  assert not ring.packed and ring.layouts is None
  assert ring.example == jax.ShapeDtypeStruct((4,), jnp.float32)
  assert ring.matches(rows((4,), batch=7)) and not ring.matches(rows((3,)))
  assert not ring.matches(rows((4,), jnp.bfloat16))
  value = np.ones((2, 4))
  assert ring.pack(value, 0) is value and ring.unpack(value, 1) is value
  assert ring.layout(0) is None


@pytest.mark.unit
def test_a_single_chunk_has_an_empty_ring():
  plan = stub_plans.plan([None], (1,), [rows((3,)), rows(())], num_stages=1)
  ring = ring_lib.Ring.of(plan)
  assert not ring.packed and ring.example == {}


def test_boundaries_of_different_types_are_packed_to_the_largest():
  # Boundary 0: {"h": [5] float32, "ids": [] int32}; boundary 1: [4] float32.
  first = {"h": rows((5,)), "ids": rows((), jnp.int32)}
  plan = _three_layers(rows((3,)), first, rows((4,)), rows(()))
  ring = ring_lib.Ring.of(plan)
  assert ring.packed and len(ring.layouts) == 2
  assert ring.example == {"float32": jax.ShapeDtypeStruct((5,), jnp.float32),
                          "int32": jax.ShapeDtypeStruct((1,), jnp.int32)}
  assert [ring.layout(b).sizes() for b in range(2)] == [{"float32": 5, "int32": 1},
                                                        {"float32": 4}]
  assert not ring.matches(rows((4,)))  # A packed ring carries no value as it is.
  value = {"h": jnp.arange(10.0).reshape(2, 5), "ids": jnp.array([7, 8], jnp.int32)}
  packed = ring.pack(value, 0)
  np.testing.assert_array_equal(packed["float32"], value["h"])
  np.testing.assert_array_equal(packed["int32"], [[7], [8]])
  back = ring.unpack(packed, 0)
  np.testing.assert_array_equal(back["h"], value["h"])
  np.testing.assert_array_equal(back["ids"], value["ids"])
  # The smaller boundary is padded with zeros, in both dtypes, and comes back exactly.
  small = jnp.arange(1.0, 9.0).reshape(2, 4)
  packed = ring.pack(small, 1)
  assert {k: a.shape for k, a in packed.items()} == {"float32": (2, 5), "int32": (2, 1)}
  np.testing.assert_array_equal(packed["float32"][:, 4], [0, 0])
  np.testing.assert_array_equal(packed["int32"], [[0], [0]])
  np.testing.assert_array_equal(ring.unpack(packed, 1), small)
