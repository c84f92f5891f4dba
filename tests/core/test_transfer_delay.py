"""Delayed transfers: a value sent over a delayed link is read two ticks later, its transfer
overlapping a whole tick of compute; the pipeline still equals the layers in order.

Eight CPU devices emulate two slices of four (``tpipe.make_mesh(..., dcn={"stage": 2},
slices=...)``): stages 0-1 on one, 2-3 on the other, so links 1 (stage 1 to 2) and 3 (stage 3 back
to 0) cross slices and are delayed by default. Forward schedules (autodiff backward, and the
by-units backward of ``remat="full"``), the circular schedule's closing link, and fused schedules
(1F1B, ZB-V whose turn stays on a stage, ZB-H1 and interleaved 1F1B with every link delayed) give
the sequential model's loss and gradients (numerics rule: :mod:`tests.helpers.numerics`).
"""

import pytest

import tpipe
from tests.helpers import linen_models as lm


# (model, schedule, stages, micro-batches per replica, remat, transfer_delay): None is the
# default, the links that cross the two slices (with 2 stages, one per slice: both links). Each
# schedule once, a forward one with each backward (autodiff: circular under "dots"; by units:
# GPipe under "full").
CASES = [
    ("lm", "gpipe", 4, 4, "full", None),
    ("blocks", "circular", 4, 2, "dots", None),
    ("mlp", "1f1b", 4, 4, "full", None),
    ("lm", "zbv", 2, 3, "none", None),
    ("blocks", "zb_h1", 4, 4, "full", 1),
    ("mlp", "interleaved_1f1b", 2, 6, "dots", (0, 1)),
]


@pytest.mark.parametrize("name,schedule,stages,microbatches,remat,delay", CASES)
def test_delayed_transfers_equal_sequential(name, schedule, stages, microbatches, remat, delay):
  mesh = lm.emulated_mesh(stages, slices=2)
  model = lm.loss_sequential(name, schedule, mesh, microbatches, remat, transfer_delay=delay)
  crossing = (0, 1, 0, 1) if stages == 4 else (1, 1)
  expected = crossing if delay is None else tpipe.schedules.actions.link_delays(delay, stages)
  assert model.spec.delays == expected and model.spec.table.delays == expected
  lm.assert_loss_equals_sequential(model, name, microbatches * (8 // stages))
