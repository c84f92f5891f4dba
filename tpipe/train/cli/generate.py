r"""Text from a prompt, greedy or sampled, with a key/value cache (``tpipe.train.cli.generate``).

Usage::

  python -m tpipe.train.cli.generate --workdir=/tmp/run --prompt="def main(" --max_new_tokens=64
  python -m tpipe.train.cli.generate --init_from=/models/llama \
      --tokenizer=/models/llama/tokenizer.json --prompt="Once upon a time" --temperature=0.8

A first, simple version, for checking a model: it runs the model's layers one after the other on
one device (no pipeline; the model must fit the device), the prompt in one pass that fills each
block's key/value cache, then one token per step reading the cache. ``--temperature=0`` picks the
most likely token (greedy); above 0 it samples from the softmax of the logits divided by the
temperature (``--seed``). Generation stops after ``--max_new_tokens`` tokens or at the
end-of-document token.
"""

from __future__ import annotations

import functools

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from tpipe.train import architecture
from tpipe.train import models
from tpipe.train import tokenization
from tpipe.train.cli import loading
from tpipe.train.cli import startup


class Generator:
  """The model's layers applied one after the other with a key/value cache per block.

  Args:
    config: the model's config (architecture fields, ``dtype``).
    params: logical parameters.
  """

  def __init__(self, config, params):
    arguments = dict(architecture.lm_arguments(config), dropout_rate=0.0)
    self.embed, repeat, self.head = models.lm_layers(**arguments)
    self.block, self.num_layers = repeat.module, repeat.n
    heads = arguments["num_heads"]
    self.kv_heads = (arguments["num_kv_heads"] or heads) if arguments["block"] in (
        "llama", "moe") else heads
    self.head_dim = arguments["head_dim"] or arguments["width"] // heads
    self.max_len = arguments["max_len"]
    self.dtype = arguments["dtype"]
    self.params = jax.device_put(params)

  def _forward(self, params, tokens, positions, caches):
    x = self.embed.apply({"params": params["layers_0"]}, tokens, positions=positions)

    def layer(x, weights_and_cache):
      weights, cache = weights_and_cache
      return self.block.apply({"params": weights}, x, positions=positions, cache=cache)

    x, caches = jax.lax.scan(layer, x, (params["layers_1"], caches))
    return self.head.apply({"params": params["layers_2"]}, x[:, -1:])[:, 0], caches

  @functools.partial(jax.jit, static_argnums=(0, 3))
  def _run(self, params, prompt, max_new_tokens, temperature, key):
    batch, length = prompt.shape
    cache = models.init_cache(batch, length + max_new_tokens, self.kv_heads, self.head_dim,
                              self.dtype)
    caches = jax.tree.map(lambda a: jnp.broadcast_to(a, (self.num_layers,) + a.shape), cache)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    logits, caches = self._forward(params, prompt, positions, caches)

    def pick(logits, key):
      greedy = jnp.argmax(logits, axis=-1)
      scaled = logits / jnp.maximum(temperature, 1e-6)
      sampled = jax.random.categorical(key, scaled.astype(jnp.float32), axis=-1)
      return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)

    def step(carry, i):
      logits, caches, key = carry
      key, now = jax.random.split(key)
      token = pick(logits, now)
      where = jnp.full((batch, 1), length + i, jnp.int32)
      logits, caches = self._forward(params, token[:, None], where, caches)
      return (logits, caches, key), token

    _, tokens = jax.lax.scan(step, (logits, caches, key), jnp.arange(max_new_tokens))
    return tokens.T

  def generate(self, prompt, max_new_tokens: int, *, temperature: float = 0.0,
               seed: int = 0) -> np.ndarray:
    """``max_new_tokens`` tokens after each row of ``prompt`` (int ``[batch, length]``, rows of
    equal length), as int32 ``[batch, max_new_tokens]``.

    Raises:
      ValueError: prompt and new tokens exceed the model's ``max_len``, or an empty prompt.
    """
    prompt = np.asarray(prompt, np.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
      raise ValueError(f"the prompt must be [batch, length >= 1] token ids, got shape "
                       f"{prompt.shape}.")
    if prompt.shape[1] + max_new_tokens > self.max_len:
      raise ValueError(f"{prompt.shape[1]} prompt tokens + {max_new_tokens} new ones exceed the "
                       f"model's {self.max_len} positions; ask for fewer --max_new_tokens.")
    return np.asarray(self._run(self.params, prompt, max_new_tokens, float(temperature),
                                jax.random.key(seed)))


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines the command line's flags (called when run as a program)."""
  loading.define_source_flags("use")
  flags.DEFINE_string(
      "tokenizer", "",
      "A tokenizer.json, SentencePiece .model or 'bytes' (default: the run's).")
  flags.DEFINE_string("prompt", "", "The text to continue.")
  flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most.")
  flags.DEFINE_float(
      "temperature", 0.0,
      "0: greedy; above 0: sample from softmax(logits / temperature).")
  flags.DEFINE_integer("seed", 0, "Seed of the sampling.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  startup.quiet_absent_tpu()
  model = loading.load(workdir=FLAGS.workdir, init_from=FLAGS.init_from, step=FLAGS.step,
                       tokenizer=FLAGS.tokenizer)
  config = model.config
  tokenizer = tokenization.load(config.tokenizer, config.eod_token)
  prompt = tokenizer.encode_batch([FLAGS.prompt])[0]
  if not prompt:
    raise ValueError("--prompt is empty and the tokenizer adds no start token; give a prompt.")
  if not config.get("max_len"):
    config.max_len = len(prompt) + FLAGS.max_new_tokens
  new = Generator(config, model.params).generate(
      [prompt], FLAGS.max_new_tokens, temperature=FLAGS.temperature, seed=FLAGS.seed)[0].tolist()
  if tokenizer.eod_id in new:
    new = new[:new.index(tokenizer.eod_id)]
  print(FLAGS.prompt + tokenizer.decode(new))


if __name__ == "__main__":
  define_flags()
  startup.run(main, doc=__doc__)
