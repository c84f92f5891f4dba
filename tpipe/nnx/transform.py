"""``tpipe.nnx.pipeline``: ``length`` copies of one NNX block class, pipelined.

The NNX counterpart of the linen :func:`tpipe.pipeline`: it takes an ``nnx.Module`` class and
returns an ``nnx.Module`` class whose constructor takes the block's constructor arguments
(``rngs=`` included). An instance holds ``length`` copies of the block, stacked like a
:class:`tpipe.nnx.Repeat` (its state is a Repeat's: every ``nnx.Param`` of ``layer`` has a
leading axis of length ``length``, whatever the stages, schedule or repeats), and calling it runs
them in order, split evenly over the stages, exactly as
``tpipe.nnx.Sequential([tpipe.nnx.Repeat(...)], balance=[length // (S * R)] * (S * R))`` would.

Example::

  Stack = tpipe.nnx.pipeline(Block, length=8, num_stages=4, num_microbatches=8,
                             mesh=tpipe.make_mesh(stages=4, data=2))
  model = Stack(width, rngs=nnx.Rngs(0))      # Block(width, rngs=...) eight times
  y = nnx.jit(lambda m, x: m(x))(model, x)    # x: [batch, width]
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
from flax import nnx
from jax.sharding import Mesh

from tpipe import partition
from tpipe import schedules as schedules_lib
from tpipe.core import arguments as arguments_lib
from tpipe.linen import sequential as linen_sequential
from tpipe.linen import transform as linen_transform
from tpipe.nnx import sequential
from tpipe.parallel import mesh as mesh_lib

_OWNER = "tpipe.nnx.pipeline"


def pipeline(block_cls: type[nnx.Module], *, length: int, num_stages: int,
             num_microbatches: int, schedule: str = "gpipe", num_repeats: int = 1,
             remat: Any = "full", remat_granularity: Any = "chunk",
             per_example: Sequence[str] = (), mesh: Mesh | None = None,
             stage_axis: str = mesh_lib.STAGE_AXIS,
             data_axis: str = mesh_lib.DATA_AXIS) -> type[nnx.Module]:
  """Pipelines ``length`` copies of the NNX block ``block_cls`` over the ``stage`` axis of a mesh.

  The returned class's constructor takes ``block_cls``'s arguments, ``rngs`` by keyword, and
  makes the copies as ``tpipe.nnx.Repeat(lambda r: block_cls(*args, rngs=r, **kwargs), length,
  rngs=rngs)`` does. Its ``__call__(x, *args, **kwargs)`` applies the copies in order to ``x``
  (an array or pytree of arrays, batch first); the other arguments are bound to
  ``block_cls.__call__``'s parameter names and given to every copy, those named in
  ``per_example`` split into micro-batches with ``x``, the others whole. The result, and its
  gradients through ``nnx.grad``/``nnx.value_and_grad``, equal the copies applied in order.

  Args:
    block_cls: an ``nnx.Module`` class whose constructor takes ``rngs=`` and whose
      ``__call__(x, ...)`` returns a value with the structure, shapes and dtypes of ``x``.
    length: the number of copies L; must divide by ``num_stages * num_repeats`` (the copies are
      split evenly).
    num_stages: pipeline stages S; must equal the size of the mesh's stage axis.
    num_microbatches: micro-batches M per data-parallel replica.
    schedule: ``"gpipe"`` or ``"circular"``. Fused schedules (``"1f1b"``) return the loss, so
      they need a last layer that computes it: use :class:`tpipe.nnx.Sequential`.
    num_repeats: chunks per stage R (``"circular"`` only).
    remat: ``"none"``, ``"full"``, ``"dots"`` or a ``jax.checkpoint`` policy, per chunk.
    remat_granularity: ``"chunk"``, ``"layer"`` or an int ``k``: what is checkpointed with the
      remat policy (see ``tpipe.Sequential``).
    per_example: names of ``block_cls.__call__`` parameters whose arrays have a leading batch
      axis and are split into micro-batches.
    mesh: the device mesh; ``None`` means the ambient mesh (``jax.set_mesh``), or one device.
    stage_axis: the mesh axis of stages.
    data_axis: the mesh axis of data-parallel replicas.

  Returns:
    An ``nnx.Module`` subclass of :class:`tpipe.nnx.Repeat`, named ``Pipelined<Block>``.

  Raises:
    TypeError, ValueError: here, for a bad block class or setting; at construction, for a block
      the stack cannot run (see :class:`tpipe.nnx.Sequential`).
  """
  if not (isinstance(block_cls, type) and issubclass(block_cls, nnx.Module)):
    hint = (" (a flax.linen class: use tpipe.pipeline)" if isinstance(block_cls, type)
            and issubclass(block_cls, nn.Module) else "")
    raise TypeError(f"{_OWNER} takes an nnx.Module class, got {block_cls!r}{hint}.")
  for name, value in (("length", length), ("num_stages", num_stages),
                      ("num_microbatches", num_microbatches), ("num_repeats", num_repeats)):
    linen_transform.check_count(f"{_OWNER} {name}", value)
  if schedule in schedules_lib.FUSED_SCHEDULE_NAMES or schedule in linen_sequential.FUSED_SCHEDULES:
    raise ValueError(
        f"{_OWNER}: schedule={schedule!r} returns the mean loss, but a pipelined stack of "
        f"{block_cls.__name__} returns activations. Put the loss in the last layer of a "
        "tpipe.nnx.Sequential([..., tpipe.nnx.Repeat(...), HeadLoss(...)], "
        f"schedule={schedule!r}), or use schedule='gpipe' or 'circular' here.")
  schedules_lib.make_schedule(schedule, num_stages, num_microbatches, num_repeats)
  per_chunk = partition.layers_per_chunk(length, num_stages, num_repeats)  # Raises unless even.
  block_name = block_cls.__name__
  per_example = arguments_lib.check_per_example(block_cls.__call__, per_example, block_name)
  if mesh is not None:
    if not isinstance(mesh, Mesh):
      raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}.")
    linen_transform.resolve_mesh(mesh, num_stages, stage_axis)
  names = arguments_lib.extra_parameter_names(block_cls.__call__)

  class Pipelined(sequential._Stack, sequential.Repeat):  # pylint: disable=protected-access
    """``block_cls`` repeated ``length`` times, pipelined (made by :func:`tpipe.nnx.pipeline`)."""

    _owner = f"{_OWNER}({block_name})"

    def __init__(self, *args, rngs: nnx.Rngs, **kwargs):
      sequential.Repeat.__init__(self, lambda r: block_cls(*args, rngs=r, **kwargs), length,
                                 rngs=rngs)
      probe = nnx.split(self.layer, nnx.RngState, ...)[1]
      self._configure(num_stages=num_stages, num_microbatches=num_microbatches,
                      schedule=schedule, num_repeats=num_repeats,
                      balance=[per_chunk] * (num_stages * num_repeats), remat=remat,
                      remat_granularity=remat_granularity, per_example=per_example,
                      mesh=mesh, stage_axis=stage_axis,
                      data_axis=data_axis, rngs=rngs if nnx.to_flat_state(probe) else None)

    def _pipeline_layers(self):
      return [self]

    def __call__(self, x, *args, **kwargs):
      if len(args) > len(names):
        raise TypeError(f"{block_name}.__call__ takes {len(names)} argument(s) after x "
                        f"({names}), got {len(args)}.")
      doubled = sorted(set(names[:len(args)]) & set(kwargs))
      if doubled:
        raise TypeError(f"{block_name}.__call__ got {doubled} both by position and by keyword.")
      return self._run(x, {**dict(zip(names, args)), **kwargs})

  Pipelined.__name__ = Pipelined.__qualname__ = f"Pipelined{block_name}"
  Pipelined.__doc__ = (f"{length} x {block_name} in {num_stages} stages, {num_microbatches} "
                       f"micro-batches, schedule={schedule!r}, num_repeats={num_repeats}, "
                       f"remat={remat!r} (made by tpipe.nnx.pipeline).")
  return Pipelined
