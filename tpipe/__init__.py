"""tpipe: GPipe pipeline parallelism for JAX and Flax.

A sequence of layers is split into stages, one per device along a mesh axis; each mini-batch is
split into micro-batches that flow through the stages; gradients accumulate over micro-batches
and are reduced across data-parallel replicas once per step.

The public surface, one name per line below; the layers of the package (each imports only from
the ones below it):

* front ends: :func:`pipeline` (a stack of identical blocks, as ``nn.scan`` writes it) and
  :class:`Sequential` (any sequence of layers) for linen, :mod:`tpipe.nnx` for NNX; their
  ``pipeline_for(x)`` returns the :class:`PlannedPipeline` a call of theirs runs (the split, the
  stage layouts, ``apply``/``loss`` on staged variables), which the trainer trains, and their
  ``stage_layout(x)`` the :class:`StageLayout` of the variables on the stages;
* :mod:`tpipe.training`: train state, shardings and the jitted step (:class:`TrainStep`);
  :mod:`tpipe.staging`: variables between their logical and staged forms, and checkpoints;
* :mod:`tpipe.core`: the engine (planning, stage layout, chunk programs, the two tick loops);
* :class:`PipelineSpec`, :mod:`tpipe.mesh`, :mod:`tpipe.axis_rules`, :mod:`tpipe.schedules`,
  :mod:`tpipe.partition`: settings, meshes, how weights split over ``fsdp`` and ``tensor``,
  schedule tables (``tpipe.schedules.build``, ``tpipe.schedules.Schedule``, ...) and balancing,
  pure where they can be.

Research tools outside the stable API (the exact window search, link pricing, hand-written
tick costs) are :mod:`tpipe.experimental`, imported by name; nothing above imports it.
"""

from tpipe import axis_rules
from tpipe import nnx
from tpipe import schedules
from tpipe import staging
from tpipe.axis_rules import DEFAULT_RULES
from tpipe.core.engine import PlannedPipeline
from tpipe.core.planning.unit_cost import counting_flops
from tpipe.linen.layers import AUX_LOSS
from tpipe.linen.layers import AUX_METRIC
from tpipe.linen.sequential import Repeat
from tpipe.linen.sequential import Sequential
from tpipe.linen.transform import pipeline
from tpipe.mesh import data_sharding
from tpipe.mesh import make_mesh
from tpipe.mesh import topology_devices
from tpipe.spec import PipelineSpec
from tpipe.staging import StageLayout
from tpipe.training import create_train_state
from tpipe.training import make_train_step
from tpipe.training import shardings
from tpipe.training import TrainState
from tpipe.training import TrainStep

__all__ = [
    "AUX_LOSS",
    "AUX_METRIC",
    "DEFAULT_RULES",
    "PipelineSpec",
    "PlannedPipeline",
    "Repeat",
    "Sequential",
    "StageLayout",
    "TrainState",
    "TrainStep",
    "axis_rules",
    "counting_flops",
    "create_train_state",
    "data_sharding",
    "make_mesh",
    "make_train_step",
    "nnx",
    "pipeline",
    "schedules",
    "shardings",
    "staging",
    "topology_devices",
]

__version__ = "0.1.0"
