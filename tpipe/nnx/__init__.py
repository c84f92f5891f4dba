"""Flax NNX front end: :class:`Sequential` (any sequence of NNX layers, pipelined),
:class:`Repeat` (stacked copies of one layer), :func:`pipeline` (a stack of one block class) and
:func:`shard` (stage-resident parameters).

Import as ``from tpipe import nnx as tnnx`` (or use ``tpipe.nnx``); the name does not shadow
``flax.nnx`` in user code that imports both."""

from tpipe.nnx.layers import AuxLoss
from tpipe.nnx.layers import AuxMetric
from tpipe.nnx.placement import shard
from tpipe.nnx.sequential import Sequential
from tpipe.nnx.stack import Repeat
from tpipe.nnx.transform import pipeline

__all__ = ["AuxLoss", "AuxMetric", "Repeat", "Sequential", "pipeline", "shard"]
