"""The pipeline engine, free of any front end (no Flax).

From the bottom up:

* :mod:`~tpipe.core.arguments` - a call's extra arguments: per-example, broadcast, static.
* :mod:`~tpipe.core.packing` - pytrees to one flat buffer per dtype and back.
* :mod:`~tpipe.core.spmd` - what the tick loops share inside ``shard_map``: axes, casts, slots.
* :mod:`~tpipe.core.gated` - run one of several functions only on busy ticks, with its own VJP.
* :mod:`~tpipe.core.remat` - remat policies and the checkpointed pieces of a chunk.
* :mod:`~tpipe.core.layers` - a layer as pure functions, the RNG rule, keyword routing.
* :mod:`~tpipe.core.unit_cost` - FLOPs or time of one layer unit, cached.
* :mod:`~tpipe.core.tick_costs` - a fused table's per-action costs from the units' FLOPs.
* :mod:`~tpipe.core.plan` - unit shapes and costs, the cut into chunks.
* :mod:`~tpipe.core.layout` - where variables live on the stages (per leaf, or packed).
* :mod:`~tpipe.core.taps` - the split backward (``BI`` / ``W``) of any layer, from its jaxpr.
* :mod:`~tpipe.core.chunks` - the chunk programs the tick loops run, one per signature.
* :mod:`~tpipe.core.residuals` - a chunk's VJP residuals kept from its forward for its backward.
* :mod:`~tpipe.core.unit_backward` - a chunk's backward one unit at a time, summed in place.
* :mod:`~tpipe.core.statistics` - running statistics pooled over a step (BatchNorm).
* :mod:`~tpipe.core.forward` - the forward tick loop (GPipe, circular).
* :mod:`~tpipe.core.branches` - what F, B, BI and W do on one device of a fused tick.
* :mod:`~tpipe.core.fused` - the fused tick loop (1F1B, interleaved, ZB-H1, ZB-V).
* :mod:`~tpipe.core.engine` - a planned, laid-out sequence and its runs.
"""
