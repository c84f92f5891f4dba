"""The stage axis over DCN: simulated step time with and without delayed transfers.

Run from the repository root (pure NumPy, seconds)::

  python -m experiments.multislice           # writes experiments/results/multislice.md
  python -m experiments.multislice --smoke   # one row: checks the script

A Llama-3-8B-shaped model (32 blocks of width 4096, 32 query and 8 key-value heads of 128, MLP
14336, sequence 4096, bfloat16 activations) trained on 2 and 4 slices of 64 TPU v5p chips with the
stage axis over DCN, a global batch of 256 sequences in M = 8, 16, 32 micro-batches. Two layouts:

* **one stage per slice** (S = 2 and 4, each stage over the slice's 64 chips as fsdp 8 x tensor
  8): every link between stages crosses DCN;
* **two stages per slice** (S = 4 and 8, each over 32 chips as fsdp 8 x tensor 4): every other
  link crosses DCN, the rest are ICI.

Per action, from FLOPs at 50% of the chip's peak (459 TFLOP/s bf16): a block's forward costs
``2 x 218.1 M`` FLOPs per token for its matrices plus ``4 x 4096 x 4096`` for attention (scores
and values over the whole sequence), F is the stage's blocks on one micro-batch's tokens shared by
its 32 chips, and B = 3 F (remat full: the forward again, then twice its FLOPs). The embedding,
the head and the loss are left out (they add to the first and last stage alike in every row).
One tick's message per device: its share of the micro-batch's boundary activations, rows split
over the 8 fsdp devices (each tensor device sends its own copy), ``rows x 4096 x 4096 x 2`` bytes,
priced with :mod:`tpipe.experimental.links` (v5p: DCN 50 Gbit/s per chip and 10 us, ICI a 2/6
share of 4800 Gbit/s and 1 us; the message is the same under both layouts: the rows split over
fsdp 8).
The table of each schedule (:func:`tpipe.schedules.build`, with
``delays`` on the crossing links or none) is simulated with :meth:`FusedSchedule.simulate`
(neighbour-synchronised, per-link transfer times): ``step`` is the predicted step, ``exposed``
the part of it that is transfer time.

**Hand check** of the exposed figure without delay, one stage per slice: every tick of the loop
runs one exchange over each link, and with every link on DCN each stage starts a tick only after
the exchange that follows the previous tick, on any path through the table; so each step from
one tick to the next adds exactly one DCN send: exposed = (ticks - 1) x (latency + message /
bandwidth). The
script prints that product beside the simulation's figure (they must agree). With two stages per
slice a path can avoid the DCN links on some ticks, so the product is only an upper bound there.
With delayed links a send overlaps the next tick's compute: what shows is its excess over that
tick (on idle ticks, all of it).
"""

from __future__ import annotations

import numpy as np

from experiments import _common
from tpipe import schedules
from tpipe.experimental import links

LAYERS, WIDTH, HEADS, KV_HEADS, HEAD_DIM, MLP, SEQ = 32, 4096, 32, 8, 128, 14336, 4096
GLOBAL_BATCH, FSDP, CHIPS_PER_SLICE = 256, 8, 64
EFFICIENCY = 0.5


def block_flops_per_token() -> float:
  """Forward FLOPs of one block per token: its matrices and attention over the sequence."""
  params = (WIDTH * HEADS * HEAD_DIM + 2 * WIDTH * KV_HEADS * HEAD_DIM + HEADS * HEAD_DIM * WIDTH
            + 3 * WIDTH * MLP)
  return 2 * params + 4 * SEQ * WIDTH


def row(name: str, slices: int, per_slice: int, microbatches: int, net: links.Interconnect,
        delayed: bool):
  """The simulated step of one (schedule, slices, stages per slice, M, delay)."""
  stages = per_slice * slices
  chips = CHIPS_PER_SLICE // per_slice
  tokens = GLOBAL_BATCH // microbatches * SEQ
  forward = (LAYERS // stages) * block_flops_per_token() * tokens / chips / (
      net.flops_per_second * EFFICIENCY)
  costs = {"F": forward, "B": 3 * forward}
  rows_per_device = GLOBAL_BATCH / microbatches / FSDP
  message = rows_per_device * SEQ * WIDTH * 2
  crossing = [(s + 1) % per_slice == 0 for s in range(stages)]
  transfer = np.array([net.link("dcn" if c else "ici").seconds(message) for c in crossing])
  delays = tuple(int(c and delayed) for c in crossing)
  table = schedules.whole_step(schedules.build(name, stages, microbatches, delays=delays))
  timing = table.simulate(costs, transfer)
  return {"stages": stages, "forward": forward, "message": message,
          "dcn_send": net.dcn.seconds(message), "ticks": table.num_ticks,
          "step": timing.neighbour, "exposed": timing.exposed_transfer,
          "compute": timing.neighbour - timing.exposed_transfer}


def main():
  run = _common.start("multislice", __doc__, smoke="one row (GPipe, 2 slices, M = 8)")
  net = links.interconnect("v5p")
  cases = ([("gpipe", 2, 1, 8)] if run.smoke else
           [(name, slices, per_slice, m) for per_slice in (1, 2) for name in ("gpipe", "1f1b")
            for slices in (2, 4) for m in (8, 16, 32)])
  lines = [f"Llama-3-8B-shaped, v5p slices of {CHIPS_PER_SLICE} chips, stage over DCN, global "
           f"batch {GLOBAL_BATCH} x {SEQ} tokens; times in ms per step.", "",
           "| schedule | slices | stages per slice | S | M | F ms | DCN send ms | "
           "ticks (plain / delayed) | step plain | exposed plain | "
           "hand check: (ticks - 1) x send | step delayed | exposed delayed | delayed / plain |",
           "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
  for name, slices, per_slice, m in cases:
    plain = row(name, slices, per_slice, m, net, delayed=False)
    late = row(name, slices, per_slice, m, net, delayed=True)
    hand = (plain["ticks"] - 1) * plain["dcn_send"]
    if per_slice == 1 and not np.isclose(hand, plain["exposed"], rtol=1e-9):
      raise AssertionError(f"{name}, {slices} slices, M={m}: the simulation's exposed "
                           f"{plain['exposed']} differs from (ticks - 1) x send {hand}.")
    lines.append(
        f"| {name} | {slices} | {per_slice} | {plain['stages']} | {m} | "
        f"{plain['forward'] * 1e3:.1f} | "
        f"{plain['dcn_send'] * 1e3:.2f} | {plain['ticks']} / {late['ticks']} | "
        f"{plain['step'] * 1e3:.0f} | {plain['exposed'] * 1e3:.1f} | {hand * 1e3:.1f} | "
        f"{late['step'] * 1e3:.0f} | {late['exposed'] * 1e3:.2f} | "
        f"{late['step'] / plain['step']:.3f} |")
  first = row("gpipe", 2, 1, 8, net, delayed=False)
  lines += ["", f"Hand check, GPipe on 2 slices (one stage each), M = 8: the whole step has "
            f"{first['ticks']} ticks, so {first['ticks'] - 1} exchanges between them; one "
            f"carries {first['message'] / 2**20:.0f} MiB per device (4 rows x 4096 x 4096 x 2 B) "
            f"over DCN at {net.dcn.bytes_per_second / 1e9:.2f} GB/s plus "
            f"{net.dcn.latency_seconds * 1e6:.0f} us: {first['dcn_send'] * 1e3:.2f} ms, and "
            f"{first['ticks'] - 1} x {first['dcn_send'] * 1e3:.2f} ms = "
            f"{(first['ticks'] - 1) * first['dcn_send'] * 1e3:.1f} ms, the simulation's "
            f"{first['exposed'] * 1e3:.1f} ms (the script checks every one-stage-per-slice row "
            "this way)."]
  lines += ["", "Reading: where a tick's compute (F, and B = 3 F) exceeds the DCN send, the "
            "delayed links hide it (exposed near 0) and the step pays only the ticks the delay "
            "adds; the plain table pays one send per tick."]
  run.write("Stage axis over DCN: delayed transfers (simulated)", lines)


if __name__ == "__main__":
  main()
