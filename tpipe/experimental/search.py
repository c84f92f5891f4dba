"""The exact window search in a pipeline: a spec whose table the search re-placed.

Experimental (research): the stable :class:`tpipe.PipelineSpec` has no setting for the search;
:func:`with_search` returns a variant of a spec, a :class:`SearchedSpec`, whose table is the
compound table :func:`tpipe.schedules.build` lays out, re-placed by ``sweeps`` sweeps of
:func:`tpipe.experimental.refine.refine` (seconds to minutes). Every front end and the engine
take it where they take a spec, and read the searched table from it as they read any spec's
``table``; ``spec.replace(...)`` keeps the variant.

Example::

  >>> import tpipe
  >>> from tpipe.experimental import search
  >>> costs = {"F": 1.0, "BI": 1.3, "W": 1.0}
  >>> spec = tpipe.PipelineSpec(num_stages=3, num_microbatches=3, schedule="zb_h1",
  ...                           tick_costs=costs)
  >>> searched = search.with_search(spec, sweeps=1)
  >>> searched.table.simulate(costs).neighbour < spec.table.simulate(costs).neighbour
  True
  >>> searched.replace(num_microbatches=4).tick_search
  1
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from tpipe import schedules
from tpipe import spec as spec_lib
from tpipe.experimental import refine as refine_lib


@dataclasses.dataclass(frozen=True)
class SearchedSpec(spec_lib.PipelineSpec):
  """A :class:`tpipe.PipelineSpec` whose table the exact window search re-placed.

  Attributes:
    tick_search: sweeps of exact window search over the compound table (0: none, the table
      :func:`tpipe.schedules.build` lays out). Needs ``tick_costs`` (the search minimises the
      neighbour-synchronised step under them).
  """

  tick_search: int = 0

  def __post_init__(self):
    object.__setattr__(self, "tick_search", check_sweeps(self.tick_search, self.tick_costs))
    super().__post_init__()  # Validates the rest and builds the table.

  @property
  def table(self) -> schedules.FusedSchedule:
    """The compound table re-placed by ``tick_search`` sweeps (cached), or with 0 sweeps the
    spec's own."""
    if not self.tick_search:
      return super().table
    return searched_table(self.schedule, self.num_stages, self.num_microbatches,
                          self.num_repeats, self.delays, self.given_tick_costs, self.tick_search)


def with_search(spec: spec_lib.PipelineSpec, sweeps: int) -> SearchedSpec:
  """``spec`` with its table re-placed by ``sweeps`` sweeps of exact window search.

  Raises:
    TypeError: ``spec`` is not a :class:`tpipe.PipelineSpec`, or ``sweeps`` not an int.
    ValueError: ``sweeps`` < 0, or > 0 without ``tick_costs`` on the spec.
  """
  if not isinstance(spec, spec_lib.PipelineSpec):
    raise TypeError(f"spec must be a tpipe.PipelineSpec, got {type(spec).__name__}.")
  settings = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec_lib.PipelineSpec)}
  return SearchedSpec(**settings, tick_search=sweeps)


def check_sweeps(sweeps, costs) -> int:
  """``sweeps`` as an int >= 0; ``costs`` are the spec's ``tick_costs``.

  Raises:
    TypeError: not an int.
    ValueError: negative, or > 0 without costs (None or ``"plain"``).
  """
  if isinstance(sweeps, bool) or not isinstance(sweeps, (int, np.integer)):
    raise TypeError(f"tick_search must be an int >= 0, sweeps of exact window search; got "
                    f"{sweeps!r}.")
  if sweeps < 0:
    raise ValueError(f"tick_search must be >= 0 sweeps, got {sweeps}.")
  if sweeps and (costs is None or isinstance(costs, str)):
    raise ValueError(f"tick_search={sweeps} re-places a compound table's actions for a shorter "
                     "step under its per-action costs; pass costs (tick_costs) too, or "
                     "tick_search=0.")
  return int(sweeps)


@functools.lru_cache(maxsize=None)
def searched_table(name: str, num_stages: int, num_microbatches: int, num_repeats: int,
                   delays: tuple[int, ...], costs: tuple[tuple[str, float], ...],
                   sweeps: int) -> schedules.FusedSchedule:
  """The table :func:`tpipe.schedules.build` lays out for these arguments, re-placed by
  ``sweeps`` sweeps of :func:`tpipe.experimental.refine.refine`; cached (the search takes
  seconds to minutes, and gives the same table on every host)."""
  table = schedules.build(name, num_stages, num_microbatches, num_repeats, delays, costs)
  return refine_lib.refine(table, dict(costs), sweeps=sweeps)
