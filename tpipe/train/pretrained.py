"""Hugging Face checkpoints in and out: Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE and GPT-2, tied
or untied.

A Hugging Face checkpoint directory holds ``config.json`` and one or more ``*.safetensors``
files whose tensors carry PyTorch's names and layouts (``model.layers.0.self_attn.q_proj.weight
[heads * head_dim, width]``, GPT-2's ``h.0.attn.c_attn.weight [width, 3 * width]``). This module
maps them to tpipe's **logical** parameters (``{"layers_0": embedding, "layers_1": blocks
stacked [L, ...], "layers_2": head}``, what :func:`tpipe.train.models.decoder_lm` creates), which
do not depend on the stages or mesh, so an imported model trains on any layout; and back.

* :func:`architecture_of`: the config fields (:mod:`tpipe.train.architecture`) of the model in
  a directory: a Hugging Face checkpoint's, or another run's workdir (its ``config.json``).
* :func:`load_params`: its logical parameters as float32 NumPy arrays (bfloat16 and float16
  tensors are widened exactly). A tied model's one matrix fills both copies
  (:mod:`tpipe.train.tied`).
* :func:`export`: logical parameters and architecture to ``config.json`` and
  ``model.safetensors``, loadable by ``transformers``' ``AutoModelForCausalLM``; import then
  export is bit for bit the original (float32).

The families map to :class:`tpipe.train.models.LlamaBlock` (RMSNorm, rotary positions with
``rope_theta`` and ``linear``/``llama3`` ``rope_scaling``, grouped-query attention, SwiGLU;
Qwen2's query/key/value biases; Mistral's sliding window; Mixtral's mixture of SwiGLU experts,
``block="moe"``: :class:`tpipe.train.moe.MixtureOfExperts`, dropless; Qwen2-MoE's, with its
shared expert and its top-k weights not renormalised, ``norm_topk_prob=False``) and to
:class:`tpipe.train.models.TransformerBlock` (GPT-2: LayerNorm with epsilon 1e-5, learned
positions, biases, tanh GELU). Anything else in a config (another activation, a bias on the
attention output, Qwen2's per-layer sliding window, Mixtral's router jitter, Qwen2-MoE's dense
layers among the sparse ones: ``decoder_sparse_step``, ``mlp_only_layers``) is refused with the
field's name.

Example::

  fields = architecture_of("/models/llama-tiny")        # {"block": "llama", "width": ..., ...}
  params = load_params("/models/llama-tiny", fields)     # {"layers_0": ..., ...}
  export(params, fields, "/tmp/out")                     # config.json + model.safetensors
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import ml_dtypes
import numpy as np

from tpipe.train import architecture_fields

FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "gpt2")
_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "mixtral": "MixtralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen2_moe": "Qwen2MoeForCausalLM", "gpt2": "GPT2LMHeadModel"}
# The mixture-of-experts families.
_MOE = ("mixtral", "qwen2_moe")
# Tensors of some checkpoints that are buffers, not parameters (masks, rotary tables).
_BUFFERS = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


def _read_json(path: pathlib.Path) -> dict:
  try:
    return json.loads(path.read_text())
  except (OSError, json.JSONDecodeError) as error:
    raise ValueError(f"cannot read {path}: {error}") from None


def is_workdir(directory) -> bool:
  """Whether ``directory`` is a tpipe run's workdir (``config.json`` and ``checkpoints/``)."""
  directory = pathlib.Path(directory)
  return (directory / "checkpoints").is_dir() and (directory / "config.json").is_file()


def architecture_of(directory) -> dict[str, Any]:
  """The architecture fields of the model in ``directory``.

  Args:
    directory: a Hugging Face checkpoint directory (``config.json`` with a ``model_type`` in
      :data:`FAMILIES`), or a tpipe workdir.

  Returns:
    ``{field: value}`` for :data:`tpipe.train.architecture_fields.FIELDS`.

  Raises:
    ValueError: no such directory, no config, or a configuration tpipe cannot run.
  """
  directory = pathlib.Path(directory).expanduser()
  if not (directory / "config.json").is_file():
    raise ValueError(f"config.init_from={str(directory)!r} has no config.json; give a Hugging "
                     "Face checkpoint directory (config.json and *.safetensors) or a tpipe "
                     "workdir (nothing is downloaded).")
  config = _read_json(directory / "config.json")
  if is_workdir(directory):
    return {name: config[name] if name in config else architecture_fields.DEFAULTS[name]
            for name in architecture_fields.FIELDS}
  family = config.get("model_type")
  if family not in FAMILIES:
    raise ValueError(f"{directory}/config.json has model_type={family!r}; tpipe imports "
                     f"{FAMILIES}.")
  fields = _gpt2_fields(config) if family == "gpt2" else _llama_fields(config, family)
  return {**architecture_fields.DEFAULTS, **fields, "family": family}


def _refuse(config: dict, family: str, **expected) -> None:
  """Raises for the first ``config`` key whose value is not the expected one."""
  for key, allowed in expected.items():
    value = config.get(key, allowed[0])
    if value not in allowed:
      raise ValueError(f"this {family} checkpoint has {key}={value!r}; tpipe supports "
                       f"{key} in {allowed}.")


def _llama_fields(config: dict, family: str) -> dict[str, Any]:
  _refuse(config, family, hidden_act=("silu",), mlp_bias=(False,), pretraining_tp=(1,),
          use_sliding_window=(False,))
  if family == "llama":
    _refuse(config, family, attention_bias=(False,))
  if family == "mixtral":
    # The jitter multiplies a training step's inputs by noise: a router tpipe does not model.
    _refuse(config, family, router_jitter_noise=(0.0,))
  if family == "qwen2_moe":
    # Every layer a mixture: dense layers in between (every decoder_sparse_step-th layer sparse,
    # or the layers listed dense) would make the stacked blocks differ.
    _refuse(config, family, decoder_sparse_step=(1,))
    if config.get("mlp_only_layers"):
      raise ValueError(f"this qwen2_moe checkpoint has mlp_only_layers="
                       f"{config['mlp_only_layers']!r} (dense layers among the mixtures); tpipe "
                       "supports mlp_only_layers=[] (every layer a mixture of experts).")
    for key in ("num_experts", "shared_expert_intermediate_size"):
      if int(config.get(key, 0)) < 1:
        raise ValueError(f"this qwen2_moe checkpoint has {key}={config.get(key)!r}; tpipe "
                         f"supports {key} >= 1.")
  width, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
  head_dim = int(config.get("head_dim") or width // heads)
  scaling = config.get("rope_scaling")
  window = config.get("sliding_window") if family in ("mistral", "mixtral") else None
  experts, mlp_dim, qkv_bias = {}, int(config["intermediate_size"]), family == "qwen2"
  if family == "mixtral":
    experts = dict(num_experts=int(config.get("num_local_experts", 8)),
                   experts_per_token=int(config.get("num_experts_per_tok", 2)),
                   capacity_factor=0.0, normalize_expert_weights=True, shared_expert_mlp_dim=0)
  if family == "qwen2_moe":  # intermediate_size is its dense layers' width: it has none.
    experts = dict(num_experts=int(config["num_experts"]),
                   experts_per_token=int(config.get("num_experts_per_tok", 4)),
                   capacity_factor=0.0,
                   normalize_expert_weights=bool(config.get("norm_topk_prob", False)),
                   shared_expert_mlp_dim=int(config["shared_expert_intermediate_size"]))
    mlp_dim, qkv_bias = int(config["moe_intermediate_size"]), bool(config.get("qkv_bias", True))
  return dict(
      block="moe" if experts else "llama", num_layers=int(config["num_hidden_layers"]), width=width,
      num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
      head_dim=0 if head_dim * heads == width else head_dim,
      mlp_dim=mlp_dim, vocab_size=int(config["vocab_size"]),
      positions="rotary", rope_theta=float(config.get("rope_theta", 10000.0)),
      rope_scaling=json.dumps(scaling, sort_keys=True) if scaling else "",
      norm_epsilon=float(config.get("rms_norm_eps", 1e-6)), final_norm="rms", head_bias=False,
      qkv_bias=qkv_bias, sliding_window=int(window or 0),
      max_len=int(config.get("max_position_embeddings", 0)),
      tie_embeddings=bool(config.get("tie_word_embeddings", False)), **experts)


def _gpt2_fields(config: dict) -> dict[str, Any]:
  _refuse(config, "gpt2", activation_function=("gelu_new", "gelu_pytorch_tanh"),
          scale_attn_weights=(True,), scale_attn_by_inverse_layer_idx=(False,))
  width = int(config.get("n_embd", 768))
  return dict(
      block="gpt", num_layers=int(config.get("n_layer", 12)), width=width,
      num_heads=int(config.get("n_head", 12)), num_kv_heads=None, head_dim=0,
      mlp_dim=int(config.get("n_inner") or 4 * width),
      vocab_size=int(config.get("vocab_size", 50257)), positions="learned",
      norm_epsilon=float(config.get("layer_norm_epsilon", 1e-5)), final_norm="layer",
      head_bias=False, qkv_bias=False, sliding_window=0,
      max_len=int(config.get("n_positions", 1024)),
      tie_embeddings=bool(config.get("tie_word_embeddings", True)))


# ------------------------------------------------------------------------------------------------
# Tensors.


def read_safetensors(path) -> dict[str, np.ndarray]:
  """Every tensor of a ``.safetensors`` file, memory-mapped (bfloat16 as ``ml_dtypes``')."""
  path = pathlib.Path(path)
  with path.open("rb") as f:
    size = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(size))
  header.pop("__metadata__", None)
  data = np.memmap(path, np.uint8, "r", offset=8 + size)
  tensors = {}
  for name, info in header.items():
    if info["dtype"] not in _DTYPES:
      raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}; tpipe reads "
                       f"{sorted(_DTYPES)}.")
    begin, end = info["data_offsets"]
    tensors[name] = data[begin:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
  return tensors


def _tensors(directory: pathlib.Path) -> dict[str, np.ndarray]:
  files = sorted(directory.glob("*.safetensors"))
  if not files:
    raise ValueError(f"{directory} has no *.safetensors file (PyTorch .bin checkpoints are not "
                     "read: save the model with safe_serialization=True).")
  tensors = {}
  for file in files:
    tensors.update(read_safetensors(file))
  return tensors


class _Reader:
  """Takes tensors by name (as float32), remembering which were used."""

  def __init__(self, tensors: dict[str, np.ndarray], prefix: str):
    self._tensors, self._prefix, self.used = tensors, prefix, set()

  def __call__(self, name: str) -> np.ndarray:
    key = self._prefix + name
    if key not in self._tensors:
      raise ValueError(f"the checkpoint has no tensor {key!r}; is it the model its config.json "
                       "describes?")
    self.used.add(key)
    return np.asarray(self._tensors[key], np.float32)

  def unprefixed(self, name: str) -> np.ndarray | None:
    """Tensor ``name`` without the prefix (GPT-2's ``lm_head.weight``) as float32, or None."""
    if name not in self._tensors:
      return None
    self.used.add(name)
    return np.asarray(self._tensors[name], np.float32)

  def check_all_used(self) -> None:
    left = sorted(k for k in set(self._tensors) - self.used if not k.endswith(_BUFFERS))
    if left:
      raise ValueError(f"the checkpoint has tensors tpipe does not map: {left[:5]}"
                       f"{' ...' if len(left) > 5 else ''}; its config.json may not describe "
                       "it.")


def _stack(layers: list[dict]) -> dict:
  """Per-layer trees stacked on a leading axis (the Repeat's layout)."""
  first = layers[0]
  if isinstance(first, dict):
    return {k: _stack([layer[k] for layer in layers]) for k in first}
  return np.stack(layers)


def load_params(directory, fields: dict[str, Any] | None = None) -> dict[str, Any]:
  """The logical parameters of the model in ``directory`` (float32 NumPy arrays).

  Args:
    directory: a Hugging Face checkpoint directory or a tpipe workdir (its latest checkpoint).
    fields: :func:`architecture_of` ``directory`` (computed when None).

  Returns:
    ``{"layers_0": ..., "layers_1": ..., "layers_2": ...}`` as
    :func:`tpipe.train.models.decoder_lm` names them.
  """
  directory = pathlib.Path(directory).expanduser()
  fields = architecture_of(directory) if fields is None else fields
  if is_workdir(directory):
    return _workdir_params(directory)
  tensors = _tensors(directory)
  if fields["family"] == "gpt2":
    prefix = "transformer." if "transformer.wte.weight" in tensors else ""
    read = _Reader(tensors, prefix)
    params = _gpt2_params(read, fields)
  else:
    read = _Reader(tensors, "")
    params = _llama_params(read, fields)
  read.check_all_used()
  return params


def _workdir_params(directory: pathlib.Path) -> dict[str, Any]:
  from tpipe.train import checkpointing  # pylint: disable=g-import-not-at-top
  steps = sorted(int(p.name) for p in (directory / "checkpoints").iterdir() if p.name.isdigit())
  if not steps:
    raise ValueError(f"the workdir {directory} has no checkpoint yet.")
  return {name: checkpointing.read_layer(directory / "checkpoints", steps[-1], name)
          for name in ("layers_0", "layers_1", "layers_2")}


def _shape(fields) -> tuple[int, int, int, int]:
  heads, kv = fields["num_heads"], fields["num_kv_heads"] or fields["num_heads"]
  return fields["width"], heads, kv, fields["head_dim"] or fields["width"] // heads


def _llama_params(read: _Reader, fields) -> dict[str, Any]:
  width, heads, kv, dim = _shape(fields)
  blocks = []
  for i in range(fields["num_layers"]):
    p = f"model.layers.{i}."
    block = {
        "attn_norm": {"scale": read(p + "input_layernorm.weight")},
        "query": read(p + "self_attn.q_proj.weight").T.reshape(width, heads, dim),
        "key": read(p + "self_attn.k_proj.weight").T.reshape(width, kv, dim),
        "value": read(p + "self_attn.v_proj.weight").T.reshape(width, kv, dim),
        "out": read(p + "self_attn.o_proj.weight").T.reshape(heads, dim, width),
        "mlp_norm": {"scale": read(p + "post_attention_layernorm.weight")},
    }
    if fields["family"] == "qwen2_moe":
      block["moe"] = _qwen2_moe_experts(read, p + "mlp.", fields["num_experts"])
    elif fields["block"] == "moe":
      block["moe"] = _mixtral_experts(read, p + "block_sparse_moe.", fields["num_experts"])
    else:
      block.update(gate=read(p + "mlp.gate_proj.weight").T, up=read(p + "mlp.up_proj.weight").T,
                   down=read(p + "mlp.down_proj.weight").T)
    if fields["qkv_bias"]:
      block["query_bias"] = read(p + "self_attn.q_proj.bias").reshape(heads, dim)
      block["key_bias"] = read(p + "self_attn.k_proj.bias").reshape(kv, dim)
      block["value_bias"] = read(p + "self_attn.v_proj.bias").reshape(kv, dim)
    blocks.append(block)
  embedding = read("model.embed_tokens.weight")
  return {"layers_0": {"embed": {"embedding": embedding}},
          "layers_1": _stack(blocks),
          "layers_2": {"final_norm": {"scale": read("model.norm.weight")},
                       "head": {"kernel": _head(read, embedding, fields)}}}


def _mixtral_experts(read: _Reader, p: str, num_experts: int) -> dict[str, np.ndarray]:
  """A Mixtral layer's router and experts: ``gate.weight [E, D]`` is the router transposed,
  expert ``j``'s ``w1``, ``w3 [H, D]`` and ``w2 [D, H]`` its gate, up and down transposed."""
  experts = lambda name: np.stack([read(f"{p}experts.{j}.{name}.weight").T
                                   for j in range(num_experts)])
  return {"router": read(p + "gate.weight").T, "gate": experts("w1"), "up": experts("w3"),
          "down": experts("w2")}


def _qwen2_moe_experts(read: _Reader, p: str, num_experts: int) -> dict[str, np.ndarray]:
  """A Qwen2-MoE layer's router, experts and shared expert: ``gate.weight [E, D]`` is the
  router transposed, expert ``j``'s ``gate_proj``, ``up_proj [H, D]`` and ``down_proj [D, H]``
  its gate, up and down transposed, the shared expert's likewise, and ``shared_expert_gate.weight
  [1, D]`` the shared expert's gate ``shared_router [D, 1]``."""
  experts = lambda name: np.stack([read(f"{p}experts.{j}.{name}.weight").T
                                   for j in range(num_experts)])
  return {"router": read(p + "gate.weight").T, "gate": experts("gate_proj"),
          "up": experts("up_proj"), "down": experts("down_proj"),
          "shared_gate": read(p + "shared_expert.gate_proj.weight").T,
          "shared_up": read(p + "shared_expert.up_proj.weight").T,
          "shared_down": read(p + "shared_expert.down_proj.weight").T,
          "shared_router": read(p + "shared_expert_gate.weight").T}


def _gpt2_params(read: _Reader, fields) -> dict[str, Any]:
  width, heads, _, dim = _shape(fields)
  norm = lambda name: {"scale": read(name + ".weight"), "bias": read(name + ".bias")}
  blocks = []
  for i in range(fields["num_layers"]):
    p = f"h.{i}."
    qkv, qkv_bias = read(p + "attn.c_attn.weight"), read(p + "attn.c_attn.bias")
    attn = {name: {"kernel": qkv[:, j * width:(j + 1) * width].reshape(width, heads, dim),
                   "bias": qkv_bias[j * width:(j + 1) * width].reshape(heads, dim)}
            for j, name in enumerate(("query", "key", "value"))}
    attn["out"] = {"kernel": read(p + "attn.c_proj.weight").reshape(heads, dim, width),
                   "bias": read(p + "attn.c_proj.bias")}
    blocks.append({
        "attn_norm": norm(p + "ln_1"), "attn": attn, "mlp_norm": norm(p + "ln_2"),
        "mlp_in": {"kernel": read(p + "mlp.c_fc.weight"), "bias": read(p + "mlp.c_fc.bias")},
        "mlp_out": {"kernel": read(p + "mlp.c_proj.weight"),
                    "bias": read(p + "mlp.c_proj.bias")}})
  embedding = read("wte.weight")
  return {"layers_0": {"embed": {"embedding": embedding}, "pos_embed": read("wpe.weight")},
          "layers_1": _stack(blocks),
          "layers_2": {"final_norm": norm("ln_f"),
                       "head": {"kernel": _head(read, embedding, fields)}}}


def _head(read: _Reader, embedding: np.ndarray, fields) -> np.ndarray:
  """The head's kernel ``[width, vocab]``: the embedding's transpose when tied (a tied
  checkpoint may store the matrix again as ``lm_head.weight``), else ``lm_head.weight``'s."""
  stored = read.unprefixed("lm_head.weight")
  if fields["tie_embeddings"]:
    return np.ascontiguousarray(embedding.T)
  if stored is None:
    raise ValueError("the checkpoint is untied (tie_word_embeddings=false) but has no "
                     "lm_head.weight.")
  return np.ascontiguousarray(stored.T)


# ------------------------------------------------------------------------------------------------
# Export.


def family_of(fields: dict[str, Any]) -> str:
  """The Hugging Face family an architecture exports as: ``fields["family"]``, or for a model
  trained from scratch the one it fits.

  Raises:
    ValueError: naming the fields that fit no family.
  """
  family = fields.get("family") or ""
  if not family:
    if fields["block"] == "gpt":
      family = "gpt2"
    elif fields["block"] == "moe":  # Only Qwen2-MoE has a shared expert.
      family = "qwen2_moe" if fields.get("shared_expert_mlp_dim") else "mixtral"
    else:
      family = "qwen2" if fields["qkv_bias"] else "mistral" if fields["sliding_window"] \
          else "llama"
  if family == "gpt2":
    wrong = {"head_bias": False, "final_norm": "layer", "positions": "learned"}
  else:
    wrong = {"head_bias": False, "final_norm": "rms", "positions": "rotary",
             "qkv_bias": family == "qwen2"}
  wrong["block"] = "gpt" if family == "gpt2" else "moe" if family in _MOE else "llama"
  if family in _MOE:  # Hugging Face's mixtures route dropless: no capacity.
    wrong["capacity_factor"] = 0.0
  if family == "qwen2_moe":  # Its biases are optional, its window is per layer.
    del wrong["qkv_bias"]
    wrong["sliding_window"] = 0
  if family != "qwen2_moe":  # Mixtral's experts (and a dense MLP): no shared expert, the
    # top-k weights renormalised.
    wrong.update(shared_expert_mlp_dim=0, normalize_expert_weights=True)
  given = {**architecture_fields.DEFAULTS, **fields}  # A config from before a field: its default.
  wrong = [f"config.{k}={given[k]!r} (export needs {v!r})" for k, v in wrong.items()
           if given[k] != v]
  if family == "qwen2" and fields["sliding_window"]:
    wrong.append("config.sliding_window with qkv_bias (no Hugging Face family has both)")
  if family == "qwen2_moe" and given["shared_expert_mlp_dim"] < 1:
    wrong.append(f"config.shared_expert_mlp_dim={given['shared_expert_mlp_dim']!r} (export "
                 "needs a shared expert, >= 1)")
  if wrong:
    raise ValueError(f"this model does not fit Hugging Face's {_CLASSES[family]}: "
                     f"{'; '.join(wrong)}.")
  return family


def hf_config(fields: dict[str, Any], family: str, dtype: str = "float32") -> dict[str, Any]:
  """The ``config.json`` of the exported model."""
  common = {"architectures": [_CLASSES[family]], "model_type": family,
            "vocab_size": fields["vocab_size"], "torch_dtype": dtype}
  if family == "gpt2":
    return {**common, "n_embd": fields["width"], "n_head": fields["num_heads"],
            "n_layer": fields["num_layers"], "n_inner": fields["mlp_dim"],
            "n_positions": fields["max_len"], "layer_norm_epsilon": fields["norm_epsilon"],
            "activation_function": "gelu_new",
            "tie_word_embeddings": bool(fields["tie_embeddings"])}
  width, heads, kv, dim = _shape(fields)
  config = {**common, "hidden_size": width, "intermediate_size": fields["mlp_dim"],
            "num_hidden_layers": fields["num_layers"], "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": dim, "hidden_act": "silu",
            "rms_norm_eps": fields["norm_epsilon"], "rope_theta": fields["rope_theta"],
            "rope_scaling": json.loads(fields["rope_scaling"]) if fields["rope_scaling"]
            else None,
            "max_position_embeddings": fields["max_len"] or 4096,
            "tie_word_embeddings": bool(fields["tie_embeddings"])}
  if family == "llama":
    config.update(attention_bias=False, mlp_bias=False)
  if family in ("mistral", "mixtral"):
    config["sliding_window"] = fields["sliding_window"] or None
  if family == "mixtral":
    config.update(num_local_experts=fields["num_experts"],
                  num_experts_per_tok=fields["experts_per_token"], router_jitter_noise=0.0)
  if family == "qwen2_moe":  # Every layer a mixture (intermediate_size: dense layers', none).
    config.update(num_experts=fields["num_experts"],
                  num_experts_per_tok=fields["experts_per_token"],
                  moe_intermediate_size=fields["mlp_dim"],
                  shared_expert_intermediate_size=fields["shared_expert_mlp_dim"],
                  intermediate_size=fields["shared_expert_mlp_dim"],
                  norm_topk_prob=bool(fields["normalize_expert_weights"]),
                  qkv_bias=bool(fields["qkv_bias"]), decoder_sparse_step=1, mlp_only_layers=[],
                  use_sliding_window=False)
  if family in _MOE and fields.get("router_aux_loss_coef") is not None:  # A training setting.
    config["router_aux_loss_coef"] = float(fields["router_aux_loss_coef"])
  return config


def hf_tensors(params: dict[str, Any], fields: dict[str, Any], family: str
               ) -> dict[str, np.ndarray]:
  """The logical parameters as Hugging Face's tensors (names and layouts of the PyTorch
  classes; a tied model's one matrix once)."""
  params = {k: np.asarray(v) if not isinstance(v, dict) else v for k, v in params.items()}
  get = lambda tree, *keys: np.asarray(_walk(tree, keys))
  blocks = params["layers_1"]
  out = {}
  if family == "gpt2":
    for i in range(fields["num_layers"]):
      p = f"transformer.h.{i}."
      b = lambda *keys, i=i: get(blocks, *keys)[i]
      for name, norm in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
        out[p + name + ".weight"], out[p + name + ".bias"] = b(norm, "scale"), b(norm, "bias")
      width = fields["width"]
      out[p + "attn.c_attn.weight"] = np.concatenate(
          [b("attn", n, "kernel").reshape(width, width) for n in ("query", "key", "value")], 1)
      out[p + "attn.c_attn.bias"] = np.concatenate(
          [b("attn", n, "bias").reshape(width) for n in ("query", "key", "value")])
      out[p + "attn.c_proj.weight"] = b("attn", "out", "kernel").reshape(width, width)
      out[p + "attn.c_proj.bias"] = b("attn", "out", "bias")
      out[p + "mlp.c_fc.weight"], out[p + "mlp.c_fc.bias"] = (b("mlp_in", "kernel"),
                                                              b("mlp_in", "bias"))
      out[p + "mlp.c_proj.weight"], out[p + "mlp.c_proj.bias"] = (b("mlp_out", "kernel"),
                                                                  b("mlp_out", "bias"))
    out["transformer.wte.weight"] = get(params, "layers_0", "embed", "embedding")
    out["transformer.wpe.weight"] = get(params, "layers_0", "pos_embed")
    out["transformer.ln_f.weight"] = get(params, "layers_2", "final_norm", "scale")
    out["transformer.ln_f.bias"] = get(params, "layers_2", "final_norm", "bias")
    if not fields["tie_embeddings"]:
      out["lm_head.weight"] = get(params, "layers_2", "head", "kernel").T
  else:
    width, heads, kv, dim = _shape(fields)
    for i in range(fields["num_layers"]):
      p = f"model.layers.{i}."
      b = lambda *keys, i=i: get(blocks, *keys)[i]
      out[p + "input_layernorm.weight"] = b("attn_norm", "scale")
      out[p + "post_attention_layernorm.weight"] = b("mlp_norm", "scale")
      out[p + "self_attn.q_proj.weight"] = b("query").reshape(width, heads * dim).T
      out[p + "self_attn.k_proj.weight"] = b("key").reshape(width, kv * dim).T
      out[p + "self_attn.v_proj.weight"] = b("value").reshape(width, kv * dim).T
      out[p + "self_attn.o_proj.weight"] = b("out").reshape(heads * dim, width).T
      if fields["qkv_bias"]:
        out[p + "self_attn.q_proj.bias"] = b("query_bias").reshape(-1)
        out[p + "self_attn.k_proj.bias"] = b("key_bias").reshape(-1)
        out[p + "self_attn.v_proj.bias"] = b("value_bias").reshape(-1)
      if family in _MOE:
        q = p + ("block_sparse_moe." if family == "mixtral" else "mlp.")
        names = (("w1", "gate"), ("w3", "up"), ("w2", "down")) if family == "mixtral" else (
            ("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"))
        out[q + "gate.weight"] = b("moe", "router").T
        for j in range(fields["num_experts"]):
          for name, weight in names:
            out[f"{q}experts.{j}.{name}.weight"] = b("moe", weight)[j].T
        if family == "qwen2_moe":
          for name, weight in names:
            out[f"{q}shared_expert.{name}.weight"] = b("moe", "shared_" + weight).T
          out[q + "shared_expert_gate.weight"] = b("moe", "shared_router").T
      else:
        out[p + "mlp.gate_proj.weight"] = b("gate").T
        out[p + "mlp.up_proj.weight"] = b("up").T
        out[p + "mlp.down_proj.weight"] = b("down").T
    out["model.embed_tokens.weight"] = get(params, "layers_0", "embed", "embedding")
    out["model.norm.weight"] = get(params, "layers_2", "final_norm", "scale")
    if not fields["tie_embeddings"]:
      out["lm_head.weight"] = get(params, "layers_2", "head", "kernel").T
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _walk(tree, keys):
  for key in keys:
    tree = tree[key]
  return tree


def export(params: dict[str, Any], fields: dict[str, Any], out, dtype: str = "float32"
           ) -> pathlib.Path:
  """Writes ``config.json`` and ``model.safetensors`` of a Hugging Face model to ``out``.

  Args:
    params: logical parameters (NumPy or JAX arrays).
    fields: the architecture (:func:`architecture_of`, or a run's resolved config).
    out: a new or empty directory (an existing model there is never overwritten).
    dtype: ``"float32"`` or ``"bfloat16"`` tensors.

  Returns:
    ``out`` as a path.

  Raises:
    ValueError: the model fits no family (:func:`family_of`), a tied model's copies differ,
      ``out`` is not empty, or an unknown dtype.
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  if dtype not in ("float32", "bfloat16"):
    raise ValueError(f"--dtype={dtype!r}: export writes 'float32' or 'bfloat16'.")
  family = family_of(fields)
  if fields["tie_embeddings"]:
    from tpipe.train import tied  # pylint: disable=g-import-not-at-top
    if not tied.are_equal(params):
      raise ValueError("the tied embedding's two copies differ; this checkpoint was not "
                       "trained with config.tie_embeddings=True.")
  out = pathlib.Path(out).expanduser()
  if out.exists() and any(out.iterdir()):
    raise ValueError(f"--out={out} is not empty; export writes into a new directory.")
  out.mkdir(parents=True, exist_ok=True)
  tensors = hf_tensors(params, fields, family)
  tensors = {k: v.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
             for k, v in tensors.items()}
  save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
  (out / "config.json").write_text(json.dumps(hf_config(fields, family, dtype), indent=2))
  return out
