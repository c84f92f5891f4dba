"""Hand-given per-action costs and the compound layouts' research knobs.

Experimental (research). The stable path needs none of this: a fused schedule's table is laid
out in compound ticks for costs derived from measured FLOPs
(:mod:`tpipe.schedules.derived_costs`), and
``PipelineSpec.tick_costs`` takes a mapping to override them. Here:

* :func:`parse`: costs written by hand, ``"F=1,B=3,BI=2,W=1"`` (what ``config.tick_costs``
  takes), as the mapping the spec takes.
* :func:`layout`: one compound layout for explicit knobs (caps, weight backlog, orders, second
  forwards, the light ramp, weight holds; :func:`tpipe.schedules.compound.pack`), rather than
  the best of the builder's candidates, for experiments with the layouts themselves.
* :func:`settle`: a split-backward table's weight work moved into slack
  (:func:`tpipe.schedules.weight_settling.settle_weights`).

Example::

  >>> from tpipe.experimental import costs
  >>> costs.parse("F=1, B=3")
  {'F': 1.0, 'B': 3.0}
  >>> table = costs.layout("zb_h1", 4, 8, {"F": 1, "BI": 2, "W": 1}, weight_hold=0)
  >>> table.is_compound
  True
"""

from __future__ import annotations

from typing import Mapping

from tpipe.schedules import actions
from tpipe.schedules import compound
from tpipe.schedules import weight_settling


def parse(text: str) -> dict[str, float]:
  """``"F=1,B=3,BI=2,W=1"`` as ``{"F": 1.0, ...}``, checked
  (:func:`tpipe.schedules.actions.check_costs`).

  Raises:
    ValueError: a part that is not ``NAME=number``, an unknown action or a cost <= 0.
  """
  if not isinstance(text, str):
    raise TypeError(f"costs must be written as 'F=1,B=3,BI=2,W=1', got {text!r}.")
  parsed = {}
  for part in text.split(","):
    name, _, number = part.partition("=")
    try:
      parsed[name.strip()] = float(number)
    except ValueError:
      raise ValueError("write per-action costs as 'F=1,B=3,BI=2,W=1'.") from None
  return actions.check_costs(parsed)


def layout(name: str, num_stages: int, num_microbatches: int, costs: Mapping[str, float],
           num_repeats: int | None = None, delays=None, **knobs):
  """Fused schedule ``name`` packed in compound ticks for ``costs`` with explicit ``knobs``
  (the keywords of :func:`tpipe.schedules.compound.pack`: ``in_flight``, ``weight_backlog``,
  ``deeper_first``, ``backward_first``, ``second_forward``, ``light_ramp``,
  ``weight_hold``); ``num_repeats`` None: the schedule's own chunks per stage."""
  placement, _ = compound.SHAPES[name]
  chunks = num_repeats or (2 if placement == "v" else 1)
  return compound.pack(name, num_stages, num_microbatches, chunks, costs, delays=delays, **knobs)


def settle(table, costs: Mapping[str, float], weight_slots: int | None = None):
  """``table``'s ``W`` moved where they cost the step nothing
  (:func:`tpipe.schedules.weight_settling.settle_weights`)."""
  return weight_settling.settle_weights(table, costs, weight_slots)
