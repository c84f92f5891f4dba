"""Throughput: tokens per second, model FLOP/s per device and MFU (model FLOPs utilisation).

The **model FLOPs** of a training step are what the model's math needs, counted from its
architecture (:func:`lm_step_flops`): every matrix multiplication of the forward pass (the
projections, the attention's scores and weighted sum over the whole sequence, the vocabulary
projection; in a mixture of experts the router and the ``k`` of ``E`` experts a token goes to,
its *active* parameters), times 3 for the forward and the backward (which multiplies twice as
much: the inputs' and the weights' gradients). What remat or the attention's backward computes
again is not counted, nor elementwise work or the optimizer: the same convention as MFU in the
PaLM paper, so the figure compares across remat policies and schedules.

**MFU** divides the model FLOP/s per device by the device's peak (:func:`peak_tflops`: dense
bfloat16 matrix throughput per chip, from :data:`PEAK_TFLOPS` by the device kind, or
``config.peak_tflops`` to override); where no peak is known (a CPU) it is left out.

Example::

  flops = lm_step_flops(architecture.lm_arguments(config), batch=32, seq_len=1024)
  rates = Rates(flops, tokens=32 * 1024, num_devices=8, peak=peak_tflops(jax.devices()[0]))
  rates.of(seconds=0.5)   # {"tokens_per_s": ..., "tflops_per_device": ..., "mfu": ...}
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tpipe.train import architecture

# Dense bfloat16 peak TFLOP/s per chip, by a piece of the device kind JAX reports; the first
# match wins (so "TPU v5 lite" is v5e, not v5p). Public figures of each vendor.
PEAK_TFLOPS = (
    ("TPU v4", 275.0),
    ("TPU v5 lite", 197.0),   # v5e
    ("TPU v5e", 197.0),
    ("TPU v5", 459.0),        # v5p
    ("TPU v6 lite", 918.0),   # v6e (Trillium)
    ("TPU v6e", 918.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),          # SXM
    ("H200", 989.0),
    ("A100", 312.0),
)


def peak_tflops(device_kind: str, override: float = 0.0) -> float | None:
  """A device's peak TFLOP/s: ``override`` when positive, else the first entry of
  :data:`PEAK_TFLOPS` whose key is in ``device_kind``, else None (unknown, e.g. a CPU)."""
  if override and override > 0:
    return float(override)
  for key, value in PEAK_TFLOPS:
    if key.lower() in device_kind.lower():
      return value
  return None


def lm_forward_flops_per_token(arguments: dict[str, Any], seq_len: int) -> float:
  """Matrix-multiply FLOPs of one token's forward pass through the LM.

  Args:
    arguments: :func:`tpipe.train.models.decoder_lm`'s arguments (``lm_arguments(config)``).
    seq_len: the sequence length (the attention scores cover the whole sequence).
  """
  width, heads = arguments["width"], arguments["num_heads"]
  head_dim = arguments.get("head_dim") or width // heads
  block = arguments.get("block", "gpt")
  llama = block in ("llama", "moe")
  kv_heads = (arguments.get("num_kv_heads") or heads) if llama else heads
  projections = 2 * width * head_dim * (2 * heads + 2 * kv_heads)  # q, out; k, v.
  attention = 2 * 2 * seq_len * heads * head_dim  # Scores and the weighted sum.
  mlp = 2 * width * arguments["mlp_dim"] * (3 if llama else 2)
  if block == "moe":  # The experts a token goes to (active FLOPs), and the router.
    mlp = mlp * arguments["experts_per_token"] + 2 * width * arguments["num_experts"]
    shared = arguments.get("shared_expert_mlp_dim") or 0  # Every token's, and its gate.
    mlp += 2 * width * shared * 3 + 2 * width if shared else 0
  head = 2 * width * arguments["vocab_size"]
  return arguments["num_layers"] * (projections + attention + mlp) + head


def lm_step_flops(arguments: dict[str, Any], *, batch: int, seq_len: int) -> float:
  """Model FLOPs of one training step: 3 x the forward's matrix multiplies over the batch."""
  return 3.0 * batch * seq_len * lm_forward_flops_per_token(arguments, seq_len)


@dataclasses.dataclass(frozen=True)
class Rates:
  """Turns a step time into throughput figures.

  Attributes:
    step_flops: model FLOPs per step (all devices), or None where unknown (then no FLOP
      figures).
    tokens: tokens per step (global batch x sequence length), or None (no token rate).
    num_devices: devices the step runs on.
    peak: one device's peak TFLOP/s, or None (then no MFU).
  """

  step_flops: float | None
  tokens: int | None
  num_devices: int
  peak: float | None

  def of(self, seconds: float) -> dict[str, float]:
    """``tokens_per_s``, ``tflops_per_device`` and ``mfu`` for one step of ``seconds``
    (each where it is known)."""
    out = {}
    if self.tokens:
      out["tokens_per_s"] = self.tokens / seconds
    if self.step_flops:
      tflops = self.step_flops / seconds / self.num_devices / 1e12
      out["tflops_per_device"] = tflops
      if self.peak:
        out["mfu"] = tflops / self.peak
    return out


def step_counts(config, task_name: str) -> tuple[int | None, float | None]:
  """``(tokens, model FLOPs)`` of one training step of ``config``: the LM's (``task_name``
  ``"lm"``), from its architecture (:func:`lm_step_flops`); ``(None, None)`` for other tasks."""
  if task_name != "lm":
    return None, None
  tokens = config.batch_size * config.seq_len
  return tokens, lm_step_flops(architecture.lm_arguments(config), batch=config.batch_size,
                               seq_len=config.seq_len)
