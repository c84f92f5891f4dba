"""A pipelined ResNet-style convnet with BatchNorm on the UCI handwritten digits.

GPipe's second task was image classification. The network (``tpipe.train.convnet``) is a stem,
residual cells with BatchNorm (the first cell of each later group halves the resolution and
doubles the channels) and a pooling classifier whose per-example loss lives in the last stage.
``tpipe.Sequential`` cuts it into 4 stages balanced by FLOPs, times 2 data replicas, on the 8
emulated CPU devices. Each micro-batch is normalized with its own statistics; the running
averages are updated once per step from statistics pooled over the whole mini-batch.

Data: the 1,797 8x8 digit images that scikit-learn ships (no download), a fixed stratified split
of 1,437 training and 360 test images, random shifts of up to one pixel.

Commands::

  python -m tpipe.train --config=configs/convnet.py --workdir=/tmp/digits
  python -m tpipe.train --config=configs/convnet.py:size=tiny --workdir=/tmp/d --config.num_steps=20
  python -m tpipe.train.cli.report --config=configs/convnet.py
"""

import ml_collections

# name -> (width, stage_sizes, batch_size, num_microbatches, num_steps)
_SIZES = {
    "tiny": (8, (1, 1), 32, 2, 20),
    "small": (16, (2, 2), 64, 4, 1000),
}


def get_config(arg=None):
  """Returns the digits convnet config.

  Args:
    arg: the text after ``:`` in ``--config=configs/convnet.py:ARG``: ``size=tiny`` (tests) or
      ``size=small`` (default).

  Returns:
    An ``ml_collections.ConfigDict``.
  """
  parts = dict(p.split("=", 1) if "=" in p else ("size", p)
               for p in filter(None, (arg or "").split(",")))
  size = parts.pop("size", "small")
  if parts:
    raise ValueError(f"Unknown config argument(s) {sorted(parts)}; only size=... is accepted.")
  if size not in _SIZES:
    raise ValueError(f"Unknown size {size!r}; choose one of {sorted(_SIZES)}.")
  width, stage_sizes, batch_size, num_microbatches, num_steps = _SIZES[size]

  config = ml_collections.ConfigDict()
  config.task = "image_classification"
  config.size = size

  # Model: Stem, residual cells (stage_sizes per resolution), pooling classifier with the loss.
  config.width = width
  config.stage_sizes = stage_sizes
  config.bn_momentum = 0.9
  config.dtype = "float32"

  # Pipeline and mesh: num_stages * num_data devices.
  config.num_stages = 4
  config.num_data = 2
  config.num_microbatches = num_microbatches
  config.schedule = "gpipe"
  config.num_repeats = 1
  config.remat = "none"
  config.remat_granularity = "chunk"  # "chunk", "layer" or an int k (see configs/lm.py).
  config.balance = "flops"

  # Optimisation.
  config.seed = 0
  config.batch_size = batch_size  # Global batch, sharded over 'data'.
  config.num_steps = num_steps
  config.learning_rate = 3e-3
  config.warmup_steps = max(1, min(100, num_steps // 10))
  config.weight_decay = 1e-4
  config.grad_clip = 1.0

  # Data.
  config.num_test = 360
  config.max_shift = 1  # Random shifts of the training images, in pixels.

  # Logging, eval and checkpoints (in steps).
  config.log_every = 50 if num_steps >= 100 else 1
  config.eval_every = 250 if num_steps >= 100 else 10
  config.checkpoint_every = 250 if num_steps >= 100 else 10
  config.keep_checkpoints = 3
  return config
