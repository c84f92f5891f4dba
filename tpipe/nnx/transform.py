"""``tpipe.nnx.pipeline``: ``length`` copies of one NNX block class, pipelined.

The NNX counterpart of the linen :func:`tpipe.pipeline`: it takes an ``nnx.Module`` class and
returns an ``nnx.Module`` class whose constructor takes the block's constructor arguments
(``rngs=`` included). An instance holds ``length`` copies of the block, stacked like a
:class:`tpipe.nnx.Repeat` (every ``nnx.Param`` of ``layer`` has a leading axis of length
``length``), and calling it runs them in order, split evenly over the stages, as
``tpipe.nnx.Sequential([tpipe.nnx.Repeat(...)], balance=[length // (S * R)] * (S * R))`` would.

Example::

  Stack = tpipe.nnx.pipeline(Block, length=8, num_stages=4, num_microbatches=8,
                             mesh=tpipe.make_mesh(stages=4, data=2))
  model = Stack(width, rngs=nnx.Rngs(0))      # Block(width, rngs=...) eight times
  y = nnx.jit(lambda m, x: m(x))(model, x)    # x: [batch, width]
"""

from __future__ import annotations

import flax.linen as nn
from flax import nnx

from tpipe import spec as spec_lib
from tpipe.core.base import arguments
from tpipe.core.base import layers as layers_lib
from tpipe.nnx import stack

OWNER = "tpipe.nnx.pipeline"


def pipeline(block_cls: type[nnx.Module], *, length: int,
             spec: spec_lib.PipelineSpec | None = None, **settings) -> type[nnx.Module]:
  """Pipelines ``length`` copies of the NNX block ``block_cls`` over the ``stage`` axis of a mesh.

  The returned class's constructor takes ``block_cls``'s arguments, ``rngs`` by keyword, and
  makes the copies as ``tpipe.nnx.Repeat(lambda r: block_cls(*args, rngs=r, **kwargs), length,
  rngs=rngs)`` does. Its ``__call__(x, *args, **kwargs)`` applies the copies in order to ``x``;
  the other arguments are bound to ``block_cls.__call__``'s parameter names and given to every
  copy, those named in ``per_example`` split into micro-batches with ``x``, the others whole
  (:mod:`tpipe.core.base.arguments`, with the errors and hints of :func:`tpipe.pipeline`).

  Args:
    block_cls: an ``nnx.Module`` class whose constructor takes ``rngs=`` and whose
      ``__call__(x, ...)`` returns a value with the structure, shapes and dtypes of ``x``.
    length: the number of copies L; must divide by ``num_stages * num_repeats``.
    spec: a :class:`tpipe.PipelineSpec`, or None to build one from ``settings``.
    **settings: :class:`tpipe.PipelineSpec` fields (not ``balance``: the copies are cut evenly;
      not a fused schedule: a stack returns activations), overriding ``spec``'s.

  Returns:
    An ``nnx.Module`` subclass of :class:`tpipe.nnx.Repeat`, named ``Pipelined<Block>``.
  """
  if not (isinstance(block_cls, type) and issubclass(block_cls, nnx.Module)):
    hint = (" (a flax.linen class: use tpipe.pipeline)" if isinstance(block_cls, type)
            and issubclass(block_cls, nn.Module) else "")
    raise TypeError(f"{OWNER} takes an nnx.Module class, got {block_cls!r}{hint}.")
  spec = spec_lib.for_stack(OWNER, length, spec, **settings)
  block_name = block_cls.__name__
  arguments.check_per_example(block_cls.__call__, spec.per_example, block_name)

  class Pipelined(stack.Stack, stack.Repeat):
    """``block_cls`` repeated ``length`` times, pipelined (made by :func:`tpipe.nnx.pipeline`)."""

    owner = f"{OWNER}({block_name})"

    def __init__(self, *args, rngs: nnx.Rngs, **kwargs):
      stack.Repeat.__init__(self, lambda r: block_cls(*args, rngs=r, **kwargs), length,
                            rngs=rngs)
      probe = nnx.split(self.layer, nnx.RngState, ...)[1]
      self._configure(spec, rngs if nnx.to_flat_state(probe) else None)

    def pipeline_layers(self):
      return [self]

    def __call__(self, x, *args, **kwargs):
      # Bound, sorted and checked as tpipe.pipeline does a linen block's, with its errors.
      kwargs = arguments.bind(block_cls.__call__, args, kwargs, owner=block_name)
      self.spec.run_mesh(self.owner)
      batch = layers_lib.batch_size(x, self.owner)
      split = arguments.split_keywords(kwargs, per_example=spec.per_example, batch_size=batch,
                                       owner=block_name)
      with arguments.hint_per_example(split, batch, failed=block_name, owner=OWNER):
        return self._run(x, kwargs, loss=False)

  Pipelined.__name__ = Pipelined.__qualname__ = f"Pipelined{block_name}"
  Pipelined.__doc__ = (f"{length} x {block_name} pipelined with {spec} (made by "
                       "tpipe.nnx.pipeline).")
  return Pipelined
