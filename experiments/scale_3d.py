"""Pipeline x FSDP x tensor parallelism at the scale TPU users train: Llama-shaped models on a
64-chip TPU v5p slice, memory per device from the TPU compiler.

The models are ``configs/lm.py`` with ``block="llama"`` (RMSNorm, grouped-query attention,
SwiGLU, every matrix named for fsdp and tensor; :class:`tpipe.train.models.LlamaBlock`), bfloat16
compute, float32 parameters and AdamW state, sequence 4096, vocabulary 128256 (untied embedding
and head; the loss 8 vocabulary slices at a time), remat full with per-layer pieces:

* Llama-3-8B-shaped: 32 blocks of width 4096, 32 query heads and 8 key/value heads of 128, MLP
  14336;
* Llama-3-70B-shaped: 80 blocks of width 8192, 64 query heads and 8 key/value heads, MLP 28672.

Differences from Llama 3: positions are a learned table in the embedding (no rotary embedding),
and the embedding carries no tensor axis (it sits in a chunk's packed buffer, split over fsdp).

Each row builds the experiment with ``tpipe.train.cli.experiment.build`` on the 64 devices of the
TPU topology ``v5p:4x4x4`` (:func:`tpipe.topology_devices`), lowers the whole train step on the
abstract state and compiles it with the TPU compiler on this CPU machine; nothing runs on a TPU.
Columns: the state a device holds (parameters and AdamW moments: the step's arguments), the
temporaries, and the peak (arguments + outputs - aliased + temporaries), all per device from
``memory_analysis()``; "share" is 12 bytes per parameter (f32 parameter and two f32 moments)
over stages x fsdp x tensor, the state's floor. ``--cpu`` compiles the same rows for 64
emulated CPU devices instead (XLA:CPU's figures; run with ``JAX_NUM_CPU_DEVICES=64``).

A second table breaks each peak down by what is live there (:mod:`tpipe.tools.peak`, from the
compiler's buffer assignment): state (parameters and moments), gradient sums, weight casts and
copies (bfloat16 copies, gathered weights), stash (what the forward keeps for the backward, with
the stage-to-stage mailboxes and boundary buffers), working set (forward, backward and remat
intermediates, logits and loss) and what no role explains. Beside it the **floor**: what any
pipeline must hold at this layout, per device:

* state and gradients: 16 bytes per parameter (parameter, two moments, gradient; float32) over
  the 64 devices, without padding;
* stash: bfloat16 ``[rows, sequence, width]`` activations, the rows of a micro-batch split over
  ``fsdp``: GPipe with per-layer remat keeps every layer's input of the fullest stage for all M
  micro-batches (autodiff through the tick loop); a fused schedule (1F1B) keeps only each
  in-flight micro-batch's chunk input, S of them, and recomputes the chunk in its backward;
* working set: the one measured at the peak (one chunk's recomputed layer inputs and one
  layer's forward and backward on a micro-batch, the weights gathered for it, the loss).

Needs the TPU compiler: ``pip install -e '.[tpu]'`` (or ``pip install libtpu`` in an environment
whose jax matches).
"""

from __future__ import annotations

import os
import time

from experiments import _common

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # One host: no slice discovery.

import jax  # noqa: E402  pylint: disable=g-import-not-at-top

import tpipe  # noqa: E402  pylint: disable=g-import-not-at-top
from tpipe.tools import peak  # noqa: E402  pylint: disable=g-import-not-at-top
from tpipe.train.cli import experiment  # noqa: E402  pylint: disable=g-import-not-at-top

TOPOLOGY = "v5p:4x4x4"
# name -> (num_layers, width, num_heads, num_kv_heads, mlp_dim)
MODELS = {
    "llama3-8b": (32, 4096, 32, 8, 14336),
    "llama3-70b": (80, 8192, 64, 8, 28672),
}
# (model, stages, fsdp, tensor, schedule, micro-batches)
ROWS = [
    ("llama3-8b", 4, 8, 2, "gpipe", 16),
    ("llama3-8b", 4, 8, 2, "1f1b", 16),
    ("llama3-8b", 8, 4, 2, "gpipe", 16),
    ("llama3-8b", 8, 4, 2, "1f1b", 16),
    ("llama3-70b", 8, 4, 2, "1f1b", 16),
]
SMOKE_ROWS = [("llama3-8b", 4, 8, 2, "1f1b", 16)]
GLOBAL_BATCH = 128
SEQ = 4096
VOCAB = 128256


def balance(num_layers: int, stages: int) -> str:
  """Unit counts per stage: the blocks evenly (any remainder to the middle stages), plus the
  embedding on the first stage and the head on the last (one unit each)."""
  blocks = [num_layers // stages] * stages
  for s in range(num_layers % stages):
    blocks[1 + s % max(1, stages - 2)] += 1
  blocks[0] += 1
  blocks[-1] += 1
  return ",".join(map(str, blocks))


def config_for(model: str, stages: int, fsdp: int, tensor: int, schedule: str,
               microbatches: int):
  from configs import lm  # pylint: disable=g-import-not-at-top

  num_layers, width, heads, kv_heads, mlp = MODELS[model]
  c = lm.get_config("size=base")
  c.update(dict(num_layers=num_layers, width=width, num_heads=heads, num_kv_heads=kv_heads,
                mlp_dim=mlp, block="llama", seq_len=SEQ, vocab_size=VOCAB, vocab_chunks=8,
                batch_size=GLOBAL_BATCH, dropout=0.0, dtype="bfloat16", num_stages=stages,
                num_data=1, balance=balance(num_layers, stages), num_microbatches=microbatches,
                schedule=schedule, remat="full", remat_granularity="layer"))
  c.mesh.update(dict(fsdp=fsdp, tensor=tensor))
  return c


# Roles of tpipe.tools.peak, grouped into the breakdown's columns.
PARTS = {
    "state": ("parameters", "optimizer state"),
    "gradient sums": ("gradient accumulators",),
    "weight casts and copies": ("weight casts", "parameter copies"),
    "stash": ("stash", "mailbox", "boundary buffers"),
    "working set": ("logits and loss", "remat working set", "backward working set",
                    "forward working set"),
    "unexplained": ("other", "batch and other inputs"),
}


def compile_row(config, devices):
  """``(experiment, memory_analysis, live-at-peak breakdown, seconds)`` of one row's step."""
  start = time.perf_counter()
  exp = experiment.build(config, devices=devices)
  lowered = exp.train_step.lower(exp.abstract_state(), exp.abstract_batch(), jax.random.key(0))
  compiled, breakdown = peak.breakdown_of_lowered(lowered)
  return exp, compiled.memory_analysis(), breakdown, time.perf_counter() - start


def part_sums(breakdown) -> dict[str, int]:
  """The breakdown's live bytes at the peak summed into :data:`PARTS`' columns."""
  roles = breakdown.by_role()
  return {name: sum(roles.get(r, 0) for r in members) for name, members in PARTS.items()}


def floor_parts(config, params: int, working_set: int) -> dict[str, int]:
  """The floor's parts in bytes per device (see the module documentation): the state and
  gradients; the stash (a forward schedule keeps one input per micro-batch, repeat and remat
  piece of the fullest stage, a single piece at granularity "chunk" or "nested"; a fused one, one
  per micro-batch in flight, min(S, M), per repeat); the working set measured at the peak."""
  devices = config.num_stages * config.mesh.fsdp * config.mesh.tensor * config.num_data
  rows = config.batch_size // config.num_microbatches // (config.num_data * config.mesh.fsdp)
  layer_input = rows * config.seq_len * config.width * 2  # bfloat16.
  m, s = config.num_microbatches, config.num_stages
  if config.schedule in ("gpipe", "circular"):
    pieces = 1  # "chunk" and "nested": one input per chunk a micro-batch is in.
    if str(config.remat_granularity) not in ("chunk", "nested"):
      pieces = max(int(n) for n in str(config.balance).split(","))
    stash = m * config.num_repeats * pieces
  else:
    stash = min(s, m) * config.num_repeats
  return {"state and gradients": 16 * params // devices, "stash": stash * layer_input,
          "working set": working_set}


def main():
  run = _common.start(
      "scale_3d", __doc__, smoke="the 8B 1F1B row alone",
      arguments=lambda parser: parser.add_argument(
          "--cpu", action="store_true", help="compile the rows for 64 emulated CPU devices "
          "(set JAX_NUM_CPU_DEVICES=64) instead of the TPU topology"))
  gib = lambda n: f"{n / 2**30:.2f}"
  if run.args.cpu:
    devices, target = jax.devices()[:64], "64 emulated CPU devices"
    if len(devices) < 64:
      raise SystemExit("--cpu needs 64 devices: run with JAX_NUM_CPU_DEVICES=64.")
  else:
    devices, target = tpipe.topology_devices(TOPOLOGY), f"`{TOPOLOGY}` (64 chips)"
  rows = SMOKE_ROWS if run.args.smoke else ROWS
  table = ["| model | stage x fsdp x tensor | schedule | M | parameters | share GiB | "
           "state (arguments) GiB | temporaries GiB | peak GiB | compile s |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  parts = ["| model | stage x fsdp x tensor | schedule | " + " | ".join(PARTS) +
           " | live at peak | floor: state + grads | floor: stash | floor: working set | "
           "**floor** | peak / floor |",
           "|---|---|---|" + "---:|" * (len(PARTS) + 6)]
  for model, stages, fsdp, tensor, schedule, microbatches in rows:
    config = config_for(model, stages, fsdp, tensor, schedule, microbatches)
    exp, memory, breakdown, seconds = compile_row(config, devices)
    params = exp.num_params()
    share = 12 * params / (stages * fsdp * tensor)
    peak_bytes = _common.peak_bytes(memory)
    table.append(
        f"| {model} | {stages} x {fsdp} x {tensor} | {schedule} | {microbatches} | "
        f"{params / 1e9:.2f} B | {gib(share)} | {gib(memory.argument_size_in_bytes)} | "
        f"{gib(memory.temp_size_in_bytes)} | **{gib(peak_bytes)}** | "
        f"{seconds:.0f} |")
    sums = part_sums(breakdown)
    floor = floor_parts(config, params, sums["working set"])
    parts.append(
        f"| {model} | {stages} x {fsdp} x {tensor} | {schedule} | "
        + " | ".join(gib(n) for n in sums.values()) + f" | {gib(breakdown.total)} | "
        + " | ".join(gib(n) for n in floor.values())
        + f" | **{gib(sum(floor.values()))}** | {peak_bytes / sum(floor.values()):.2f} |")
    print(table[-1], parts[-1], sep="\n", flush=True)
  lines = [f"Per device, compiled for {target}; global batch {GLOBAL_BATCH} sequences of "
           f"{SEQ} tokens, bfloat16 compute, float32 parameters and AdamW state, remat full in "
           "per-layer pieces, the loss in 8 vocabulary slices.", ""] + table + [
               "", "What is live at each peak, by role (GiB per device; `tpipe.tools.peak`), "
               "and the floor (see the script's documentation):", ""] + parts
  run.write("Pipeline x FSDP x tensor: Llama-shaped models on a TPU v5p slice", lines)


if __name__ == "__main__":
  main()
