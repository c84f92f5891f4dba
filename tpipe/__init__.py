"""tpipe: GPipe pipeline parallelism for JAX and Flax.

A stack of identical Flax blocks is split into stages, one per device along a mesh axis; each
mini-batch is split into micro-batches that flow through the stages; gradients accumulate over
micro-batches and are reduced across data-parallel replicas once per step.
"""

from tpipe import nnx
from tpipe import schedules
from tpipe.linen.sequential import Repeat
from tpipe.linen.sequential import Sequential
from tpipe.linen.transform import pipeline
from tpipe.parallel.mesh import data_sharding
from tpipe.parallel.mesh import make_mesh
from tpipe.parallel.train_step import TrainState
from tpipe.parallel.train_step import create_train_state
from tpipe.parallel.train_step import make_train_step
from tpipe.parallel.train_step import param_shardings
from tpipe.parallel.train_step import state_shardings
from tpipe.parallel.train_step import train_state_shardings
from tpipe.schedules import Schedule
from tpipe.schedules import make_schedule

__version__ = "0.1.0"
