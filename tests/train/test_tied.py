"""Tied embeddings in a pipeline: the two copies (embedding on the first stage, head on the last)
stay bit for bit equal through training, and train as the one shared matrix of the plain model
does (its gradient the sum of both uses, clipped once)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tpipe
from configs import lm
from tests.helpers import numerics
from tests.helpers import train_runs
from tpipe.train import architecture
from tpipe.train import models
from tpipe.train import tied
from tpipe.train.cli import experiment

STEPS = 3


def _config():
  config = lm.get_config("size=tiny")
  config.block, config.positions, config.final_norm = "llama", "rotary", "rms"
  config.head_bias, config.tie_embeddings, config.num_kv_heads = False, True, 1
  config.num_stages, config.num_data, config.num_microbatches = 2, 2, 2
  config.batch_size, config.num_steps, config.remat = 8, STEPS, "none"
  config.learning_rate, config.grad_clip = 1e-2, 0.5  # Clipping active: the norm matters.
  return config


def _batches(config):
  rng = np.random.RandomState(0)
  shape = (STEPS, config.batch_size, config.seq_len)
  return {"inputs": rng.randint(0, 256, shape).astype(np.int32),
          "targets": rng.randint(0, 256, shape).astype(np.int32)}


def _plain_run(config, params, batches):
  """The plain LM with one shared matrix (the head reads the embedding's transpose), trained
  with the trainer's optimizer written out with optax on logical parameters."""
  dtype = train_runs.params_dtype(params)
  model = models.decoder_lm(**dict(architecture.lm_arguments(config), dtype=dtype,
                                   param_dtype=dtype), num_stages=1, num_microbatches=1)
  shared = {**params, "layers_2": {**params["layers_2"], "head": {}}}
  tie = lambda p: {**p, "layers_2": {**p["layers_2"], "head": {
      "kernel": p["layers_0"]["embed"]["embedding"].T}}}
  optimizer = train_runs._optimizer_on_logical_params(  # pylint: disable=protected-access
      config, shared)

  def step(carry, batch):
    p, state = carry
    grads = jax.grad(lambda p: model.apply({"params": tie(p)}, batch["inputs"],
                                           targets=batch["targets"]).mean())(p)
    updates, state = optimizer.update(grads, state, p)
    return (optax.apply_updates(p, updates), state), None

  final = jax.lax.scan(step, (shared, optimizer.init(shared)), batches)[0][0]
  return tie(final)


def test_tied_copies_stay_equal_and_train_as_one_matrix():
  """Under 1F1B on 2 stages x 2 replicas (the head's gradient formed in the schedule's fused
  backward on the last stage, the embedding's on the first)."""
  config = _config()
  config.schedule = "1f1b"
  exp = experiment.build(config)
  state = exp.init_state(jax.random.key(0))
  initial = jax.device_get(exp.to_checkpoint(state).params)
  assert tied.are_equal(initial)
  batches = _batches(config)
  sharding = tpipe.data_sharding(exp.mesh)
  for i in range(STEPS):
    batch = {k: jax.device_put(v[i], sharding) for k, v in batches.items()}
    state, _ = exp.train_step(state, batch, jax.random.key(i))
  trained = jax.device_get(exp.to_checkpoint(state).params)
  assert tied.are_equal(trained)  # Bit for bit, after updates from both stages.
  assert not np.array_equal(trained["layers_0"]["embed"]["embedding"],
                            initial["layers_0"]["embed"]["embedding"])
  plain = functools.partial(_plain_run, config)
  numerics.assert_as_close_as_plain(
      trained, jax.jit(plain)(initial, batches),
      numerics.float64_reference(plain, initial, batches), what="tied parameters")


def test_tying_needs_a_head_without_bias():
  params = {"layers_0": {"embed": {"embedding": jnp.zeros((4, 2))}},
            "layers_1": {}, "layers_2": {"head": {"kernel": jnp.zeros((2, 4)),
                                                  "bias": jnp.zeros(4)}}}
  with pytest.raises(ValueError, match="config.head_bias=False"):
    tied.synchronized(params)
