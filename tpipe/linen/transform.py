"""``tpipe.pipeline``: the Flax linen transform that pipelines a stack of identical blocks.

Like ``nn.scan`` it takes a Module class and returns a Module class with the same constructor;
the new module applies ``length`` copies of the block in sequence (each with its own parameters),
split into stages over the mesh's ``stage`` axis and run with a pipeline schedule.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh

from tpipe import partition
from tpipe import schedules as schedules_lib
from tpipe.core import arguments as arguments_lib
from tpipe.core import executor
from tpipe.core import stage as stage_lib
from tpipe.parallel import mesh as mesh_lib


# The variable collection of BatchNorm's running statistics.
STATS = "batch_stats"


def check_count(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}.")
  if value < 1:
    raise ValueError(f"{name} must be >= 1, got {value}.")


def resolve_mesh(mesh, num_stages: int, stage_axis: str):
  """The mesh to run on: the given one, else the ambient one (``jax.set_mesh``), else 1 device."""
  if mesh is None:
    ambient = jax.sharding.get_abstract_mesh()
    mesh = mesh_lib.single_device_mesh(stage_axis) if ambient.empty else ambient
    origin = "the ambient mesh (jax.set_mesh)" if not ambient.empty else "the default 1-device mesh"
  else:
    origin = "the mesh passed to tpipe.pipeline"
  shape = dict(mesh.shape)
  if stage_axis not in shape:
    raise ValueError(
        f"{origin} has axes {tuple(shape)} but no stage axis {stage_axis!r}; build one with "
        f"tpipe.make_mesh(stages={num_stages}, data=...) or pass stage_axis=<your axis name>.")
  if shape[stage_axis] != num_stages:
    raise ValueError(
        f"num_stages={num_stages} but the {stage_axis!r} axis of {origin} has size "
        f"{shape[stage_axis]}; make them equal (e.g. tpipe.make_mesh(stages={num_stages}, ...)).")
  return mesh


def _block_fields(module: nn.Module, block_cls) -> dict[str, Any]:
  return {f.name: getattr(module, f.name) for f in dataclasses.fields(block_cls)
          if f.init and f.name not in ("parent", "name")}


def batch_size(x) -> int:
  leaves = jax.tree.leaves(x)
  if not leaves:
    raise ValueError("The pipelined block's input x has no arrays; pass an array or a pytree of "
                     "arrays with a leading batch axis.")
  sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
  if None in sizes or len(sizes) != 1:
    raise ValueError(
        "Every array in the pipelined block's input x needs the same leading batch axis; got "
        f"shapes {[np.shape(leaf) for leaf in leaves]}.")
  return sizes.pop()


def microbatch_size(x, num_microbatches: int, mesh, data_axis: str) -> tuple[int, int]:
  """``(batch, micro-batch size)`` of input ``x``: the batch splits into ``num_microbatches``
  micro-batches on each replica of the mesh's data axis; ValueError if it does not divide."""
  data_size = dict(mesh.shape).get(data_axis, 1)
  batch = batch_size(x)
  parts = num_microbatches * data_size
  if batch % parts:
    raise ValueError(
        f"Batch size {batch} is not divisible by num_microbatches * data replicas = "
        f"{num_microbatches} * {data_size} = {parts}; use a batch that is a multiple of "
        f"{parts} or change num_microbatches.")
  return batch, batch // parts


def _check_same_structure(x, y, block_name: str) -> None:
  x_struct = jax.tree.map(lambda a: (np.shape(a), np.dtype(a.dtype)), x)
  y_struct = jax.tree.map(lambda a: (np.shape(a), np.dtype(a.dtype)), y)
  if jax.tree.structure(x) != jax.tree.structure(y) or x_struct != y_struct:
    raise ValueError(
        f"{block_name} must return an activation with the same pytree structure, shapes and "
        f"dtypes as its input x (it crosses stage boundaries), but maps {x_struct} to "
        f"{y_struct}. Make the block shape- and dtype-preserving, e.g. move a projection that "
        "changes the width into the model before or after the pipelined stack.")


@contextlib.contextmanager
def _hint_per_example(split, batch: int, block_name: str):
  """Re-raises a failed trace of one layer with a hint when a broadcast array looks per-example."""
  try:
    yield
  except (TypeError, ValueError) as error:
    suspects = sorted({name for name, a in zip(split.broadcast_names(), split.broadcast)
                       if np.ndim(a) and np.shape(a)[0] == batch})
    if not suspects:
      raise
    raise ValueError(
        f"{block_name} failed on one micro-batch: {type(error).__name__}: {error}\nThe broadcast "
        f"argument(s) {suspects} have the batch size {batch} as their leading axis, but every "
        "layer sees broadcast arrays whole while x is split into micro-batches. If they hold one "
        f"row per example, pass per_example={tuple(suspects)!r} to tpipe.pipeline.") from error


def pipeline(block_cls: type[nn.Module], *, length: int, num_stages: int, num_microbatches: int,
             schedule: str = "gpipe", num_repeats: int = 1, remat="full",
             remat_granularity="chunk", per_example: Sequence[str] = (), unroll: int | bool = 1,
             mesh: Mesh | None = None, stage_axis: str = mesh_lib.STAGE_AXIS,
             data_axis: str = mesh_lib.DATA_AXIS) -> type[nn.Module]:
  """Pipelines ``length`` copies of ``block_cls`` over the ``stage`` axis of a device mesh.

  The returned class takes ``block_cls``'s constructor arguments. Its ``__call__(x, *args,
  **kwargs)`` applies the ``length`` layers in sequence to ``x`` (an array or pytree of arrays
  with a leading batch axis), passing the other arguments to every layer. The batch is split into
  ``num_microbatches`` micro-batches per data-parallel replica which flow through the stages as
  the schedule says. The result equals applying the layers in sequence.

  Arguments after ``x`` are bound to ``block_cls.__call__``'s signature, so they are found by name
  whether passed by position or keyword (see :mod:`tpipe.core.arguments`):

  * parameters named in ``per_example`` hold arrays whose leading axis is the batch (a padding
    mask ``[batch, 1, 1, seq]``); they are split into micro-batches with ``x``, and each layer
    sees its micro-batch's slice;
  * other arrays, at any depth of a pytree, are broadcast: every layer sees them whole (a causal
    mask ``[seq, seq]``);
  * non-array values (``deterministic=True``, ``None``) are passed through unchanged, untraced.

  Gradients flow to per-example and broadcast arrays as well as to ``x`` and the parameters.

  Parameters use ``nn.scan``'s layout: ``init`` returns ``{"params": P}`` where ``P`` has the
  tree structure of ``block_cls(...).init(...)["params"]`` with every leaf stacked on a new
  leading axis of length ``length``, layer ``l`` at index ``l``, each layer initialised from its
  own key. The same variables work for every stage count, schedule, micro-batch count and remat.
  Partitioning metadata is kept: a parameter the block boxes with ``nn.with_partitioning`` or
  ``nn.with_logical_partitioning`` comes back boxed, with ``stage_axis`` as the name of the new
  layer axis (so ``nn.get_partition_spec`` shows the stack split over stages; with logical
  partitioning, map the logical name ``stage_axis`` to the mesh's stage axis in your rules).

  Random streams other than ``params`` passed to ``apply`` (e.g. ``rngs={"dropout": key}``):
  the module draws ``K = self.make_rng(name)`` once per call (Flax's key for this module's place
  in the model, derived from ``key`` and the name path; not ``key`` itself), and applies layer
  ``l`` (0-based over the stack) to micro-batch ``m`` with ``rngs={name: fold_in(fold_in(K, l),
  m)}``, where ``m = replica * num_microbatches + j`` is the global index of micro-batch ``j`` of
  data-parallel replica ``replica``. So for a fixed number of micro-batches per replica and of
  replicas, the result does not depend on the stage count, schedule or remat policy.

  BatchNorm: a block with ``batch_stats`` (stacked like the parameters) runs as
  ``tpipe.Sequential([tpipe.Repeat(block, L)])`` with the same uniform split, so each micro-batch
  is normalized with its own statistics and the running averages are updated once per step from
  statistics pooled over the whole mini-batch (pass ``mutable=["batch_stats"]`` in training).
  Other variable collections are not supported: a block that creates them at ``init`` is
  rejected, and a block that writes a collection the caller made mutable (``sow`` into
  ``intermediates``) raises instead of silently returning nothing.

  Args:
    block_cls: a ``flax.linen.Module`` class whose ``__call__(x, ...)`` returns a value with the
      same structure, shapes and dtypes as ``x``, and whose only variables are ``params``.
    length: number of layers L.
    num_stages: pipeline stages S; must equal the size of the mesh's stage axis.
    num_microbatches: micro-batches M per data-parallel replica. ``M < S`` works (big bubble).
    schedule: ``"gpipe"`` (fill-drain) or ``"circular"`` (each stage holds ``num_repeats``
      chunks of layers; bubble ``(S-1) / (R*M + S-1)``). The fused schedules (``"1f1b"``,
      ``"zb_h1"``, ...) return the loss, not activations, so they need a loss layer at the end:
      use :class:`tpipe.Sequential` for them (a ValueError here says so).
    num_repeats: chunks per stage R (``"circular"`` only). L must divide by ``S * R``.
    remat: ``"none"``, ``"full"`` (recompute each stage's chunk in the backward pass, keeping
      only its input), ``"dots"`` (keep matmul outputs), or a ``jax.checkpoint`` policy.
    remat_granularity: what is checkpointed with the remat policy: ``"chunk"`` (each stage's
      whole chunk), ``"layer"`` (each layer: the chunk keeps every layer's input and its
      backward recomputes one layer at a time), or an int ``k`` (every ``k`` layers of the
      chunk; a chunk's ``n % k`` last layers are one shorter piece).
    per_example: names of ``block_cls.__call__`` parameters whose arrays carry a leading batch
      axis and are split into micro-batches (see above).
    unroll: layers per iteration of each stage's layer loop, as in ``nn.scan`` (``True``:
      unroll the whole chunk). More unrolling lets XLA fuse across layers; compile time grows.
    mesh: the device mesh; ``None`` means the ambient mesh (``jax.set_mesh``), or one device.
      Its axes must have ``AxisType.Auto`` (``tpipe.make_mesh`` makes such a mesh).
    stage_axis: name of the mesh axis holding the stages.
    data_axis: name of the mesh axis of data-parallel replicas (the batch is split over it);
      ignored if the mesh has no such axis.

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
    raise TypeError(f"block_cls must be a flax.linen.Module class, got {block_cls!r}.")
  for name, value in (("length", length), ("num_stages", num_stages),
                      ("num_microbatches", num_microbatches), ("num_repeats", num_repeats)):
    check_count(name, value)
  if schedule in schedules_lib.FUSED_SCHEDULE_NAMES:
    raise ValueError(
        f"tpipe.pipeline returns the blocks' activations, but schedule={schedule!r} runs the "
        "backward inside the pipeline and returns the loss, which needs a last layer that "
        "computes each example's loss. Use tpipe.Sequential([tpipe.Repeat(block, length), "
        f"YourLoss()], schedule={schedule!r}, per_example=('targets',), ...), or "
        "schedule='gpipe'/'circular' here.")
  the_schedule = schedules_lib.make_schedule(schedule, num_stages, num_microbatches, num_repeats)
  partition.layers_per_chunk(length, num_stages, num_repeats)  # Raises unless L splits evenly.
  stage_lib.resolve_remat(remat)  # Raises for unknown names before anything is traced.
  stage_lib.check_remat_granularity(remat_granularity)
  stage_lib.check_unroll(unroll)
  block_name = block_cls.__name__
  per_example = arguments_lib.check_per_example(block_cls.__call__, per_example, block_name)
  if mesh is not None:
    if not isinstance(mesh, Mesh):
      raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}.")
    resolve_mesh(mesh, num_stages, stage_axis)

  class Pipelined(block_cls):
    """``block_cls`` repeated ``length`` times, pipelined (made by :func:`tpipe.pipeline`)."""

    def setup(self):
      # The block's own setup (if any) belongs to the per-layer template, not to the stack.
      pass

    @nn.compact
    def __call__(self, x, *args, **kwargs):
      run_mesh = resolve_mesh(mesh, num_stages, stage_axis)
      batch, micro = microbatch_size(x, num_microbatches, run_mesh, data_axis)
      template = block_cls(**_block_fields(self, block_cls), parent=None)
      split = arguments_lib.split_arguments(block_cls.__call__, args, kwargs,
                                            per_example=per_example, batch_size=batch,
                                            owner=block_name)

      def call_layer(layer_variables, h, broadcast, per_example_slice, layer_rngs, **apply_kw):
        call_args, call_kwargs = split.rebuild(broadcast, per_example_slice)
        return template.apply(layer_variables, h, *call_args, rngs=layer_rngs, **call_kwargs,
                              **apply_kw)

      def layer_fn(layer_params, h, broadcast, per_example_slice, layer_rngs):
        return call_layer({"params": layer_params}, h, broadcast, per_example_slice, layer_rngs)

      streams = sorted(name for name in self.scope.rngs if name != "params")
      rngs = {name: self.make_rng(name) for name in streams}
      x_micro = jax.tree.map(lambda a: a[:micro], x)
      per_example_micro = tuple(a[:micro] for a in split.per_example)

      if self.is_initializing():
        keys = jax.random.split(self.make_rng("params"), length)

        def init_layer(key):
          init_rngs = {"params": key, **stage_lib.fold_rngs(rngs, 0, 0)}
          call_args, call_kwargs = split.rebuild(split.broadcast, per_example_micro)
          return template.init(init_rngs, x_micro, *call_args, **call_kwargs)

        with _hint_per_example(split, batch, block_name):
          layer_vars = jax.vmap(init_layer)(keys)
        extra = sorted(set(layer_vars) - {"params", STATS})
        if extra:
          raise ValueError(
              f"{block_name} creates variable collections {extra}; tpipe.pipeline supports "
              f"blocks whose variables are 'params' and BatchNorm's '{STATS}'.")
        # The new leading axis is the layer axis, split over stages: say so in the metadata.
        stacked = nn.meta.add_axis(layer_vars.get("params", {}), 0,
                                   {nn.PARTITION_NAME: stage_axis})
        for name, value in stacked.items():
          self.param(name, lambda _key, value=value: value, unbox=False)
        for name, value in nn.meta.unbox(layer_vars.get(STATS, {})).items():
          self.put_variable(STATS, name, value)

      params = nn.meta.unbox(dict(self.variables.get("params", {})))
      if self.variables.get(STATS):
        return self._run_with_statistics(template, params, x, split, rngs)
      leaves = jax.tree.leaves(params)
      if leaves and any(np.shape(leaf)[:1] != (length,) for leaf in leaves):
        raise ValueError(
            f"Expected every parameter of the pipelined {block_name} stacked on a leading axis "
            f"of length {length}; got shapes {jax.tree.map(np.shape, params)}. Were these "
            "variables made for another length?")
      one_layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)
      with _hint_per_example(split, batch, block_name):
        out, written = jax.eval_shape(
            lambda p, h, b, e: call_layer({"params": p}, h, b, e, rngs, mutable=True),
            one_layer, x_micro, split.broadcast, per_example_micro)
      _check_same_structure(x_micro, out, block_name)
      dropped = sorted(c for c in written if c != "params" and self.is_mutable_collection(c))
      if dropped:
        raise ValueError(
            f"{block_name} writes to the variable collection(s) {dropped} (e.g. with self.sow), "
            f"which the caller made mutable, but tpipe.pipeline does not return them from its "
            f"layers. Take what you need from the stack's output instead, or call apply without "
            f"mutable={dropped}.")
      return executor.run_pipeline(
          layer_fn, params, x, split.broadcast, split.per_example, rngs, length=length,
          schedule=the_schedule, mesh=run_mesh, remat=remat,
          remat_granularity=remat_granularity, unroll=unroll,
          stage_axis=stage_axis, data_axis=data_axis)

    def _run_with_statistics(self, template, params, x, split, rngs):
      """A block with BatchNorm statistics: the stack as ``tpipe.Sequential([Repeat(block, L)])``
      with the same uniform split, whose pooled once-per-step update GPipe's semantics need."""
      # Imported here: tpipe.linen.sequential builds on this module's helpers.
      from tpipe.linen import sequential  # pylint: disable=g-import-not-at-top
      args, kwargs = split.rebuild(split.broadcast, split.per_example)
      names = arguments_lib.extra_parameter_names(block_cls.__call__)
      if len(args) > len(names):
        raise TypeError(f"{block_name}: {len(args)} positional arguments after x, but its "
                        f"__call__ names only {names}.")
      kwargs = {**dict(zip(names, args)), **kwargs}
      num_chunks = num_stages * num_repeats
      stack = sequential.Sequential(
          [sequential.Repeat(template, length)], num_stages=num_stages,
          num_microbatches=num_microbatches, schedule=schedule, num_repeats=num_repeats,
          balance=[length // num_chunks] * num_chunks, remat=remat,
          remat_granularity=remat_granularity, per_example=per_example,
          mesh=mesh, stage_axis=stage_axis, data_axis=data_axis)
      stats = nn.meta.unbox(dict(self.variables[STATS]))
      variables = {"params": {"layers_0": params}, STATS: {"layers_0": stats}}
      if self.is_initializing() or not self.is_mutable_collection(STATS):
        # Evaluation; or init, which (like Flax) leaves the statistics as created. In training
        # mode without mutable statistics the stack raises and names the fix.
        mutable = [STATS] if self.is_initializing() else False
        out = stack.apply(variables, x, **kwargs, rngs=rngs, mutable=mutable)
        return out[0] if self.is_initializing() else out
      y, updated = stack.apply(variables, x, **kwargs, rngs=rngs, mutable=[STATS])
      for name, value in updated[STATS]["layers_0"].items():
        self.put_variable(STATS, name, value)
      return y

  Pipelined.__name__ = Pipelined.__qualname__ = f"Pipelined{block_name}"
  Pipelined.__doc__ = (f"{length} x {block_name} in {num_stages} stages, {num_microbatches} "
                       f"micro-batches, schedule={schedule!r}, num_repeats={num_repeats}, "
                       f"remat={remat!r}, remat_granularity={remat_granularity!r} (made by "
                       "tpipe.pipeline).")
  return Pipelined
