"""How a tick loop sums weight gradients, and what the TPU compiler allocates for each way.

The pattern of a pipeline's backward pass in miniature: a loop of 8 ticks, each running one of two
programs (a ``lax.switch``) that differentiates 4 layers ``h -> tanh(h @ W[l])`` (bfloat16
compute, 64 MiB of float32 weights ``W``) on one micro-batch and adds the weight gradient into a
running sum. Each row sums it another way; every program is compiled for one chip of the TPU
topology ``v5p:2x2x2`` from this CPU machine, and the row gives ``memory_analysis()``'s
temporaries beside what the dumped buffer assignment reserves (:mod:`tpipe.tools.peak`).

* ``autodiff``: ``jax.grad`` through the tick loop: each tick's transposed layer scan builds the
  whole ``dW`` (a stacked output) and the tick loop's transpose adds it to the sum.
* ``sum in the branch``: the same per tick, but each branch adds its ``dW`` to the sum it is given.
* ``sum in the loop over layers``: each branch runs its layers backwards, adding each layer's
  gradient into the sum inside that loop (what ``tpipe``'s backward by units does).
* ``sum in the loop, one conditional per branch``: the same with the switch written as a chain of
  busy-or-pass-through ``lax.cond``s (a switch of several branches whose loops update the same
  carried buffer gets a copy of it).

A second table compiles the same programs for one chip of other TPU generations (:data:`CHIPS`):
what ``memory_analysis()`` reports beyond the dumped buffer assignment differs by chip for the
same program, so it comes from the target's compiler, not from the program alone.

Needs the TPU compiler (``pip install -e '.[tpu]'``); nothing runs on a TPU. About a minute.
"""

from __future__ import annotations

import os

from experiments import _common

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # One host: no slice discovery.

import jax  # noqa: E402  pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # noqa: E402  pylint: disable=g-import-not-at-top
from jax import lax  # noqa: E402  pylint: disable=g-import-not-at-top

import tpipe  # noqa: E402  pylint: disable=g-import-not-at-top
from tpipe.tools import peak  # noqa: E402  pylint: disable=g-import-not-at-top

TOPOLOGY = "v5p:2x2x2"
# One small topology per TPU generation libtpu describes: v4 and v5p have two TensorCores per chip
# (megacore), v5e and v6e one.
CHIPS = ("v4:2x2x1", TOPOLOGY, "v5e:2x2", "v6e:2x2")
LAYERS, WIDTH, MICROBATCH_ROWS, TICKS = 4, 2048, 1024, 8


def layer(h, w):
  return jnp.tanh(h @ w.astype(jnp.bfloat16))


def loss_of_layers(w, x):
  h, _ = lax.scan(lambda h, wl: (layer(h, wl), None), x, w)
  return jnp.sum(h.astype(jnp.float32))


def programs(xm):
  """The two branch programs of a tick: the layers on ``xm`` and on ``2 xm`` (scaled loss)."""
  return [lambda w: loss_of_layers(w, xm), lambda w: 2.0 * loss_of_layers(w, 2.0 * xm)]


def autodiff(w, xs):
  def loss(w):
    def tick(total, ixm):
      i, xm = ixm
      branches = [jax.checkpoint(p) for p in programs(xm)]
      return total + lax.switch(i % 2, branches, w), None

    return lax.scan(tick, 0.0, (jnp.arange(TICKS), xs))[0]

  return jax.grad(loss)(w)


def sum_in_branch(w, xs):
  def tick(total, ixm):
    i, xm = ixm
    branches = [lambda total, p=p: total + jax.grad(p)(w) for p in programs(xm)]
    return lax.switch(i % 2, branches, total), None

  return lax.scan(tick, jnp.zeros_like(w), (jnp.arange(TICKS), xs))[0]


def backward_into(total, w, x, scale):
  """The layers' forward keeping each layer's input, then a loop over layers backwards adding
  each layer's weight gradient (a full-size VJP of a dynamic index: XLA makes it in place)."""
  out, inputs = lax.scan(
      lambda h, i: (layer(h, lax.dynamic_index_in_dim(w, i, keepdims=False)), h), x,
      jnp.arange(LAYERS))

  def back(carry, i):
    g, total = carry
    h = lax.dynamic_index_in_dim(inputs, i, keepdims=False)
    _, vjp = jax.vjp(lambda h, w: layer(h, lax.dynamic_index_in_dim(w, i, keepdims=False)), h, w)
    g_h, g_w = vjp(g)
    return (g_h, total + g_w), None

  (_, total), _ = lax.scan(back, (jnp.full(out.shape, scale, out.dtype), total),
                           jnp.arange(LAYERS), reverse=True)
  return total


def sum_in_layer_loop(w, xs):
  def tick(total, ixm):
    i, xm = ixm
    branches = [lambda t: backward_into(t, w, xm, 1.0),
                lambda t: backward_into(t, w, 2.0 * xm, 2.0)]
    return lax.switch(i % 2, branches, total), None

  return lax.scan(tick, jnp.zeros_like(w), (jnp.arange(TICKS), xs))[0]


def sum_in_layer_loop_chained(w, xs):
  def tick(total, ixm):
    i, xm = ixm
    total = lax.cond(i % 2 == 0, lambda t: backward_into(t, w, xm, 1.0), lambda t: t, total)
    total = lax.cond(i % 2 == 1, lambda t: backward_into(t, w, 2.0 * xm, 2.0), lambda t: t,
                     total)
    return total, None

  return lax.scan(tick, jnp.zeros_like(w), (jnp.arange(TICKS), xs))[0]


WAYS = [
    ("autodiff", autodiff),
    ("sum in the branch", sum_in_branch),
    ("sum in the loop over layers", sum_in_layer_loop),
    ("sum in the loop, one conditional per branch", sum_in_layer_loop_chained),
]


def temporaries(fn, topology: str) -> tuple[int, int]:
  """``(memory_analysis() temporaries, what the dumped buffer assignment reserves)`` of ``fn``
  compiled for one chip of ``topology``."""
  sharding = jax.sharding.SingleDeviceSharding(tpipe.topology_devices(topology)[0])
  w = jax.ShapeDtypeStruct((LAYERS, WIDTH, WIDTH), jnp.float32, sharding=sharding)
  xs = jax.ShapeDtypeStruct((TICKS, MICROBATCH_ROWS, WIDTH), jnp.bfloat16, sharding=sharding)
  compiled, breakdown = peak.breakdown_of_lowered(jax.jit(fn).lower(w, xs))
  return compiled.memory_analysis().temp_size_in_bytes, breakdown.allocated_temporaries


def main():
  run = _common.start("tpu_gradient_sums", __doc__,
                      smoke=f"one chip of {TOPOLOGY} only, no table of other generations")
  chips_compiled = (TOPOLOGY,) if run.smoke else CHIPS
  mib = lambda n: f"{n / 2**20:.1f}"
  table = ["| how the weight gradient is summed | temporaries MiB | buffer assignment MiB "
           "| beyond it MiB |", "|---|---:|---:|---:|"]
  by_chip = {}
  for label, fn in WAYS:
    for topology in chips_compiled:
      by_chip[label, topology] = temporaries(fn, topology)
    total, allocated = by_chip[label, TOPOLOGY]
    table.append(f"| {label} | {mib(total)} | {mib(allocated)} | {mib(total - allocated)} |")
    print(table[-1], flush=True)
  if run.smoke:
    run.write("Summing weight gradients in a tick loop, compiled for a TPU (smoke)", table)
    return
  chips = ["", "Beyond the buffer assignment, MiB, for one chip of each generation (the same "
           "programs; temporaries / buffer assignment in brackets):", "",
           "| how the weight gradient is summed | " + " | ".join(f"`{t}`" for t in CHIPS) + " |",
           "|---|" + "---:|" * len(CHIPS)]
  for label, _ in WAYS:
    cells = [f"{mib(t - a)} ({mib(t)} / {mib(a)})"
             for t, a in (by_chip[label, topology] for topology in CHIPS)]
    chips.append(f"| {label} | " + " | ".join(cells) + " |")
  print("\n".join(chips), flush=True)
  lines = [f"One chip of `{TOPOLOGY}`; float32 weights of {LAYERS} x {WIDTH} x {WIDTH} "
           f"({mib(LAYERS * WIDTH * WIDTH * 4)} MiB), {TICKS} ticks of {MICROBATCH_ROWS} rows.", ""]
  run.write("Summing weight gradients in a tick loop, compiled for a TPU", lines + table + chips)


if __name__ == "__main__":
  main()
