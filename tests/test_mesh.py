"""tpipe.mesh: make_mesh's shapes and errors, the mesh a pipeline runs on (resolve) and the
stage-axis check, whose messages say where the mesh came from and which API was called."""

import doctest

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import tpipe
from tpipe import mesh as mesh_lib

pytestmark = pytest.mark.unit  # Meshes and messages: no JAX computation.


@pytest.mark.parametrize("stages,data", [(1, 1), (4, 1), (4, 2), (2, 4), (8, 1), (1, 8)])
def test_make_mesh_shapes(stages, data):
  mesh = tpipe.make_mesh(stages=stages, data=data)
  assert dict(mesh.shape) == {"data": data, "fsdp": 1, "stage": stages, "tensor": 1}
  # Slowest to fastest: tensor is the minor axis, then stage.
  assert mesh.axis_names == ("data", "fsdp", "stage", "tensor")
  assert mesh.axis_types == (AxisType.Auto,) * 4
  assert sorted(d.id for d in mesh.devices.flat) == [d.id for d in jax.devices()[:stages * data]]


@pytest.mark.parametrize("sizes", [dict(stages=2, fsdp=2, tensor=2), dict(stages=4, fsdp=2),
                                   dict(stages=2, tensor=2, data=2), dict(stages=1, fsdp=8)])
def test_make_mesh_with_fsdp_and_tensor(sizes):
  mesh = tpipe.make_mesh(**sizes)
  want = {"data": sizes.get("data", 1), "fsdp": sizes.get("fsdp", 1),
          "stage": sizes["stages"], "tensor": sizes.get("tensor", 1)}
  assert dict(mesh.shape) == want
  assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_make_mesh_devices_and_axis_names():
  devices = jax.devices()[4:]
  mesh = tpipe.make_mesh(stages=2, data=2, devices=devices, stage_axis="pipe", data_axis="batch")
  assert dict(mesh.shape) == {"batch": 2, "fsdp": 1, "pipe": 2, "tensor": 1}
  assert sorted(d.id for d in mesh.devices.flat) == [4, 5, 6, 7]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(stages=0), ValueError, r"^stages must be >= 1, got 0\.$"),
    (dict(stages=2, data=-1), ValueError, r"^data must be >= 1, got -1\.$"),
    (dict(stages=2.0), TypeError, r"^stages must be an int, got 2\.0\.$"),
    (dict(stages=2, data=True), TypeError, r"^data must be an int, got True\.$"),
    (dict(stages=2, stage_axis="x", data_axis="x"), ValueError,
     r"^stage_axis and data_axis must differ from each other and from 'fsdp' and 'tensor'; "
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


def test_check_stage_axis_names_where_the_mesh_came_from():
  mesh = tpipe.make_mesh(stages=4, data=2)
  mesh_lib.check_stage_axis(mesh, 4, "stage", "the mesh given")
  mesh_lib.check_stage_axis(mesh.abstract_mesh, 4, "stage", "the mesh given")  # Abstract too.
  with pytest.raises(ValueError, match=r"^num_stages=2 but the 'stage' axis of the mesh passed "
                                       r"to tpipe\.Sequential has size 4; make them equal \(e\.g\. "
                                       r"tpipe\.make_mesh\(stages=2, \.\.\.\)\)\.$"):
    mesh_lib.check_stage_axis(mesh, 2, "stage", "the mesh passed to tpipe.Sequential")
  with pytest.raises(ValueError, match=r"^the mesh passed to tpipe\.nnx\.Sequential has axes "
                                       r"\('data', 'fsdp', 'stage', 'tensor'\) but no stage axis "
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
    assert dict(ambient.shape) == {"data": 2, "fsdp": 1, "stage": 4, "tensor": 1}


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
