"""What every part of the engine shares, importing nothing else of tpipe.core.

A layer as pure functions with the RNG rule and keyword routing (:mod:`.layers`), a call's extra
arguments (:mod:`.arguments`), pytrees as one flat buffer per dtype (:mod:`.packing`), the leaves
that carry gradients (:mod:`.float_leaves`), the axes, casts and slots inside ``shard_map``
(:mod:`.spmd`), and every use of JAX internals (:mod:`.jax_compat`).
"""
