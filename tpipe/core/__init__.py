"""The pipeline engine, free of any front end (no Flax), in five layers, each importing only the
ones above it in this list:

* :mod:`tpipe.core.base` - what every layer shares: a layer as pure functions, a call's
  arguments, packed buffers, the axes and casts inside ``shard_map``, JAX internals.
* :mod:`tpipe.core.planning` - the plan for one input type: unit shapes and costs, the cut into
  chunks, remat, how each backward action runs, auxiliary losses, pooled statistics.
* :mod:`tpipe.core.layout` - where variables live on the stages: the stage layout, packing a
  chunk, its bytes, logical to staged and back, checkpoints' form and relayout.
* :mod:`tpipe.core.programs` - the chunk programs the tick loops run: the ring between chunks,
  signatures, FSDP gathers, the split backward and a chunk's backward one unit at a time.
* :mod:`tpipe.core.loops` - the tick loops: forward (GPipe, circular) and fused (1F1B,
  interleaved, ZB-H1, ZB-V), with the branches a fused tick chooses and streamed inputs.

On top, :mod:`tpipe.core.engine` plans and lays out a sequence and runs it, and
:mod:`tpipe.core.adapter` is the one call every front end makes of it: build, stage, run,
statistics back.
"""
