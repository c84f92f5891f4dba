"""Scaling of cost with work: compile time and per-device memory as L, M and S grow.

Run from the repository root::

  python -m experiments.scaling            # writes experiments/results/scaling.md and scaling.png
  python -m experiments.scaling --smoke    # a tiny model, L = 8, two points per sweep

Three sweeps of the AOT-compiled training step (width 128, 4 heads, MLP 512, sequence 128):

* depth L in {4, 8, 16, 32, 64} at S=4, M=8, batch 32: the layers are a ``lax.scan``, so
  compile time should stay flat while parameter memory grows linearly;
* micro-batches M in {2, 8, 32}, both at a fixed micro-batch of 4 sequences (batch 4M: the
  GPipe stash of one stage input per tick grows with M) and at a fixed global batch of 32
  (the stash, (M+S-1)/M batches, shrinks toward one batch); compile time should stay flat
  because the ticks are a ``lax.scan``;
* stages S in {1, 2, 4, 8} at L=16, M=8, batch 32: parameters and activations per device shrink.

Compile times are the process's CPU seconds (all threads), steadier than wall clock on a
shared machine; still compare their order of magnitude, not single seconds.
"""

from __future__ import annotations

from experiments import _common

MODEL = dict(width=128, num_heads=4, mlp_dim=512, seq_len=128)
SMOKE = dict(width=32, num_heads=2, mlp_dim=64, seq_len=16)
# Sweep values: depth L, micro-batches M, stages S; layers: L in the M and S sweeps.
VALUES = dict(depth=(4, 8, 16, 32, 64), microbatches=(2, 8, 32), stages=(1, 2, 4, 8), layers=16)
SMOKE_VALUES = dict(depth=(4, 8), microbatches=(2, 8), stages=(1, 4), layers=8)


def _run(cache, model, **kw):
  key = tuple(sorted(kw.items()))
  if key not in cache:
    cfg = _common.config(**model, remat="none", **kw)
    r = _common.measure(cfg)
    cache[key] = r
    print(f"  {kw}: {_common.mib(r.total_bytes)} MiB, compile {r.cpu_seconds:.1f} CPU s",
          flush=True)
  return cache[key]


def main():
  run = _common.start("scaling", __doc__, smoke="a tiny model and two points per sweep")
  model, values = (SMOKE, SMOKE_VALUES) if run.smoke else (MODEL, VALUES)
  cache, layers = {}, values["layers"]
  sweeps = {
      "depth L (S=4, M=8, batch 32)": [
          (L, _run(cache, model, num_layers=L, num_stages=4, num_microbatches=8, batch_size=32))
          for L in values["depth"]],
      f"micro-batches M (S=4, L={layers}, micro-batch 4)": [
          (m, _run(cache, model, num_layers=layers, num_stages=4, num_microbatches=m,
                   batch_size=4 * m))
          for m in values["microbatches"]],
      f"micro-batches M (S=4, L={layers}, batch 32)": [
          (m, _run(cache, model, num_layers=layers, num_stages=4, num_microbatches=m,
                   batch_size=32))
          for m in values["microbatches"]],
      f"stages S (L={layers}, M=8, batch 32)": [
          (s, _run(cache, model, num_layers=layers, num_stages=s, num_microbatches=8,
                   batch_size=32))
          for s in values["stages"]],
  }
  lines = [f"Model: `configs/lm.py` with width {model['width']}, {model['num_heads']} heads, MLP "
           f"{model['mlp_dim']}, sequence {model['seq_len']}, remat none, GPipe, no data "
           "parallelism. Compile time = lowering + XLA compile, in CPU seconds of the process "
           "(all threads; steadier than wall clock on a shared machine, which is also given).",
           ""]
  for title, points in sweeps.items():
    lines += [f"## {title}", "",
              "| value | lower + compile, CPU s | wall s | peak memory / device | "
              "parameters / device | activations + temporaries | HLO while loops |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for value, r in points:
      lines.append(f"| {value} | {r.cpu_seconds:.1f} | {r.lower_seconds + r.compile_seconds:.1f} | "
                   f"{_common.mib(r.total_bytes)} MiB | {_common.mib(r.params_bytes)} MiB | "
                   f"{_common.mib(r.activation_bytes)} MiB | {len(r.analysis.flops.loops)} |")
    lines.append("")
  plt = _common.pyplot()
  fig, axes = plt.subplots(1, len(sweeps), figsize=(15, 3.4))
  for ax, (title, points) in zip(axes, sweeps.items()):
    xs = [p[0] for p in points]
    ax.plot(xs, [p[1].cpu_seconds for p in points], "o-", color="tab:blue",
            label="compile CPU s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.set_ylim(bottom=0)
    ax.set_ylabel("lower + compile (CPU s)", color="tab:blue", fontsize=8)
    ax.set_title(title, fontsize=9)
    twin = ax.twinx()
    twin.plot(xs, [p[1].total_bytes / 2**20 for p in points], "s--", color="tab:red")
    twin.set_ylim(bottom=0)
    twin.set_ylabel("peak MiB / device", color="tab:red", fontsize=8)
  fig.tight_layout()
  fig.savefig(run.beside("scaling.png"), dpi=110)

  def compile_range(points):
    times = [p[1].cpu_seconds for p in points]
    return f"{min(times):.1f}-{max(times):.1f} CPU s"

  def loops(points):
    return ", ".join(str(len(p[1].analysis.flops.loops)) for p in points)

  def mem_ratio(points):
    return points[-1][1].total_bytes / points[0][1].total_bytes

  def span(points):
    return f"{points[0][0]} -> {points[-1][0]}"

  (depth, m_fixed_micro, m_fixed_batch, stages) = sweeps.values()
  lines += [
      "![scaling](scaling.png)", "",
      f"- Depth {span(depth)}: compile {compile_range(depth)}, peak memory "
      f"x{mem_ratio(depth):.1f} (no remat: every layer's activations are kept).",
      f"- M {span(m_fixed_micro)} at a fixed micro-batch: compile "
      f"{compile_range(m_fixed_micro)}, peak memory x{mem_ratio(m_fixed_micro):.1f}: GPipe "
      "stashes one stage input per tick, and the batch grows with M.",
      f"- M {span(m_fixed_batch)} at a fixed global batch: compile "
      f"{compile_range(m_fixed_batch)}, peak memory x{mem_ratio(m_fixed_batch):.2f}: the stash "
      "holds (M+S-1)/M batches, and smaller micro-batches shrink each layer's working set.",
      f"- S {span(stages)}: compile {compile_range(stages)}, peak memory "
      f"x{mem_ratio(stages):.2f} per device.",
      "",
      "Layers are a `lax.scan` inside a stage and ticks a `lax.scan` inside the step, so the "
      "program's size should not follow L or M. HLO while loops per program: "
      + "; ".join(f"{title.split(' (')[0]}: {loops(points)}" for title, points in sweeps.items())
      + ".",
  ]
  run.write("Scaling: compile time and per-device memory as L, M and S grow", lines,
            _common.AOT_NOTE)


if __name__ == "__main__":
  main()
