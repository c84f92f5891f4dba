"""Device meshes for pipelining: ``data`` replicas, ``fsdp``, ``expert`` and ``tensor`` shards,
``stage``s.

* ``stage``: one pipeline stage per position; the tick loops run manual over it.
* ``data``: data-parallel replicas, each with the whole (stage's) state; manual too.
* ``fsdp``: inside a stage, weights and optimizer state split over devices (ZeRO-3) and
  gathered one layer at a time; each micro-batch's rows split over it too. Left to XLA's
  partitioner (an auto axis of a partially manual ``shard_map``).
* ``expert``: inside a mixture-of-experts layer, its experts split (expert parallelism): a
  weight's dimension named ``expert`` goes to it; auto as well.
* ``tensor``: inside a layer, its matrices split (Megatron-style); auto as well.

:func:`make_mesh` builds one; :func:`resolve` finds the mesh a pipeline runs on (the one given,
the ambient one, or one device) and checks its stage axis, naming the API the user called.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

STAGE_AXIS = "stage"
DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"


def make_mesh(stages: int, data: int = 1, *, fsdp: int = 1, expert: int = 1, tensor: int = 1,
              devices=None,
              dcn: Mapping[str, int] | None = None, slices=None,
              stage_axis: str = STAGE_AXIS,
              data_axis: str = DATA_AXIS) -> Mesh:  # The public mesh API: one setting per axis.
  """A ``(data, fsdp, stage, expert, tensor)`` mesh over the first
  ``data * fsdp * stages * expert * tensor`` devices.

  Axes run from the slowest-changing to the fastest: ``tensor`` is the minor axis (its
  collectives run inside every layer, so its devices are nearest on the interconnect), then
  ``expert`` (an all-to-all per mixture-of-experts layer), ``stage`` (a send per tick to a
  neighbour), ``fsdp`` (a gather per layer), and ``data`` (one gradient reduction per step).
  ``jax.make_mesh`` orders the devices by the TPU topology, so each axis's groups are valid
  sub-slices. Axes of size 1 are kept: every mesh has all five names, so shardings and rules
  can name them whatever the sizes.

  Args:
    stages: devices per pipeline (size of the ``stage`` axis).
    data: data-parallel replicas (size of the ``data`` axis).
    fsdp: devices each stage's weights and optimizer state are split over (``fsdp`` axis).
    expert: devices a mixture-of-experts layer's experts are split over (``expert`` axis).
    tensor: devices each layer's matrices are split over (``tensor`` axis).
    devices: devices to use; default ``jax.devices()``.
    dcn: for a job over several slices (multislice TPU, several GPU hosts): how many slices each
      axis spans, by axis name, e.g. ``{"stage": 2}`` (the pipeline's two halves on two slices,
      only stage-boundary activations cross the data-centre network) or ``{"data": 4}``. The
      product is the number of slices; each axis's size counts all its devices and must divide
      by its entry. Axes that cross slices come first in the mesh, slowest-changing (XLA needs
      the cross-slice axis outermost), and within each such axis the slice changes slowest, so
      every slice holds one contiguous block of it. ``expert`` and ``tensor`` never cross
      slices. ``None``
      or all ones: one slice.
    slices: which devices form each slice, as a list of device lists; default: the devices'
      ``slice_index`` (TPU), else their ``process_index`` (one granule per host, as
      ``mesh_utils`` does for GPUs). Give it to emulate slices, e.g. 8 CPU devices as two
      slices of 4; the grouping is remembered for the mesh (:func:`slice_of_devices`) until
      ``make_mesh`` builds the same mesh (JAX hands out one object per mesh) without it.
    stage_axis: name of the stage axis.
    data_axis: name of the data axis.

  Returns:
    A ``jax.sharding.Mesh`` with Auto axis types.

  Example::

    >>> mesh = make_mesh(stages=2, data=2, fsdp=2)
    >>> dict(mesh.shape)
    {'data': 2, 'fsdp': 2, 'stage': 2, 'expert': 1, 'tensor': 1}
    >>> two = [jax.devices()[:4], jax.devices()[4:8]]   # two emulated slices
    >>> mesh = make_mesh(stages=4, data=2, dcn={"stage": 2}, slices=two)
    >>> mesh.axis_names
    ('stage', 'data', 'fsdp', 'expert', 'tensor')
    >>> crossing_links(mesh)   # link s joins stage s to s + 1 (the last one wraps)
    (False, True, False, True)

  Raises:
    TypeError / ValueError: a size is not a positive int, the devices are too few, ``dcn``
      names an axis the mesh does not have or does not divide its size, or the devices span a
      different number of slices than ``dcn`` says.
  """
  for name, value in (("stages", stages), ("data", data), ("fsdp", fsdp), ("expert", expert),
                      ("tensor", tensor)):
    if isinstance(value, bool) or not isinstance(value, int):
      raise TypeError(f"{name} must be an int, got {value!r}.")
    if value < 1:
      raise ValueError(f"{name} must be >= 1, got {value}.")
  names = (data_axis, FSDP_AXIS, stage_axis, EXPERT_AXIS, TENSOR_AXIS)
  if len(set(names)) < len(names):
    raise ValueError(f"stage_axis and data_axis must differ from each other and from "
                     f"{FSDP_AXIS!r}, {EXPERT_AXIS!r} and {TENSOR_AXIS!r}; got "
                     f"stage_axis={stage_axis!r}, "
                     f"data_axis={data_axis!r}.")
  devices = list(jax.devices() if devices is None else devices)
  needed = stages * data * fsdp * expert * tensor
  sizes = dict(zip(names, (data, fsdp, stages, expert, tensor)))
  spans = _check_dcn(dcn, sizes, stage_axis, data_axis)
  if math.prod(spans.values()) > 1 or slices is not None:
    mesh = _hybrid_mesh(sizes, spans, _slice_groups(devices, slices))
    if slices is not None:
      _DECLARED_SLICES[mesh] = {d.id: i for i, group in enumerate(slices) for d in group}
    return mesh
  spanned = {d.slice_index for d in devices[:needed] if hasattr(d, "slice_index")}
  if len(spanned) > 1:
    raise ValueError(
        f"The devices span {len(spanned)} slices but dcn={dcn!r} puts "
        "the mesh on one; say which axis crosses slices, e.g. "
        f"tpipe.make_mesh(..., dcn={{{stage_axis!r}: <slices>}}) or "
        f"dcn={{{data_axis!r}: <slices>}}.")
  if needed > len(devices):
    named = (("data", data), ("fsdp", fsdp), ("stages", stages), ("expert", expert),
             ("tensor", tensor))
    sizes = " x ".join(f"{n}={v}" for n, v in named if v > 1 or n in ("data", "stages"))
    raise ValueError(
        f"A mesh of {sizes} needs {needed} devices but {len(devices)} are "
        "available. On CPU, emulate more with JAX_NUM_CPU_DEVICES=8 (or "
        "jax.config.update('jax_num_cpu_devices', 8) before the first JAX call).")
  shape, types = (data, fsdp, stages, expert, tensor), (AxisType.Auto,) * 5
  try:
    mesh = jax.make_mesh(shape, names, axis_types=types, devices=devices[:needed])
  except NotImplementedError:
    # A TPU torus whose physical axes no product of mesh axes matches (tensor = 2 on a 4x4x4
    # slice): split physical axes, as mesh_utils allows when asked.
    from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top

    grid = mesh_utils.create_device_mesh(shape, devices[:needed],
                                         allow_split_physical_axes=True)
    mesh = Mesh(grid, names, axis_types=types)
  # JAX hands out one object per mesh: built here on one slice, it forgets emulated slices an
  # earlier call declared for the same devices in the same order.
  _DECLARED_SLICES.pop(mesh, None)
  return mesh


# Meshes whose slices were given explicitly (emulated): mesh -> {device id: slice}.
_DECLARED_SLICES: dict = {}


def _check_dcn(dcn, sizes: dict, stage_axis: str, data_axis: str) -> dict:
  """``dcn`` as ``{axis: slices}`` for every axis (1 where absent), validated."""
  if dcn is None:
    dcn = {}
  if not isinstance(dcn, Mapping):
    raise TypeError(f"dcn must be a dict from axis name to slices, e.g. {{{stage_axis!r}: 2}}; "
                    f"got {dcn!r}.")
  spans = dict.fromkeys(sizes, 1)
  for axis, count in dcn.items():
    if axis not in sizes:
      raise ValueError(f"dcn names axis {axis!r}, but the mesh's axes are {tuple(sizes)}; name "
                       f"one of them, e.g. dcn={{{stage_axis!r}: 2}}.")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
      raise ValueError(f"dcn[{axis!r}] must be an int >= 1 (slices the axis spans), got "
                       f"{count!r}.")
    if axis in (EXPERT_AXIS, TENSOR_AXIS) and count > 1:
      raise ValueError(f"dcn[{axis!r}]={count}: {axis} parallelism communicates inside "
                       "every layer and must stay within a slice; span slices with "
                       f"{stage_axis!r}, {data_axis!r} or {FSDP_AXIS!r} instead.")
    if sizes[axis] % count:
      raise ValueError(f"dcn[{axis!r}]={count} does not divide the {axis!r} axis's size "
                       f"{sizes[axis]}; each slice must hold an equal share of it.")
    spans[axis] = count
  return spans


def _slice_key(device):
  """The slice a device is on: its ``slice_index`` (TPU), else its process (one host). A TPU
  device without one (a topology's description of one slice, ``topology_devices``) is on the
  one slice: its hosts share the slice's interconnect, not the data-centre network."""
  index = getattr(device, "slice_index", None)
  if index is not None:
    return index
  return 0 if device.platform == "tpu" else device.process_index


def _slice_groups(devices: list, slices) -> list[list]:
  """The devices grouped by slice: ``slices`` as given, else by :func:`_slice_key`."""
  if slices is None:
    groups: dict = {}
    for device in devices:
      groups.setdefault(_slice_key(device), []).append(device)
    return [groups[key] for key in sorted(groups)]
  groups = [list(group) for group in slices]
  flat = [d for group in groups for d in group]
  if len(set(flat)) != len(flat):
    raise ValueError("slices lists a device more than once; give each slice its own devices.")
  return groups


def _hybrid_mesh(sizes: dict, spans: dict, groups: list[list]) -> Mesh:
  """A mesh over several slices: in each slice a mesh of the per-slice sizes (the topology's
  device order, as ``mesh_utils.create_device_mesh`` gives it), the slices laid out as blocks
  along the axes that cross them, and those axes first."""
  from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top

  count = math.prod(spans.values())
  if len(groups) != count:
    raise ValueError(
        f"dcn={ {a: n for a, n in spans.items() if n > 1} } spans {count} slice(s), but the "
        f"devices are on {len(groups)}; make the product of the dcn entries equal the number of "
        "slices (or pass slices= to group the devices yourself).")
  order = sorted(sizes, key=lambda a: spans[a] == 1)  # Stable: crossing axes first, in order.
  inner = [sizes[a] // spans[a] for a in order]
  per_slice = math.prod(inner)
  short = [i for i, group in enumerate(groups) if len(group) < per_slice]
  if short:
    raise ValueError(
        f"Each slice must hold {per_slice} devices (the mesh's sizes "
        f"{ {a: sizes[a] for a in order} } over dcn { {a: spans[a] for a in order} }), but "
        f"slice {short[0]} has {len(groups[short[0]])}; use fewer devices per slice or more "
        "slices.")
  blocks = []
  for group in groups:
    try:
      block = mesh_utils.create_device_mesh(inner, group[:per_slice])
    except NotImplementedError:
      block = mesh_utils.create_device_mesh(inner, group[:per_slice],
                                            allow_split_physical_axes=True)
    blocks.append(block)
  grid = np.empty([spans[a] for a in order], object)
  for index, block in zip(np.ndindex(grid.shape), blocks):
    grid[index] = block
  devices = np.block(grid.tolist()) if grid.ndim else blocks[0]
  return Mesh(devices, tuple(order), axis_types=(AxisType.Auto,) * len(order))


def slice_of_devices(mesh) -> np.ndarray:
  """The slice of every device of ``mesh``, shaped like ``mesh.devices``: the grouping
  :func:`make_mesh` was given (``slices=``), else each device's ``slice_index``, else its
  process."""
  declared = _DECLARED_SLICES.get(mesh)
  if declared is not None:
    return np.vectorize(lambda d: declared[d.id], otypes=[int])(mesh.devices)
  keys = np.vectorize(_slice_key, otypes=[object])(mesh.devices)
  ranks = {k: i for i, k in enumerate(sorted(set(keys.flat)))}
  return np.vectorize(ranks.get, otypes=[int])(keys)


def crossing_links(mesh, stage_axis: str = STAGE_AXIS) -> tuple[bool, ...]:
  """Per link of the stage ring, whether it crosses slices (the data-centre network).

  Link ``s`` joins stage ``s`` to stage ``s + 1``; the last joins stage ``S - 1`` to stage 0
  (what circular and V-shaped schedules use). A link crosses when, anywhere along the other
  axes, its two stages' devices are on different slices.
  """
  axis = tuple(mesh.axis_names).index(stage_axis)
  slice_of = np.moveaxis(slice_of_devices(mesh), axis, 0)
  num_stages = slice_of.shape[0]
  return tuple(bool(np.any(slice_of[s] != slice_of[(s + 1) % num_stages]))
               for s in range(num_stages))


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


def topology_devices(topology: str, platform: str = "tpu", *, num_slices: int = 1) -> list:
  """The devices of an accelerator topology this machine need not have, to compile for it.

  ``jax.experimental.topologies`` describes a slice (``"v5p:2x2x2"``: 8 TPU v5p chips) with
  the target's own compiler (libtpu for TPUs); a mesh over these devices lowers and compiles
  (``jax.jit(...).lower(...).compile()``, ``memory_analysis()``) as on the slice, but runs
  nothing. Example: ``make_mesh(stages=4, data=2, devices=topology_devices("v5p:2x2x2"))``.

  Args:
    topology: a topology name as ``get_topology_desc`` takes it, e.g. ``"v5p:2x2x2"``,
      ``"v5e:4x4"``, ``"v4:2x2x1"``.
    platform: the platform of the topology.
    num_slices: how many such slices (a multislice job); their devices carry ``slice_index``,
      so ``make_mesh(..., dcn=...)`` lays axes over them as on the real job.

  Raises:
    ValueError: the compiler for ``platform`` is not installed, or it does not know
      ``topology``.
  """
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  try:
    extra = {"num_slices": num_slices} if num_slices != 1 else {}
    return list(topologies.get_topology_desc(platform=platform, topology_name=topology,
                                             **extra).devices)
  except Exception as error:  # The plugin raises RuntimeError/ValueError/XlaRuntimeError.
    hint = ("install the TPU compiler (libtpu) with pip install -e '.[tpu]'"
            if platform == "tpu" else f"install the {platform} plugin")
    fix = f"{hint}, and name a topology as 'v5p:2x2x2' or 'v5e:4x4'"
    if "lockfile" in str(error):
      fix = ("another process has libtpu loaded: to compile from several processes at once, set "
             "ALLOW_MULTIPLE_LIBTPU_LOAD=1 in each before it loads libtpu")
    raise ValueError(f"Cannot describe the {platform} topology {topology!r} ({error}); "
                     f"{fix}.") from None
