"""Flax linen front ends: :func:`pipeline` (a stack of identical blocks) and :class:`Sequential`
(any sequence of layers, balanced by cost)."""

from tpipe.linen.sequential import Repeat
from tpipe.linen.sequential import Sequential
from tpipe.linen.transform import pipeline

__all__ = ["Repeat", "Sequential", "pipeline"]
