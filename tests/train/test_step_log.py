"""What the trainer writes about a logged step: the loss's terms, the schedule of logged steps,
the ETA."""

import math

import ml_collections
import numpy as np
import pytest

from tpipe.train.cli import step_log

pytestmark = pytest.mark.unit


def test_the_loss_terms_record_sums_losses_and_averages_metrics_over_the_blocks():
  config = ml_collections.ConfigDict({"num_layers": 4})
  terms = {"loss": np.float32(2.5), "aux_loss/moe/router_balance": np.float32(0.8),
           "aux_metric/moe/expert_load": np.float32(6.0)}
  assert step_log.loss_terms_record(terms, config) == {
      "task_loss": 2.5, "aux_loss/moe/router_balance": pytest.approx(0.8),
      "aux_metric/moe/expert_load": 1.5}


def test_logged_steps_follow_every_cadence_and_the_last_step():
  config = ml_collections.ConfigDict(dict(num_steps=25, log_every=10, eval_every=4,
                                          checkpoint_every=6))
  logged = [step for step in range(1, 26) if step_log.logs_at(step, config)]
  assert logged == [4, 6, 8, 10, 12, 16, 18, 20, 24, 25]


def test_the_eta_reads_hours_minutes_seconds():
  assert step_log.format_eta(3725.9) == "1:02:05"
  assert step_log.format_eta(math.nan) == "?"
  assert step_log.format_eval({"eval_loss": 1.23456, "loss": 9.0}) == "eval_loss 1.2346"
