"""The transform's contract beyond transparency: validation, RNG, composition, ambient mesh."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import tpipe
from tests.helpers import blocks
from tests.helpers import numerics
from tpipe import schedules

WIDTH = 8


def _x(batch=16):
  return jax.random.normal(jax.random.key(3), (batch, WIDTH))


def _assert_equals_sequential(y, block, params, x, *args, microbatches):
  """``y`` against ``block`` applied in sequence, by :mod:`tests.helpers.numerics`' rule.

  ``microbatches`` is the pipeline's total (``num_microbatches * data``): the plain float32 model
  runs on the same micro-batches, the float64 reference on the whole batch.
  """
  sequential = functools.partial(blocks.apply_in_sequence, block)
  plain = jax.jit(functools.partial(sequential, microbatches=microbatches))(params, x, *args)
  exact = numerics.float64_reference(jax.jit(sequential), params, x, *args)
  numerics.assert_as_close_as_plain(y, plain, exact, what="outputs")


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(length=6, num_stages=4, num_microbatches=4), ValueError,
     r"^tpipe.pipeline: length=6 layers cannot be split evenly into num_stages \* num_repeats "
     r"= 4 chunks"),
    (dict(length=8, num_stages=2, num_microbatches=2, schedule="circular", num_repeats=3),
     ValueError, r"num_stages \* num_repeats = 6 chunks; choose a length that is a multiple of 6"),
    (dict(length=8, num_stages=0, num_microbatches=2), ValueError, "num_stages must be >= 1"),
    (dict(length=8, num_stages=2, num_microbatches=0), ValueError,
     "num_microbatches must be >= 1"),
    (dict(length=-8, num_stages=2, num_microbatches=2), ValueError, "length must be >= 1"),
    (dict(length=8, num_stages=2, num_microbatches=2.5), TypeError,
     "num_microbatches must be an int"),
    (dict(length=8, num_stages=2, num_microbatches=2, schedule="zigzag"), ValueError,
     "Unknown schedule 'zigzag'"),
    (dict(length=8, num_stages=2, num_microbatches=2, num_repeats=2), ValueError,
     "use schedule='circular'"),
    (dict(length=8, num_stages=2, num_microbatches=2, schedule="zb_h1"), ValueError,
     r"^tpipe.pipeline returns the blocks' activations, but schedule='zb_h1' runs the backward "
     r"inside.*tpipe.Sequential\(\[tpipe.Repeat\(block, length\), YourLoss\(\)\]"),
    (dict(length=8, num_stages=2, num_microbatches=2, remat="everything"), ValueError,
     "Unknown remat 'everything'"),
    (dict(length=8, num_stages=2, num_microbatches=2, remat=3), TypeError, "remat must be one of"),
    (dict(length=8, num_stages=2, num_microbatches=2, mesh="mesh"), TypeError,
     "mesh must be a jax.sharding.Mesh"),
    (dict(length=8, num_stages=2, num_microbatches=2, unroll=0), ValueError,
     "unroll must be an int >= 1"),
    (dict(length=8, num_stages=2, num_microbatches=2, unroll="all"), ValueError,
     "unroll must be an int >= 1"),
])
def test_bad_configuration_is_rejected_at_construction(kwargs, error, match):
  with pytest.raises(error, match=match):
    tpipe.pipeline(blocks.MLPBlock, **kwargs)


def test_block_must_be_a_linen_module_class():
  with pytest.raises(TypeError, match="block_cls must be a flax.linen.Module class"):
    tpipe.pipeline(blocks.MLPBlock(), length=2, num_stages=1, num_microbatches=1)


def test_stage_count_must_match_the_mesh():
  with pytest.raises(ValueError, match="num_stages=2 but the 'stage' axis .* has size 4"):
    tpipe.pipeline(blocks.MLPBlock, length=8, num_stages=2, num_microbatches=2,
                   mesh=tpipe.make_mesh(stages=4))


def test_mesh_needs_a_stage_axis():
  mesh = jax.make_mesh((2,), ("model",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
  with pytest.raises(ValueError, match="no stage axis 'stage'"):
    tpipe.pipeline(blocks.MLPBlock, length=8, num_stages=2, num_microbatches=2, mesh=mesh)


def test_many_stages_without_a_mesh_is_rejected_at_call():
  stack = tpipe.pipeline(blocks.MLPBlock, length=8, num_stages=2, num_microbatches=2)(WIDTH)
  with pytest.raises(ValueError, match="num_stages=2 but the 'stage' axis of tpipe.pipeline's "
                                       "default 1-device mesh"):
    stack.init({"params": jax.random.key(0)}, _x())


def test_batch_must_divide_into_microbatches_times_replicas():
  stack = tpipe.pipeline(blocks.MLPBlock, length=8, num_stages=2, num_microbatches=3,
                         mesh=tpipe.make_mesh(stages=2, data=2))(WIDTH)
  with pytest.raises(ValueError,
                     match=r"^tpipe.pipeline: batch size 16 is not divisible by .* 3 \* 2 = 6"):
    stack.init({"params": jax.random.key(0)}, _x(16))


def test_block_that_changes_its_activation_shape_is_rejected():

  class Widen(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Dense(x.shape[-1] + 1)(x)

  stack = tpipe.pipeline(Widen, length=2, num_stages=1, num_microbatches=1)()
  with pytest.raises(ValueError, match=r"^tpipe.pipeline: layers\[0\] repeats Widen, which maps "
                                       r".*; a repeated layer must keep its input's structure, "
                                       r"shapes and dtypes"):
    stack.init({"params": jax.random.key(0)}, _x())


def test_block_that_changes_its_activation_dtype_is_rejected():

  class ToHalf(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Dense(x.shape[-1], dtype=jnp.bfloat16)(x)

  stack = tpipe.pipeline(ToHalf, length=2, num_stages=1, num_microbatches=1)()
  with pytest.raises(ValueError, match="bfloat16"):
    stack.init({"params": jax.random.key(0)}, _x())


def test_block_with_other_variable_collections_is_rejected():

  class WithCache(nn.Module):

    @nn.compact
    def __call__(self, x):
      seen = self.variable("cache", "seen", lambda: jnp.zeros(x.shape[-1]))
      return x + seen.value

  stack = tpipe.pipeline(WithCache, length=2, num_stages=1, num_microbatches=1)()
  with pytest.raises(ValueError, match=r"creates variable collections \['cache'\]; "
                                       r"tpipe.pipeline supports .*'params' and BatchNorm"):
    stack.init({"params": jax.random.key(0)}, _x())


def test_variables_for_another_length_are_rejected():
  short = tpipe.pipeline(blocks.MLPBlock, length=4, num_stages=1, num_microbatches=1)(WIDTH)
  long = tpipe.pipeline(blocks.MLPBlock, length=8, num_stages=1, num_microbatches=1)(WIDTH)
  variables = short.init({"params": jax.random.key(0)}, _x())
  with pytest.raises(ValueError, match="leading axis of length 8"):
    long.apply(variables, _x())


def test_make_mesh_rejects_too_many_devices():
  with pytest.raises(ValueError, match="needs 16 devices but 8 are available"):
    tpipe.make_mesh(stages=8, data=2)


# ----------------------------------------------------------------------------- behaviour


def test_fewer_microbatches_than_stages_terminates_with_the_right_answer():
  x = _x(4)
  single = tpipe.pipeline(blocks.MLPBlock, length=8, num_stages=1, num_microbatches=1)(WIDTH)
  variables = single.init({"params": jax.random.key(0)}, x)
  stack = tpipe.pipeline(blocks.MLPBlock, length=8, num_stages=8, num_microbatches=1,
                         mesh=tpipe.make_mesh(stages=8))(WIDTH)
  _assert_equals_sequential(jax.jit(stack.apply)(variables, x), blocks.MLPBlock(WIDTH),
                            variables["params"], x, microbatches=1)


@pytest.mark.parametrize("schedule,microbatches,repeats", [
    ("gpipe", 8, 1), ("circular", 2, 2), ("circular", 3, 3)])
def test_the_tick_loop_stashes_what_the_schedule_says(schedule, microbatches, repeats, capsys):
  stages, rows = 4, 3
  stack = tpipe.pipeline(blocks.MLPBlock, length=stages * repeats, num_stages=stages,
                         num_microbatches=microbatches, schedule=schedule, num_repeats=repeats,
                         remat="full", mesh=tpipe.make_mesh(stages=stages))(WIDTH)
  x = _x(microbatches * rows)
  params = jax.eval_shape(lambda: stack.init({"params": jax.random.key(0)}, x)["params"])
  jax.ad_checkpoint.print_saved_residuals(lambda p: stack.apply({"params": p}, x).sum(), params)
  saved = capsys.readouterr().out
  slots = schedules.build(schedule, stages, microbatches, repeats).stash_slots()
  # With remat="full" each stage saves its [rows, WIDTH] input at every tick; shard_map stacks
  # the stages' stashes along the leading axis.
  assert f"f32[{stages * slots[0]},{rows},{WIDTH}]" in saved, saved


LAYOUTS = ((1, "gpipe", 1, "none"), (4, "gpipe", 1, "full"), (2, "circular", 2, "dots"),
           (8, "gpipe", 1, "full"))


def _norm_relative(a, b):
  a, b = jax.tree.leaves(a), jax.tree.leaves(b)
  diff = sum(float(np.sum((np.asarray(x, np.float64) - y) ** 2)) for x, y in zip(a, b))
  return (diff / sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in b)) ** 0.5


def test_dropout_masks_do_not_depend_on_stages_schedule_or_remat():
  # Each layer records its keep-mask (0 or 1, exact in any arithmetic) into the activation.
  masks = jnp.zeros((16, 8, WIDTH))
  recorded = []
  for stages, schedule, repeats, remat in LAYOUTS:
    stack = tpipe.pipeline(_MaskRecorder, length=8, num_stages=stages, num_microbatches=4,
                           schedule=schedule, num_repeats=repeats, remat=remat,
                           mesh=tpipe.make_mesh(stages=stages))()
    recorded.append(jax.jit(stack.apply)({}, masks, rngs={"dropout": jax.random.key(7)}))
  for r in recorded[1:]:
    np.testing.assert_array_equal(r, recorded[0])
  kept = float(jnp.mean(recorded[0]))
  assert 0.4 < kept < 0.6, kept  # rate 0.5, really drawn
  # Different layers and micro-batches get different masks.
  assert not np.array_equal(recorded[0][:, 0], recorded[0][:, 1])
  assert not np.array_equal(recorded[0][:4], recorded[0][4:8])


def test_dropout_outputs_and_gradients_do_not_depend_on_the_layout():
  # Same masks, so layouts differ only by float32 rounding between different programs (about
  # 1e-6 here; not bit-identical on AVX-512). Different masks would change them by O(1), so a
  # 1e-3 norm-relative bound separates the two cases by three orders of magnitude either way.
  x = _x(16)
  results = []
  for stages, schedule, repeats, remat in LAYOUTS:
    stack = tpipe.pipeline(blocks.DropoutBlock, length=8, num_stages=stages, num_microbatches=4,
                           schedule=schedule, num_repeats=repeats, remat=remat,
                           mesh=tpipe.make_mesh(stages=stages))(WIDTH)
    variables = stack.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)

    def loss(params, stack=stack):
      y = stack.apply({"params": params}, x, rngs={"dropout": jax.random.key(7)})
      return jnp.sum(jnp.sin(y)), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"])
    results.append((y, grads))
  for y, grads in results[1:]:
    assert _norm_relative(y, results[0][0]) < 1e-3
    # Rematerialization replays the same dropout masks in the backward pass.
    assert _norm_relative(grads, results[0][1]) < 1e-3
  # The bound can fail: another key gives another answer.
  other_key = jax.jit(stack.apply)(variables, x, rngs={"dropout": jax.random.key(8)})
  assert _norm_relative(other_key, results[0][0]) > 1e-1
  # Different micro-batches get different masks: identical rows do not give identical outputs.
  same_rows = jnp.broadcast_to(x[:1], x.shape)
  y = jax.jit(stack.apply)(variables, same_rows, rngs={"dropout": jax.random.key(7)})
  assert not np.allclose(y[0], y[-1], atol=1e-3)


class _MaskRecorder(nn.Module):
  """Shifts its dropout keep-mask into the activation: after L layers, ``[:, l]`` is layer l's."""

  @nn.compact
  def __call__(self, masks):  # [batch, L, WIDTH]
    keep = nn.Dropout(0.5, deterministic=False)(jnp.ones_like(masks[:, 0])) > 0
    return jnp.concatenate([masks[:, 1:], keep[:, None].astype(masks.dtype)], axis=1)


class _ModelWithRecorders(nn.Module):
  mesh: object

  @nn.compact
  def __call__(self, masks):
    stack = tpipe.pipeline(_MaskRecorder, length=2, num_stages=2, num_microbatches=2,
                           mesh=self.mesh)
    return stack(name="blocks")(masks)


class _KeyProbe(nn.Module):

  @nn.compact
  def __call__(self):
    return self.make_rng("dropout")


class _ModelWithProbe(nn.Module):
  """Same name path as ``_ModelWithRecorders``'s stack: its make_rng gives the stack's key."""

  @nn.compact
  def __call__(self):
    return _KeyProbe(name="blocks")()


def test_dropout_keys_follow_the_documented_rule():
  # data=2 x stage=2, one layer per stage, M=2 micro-batches of 3 rows per replica.
  replicas, microbatches, rows, layers = 2, 2, 3, 2
  mesh = tpipe.make_mesh(stages=2, data=replicas)
  masks = jnp.zeros((replicas * microbatches * rows, layers, WIDTH))
  k = jax.random.key(42)
  got = jax.jit(lambda m: _ModelWithRecorders(mesh).apply({}, m, rngs={"dropout": k}))(masks)
  got = np.asarray(got).reshape(replicas, microbatches, rows, layers, WIDTH)
  # K: the stack's own make_rng key (Flax derives it from k and the name path), not k itself.
  big_k = _ModelWithProbe().apply({}, rngs={"dropout": k})

  def documented(root, layer, micro):
    """The block applied alone with key ``fold_in(fold_in(root, layer), micro)``: its mask."""
    key = jax.random.fold_in(jax.random.fold_in(root, layer), micro)
    out = _MaskRecorder().apply({}, jnp.zeros((rows, layers, WIDTH)), rngs={"dropout": key})
    return np.asarray(out[:, -1])

  for r in range(replicas):
    for m in range(microbatches):
      for layer in range(layers):
        # Micro-batch m of replica r is global micro-batch r * M + m.
        np.testing.assert_array_equal(got[r, m, :, layer],
                                      documented(big_k, layer, r * microbatches + m))
  # Neither the raw key nor the replica-local index reproduces the masks.
  assert not np.array_equal(got[0, 0, :, 0], documented(k, 0, 0))
  assert not np.array_equal(got[1, 0, :, 0], documented(big_k, 0, 0))
  assert 0 < got.mean() < 1  # dropout is on.


class _LanguageModelish(nn.Module):
  """Embedding -> pipelined stack -> head: the way a model uses tpipe.pipeline."""

  mesh: object
  stages: int

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(32, WIDTH)(tokens)
    stack = tpipe.pipeline(blocks.AttentionBlock, length=8, num_stages=self.stages,
                           num_microbatches=4, mesh=self.mesh)
    mask = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))
    x = stack(WIDTH, name="blocks")(x, mask)
    return nn.Dense(32)(nn.LayerNorm()(x))


def _sequential_language_modelish(params, tokens, microbatches):
  """``_LanguageModelish`` without the pipeline, its stack run on ``microbatches`` parts."""
  x = nn.Embed(32, WIDTH).apply({"params": params["Embed_0"]}, tokens)
  mask = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))
  x = blocks.apply_in_sequence(blocks.AttentionBlock(WIDTH), params["blocks"], x, mask,
                               microbatches=microbatches)
  x = nn.LayerNorm().apply({"params": params["LayerNorm_0"]}, x)
  return nn.Dense(32).apply({"params": params["Dense_0"]}, x)


def _first_token_loss(apply, params, tokens):
  return -jnp.mean(jax.nn.log_softmax(apply(params, tokens))[..., 0])


def test_composes_inside_a_bigger_model_under_jit_and_grad():
  tokens = jax.random.randint(jax.random.key(0), (16, 6), 0, 32)
  mesh = tpipe.make_mesh(stages=4, data=2)
  model = _LanguageModelish(mesh, 4)
  params = _LanguageModelish(tpipe.make_mesh(stages=1), 1).init(jax.random.key(1),
                                                                tokens)["params"]
  assert params["blocks"]["LayerNorm_0"]["scale"].shape == (8, WIDTH)

  sharded_tokens = jax.device_put(tokens, tpipe.data_sharding(mesh))
  sharded_params = jax.device_put(params, tpipe.shardings(params, mesh, ("blocks",)))
  pipelined = functools.partial(_first_token_loss, lambda p, t: model.apply({"params": p}, t))
  value, grads = jax.jit(jax.value_and_grad(pipelined))(sharded_params, sharded_tokens)

  def sequential(microbatches):
    apply = functools.partial(_sequential_language_modelish, microbatches=microbatches)
    return jax.jit(jax.value_and_grad(functools.partial(_first_token_loss, apply)))

  plain_value, plain_grads = sequential(4 * 2)(params, tokens)  # M x data micro-batches
  exact_value, exact_grads = numerics.float64_reference(sequential(1), params, tokens)
  numerics.assert_as_close_as_plain(value, plain_value, exact_value, what="loss")
  numerics.assert_as_close_as_plain(grads, plain_grads, exact_grads, what="grads")
  # The stack's parameters stay split over stages: each device holds 8 / 4 = 2 layers.
  kernel = sharded_params["blocks"]["MultiHeadDotProductAttention_0"]["query"]["kernel"]
  assert {shard.data.shape[0] for shard in kernel.addressable_shards} == {2}


def test_mesh_none_uses_the_ambient_mesh():
  mesh = tpipe.make_mesh(stages=2, data=2)
  x = _x(16)
  single = tpipe.pipeline(blocks.MLPBlock, length=4, num_stages=1, num_microbatches=1)(WIDTH)
  variables = single.init({"params": jax.random.key(0)}, x)
  stack = tpipe.pipeline(blocks.MLPBlock, length=4, num_stages=2, num_microbatches=2)(WIDTH)
  with jax.set_mesh(mesh):
    y = jax.jit(stack.apply)(variables, x)
  _assert_equals_sequential(y, blocks.MLPBlock(WIDTH), variables["params"], x, microbatches=2 * 2)


def test_static_python_arguments_are_passed_through():

  class Scaled(nn.Module):

    @nn.compact
    def __call__(self, x, scale, mask):
      return x + scale * jnp.where(mask, nn.Dense(x.shape[-1])(x), 0.0)

  x = _x(8)
  mask = jnp.arange(WIDTH) % 2 == 0
  one = tpipe.pipeline(Scaled, length=4, num_stages=1, num_microbatches=1)()
  variables = one.init({"params": jax.random.key(0)}, x, 0.5, mask)
  two = tpipe.pipeline(Scaled, length=4, num_stages=2, num_microbatches=2,
                       mesh=tpipe.make_mesh(stages=2))()
  _assert_equals_sequential(jax.jit(two.apply, static_argnums=2)(variables, x, 0.5, mask),
                            Scaled(), variables["params"], x, 0.5, mask, microbatches=2)


def _run_on_mesh(mesh, given_mesh):
  """Params and ``(loss, grads)`` of a 4-stage stack on ``mesh`` (``given_mesh`` to the stack)."""
  x = _x(16)
  stack = tpipe.pipeline(blocks.MLPBlock, length=8, num_stages=4, num_microbatches=2,
                         mesh=given_mesh)(WIDTH)
  params = stack.init({"params": jax.random.key(0)}, x)["params"]
  loss = lambda p, x: jnp.sum(stack.apply({"params": p}, x) ** 2)
  sharded = jax.device_put(x, tpipe.data_sharding(mesh))
  return params, jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, sharded)


@functools.cache
def _run_on_the_auto_mesh():
  """The Auto-axes run both cases compare with (computed once)."""
  auto = tpipe.make_mesh(stages=4, data=2)
  return _run_on_mesh(auto, auto)


@pytest.mark.parametrize("ambient", [False, True])
def test_mesh_with_explicit_axes_gives_the_same_result(ambient):
  explicit = jax.make_mesh((2, 4), ("data", "stage"), devices=jax.devices()[:8],
                           axis_types=(AxisType.Explicit, AxisType.Explicit))
  params, (loss, grads) = _run_on_the_auto_mesh()
  if ambient:
    with jax.set_mesh(explicit):
      params_e, (loss_e, grads_e) = _run_on_mesh(explicit, None)
  else:
    params_e, (loss_e, grads_e) = _run_on_mesh(explicit, explicit)
  jax.tree.map(np.testing.assert_array_equal, params_e, params)
  np.testing.assert_array_equal(loss_e, loss)
  jax.tree.map(np.testing.assert_array_equal, grads_e, grads)
