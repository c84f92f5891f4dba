"""Per-action costs of a fused schedule (F, B, BI, W on one chunk), derived from measured FLOPs.

A fused schedule lays its table out in compound ticks (:mod:`tpipe.schedules.compound`) for the
relative costs of its actions ``F``, ``B``, ``BI`` and ``W`` on one chunk. Nothing needs to be
typed for them: planning (:func:`tpipe.core.planning.plan.make_plan`) measures each distinct unit's
forward, input-gradient and weight-gradient FLOPs on one micro-batch
(:func:`tpipe.core.planning.unit_cost.action_flops`), sums them over the model and turns the sums
into
what each action computes in the fused executor (:mod:`tpipe.core.loops.fused`) under the spec's
remat (:func:`from_flops`). ``PipelineSpec.tick_costs`` overrides the result; ``"plain"`` asks for
one action per tick. This module is that rule and its text for ``describe()``; it is pure.

Example::

  >>> parts = {"forward": 2.0, "backward_input": 2.0, "backward_weight": 2.0}
  >>> dict(from_flops(parts, remat="full", granularity="chunk"))
  {'B': 3.0, 'BI': 2.0, 'F': 1.0, 'W': 1.0}
"""

from __future__ import annotations

from typing import Mapping

# Costs are kept to this many decimals of F (= 1): equal models give equal keys, so the table
# factory's cache holds one compound table for them, and noise in a count flips no layout.
DECIMALS = 2
# What a model with no measurable FLOPs (a test's identity layers) gets: a matmul's split.
MATMUL_PARTS = {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0}


def recomputed_forwards(remat, granularity) -> int:
  """How many times a fused backward runs the chunk's forward again before its VJP: none with
  ``remat="none"`` (``F`` keeps residuals), once for the chunk under any other remat, and once
  more under ``remat="full"`` finer than the chunk (each unit again under ``jax.vjp`` when its
  backward runs one unit at a time, :mod:`tpipe.core.programs.unit_backward`)."""
  if remat == "none":
    return 0
  return 2 if remat == "full" and granularity != "chunk" else 1


def from_flops(parts: Mapping[str, float], remat="full", granularity="nested",
               weight_recompute=False) -> tuple[tuple[str, float], ...]:
  """Relative per-action costs (``F`` = 1) from a model's summed FLOPs.

  Args:
    parts: ``{"forward", "backward_input", "backward_weight"}`` FLOPs, summed over the units
      (:func:`tpipe.core.planning.unit_cost.action_flops`); no forward FLOPs: :data:`MATMUL_PARTS`.
    remat: the spec's remat (a name or a policy).
    granularity: the spec's remat granularity.
    weight_recompute: the spec's (False, ``"forward"`` or ``"backward"``).

  Returns:
    A sorted tuple of ``(action, cost)`` pairs for all four actions, as
    :func:`tpipe.schedules.check_costs` holds them: ``F`` the forward; ``B`` the recomputed
    forwards and the whole backward; ``BI`` the recomputed forwards and the input gradients;
    ``W`` the weight gradients (and what ``weight_recompute`` has it compute again).
  """
  if not parts.get("forward", 0.0) > 0:
    parts = MATMUL_PARTS
  forward = float(parts["forward"])
  inputs = float(parts["backward_input"]) / forward
  weights = float(parts["backward_weight"]) / forward
  again = recomputed_forwards(remat, granularity)
  costs = {"F": 1.0, "B": again + inputs + weights, "BI": again + inputs, "W": weights}
  if weight_recompute == "forward":
    costs["W"] += 1.0  # The chunk's forward again for the weight operations' inputs.
  elif weight_recompute == "backward":
    costs["W"] = again + inputs + weights  # The chunk's forward and backward again.
  # Costs must be > 0 (a layer with no weights still has a W action to schedule).
  floor = 10.0 ** -DECIMALS
  return tuple(sorted((name, max(round(value, DECIMALS), floor))
                      for name, value in costs.items()))


def describe(costs, derived: bool) -> str:
  """One line for ``describe()`` and the report: the costs a table was laid out for."""
  if costs is None or costs == "plain":
    return "ticks: one action per tick (tick_costs='plain')"
  text = ", ".join(f"{name} = {value:g}" for name, value in costs)
  source = "derived from measured per-unit FLOPs" if derived else "given (tick_costs)"
  return f"compound ticks for per-action costs {text} ({source})"
