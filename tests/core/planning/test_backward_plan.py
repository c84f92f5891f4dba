"""The backward plan: one resolved value says how each backward action runs, and every plan
gives the sequential model's loss and gradients.

:func:`tpipe.core.planning.backward_plan.resolve` is the one place the settings (remat, granularity,
schedule, weight_recompute, running statistics) are turned into how ``B``/``BI``/``W`` form
gradients; each plan it can return is run here on a small model against the layers in order
(numerics rule: :mod:`tests.helpers.numerics`).
"""

import pytest

import tpipe
from tests.helpers import linen_models as lm
from tpipe.core.planning import backward_plan

# The plan's values, unqualified in the table below.
UNITS, VJP, KEPT_RESIDUALS, AUTODIFF = (backward_plan.UNITS, backward_plan.VJP,
                                        backward_plan.KEPT_RESIDUALS, backward_plan.AUTODIFF)
WITH_INPUT_GRADS, FILED_TAPS, OPERANDS_FROM_F = (
    backward_plan.WITH_INPUT_GRADS, backward_plan.FILED_TAPS, backward_plan.OPERANDS_FROM_F)
RECOMPUTED_OPERANDS, RERUN_BACKWARD = (backward_plan.RECOMPUTED_OPERANDS,
                                       backward_plan.RERUN_BACKWARD)


def _spec(schedule="1f1b", remat="full", granularity="chunk", **settings):
  repeats = 2 if schedule in lm.TWO_CHUNKS else 1
  return tpipe.PipelineSpec(num_stages=2, num_microbatches=4, schedule=schedule,
                            num_repeats=repeats, remat=remat, remat_granularity=granularity,
                            **settings)


# (settings, input_grads, weight_grads, unit_residuals, fused_loss_table): every plan resolve
# returns.
PLANS = [
    (dict(schedule="gpipe", granularity="layer"), AUTODIFF, WITH_INPUT_GRADS, False, False),
    (dict(schedule="gpipe", remat="none"), AUTODIFF, WITH_INPUT_GRADS, False, False),
    (dict(schedule="gpipe", granularity="nested"), UNITS, WITH_INPUT_GRADS, False, True),
    (dict(schedule="circular", granularity="chunk"), UNITS, WITH_INPUT_GRADS, True, True),
    (dict(schedule="1f1b", granularity="layer"), UNITS, WITH_INPUT_GRADS, False, False),
    (dict(schedule="1f1b", granularity="chunk"), UNITS, WITH_INPUT_GRADS, True, False),
    (dict(schedule="1f1b", remat="dots"), VJP, WITH_INPUT_GRADS, False, False),
    (dict(schedule="1f1b", remat="none"), KEPT_RESIDUALS, WITH_INPUT_GRADS, False, False),
    (dict(schedule="zb_h1"), UNITS, FILED_TAPS, True, False),
    (dict(schedule="zb_h1", remat="dots"), VJP, FILED_TAPS, False, False),
    (dict(schedule="zb_h1", remat="none"), KEPT_RESIDUALS, OPERANDS_FROM_F, False, False),
    (dict(schedule="zbv", weight_recompute="forward"), UNITS, RECOMPUTED_OPERANDS, True, False),
    (dict(schedule="zb_h1", weight_recompute="backward"), UNITS, RERUN_BACKWARD, True, False),
    (dict(schedule="zb_h1", remat="dots", weight_recompute="backward"), VJP, RERUN_BACKWARD,
     False, False),
    (dict(schedule="zb_h1", remat="none", weight_recompute="forward"), VJP,
     RECOMPUTED_OPERANDS, False, False),
]


@pytest.mark.unit
@pytest.mark.parametrize("settings, input_grads, weight_grads, unit_residuals, fused_table",
                         PLANS)
def test_resolve_says_how_each_backward_runs(settings, input_grads, weight_grads,
                                             unit_residuals, fused_table):
  plan = backward_plan.resolve(_spec(**settings))
  assert (plan.input_grads, plan.weight_grads, plan.unit_residuals, plan.fused_loss_table) == (
      input_grads, weight_grads, unit_residuals, fused_table)
  assert plan.split == (weight_grads != backward_plan.WITH_INPUT_GRADS)
  assert plan.describe().startswith("backward: ")


@pytest.mark.unit
def test_running_statistics_change_the_plan_or_are_rejected():
  # A forward schedule with BatchNorm statistics differentiates through its tick loop.
  plan = backward_plan.resolve(_spec("gpipe", granularity="nested"), has_stats=True)
  assert plan.input_grads == AUTODIFF
  with pytest.raises(ValueError, match=r"model: schedule='1f1b' does not support BatchNorm"):
    backward_plan.resolve(_spec("1f1b"), has_stats=True, owner="model")


@pytest.mark.unit
def test_a_table_without_a_split_backward_forms_weight_gradients_with_the_input_gradients():
  spec = _spec("zb_h1")
  assert backward_plan.resolve(spec, split=False).weight_grads == backward_plan.WITH_INPUT_GRADS
  assert backward_plan.resolve(spec).weight_grads == backward_plan.FILED_TAPS


# Each plan once (the first settings that resolve to it): the settings of one plan run the same
# backward (GPipe under remat "none" as under "layer": autodiff through the tick loop).
DISTINCT_PLANS = [p for i, p in enumerate(PLANS) if p[1:] not in [q[1:] for q in PLANS[:i]]]


@pytest.mark.parametrize("settings", [p[0] for p in DISTINCT_PLANS],
                         ids=[f"{p[1]}-{p[2]}" for p in DISTINCT_PLANS])
def test_every_plan_gives_the_sequential_loss_and_gradients(settings):
  settings = dict(settings)
  schedule = settings.pop("schedule")
  granularity = settings.pop("granularity", "chunk")
  mesh = lm.emulated_mesh(2)
  model = lm.loss_sequential("blocks", schedule, mesh, 4, remat_granularity=granularity,
                             **settings)
  lm.assert_loss_equals_sequential(model, "blocks", 4 * dict(mesh.shape)["data"])
