"""Device meshes for pipelining: ``data`` replicas, ``fsdp`` and ``tensor`` shards, ``stage``s.

* ``stage``: one pipeline stage per position; the tick loops run manual over it.
* ``data``: data-parallel replicas, each with the whole (stage's) state; manual too.
* ``fsdp``: inside a stage, weights and optimizer state split over devices (ZeRO-3) and
  gathered one layer at a time; each micro-batch's rows split over it too. Left to XLA's
  partitioner (an auto axis of a partially manual ``shard_map``).
* ``tensor``: inside a layer, its matrices split (Megatron-style); auto as well.

:func:`make_mesh` builds one; :func:`resolve` finds the mesh a pipeline runs on (the one given,
the ambient one, or one device) and checks its stage axis, naming the API the user called.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

STAGE_AXIS = "stage"
DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
TENSOR_AXIS = "tensor"


def make_mesh(stages: int, data: int = 1, *, fsdp: int = 1, tensor: int = 1, devices=None,
              stage_axis: str = STAGE_AXIS, data_axis: str = DATA_AXIS) -> Mesh:
  """A ``(data, fsdp, stage, tensor)`` mesh over the first ``data * fsdp * stages * tensor``
  devices.

  Axes run from the slowest-changing to the fastest: ``tensor`` is the minor axis (its
  collectives run inside every layer, so its devices are nearest on the interconnect), then
  ``stage`` (a send per tick to a neighbour), ``fsdp`` (a gather per layer), and ``data``
  (one gradient reduction per step). ``jax.make_mesh`` orders the devices by the TPU topology,
  so each axis's groups are valid sub-slices. Axes of size 1 are kept: every mesh has all four
  names, so shardings and rules can name them whatever the sizes.

  Args:
    stages: devices per pipeline (size of the ``stage`` axis).
    data: data-parallel replicas (size of the ``data`` axis).
    fsdp: devices each stage's weights and optimizer state are split over (``fsdp`` axis).
    tensor: devices each layer's matrices are split over (``tensor`` axis).
    devices: devices to use; default ``jax.devices()``.
    stage_axis: name of the stage axis.
    data_axis: name of the data axis.

  Returns:
    A ``jax.sharding.Mesh`` with Auto axis types.

  Example::

    >>> mesh = make_mesh(stages=2, data=2, fsdp=2)
    >>> dict(mesh.shape)
    {'data': 2, 'fsdp': 2, 'stage': 2, 'tensor': 1}
  """
  for name, value in (("stages", stages), ("data", data), ("fsdp", fsdp), ("tensor", tensor)):
    if isinstance(value, bool) or not isinstance(value, int):
      raise TypeError(f"{name} must be an int, got {value!r}.")
    if value < 1:
      raise ValueError(f"{name} must be >= 1, got {value}.")
  names = (data_axis, FSDP_AXIS, stage_axis, TENSOR_AXIS)
  if len(set(names)) < len(names):
    raise ValueError(f"stage_axis and data_axis must differ from each other and from "
                     f"{FSDP_AXIS!r} and {TENSOR_AXIS!r}; got stage_axis={stage_axis!r}, "
                     f"data_axis={data_axis!r}.")
  devices = list(jax.devices() if devices is None else devices)
  needed = stages * data * fsdp * tensor
  if needed > len(devices):
    named = (("data", data), ("fsdp", fsdp), ("stages", stages), ("tensor", tensor))
    sizes = " x ".join(f"{n}={v}" for n, v in named if v > 1 or n in ("data", "stages"))
    raise ValueError(
        f"A mesh of {sizes} needs {needed} devices but {len(devices)} are "
        "available. On CPU, emulate more with JAX_NUM_CPU_DEVICES=8 (or "
        "jax.config.update('jax_num_cpu_devices', 8) before the first JAX call).")
  shape, types = (data, fsdp, stages, tensor), (AxisType.Auto,) * 4
  try:
    return jax.make_mesh(shape, names, axis_types=types, devices=devices[:needed])
  except NotImplementedError:
    # A TPU torus whose physical axes no product of mesh axes matches (tensor = 2 on a 4x4x4
    # slice): split physical axes, as mesh_utils allows when asked.
    from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top

    grid = mesh_utils.create_device_mesh(shape, devices[:needed],
                                         allow_split_physical_axes=True)
    return Mesh(grid, names, axis_types=types)


def batch_axes(mesh, data_axis: str = DATA_AXIS) -> tuple[str, ...]:
  """The mesh axes a batch's rows are split over: ``data``, then ``fsdp`` where it has more
  than one device (each FSDP shard computes on its own rows, as in ZeRO-3)."""
  shape = dict(mesh.shape)
  axes = [data_axis] if data_axis in shape else []
  if shape.get(FSDP_AXIS, 1) > 1:
    axes.append(FSDP_AXIS)
  return tuple(axes)


def data_sharding(mesh: Mesh, data_axis: str = DATA_AXIS) -> NamedSharding:
  """Sharding for a batch: axis 0 split over the data axis and, where the mesh has more than
  one, the fsdp axis (replicated if there is neither)."""
  axes = batch_axes(mesh, data_axis)
  if not axes:
    return NamedSharding(mesh, P())
  return NamedSharding(mesh, P(axes if len(axes) > 1 else axes[0]))


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
    fix = f"{hint}, and name a topology as 'v5p:2x2x2' or 'v5e:4x4'"
    if "lockfile" in str(error):
      fix = ("another process has libtpu loaded: to compile from several processes at once, set "
             "ALLOW_MULTIPLE_LIBTPU_LOAD=1 in each before it loads libtpu")
    raise ValueError(f"Cannot describe the {platform} topology {topology!r} ({error}); "
                     f"{fix}.") from None
