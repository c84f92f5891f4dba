"""What the trainer trains: a task pairs a pipelined model with its data and its metrics.

The trainer (:mod:`tpipe.train.cli.trainer`) and the experiment builder
(:mod:`tpipe.train.cli.experiment`) are the same for every task; ``config.task`` picks one of:

* ``"lm"`` (:class:`LanguageModelling`): the byte-level decoder LM on the Python standard
  library's source (``configs/lm.py``); batches ``{"inputs", "targets"}``, metric: loss.
* ``"image_classification"`` (:class:`ImageClassification`): the ResNet-style convnet with
  BatchNorm on the UCI handwritten digits (``configs/convnet.py``); batches
  ``{"images", "labels"}`` (evaluation adds ``"mask"``), metrics: loss and accuracy.

In both the model is a :class:`tpipe.Sequential` whose last layer returns one loss per example
when given the labels, and logits without them.

``config.frontend`` (``"linen"``, the default, or ``"nnx"``; the LM only) picks how the model is
written. With ``"nnx"`` the LM is the Flax NNX one (:mod:`tpipe.train.models_nnx`), whose logical
variables have the linen LM's names and shapes, so both front ends write and resume the same
checkpoints. Either way the trainer runs the model's engine pipeline
(:meth:`tpipe.Sequential.pipeline_for`, :meth:`tpipe.nnx.Sequential.pipeline_for`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import tpipe
from tpipe import spec as spec_lib
from tpipe.train import architecture
from tpipe.train import convnet
from tpipe.train import data as text_data
from tpipe.train import document_packing
from tpipe.train import flash_attention
from tpipe.train import images
from tpipe.train import losses
from tpipe.train import models
from tpipe.train import models_nnx
from tpipe.train import sources
from tpipe.train import tokenization

FRONTENDS = ("linen", "nnx")


def frontend(config) -> str:
  """``config.frontend``, ``"linen"`` when absent; raises for another value."""
  name = config.get("frontend", "linen")
  if name not in FRONTENDS:
    raise ValueError(f"config.frontend must be one of {FRONTENDS}, got {name!r}.")
  return name


def remat_granularity(config) -> str | int:
  """``config.remat_granularity``: ``"nested"`` when absent; a string of digits (as
  ``--config.remat_granularity=2`` gives it) is the int k. Raises for a bad value."""
  value = config.get("remat_granularity", "nested")
  if isinstance(value, str) and value.isdigit():
    value = int(value)
  try:
    spec_lib.check_remat_granularity(value)
  except (ValueError, TypeError) as error:
    raise type(error)(f"config.remat_granularity: {error}") from None
  return value


def _linen_init(model: tpipe.Sequential, rng, x, kwargs) -> dict:
  """The model's initial variables, unboxed (the trainer places them by its stage layout);
  created without running the pipeline (``Sequential.initialize``), whose output init drops."""
  return nn.meta.unbox(model.init({"params": rng}, x, method="initialize", **kwargs))


def lm_arguments(config) -> dict:
  """The LM's own settings from ``config`` (the pipeline's are in the spec)."""
  return architecture.lm_arguments(config)


def _check_int(config, name: str, minimum: int = 1) -> None:
  value = config.get(name)
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"config.{name} must be an int, got {value!r}.")
  if value < minimum:
    raise ValueError(f"config.{name} must be >= {minimum}, got {value}.")


@dataclasses.dataclass
class TaskData:
  """A task's data for one run.

  Attributes:
    train: a checkpointable iterator of global training batches (``get_state``/``set_state``).
    eval_batches: the evaluation batches (host arrays), each with the training batch's shapes
      plus a bool ``mask`` ``[batch]`` (False on padding).
    spec: what the saved iterator position means (config fields, a hash of the data); a
      resumed run must see the same.
  """

  train: Iterator[dict[str, np.ndarray]]
  eval_batches: list[dict[str, np.ndarray]]
  spec: dict[str, Any]


# Where config.data is the Python standard library's source (tpipe.train.data), not files.
STDLIB = "stdlib"


def uses_files(config) -> bool:
  """Whether ``config.data`` names files (packed documents) rather than the stdlib corpus."""
  return config.get("data", STDLIB) != STDLIB


class LanguageModelling:
  """Next-token prediction with :func:`tpipe.train.models.decoder_lm`.

  ``config.data`` is ``"stdlib"`` (the byte corpus of :mod:`tpipe.train.data`, batches
  ``{"inputs", "targets"}``) or files (:mod:`tpipe.train.sources`) tokenized with
  ``config.tokenizer`` and packed (:mod:`tpipe.train.document_packing`): batches then also carry
  ``loss_weights``, ``segment_ids`` and ``positions``, which keep the documents apart.
  """

  name = "lm"
  fields = ("num_layers", "width", "num_heads", "mlp_dim", "seq_len", "dropout",
            "max_corpus_bytes", "eval_fraction", "eval_batches")
  data_fields = ("batch_size", "seq_len", "seed", "max_corpus_bytes", "eval_fraction")
  # Further data fields (optional in a config; a resumed run must see the same values).
  file_data_fields = ("data", "data_format", "text_field", "eval_data", "tokenizer", "eod_token")
  train_keywords = {"deterministic": False}
  measures_accuracy = False
  # Why fused schedules ("1f1b", ...) cannot train this task, or None when they can (the LMHead
  # returns per-example losses, which a fused stack reduces to the mean loss).
  no_fused_schedules = None

  def validate(self, config) -> None:
    for name in ("num_layers", "width", "num_heads", "mlp_dim", "seq_len", "max_corpus_bytes",
                 "eval_batches"):
      _check_int(config, name)
    if not 0.0 < config.get("eval_fraction", 0.0) < 1.0:
      raise ValueError(f"config.eval_fraction must be in (0, 1), got {config.eval_fraction!r}.")
    smallest = 16 * (config.seq_len + 1)  # What data.TextData.load accepts.
    kernel = flash_attention.check(config.get("attention", "blocked"), seq_len=config.seq_len,
                                   dropout_rate=config.dropout, owner="config.attention")
    if frontend(config) == "nnx" and kernel != "blocked":
      raise ValueError(f"config.attention={kernel!r}: the NNX LM attends the blocked way only; "
                       "use config.frontend='linen' or config.attention='blocked'.")
    if frontend(config) == "nnx":
      changed = [f"{name}={architecture.value(config, name)!r}"
                 for name in ("block", "positions", "final_norm", "head_bias", "init_from",
                              "tie_embeddings")
                 if config.get(name, architecture.DEFAULTS.get(name, ""))
                 != architecture.DEFAULTS.get(name, "")]
      if uses_files(config):
        changed.append(f"data={config.data!r}")
      if changed:
        raise ValueError(f"config.{', config.'.join(changed)}: the NNX LM is the byte-level "
                         "GPT LM on the stdlib corpus only (no packed documents, no pretrained "
                         "architectures); use config.frontend='linen'.")
    if uses_files(config):
      sources.format_of(None, config.get("data_format", ""))  # Checks the name.
    tokenizer = tokenization.load(config.get("tokenizer", tokenization.BYTES),
                                  config.get("eod_token", ""))
    if not uses_files(config) and tokenizer.fingerprint != tokenization.BYTES:
      raise ValueError(f"config.tokenizer={config.tokenizer!r} needs text files: the stdlib "
                       "corpus is bytes. Set --config.data to a path or glob of your files.")
    vocab = architecture.resolve(config).vocab_size
    if vocab < tokenizer.vocab_size:
      where = (f"the model in config.init_from={config.init_from!r}"
               if config.get("init_from", "") else "config.vocab_size")
      raise ValueError(f"{where} has {vocab} token ids, fewer than the tokenizer "
                       f"{config.get('tokenizer', 'bytes')!r} makes ({tokenizer.vocab_size}); "
                       "use the model's own tokenizer (or config.vocab_size=0 for the "
                       "tokenizer's).")
    try:
      if config.get("vocab_chunks", 1) != 0:  # 0: as many as the logits call for.
        losses.check_num_chunks(config.get("vocab_chunks", 1), vocab)
    except (ValueError, TypeError) as error:
      raise type(error)(f"config.vocab_chunks: {error}") from None
    if not uses_files(config) and config.max_corpus_bytes < smallest:
      raise ValueError(
          f"config.max_corpus_bytes={config.max_corpus_bytes} is too small for "
          f"config.seq_len={config.seq_len}; use at least {smallest} (a few MB is typical).")

  def _nnx_model(self, config, spec, key):
    from flax import nnx  # Only the NNX front end needs it.
    arguments = lm_arguments(config)
    arguments = {k: arguments[k] for k in (
        "num_layers", "width", "num_heads", "mlp_dim", "max_len", "vocab_size", "dropout_rate",
        "dtype", "param_dtype", "vocab_chunks")}  # The NNX LM has the "gpt" block only.
    return models_nnx.decoder_lm(**arguments, spec=spec,
                                 rngs=nnx.Rngs(params=key, dropout=0))

  def make_model(self, config, spec: tpipe.PipelineSpec):
    """The LM (linen, or NNX with abstract state: nothing allocated)."""
    if frontend(config) == "nnx":
      from flax import nnx
      return nnx.eval_shape(lambda: self._nnx_model(config, spec, jax.random.key(0)))
    return models.decoder_lm(**lm_arguments(config), spec=spec)

  def init_variables(self, config, model, rng, x, kwargs) -> dict:
    """The initial logical variables (NNX: the NNX LM's own initialisation). With tied
    embeddings the head starts as the embedding's transpose."""
    if frontend(config) == "nnx":
      return self._nnx_model(config, model.spec, rng).variables()
    variables = _linen_init(model, rng, x, kwargs)
    if architecture.value(config, "tie_embeddings"):
      from tpipe.train import tied  # pylint: disable=g-import-not-at-top
      variables = dict(variables, params=tied.synchronized(variables["params"]))
    return variables

  def batch_shapes(self, config) -> dict[str, jax.ShapeDtypeStruct]:
    shape = (config.batch_size, config.seq_len)
    shapes = {"inputs": jax.ShapeDtypeStruct(shape, jnp.int32),
              "targets": jax.ShapeDtypeStruct(shape, jnp.int32)}
    if uses_files(config):
      shapes.update(loss_weights=jax.ShapeDtypeStruct(shape, jnp.float32),
                    segment_ids=jax.ShapeDtypeStruct(shape, jnp.int32),
                    positions=jax.ShapeDtypeStruct(shape, jnp.int32))
    return shapes

  def model_inputs(self, batch) -> tuple[Any, dict[str, Any]]:
    keywords = {k: batch[k] for k in models.PER_EXAMPLE if k in batch}
    return batch["inputs"], keywords

  def load_data(self, config) -> TaskData:
    if uses_files(config):
      return self._load_files(config)
    train, held_out = text_data.TextData.load(
        seq_len=config.seq_len, max_bytes=config.max_corpus_bytes,
        eval_fraction=config.eval_fraction)
    spec = {name: config[name] for name in self.data_fields}
    spec["corpus_sha256"] = hashlib.sha256(train.tokens.tobytes()).hexdigest()
    return _task_data(text_data, train, held_out, config, spec)

  def _load_files(self, config) -> TaskData:
    train, held_out = packed_splits(config)
    spec = {name: config[name] for name in ("batch_size", "seq_len", "seed")}
    spec.update({name: config.get(name, "") for name in self.file_data_fields})
    if not config.get("eval_data", ""):
      spec["eval_fraction"] = config.eval_fraction
    spec["corpus_sha256"] = train.fingerprint()
    return _task_data(document_packing, train, held_out, config, spec)


def _task_data(source, train, held_out, config, spec: dict) -> TaskData:
  """The LM's :class:`TaskData` from a train and a held-out split of ``source``'s kind (the byte
  corpus, :mod:`tpipe.train.data`, or packed documents, :mod:`tpipe.train.document_packing`: both
  give ``train_iterator`` and ``eval_batches``); every evaluation row counts (mask all true)."""
  batches = source.eval_batches(held_out, batch_size=config.batch_size,
                                num_batches=config.eval_batches)
  batches = [dict(b, mask=np.ones(config.batch_size, bool)) for b in batches]
  return TaskData(train=source.train_iterator(train, batch_size=config.batch_size,
                                              seed=config.seed),
                  eval_batches=batches, spec=spec)


def packed_splits(config) -> tuple[document_packing.PackedTokens, document_packing.PackedTokens]:
  """``(train, eval)`` packed token windows of ``config.data`` (eval: ``config.eval_data``'s
  files, or the ``config.eval_fraction`` of documents :func:`tpipe.train.sources.split` holds
  out), tokenized with ``config.tokenizer``."""
  tokenizer = tokenization.load(config.get("tokenizer", tokenization.BYTES),
                                config.get("eod_token", ""))
  data_format, field = config.get("data_format", ""), config.get("text_field", "text")
  documents = sources.read(sources.expand(config.data), data_format, field)
  if config.get("eval_data", ""):
    train = documents
    held_out = sources.read(sources.expand(config.eval_data), data_format, field)
  else:
    train, held_out = sources.split(documents, config.eval_fraction)
  pack = lambda part: document_packing.PackedTokens.of(
      tokenizer.encode_batch([d.text for d in part]), tokenizer.eod_id, seq_len=config.seq_len)
  return pack(train), pack(held_out)


class ImageClassification:
  """Digit classification with the ResNet-style :mod:`tpipe.train.convnet` and BatchNorm."""

  name = "image_classification"
  fields = ("width", "stage_sizes", "num_test", "max_shift", "bn_momentum")
  data_fields = ("batch_size", "seed", "num_test", "max_shift")
  train_keywords = {"train": True}
  measures_accuracy = True
  no_fused_schedules = ("its convnet has BatchNorm, whose batch statistics the fused executor "
                        "does not support")

  def validate(self, config) -> None:
    _check_int(config, "width")
    _check_int(config, "num_test")
    _check_int(config, "max_shift", minimum=0)
    sizes = tuple(config.stage_sizes)
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
      raise ValueError(f"config.stage_sizes must be ints >= 1, got {config.stage_sizes!r}.")
    if not 0.0 <= config.bn_momentum < 1.0:
      raise ValueError(f"config.bn_momentum must be in [0, 1), got {config.bn_momentum!r}.")
    if frontend(config) != "linen":
      raise ValueError("config.frontend='nnx' is available for the LM task only; the convnet "
                       "is written in linen.")

  def init_variables(self, config, model, rng, x, kwargs) -> dict:
    del config
    return _linen_init(model, rng, x, kwargs)

  def make_model(self, config, spec: tpipe.PipelineSpec) -> tpipe.Sequential:
    layers = convnet.resnet_layers(width=config.width, stage_sizes=tuple(config.stage_sizes),
                                   bn_momentum=config.bn_momentum,
                                   dtype=jnp.dtype(config.dtype), param_dtype=jnp.float32)
    return tpipe.Sequential(layers, spec.replace(per_example=("labels",)))

  def batch_shapes(self, config) -> dict[str, jax.ShapeDtypeStruct]:
    return {"images": jax.ShapeDtypeStruct((config.batch_size,) + images.IMAGE_SHAPE,
                                           jnp.float32),
            "labels": jax.ShapeDtypeStruct((config.batch_size,), jnp.int32)}

  def model_inputs(self, batch) -> tuple[Any, dict[str, Any]]:
    return batch["images"], {"labels": batch["labels"]}

  def correct(self, logits, batch):
    """1 where the most likely class is the label, else 0."""
    return (jnp.argmax(logits, -1) == batch["labels"]).astype(jnp.float32)

  def load_data(self, config) -> TaskData:
    train, test = images.DigitsData.load(num_test=config.num_test, seed=config.seed)
    spec = {name: config[name] for name in self.data_fields}
    spec["data_sha256"] = hashlib.sha256(train.images.tobytes()).hexdigest()
    return TaskData(train=images.train_iterator(train, batch_size=config.batch_size,
                                                seed=config.seed, max_shift=config.max_shift),
                    eval_batches=images.eval_batches(test, batch_size=config.batch_size),
                    spec=spec)


TASKS = {task.name: task for task in (LanguageModelling(), ImageClassification())}


def get_task(config: ml_collections.ConfigDict):
  """The task ``config.task`` names (``"lm"`` when the field is absent)."""
  name = config.get("task", "lm")
  if name not in TASKS:
    raise ValueError(f"config.task={name!r} is not one of {sorted(TASKS)}.")
  return TASKS[name]
