r"""Perplexity of a model on a data source: ``python -m tpipe.train.cli.evaluate``.

Usage::

  # A run's latest checkpoint, on held-out files (its tokenizer and sequence length).
  python -m tpipe.train.cli.evaluate --workdir=/tmp/run --data='data/test/*.jsonl'
  # An imported Hugging Face checkpoint.
  python -m tpipe.train.cli.evaluate --init_from=/models/llama \
      --tokenizer=/models/llama/tokenizer.json --data=data/test.jsonl --seq_len=512

The documents are tokenized and packed as for training (:mod:`tpipe.train.document_packing`: each
followed by the end-of-document token, segment ids and positions keeping them apart) into
windows read once, in order; every target whose input is in the same document counts once. The
result is the mean cross-entropy per token (nats) and its exponential, the perplexity:
``{"loss": ..., "perplexity": ..., "tokens": ...}``, printed as JSON.

The model runs pipelined over ``--num_stages`` stages x ``--num_data`` replicas (on a CPU-only
machine that many devices are emulated), micro-batched as ``--num_microbatches`` says.
"""

from __future__ import annotations

import json
import math

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import tpipe
from tpipe.train import architecture
from tpipe.train import data as data_lib
from tpipe.train import document_packing
from tpipe.train import models
from tpipe.train import sources
from tpipe.train import tokenization
from tpipe.train.cli import loading
from tpipe.train.cli import startup


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines the command line's flags (called when run as a program)."""
  loading.define_source_flags("evaluate")
  flags.DEFINE_string(
      "data", None,
      "The documents: a path or glob of text, JSONL, Parquet or ArrayRecord files (several "
      "separated by commas).")
  flags.DEFINE_string("data_format", "", "The files' format ('' from each suffix).")
  flags.DEFINE_string(
      "text_field", "",
      "The JSONL field or Parquet column of the text (default: the run's, else 'text').")
  flags.DEFINE_string(
      "tokenizer", "",
      "A tokenizer.json, SentencePiece .model or 'bytes' (default: the run's).")
  flags.DEFINE_integer("seq_len", 0, "Tokens per window (default: the run's, else 1024).")
  flags.DEFINE_integer("batch_size", 8, "Windows per batch.")
  flags.DEFINE_integer("num_stages", 1, "Pipeline stages.")
  flags.DEFINE_integer("num_data", 1, "Data-parallel replicas.")
  flags.DEFINE_integer("num_microbatches", 1, "Micro-batches per replica's batch.")


def perplexity(config, params, packed: document_packing.PackedTokens, *, batch_size: int = 8,
               num_stages: int = 1, num_data: int = 1, num_microbatches: int = 1,
               devices=None) -> dict[str, float]:
  """The mean per-token cross-entropy and perplexity of the model on every window of
  ``packed``.

  Args:
    config: the model's config (architecture fields, ``seq_len``, ``dtype``).
    params: logical parameters.
    packed: the token windows (:class:`tpipe.train.document_packing.PackedTokens`).
    batch_size: windows per batch (a multiple of ``num_data * num_microbatches``).
    num_stages, num_data, num_microbatches: the pipeline and its mesh.
    devices: the mesh's devices (default the first ``num_stages * num_data``).

  Returns:
    ``{"loss": nats per token, "perplexity": exp(loss), "tokens": counted targets}``.
  """
  if batch_size % (num_data * num_microbatches):
    raise ValueError(f"--batch_size={batch_size} must be a multiple of --num_data * "
                     f"--num_microbatches = {num_data * num_microbatches}.")
  mesh = tpipe.make_mesh(stages=num_stages, data=num_data, devices=devices)
  # The language model's loss alone: a mixture's router losses are training's.
  arguments = dict(architecture.lm_arguments(config), dropout_rate=0.0, router_aux_loss_coef=0.0,
                   router_z_loss_coef=0.0)
  model = models.decoder_lm(**arguments, num_stages=num_stages,
                            num_microbatches=num_microbatches, mesh=mesh, remat="none")
  sharding = tpipe.data_sharding(mesh)

  @jax.jit
  def sums(params, batch):
    keywords = {k: batch[k] for k in ("targets", "segment_ids", "positions")}
    # Per example: mean over positions of loss * mask, so times seq_len the masked sum.
    losses = model.apply({"params": params}, batch["inputs"], loss_weights=batch["loss_mask"],
                         **keywords) * batch["inputs"].shape[1]
    rows = batch["mask"].astype(jnp.float32)
    return (losses * rows).sum(), (batch["loss_mask"].sum(axis=1) * rows).sum()

  params = jax.device_put(params)
  total = count = 0.0
  for batch in document_packing.in_order(packed, batch_size=batch_size):
    batch = data_lib.to_global({k: np.asarray(v) for k, v in batch.items()}, sharding)
    loss, tokens = jax.device_get(sums(params, batch))
    total, count = total + float(loss), count + float(tokens)
  return {"loss": total / count, "perplexity": math.exp(total / count), "tokens": int(count)}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not FLAGS.data:
    raise ValueError("--data is required: a path or glob of the documents to evaluate on.")
  startup.quiet_absent_tpu()
  if startup.user_cpu_device_count() is None:
    jax.config.update("jax_num_cpu_devices", FLAGS.num_stages * FLAGS.num_data)
  model = loading.load(workdir=FLAGS.workdir, init_from=FLAGS.init_from, step=FLAGS.step,
                       tokenizer=FLAGS.tokenizer, seq_len=FLAGS.seq_len,
                       text_field=FLAGS.text_field)
  config = model.config
  tokenizer = tokenization.load(config.tokenizer, config.eod_token)
  documents = sources.read(sources.expand(FLAGS.data), FLAGS.data_format or config.data_format,
                           config.text_field)
  packed = document_packing.PackedTokens.of(
      tokenizer.encode_batch([d.text for d in documents]), tokenizer.eod_id,
      seq_len=config.seq_len)
  result = perplexity(config, model.params, packed, batch_size=FLAGS.batch_size,
                      num_stages=FLAGS.num_stages, num_data=FLAGS.num_data,
                      num_microbatches=FLAGS.num_microbatches)
  print(json.dumps({"model": model.source, **result}))


if __name__ == "__main__":
  define_flags()
  startup.run(main, doc=__doc__)
