"""The GPipe paper's Transformer setting, in kind: a deep stack and many micro-batches.

GPipe (Huang et al., 2019) trains Transformers of model width 2048, feed-forward width 8192 and
32 attention heads, made deeper as accelerators are added, with the mini-batch split into 32
micro-batches (the speed study uses a 48-layer model). This config keeps those proportions for
our byte-level LM on the Python standard library: 48 blocks of width 2048 (about 2.4B
parameters), 32 micro-batches, full rematerialisation, 4 pipeline stages, bfloat16 compute
(float32 parameters and Adam state). It is sized for a TPU VM with 4 chips of 32 GiB (e.g. v4-8):
per chip about 10 GiB of params and Adam state plus the activations of one stage. Use
``:size=tiny`` to run the same shape of experiment here.

Commands::

  # Here: 8 emulated CPU devices (data=2 x stage=4), 8 layers, 8 micro-batches, 20 steps.
  python -m tpipe.train --config=configs/transformer_gpipe.py:size=tiny --workdir=/tmp/gpipe_tiny

  # On a TPU VM (see scripts/tpu_vm.sh), on every worker:
  python -m tpipe.train --config=configs/transformer_gpipe.py --workdir=$HOME/gpipe

  # More stages on a bigger slice (v4-16: 8 chips), or the circular schedule:
  python -m tpipe.train --config=configs/transformer_gpipe.py --workdir=$HOME/gpipe8 \\
      --config.num_stages=8
  python -m tpipe.train --config=configs/transformer_gpipe.py --workdir=$HOME/gpipe_c \\
      --config.schedule=circular --config.num_repeats=2
"""

import importlib.util
import os


def _lm_module():
  # Loaded by path: config files are imported by file name, not as a package.
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm.py")
  spec = importlib.util.spec_from_file_location("tpipe_configs_lm", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config(arg=None):
  """Returns the GPipe-style Transformer config.

  Args:
    arg: ``size=gpipe`` (default, TPU VM) or ``size=tiny`` (runs on this machine's CPU).

  Returns:
    An ``ml_collections.ConfigDict`` with the fields of ``configs/lm.py``.
  """
  parts = dict(p.split("=", 1) if "=" in p else ("size", p)
               for p in filter(None, (arg or "").split(",")))
  size = parts.pop("size", "gpipe")
  if parts:
    raise ValueError(f"Unknown config argument(s) {sorted(parts)}; only size=... is accepted.")
  if size not in ("gpipe", "tiny"):
    raise ValueError(f"Unknown size {size!r}; choose 'gpipe' (TPU VM) or 'tiny' (CPU).")
  config = _lm_module().get_config("size=tiny" if size == "tiny" else "size=base")
  config.size = f"transformer_gpipe/{size}"
  # TPU-first: bfloat16 compute halves the stashed and transferred activations; parameters and
  # the optimizer state stay float32.
  config.dtype = "bfloat16"
  if size == "gpipe":
    config.num_layers = 48
    config.width = 2048
    config.num_heads = 32
    config.mlp_dim = 8192
    config.seq_len = 512
    config.dropout = 0.1
    config.num_stages = 4
    config.num_data = 1
    config.num_microbatches = 32
    config.batch_size = 128  # 32 micro-batches of 4 sequences.
    config.remat = "full"
    config.remat_granularity = "chunk"
    config.learning_rate = 1e-4
    config.num_steps = 10_000
    config.max_corpus_bytes = 100_000_000  # The whole stdlib (~30 MB).
    config.eval_every = 500
    config.checkpoint_every = 500
    config.log_every = 10
  else:
    config.num_layers = 8
    config.width = 32
    config.num_heads = 2
    config.mlp_dim = 128
    config.seq_len = 32
    config.num_stages = 4
    config.num_data = 2
    config.num_microbatches = 8
    config.batch_size = 32  # 2 replicas x 8 micro-batches x 2 sequences.
    config.remat = "full"
    config.remat_granularity = "chunk"
    config.num_steps = 20
  return config
