"""Tiny randomly initialised Hugging Face models (PyTorch classes of ``transformers``) saved
locally in the Hub's safetensors layout, and their logits: the references of the pretrained
import, export, evaluation and generation tests.

Every parameter is perturbed from its initial value (norm scales away from 1, biases away from
0), so a tensor mapped to the wrong place shows. :func:`logits` in float64 computes the rotary
angles and the Mixtral and Qwen2-MoE routers' softmax in float64 too (``transformers`` computes
them in float32 whatever the model's dtype), so the float64 run is exact math throughout.
"""

from __future__ import annotations

import functools
import math
import pathlib

import numpy as np

from tpipe.train import pretrained

VOCAB, WIDTH, HEADS, KV_HEADS, MLP, LAYERS, POSITIONS = 64, 32, 4, 2, 48, 2, 32
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
# name -> (model_type, tied, extra config); each family tied and untied, Llama with Llama
# 3.1's rope scaling, Mistral with a sliding window shorter than the test sequences.
CASES = {
    "llama": ("llama", False, dict(rope_scaling=LLAMA3_SCALING, rope_theta=500.0)),
    "llama_tied": ("llama", True, dict(rope_scaling=LLAMA3_SCALING, rope_theta=500.0)),
    "mistral": ("mistral", False, dict(sliding_window=4)),
    "qwen2_tied": ("qwen2", True, {}),
    "qwen2": ("qwen2", False, {}),
    "gpt2_tied": ("gpt2", True, {}),
    "gpt2": ("gpt2", False, {}),
}
# Mixture-of-experts cases (their own tests: a mesh with an expert axis): Mixtral with 4
# experts, each token to 2, and a sliding window shorter than the test sequences; Qwen2-MoE
# (tied) with 4 experts, each token to 2 mixed by its probabilities as they are, a shared expert,
# the experts', the shared expert's and the (unused) dense width all different.
EXPERTS, EXPERTS_PER_TOKEN = 4, 2
QWEN_MOE_MLP, QWEN_SHARED_MLP = 24, 40
MOE_CASES = {
    "mixtral": ("mixtral", False, dict(num_local_experts=EXPERTS,
                                       num_experts_per_tok=EXPERTS_PER_TOKEN, sliding_window=4)),
    "qwen2_moe_tied": ("qwen2_moe", True, dict(
        num_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN,
        moe_intermediate_size=QWEN_MOE_MLP, shared_expert_intermediate_size=QWEN_SHARED_MLP,
        norm_topk_prob=False)),
}


def _torch():
  import torch  # pylint: disable=g-import-not-at-top  # The test extra.
  torch.set_num_threads(1)
  return torch


def hf_config(name: str):
  """The ``transformers`` config of case ``name``."""
  import transformers  # pylint: disable=g-import-not-at-top
  family, tied, extra = {**CASES, **MOE_CASES}[name]
  if family == "gpt2":
    return transformers.GPT2Config(vocab_size=VOCAB, n_embd=WIDTH, n_head=HEADS, n_layer=LAYERS,
                                   n_inner=MLP, n_positions=POSITIONS, tie_word_embeddings=tied,
                                   **extra)
  config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "mixtral": transformers.MixtralConfig, "qwen2": transformers.Qwen2Config,
                  "qwen2_moe": transformers.Qwen2MoeConfig}[family]
  return config_class(vocab_size=VOCAB, hidden_size=WIDTH, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, intermediate_size=MLP,
                      num_hidden_layers=LAYERS, max_position_embeddings=POSITIONS,
                      rms_norm_eps=1e-5, tie_word_embeddings=tied, **extra)


def save(name: str, directory: pathlib.Path) -> pathlib.Path:
  """Creates case ``name`` with seeded, perturbed weights and saves it (config.json +
  model.safetensors) to ``directory``; returns it."""
  torch = _torch()
  import transformers  # pylint: disable=g-import-not-at-top
  torch.manual_seed(sorted(CASES).index(name) if name in CASES
                    else len(CASES) + sorted(MOE_CASES).index(name))
  model = transformers.AutoModelForCausalLM.from_config(hf_config(name))
  with torch.no_grad():
    for parameter in model.parameters():
      parameter.add_(0.1 * torch.randn_like(parameter))
  model.save_pretrained(directory, safe_serialization=True)
  return pathlib.Path(directory)


@functools.cache
def load(directory: str, dtype: str = "float32"):
  """The saved model as ``transformers`` loads it (eager attention), in ``dtype``."""
  torch = _torch()
  import transformers  # pylint: disable=g-import-not-at-top
  model = transformers.AutoModelForCausalLM.from_pretrained(
      directory, attn_implementation="eager", dtype=getattr(torch, dtype))
  model.eval()
  if dtype == "float64" and hasattr(model, "model") and hasattr(model.model, "rotary_emb"):
    model.model.rotary_emb.forward = _exact_rotary(model.config)
  if dtype == "float64":
    for module in model.modules():
      if type(module).__name__ in ("MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock"):
        module.forward = _exact_experts(module)
  return model


def _exact_rotary(config):
  """A rotary embedding forward computing Hugging Face's frequencies and angles in float64
  (its default and ``llama3`` rope types, written after ``transformers.modeling_rope_utils``)."""
  torch = _torch()
  dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
  inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
  scaling = getattr(config, "rope_scaling", None) or {}
  if scaling.get("rope_type") == "llama3":
    factor, low, high = (scaling["factor"], scaling["low_freq_factor"],
                         scaling["high_freq_factor"])
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    inv_freq = torch.where(medium, smoothed, scaled)

  def forward(x, position_ids):
    angles = position_ids[..., None].to(torch.float64) * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

  return forward


def _exact_experts(block):
  """A Mixtral or Qwen2-MoE sparse block's forward with the router's softmax in the model's
  dtype, not float32 (written after ``transformers``' ``MixtralSparseMoeBlock.forward``, no
  jitter, and ``Qwen2MoeSparseMoeBlock.forward``: top-k weights renormalised only with
  ``norm_topk_prob``, plus the sigmoid-gated shared expert)."""
  torch = _torch()
  normalize = getattr(block, "norm_topk_prob", True)  # Mixtral always renormalises.

  def forward(hidden):
    x = hidden.reshape(-1, hidden.shape[-1])
    scores = block.gate(x)
    weights, experts = torch.topk(torch.softmax(scores, dim=-1), block.top_k, dim=-1)
    if normalize:
      weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for j, expert in enumerate(block.experts):
      token, slot = torch.where(experts == j)
      out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
    if hasattr(block, "shared_expert"):
      out = out + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return out.reshape(hidden.shape), scores

  return forward


def routing_margin(directory, tokens: np.ndarray) -> float:
  """The smallest gap, in float64, between a token's ``k``-th and ``k+1``-th router
  probability over every MoE layer: top-k routing is only well defined (the same experts in
  any float32 arithmetic) where it is not tiny."""
  torch = _torch()
  model = load(str(directory), "float64")
  with torch.no_grad():
    out = model(torch.as_tensor(np.asarray(tokens), dtype=torch.long), output_router_logits=True)
  k = model.config.num_experts_per_tok
  gaps = [np.diff(np.sort(torch.softmax(scores, dim=-1).numpy(), axis=-1)[:, -k - 1:-k + 1])
          for scores in out.router_logits]
  return float(np.min(gaps))


def logits(directory, tokens: np.ndarray, dtype: str = "float32") -> np.ndarray:
  """``transformers``' logits ``[batch, seq, vocab]`` of the saved model for ``tokens``."""
  torch = _torch()
  with torch.no_grad():
    out = load(str(directory), dtype)(torch.as_tensor(np.asarray(tokens), dtype=torch.long))
  return out.logits.numpy()


def packed_documents(directory: pathlib.Path):
  """Twelve word-level documents packed into windows of 16 tokens
  (:class:`tpipe.train.document_packing.PackedTokens`), their tokenizer written to ``directory``:
  what
  the perplexity tests read."""
  from tests.helpers import text_corpus  # pylint: disable=g-import-not-at-top
  from tpipe.train import document_packing, tokenization  # pylint: disable=g-import-not-at-top
  tokenizer = tokenization.load(text_corpus.word_tokenizer(directory))
  assert tokenizer.vocab_size <= VOCAB
  ids = tokenizer.encode_batch(text_corpus.documents(12, seed=1))
  return document_packing.PackedTokens.of(ids, tokenizer.eod_id, seq_len=16)


def document_loss(directory, packed, dtype: str = "float32") -> np.float64:
  """``transformers``' mean next-token cross-entropy over the unmasked targets of packed
  windows (:class:`tpipe.train.document_packing.PackedTokens`), each window's documents run one at a
  time from position 0 (as tpipe restarts positions per document), in float64 from ``dtype``
  logits."""
  total = count = 0.0
  for i in range(len(packed)):
    window = packed[i]
    for segment in np.unique(window["segment_ids"]):
      rows = window["segment_ids"] == segment
      scores = logits(directory, window["inputs"][rows][None], dtype)[0].astype(np.float64)
      peak = scores.max(axis=-1, keepdims=True)
      log_z = (peak + np.log(np.exp(scores - peak).sum(axis=-1, keepdims=True)))[:, 0]
      target = scores[np.arange(len(scores)), window["targets"][rows]]
      mask = window["loss_mask"][rows]
      total += float(((log_z - target) * mask).sum())
      count += float(mask.sum())
  return np.float64(total / count)


def greedy(directory, prompt: np.ndarray, new_tokens: int) -> tuple[np.ndarray, float]:
  """``transformers``' greedy continuation ``[batch, new_tokens]`` of ``prompt`` (no end
  token), and the smallest float64 gap between the two best logits along it (greedy decoding is
  only well defined, the same in any float32 arithmetic, where that gap is not tiny)."""
  torch = _torch()
  model = load(str(directory))
  model.generation_config.eos_token_id = None
  with torch.no_grad():
    out = model.generate(torch.as_tensor(prompt, dtype=torch.long), max_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0)
  continuation = out[:, prompt.shape[1]:].numpy()
  sequence = np.concatenate([prompt, continuation], axis=1)
  scores = logits(directory, sequence, "float64")[:, prompt.shape[1] - 1:-1]
  best_two = np.sort(scores, axis=-1)[..., -2:]
  return continuation, float((best_two[..., 1] - best_two[..., 0]).min())


def assert_same_tensors(original: pathlib.Path, exported: pathlib.Path) -> None:
  """The exported checkpoint's ``model.safetensors`` holds the original's tensors, names,
  dtypes and values bit for bit."""
  want = pretrained.read_safetensors(original / "model.safetensors")
  got = pretrained.read_safetensors(exported / "model.safetensors")
  assert sorted(got) == sorted(want)
  for key, tensor in want.items():
    assert got[key].dtype == tensor.dtype
    np.testing.assert_array_equal(got[key], tensor, err_msg=key)
