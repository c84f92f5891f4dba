"""The pipeline engine, independent of any front end.

* :mod:`~tpipe.core.arguments` - a layer's extra call arguments: per-example, broadcast, static.
* :mod:`~tpipe.core.gated` - run a function (or one of several) only on busy ticks, forward and
  backward, without copying its inputs.
* :mod:`~tpipe.core.packing` - pytrees to one flat buffer per dtype and back (stage boundaries,
  per-stage parameters).
* :mod:`~tpipe.core.stage` - one chunk of identical layers: ``lax.scan`` under ``jax.checkpoint``,
  remat policies, RNG folding.
* :mod:`~tpipe.core.executor` - the SPMD interpreter of a schedule's table inside ``shard_map``.
"""
