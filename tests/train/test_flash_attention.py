"""``tpipe.train.flash_attention``: the splash attention kernel (run by the Pallas interpreter on
CPU, ``attention="splash_interpret"``) equals the blocked XLA attention by the numerics rule
(against a float64 reference, its float32 error and its gradients' at most 4x the blocked
attention's own), with causal masking, grouped-query heads, a sliding window and packed
documents; in the blocks, in a pipeline split over tensor, and on a TPU topology, where
``attention="flash"`` compiles to the Mosaic kernel. Bad settings raise ValueError."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpipe
from tests.helpers import numerics
from tpipe.train import attention
from tpipe.train import blocks
from tpipe.train import flash_attention
from tpipe.train import models

# The kernel's smallest sequence (one block of 128 lanes) is too short to see two blocks, so
# the tests use two: queries of the second block attend keys of both.
SEQ, DEPTH, BATCH = 256, 8, 2
# How many times the blocked attention's own float32 error the kernel's may be (per leaf).
FACTOR = 4.0


def _blocked(query, key, value, segment_ids, window):
  """The reference: tpipe's blocked grouped-query attention with the blocks' mask."""
  batch, seq, heads, depth = query.shape
  kv_heads = key.shape[2]
  mask = blocks.attention_mask(seq, segment_ids, window)[:, :, None]
  grouped = query.reshape(batch, seq, kv_heads, heads // kv_heads, depth)
  out = attention.grouped_attention(grouped, key, value, mask, math.sqrt(depth))
  return out.reshape(batch, seq, heads, depth)


def _flash(query, key, value, segment_ids, window):
  return flash_attention.causal_attention(query, key, value, implementation="splash_interpret",
                                          segment_ids=segment_ids, sliding_window=window)


def _output_and_gradients(attend, segment_ids, window):
  """A jitted ``(q, k, v, cotangent) -> (output, (d_q, d_k, d_v))`` of ``attend``."""

  def run(query, key, value, cotangent):
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, segment_ids, window), query, key, value)
    return out, vjp(cotangent)

  return jax.jit(run)


def _inputs(heads, kv_heads, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  query = jax.random.normal(keys[0], (BATCH, SEQ, heads, DEPTH), jnp.float32)
  key = jax.random.normal(keys[1], (BATCH, SEQ, kv_heads, DEPTH), jnp.float32)
  value = jax.random.normal(keys[2], (BATCH, SEQ, kv_heads, DEPTH), jnp.float32)
  cotangent = jax.random.normal(keys[3], (BATCH, SEQ, heads, DEPTH), jnp.float32)
  return query, key, value, cotangent


def _packed():
  """Two rows of packed documents: one of 3 documents (lengths 100, 60, 96: boundaries inside
  the kernel's blocks) and one of 2 (200 then 56 positions of padding, a segment of its own)."""
  first = np.repeat([0, 1, 2], [100, 60, 96])
  second = np.repeat([0, 1], [200, 56])
  return jnp.asarray(np.stack([first, second]), jnp.int32)


CASES = {
    "causal": (4, 4, None, False),
    "grouped query": (4, 2, None, False),
    "multi-query, sliding window": (4, 1, 48, False),
    "packed documents": (4, 2, None, True),
    "packed documents in a window": (2, 1, 80, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_splash_equals_blocked_attention_and_its_gradients(case):
  heads, kv_heads, window, packed = CASES[case]
  segment_ids = _packed() if packed else None
  inputs = _inputs(heads, kv_heads)
  got = _output_and_gradients(_flash, segment_ids, window)(*inputs)
  plain = _output_and_gradients(_blocked, segment_ids, window)(*inputs)
  reference = numerics.float64_reference(_output_and_gradients(_blocked, segment_ids, window),
                                         *inputs)
  numerics.assert_as_close_as_plain(got[0], plain[0], reference[0], factor=FACTOR,
                                    what=f"{case}: output")
  numerics.assert_as_close_as_plain(got[1], plain[1], reference[1], factor=FACTOR,
                                    what=f"{case}: gradients")
  if window or packed:  # The case's mask matters here: plain causal attention is far off.
    causal = _output_and_gradients(_blocked, None, None)(*inputs)[0]
    assert np.linalg.norm(causal - reference[0]) > 0.1 * np.linalg.norm(reference[0])


def test_a_row_of_one_segment_needs_no_segment_ids():
  """Segment ids of a single document change nothing: the kernel's causal mask alone."""
  query, key, value, _ = _inputs(4, 2)
  one = jnp.zeros((BATCH, SEQ), jnp.int32)
  np.testing.assert_array_equal(jax.jit(_flash, static_argnums=4)(query, key, value, one, None),
                                jax.jit(_flash, static_argnums=4)(query, key, value, None, None))


BLOCKS = {
    "llama": lambda attention: blocks.LlamaBlock(
        width=32, num_heads=4, num_kv_heads=2, mlp_dim=64, sliding_window=100,
        rope_theta=10000.0, attention=attention),
    "gpt": lambda attention: blocks.TransformerBlock(
        width=32, num_heads=4, mlp_dim=64, causal=True, attention=attention),
}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_blocks_with_flash_attention_equal_blocked_ones(name):
  """The Llama block (grouped query, window, packed documents) and the GPT block with
  ``attention="splash_interpret"`` equal their blocked selves; same parameters."""
  x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, 32), jnp.float32)
  segment_ids = _packed()
  flash, blocked = BLOCKS[name]("splash_interpret"), BLOCKS[name]("blocked")
  params = blocked.init(jax.random.key(2), x, segment_ids=segment_ids)["params"]

  def loss_and_grads(block):
    return jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(
        block.apply({"params": p}, x, segment_ids=segment_ids) ** 2)))

  got = loss_and_grads(flash)(params, x)
  plain = loss_and_grads(blocked)(params, x)
  reference = numerics.float64_reference(loss_and_grads(blocked), params, x)
  numerics.assert_as_close_as_plain(got[0], plain[0], reference[0], factor=FACTOR,
                                    what=f"{name}: loss")
  numerics.assert_as_close_as_plain(got[1], plain[1], reference[1], factor=FACTOR,
                                    what=f"{name}: gradients")


def test_a_pipelined_llama_lm_with_flash_attention_equals_blocked():
  """Through a pipeline of 2 stages x tensor 2 (the kernel runs manual over tensor, a key/value
  head per device) with packed documents, the LM's loss and gradients are the blocked LM's."""
  args = dict(num_layers=2, width=32, num_heads=4, num_kv_heads=2, mlp_dim=64, max_len=128,
              block="llama", positions="rotary")
  tokens = jax.random.randint(jax.random.key(0), (4, 128), 0, 256, jnp.int32)
  targets = jax.random.randint(jax.random.key(1), (4, 128), 0, 256, jnp.int32)
  segment_ids = jnp.asarray(np.repeat([[0, 1]] * 4, [70, 58], axis=1), jnp.int32)
  mesh = tpipe.make_mesh(stages=2, tensor=2)
  flash = models.decoder_lm(**args, num_stages=2, num_microbatches=2, mesh=mesh,
                            remat="none", attention="splash_interpret")
  plain = models.decoder_lm(**args, num_stages=1, num_microbatches=2,
                            mesh=tpipe.make_mesh(stages=1))
  exact = models.decoder_lm(**args, num_stages=1, num_microbatches=1,
                            mesh=tpipe.make_mesh(stages=1), dtype=jnp.float64,
                            param_dtype=jnp.float64)
  params = plain.init(jax.random.key(0), tokens, targets=targets, segment_ids=segment_ids,
                      method="initialize")["params"]

  def loss_and_grads(model):
    return jax.jit(jax.value_and_grad(lambda p: model.apply(
        {"params": p}, tokens, targets=targets, segment_ids=segment_ids).mean()))

  got = loss_and_grads(flash)(params)
  reference = numerics.float64_reference(loss_and_grads(exact), params)
  expected = loss_and_grads(plain)(params)
  numerics.assert_as_close_as_plain(got[0], expected[0], reference[0], factor=FACTOR,
                                    what="loss")
  numerics.assert_as_close_as_plain(got[1], expected[1], reference[1], factor=FACTOR,
                                    what="gradients")


@pytest.mark.parametrize("make, match", [
    (lambda: flash_attention.check("flsh"), r"attention='flsh' is not one of .*'blocked'"),
    (lambda: flash_attention.check("flash", seq_len=100),
     r"seq_len=100 is not a multiple of 128; pad .* or use attention='blocked'"),
    (lambda: flash_attention.check("flash", dropout_rate=0.1),
     r"dropout_rate=0.1; set the dropout to 0 or use attention='blocked'"),
    (lambda: flash_attention.resolve("flash", "cpu"),
     r"the devices are 'cpu'; use attention='blocked'"),
    (lambda: flash_attention.resolve("splash", "gpu"), r"'splash' runs on 'tpu' only"),
    (lambda: flash_attention.resolve("flash", "gpu", jnp.float32),
     r"'cudnn' is cuDNN's .* compute in float32; use dtype='bfloat16'"),
    (lambda: blocks.LlamaBlock(width=32, num_heads=4, num_kv_heads=2, mlp_dim=64,
                               attention="pallas"), r"LlamaBlock.attention='pallas'"),
    (lambda: blocks.TransformerBlock(width=32, num_heads=4, mlp_dim=64, attention="flash"),
     r"attends causally; set causal=True"),
    (lambda: blocks.TransformerBlock(width=32, num_heads=4, mlp_dim=64, causal=True,
                                     dropout_rate=0.1, attention="flash"),
     r"no dropout on the attention weights"),
    (lambda: models.decoder_lm(num_layers=2, width=32, num_heads=4, mlp_dim=64, max_len=128,
                               num_stages=1, num_microbatches=1, attention="triton"),
     r"attention='triton' is not one of"),
    (lambda: models.decoder_lm(num_layers=2, width=32, num_heads=4, mlp_dim=64, max_len=128,
                               num_stages=1, num_microbatches=1, attention="flash",
                               mesh=tpipe.make_mesh(stages=1)),
     r"attention='flash' .* the devices are 'cpu'"),
])
def test_bad_settings_raise_before_tracing(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_flash_resolves_to_the_platforms_kernel():
  assert flash_attention.resolve("flash", "tpu") == "splash"
  assert flash_attention.resolve("flash", "gpu", jnp.bfloat16) == "cudnn"
  assert flash_attention.resolve("blocked", "cpu") == "blocked"
  assert flash_attention.resolve("splash_interpret", "cpu") == "splash_interpret"


def test_flash_traced_for_a_platform_without_a_kernel_raises():
  query, key, value, _ = _inputs(4, 2)
  with pytest.raises(ValueError, match=r"the devices are 'cpu'; use attention='blocked'"):
    flash_attention.causal_attention(query, key, value, implementation="flash")
  block = blocks.LlamaBlock(width=32, num_heads=4, num_kv_heads=2, mlp_dim=64, attention="flash")
  with pytest.raises(ValueError, match="attention='flash' runs splash attention on TPU"):
    block.init(jax.random.key(0), jnp.zeros((1, 128, 32)))


def test_the_trainer_config_checks_attention():
  from configs import lm  # pylint: disable=g-import-not-at-top
  from tpipe.train.cli import tasks  # pylint: disable=g-import-not-at-top

  config = lm.get_config("size=tiny")
  assert config.attention == "blocked"
  task = tasks.get_task(config)
  config.attention, config.seq_len = "flash", 128
  task.validate(config)  # The platform is the mesh's: decoder_lm checks it.
  config.seq_len = 100
  with pytest.raises(ValueError, match=r"config.attention='flash' .* seq_len=100"):
    task.validate(config)
  config.seq_len, config.frontend = 128, "nnx"
  with pytest.raises(ValueError, match=r"config.attention='flash': the NNX LM .*='blocked'"):
    task.validate(config)


def test_flash_compiles_to_the_splash_kernel_for_a_tpu_slice():
  """On the devices of a TPU topology (``jax.set_mesh``), ``"flash"`` is splash attention: its
  forward and two backward kernels are Mosaic custom calls, run on each device's rows and
  heads (no gather of the operands)."""
  try:
    devices = tpipe.topology_devices("v5p:2x2x2")
  except ValueError as error:
    pytest.skip(f"the TPU compiler is not installed here: {error}")
  mesh = jax.sharding.Mesh(np.array(devices).reshape(4, 2), ("data", "tensor"),
                           axis_types=(jax.sharding.AxisType.Auto,) * 2)
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None, "tensor"))
  shapes = [jax.ShapeDtypeStruct((8, 256, heads, 128), jnp.bfloat16, sharding=split)
            for heads in (4, 2, 2)]
  shapes.append(jax.ShapeDtypeStruct((8, 256), jnp.int32, sharding=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("data"))))

  def loss(query, key, value, segment_ids):
    out = flash_attention.causal_attention(query, key, value, implementation="flash",
                                           segment_ids=segment_ids, sliding_window=100)
    return jnp.sum(out.astype(jnp.float32))

  with jax.set_mesh(mesh):
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*shapes).compile().as_text()
  assert text.count("custom_call_target=\"tpu_custom_call\"") == 3
  assert "all-gather" not in text


@pytest.mark.parametrize("case", ["packed documents in a window", "grouped query"])
def test_the_cudnn_call_asks_for_the_same_attention(case, monkeypatch):
  """No GPU here: ``"cudnn"``'s call of ``jax.nn.dot_product_attention`` is run by that
  function's XLA implementation instead, in bfloat16 (cuDNN's dtype), and equals the blocked
  attention by the numerics rule: its causal flag, window and segment mask say the same."""
  calls = []
  original = jax.nn.dot_product_attention

  def as_xla(*args, implementation=None, **kwargs):
    calls.append(implementation)
    return original(*args, implementation="xla", **kwargs)

  monkeypatch.setattr(jax.nn, "dot_product_attention", as_xla)
  heads, kv_heads, window, packed = CASES[case]
  segment_ids = _packed() if packed else None
  query, key, value, _ = (a.astype(jnp.bfloat16) for a in _inputs(heads, kv_heads))
  cudnn = lambda q, k, v, s, w: flash_attention.causal_attention(
      q, k, v, implementation="cudnn", segment_ids=s, sliding_window=w)
  got = jax.jit(cudnn, static_argnums=4)(query, key, value, segment_ids, window)
  plain = jax.jit(_blocked, static_argnums=4)(query, key, value, segment_ids, window)
  reference = numerics.float64_reference(jax.jit(_blocked, static_argnums=4), query, key,
                                         value, segment_ids, window)
  assert calls == ["cudnn"]
  numerics.assert_as_close_as_plain(got, plain, reference, factor=FACTOR, what=case)


def test_splash_lowered_for_this_cpu_is_the_blocked_attention():
  """``"splash"`` traced without a TPU mesh on a machine without a TPU (tpipe's planner compiles
  each unit here to count its FLOPs for a step compiled for a TPU topology) lowers to the
  blocked attention for this CPU: the same output and gradients."""
  segment_ids = _packed()
  splash = lambda q, k, v, s, w: flash_attention.causal_attention(
      q, k, v, implementation="splash", segment_ids=s, sliding_window=w)
  inputs = _inputs(4, 2)
  got = _output_and_gradients(splash, segment_ids, 48)(*inputs)
  want = _output_and_gradients(_blocked, segment_ids, 48)(*inputs)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
