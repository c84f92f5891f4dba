"""One measurement of :mod:`experiments.engine_comparison`, in the tree on ``PYTHONPATH``.

``engine_comparison`` starts this file as ``python -P experiments/_engine_worker.py KIND JSON``
with the working directory and ``PYTHONPATH`` set to the tree under test (this checkout, or a
checkout of the previous engine), so ``import tpipe`` and ``import configs`` find that tree's
code. For the same reason it imports nothing from ``experiments`` (not even the preamble): the
emulated CPU devices come from the environment ``engine_comparison``'s preamble set
(``JAX_PLATFORMS``, ``JAX_NUM_CPU_DEVICES``), which the subprocess inherits. The code runs on
both APIs: the previous one (``tpipe.param_shardings``, ``tpipe.report``) and today's
(``tpipe.shardings``, ``tpipe.train.cli.report``). It prints one line, ``RESULT {json}``.

Kinds:

* ``stack``: the full train step (forward, backward, SGD) of a ``tpipe.pipeline`` of residual MLP
  blocks: compile CPU and wall seconds, per-device bytes from ``memory_analysis()`` (arguments,
  outputs, aliased, temporaries and the peak), and the time of each step after ``warmup``
  untimed ones.
* ``report``: ``analyze_config(config, per_stage=False)`` of ``configs/transformer_gpipe.py`` at
  a ``size``: the per-device peak and the parameter and optimizer argument bytes.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import time


def _tpipe_file() -> str:
  import tpipe  # pylint: disable=g-import-not-at-top

  return os.path.abspath(tpipe.__file__)


def stack(width: int, batch: int, length: int, stages: int, microbatches: int, runs: int,
          warmup: int, granularity: str | None = None) -> dict:  # One measurement's settings.
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  import tpipe  # pylint: disable=g-import-not-at-top

  class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
      h = nn.gelu(nn.Dense(4 * self.width)(x))
      # The residual branch starts at variance 1 / length, so the stack's outputs stay of order
      # one and the measured steps train (loss falls) instead of running on infinities and NaNs.
      out = nn.Dense(self.width,
                     kernel_init=nn.initializers.variance_scaling(1 / length, "fan_in", "normal"))
      return x + out(h)

  mesh = tpipe.make_mesh(stages=stages)
  # Each tree's default remat granularity, or the one asked for in both.
  chosen = {} if granularity is None else {"remat_granularity": granularity}
  model = tpipe.pipeline(Block, length=length, num_stages=stages, num_microbatches=microbatches,
                         schedule="gpipe", remat="full", mesh=mesh, **chosen)(width=width)
  kx, ky = jax.random.split(jax.random.key(1))
  data = {"x": jax.random.normal(kx, (batch, width)), "y": jax.random.normal(ky, (batch, width))}
  params = {"blocks": model.init(jax.random.key(0), data["x"])["params"]}
  # The stack split over 'stage' on its layer axis, the rest replicated.
  if hasattr(tpipe, "shardings"):
    placement = tpipe.shardings(params, mesh, ("blocks",))
  else:
    placement = tpipe.param_shardings(params, mesh, ("blocks",))
  optimizer = optax.sgd(1e-3)
  state = tpipe.create_train_state(params, optimizer, placement)
  state_shardings = jax.tree.map(lambda a: a.sharding, state)
  data = jax.device_put(data, tpipe.data_sharding(mesh))

  def loss(p, b, rng):
    del rng
    return jnp.mean((model.apply({"params": p["blocks"]}, b["x"]) - b["y"]) ** 2)

  step = tpipe.make_train_step(loss, optimizer, shardings=state_shardings)
  rng = jax.random.key(0)
  cpu, wall = time.process_time(), time.perf_counter()
  compiled = step.lower(state, data, rng).compile()
  compile_cpu, compile_wall = time.process_time() - cpu, time.perf_counter() - wall
  memory = compiled.memory_analysis()
  run = compiled
  times = []
  for i in range(warmup + runs):
    start = time.perf_counter()
    try:
      state, metrics = run(state, data, rng)
    except TypeError:
      if run is step:
        raise
      # Trees before 58.2's fix lowered the inner jit, whose compiled program takes the
      # parameters apart from the rest of the state (refused before it runs): time the jitted
      # step there (this warm-up call compiles it again).
      run = step
      state, metrics = run(state, data, rng)
    jax.block_until_ready((state, metrics))
    if i >= warmup:
      times.append(time.perf_counter() - start)
  if not math.isfinite(float(metrics["loss"])):
    raise FloatingPointError(f"the stack's loss is {float(metrics['loss'])} after "
                             f"{warmup + runs} steps: the timed steps ran on non-finite numbers")
  bytes_ = {"arguments": int(memory.argument_size_in_bytes),
            "outputs": int(memory.output_size_in_bytes),
            "aliased": int(memory.alias_size_in_bytes),
            "temporaries": int(memory.temp_size_in_bytes)}
  peak = bytes_["arguments"] + bytes_["outputs"] - bytes_["aliased"] + bytes_["temporaries"]
  return {"compile_cpu_seconds": compile_cpu, "compile_seconds": compile_wall,
          "step_seconds": times, "peak": peak, **bytes_, "loss": float(metrics["loss"])}


def report(size: str) -> dict:
  from configs import transformer_gpipe  # pylint: disable=g-import-not-at-top

  # The report's library in this tree's layout, or in an older one (a run against a past commit).
  for name in ("tpipe.train.cli.config_costs", "tpipe.train.report", "tpipe.report"):
    try:
      report_lib = importlib.import_module(name)
      break
    except ModuleNotFoundError:
      continue
  config = transformer_gpipe.get_config(f"size={size}")
  rep = report_lib.analyze_config(config, per_stage=False)
  memory = rep.analysis.memory
  return {"size": size, "num_stages": int(config.num_stages), "num_data": int(config.num_data),
          "num_microbatches": int(config.num_microbatches), "schedule": config.schedule,
          "largest_device": int(rep.largest_device_bytes), "total": int(rep.total_bytes),
          "params": int(rep.params_bytes), "opt_state": int(rep.opt_state_bytes),
          "batch": int(rep.batch_bytes), "arguments": int(memory.arguments),
          "temporaries": int(memory.temporaries), "compile_cpu_seconds": rep.cpu_seconds,
          "compile_seconds": rep.lower_seconds + rep.compile_seconds,
          "num_params": int(rep.num_params), "report_module": report_lib.__name__}


def main(argv: list[str]) -> None:
  kind, arguments = argv[1], json.loads(argv[2])
  result = {"stack": stack, "report": report}[kind](**arguments)
  result["tpipe"] = _tpipe_file()
  print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main(sys.argv)
