"""A plain (unpipelined) baseline: the convnet layers trained on the UCI digits, on one device.

Run from the repository root::

  python -m experiments.digits_baseline            # writes experiments/results/digits_baseline.md
  python -m experiments.digits_baseline --smoke    # 50 steps, to check the script

The layers of :mod:`tpipe.train.convnet` (``Stem -> ResidualCell x n -> PoolHead``) are applied
in order by a small linen wrapper under plain ``jax.jit`` on one device; no ``tpipe`` pipelining
is involved. Training uses batch statistics and updates the running averages
(``mutable=["batch_stats"]``); evaluation uses the running averages. The data is
:mod:`tpipe.train.images` (1,437 train / 360 test, random 1-pixel shifts). It reports the test
accuracy and the wall time: the accuracy a pipelined run of the same layers should match.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import _common
from tpipe.train import convnet
from tpipe.train import images as images_lib


class Classifier(nn.Module):
  """``layers[0] -> ... -> layers[-1]``: the convolutional layers take ``train``, the head labels.

  The layers are adopted as ``layers_0``, ``layers_1``, ... (``nn.Sequential``'s names, which
  are also ``tpipe.Sequential``'s logical names), so these variables have the pipelined model's
  layout.
  """

  layers: Sequence[nn.Module]

  @nn.compact
  def __call__(self, x: jax.Array, labels: jax.Array | None = None, *,
               train: bool = False) -> jax.Array:
    for layer in self.layers[:-1]:
      x = layer(x, train=train)
    return self.layers[-1](x, labels)


def make_functions(model: Classifier, optimizer: optax.GradientTransformation):
  """The jitted train step (batch statistics, running averages updated) and eval step."""

  def loss_fn(params, batch_stats, batch):
    losses, updates = model.apply({"params": params, "batch_stats": batch_stats},
                                  batch["images"], batch["labels"], train=True,
                                  mutable=["batch_stats"])
    return jnp.mean(losses), updates["batch_stats"]

  @jax.jit
  def train_step(state, batch):
    params, batch_stats, opt_state = state
    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, batch_stats, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), batch_stats, opt_state), loss

  @jax.jit
  def correct(params, batch_stats, batch):
    logits = model.apply({"params": params, "batch_stats": batch_stats}, batch["images"])
    return jnp.sum((jnp.argmax(logits, -1) == batch["labels"]) & batch["mask"])

  return train_step, correct


def evaluate(correct_fn, params, batch_stats, batches) -> float:
  hits = sum(int(correct_fn(params, batch_stats, b)) for b in batches)
  return hits / sum(int(b["mask"].sum()) for b in batches)


def run_training(args) -> dict[str, Any]:
  started = time.time()
  train, test = images_lib.DigitsData.load(num_test=args.num_test, seed=args.split_seed)
  layers = convnet.resnet_layers(width=args.width, stage_sizes=tuple(args.stage_sizes),
                                 bn_momentum=args.bn_momentum)
  model = Classifier(layers)
  schedule = optax.warmup_cosine_decay_schedule(0.0, args.learning_rate, args.warmup_steps,
                                                args.steps)
  optimizer = optax.adamw(schedule, weight_decay=args.weight_decay)
  it = images_lib.train_iterator(train, batch_size=args.batch_size, seed=args.seed,
                                 max_shift=args.max_shift)
  eval_batches = images_lib.eval_batches(test, batch_size=args.eval_batch_size)
  first = next(it)
  variables = model.init(jax.random.key(args.seed), first["images"], train=False)
  params, batch_stats = variables["params"], variables["batch_stats"]
  num_params = sum(np.size(p) for p in jax.tree.leaves(params))
  print(f"{len(layers)} layers, {num_params:,} parameters; {len(train)} train / {len(test)} "
        f"test images", flush=True)
  train_step, correct = make_functions(model, optimizer)
  state = (params, batch_stats, optimizer.init(params))
  batch, losses = first, []
  for step in range(1, args.steps + 1):
    state, loss = train_step(state, batch)
    losses.append(loss)
    if step % args.log_every == 0 or step == args.steps:
      mean_loss = float(np.mean(jax.device_get(losses)))
      losses = []
      line = f"step {step:5d}  train loss {mean_loss:.4f}"
      if step % args.eval_every == 0 or step == args.steps:
        line += f"  test accuracy {evaluate(correct, state[0], state[1], eval_batches):.4f}"
      print(f"{line}  ({time.time() - started:.1f} s)", flush=True)
    if step < args.steps:
      batch = next(it)
  accuracy = evaluate(correct, state[0], state[1], eval_batches)
  train_accuracy = evaluate(correct, state[0], state[1],
                            images_lib.eval_batches(train, batch_size=args.eval_batch_size))
  wall = time.time() - started
  print(f"test accuracy {accuracy:.4f} ({round(accuracy * len(test))}/{len(test)}), train "
        f"accuracy (running averages, no shifts) {train_accuracy:.4f}; {wall:.1f} s wall")
  return dict(accuracy=accuracy, train_accuracy=train_accuracy, wall=wall,
              num_params=num_params, num_layers=len(layers), num_test=len(test),
              num_train=len(train))


def result_lines(args, result: dict[str, Any]) -> list[str]:
  """The markdown table of the run's settings and results."""
  test_right = round(result["accuracy"] * result["num_test"])
  return [
      "| | |", "|---|---|",
      f"| data | UCI digits (`sklearn.datasets.load_digits`), {result['num_train']} train / "
      f"{result['num_test']} test, stratified split seed {args.split_seed}, random shifts up to "
      f"{args.max_shift} px |",
      f"| model | `resnet_layers(width={args.width}, stage_sizes={tuple(args.stage_sizes)})`: "
      f"{result['num_layers']} layers, {result['num_params']:,} parameters, BatchNorm momentum "
      f"{args.bn_momentum} |",
      f"| training | AdamW (weight decay {args.weight_decay}), peak learning rate "
      f"{args.learning_rate}, warmup {args.warmup_steps} then cosine to 0, {args.steps} steps of "
      f"batch {args.batch_size} (~{args.steps * args.batch_size / result['num_train']:.0f} "
      f"epochs), seed {args.seed} |",
      f"| **test accuracy** | **{result['accuracy']:.2%}** ({test_right}/{result['num_test']}), "
      "BatchNorm running averages |",
      f"| train accuracy | {result['train_accuracy']:.2%} (running averages, unshifted) |",
      f"| wall time | {result['wall']:.0f} s, everything (imports excluded): load, compile, "
      "train, eval |",
  ]


def add_arguments(parser) -> None:
  parser.add_argument("--width", type=int, default=16)
  parser.add_argument("--stage_sizes", type=int, nargs="+", default=[1, 1])
  parser.add_argument("--bn_momentum", type=float, default=0.9)
  parser.add_argument("--steps", type=int, default=1500)
  parser.add_argument("--batch_size", type=int, default=64)
  parser.add_argument("--learning_rate", type=float, default=3e-3)
  parser.add_argument("--warmup_steps", type=int, default=100)
  parser.add_argument("--weight_decay", type=float, default=1e-4)
  parser.add_argument("--max_shift", type=int, default=1)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--split_seed", type=int, default=0)
  parser.add_argument("--num_test", type=int, default=360)
  parser.add_argument("--eval_batch_size", type=int, default=120)
  parser.add_argument("--log_every", type=int, default=100)
  parser.add_argument("--eval_every", type=int, default=500)


def main():
  run = _common.start("digits_baseline", __doc__, smoke="50 steps (overrides --steps)",
                      arguments=add_arguments)
  args = run.args
  if run.smoke:
    args.steps, args.warmup_steps, args.log_every, args.eval_every = 50, 10, 25, 50
  result = run_training(args)
  run.write("Digits baseline: the convnet layers without pipelining", result_lines(args, result),
            "One device of those, plain `jax.jit`.")


if __name__ == "__main__":
  main()
