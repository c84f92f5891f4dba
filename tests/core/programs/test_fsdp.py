"""tpipe.core.programs.fsdp: which staged weights split over ``fsdp`` (:class:`Split`), and the
gathers that
make a unit's weights whole, whose transposes leave each device its piece of the gradient summed
over the group."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import tpipe
from tests.helpers import core_layers as cl
from tpipe.core.layout import packed_places as places
from tpipe.core.programs import fsdp


def _path(*keys):
  return tuple(jax.tree_util.DictKey(k) for k in keys)


@pytest.mark.unit
def test_split_of_hand_written_specs():
  specs = {
      "stacked": {"layers_3": {"w": P(None, "stage", None, None, "fsdp"), "b": P(None, "stage")}},
      "packed": {"float32": P(None, "stage"), "bfloat16": P(None, "stage", "fsdp")},
      "shared": {"shared_0": P(None, "stage", "fsdp"),
                 "shared_1": P(None, "stage", None, ("fsdp", "tensor"))},
  }
  split = fsdp.Split.of(specs, "fsdp")
  assert split.stacked == {"layers_3": {"['w']": 1, "['b']": fsdp.NOT_SPLIT}}
  assert split.packed == {"float32": False, "bfloat16": True}
  assert split.shared == {"shared_0": 0, "shared_1": 1}
  assert split.is_split(_path("stacked", "layers_3", "w"))
  assert not split.is_split(_path("stacked", "layers_3", "b"))
  assert split.is_split(_path("packed", "bfloat16"))
  assert not split.is_split(_path("packed", "float32"))
  assert split.is_split(_path("shared", "shared_1"))


def test_split_of_a_pipeline_on_an_fsdp_mesh():
  mesh = tpipe.make_mesh(stages=2, fsdp=2)
  spec = tpipe.PipelineSpec(num_stages=2, num_microbatches=2, schedule="1f1b", balance=[3, 3],
                            per_example=("targets",), mesh=mesh)
  layout = cl.build(spec).layout
  split = fsdp.Split.of(layout.partition_specs("stage", mesh=mesh), "fsdp")
  # The block's [4, 4] kernel and [4] scale split on their first dimension; the packed buffer
  # (projection and loss) in 2 blocks, each leaf cut into pieces.
  assert split.stacked == {"layers_1": {"['kernel']": 0, "['scale']": 0}}
  assert split.packed == {"float32": True} and split.shared == {}
  assert layout.packed_shards == 2
  assert layout.piece_dims(0) == [{"bias": 0, "kernel": 1}]


def _on_fsdp(fn, *pieces):
  """``fn`` per device of a 2-device fsdp axis, each given its piece (leading axis) of each of
  ``pieces``; the results stacked per device."""
  mesh = tpipe.make_mesh(stages=1, fsdp=2)
  lead = lambda tree: jax.tree.map(lambda a: a[None], tree)
  run = jax.shard_map(lambda *p: lead(fn(*jax.tree.map(lambda a: a[0], p))), mesh=mesh,
                      in_specs=P("fsdp"), out_specs=P("fsdp"))
  return jax.jit(run)(*pieces)


@pytest.mark.parametrize("shape,dim", [((3, 4), 1), ((4, 3), 0), ((5, 3), places.FLAT)])
def test_gather_piece_makes_the_leaf_whole_on_every_device(shape, dim):
  split = fsdp.Split(axis="fsdp", stacked={}, packed={})
  leaf = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
  pieces = places.cut_pieces(leaf, dim, 2)
  whole = _on_fsdp(lambda piece: split.gather_piece(piece, dim, shape), pieces)
  assert whole.shape == (2,) + shape
  np.testing.assert_array_equal(whole[0], leaf)
  np.testing.assert_array_equal(whole[1], leaf)


def test_gather_transposes_to_the_piece_gradient_summed_over_the_group():
  split = fsdp.Split(axis="fsdp", stacked={}, packed={})
  pieces = places.cut_pieces(jnp.ones((4, 2)), 0, 2)

  def grad(piece):
    weight = jax.lax.axis_index("fsdp") + 1.0  # Device f uses the whole leaf f + 1 times.
    return jax.grad(lambda p: jnp.sum(split.gather_piece(p, 0, (4, 2)) * weight))(piece)

  np.testing.assert_array_equal(_on_fsdp(grad, pieces), np.full((2, 2, 2), 3.0))


def test_gather_unit_and_packed():
  split = fsdp.Split(axis="fsdp", stacked={"layers_1": {"['w']": 1, "['b']": fsdp.NOT_SPLIT}},
                     packed={"float32": True, "int32": False})
  w = jnp.arange(3 * 2 * 4, dtype=jnp.float32).reshape(3, 2, 4)  # [copies, 2, 4]
  b = jnp.arange(6.0).reshape(2, 3)  # Not split: each device holds it whole.
  w_pieces = jnp.stack(jnp.split(w, 2, axis=2))  # One copy's dimension 1 split.

  def unit(w_piece):
    gathered = split.gather_unit("layers_1", {"w": w_piece, "b": b}, copy_axis=True)
    return gathered["w"], gathered["b"]

  whole_w, whole_b = _on_fsdp(unit, w_pieces)
  np.testing.assert_array_equal(whole_w[1], w)
  np.testing.assert_array_equal(whole_b[0], b)
  buffers = {"float32": jnp.arange(8.0).reshape(2, 4), "int32": jnp.zeros((2, 3), jnp.int32)}
  packed = _on_fsdp(lambda f, i: split.gather_packed({"packed": {"float32": f, "int32": i}}),
                    buffers["float32"], buffers["int32"])["packed"]
  np.testing.assert_array_equal(packed["float32"][0], np.arange(8.0))  # Gathered whole.
  assert packed["int32"].shape == (2, 3)  # Left as each device holds it.


@pytest.mark.parametrize("rows,piece_bytes,loop,scatters", [
    (6, 2**30, None, 1),  # 96 bytes of float32 gradient: scattered whole.
    (6, 32, 3, 1),        # 3 pieces of 2 rows (32 bytes each) in a loop.
    (7, 48, 2, 2),        # 112 bytes: 2 pieces of 3 rows in a loop, then the last row.
])
def test_gather_cast_is_the_gather_of_the_cast_with_its_gradient_scattered_in_pieces(
        monkeypatch, rows, piece_bytes, loop, scatters):
  monkeypatch.setattr(fsdp, "GRADIENT_PIECE_BYTES", piece_bytes)
  leaf = jax.random.normal(jax.random.key(0), (rows, 4))  # float32, split over fsdp on dim 1.
  pieces_of_leaf = places.cut_pieces(leaf, 1, 2)
  scale = jax.random.normal(jax.random.key(1), (rows, 4))

  def loss(gather, piece):
    weight = (jax.lax.axis_index("fsdp") + 1.0) * scale  # Each device its own cotangent.
    return jnp.sum(gather(piece).astype(jnp.float32) ** 2 * weight)

  cast = lambda p: fsdp.gather_cast(p, "fsdp", 1, np.dtype(jnp.bfloat16))
  # Gathered, then cast: the same values, and the gradient summed over fsdp in float32.
  plain = lambda p: jax.lax.all_gather(p, "fsdp", axis=1, tiled=True).astype(jnp.bfloat16)
  got = _on_fsdp(lambda p: (cast(p), jax.grad(lambda p: loss(cast, p))(p)), pieces_of_leaf)
  want = _on_fsdp(lambda p: (plain(p), jax.grad(lambda p: loss(plain, p))(p)), pieces_of_leaf)
  assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
  trace = lambda fn: str(jax.make_jaxpr(fn, axis_env=[("fsdp", 2)])(pieces_of_leaf[0]))
  assert f"bf16[{rows},4] = all_gather" in trace(cast)  # It moves the bfloat16 weight.
  backward = trace(lambda p: jax.grad(lambda p: loss(cast, p))(p))
  assert backward.count("reduce_scatter") == scatters
  assert (f"length={loop}" in backward) == (loop is not None)


def test_casts_before_gather_names_the_leaves_a_unit_only_narrows():
  def unit(params):
    kernel = params["head"]["kernel"]  # Transposed and sliced before its cast: followed.
    first = kernel.T[:2].astype(jnp.bfloat16)
    wide = params["half"].astype(jnp.float32)  # Widened: gathering it cast would move more.
    return first.sum() + params["scale"].sum() + wide.sum(), params["steps"] * 2

  whole = {"head": {"kernel": jnp.ones((4, 6))}, "scale": jnp.ones(4),
           "half": jnp.ones(4, jnp.bfloat16), "steps": jnp.ones((), jnp.int32)}
  assert fsdp.casts_before_gather(whole, unit) == {"['head']['kernel']": np.dtype(jnp.bfloat16)}


def test_casts_before_gather_keeps_what_a_layer_returns():
  # The layer casts its output back to the weight's own dtype: cast first, it would return
  # bfloat16, so nothing is cast before the gather.
  unit = lambda params: (jnp.ones((2, 4), jnp.bfloat16) @ params["w"].astype(jnp.bfloat16)
                         ).astype(params["w"].dtype)
  assert fsdp.casts_before_gather({"w": jnp.ones((4, 3))}, unit) == {}
