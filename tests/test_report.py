"""Tests for tpipe.report: its figures are those of the real train step's compile."""

import json
import os
import subprocess
import sys

import jax
import pytest

from configs import lm
from tpipe import report as report_lib
from tpipe.train import experiment

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny_config():
  config = lm.get_config("size=tiny")
  config.num_stages, config.num_data, config.num_microbatches = 4, 2, 4
  return config


@pytest.fixture(scope="module")
def tiny_report():
  return report_lib.analyze_config(_tiny_config())


def test_memory_agrees_with_memory_analysis_of_the_real_train_step(tiny_report):
  # An independent compile of the same training step.
  exp = experiment.build(_tiny_config())
  compiled = exp.train_step.lower(
      exp.abstract_state(), exp.abstract_batch(), jax.random.key(0)).compile()
  stats = compiled.memory_analysis()
  mem = tiny_report.to_json()["memory_bytes_per_device"]
  assert mem["arguments"] == stats.argument_size_in_bytes
  assert mem["outputs"] == stats.output_size_in_bytes
  assert mem["temporaries"] == stats.temp_size_in_bytes
  assert mem["aliased"] == stats.alias_size_in_bytes
  assert mem["total"] == (stats.argument_size_in_bytes + stats.output_size_in_bytes
                          - stats.alias_size_in_bytes + stats.temp_size_in_bytes
                          + stats.generated_code_size_in_bytes)
  # The split of the arguments covers them exactly (the rest: step counter and RNG key).
  split = mem["params"] + mem["opt_state"] + mem["batch"]
  assert 0 <= stats.argument_size_in_bytes - split <= 16
  assert mem["gradients"] + mem["activations_and_temporaries"] == mem["temporaries"]


def test_parameter_bytes_follow_the_stage_split(tiny_report):
  config = tiny_report.config
  state = experiment.build(config).abstract_state()
  # Every parameter lives in the staged buffers, split evenly over the stages.
  staged = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
  assert set(state.params) == {"staged"}
  assert tiny_report.params_bytes == staged // config.num_stages
  # Adam keeps two moments per parameter.
  assert tiny_report.opt_state_bytes >= 2 * tiny_report.params_bytes
  batch = 2 * config.batch_size // config.num_data * config.seq_len * 4  # inputs + targets.
  assert tiny_report.batch_bytes == batch


def test_flops_and_collectives(tiny_report):
  out = tiny_report.to_json()
  flops = out["flops_per_device"]
  schedule = tiny_report.schedule
  assert flops["lockstep"] > flops["xla_cost_analysis"]
  bubble = schedule.bubble_fraction
  assert flops["useful"] == pytest.approx(flops["lockstep"] - bubble * flops["in_tick_loops"])
  # Idle ticks skip the stage's layers: most of the tick loops' work sits in that conditional.
  assert flops["gated_in_tick_loops"] > 0.5 * flops["in_tick_loops"]
  assert flops["executed"] == pytest.approx(
      flops["lockstep"] - bubble * flops["gated_in_tick_loops"])
  assert flops["useful"] <= flops["executed"] < flops["lockstep"]
  assert out["schedule"]["bubble_fraction"] == pytest.approx(3 / 7)  # (S-1)/(M+S-1).
  # One stash slot per forward tick (M + S - 1 = 7), M = 4 of them holding micro-batches.
  assert out["schedule"]["stash_slots_per_stage"] == 7
  assert out["schedule"]["stashed_microbatches_per_stage"] == 4
  roles = {(r["kind"], r["role"]): r for r in out["collectives_per_step"]}
  transfers = roles[("collective-permute", "stage-to-stage transfer")]
  # One send per tick in the forward loop and one in the backward loop.
  assert transfers["count"] == 2 * schedule.num_ticks
  assert transfers["in_loop"] == transfers["instructions"]
  reductions = roles[("all-reduce", "data-parallel reduction")]
  assert reductions["in_loop"] == 0  # once per step, not per micro-batch.
  text = report_lib.format_report(tiny_report)
  assert "peak total" in text and "stage-to-stage transfer" in text
  assert "stash per stage: 7 slots" in text


def test_bad_config_is_a_clean_error(tmp_path):
  env = dict(os.environ, PYTHONPATH=REPO)
  result = subprocess.run(
      [sys.executable, "-m", "tpipe.report", "--config=configs/lm.py:size=tiny",
       "--config.num_microbatches=3", f"--out_dir={tmp_path}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 2
  assert "error: " in result.stderr and "num_microbatches=3" in result.stderr
  assert "Traceback" not in result.stderr


def test_command_line_writes_report_and_timeline(tmp_path):
  env = dict(os.environ, PYTHONPATH=REPO)
  env.pop("JAX_NUM_CPU_DEVICES", None)  # the tool sets 8 emulated devices itself.
  result = subprocess.run(
      [sys.executable, "-m", "tpipe.report", "--config=configs/transformer_gpipe.py:size=tiny",
       "--config.num_layers=2", "--config.num_stages=2", "--config.num_data=1",
       "--config.num_microbatches=2", f"--out_dir={tmp_path}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "peak total" in result.stdout
  with open(tmp_path / "report.json") as f:
    numbers = json.load(f)
  assert numbers["config"]["num_stages"] == 2
  assert numbers["config"]["remat"] == "full"  # the GPipe config's setting.
  assert numbers["schedule"]["num_ticks"] == 3
  with open(tmp_path / "timeline.png", "rb") as f:
    assert f.read(4) == b"\x89PNG"
  assert "python -m tpipe.report" in (tmp_path / "report.md").read_text()
