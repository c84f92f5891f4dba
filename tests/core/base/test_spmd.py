"""tpipe.core.base.spmd: slot buffers, micro-batches, neighbour pairs and the manual axes of a
mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import tpipe
from tpipe.core.base import spmd


def test_read_write_and_add_to_slot():
  buffer = {"a": jnp.arange(12.0).reshape(3, 4), "b": jnp.zeros((3,), jnp.int32)}
  np.testing.assert_array_equal(spmd.read_slot(buffer, 1)["a"], [4, 5, 6, 7])
  written = spmd.write_slot(buffer, 2, {"a": jnp.ones(4), "b": jnp.int32(7)})
  np.testing.assert_array_equal(written["a"][2], [1, 1, 1, 1])
  np.testing.assert_array_equal(written["a"][:2], buffer["a"][:2])
  np.testing.assert_array_equal(written["b"], [0, 0, 7])
  # A bfloat16 value written into a float32 buffer keeps the buffer's dtype.
  cast = spmd.write_slot(buffer, 0, {"a": jnp.ones(4, jnp.bfloat16), "b": jnp.int32(1)})
  assert cast["a"].dtype == jnp.float32
  added = spmd.add_to_slot(buffer, 0, {"a": jnp.full(4, 10.0), "b": jnp.int32(2)})
  np.testing.assert_array_equal(added["a"][0], [10, 11, 12, 13])
  np.testing.assert_array_equal(added["b"], [2, 0, 0])


def test_write_slot_under_a_traced_predicate():
  buffer = jnp.zeros((2, 3))
  write = jax.jit(lambda pred: spmd.write_slot(buffer, 1, jnp.ones(3), pred))
  np.testing.assert_array_equal(write(True), [[0, 0, 0], [1, 1, 1]])
  np.testing.assert_array_equal(write(False), buffer)


def test_split_and_join_microbatches():
  x = {"x": jnp.arange(12).reshape(6, 2), "y": jnp.arange(6)}
  split = spmd.split_microbatches(x, 3)
  assert split["x"].shape == (3, 2, 2) and split["y"].shape == (3, 2)
  np.testing.assert_array_equal(split["y"], [[0, 1], [2, 3], [4, 5]])  # Contiguous rows.
  joined = spmd.join_microbatches(split)
  np.testing.assert_array_equal(joined["x"], x["x"])


def test_stacked_zeros_and_select():
  zeros = spmd.stacked_zeros({"a": jax.ShapeDtypeStruct((2,), jnp.bfloat16)}, 3)
  assert zeros["a"].shape == (3, 2) and zeros["a"].dtype == jnp.bfloat16
  assert not np.any(zeros["a"])
  picked = spmd.select(jnp.bool_(False), {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})
  np.testing.assert_array_equal(picked["a"], [0, 0])


@pytest.mark.unit
@pytest.mark.parametrize("stages,direction,wrap,pairs", [
    (4, 1, False, [(0, 1), (1, 2), (2, 3)]),
    (4, 1, True, [(0, 1), (1, 2), (2, 3), (3, 0)]),
    (4, -1, False, [(1, 0), (2, 1), (3, 2)]),
    (4, -1, True, [(0, 3), (1, 0), (2, 1), (3, 2)]),
    (1, 1, False, []),
])
def test_neighbour_pairs(stages, direction, wrap, pairs):
  assert spmd.neighbour_pairs(stages, direction, wrap) == pairs


@pytest.mark.unit
def test_split_by_delay_sends_over_delayed_links_late():
  pairs = spmd.neighbour_pairs(4, 1, True)
  # Link s joins stages s and s + 1; link 1 (stages 1 -> 2) and link 3 (3 -> 0) delayed.
  now, late = spmd.split_by_delay(pairs, (0, 1, 0, 1), 1, 4)
  assert now == [(0, 1), (2, 3)] and late == [(1, 2), (3, 0)]


def test_axes_of_a_mesh():
  mesh = tpipe.make_mesh(stages=2, data=2, fsdp=2)
  axes = spmd.Axes.of(mesh, "stage", "data")
  assert (axes.stage, axes.data, axes.fsdp) == ("stage", "data", "fsdp")
  assert axes.rows == ("data", "fsdp") and axes.manual == ("data", "fsdp", "stage")
  assert axes.auto == () and axes.row_shards == 4 and axes.num_stages == 2
  assert axes.staged_spec == P(None, "stage")
  # 16 rows split over 4 row shards and 2 stages; 12 rows cannot split over the stages too.
  assert axes.splits_over_stages(16) and not axes.splits_over_stages(12)
  assert axes.io_spec(16) == P(("data", "fsdp", "stage"))
  assert axes.io_spec(12) == P(("data", "fsdp"))
  assert axes.manual_spec(P(None, ("fsdp", "tensor"), "stage", "tensor")) == P(
      None, "fsdp", "stage", None)


def test_axes_leave_size_one_axes_out_and_tensor_to_the_partitioner():
  mesh = tpipe.make_mesh(stages=2, tensor=2)
  axes = spmd.Axes.of(mesh, "stage", "data")
  assert axes.data is None and axes.fsdp is None  # Size 1: treated as absent.
  assert axes.rows == () and axes.manual == ("stage",) and axes.auto == ("tensor",)
  assert axes.row_shards == 1 and axes.io_spec(8) == P("stage")
  assert spmd.Axes.of(tpipe.make_mesh(stages=1), "stage", "data").io_spec(8) == P()


def test_axes_index_and_gather_inside_shard_map():
  mesh = tpipe.make_mesh(stages=2, data=2)
  axes = spmd.Axes.of(mesh, "stage", "data")

  def body(x):
    index = jnp.stack([axes.stage_index(), axes.data_index()])
    whole = axes.gather_stages(x)
    return index[None], whole.sum(keepdims=True)[None]

  run = axes.shard_map(body, in_specs=(P(("data", "stage")),),
                       out_specs=(P(("data", "stage")), P(("data", "stage"))))
  index, sums = run(jnp.arange(8.0))
  # Devices in (data, stage) order: each knows its stage and row shard.
  np.testing.assert_array_equal(index.reshape(4, 2), [[0, 0], [1, 0], [0, 1], [1, 1]])
  # A row shard's two stages each gather the shard's 4 rows: 0+1+2+3, then 4+5+6+7.
  np.testing.assert_array_equal(sums.reshape(4), [6, 6, 22, 22])


def _constraints(fn, *args):
  """The partition specs of the sharding constraints in ``fn``'s jaxpr, in order."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "sharding_constraint":
        found.append(eqn.params["sharding"].spec)
      for value in eqn.params.values():
        inner = getattr(value, "jaxpr", value)
        if hasattr(inner, "eqns"):
          walk(inner)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


@pytest.mark.unit
def test_rows_split_over_the_expert_devices_or_rows_and_positions_where_devices_outnumber_them():
  assert spmd.pieces_per_row((8, 3), 4) == 1  # Two rows per device.
  assert spmd.pieces_per_row((2, 8, 5), 4) == 2  # Half a row's positions per device.
  assert spmd.pieces_per_row((1, 8), 8) == 8
  assert spmd.pieces_per_row((2, 3), 4) is None  # 3 positions do not halve.
  assert spmd.pieces_per_row((3, 8), 4) is None  # 4 devices are not a multiple of 3 rows.
  assert spmd.pieces_per_row((6,), 4) is None and spmd.pieces_per_row((), 4) is None


def test_leaves_split_by_rows_over_an_expert_axis_alone_before_they_are_flattened():
  leaves = (jnp.ones((8, 3)), jnp.ones((2, 4)), jnp.ones((3, 8)), jnp.ones(()))

  def inside(mesh):
    axes = spmd.Axes.of(mesh, "stage", "data")
    run = axes.shard_map(lambda *a: jax.tree.map(lambda x: x[None], spmd.rows_over_expert_axis(a)),
                         in_specs=(P(),) * 4, out_specs=(P("stage"),) * 4)
    return _constraints(run, *leaves)

  # Rows that divide over the 4 expert devices split over them; the others stay whole, rows
  # fewer than the devices included (a packed buffer would hold a device's pieces apart).
  assert inside(tpipe.make_mesh(stages=2, expert=4)) == [P("expert"), P(), P(), P()]
  # Elsewhere nothing is pinned: no auto axis, tensor alone, or tensor beside expert.
  assert inside(tpipe.make_mesh(stages=2, data=4)) == []
  assert inside(tpipe.make_mesh(stages=2, tensor=4)) == []
  assert inside(tpipe.make_mesh(stages=2, expert=2, tensor=2)) == []
  assert spmd.rows_over_expert_axis(leaves) is leaves
