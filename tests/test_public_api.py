"""The public surface, pinned: ``tpipe.__all__`` and ``tpipe.schedules.__all__`` name exactly
what a user builds or reads. A name added or removed here is a change of the API: say so in the
docs (docs/api) too."""

import pytest

import tpipe
from tpipe import schedules

pytestmark = pytest.mark.unit

TPIPE = [
    "AUX_LOSS",
    "AUX_METRIC",
    "DEFAULT_RULES",
    "PipelineSpec",
    "PlannedPipeline",
    "Repeat",
    "Sequential",
    "StageLayout",
    "TrainState",
    "TrainStep",
    "axis_rules",
    "counting_flops",
    "create_train_state",
    "data_sharding",
    "make_mesh",
    "make_train_step",
    "nnx",
    "pipeline",
    "schedules",
    "shardings",
    "staging",
    "topology_devices",
]

SCHEDULES = [
    "Action",
    "DEFAULT_COSTS",
    "FUSED_SCHEDULE_NAMES",
    "FusedSchedule",
    "IDLE",
    "NAMES",
    "SCHEDULE_NAMES",
    "Schedule",
    "Timing",
    "build",
    "is_fused",
    "placement",
    "whole_step",
]


@pytest.mark.parametrize("module,names", [(tpipe, TPIPE), (schedules, SCHEDULES)])
def test_all_is_the_pinned_sorted_list_and_every_name_resolves(module, names):
  assert sorted(module.__all__) == names
  assert list(module.__all__) == names  # Kept sorted, one name per line.
  for name in names:
    assert getattr(module, name) is not None


def test_the_top_level_returns_types_it_names():
  """What the public functions return is exported under one name each: the planned pipeline
  (``pipeline_for``), the stage layout (``stage_layout``) and the jitted step
  (``make_train_step``)."""
  from tpipe.core import engine  # pylint: disable=g-import-not-at-top
  from tpipe import training  # pylint: disable=g-import-not-at-top
  assert tpipe.PlannedPipeline is engine.PlannedPipeline
  assert tpipe.StageLayout is tpipe.staging.StageLayout
  assert tpipe.TrainStep is training.TrainStep
  # No two public names differ only in case (tpipe.pipeline, the front end, has no twin).
  assert len({n.lower() for n in tpipe.__all__}) == len(tpipe.__all__)
  assert not hasattr(tpipe, "Pipeline")
