"""The backward plan: how each backward action of a step runs, resolved once from the settings.

A step's backward depends on five settings at once: the remat policy, its granularity, the
schedule (forward, fused, or fused with a split backward ``BI``/``W``), ``weight_recompute``, and
whether layers keep running statistics. :func:`resolve` turns them into one frozen
:class:`BackwardPlan` before anything is traced; the engine picks the table it runs from it and
each branch of the fused tick loop (:mod:`tpipe.core.loops.branches`) is chosen by it, so no other
module decides these again.

>>> import tpipe
>>> plan = resolve(tpipe.PipelineSpec(num_stages=2, num_microbatches=4, schedule="1f1b"))
>>> plan.input_grads, plan.weight_grads
('units', 'with input grads')
>>> plan.describe().startswith("backward: each chunk's forward recomputed, its units run")
True
"""

from __future__ import annotations

import dataclasses

from tpipe import spec as spec_lib

# How a backward action forms its input gradients.
AUTODIFF = "autodiff"  # A forward schedule differentiated through its tick loop.
UNITS = "units"  # The chunk's forward recomputed, then its units backwards one at a time.
VJP = "vjp"  # One jax.vjp of the whole chunk program (its forward recomputed in the tick).
KEPT_RESIDUALS = "kept residuals"  # F ran the VJP and kept its residuals; B applies them.

# Where the weight gradients come from.
WITH_INPUT_GRADS = "with input grads"  # B forms them together with the input gradients.
FILED_TAPS = "filed taps"  # BI files the weight operations' operands and output gradients.
RECOMPUTED_OPERANDS = "recomputed operands"  # BI files output gradients; W recomputes operands.
OPERANDS_FROM_F = "operands from F"  # F filed the operands beside its residuals.
RERUN_BACKWARD = "rerun backward"  # BI files the chunk's output gradient; W reruns the backward.

_INPUT_WORDS = {
    AUTODIFF: "autodiff through the forward tick loop",
    UNITS: "each chunk's forward recomputed, its units run backwards one at a time (gradients "
           "summed in place)",
    VJP: "each chunk's forward recomputed under one jax.vjp",
    KEPT_RESIDUALS: "F keeps each chunk's VJP residuals, B applies them (no forward again)",
}
_WEIGHT_WORDS = {
    WITH_INPUT_GRADS: "formed with the input gradients",
    FILED_TAPS: "W from the operands and output gradients BI filed",
    RECOMPUTED_OPERANDS: "W from the output gradients BI filed, operands recomputed",
    OPERANDS_FROM_F: "W from the output gradients BI filed and the operands F filed",
    RERUN_BACKWARD: "W runs the chunk's backward again from the output gradient BI filed",
}


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
  """How a step's backward actions run (see :func:`resolve`).

  Attributes:
    input_grads: how ``B`` (and ``BI``) form input gradients: ``"autodiff"`` (a forward
      schedule, differentiated through its tick loop), ``"units"``, ``"vjp"`` or
      ``"kept residuals"``.
    weight_grads: where the weight gradients come from: ``"with input grads"``, or in a split
      backward ``"filed taps"``, ``"recomputed operands"``, ``"operands from F"`` or
      ``"rerun backward"``.
    unit_residuals: with ``input_grads="units"``, whether the recomputed forward keeps every
      unit's VJP residuals (granularity ``"chunk"``) rather than each unit's input.
    fused_loss_table: whether a forward schedule's loss runs as one fused table (its forward
      ticks, then autodiff's backward ticks: :func:`tpipe.schedules.whole_step`).
  """

  input_grads: str
  weight_grads: str
  unit_residuals: bool = False
  fused_loss_table: bool = False

  @property
  def by_units(self) -> bool:
    """Whether backward actions run their chunk's units backwards one at a time."""
    return self.input_grads == UNITS

  @property
  def split(self) -> bool:
    """Whether the backward is split into ``BI`` and ``W``."""
    return self.weight_grads != WITH_INPUT_GRADS

  @property
  def keeps_residuals(self) -> bool:
    """Whether ``F`` keeps its VJP's residuals for the backward."""
    return self.input_grads == KEPT_RESIDUALS

  @property
  def w_recomputes(self) -> bool:
    """Whether ``W`` reads the micro-batch's inputs and stashed input again."""
    return self.weight_grads in (RECOMPUTED_OPERANDS, RERUN_BACKWARD)

  @property
  def bi_files_operands(self) -> bool:
    """Whether ``BI`` files the weight operations' operands beside their output gradients."""
    return self.weight_grads == FILED_TAPS

  def describe(self) -> str:
    """One line: how the input and the weight gradients are formed."""
    return (f"backward: {_INPUT_WORDS[self.input_grads]}; weight gradients "
            f"{_WEIGHT_WORDS[self.weight_grads]}")


def resolve(spec: spec_lib.PipelineSpec, *, split: bool | None = None,
            has_stats: bool = False, owner: str = "tpipe") -> BackwardPlan:
  """The backward plan of ``spec``'s loss.

  Args:
    spec: the pipeline's settings.
    split: whether the table run splits backwards into ``BI`` and ``W``; default: whether
      ``spec``'s own table does.
    has_stats: whether layers keep running statistics (BatchNorm).
    owner: the API the user called, for messages.

  Raises:
    ValueError: for a combination no table can run (running statistics under a fused schedule).
  """
  if has_stats and spec.is_fused:
    raise ValueError(
        f"{owner}: schedule={spec.schedule!r} does not support BatchNorm statistics "
        "('batch_stats'); use schedule='gpipe' or 'circular'.")
  full = spec.remat == "full"
  if not spec.is_fused:
    # Forward ticks then autodiff's backward ticks as one fused table, whose backward runs by
    # units, where that costs no more FLOPs than the setting asks: remat="full" recomputing a
    # whole chunk ("chunk", "nested"). "layer" and k keep every piece's input across ticks.
    fused = full and not has_stats and spec.remat_granularity in ("chunk", "nested")
    if not fused:
      return BackwardPlan(AUTODIFF, WITH_INPUT_GRADS)
    return BackwardPlan(UNITS, WITH_INPUT_GRADS,
                        unit_residuals=spec.remat_granularity == "chunk", fused_loss_table=True)
  if split is None:
    split = spec.schedule in spec_lib.SPLIT_BACKWARD
  recompute = spec.weight_recompute if split else False
  if spec.remat == "none" and not recompute:
    input_grads = KEPT_RESIDUALS
  elif full:
    input_grads = UNITS  # A fused B recomputes its chunk anyway, at every granularity.
  else:
    input_grads = VJP
  if not split:
    weight_grads = WITH_INPUT_GRADS
  elif recompute == "backward":
    weight_grads = RERUN_BACKWARD
  elif recompute:
    weight_grads = RECOMPUTED_OPERANDS
  elif input_grads == KEPT_RESIDUALS:
    weight_grads = OPERANDS_FROM_F
  else:
    weight_grads = FILED_TAPS
  return BackwardPlan(input_grads, weight_grads,
                      unit_residuals=input_grads == UNITS and spec.remat_granularity == "chunk")
