"""Good by default: a fused schedule's table is laid out in compound ticks for per-action costs
derived from the layers' measured FLOPs (:mod:`tpipe.schedules.derived_costs`) with nothing typed;
``tick_costs`` overrides them and ``"plain"`` keeps one action per tick; the derived table runs
exactly."""

import jax
import pytest

import tpipe
from tests.helpers import linen_models as lm
from tpipe.schedules import derived_costs

MATMUL = {"forward": 2.0, "backward_input": 2.0, "backward_weight": 2.0}


@pytest.mark.unit
@pytest.mark.parametrize("remat,granularity,expected", [
    ("none", "nested", {"F": 1, "B": 2, "BI": 1, "W": 1}),
    ("full", "chunk", {"F": 1, "B": 3, "BI": 2, "W": 1}),
    ("full", "nested", {"F": 1, "B": 4, "BI": 3, "W": 1}),
    ("dots", "layer", {"F": 1, "B": 3, "BI": 2, "W": 1}),
])
def test_costs_count_the_forwards_each_backward_recomputes(remat, granularity, expected):
  assert dict(derived_costs.from_flops(MATMUL, remat, granularity)) == expected


@pytest.mark.unit
def test_weight_recompute_moves_work_into_w():
  plain = dict(derived_costs.from_flops(MATMUL, "full", "chunk"))
  forward = dict(derived_costs.from_flops(MATMUL, "full", "chunk", "forward"))
  backward = dict(derived_costs.from_flops(MATMUL, "full", "chunk", "backward"))
  assert forward["W"] == plain["W"] + 1 and forward["BI"] == plain["BI"]
  assert backward["W"] == plain["B"] and backward["BI"] == plain["BI"]


@pytest.mark.unit
def test_no_measured_flops_fall_back_to_a_matmul_and_costs_stay_positive():
  none = {"forward": 0.0, "backward_input": 0.0, "backward_weight": 0.0}
  assert dict(derived_costs.from_flops(none, "none")) == {"F": 1, "B": 2, "BI": 1, "W": 1}
  no_weights = {"forward": 1.0, "backward_input": 1.0, "backward_weight": 0.0}
  assert dict(derived_costs.from_flops(no_weights, "none"))["W"] > 0


def _pipeline(schedule, **settings):
  model = lm.loss_sequential("mlp", schedule, lm.emulated_mesh(4), 4, "full", **settings)
  _, x, targets, _ = lm.loss_model("mlp")
  return model.pipeline_for(x, targets=targets)


def test_a_fused_pipeline_derives_its_costs_and_lays_out_compound_ticks():
  pipeline = _pipeline("1f1b")
  costs = dict(pipeline.spec.tick_costs)
  assert pipeline.plan.tick_costs == pipeline.spec.tick_costs
  assert costs["F"] == 1 and costs["B"] > 2  # The backward recomputes the forward (remat full).
  assert pipeline.loss_table.is_compound
  assert "derived from measured per-unit FLOPs" in pipeline.describe()
  # The spec alone (no layers to measure) keeps the one-action table.
  assert not lm.loss_sequential("mlp", "1f1b", lm.emulated_mesh(4), 4).spec.table.is_compound


def test_given_costs_override_and_plain_keeps_one_action_per_tick():
  given = _pipeline("1f1b", tick_costs={"F": 1, "B": 3})
  assert given.spec.tick_costs == (("B", 3.0), ("F", 1.0)) and given.plan.tick_costs is None
  plain = _pipeline("1f1b", tick_costs="plain")
  assert plain.spec.tick_costs == "plain" and not plain.loss_table.is_compound
  assert "per-action costs" not in plain.describe()
  forward = _pipeline("gpipe")
  assert forward.spec.tick_costs is None and forward.plan.tick_costs is None


def test_the_derived_table_runs_exactly():
  mesh = lm.emulated_mesh(4)
  model = lm.loss_sequential("mlp", "zb_h1", mesh, 4, "full")
  lm.assert_loss_equals_sequential(model, "mlp", 4 * 2)
  jax.clear_caches()


def test_bad_tick_costs_name_the_fix():
  with pytest.raises(ValueError, match="costs has unknown action"):
    tpipe.PipelineSpec(num_stages=2, num_microbatches=2, schedule="1f1b", tick_costs={"X": 1})
  with pytest.raises(TypeError, match="costs must map action names"):
    tpipe.PipelineSpec(num_stages=2, num_microbatches=2, schedule="1f1b", tick_costs="fast")
