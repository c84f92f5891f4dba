"""The LM's architecture in a config: its fields, their defaults, and what fills them in.

The LM task (:mod:`tpipe.train.cli.tasks`) builds :func:`tpipe.train.models.decoder_lm` from the
fields of :data:`DEFAULTS` (``configs/lm.py`` documents each). Two things can set them instead
of the config (:func:`resolve`, which the trainer and the other entry points call first):

* ``config.init_from``: a Hugging Face checkpoint directory or another run's workdir; the
  architecture is that model's (:func:`tpipe.train.pretrained.architecture_of`), whatever the
  config says, so its weights fit.
* ``config.tokenizer``: ``config.vocab_size = 0`` means the tokenizer's vocabulary size.

A config without these fields (an older one) gets the defaults, which are the byte-level LM's.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import ml_collections

from tpipe.train import architecture_fields as fields_lib
from tpipe.train import losses
from tpipe.train import pretrained
from tpipe.train import tokenization

DEFAULTS = fields_lib.DEFAULTS
FIELDS = fields_lib.FIELDS


def value(config, name: str):
  """``config.name``, or its default (:data:`DEFAULTS`) where the config lacks the field."""
  return config.get(name, DEFAULTS.get(name))


def resolve(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """``config`` with the architecture filled in: ``init_from``'s model, the tokenizer's
  vocabulary size. Returns ``config`` itself when nothing changes, else an unlocked copy.

  Raises:
    ValueError: ``init_from`` is not a model directory (see
      :func:`tpipe.train.pretrained.architecture_of`) or the tokenizer cannot be read.
  """
  updates = {}
  source = config.get("init_from", "")
  if source:
    updates.update(pretrained.architecture_of(source))
  if not updates.get("vocab_size", value(config, "vocab_size")):
    updates["vocab_size"] = tokenization.load(config.get("tokenizer", tokenization.BYTES),
                                              config.get("eod_token", "")).vocab_size
  if all(config.get(k, object()) == v for k, v in updates.items()):
    return config
  resolved = ml_collections.ConfigDict(config.to_dict())
  for name, new in updates.items():
    resolved[name] = new
  return resolved


def rope_scaling(config) -> tuple | None:
  """``config.rope_scaling`` (Hugging Face's dict as JSON text, "" for none) as the sorted
  ``(key, value)`` pairs :class:`tpipe.train.models.LlamaBlock` takes."""
  text = value(config, "rope_scaling")
  if not text:
    return None
  try:
    scaling = json.loads(text) if isinstance(text, str) else dict(text)
  except json.JSONDecodeError:
    raise ValueError(f"config.rope_scaling={text!r} is not JSON; write e.g. "
                     "'{\"rope_type\": \"linear\", \"factor\": 2.0}' or '' for none.") from None
  return tuple(sorted((k, v) for k, v in scaling.items() if not isinstance(v, (list, dict))))


def lm_arguments(config) -> dict:
  """The keyword arguments of :func:`tpipe.train.models.decoder_lm` for ``config`` (resolved:
  :func:`resolve` first)."""
  config = resolve(config)
  head_dim = value(config, "head_dim") or None
  return dict(num_layers=config.num_layers, width=config.width, num_heads=config.num_heads,
              mlp_dim=config.mlp_dim, max_len=value(config, "max_len") or config.seq_len,
              vocab_size=config.vocab_size, dropout_rate=float(config.dropout),
              dtype=jnp.dtype(config.dtype), param_dtype=jnp.float32,
              vocab_chunks=vocab_chunks(config), block=value(config, "block"),
              num_kv_heads=value(config, "num_kv_heads"), positions=value(config, "positions"),
              rope_theta=float(value(config, "rope_theta")), rope_scaling=rope_scaling(config),
              norm_epsilon=float(value(config, "norm_epsilon")),
              final_norm=value(config, "final_norm"), head_bias=bool(value(config, "head_bias")),
              qkv_bias=bool(value(config, "qkv_bias")), head_dim=head_dim,
              sliding_window=value(config, "sliding_window") or None,
              num_experts=value(config, "num_experts"),
              experts_per_token=value(config, "experts_per_token"),
              capacity_factor=float(value(config, "capacity_factor")),
              normalize_expert_weights=value(config, "normalize_expert_weights"),
              shared_expert_mlp_dim=value(config, "shared_expert_mlp_dim"),
              router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.0)),
              router_z_loss_coef=float(config.get("router_z_loss_coef", 0.0)),
              attention=config.get("attention", "blocked"),
              moe_dispatch=config.get("moe_dispatch", "partitioner"),
              moe_exchange_chunks=config.get("moe_exchange_chunks", 1))


def vocab_chunks(config) -> int:
  """``config.vocab_chunks``, or for 0 the slices a micro-batch's logits on one device call for
  (:func:`tpipe.train.losses.auto_chunks`: the rows of a micro-batch split over data and fsdp,
  the vocabulary over tensor)."""
  chunks = config.get("vocab_chunks", 1)
  if chunks:
    return chunks
  mesh = config.get("mesh", {})
  rows = config.batch_size // (config.num_microbatches * config.get("num_data", 1)
                               * mesh.get("fsdp", 1))
  return losses.auto_chunks(max(1, rows) * config.seq_len, resolve(config).vocab_size,
                            mesh.get("tensor", 1))
