"""Tests for tpipe.train.models: the Transformer block and the pipelined byte-level decoder LM."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax

import tpipe
from tests.helpers import numerics
from tpipe.core.layout import staging
from tpipe.train import models

WIDTH, HEADS, MLP, LAYERS, SEQ = 32, 2, 64, 4, 16


def _lm(num_stages=1, num_data=1, num_microbatches=1, dropout_rate=0.0, **kwargs):
  mesh = tpipe.make_mesh(stages=num_stages, data=num_data)
  return models.decoder_lm(num_layers=LAYERS, width=WIDTH, num_heads=HEADS, mlp_dim=MLP,
                           max_len=SEQ, dropout_rate=dropout_rate, num_stages=num_stages,
                           num_microbatches=num_microbatches, mesh=mesh, **kwargs)


def _tokens(batch=8, seq=SEQ, seed=0):
  return jax.random.randint(jax.random.key(seed), (batch, seq), 0, 256, dtype=jnp.int32)


def test_block_preserves_shape_and_dtype():
  block = models.TransformerBlock(width=WIDTH, num_heads=HEADS, mlp_dim=MLP)
  x = jax.random.normal(jax.random.key(0), (3, SEQ, WIDTH), jnp.float32)
  mask = models.causal_mask(SEQ)
  variables = block.init(jax.random.key(1), x, mask)
  y = block.apply(variables, x, mask)
  assert y.shape == x.shape and y.dtype == jnp.float32
  assert not np.allclose(y, x)
  with pytest.raises(ValueError, match="expects"):
    block.apply(variables, x[..., :WIDTH // 2], mask)


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_block_returns_its_input_dtype_and_keeps_float32_params(x_dtype, dtype):
  block = models.TransformerBlock(width=WIDTH, num_heads=HEADS, mlp_dim=MLP, dtype=dtype)
  x = jax.random.normal(jax.random.key(0), (3, SEQ, WIDTH)).astype(x_dtype)
  mask = models.causal_mask(SEQ)
  variables = block.init(jax.random.key(1), x, mask)
  assert {leaf.dtype for leaf in jax.tree.leaves(variables)} == {jnp.dtype(jnp.float32)}
  y = block.apply(variables, x, mask)
  assert y.shape == x.shape and y.dtype == x_dtype


def test_block_param_dtype_sets_the_stored_dtype():
  block = models.TransformerBlock(width=WIDTH, num_heads=HEADS, mlp_dim=MLP,
                                  dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  x = jnp.ones((1, SEQ, WIDTH), jnp.bfloat16)
  variables = jax.eval_shape(block.init, jax.random.key(1), x, models.causal_mask(SEQ))
  assert {leaf.dtype for leaf in jax.tree.leaves(variables)} == {jnp.dtype(jnp.bfloat16)}


def test_causal_mask():
  mask = np.asarray(models.causal_mask(4))
  assert mask.shape == (1, 1, 4, 4)
  np.testing.assert_array_equal(mask[0, 0], np.tril(np.ones((4, 4), bool)))


@pytest.fixture(scope="module")
def lm_and_params():
  model = _lm()
  boxed = jax.jit(model.init)(jax.random.key(0), _tokens())["params"]
  return model, boxed


def test_params_layout_stacks_the_blocks(lm_and_params):
  _, boxed = lm_and_params
  # init keeps the layers' logical names, a Repeat's copy axis named after the stage axis.
  assert boxed["layers_1"]["mlp_in"]["kernel"].names == ("stage", "embed", "mlp")
  params = nn.meta.unbox(boxed)
  assert set(params) == {"layers_0", "layers_1", "layers_2"}
  assert set(params["layers_0"]) == {"embed", "pos_embed"}
  for leaf in jax.tree.leaves(params["layers_1"]):
    assert leaf.shape[0] == LAYERS
  assert params["layers_2"]["head"]["kernel"].shape == (WIDTH, models.VOCAB_SIZE)


def test_logits_are_causal(lm_and_params):
  model, params = lm_and_params
  tokens = _tokens(batch=1)
  changed = tokens.at[0, 10].set((tokens[0, 10] + 1) % 256)
  apply = jax.jit(lambda t: model.apply({"params": params}, t))
  a, b = apply(tokens), apply(changed)
  assert a.shape == (1, SEQ, 256) and a.dtype == jnp.float32
  np.testing.assert_allclose(a[0, :10], b[0, :10], rtol=1e-5, atol=1e-6)
  assert not np.allclose(a[0, 10:], b[0, 10:])


def test_losses_are_the_cross_entropy_of_the_logits(lm_and_params):
  model, params = lm_and_params
  tokens, targets = _tokens(), _tokens(seed=1)
  logits = jax.jit(lambda t: model.apply({"params": params}, t))(tokens)
  losses = jax.jit(lambda t, y: model.apply({"params": params}, t, targets=y))(tokens, targets)
  want = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(axis=-1)
  assert losses.shape == (8,) and losses.dtype == jnp.float32
  np.testing.assert_allclose(losses, want, rtol=1e-6)


def test_pipelined_lm_matches_the_layers_in_sequence(lm_and_params):
  model, params = lm_and_params
  tokens, targets = _tokens(), _tokens(seed=1)
  piped = _lm(num_stages=4, num_data=2, num_microbatches=2)

  def loss_and_grads(m):
    return jax.jit(jax.value_and_grad(
        lambda p: m.apply({"params": p}, tokens, targets=targets).mean()))

  got = loss_and_grads(piped)(params)
  plain = loss_and_grads(model)(params)
  exact = lambda p: loss_and_grads(_lm(dtype=jnp.float64, param_dtype=jnp.float64))(p)
  reference = numerics.float64_reference(exact, params)
  numerics.assert_as_close_as_plain(got[0], plain[0], reference[0], what="loss")
  numerics.assert_as_close_as_plain(got[1], plain[1], reference[1], what="gradients")


def test_staged_params_give_the_same_losses(lm_and_params):
  params = nn.meta.unbox(lm_and_params[1])
  tokens, targets = _tokens(), _tokens(seed=1)
  piped = _lm(num_stages=4, num_data=2, num_microbatches=2)
  layout = piped.stage_layout(tokens, targets=targets)
  staged = {"staged": staging.to_staged(layout, params)}
  # The blocks per leaf (one per stage where the split gives each stage one), the rest packed.
  assert {leaf.shape[:2] for leaf in jax.tree.leaves(staged["staged"])} == {(1, 4)}
  assert set(staged["staged"]["packed"]) == {"float32"}
  fixed = piped.with_split(layout)
  apply = lambda m, p: jax.jit(lambda p: m.apply({"params": p}, tokens, targets=targets))(p)
  np.testing.assert_array_equal(apply(fixed, staged), apply(piped, params))
  # The head (and its logits) live on the last stage only: its kernel is in no other chunk.
  head = sum(g.layer == 2 for chunk in layout.groups[:-1] for g in chunk)
  assert head == 0 and layout.groups[-1][-1].layer == 2
  assert layout.groups[0][0].layer == 0


def test_dropout_only_in_training():
  model = _lm(dropout_rate=0.5)
  tokens = _tokens(batch=2)
  params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
  jitted = jax.jit(
      lambda key, train: model.apply({"params": params}, tokens, deterministic=not train,
                                     rngs={"dropout": key}), static_argnums=1)
  apply = lambda train, seed: jitted(jax.random.key(seed), train)
  np.testing.assert_array_equal(apply(False, 1), apply(False, 2))
  np.testing.assert_array_equal(apply(True, 1), apply(True, 1))
  assert not np.allclose(apply(True, 1), apply(True, 2))
  assert not np.allclose(apply(True, 1), apply(False, 1))


def test_bfloat16_lm_keeps_float32_params_and_logits(lm_and_params):
  model, params = lm_and_params
  tokens = _tokens()
  mixed = _lm(num_stages=4, num_data=2, num_microbatches=2, dtype=jnp.bfloat16)
  mixed_params = jax.eval_shape(mixed.init, jax.random.key(0), tokens)["params"]
  assert jax.tree.structure(mixed_params) == jax.tree.structure(params)
  assert {leaf.dtype for leaf in jax.tree.leaves(mixed_params)} == {jnp.dtype(jnp.float32)}
  apply = jax.jit(lambda p, t: mixed.apply({"params": p}, t))
  assert "bf16" in apply.lower(params, tokens).as_text()  # It does compute in bfloat16.
  got = apply(params, tokens)
  want = jax.jit(lambda p, t: model.apply({"params": p}, t))(params, tokens)
  assert got.dtype == jnp.float32 and got.shape == want.shape
  # The same function up to bfloat16 rounding (eps 2**-8), but not bit-for-bit float32.
  got, want = np.asarray(got), np.asarray(want)
  error = float(np.linalg.norm(got - want) / np.linalg.norm(want))
  assert 1e-5 < error < 5e-2, error
  # The gradients' dtypes, traced (not compiled): what is asserted of them.
  grads = jax.eval_shape(jax.grad(lambda p: mixed.apply({"params": p}, tokens).mean()), params)
  assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}


@pytest.mark.unit  # No JAX computation.
def test_pipeline_settings_come_from_the_spec_or_keywords():
  spec = tpipe.PipelineSpec(num_stages=4, num_microbatches=2, schedule="1f1b",
                            per_example=("inputs",), mesh=tpipe.make_mesh(stages=4, data=2))
  sizes = dict(num_layers=LAYERS, width=WIDTH, num_heads=HEADS, mlp_dim=MLP, max_len=SEQ)
  model = models.decoder_lm(**sizes, spec=spec)
  # The spec's settings, but the LM's keyword inputs (targets, loss weights, segment ids and
  # positions, and only they) are split into micro-batches with the tokens.
  assert model.spec == spec.replace(per_example=models.PER_EXAMPLE)
  # Keywords override the spec's settings.
  other = models.decoder_lm(**sizes, spec=spec, num_microbatches=4, remat="none")
  assert other.spec.num_microbatches == 4 and other.spec.remat == "none"
  assert other.spec.schedule == "1f1b" and other.spec.mesh is spec.mesh
  # Without a spec: PipelineSpec's defaults for whatever is not given.
  plain = models.decoder_lm(**sizes, num_stages=1, num_microbatches=1)
  assert plain.spec.balance == "params" and plain.spec.remat == "full"
  assert plain.spec.schedule == "gpipe" and plain.spec.mesh is None
  assert plain.spec.per_example == ("targets", "loss_weights", "segment_ids", "positions")
  assert [type(layer).__name__ for layer in plain.layer_list()] == [
      "TokenEmbedding", "Repeat", "LMHead"]
  with pytest.raises(ValueError, match="decoder_lm: .*schedule"):
    models.decoder_lm(**sizes, num_stages=1, num_microbatches=1, schedule="pipedream")


@pytest.mark.unit  # No JAX computation.
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_heads=3), ValueError, "must divide width"),
    (dict(dropout_rate=1.5), ValueError, "dropout_rate"),
    (dict(num_layers=0), ValueError, "num_layers"),
    (dict(width=32.0), TypeError, "width"),
    (dict(dtype="floaty"), TypeError, "decoder_lm dtype must be a floating dtype"),
    (dict(dtype=jnp.int32), ValueError, "decoder_lm dtype must be a floating dtype"),
    (dict(param_dtype="int8"), ValueError, "decoder_lm param_dtype"),
    (dict(vocab_size=0), ValueError, "vocab_size"),
    (dict(block="bert"), ValueError, r"block must be 'gpt', 'llama' or 'moe', got 'bert'"),
    (dict(block="llama", num_kv_heads=3), ValueError, "num_kv_heads=3 must divide num_heads=2"),
    (dict(num_kv_heads=1), ValueError, "use block='llama' for grouped-query attention"),
    (dict(block="llama", dropout_rate=0.1), ValueError, "block='llama' has no dropout"),
])
def test_bad_model_arguments_raise(kwargs, error, match):
  args = dict(num_layers=LAYERS, width=WIDTH, num_heads=HEADS, mlp_dim=MLP, max_len=SEQ,
              num_stages=1, num_microbatches=1)
  assert isinstance(models.decoder_lm(**args), tpipe.Sequential)  # The arguments, unchanged.
  args.update(kwargs)
  with pytest.raises(error, match=match):
    models.decoder_lm(**args)


@pytest.mark.unit  # No JAX computation.
def test_bad_block_dtype_raises_before_tracing():
  with pytest.raises(ValueError, match="TransformerBlock.dtype must be a floating dtype"):
    models.TransformerBlock(width=WIDTH, num_heads=HEADS, mlp_dim=MLP, dtype="int32")
  stack = tpipe.pipeline(models.TransformerBlock, length=LAYERS, num_stages=1, num_microbatches=1)
  with pytest.raises(TypeError, match="TransformerBlock.param_dtype"):
    stack(width=WIDTH, num_heads=HEADS, mlp_dim=MLP, param_dtype="bf17")


def test_too_long_sequence_raises(lm_and_params):
  model, params = lm_and_params
  with pytest.raises(ValueError, match="max_len"):
    model.apply({"params": params}, _tokens(seq=SEQ + 1))


def _grouped_query_block_by_hand(params, x, num_heads, num_kv_heads, eps=1e-6):
  """The Llama block's math written out: every key/value head repeated for its query heads."""
  rms = lambda h, scale: h / jnp.sqrt(jnp.mean(h * h, -1, keepdims=True) + eps) * scale
  h = rms(x, params["attn_norm"]["scale"])
  q = jnp.einsum("bsd,dhk->bshk", h, params["query"])
  repeat = lambda w: jnp.repeat(w, num_heads // num_kv_heads, axis=1)
  k = jnp.einsum("bsd,dhk->bshk", h, repeat(params["key"]))
  v = jnp.einsum("bsd,dhk->bshk", h, repeat(params["value"]))
  seq, head_dim = x.shape[1], q.shape[-1]
  logits = jnp.einsum("bshk,bthk->bhst", q, k) / np.sqrt(head_dim)
  logits = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), logits, -jnp.inf)
  y = x + jnp.einsum("bhst,bthk,hkd->bsd", jax.nn.softmax(logits, -1), v, params["out"])
  h = rms(y, params["mlp_norm"]["scale"])
  return y + (jax.nn.silu(h @ params["gate"]) * (h @ params["up"])) @ params["down"]


def test_llama_block_is_grouped_query_attention_and_swiglu():
  block = models.LlamaBlock(width=WIDTH, num_heads=4, num_kv_heads=2, mlp_dim=MLP)
  x = jax.random.normal(jax.random.key(0), (2, SEQ, WIDTH))
  params = block.init(jax.random.key(1), x)["params"]
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  params = nn.meta.unbox(params)
  assert params["key"].shape == (WIDTH, 2, WIDTH // 4)
  by_hand = lambda p, x: _grouped_query_block_by_hand(p, x, 4, 2)
  numerics.assert_as_close_as_plain(
      jax.jit(block.apply)({"params": params}, x), jax.jit(by_hand)(params, x),
      numerics.float64_reference(jax.jit(by_hand), params, x), what="the Llama block")


def test_llama_lm_on_a_3d_mesh_matches_the_layers_in_sequence():
  """Every matrix of the Llama block is named: on stage 2 x fsdp 2 x tensor 2 its query heads
  split over tensor (one key/value head stays whole), and the loss and gradients are the
  sequential model's."""
  args = dict(num_layers=LAYERS, width=WIDTH, num_heads=HEADS, mlp_dim=MLP, max_len=SEQ,
              block="llama", num_kv_heads=1)
  tokens, targets = _tokens(), _tokens(seed=1)
  mesh = tpipe.make_mesh(stages=2, fsdp=2, tensor=2)
  piped = models.decoder_lm(**args, num_stages=2, num_microbatches=2, mesh=mesh)
  plain = models.decoder_lm(**args, num_stages=1, num_microbatches=4,
                            mesh=tpipe.make_mesh(stages=1))
  exact = models.decoder_lm(**args, num_stages=1, num_microbatches=1,
                            mesh=tpipe.make_mesh(stages=1), dtype=jnp.float64,
                            param_dtype=jnp.float64)
  params = plain.init(jax.random.key(0), tokens, targets=targets, method="initialize")["params"]

  def loss_and_grads(m):
    return jax.jit(jax.value_and_grad(
        lambda p: m.apply({"params": p}, tokens, targets=targets).mean()))

  got = loss_and_grads(piped)(params)
  reference = numerics.float64_reference(loss_and_grads(exact), params)
  numerics.assert_as_close_as_plain(got, loss_and_grads(plain)(params), reference,
                                    what="loss and gradients")
  specs = piped.pipeline_for(tokens, targets=targets).layout.partition_specs(mesh=mesh)
  blocks = specs["stacked"]["layers_1"]
  assert blocks["query"] == jax.sharding.PartitionSpec(None, "stage", None, "fsdp", "tensor")
  assert blocks["key"] == jax.sharding.PartitionSpec(None, "stage", None, "fsdp")
