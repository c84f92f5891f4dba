"""Device meshes for pipelining: a ``data`` axis of replicas and a ``stage`` axis of stages.

:func:`make_mesh` builds one; :func:`resolve` finds the mesh a pipeline runs on (the one given,
the ambient one, or one device) and checks its stage axis, naming the API the user called.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

STAGE_AXIS = "stage"
DATA_AXIS = "data"


def make_mesh(stages: int, data: int = 1, *, devices=None, stage_axis: str = STAGE_AXIS,
              data_axis: str = DATA_AXIS) -> Mesh:
  """A ``(data, stage)`` mesh over the first ``data * stages`` devices.

  The stage axis is the minor one, so on TPU the stages of one replica are neighbours on the
  interconnect (``jax.make_mesh`` orders devices by topology) and stage-to-stage sends are short.

  Args:
    stages: devices per pipeline (size of the ``stage`` axis).
    data: data-parallel replicas (size of the ``data`` axis).
    devices: devices to use; default ``jax.devices()``.
    stage_axis: name of the stage axis.
    data_axis: name of the data axis.

  Returns:
    A ``jax.sharding.Mesh`` with Auto axis types.

  Example::

    >>> mesh = make_mesh(stages=4, data=2)
    >>> dict(mesh.shape)
    {'data': 2, 'stage': 4}
  """
  for name, value in (("stages", stages), ("data", data)):
    if isinstance(value, bool) or not isinstance(value, int):
      raise TypeError(f"{name} must be an int, got {value!r}.")
    if value < 1:
      raise ValueError(f"{name} must be >= 1, got {value}.")
  if stage_axis == data_axis:
    raise ValueError(f"stage_axis and data_axis must differ, both are {stage_axis!r}.")
  devices = list(jax.devices() if devices is None else devices)
  needed = stages * data
  if needed > len(devices):
    raise ValueError(
        f"A mesh of data={data} x stages={stages} needs {needed} devices but {len(devices)} are "
        "available. On CPU, emulate more with JAX_NUM_CPU_DEVICES=8 (or "
        "jax.config.update('jax_num_cpu_devices', 8) before the first JAX call).")
  return jax.make_mesh((data, stages), (data_axis, stage_axis),
                       axis_types=(AxisType.Auto, AxisType.Auto), devices=devices[:needed])


def data_sharding(mesh: Mesh, data_axis: str = DATA_AXIS) -> NamedSharding:
  """Sharding for a batch: axis 0 split over the data axis (replicated if there is none)."""
  if data_axis in mesh.axis_names:
    return NamedSharding(mesh, P(data_axis))
  return NamedSharding(mesh, P())


def single_device_mesh(stage_axis: str = STAGE_AXIS) -> Mesh:
  """A one-device mesh with only a stage axis: what ``mesh=None`` means without an ambient mesh."""
  return jax.make_mesh((1,), (stage_axis,), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:1])


def check_stage_axis(mesh, num_stages: int, stage_axis: str, origin: str) -> None:
  """Raises ValueError unless ``mesh`` has ``stage_axis`` of size ``num_stages``.

  Args:
    mesh: a ``Mesh`` or ``AbstractMesh``.
    num_stages: the pipeline's stage count.
    stage_axis: the stage axis name.
    origin: where the mesh came from, for the message (``"the mesh passed to
      tpipe.Sequential"``).
  """
  shape = dict(mesh.shape)
  if stage_axis not in shape:
    raise ValueError(
        f"{origin} has axes {tuple(shape)} but no stage axis {stage_axis!r}; build one with "
        f"tpipe.make_mesh(stages={num_stages}, data=...) or pass stage_axis=<your axis name>.")
  if shape[stage_axis] != num_stages:
    raise ValueError(
        f"num_stages={num_stages} but the {stage_axis!r} axis of {origin} has size "
        f"{shape[stage_axis]}; make them equal (e.g. tpipe.make_mesh(stages={num_stages}, ...)).")


def resolve(mesh: Mesh | None, num_stages: int, stage_axis: str, owner: str):
  """The mesh to run on: ``mesh``, else the ambient one (``jax.set_mesh``), else one device;
  checked by :func:`check_stage_axis` with messages naming ``owner`` (the API called)."""
  if mesh is None:
    ambient = jax.sharding.get_abstract_mesh()
    if ambient.empty:
      mesh, origin = single_device_mesh(stage_axis), f"{owner}'s default 1-device mesh"
    else:
      mesh, origin = ambient, f"the ambient mesh (jax.set_mesh) that {owner} found"
  else:
    origin = f"the mesh passed to {owner}"
  check_stage_axis(mesh, num_stages, stage_axis, origin)
  return mesh


def topology_devices(topology: str, platform: str = "tpu") -> list:
  """The devices of an accelerator topology this machine need not have, to compile for it.

  ``jax.experimental.topologies`` describes a slice (``"v5p:2x2x2"``: 8 TPU v5p chips) with
  the target's own compiler (libtpu for TPUs); a mesh over these devices lowers and compiles
  (``jax.jit(...).lower(...).compile()``, ``memory_analysis()``) as on the slice, but runs
  nothing. Example: ``make_mesh(stages=4, data=2, devices=topology_devices("v5p:2x2x2"))``.

  Args:
    topology: a topology name as ``get_topology_desc`` takes it, e.g. ``"v5p:2x2x2"``,
      ``"v5e:4x4"``, ``"v4:2x2x1"``.
    platform: the platform of the topology.

  Raises:
    ValueError: the compiler for ``platform`` is not installed, or it does not know
      ``topology``.
  """
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  try:
    return list(topologies.get_topology_desc(platform=platform,
                                             topology_name=topology).devices)
  except Exception as error:  # The plugin raises RuntimeError/ValueError/XlaRuntimeError.
    hint = ("install the TPU compiler (libtpu) with pip install -e '.[tpu]'"
            if platform == "tpu" else f"install the {platform} plugin")
    raise ValueError(f"Cannot describe the {platform} topology {topology!r} ({error}); "
                     f"{hint}, and name a topology as 'v5p:2x2x2' or 'v5e:4x4'.") from None
