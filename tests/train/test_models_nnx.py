"""The trainer from the NNX LM (``--config.frontend=nnx``), and the NNX LM against the linen one.

* Equal parameters give equal losses: the linen LM's variables are loaded into the NNX LM (the
  logical layouts have the same names and shapes, so the conversion is the identity on the tree),
  and both are as close to the float64 LM as the linen LM run without a pipeline is.
* A short in-process trainer run logs losses and evaluations, checkpoints, and resumes; its
  checkpoint restores into the linen LM's experiment (the same checkpoint format).
"""

import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import tpipe
from tests.helpers import numerics
from tests.helpers import train_runs
from tpipe.train import checkpointing
from tpipe.train import models
from tpipe.train import models_nnx
from tpipe.train.cli import experiment
from tpipe.train.cli import metrics
from tpipe.train.cli import trainer

SIZES = dict(num_layers=2, width=16, num_heads=2, mlp_dim=32, max_len=8, vocab_size=20)


def test_nnx_and_linen_lms_give_the_same_losses_for_the_same_parameters():
  tokens = jax.random.randint(jax.random.key(0), (8, 8), 0, 20)
  targets = jnp.roll(tokens, -1, axis=1)
  plain = models.decoder_lm(**SIZES, num_stages=1, num_microbatches=4)
  variables = nn.meta.unbox(plain.init({"params": jax.random.key(1)}, tokens, targets=targets))
  mesh = tpipe.make_mesh(stages=2, data=2)
  model = models_nnx.decoder_lm(**SIZES, num_stages=2, num_microbatches=2, mesh=mesh,
                                rngs=nnx.Rngs(5))
  model.load_variables(variables)
  # The conversion is the identity: the NNX LM's logical variables are the linen tree.
  back = model.variables()
  assert set(back) == {"params"}
  assert jax.tree.structure(back["params"]) == jax.tree.structure(variables["params"])
  jax.tree.map(np.testing.assert_array_equal, back["params"], variables["params"])
  assert set(nnx.to_pure_dict(nnx.state(model, nnx.Param))["layers"][1]["layer"]) >= {
      "attn", "attn_norm", "mlp_in", "mlp_out", "mlp_norm"}

  losses = nnx.jit(lambda m, t, y: m(t, targets=y))(model, tokens, targets)
  want = jax.jit(lambda v, t, y: plain.apply(v, t, targets=y))(variables, tokens, targets)
  # The linen LM fixes its computation dtype: the reference is the same LM built in float64.
  plain64 = models.decoder_lm(**SIZES, num_stages=1, num_microbatches=4, dtype=jnp.float64,
                              param_dtype=jnp.float64)
  exact = numerics.float64_reference(
      jax.jit(lambda v, t, y: plain64.apply(v, t, targets=y)), variables, tokens, targets)
  numerics.assert_as_close_as_plain(losses, want, exact, what="losses")


def _config(num_steps):
  from configs import lm  # pylint: disable=g-import-not-at-top
  config = lm.get_config("size=tiny")
  config.frontend = "nnx"
  config.num_layers, config.seq_len, config.batch_size = 2, 16, 8
  config.num_stages, config.num_data, config.num_microbatches = 2, 2, 2
  config.num_steps = num_steps
  config.max_corpus_bytes = 200_000
  config.eval_batches = 1
  config.log_every, config.eval_every, config.checkpoint_every = 1, 2, 2
  return config


def test_trainer_trains_the_nnx_lm_saves_and_resumes(tmp_path):
  """The first run is stopped by SIGINT as it reads batch 3 (it saves after step 3 and stops),
  the second resumes it: one config, so the second run's programs are the first's (read from the
  compilation cache, not compiled again)."""
  workdir = tmp_path / "nnx"
  config = _config(4)
  with train_runs.interrupted_at(config, 3):
    stopped = trainer.train(config, str(workdir))
  assert stopped["step"] == 3 and stopped["checkpoint"] == 3
  resumed = trainer.train(_config(4), str(workdir))  # Resumes from step 3.
  assert resumed["step"] == 4 and resumed["checkpoint"] == 4
  records = metrics.read_metrics(workdir)
  losses = {r["step"]: r["loss"] for r in records if "loss" in r}
  assert sorted(losses) == [1, 2, 3, 4]
  assert all(np.isfinite(v) for v in losses.values())
  assert any("eval_loss" in r for r in records)

  # The checkpoint is the linen LM's: it restores into the linen experiment.
  linen_config = _config(4)
  linen_config.frontend = "linen"
  linen = experiment.build(linen_config)
  ckpt = checkpointing.Checkpointer(pathlib.Path(workdir) / "checkpoints")
  try:
    state, _ = ckpt.restore(4, linen.abstract_checkpoint())
  finally:
    ckpt.close()
  assert int(state.step) == 4
  assert state.params["layers_1"]["attn"]["query"]["kernel"].shape[0] == 2
