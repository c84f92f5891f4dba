"""tpipe.core.loops.branches: the function each action of a fused table runs is the one its backward
plan names (one small function per action and plan, no mode flags), which branches write the
running gradient sums, and the empty :class:`Slots` a call starts from.

Branches are made here, not run: which method made a branch is read from its closure's
``__qualname__`` (and that of the helper it closes over, for ``W``'s)."""

import dataclasses

import pytest

import tpipe
from tests.helpers import core_layers as cl
from tpipe import schedules
from tpipe.core.base import arguments
from tpipe.core.loops import branches as branches_lib
from tpipe.core.planning import backward_plan
from tpipe.core.programs import chunks as chunks_lib

A = schedules.Action
PROGRAMS = 2  # The tiny pipeline on 2 stages: one chunk program per chunk.


def _branches(schedule, remat="full", weight_recompute=False, granularity="nested"):
  spec = tpipe.PipelineSpec(num_stages=2, num_microbatches=2, schedule=schedule, balance=[3, 3],
                            per_example=("targets",), remat=remat,
                            remat_granularity=granularity, weight_recompute=weight_recompute)
  pipeline = cl.build(spec)
  _, targets = cl.inputs()
  split = arguments.split_keywords({"targets": targets}, per_example=("targets",),
                                   batch_size=cl.BATCH, owner="test")
  chunkset = chunks_lib.ChunkSet(pipeline.layers, pipeline.plan, pipeline.layout, None, spec,
                                 split)
  assert chunkset.num_branches == PROGRAMS
  return branches_lib.Branches(chunkset, backward_plan.resolve(spec))


def _number(action, program=1):
  return 1 + int(action) * PROGRAMS + program


def _made_by(fn) -> str:
  """The qualified names of ``fn`` and of the functions it closes over, joined."""
  cells = [cell.cell_contents for cell in fn.__closure__ or ()]
  return " ".join([fn.__qualname__] + [c.__qualname__ for c in cells if callable(c)
                                       and hasattr(c, "__qualname__")])


SLOTS = branches_lib.Slots(unit_programs=({}, {}))  # W's weight branch closes over programs.


def _maker(branches, action, collect=False):
  return _made_by(branches.branch(_number(action), None, SLOTS, collect))


# (schedule, remat, weight_recompute): the plan, and the method each action's branch comes from.
CASES = [
    ("1f1b", "full", False, backward_plan.UNITS, backward_plan.WITH_INPUT_GRADS,
     {A.F: "_forward.", A.B: "_backward_by_units"}),
    ("1f1b", "dots", False, backward_plan.VJP, backward_plan.WITH_INPUT_GRADS,
     {A.F: "_forward.", A.B: "_backward_by_vjp"}),
    ("1f1b", "none", False, backward_plan.KEPT_RESIDUALS, backward_plan.WITH_INPUT_GRADS,
     {A.F: "_forward_keeping_residuals", A.B: "_backward_by_vjp"}),
    ("zb_h1", "full", False, backward_plan.UNITS, backward_plan.FILED_TAPS,
     {A.F: "_forward.", A.BI: "_input_backward_filing_taps", A.W: "_weights_from_filed_taps"}),
    ("zb_h1", "full", True, backward_plan.UNITS, backward_plan.RECOMPUTED_OPERANDS,
     {A.BI: "_input_backward_filing_taps", A.W: "_weights_recomputing_operands"}),
    ("zb_h1", "none", False, backward_plan.KEPT_RESIDUALS, backward_plan.OPERANDS_FROM_F,
     {A.F: "_forward_keeping_residuals", A.BI: "_input_backward_filing_taps",
      A.W: "_weights_with_operands_from_f"}),
    ("zb_h1", "full", "backward", backward_plan.UNITS, backward_plan.RERUN_BACKWARD,
     {A.BI: "_input_backward_only", A.W: "_weights_rerun_by_units"}),
    ("zb_h1", "dots", "backward", backward_plan.VJP, backward_plan.RERUN_BACKWARD,
     {A.BI: "_input_backward_only", A.W: "_weights_rerun_by_vjp"}),
]


@pytest.mark.parametrize("schedule,remat,recompute,input_grads,weight_grads,makers", CASES)
def test_each_action_runs_the_function_its_plan_names(schedule, remat, recompute, input_grads,
                                                      weight_grads, makers):
  branches = _branches(schedule, remat, recompute)
  assert (branches.plan.input_grads, branches.plan.weight_grads) == (input_grads, weight_grads)
  for action, maker in makers.items():
    made = _maker(branches, action)
    assert f"Branches.{maker}" in made, (action, made)
  everything = " ".join(_maker(branches, a) for a in makers)
  others = {"_backward_by_units", "_backward_by_vjp", "_input_backward_only",
            "_weights_from_filed_taps", "_weights_recomputing_operands",
            "_weights_with_operands_from_f", "_weights_rerun_by_units", "_weights_rerun_by_vjp",
            "_input_backward_filing_taps", "_forward_keeping_residuals"}
  for other in others - {m.rstrip(".") for m in makers.values()}:
    assert other not in everything, other
  # Only a split plan traces the tapped programs; only a plan by units the unit backward.
  assert bool(branches.tapped) == (branches.plan.split and
                                   weight_grads != backward_plan.RERUN_BACKWARD)
  assert bool(branches.backward_into) == (input_grads == backward_plan.UNITS)


def test_a_forward_only_table_keeps_no_residuals():
  branches = _branches("1f1b", remat="none")
  assert "Branches._forward_keeping_residuals" in _maker(branches, A.F)
  assert "Branches._forward." in _maker(branches, A.F, collect=True)


def test_idle_is_branch_zero():
  made = _made_by(_branches("1f1b").branch(0, None, SLOTS, False))
  assert "Branches.branch.<locals>.<lambda>" in made


@pytest.mark.parametrize("schedule,remat,recompute", [
    ("1f1b", "full", False), ("1f1b", "none", False), ("zb_h1", "full", "backward"),
    ("zb_h1", "none", False)])
def test_only_idle_and_forwards_leave_the_gradient_sums_alone(schedule, remat, recompute):
  """Every backward writes the sums, by units or by one VJP (so each runs in a conditional of
  its own, tpipe.core.loops.tick_rows.lane_groups); idle and the forwards do not."""
  branches = _branches(schedule, remat, recompute)
  assert branches.numbers.is_forward_or_idle(0)
  runs = (A.F, A.BI, A.W) if branches.plan.split else (A.F, A.B)  # The actions its table has.
  for action in runs:
    for program in range(PROGRAMS):
      written = not branches.numbers.is_forward_or_idle(_number(action, program))
      assert written == (action != A.F), action


def test_slots_start_empty_and_are_values():
  slots = branches_lib.Slots()
  assert (slots.weight_layouts, slots.tap_shapes, slots.record_shapes, slots.unit_programs,
          slots.residual_plans, slots.residual_layouts) == ((),) * 6
  assert slots.weight_sizes == {} and slots.residual_sizes == {}
  assert slots.weight_sizes is not branches_lib.Slots().weight_sizes  # A dict of its own.
  with pytest.raises(dataclasses.FrozenInstanceError):
    slots.weight_sizes = {"float32": 1}
  changed = dataclasses.replace(slots, residual_sizes={"float32": 4})
  assert changed.residual_sizes == {"float32": 4} and slots.residual_sizes == {}
