"""tpipe.core.loops.buffers: what a device carries from tick to tick of a fused table.

The slot buffers are sized by the table's peaks (never by M), every buffer varies over every
manual axis (a scan carry inside ``shard_map`` must), and ``receive`` files each message at the
slot the table routes it to, or nowhere.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import tpipe
from tpipe import schedules
from tpipe.core.base import spmd
from tpipe.core.loops import buffers


def _allocated(schedule, *, delayed=False, weight_sizes=None, residual_sizes=None):
  """The buffers :func:`buffers.allocate` gives inside ``shard_map`` on stage 2 x data 4, as
  ``(shapes, varying axes)`` trees."""
  mesh = tpipe.make_mesh(stages=2, data=4)
  axes = spmd.Axes.of(mesh, "stage", "data")
  message = jnp.zeros((3, 5), jnp.float32)
  seen = {}

  def per_device(_):
    b = buffers.allocate(schedule, axes, {"loss": jnp.zeros(())}, message,
                         weight_sizes or {}, residual_sizes or {}, delayed=delayed)
    seen["shapes"] = jax.tree.map(lambda a: a.shape, b)
    seen["varying"] = jax.tree.leaves(jax.tree.map(spmd.varying_axes, b))
    return jnp.zeros(())

  jax.eval_shape(axes.shard_map(per_device, (P(),), P()), jnp.zeros(()))
  return seen["shapes"], seen["varying"], axes


@pytest.mark.parametrize("name,microbatches", [("1f1b", 4), ("1f1b", 16), ("zb_h1", 8)])
def test_slots_are_the_tables_peaks_and_vary_over_every_manual_axis(name, microbatches):
  schedule = schedules.build(name, 2, microbatches)
  shapes, varying, axes = _allocated(schedule, weight_sizes={"float32": 7})
  stash = int(schedule.stash_slots().max())
  assert shapes.stash == (stash, 3, 5)
  assert shapes.mailbox == (int(schedule.mailbox_slots().max()), 3, 5)
  assert shapes.weights["float32"] == (max(1, int(schedule.awaiting_weight().max())), 7)
  assert shapes.arrived == ((3, 5),) * 3
  assert shapes.pending is None and shapes.conveyor is None
  assert stash <= 2  # 1F1B and ZB-H1 hold at most S micro-batches per stage, whatever M.
  assert all(v == frozenset(axes.manual) for v in varying)


def test_delayed_links_carry_what_went_each_way():
  shapes, _, _ = _allocated(schedules.build("1f1b", 2, 4), delayed=True)
  assert shapes.pending == ((3, 5),) * 2


def test_receive_files_each_message_at_its_slot_or_nowhere():
  arrived = (jnp.full(2, 1.0), jnp.full(2, 2.0), jnp.full(2, 3.0))
  b = buffers.Buffers(state={}, stash=(), residuals=(), weights=(),
                      mailbox=jnp.zeros((3, 2)), arrived=arrived)
  np.testing.assert_array_equal(b.receive(jnp.array([2, 0, -1])).mailbox,
                                [[2, 2], [0, 0], [1, 1]])
  np.testing.assert_array_equal(b.receive(jnp.array([-1, -1, -1])).mailbox, np.zeros((3, 2)))
  assert b.slots.keys() == {"weights", "residuals"}


def test_buffers_are_one_pytree_a_scan_carries():
  b = buffers.Buffers(state={"loss": jnp.zeros(())}, stash=jnp.zeros((2, 3)), residuals={},
                      weights={}, mailbox=jnp.zeros((2, 3)), arrived=(jnp.ones(3),) * 3)

  def tick(carry, _):
    carry = carry.receive(jnp.array([0, -1, 1]))
    return jax.tree.map(lambda a: a, carry), None

  end, _ = jax.lax.scan(tick, b, None, length=2)
  assert isinstance(end, buffers.Buffers)
  np.testing.assert_array_equal(end.mailbox, np.ones((2, 3)))
