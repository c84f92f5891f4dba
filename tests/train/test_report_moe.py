"""Tests for the report's mixture-of-experts rows (tpipe.train.cli.moe_costs) and the model FLOPs
of a MoE LM: the experts' weights apart from the other weights, the dispatch buffers and the
routing metadata, each equal to its formula worked by hand on a tiny config; none for a dense
one; and the model FLOPs 6 x active parameters x tokens plus attention."""

import numpy as np
import pytest

from configs import lm
from tpipe.tools import analysis
from tpipe.train import architecture
from tpipe.train.cli import config_costs
from tpipe.train.cli import experiment
from tpipe.train.cli import moe_costs
from tpipe.train.cli import report_text
from tpipe.train.cli import throughput

# The tiny LM (4 blocks, width 32, MLP 64 per expert, sequence 32, batch 16) with 4 experts,
# top-2, on stage 2 x data 2 x expert 2, 2 micro-batches.
L, D, H, SEQ, BATCH, E, K = 4, 32, 64, 32, 16, 4, 2
STAGES, DATA, EXPERT, M = 2, 2, 2, 2


def _moe_config(**overrides):
  config = lm.get_config("size=tiny")
  for key, value in dict(block="moe", num_stages=STAGES, num_data=DATA, num_microbatches=M,
                         num_experts=E, experts_per_token=K, **overrides).items():
    config[key] = value
  config.mesh.expert = EXPERT
  return config


def _memory(config):
  exp = experiment.build(config)
  return moe_costs.moe_memory(config, exp.layout, exp.abstract_state(), exp.pipeline.spec,
                              exp.mesh)


def test_the_moe_rows_are_their_formulas_by_hand():
  memory = _memory(_moe_config())
  # Each block's experts: gate, up [E, D, H] and down [E, H, D]; the 4 blocks split over the
  # 2 stages, the experts over the 2 expert devices; float32 weights; Adam's two moments.
  experts = 3 * E * D * H * L // STAGES // EXPERT * 4
  assert memory.expert_param_bytes == experts == 98304
  assert memory.expert_opt_state_bytes == 2 * experts
  assert memory.expert_gradient_bytes == experts
  # One device routes its replica's micro-batch whole (the expert axis gathers the rows): 16
  # examples over 2 replicas and 2 micro-batches, 32 tokens each.
  tokens = BATCH // DATA // M * SEQ
  assert memory.tokens == tokens == 128
  # Dropless, float32 compute: T k rows of width D grouped, three T k x H hidden activations,
  # the experts' outputs and the same back in token order (two T k x D).
  assert memory.dispatch_bytes == tokens * K * (D + 3 * H + 2 * D) * 4 == 294912
  # Logits and probabilities [T, E] float32; top-k probabilities and weights [T, k] float32,
  # indices [T, k] int32; the sort order [T k] and the group sizes [E] int32.
  assert memory.routing_bytes == (2 * tokens * E + 3 * tokens * K + tokens * K + E) * 4 == 8208
  assert (memory.moe_layers, memory.num_experts, memory.experts_per_token) == (L, E, K)


def test_the_rows_follow_the_compute_dtype_and_the_capacity():
  memory = _memory(_moe_config(dtype="bfloat16", capacity_factor=1.5))
  tokens = 128
  slots = int(np.ceil(1.5 * tokens * K / E))  # 96 slots per expert.
  # The dispatch and combine masks [k, T, E, C], the slots' inputs and outputs [E, C, D], the
  # hidden activations (three [E, C, H]), two bytes each.
  assert memory.dispatch_bytes == (2 * K * tokens * E * slots + E * slots * (2 * D + 3 * H)) * 2
  # The router's float32 arrays as dropless; the slot bookkeeping three int32 [k T, E].
  assert memory.routing_bytes == (2 * tokens * E + 3 * tokens * K + 3 * K * tokens * E) * 4
  # The weights stay float32.
  assert memory.expert_param_bytes == 98304


def test_the_hidden_activations_are_a_tensor_shards():
  # Stage 2 x expert 2 x tensor 2: the experts' mlp dimension (and their hidden activations)
  # split over tensor, the weights over expert and tensor; one replica routes the whole batch.
  config = _moe_config()
  config.num_data, config.mesh.tensor = 1, 2
  memory = _memory(config)
  tokens = BATCH // M * SEQ
  assert (memory.tokens, memory.hidden) == (tokens, H // 2)
  assert memory.dispatch_bytes == tokens * K * (3 * D + 3 * H // 2) * 4
  assert memory.expert_param_bytes == 3 * E * D * H * L // STAGES // EXPERT // 2 * 4


def test_a_dense_config_has_no_moe_rows():
  config = lm.get_config("size=tiny")
  config.num_stages, config.num_data, config.num_microbatches = 2, 2, 2
  assert _memory(config) is None


def test_the_report_prints_the_moe_rows_apart_and_keeps_the_totals():
  """One compile of a tiny MoE step (2 blocks, sequence 8): the rows print, the experts' rows
  and the rest add up to the compiled step's parameters, optimizer state and gradients."""
  config = _moe_config(num_layers=2, seq_len=8, batch_size=8)
  report = config_costs.analyze_config(config, per_stage=False)
  moe = report.moe
  # 2 blocks over 2 stages, experts over 2 devices.
  assert moe.expert_param_bytes == 3 * E * D * H * 2 // STAGES // EXPERT * 4
  assert moe.tokens == 8 // DATA // M * 8
  text = report_text.format_report(report)
  fb = analysis.format_bytes
  assert f"| experts' weights (measured: the staged tree's expert leaves) | " \
         f"{fb(moe.expert_param_bytes)} |" in text
  assert f"| parameters other than the experts' | " \
         f"{fb(report.params_bytes - moe.expert_param_bytes)} |" in text
  assert f"| experts' optimizer state (measured likewise) | " \
         f"{fb(moe.expert_opt_state_bytes)} |" in text
  assert ("| of which MoE dispatch buffers, one MoE layer on one micro-batch (estimate from "
          f"shapes) | {fb(moe.dispatch_bytes)} |") in text
  assert ("| of which MoE routing metadata, one MoE layer on one micro-batch (estimate from "
          f"shapes) | {fb(moe.routing_bytes)} |") in text
  assert "Collectives over the expert axis alone per step" in text
  assert any(row["role"] == "MoE dispatch, combine and gradient sums"
             for row in report.collective_rows())
  assert report.to_json()["moe_memory_bytes_per_device"]["dispatch_bytes"] == moe.dispatch_bytes
  # The experts' weights are a part of the parameters the compiled step takes.
  assert 0 < moe.expert_param_bytes < report.params_bytes
  assert 0 < moe.expert_opt_state_bytes < report.opt_state_bytes


def test_moe_model_flops_are_six_times_active_parameters_times_tokens_plus_attention():
  """Model FLOPs of a MoE step: 6 x the active parameters (every matrix a token multiplies: the
  attention's projections, the router, k of E experts, the head; not the embedding's lookup)
  x tokens, plus the attention's scores and weighted sum (3 x 2 x 2 x seq x heads x head_dim
  per token and layer). The active parameters are counted from the model's own parameter
  tree."""
  config = _moe_config(num_kv_heads=1)
  exp = experiment.build(config)
  logical = exp.layout.logical
  block = logical["layers_1"]
  heads, head_dim = config.num_heads, config.width // config.num_heads
  matrices = sum(int(np.prod(block[name].shape)) for name in ("query", "key", "value", "out"))
  experts = sum(int(np.prod(block["moe"][name].shape)) for name in ("gate", "up", "down"))
  router = int(np.prod(block["moe"]["router"].shape))
  head = int(np.prod(logical["layers_2"]["head"]["kernel"].shape))
  active = matrices + router + experts * K // E + head
  # By hand: per block q, o [D, heads x head_dim]; k, v [D, 1 x head_dim]; router [D, E];
  # k experts' gate, up, down [D, H]; the head [D, vocab 256].
  by_hand = L * (2 * D * heads * head_dim + 2 * D * head_dim + D * E + K * 3 * D * H) + D * 256
  assert active == by_hand
  tokens = BATCH * SEQ
  attention = 3 * 2 * 2 * SEQ * heads * head_dim * L * tokens
  expected = 6 * active * tokens + attention
  step_tokens, model_flops = throughput.step_counts(config, "lm")
  assert step_tokens == tokens
  assert model_flops == pytest.approx(expected, rel=1e-12)
  # What the report's MFU divides by (its prediction) is the same count.
  assert throughput.lm_step_flops(architecture.lm_arguments(config), batch=BATCH,
                                  seq_len=SEQ) == model_flops
  # All E experts counted would be more: the count is the active one.
  dense_experts = 6 * (active + experts * (E - K) // E) * tokens + attention
  assert model_flops < dense_experts
