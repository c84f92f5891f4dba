"""Packed documents in the LM: with segment ids and positions restarting per document, each
document's logits are its logits alone (a mask that lets documents see each other fails)."""

import functools

import jax
import jax.numpy as jnp
import pytest

from tests.helpers import numerics
from tpipe.train import document_packing
from tpipe.train import models

SIZES = dict(num_layers=2, width=32, num_heads=4, mlp_dim=48, max_len=16, vocab_size=40)
BLOCKS = {
    "gpt": dict(block="gpt"),
    "llama": dict(block="llama", num_kv_heads=2, positions="rotary", final_norm="rms",
                  head_bias=False, qkv_bias=True),
}
DOCUMENTS = [[3, 7, 1, 9, 4], [5, 2, 8, 8, 6, 1, 3], [2]]  # Packed with EOD 0: 16 tokens.


def _model(dtype, block):
  return models.decoder_lm(**SIZES, **BLOCKS[block], dtype=dtype, param_dtype=dtype,
                           num_stages=1, num_microbatches=1)


def _logits(block, params, tokens, segment_ids=None, positions=None):
  keywords = {k: v for k, v in (("segment_ids", segment_ids), ("positions", positions))
              if v is not None}
  dtype = jax.tree.leaves(params)[0].dtype
  return _model(dtype, block).apply({"params": params}, tokens, **keywords)


def _alone(block, params, documents):
  """Each document (with its EOD) run by itself, the logits joined in packing order."""
  return jnp.concatenate([_logits(block, params, jnp.asarray([d + [0]])) for d in documents],
                         axis=1)


@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_packed_documents_see_only_themselves(block):
  packed = document_packing.PackedTokens.of(DOCUMENTS, 0, seq_len=15)[0]
  tokens = jnp.asarray(packed["inputs"])[None]
  params = jax.jit(_model(jnp.float32, block).init)(jax.random.key(0), tokens)["params"]
  run = jax.jit(functools.partial(_logits, block))
  packed_logits = run(params, tokens, jnp.asarray(packed["segment_ids"])[None],
                      jnp.asarray(packed["positions"])[None])
  # The last document's EOD is the window's 16th token, a target only: compare 15 positions.
  alone = jax.jit(functools.partial(_alone, block))
  plain = alone(params, DOCUMENTS)[:, :15]
  exact = numerics.float64_reference(alone, params, DOCUMENTS)[:, :15]
  numerics.assert_as_close_as_plain(packed_logits, plain, exact,
                                    what=f"packed {block} logits")
  # Without the segment ids (and positions) the later documents see the earlier ones.
  leaky = run(params, tokens)
  assert float(jnp.abs(leaky[:, 5:] - plain[:, 5:]).max()) > 1e-3
