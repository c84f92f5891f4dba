"""The LM's architecture fields: their names and the defaults a config without them gets.

The lowest piece of :mod:`tpipe.train.architecture`: what a config's architecture is made of,
read by the modules that fill it in (:mod:`tpipe.train.pretrained`) without importing what
resolves it.
"""

from __future__ import annotations

# Architecture fields beyond the sizes every LM config has (num_layers, width, num_heads,
# mlp_dim), with the defaults that give the byte-level LM of tpipe.train.models.
DEFAULTS = {
    "block": "gpt",
    "num_kv_heads": None,
    "head_dim": 0,
    "vocab_size": 0,
    "positions": "learned",
    "rope_theta": 10000.0,
    "rope_scaling": "",
    "norm_epsilon": 1e-6,
    "final_norm": "layer",
    "head_bias": True,
    "qkv_bias": False,
    "sliding_window": 0,
    "num_experts": 8,
    "experts_per_token": 2,
    "capacity_factor": 0.0,
    "normalize_expert_weights": True,
    "shared_expert_mlp_dim": 0,
    "max_len": 0,
    "tie_embeddings": False,
    "family": "",
}
# Every field that shapes the model or its parameters: init_from sets them all, and a run
# resumed with any of them changed is refused.
FIELDS = ("num_layers", "width", "num_heads", "mlp_dim") + tuple(DEFAULTS)
