"""Tests for tpipe.train.experiment: building the mesh, model and steps from a config; AOT compile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import lm
from tpipe.train import experiment


def _config(**overrides):
  config = lm.get_config("size=tiny")
  for key, value in overrides.items():
    config[key] = value
  return config


@pytest.fixture(scope="module")
def exp():
  return experiment.build(_config())


def test_abstract_state_is_sharded_and_allocates_nothing(exp):
  state = exp.abstract_state()
  leaves = jax.tree.leaves(state)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  assert state.params["blocks"]["mlp_in"]["kernel"].sharding.spec == P("stage")
  assert state.params["embed"]["embedding"].sharding.spec == P()
  adam = state.opt_state[1][0]  # chain(clip, adamw) -> adamw's (ScaleByAdamState, ...).
  assert adam.mu["blocks"]["mlp_in"]["kernel"].sharding.spec == P("stage")
  assert adam.nu["head"]["kernel"].sharding.spec == P()
  batch = exp.abstract_batch()
  assert batch["inputs"].shape == (exp.config.batch_size, exp.config.seq_len)
  assert batch["inputs"].sharding.spec == P("data")
  assert exp.num_params() == sum(x.size for x in jax.tree.leaves(state.params))


def test_train_step_compiles_ahead_of_time(exp):
  compiled = exp.train_step.lower(
      exp.abstract_state(), exp.abstract_batch(), jax.random.key(0)).compile()
  assert compiled.memory_analysis() is not None
  assert "all-reduce" in compiled.as_text() or "all-gather" in compiled.as_text()


def test_init_state_and_steps(exp):
  state = exp.init_state(jax.random.key(0))
  abstract = exp.abstract_state()
  for leaf, want in zip(jax.tree.leaves(state), jax.tree.leaves(abstract)):
    assert leaf.shape == want.shape and leaf.sharding == want.sharding
  rng = np.random.default_rng(0)
  shape = (exp.config.batch_size, exp.config.seq_len)
  batch = {k: jnp.asarray(rng.integers(0, 256, shape), jnp.int32) for k in ("inputs", "targets")}
  batch = jax.device_put(batch, exp.abstract_batch()["inputs"].sharding)
  eval_loss = exp.eval_step(state.params, batch)
  # Dropout is 0 in the tiny config, so the training loss equals the eval loss.
  np.testing.assert_allclose(exp.loss_fn(state.params, batch, jax.random.key(1)), eval_loss,
                             rtol=1e-5)
  assert 4.0 < float(eval_loss) < 8.0  # About ln(256) = 5.5 at initialisation.
  new_state, metrics = exp.train_step(state, batch, jax.random.key(1))
  np.testing.assert_allclose(metrics["loss"], eval_loss, rtol=1e-5)
  assert int(new_state.step) == 1
  assert new_state.params["blocks"]["mlp_in"]["kernel"].sharding.spec == P("stage")


@pytest.mark.parametrize("overrides, error, match", [
    (dict(batch_size=12), ValueError, "num_microbatches"),
    (dict(batch_size=15), ValueError, "num_data"),
    (dict(num_stages=8), ValueError, "JAX sees only 8"),
    (dict(num_layers=0), ValueError, "num_layers"),
    (dict(learning_rate=0.0), ValueError, "learning_rate"),
    (dict(dtype="float16"), ValueError, "config.dtype must be one of"),
])
def test_bad_config_raises_before_tracing(overrides, error, match):
  with pytest.raises(error, match=match):
    experiment.build(_config(**overrides))


def test_bfloat16_config_computes_in_bfloat16_with_float32_state():
  exp = experiment.build(_config(dtype="bfloat16"))
  assert exp.model.dtype == jnp.bfloat16 and exp.model.param_dtype == jnp.float32
  # Parameters and both Adam moments stay float32 (the step counters are int32).
  dtypes = {leaf.dtype for leaf in jax.tree.leaves(exp.abstract_state())}
  assert dtypes == {jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)}


def test_config_sizes_and_bad_argument():
  assert lm.get_config().size == "small"
  assert lm.get_config("size=base").num_layers > lm.get_config("size=small").num_layers
  with pytest.raises(ValueError, match="Unknown size"):
    lm.get_config("size=huge")


def _gpipe_config(arg):
  import importlib.util  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(__file__).resolve().parents[1] / "configs" / "transformer_gpipe.py"
  spec = importlib.util.spec_from_file_location("transformer_gpipe", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def test_transformer_gpipe_config():
  big = _gpipe_config(None)
  assert (big.num_layers, big.width, big.mlp_dim, big.num_heads) == (48, 2048, 8192, 32)
  assert big.num_microbatches == 32 and big.remat == "full" and big.dtype == "bfloat16"
  tiny = experiment.build(_gpipe_config("size=tiny"))
  assert tiny.model.dtype == jnp.bfloat16
  compiled = tiny.train_step.lower(
      tiny.abstract_state(), tiny.abstract_batch(), jax.random.key(0)).compile()
  assert compiled.memory_analysis() is not None
  with pytest.raises(ValueError, match="Unknown size"):
    _gpipe_config("size=medium")
