"""Where a pipelined NNX stack's state lives between calls: each variable's home on its mesh.

A stack built with a ``mesh`` places every array variable at its home when it is built, and its
calls keep it there, so a training step under ``nnx.jit`` returns the state with the shardings it
took: the next step's inputs look like the first's and reuse its compiled program. Left to the
partitioner, the state would arrive on one device (where NNX made it) and leave spread over the
mesh as propagation chose (a Repeat's copies split over ``stage`` like the staging reshape's
gradient, a LayerNorm's bias split the same way), and the second step would compile again.

Homes:

* an ``nnx.Param`` is split inside its stage as its logical axis names say
  (:func:`tpipe.axis_rules.weight_spec`, as the engine splits it: over ``fsdp``, ``tensor``,
  ``expert``; whole on a mesh of ``stage`` and ``data`` only), a Repeat's copy axis over ``stage``
  where :func:`tpipe.nnx.shard` annotated it, else whole;
* every other variable (BatchNorm statistics, RNG keys and counts) is replicated.

A call reads the parameters pinned at home (``lax.with_sharding_constraint``, whose transpose
pins their gradients there, so an optimizer's update stays there too) and writes BatchNorm
statistics and RNG counts back at home. A stack without a mesh of its own (the ambient
``jax.set_mesh`` one, or one device) has no homes: its state stays where it is put.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import jax
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpipe import axis_rules
from tpipe import mesh as mesh_lib
from tpipe import spec as spec_lib

# (module holding a layer's state, its number of stacked copies or None): a stack's layers.
Targets = Sequence[tuple[nnx.Module, int | None]]


def home_mesh(spec: spec_lib.PipelineSpec) -> Mesh | None:
  """The mesh the stack's state lives on: the spec's own, or None (no homes)."""
  return spec.mesh if isinstance(spec.mesh, Mesh) else None


def variable_spec(variable: nnx.Variable, copies: int | None, mesh, stage_axis: str) -> P:
  """The partition spec of ``variable``'s home (see the module doc); ``copies``: the number of
  stacked copies of the layer holding it, or None."""
  if not isinstance(variable, nnx.Param):
    return P()
  shape = tuple(variable.shape)
  names = variable.get_metadata().get("out_sharding") or None
  # Only fsdp, tensor and expert devices split a weight inside its stage (the engine reads its
  # names only where the mesh has them).
  reserved = (stage_axis, mesh_lib.DATA_AXIS)
  inside = any(n > 1 for axis, n in dict(mesh.shape).items() if axis not in reserved)
  split = lambda shape, names: (axis_rules.weight_spec(shape, names, mesh, reserved=reserved)
                                if inside else P())
  if copies is None:
    return split(shape, names)
  lead = None
  if names is not None and len(names) == len(shape):  # The copy axis is named (tpipe.nnx.shard).
    lead, names = names[0], tuple(names[1:])
  return P(stage_axis if lead == stage_axis else None, *split(shape[1:], names))


def _is_array(value) -> bool:
  return isinstance(value, (jax.Array, jax.core.Tracer))


def _at(value, sharding: NamedSharding):
  """``value`` at ``sharding``: pinned there while tracing, moved there (or left, when it is
  there already) otherwise."""
  if isinstance(value, jax.core.Tracer):
    return lax.with_sharding_constraint(value, sharding)
  return jax.device_put(value, sharding)


def _placeable(mesh: Mesh) -> bool:
  """Whether arrays can be moved onto ``mesh``'s devices (not those of a topology that is only
  compiled for: ``tpipe.topology_devices``)."""
  device = mesh.devices.flat[0]
  try:
    return device in jax.devices(device.platform)
  except RuntimeError:  # No backend for the platform here.
    return False


def place(targets: Targets, others: Iterable[nnx.Module], spec: spec_lib.PipelineSpec,
          kinds: Sequence[type] = (nnx.Variable,)) -> None:
  """Moves the array variables of kinds ``kinds`` in ``targets`` (a stack's layers) and
  ``others`` (the stack's other modules: its ``rngs``) to their homes, in place (pinned there,
  inside a trace). Nothing moves without a home mesh, nor onto the devices of a topology that is
  only compiled for."""
  mesh = home_mesh(spec)
  if mesh is None:
    return
  placeable = _placeable(mesh)
  seen = set()
  entries = list(targets) + [(module, None) for module in others]
  for module, copies in entries:
    for _, variable in nnx.iter_graph(module):
      if not isinstance(variable, tuple(kinds)) or id(variable) in seen:
        continue
      seen.add(id(variable))
      value = variable.get_value()
      if not _is_array(value) or not (placeable or isinstance(value, jax.core.Tracer)):
        continue
      home = variable_spec(variable, copies, mesh, spec.stage_axis)
      variable.set_value(_at(value, NamedSharding(mesh, home)))


def pinned(target: nnx.Module, copies: int | None, kind: type, values: Any,
           spec: spec_lib.PipelineSpec) -> Any:
  """``values`` (a pure dict of ``target``'s ``kind`` state, as ``nnx.to_pure_dict`` gives it)
  with every array at its variable's home; ``values`` itself without a home mesh."""
  mesh = home_mesh(spec)
  if mesh is None:
    return values
  homes = {tuple(path): variable_spec(variable, copies, mesh, spec.stage_axis)
           for path, variable in nnx.to_flat_state(nnx.state(target, kind))}

  def pin(path, value):
    key = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)
    if key not in homes or not _is_array(value):
      return value
    return _at(value, NamedSharding(mesh, homes[key]))

  return jax.tree_util.tree_map_with_path(pin, values)
