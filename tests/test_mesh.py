"""tpipe.mesh: make_mesh's shapes and errors (one slice and several: stand-in TPU devices of
2 and 4 slices, emulated slices of CPU devices), the mesh a pipeline runs on (resolve) and the
stage-axis check, whose messages say where the mesh came from and which API was called."""

import dataclasses
import doctest

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import mesh_utils
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import tpipe
from tpipe import mesh as mesh_lib

pytestmark = pytest.mark.unit  # Meshes and messages: no JAX computation.


@pytest.mark.parametrize("stages,data", [(1, 1), (4, 1), (4, 2), (2, 4), (8, 1), (1, 8)])
def test_make_mesh_shapes(stages, data):
  mesh = tpipe.make_mesh(stages=stages, data=data)
  assert dict(mesh.shape) == {"data": data, "fsdp": 1, "stage": stages, "expert": 1,
                              "tensor": 1}
  # Slowest to fastest: tensor is the minor axis, then expert, then stage.
  assert mesh.axis_names == ("data", "fsdp", "stage", "expert", "tensor")
  assert mesh.axis_types == (AxisType.Auto,) * 5
  assert sorted(d.id for d in mesh.devices.flat) == [d.id for d in jax.devices()[:stages * data]]


@pytest.mark.parametrize("sizes", [dict(stages=2, fsdp=2, tensor=2), dict(stages=4, fsdp=2),
                                   dict(stages=2, tensor=2, data=2), dict(stages=1, fsdp=8)])
def test_make_mesh_with_fsdp_and_tensor(sizes):
  mesh = tpipe.make_mesh(**sizes)
  want = {"data": sizes.get("data", 1), "fsdp": sizes.get("fsdp", 1),
          "stage": sizes["stages"], "expert": 1, "tensor": sizes.get("tensor", 1)}
  assert dict(mesh.shape) == want
  assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_make_mesh_devices_and_axis_names():
  devices = jax.devices()[4:]
  mesh = tpipe.make_mesh(stages=2, data=2, devices=devices, stage_axis="pipe", data_axis="batch")
  assert dict(mesh.shape) == {"batch": 2, "fsdp": 1, "pipe": 2, "expert": 1, "tensor": 1}
  assert sorted(d.id for d in mesh.devices.flat) == [4, 5, 6, 7]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(stages=0), ValueError, r"^stages must be >= 1, got 0\.$"),
    (dict(stages=2, data=-1), ValueError, r"^data must be >= 1, got -1\.$"),
    (dict(stages=2.0), TypeError, r"^stages must be an int, got 2\.0\.$"),
    (dict(stages=2, data=True), TypeError, r"^data must be an int, got True\.$"),
    (dict(stages=2, stage_axis="x", data_axis="x"), ValueError,
     r"^stage_axis and data_axis must differ from each other and from 'fsdp', 'expert' and "
     r"'tensor'; "
     r"got stage_axis='x', data_axis='x'\.$"),
    (dict(stages=2, data_axis="fsdp"), ValueError, r"data_axis='fsdp'"),
    (dict(stages=2, tensor=0), ValueError, r"^tensor must be >= 1, got 0\.$"),
    (dict(stages=2, fsdp=2.0), TypeError, r"^fsdp must be an int, got 2\.0\.$"),
    (dict(stages=2, fsdp=2, tensor=4), ValueError,
     r"^A mesh of data=1 x fsdp=2 x stages=2 x tensor=4 needs 16 devices but 8"),
    (dict(stages=4, data=4), ValueError,
     r"^A mesh of data=4 x stages=4 needs 16 devices but 8 are available\. On CPU, emulate more "
     r"with JAX_NUM_CPU_DEVICES=8"),
    (dict(stages=2, data=2, devices=jax.devices()[:3]), ValueError,
     r"needs 4 devices but 3 are available"),
])
def test_make_mesh_errors_name_the_value_and_the_fix(kwargs, error, match):
  with pytest.raises(error, match=match):
    tpipe.make_mesh(**kwargs)


def test_data_sharding_and_the_single_device_mesh():
  mesh = tpipe.make_mesh(stages=4, data=2)
  assert tpipe.data_sharding(mesh).spec == P("data")
  # Rows split over fsdp too where it has more than one device.
  assert tpipe.data_sharding(tpipe.make_mesh(stages=2, data=2, fsdp=2)).spec == P(("data",
                                                                                   "fsdp"))
  assert tpipe.data_sharding(mesh, data_axis="stage").spec == P("stage")
  one = mesh_lib.single_device_mesh()
  assert dict(one.shape) == {"stage": 1} and one.devices.flat[0] == jax.devices()[0]
  assert tpipe.data_sharding(one).spec == P()  # No data axis: replicated.
  assert dict(mesh_lib.single_device_mesh("pipe").shape) == {"pipe": 1}


def test_the_batch_splits_over_stages_on_entering_the_pipeline_not_in_data_sharding():
  """The README's streamed inputs: ``data_sharding`` splits rows over ``data`` (and ``fsdp``)
  only; the pipeline's input spec adds ``stage`` where each row shard divides among them."""
  from tpipe.core.base import spmd  # pylint: disable=import-outside-toplevel

  mesh = tpipe.make_mesh(stages=4, data=2)
  assert "stage" not in jax.tree.leaves(tuple(tpipe.data_sharding(mesh).spec))
  axes = spmd.Axes.of(mesh, "stage", "data")
  assert axes.io_spec(16) == P(("data", "stage"))  # 16 rows: 2 per stage of each replica.
  assert axes.io_spec(4) == P("data")  # 2 rows per replica do not split over 4 stages.


def test_check_stage_axis_names_where_the_mesh_came_from():
  mesh = tpipe.make_mesh(stages=4, data=2)
  mesh_lib.check_stage_axis(mesh, 4, "stage", "the mesh given")
  mesh_lib.check_stage_axis(mesh.abstract_mesh, 4, "stage", "the mesh given")  # Abstract too.
  with pytest.raises(ValueError, match=r"^num_stages=2 but the 'stage' axis of the mesh passed "
                                       r"to tpipe\.Sequential has size 4; make them equal \(e\.g\. "
                                       r"tpipe\.make_mesh\(stages=2, \.\.\.\)\)\.$"):
    mesh_lib.check_stage_axis(mesh, 2, "stage", "the mesh passed to tpipe.Sequential")
  with pytest.raises(ValueError, match=r"^the mesh passed to tpipe\.nnx\.Sequential has axes "
                                       r"\('data', 'fsdp', 'stage', 'expert', 'tensor'\) but no "
                                       r"stage axis "
                                       r"'pipe'; build one "
                                       r"with tpipe\.make_mesh\(stages=4, data=\.\.\.\) or pass "
                                       r"stage_axis=<your axis name>\.$"):
    mesh_lib.check_stage_axis(mesh, 4, "pipe", "the mesh passed to tpipe.nnx.Sequential")


def test_resolve_the_mesh_given_the_ambient_one_or_one_device():
  mesh = tpipe.make_mesh(stages=4, data=2)
  assert mesh_lib.resolve(mesh, 4, "stage", "tpipe.Sequential") is mesh
  default = mesh_lib.resolve(None, 1, "stage", "tpipe.Sequential")
  assert dict(default.shape) == {"stage": 1}
  with jax.set_mesh(mesh):
    ambient = mesh_lib.resolve(None, 4, "stage", "tpipe.Sequential")
    assert dict(ambient.shape) == {"data": 2, "fsdp": 1, "stage": 4, "expert": 1,
                                   "tensor": 1}


@pytest.mark.parametrize("owner", ["tpipe.Sequential", "tpipe.nnx.Sequential", "tpipe.pipeline"])
def test_resolve_errors_name_the_api(owner):
  mesh = tpipe.make_mesh(stages=4, data=2)
  with pytest.raises(ValueError, match=rf"^num_stages=2 but the 'stage' axis of the mesh passed "
                                       rf"to {owner} has size 4"):
    mesh_lib.resolve(mesh, 2, "stage", owner)
  with pytest.raises(ValueError, match=rf"^num_stages=2 but the 'stage' axis of {owner}'s "
                                       rf"default 1-device mesh has size 1; make them equal"):
    mesh_lib.resolve(None, 2, "stage", owner)
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match=r"num_stages=2 but the 'stage' axis of the ambient "
                                         r"mesh \(jax\.set_mesh\) .*has size 4") as failure:
      mesh_lib.resolve(None, 2, "stage", owner)
  assert owner in str(failure.value)  # Which call found the ambient mesh wanting.


def test_a_front_end_called_without_a_fitting_mesh_says_so():
  model = tpipe.Sequential([nn.Dense(2), nn.Dense(2)], num_stages=2, num_microbatches=2)
  x = jnp.ones((4, 2))
  with pytest.raises(ValueError, match=r"num_stages=2 but the 'stage' axis of tpipe\.Sequential's "
                                       r"default 1-device mesh has size 1"):
    jax.eval_shape(lambda: model.init(jax.random.key(0), x))


def test_module_doctests_pass():
  result = doctest.testmod(mesh_lib)
  assert result.attempted >= 2 and result.failed == 0


def test_an_unknown_or_uncompilable_topology_names_the_fix():
  # Without the TPU compiler installed, or with it and a name it does not know: the same error.
  with pytest.raises(ValueError, match=r"Cannot describe the tpu topology 'v9z:1x1' .*"
                                       r"pip install -e '\.\[tpu\]'.*'v5p:2x2x2'"):
    tpipe.topology_devices("v9z:1x1")


# ------------------------------------------------------------------------------------------
# Meshes over several slices.

@dataclasses.dataclass(frozen=True)
class _StandInTpu:
  """What mesh building reads of a TPU device (not a tuple: numpy would unpack one)."""
  id: int
  platform: str
  device_kind: str
  process_index: int
  coords: tuple
  core_on_chip: int
  slice_index: int


def _stand_in_slices(num_slices: int, shape=(2, 2, 1)) -> list:
  """TPU v4 chips (one device each) of ``num_slices`` slices of ``shape``, as the slices'
  runtime reports them: ``slice_index`` and coordinates within the slice."""
  per_slice = int(np.prod(shape))
  devices = []
  for sl in range(num_slices):
    for i, coords in enumerate(np.ndindex(*shape[::-1])):
      devices.append(_StandInTpu(id=sl * per_slice + i, platform="tpu", device_kind="TPU v4",
                                 process_index=sl, coords=tuple(coords[::-1]), core_on_chip=0,
                                 slice_index=sl))
  return devices


@dataclasses.dataclass(eq=False)
class _StandInMesh:
  """What slice finding reads of a mesh (hashable by identity, as a Mesh)."""
  devices: np.ndarray
  axis_names: tuple


@dataclasses.dataclass(frozen=True)
class _TopologyTpu:
  """What ``jax.experimental.topologies`` describes of a TPU device of one slice: its host, no
  ``slice_index``."""
  id: int
  platform: str
  process_index: int


@pytest.mark.unit  # Stand-in devices: no JAX computation.
def test_the_hosts_of_one_slice_are_one_slice():
  # A topology of one slice over 4 hosts (two devices each): its stage links use the slice's
  # interconnect (no delay, nothing over the data-centre network); CPU processes stay slices.
  tpu = np.array([_TopologyTpu(i, "tpu", i // 2) for i in range(8)]).reshape(4, 2)
  cpu = np.array([_TopologyTpu(i, "cpu", i // 2) for i in range(8)]).reshape(4, 2)
  assert mesh_lib.crossing_links(_StandInMesh(tpu, ("stage", "data"))) == (False,) * 4
  assert mesh_lib.crossing_links(_StandInMesh(cpu, ("stage", "data"))) == (True,) * 4


def _slices_along(mesh, axis):
  """The slice of each position along ``axis``, or ValueError if it varies elsewhere."""
  slice_of = np.moveaxis(np.vectorize(lambda d: d.slice_index)(mesh.devices),
                         mesh.axis_names.index(axis), 0)
  return [sorted(set(slice_of[i].flat)) for i in range(slice_of.shape[0])]


@pytest.mark.parametrize("num_slices", [2, 4])
def test_the_stage_axis_over_slices_comes_first_with_each_slice_one_block(num_slices):
  devices = _stand_in_slices(num_slices)
  mesh = tpipe.make_mesh(stages=2 * num_slices, data=2, devices=devices,
                         dcn={"stage": num_slices})
  assert mesh.axis_names == ("stage", "data", "fsdp", "expert", "tensor")
  assert dict(mesh.shape) == {"stage": 2 * num_slices, "data": 2, "fsdp": 1,
                              "expert": 1, "tensor": 1}
  # Stages 2k and 2k + 1 on slice k; inside a slice, the topology's order as mesh_utils has it.
  assert _slices_along(mesh, "stage") == [[s // 2] for s in range(2 * num_slices)]
  expected = mesh_utils.create_hybrid_device_mesh((2, 2, 1, 1), (num_slices, 1, 1, 1), devices)
  assert [d.id for d in mesh.devices.flat] == [d.id for d in expected.flat]
  links = mesh_lib.crossing_links(mesh)
  assert links == tuple(s % 2 == 1 for s in range(2 * num_slices))


@pytest.mark.parametrize("num_slices", [2, 4])
def test_the_data_axis_over_slices_holds_one_replica_group_per_slice(num_slices):
  devices = _stand_in_slices(num_slices)
  mesh = tpipe.make_mesh(stages=4, data=num_slices, devices=devices,
                         dcn={"data": num_slices})
  assert mesh.axis_names == ("data", "fsdp", "stage", "expert", "tensor")
  assert _slices_along(mesh, "data") == [[k] for k in range(num_slices)]
  assert _slices_along(mesh, "stage") == [list(range(num_slices))] * 4  # all within slices
  assert mesh_lib.crossing_links(mesh) == (False,) * 4


def test_two_axes_over_slices_come_first_in_their_usual_order():
  mesh = tpipe.make_mesh(stages=4, data=2, fsdp=2, devices=_stand_in_slices(4, (2, 2, 2)),
                         dcn={"stage": 2, "data": 2})
  assert mesh.axis_names == ("data", "stage", "fsdp", "expert", "tensor")
  assert _slices_along(mesh, "data") == [[0, 1], [2, 3]]
  assert _slices_along(mesh, "stage") == [[0, 2], [0, 2], [1, 3], [1, 3]]


def test_emulated_slices_on_cpu_devices_are_remembered_for_the_mesh():
  devices = jax.devices()[:8]
  two = [devices[4:], devices[:4]]  # The second slice first: the grouping given is the order.
  mesh = tpipe.make_mesh(stages=4, data=2, dcn={"stage": 2}, slices=two)
  assert mesh.axis_names[0] == "stage"
  assert [d.id for d in mesh.devices[:2].flat] == [4, 5, 6, 7]
  slices = mesh_lib.slice_of_devices(mesh)
  assert slices.reshape(4, 2).tolist() == [[0, 0]] * 2 + [[1, 1]] * 2
  assert mesh_lib.crossing_links(mesh) == (False, True, False, True)
  # Without slices, one process: one slice, no link crosses.
  assert mesh_lib.crossing_links(tpipe.make_mesh(stages=4, data=2)) == (False,) * 4


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(stages=4, data=2, dcn={"stage": 4}), ValueError,
     r"dcn=\{'stage': 4\} spans 4 slice\(s\), but the devices are on 2; make the product"),
    (dict(stages=4, data=2, dcn={"pipe": 2}), ValueError,
     r"dcn names axis 'pipe', but the mesh's axes are "
     r"\('data', 'fsdp', 'stage', 'expert', 'tensor'\)"),
    (dict(stages=3, data=2, dcn={"stage": 2}), ValueError,
     r"dcn\['stage'\]=2 does not divide the 'stage' axis's size 3"),
    (dict(stages=2, tensor=4, dcn={"tensor": 2}), ValueError,
     r"tensor parallelism communicates inside every layer and must stay within a slice"),
    (dict(stages=2, expert=4, dcn={"expert": 2}), ValueError,
     r"expert parallelism communicates inside every layer and must stay within a slice"),
    (dict(stages=4, data=2, dcn={"stage": 0}), ValueError, r"dcn\['stage'\] must be an int >= 1"),
    (dict(stages=4, data=2, dcn=[("stage", 2)]), TypeError, r"dcn must be a dict"),
    (dict(stages=4, data=4, dcn={"stage": 2}), ValueError,
     r"Each slice must hold 8 devices .* but slice 0 has 4"),
    (dict(stages=8), ValueError, r"The devices span 2 slices but dcn=None puts the mesh on one; "
                                 r"say which axis crosses slices"),
])
def test_bad_slice_layouts_name_the_value_and_the_fix(kwargs, error, match):
  with pytest.raises(error, match=match):
    tpipe.make_mesh(devices=_stand_in_slices(2), **kwargs)


def test_slices_given_twice_is_an_error():
  devices = jax.devices()[:8]
  with pytest.raises(ValueError, match="lists a device more than once"):
    tpipe.make_mesh(stages=4, data=2, dcn={"stage": 2}, slices=[devices[:4], devices[:4]])


def test_an_expert_axis_sits_between_stage_and_tensor():
  mesh = tpipe.make_mesh(stages=2, expert=2, tensor=2)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "stage": 2, "expert": 2, "tensor": 2}
  # Each expert group holds devices of one stage: the tensor pairs inside it are neighbours.
  devices = np.vectorize(lambda d: d.id)(mesh.devices)[0, 0]
  np.testing.assert_array_equal(devices, [[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
  with pytest.raises(ValueError, match="expert must be >= 1, got 0"):
    tpipe.make_mesh(stages=2, expert=0)
  with pytest.raises(ValueError, match="stages=2 x expert=8 needs 16 devices"):
    tpipe.make_mesh(stages=2, expert=8)
