"""tpipe.experimental: research tools, outside the stable API.

What lives here is research: it may change or go without notice, and nothing in the stable
layers (``tpipe.schedules``, ``tpipe.core``, the front ends) imports it; it imports them. What
reaches the engine from here comes as a value the stable layers already take: a spec whose
table the search re-placed (:func:`tpipe.experimental.search.with_search`).

* :mod:`~tpipe.experimental.refine`: exact window search for a shorter neighbour-synchronised
  step, a fused table's actions re-placed by a mixed-integer program (SciPy's HiGHS; seconds to
  minutes).
* :mod:`~tpipe.experimental.search`: the search in a pipeline: ``with_search(spec, sweeps)``,
  a :class:`tpipe.PipelineSpec` variant whose table is the searched one.
* :mod:`~tpipe.experimental.links`: link pricing models (ICI and DCN bandwidths and latencies
  of TPU chips) that price a compiled step's collectives.
* :mod:`~tpipe.experimental.costs`: per-action costs written by hand (``"F=1,B=3,BI=2,W=1"``)
  and the compound layouts' research knobs (weight holds, settled weights).
"""
