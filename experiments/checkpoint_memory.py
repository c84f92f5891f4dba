"""Checkpoint save and restore at scale: memory per device of the programs that move the state
between its stage layout and the layout-independent checkpoint form, from the TPU compiler.

The models and layouts are those of ``experiments/scale_3d.py`` (Llama-3-shaped, float32
parameters and AdamW moments) on the 64 chips of ``v5p:4x4x4``. A checkpoint holds the logical
state (``{"layers_i": tree}``, a repeated block's copies stacked ``[L, ...]``), every leaf split
over the whole mesh (:mod:`tpipe.core.layout.relayout`). Rows:

* **save**: ``Experiment.to_checkpoint`` compiled on the layout's abstract state: the staged state
  in (the arguments), the checkpoint form out;
* **restore**: ``Experiment.from_checkpoint`` compiled on the checkpoint form as Orbax restores it
  for that layout (Orbax reads each device's blocks straight from the files into the checkpoint
  form's shardings, no device program), the staged state out. A checkpoint written by one layout
  restores into another through exactly this program, since the form does not depend on the
  layout.

Columns, per device, from ``memory_analysis()``: arguments, outputs, temporaries, the peak
(arguments + outputs - aliased + temporaries), the state the layout holds (the train step's
state arguments: parameters and moments with the stage layout's padding), and the ideal share
(12 bytes per parameter over the 64 chips). The bar the work set itself: peak at most twice the
held state.

Needs the TPU compiler: ``pip install -e '.[tpu]'``.
"""

from __future__ import annotations

import os
import time

from experiments import _common

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # One host: no slice discovery.

import jax  # noqa: E402  pylint: disable=g-import-not-at-top

import tpipe  # noqa: E402  pylint: disable=g-import-not-at-top
from experiments import scale_3d  # noqa: E402  pylint: disable=g-import-not-at-top
from tpipe.train.cli import experiment  # noqa: E402  pylint: disable=g-import-not-at-top

# (model, stages, fsdp, tensor, schedule)
LAYOUTS = [
    ("llama3-8b", 4, 8, 2, "gpipe"),
    ("llama3-8b", 8, 4, 2, "1f1b"),
    ("llama3-70b", 8, 4, 2, "1f1b"),
]
SMOKE_LAYOUTS = LAYOUTS[:1]


def state_bytes(abstract) -> int:
  """Bytes one device holds of an abstract, sharded tree."""
  total = 0
  for leaf in jax.tree.leaves(abstract):
    shard = leaf.sharding.shard_shape(leaf.shape)
    size = 1
    for n in shard:
      size *= n
    total += size * leaf.dtype.itemsize
  return total


def main():
  run = _common.start("checkpoint_memory", __doc__, smoke="the 8B 4 x 8 x 2 layout alone")
  devices = tpipe.topology_devices(scale_3d.TOPOLOGY)
  gib = lambda n: f"{n / 2**30:.2f}"
  table = ["| model | stage x fsdp x tensor | program | arguments GiB | outputs GiB | "
           "temporaries GiB | peak GiB | held state GiB | ideal share GiB | peak / held | "
           "compile s |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for model, stages, fsdp, tensor, schedule in (SMOKE_LAYOUTS if run.args.smoke else LAYOUTS):
    config = scale_3d.config_for(model, stages, fsdp, tensor, schedule, 16)
    exp = experiment.build(config, devices=devices)
    held = state_bytes(exp.abstract_state())
    share = 12 * exp.num_params() / len(devices)
    # The jitted conversions Experiment.to_checkpoint and from_checkpoint run.
    programs = {
        "save": (exp.save_program, exp.abstract_state()),
        "restore": (exp.restore_program, exp.abstract_checkpoint()),
    }
    for name, (convert, arguments) in programs.items():
      start = time.perf_counter()
      compiled = convert.lower(arguments).compile()
      seconds = time.perf_counter() - start
      memory = compiled.memory_analysis()
      peak = _common.peak_bytes(memory)
      table.append(
          f"| {model} | {stages} x {fsdp} x {tensor} | {name} | "
          f"{gib(memory.argument_size_in_bytes)} | {gib(memory.output_size_in_bytes)} | "
          f"{gib(memory.temp_size_in_bytes)} | **{gib(peak)}** | {gib(held)} | {gib(share)} | "
          f"{peak / held:.2f} | {seconds:.0f} |")
      print(table[-1], flush=True)
  lines = [f"Per device, compiled for `{scale_3d.TOPOLOGY}` (64 chips); float32 parameters and "
           "AdamW moments; the checkpoint form split over the whole mesh.", ""] + table
  run.write("Checkpoint save and restore: memory per device at 8B and 70B", lines)


if __name__ == "__main__":
  main()
