"""``tpipe.pipeline``: the Flax linen transform that pipelines a stack of identical blocks.

Like ``nn.scan`` it takes a Module class and returns a Module class with the same constructor;
the new module applies ``length`` copies of the block in sequence (each with its own parameters),
split evenly over the stages: it is ``tpipe.Sequential([tpipe.Repeat(block, length)])`` with the
blocks cut ``length / (S * R)`` per chunk, on the same engine, its parameters in ``nn.scan``'s
layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from tpipe import spec as spec_lib
from tpipe.core import adapter
from tpipe.core.base import arguments
from tpipe.core.base import layers as layers_lib
from tpipe.linen import sequential

OWNER = "tpipe.pipeline"
STATS = sequential.STATS


def _block_fields(module: nn.Module, block_cls) -> dict[str, Any]:
  return {f.name: getattr(module, f.name) for f in dataclasses.fields(block_cls)
          if f.init and f.name not in ("parent", "name")}


def pipeline(block_cls: type[nn.Module], *, length: int, spec: spec_lib.PipelineSpec | None = None,
             **settings) -> type[nn.Module]:
  """Pipelines ``length`` copies of ``block_cls`` over the ``stage`` axis of a device mesh.

  The returned class takes ``block_cls``'s constructor arguments. Its ``__call__(x, *args,
  **kwargs)`` applies the ``length`` layers in sequence to ``x`` (an array or pytree of arrays
  with a leading batch axis), passing the other arguments to every layer. The batch is split into
  ``num_microbatches`` micro-batches per data-parallel replica which flow through the stages as
  the schedule says. The result equals applying the layers in sequence.

  Arguments after ``x`` are bound to ``block_cls.__call__``'s signature, so they are found by name
  whether passed by position or keyword (see :mod:`tpipe.core.base.arguments`): parameters named in
  ``per_example`` hold arrays with the batch as leading axis, split into micro-batches with ``x``;
  other arrays, at any depth of a pytree, are broadcast whole to every layer; non-array values
  (``deterministic=True``) are passed through untraced. Gradients reach every float array.

  Parameters use ``nn.scan``'s layout: every leaf of the block's params stacked on a leading axis
  of length ``length``, layer ``l`` at index ``l``, each layer initialised from its own key
  (``jax.random.split(self.make_rng("params"), length)``). Partitioning metadata is kept, with
  ``stage_axis`` naming the new layer axis. RNG streams follow :mod:`tpipe.core.base.layers`' rule
  (unit ``l`` is layer ``l``). BatchNorm statistics (``batch_stats``) are pooled as in
  :class:`tpipe.Sequential`. A block that ``sow`` s into a collection the caller made mutable
  raises: the stack does not return sown values.

  Args:
    block_cls: a ``flax.linen.Module`` class whose ``__call__(x, ...)`` returns a value with the
      same structure, shapes and dtypes as ``x``.
    length: number of layers L; must divide by ``num_stages * num_repeats``.
    spec: a :class:`tpipe.PipelineSpec`, or None to build one from ``settings``.
    **settings: :class:`tpipe.PipelineSpec` fields (``num_stages``, ``num_microbatches``,
      ``schedule`` (``"gpipe"`` or ``"circular"``), ``num_repeats``, ``remat``,
      ``remat_granularity``, ``per_example``, ``unroll``, ``mesh``, ``stage_axis``,
      ``data_axis``), overriding ``spec``'s.

  Returns:
    A ``flax.linen.Module`` subclass of ``block_cls``.

  Example::

    Stack = tpipe.pipeline(MLPBlock, length=8, num_stages=4, num_microbatches=8,
                           mesh=tpipe.make_mesh(stages=4, data=2))
    model = Stack(width=64)
    variables = model.init({"params": key}, x)   # x: [batch, 64]
    y = jax.jit(model.apply)(variables, x)
  """
  if not (isinstance(block_cls, type) and issubclass(block_cls, nn.Module)):
    raise TypeError(f"{OWNER}: block_cls must be a flax.linen.Module class (pass the class, not "
                    f"an instance), got {block_cls!r}.")
  spec = spec_lib.for_stack(OWNER, length, spec, **settings)
  stack = _Stack(block_cls, length, spec,
                 arguments.check_per_example(block_cls.__call__, spec.per_example,
                                             block_cls.__name__))
  block_name = block_cls.__name__

  class Pipelined(block_cls):
    """``block_cls`` repeated ``length`` times, pipelined (made by :func:`tpipe.pipeline`)."""

    def setup(self):
      # The block's own setup (if any) belongs to the per-layer template, not to the stack.
      pass

    @nn.compact
    def __call__(self, x, *args, **kwargs):
      return stack.call(self, x, args, kwargs)

  Pipelined.__name__ = Pipelined.__qualname__ = f"Pipelined{block_name}"
  Pipelined.__doc__ = (f"{length} x {block_name} pipelined with {spec} (made by "
                       "tpipe.pipeline).")
  return Pipelined


@dataclasses.dataclass(frozen=True)
class _Stack:
  """What the class :func:`pipeline` makes does: its call, init and checks.

  Attributes:
    block_cls: the block class.
    length: L.
    spec: the settings (the blocks cut evenly).
    per_example: checked ``per_example`` names.
  """

  block_cls: Any
  length: int
  spec: spec_lib.PipelineSpec
  per_example: tuple

  @property
  def block_name(self) -> str:
    return self.block_cls.__name__

  def call(self, module: nn.Module, x, args, kwargs):
    spec, block_name = self.spec, self.block_name
    mesh = spec.run_mesh(OWNER)
    batch = layers_lib.batch_size(x, OWNER)
    template = self.block_cls(**_block_fields(module, self.block_cls), parent=None)
    kwargs = arguments.bind(self.block_cls.__call__, args, kwargs, owner=block_name)
    split = arguments.split_keywords(kwargs, per_example=self.per_example, batch_size=batch,
                                     owner=block_name)
    streams = tuple(sorted(name for name in module.scope.rngs if name != "params"))
    rngs = {name: module.make_rng(name) for name in streams}
    hint = lambda: arguments.hint_per_example(split, batch, failed=block_name, owner=OWNER)
    if module.is_initializing():
      with hint():
        self.init_blocks(module, template, x, kwargs, rngs, mesh)
    params = {"layers_0": nn.meta.unbox(dict(module.variables.get("params", {})))}
    leaves = jax.tree.leaves(params)
    if leaves and any(np.shape(leaf)[:1] != (self.length,) for leaf in leaves):
      raise ValueError(
          f"Expected every parameter of the pipelined {block_name} stacked on a leading axis "
          f"of length {self.length}; got shapes {jax.tree.map(np.shape, params)}. Were these "
          "variables made for another length?")
    stats = dict(module.variables.get(STATS, {}))
    stats = {"layers_0": nn.meta.unbox(stats)} if stats else {}

    def store(new_stats):
      for name, value in new_stats["layers_0"].items():
        module.put_variable(STATS, name, value)

    # A block that writes to a collection the caller made mutable (sow) raises there.
    front = sequential.LinenLayers((sequential.Repeat(template, self.length),), spec, OWNER,
                                   returned=module.scope.mutable)
    with hint():
      return front.run(module, adapter.Variables(params, stats), x, kwargs, loss=False,
                       rngs=rngs, store_stats=store)

  def _micro(self, x, mesh) -> int:
    return self.spec.microbatch_size(layers_lib.batch_size(x, OWNER), self.spec.row_shards(mesh))

  def init_blocks(self, module, template, x, kwargs, rngs, mesh):
    """Creates the stack's variables: layer ``l`` from key ``l`` of
    ``jax.random.split(make_rng("params"), length)``, the block's boxes kept."""
    spec, micro = self.spec, self._micro(x, mesh)
    h = jax.tree.map(lambda a: a[:micro], x)
    kw = {k: (jax.tree.map(lambda a: a[:micro], v) if k in spec.per_example else v)
          for k, v in kwargs.items()}
    other = layers_lib.unit_rngs(rngs, 0, 0)
    init = layers_lib.outside_mesh(template.init, (spec.data_axis, spec.stage_axis))
    keys = jax.random.split(module.make_rng("params"), self.length)
    layer_vars = jax.vmap(lambda k: init({"params": k, **other}, h, **kw))(keys)
    extra = sorted(set(layer_vars) - {"params", STATS})
    if extra:
      raise ValueError(
          f"{self.block_name} creates variable collections {extra}; tpipe.pipeline supports "
          f"blocks whose variables are 'params' and BatchNorm's '{STATS}'.")
    # The new leading axis is the layer axis, split over stages: say so in the metadata.
    stacked = nn.meta.add_axis(layer_vars.get("params", {}), 0,
                               {nn.PARTITION_NAME: spec.stage_axis})
    for name, value in stacked.items():
      module.param(name, lambda _key, value=value: value, unbox=False)
    for name, value in nn.meta.unbox(layer_vars.get(STATS, {})).items():
      module.put_variable(STATS, name, value)
