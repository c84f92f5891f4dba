"""The trainer on a mixture-of-experts LM: the router's losses and metrics in metrics.jsonl and
TensorBoard, the logged loss their sum with the task's, evaluation without them."""

import numpy as np

from tests.helpers import train_runs
from tests.train import test_metrics
from tpipe.train.cli import metrics

MOE = ["--config.block=moe", "--config.num_experts=4", "--config.experts_per_token=2",
       "--config.capacity_factor=1.0", "--config.router_aux_loss_coef=0.1",
       "--config.router_z_loss_coef=0.01", "--config.num_stages=2", "--config.num_data=2",
       "--config.mesh.expert=2", "--config.num_microbatches=2", "--config.num_steps=2",
       "--config.eval_every=2", "--config.checkpoint_every=2"]


def test_a_moe_run_logs_its_router_losses_and_metrics(tmp_path):
  train_runs.check_ok(train_runs.train_here(tmp_path, *MOE))
  records = [r for r in metrics.read_metrics(tmp_path) if "loss" in r]
  assert [r["step"] for r in records] == [1, 2]
  layers = 2  # configs/lm.py:size=tiny.
  for record in records:
    aux = [record["aux_loss/moe/router_balance"], record["aux_loss/moe/router_z"]]
    # The step's loss (before its update) is the task's plus the auxiliary losses, measured on
    # the same batch, parameters and dropout key by a forward pass.
    np.testing.assert_allclose(record["loss"], record["task_loss"] + sum(aux), rtol=1e-5)
    assert aux[0] >= 0.1 * 2 * layers - 1e-4  # At least k per block.
    assert 1.0 <= record["aux_metric/moe/expert_load"] <= 4.0  # Mean over the blocks.
    assert 0.0 <= record["aux_metric/moe/dropped"] < 0.5
  # Evaluation is the task's loss alone: near the training task loss, not above it by the
  # router losses (the evaluation batches are others, the model barely trained).
  final = records[-1]
  assert abs(final["eval_loss"] - final["task_loss"]) < 0.5 * sum(
      final[k] for k in ("aux_loss/moe/router_balance", "aux_loss/moe/router_z"))
  tags = {v.tag for e in test_metrics._tensorboard_events(tmp_path) for v in e.summary.value}
  assert {"task_loss", "aux_loss/moe/router_balance", "aux_metric/moe/expert_load",
          "aux_metric/moe/dropped"} <= tags
