"""The GPipe paper's Transformer with the embedding and head replicated vs inside the pipeline.

Run from the repository root (compiles only, nothing runs)::

  python -m experiments.sequential_memory            # experiments/results/sequential_memory.md
  python -m experiments.sequential_memory --smoke    # a tiny model at S = 4, to check the script

The model is the GPipe paper's Transformer in kind, as ``configs/transformer_gpipe.py`` sets it up
(bfloat16 compute, float32 parameters and Adam state, full rematerialisation, dropout 0.1): 48
blocks of width 2048 (MLP 8192, 32 heads), sequence 2048, batch 256, a 32,000-token vocabulary,
M = 32 micro-batches, at S = 4 and S = 8 stages (data = 1). Two designs are compiled ahead of
time for the same mesh:

* **replicated**: embedding, learned positions, final norm and head run under plain
  ``jax.jit`` on the whole batch, replicated over the stages; only the block stack is pipelined,
  by ``tpipe.pipeline(TransformerBlock, ...)``, its parameters stacked ``[L, ...]`` and split over
  ``stage`` (``tpipe.shardings``); AdamW on that tree. The model is defined here.
* **sequential**: ``tpipe.train.cli.experiment.build(config)``: a ``tpipe.Sequential`` of
  [TokenEmbedding, Repeat(TransformerBlock, 48), LMHead with the loss], split by FLOPs, its train
  state in the stage layout. Measured by ``tpipe.train.cli.config_costs.analyze_config``.

For each: the per-device peak (``memory_analysis()``: arguments + outputs - aliased +
temporaries), the largest and smallest stage's own parameter + optimizer bytes, the memory floor
and the peak over it (:mod:`tpipe.tools.stage_costs`), the collectives per step, and the
buffers of the compiled program with a vocabulary-wide (32,000) dimension, with where they are
made (inside which chunk's branch of the stage switch, or outside the pipeline).
"""

from __future__ import annotations

import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax import lax

import tpipe
from configs import transformer_gpipe
from experiments import _common
from experiments._common import gib
from tpipe import partition
from tpipe import schedules
from tpipe.tools import analysis
from tpipe.tools import hlo
from tpipe.tools import stage_costs
from tpipe.train import models
from tpipe.train.cli import config_costs
from tpipe.train.cli import experiment
from tpipe.train.cli import translate
from tpipe.train.cli import report_text

# The GPipe paper's Transformer in kind, and a tiny stand-in for --smoke.
GPIPE = dict(num_layers=48, width=2048, num_heads=32, mlp_dim=8192, seq_len=2048,
             batch_size=256, vocab_size=32000, num_microbatches=32)
SMOKE = dict(num_layers=8, width=64, num_heads=4, mlp_dim=256, seq_len=64, batch_size=64,
             vocab_size=1000, num_microbatches=8)


def make_config(sizes: dict[str, int], num_stages: int):
  """``configs/transformer_gpipe.py`` (bfloat16, remat full, dropout 0.1) at ``sizes``."""
  config = transformer_gpipe.get_config()
  for key, value in sizes.items():
    config[key] = value
  config.num_stages, config.num_data = num_stages, 1
  config.schedule, config.num_repeats = "gpipe", 1
  return config


# --------------------------------------------------------------------------------------------
# Replicated: embedding and head under plain jit on every stage, only the blocks pipelined.


class ReplicatedLM(nn.Module):
  """A decoder LM whose blocks alone are pipelined (``tpipe.pipeline``)."""

  config: Any
  mesh: Any

  @nn.compact
  def __call__(self, tokens, *, train: bool = False):
    c = self.config
    dtype = jnp.dtype(c.dtype)
    seq_len = tokens.shape[1]
    x = nn.Embed(c.vocab_size, c.width, dtype=dtype, name="embed")(tokens)
    pos = self.param("pos_embed", nn.initializers.normal(0.02), (c.seq_len, c.width))
    x = x + pos[None, :seq_len].astype(dtype)
    x = nn.Dropout(c.dropout, deterministic=not train)(x)
    stack = tpipe.pipeline(models.TransformerBlock, length=c.num_layers,
                           num_stages=c.num_stages, num_microbatches=c.num_microbatches,
                           schedule=c.schedule, num_repeats=c.num_repeats, remat=c.remat,
                           mesh=self.mesh)
    x = stack(width=c.width, num_heads=c.num_heads, mlp_dim=c.mlp_dim, dropout_rate=c.dropout,
              deterministic=not train, dtype=dtype, name="blocks")(x, models.causal_mask(seq_len))
    x = nn.LayerNorm(dtype=dtype, name="final_norm")(x)
    logits = nn.Dense(c.vocab_size, dtype=dtype, name="head")(x)
    return logits.astype(jnp.float32)


def replicated_optimizer(config):
  """AdamW on the logical tree: decay on kernels and embeddings, after clipping."""
  decay_mask = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], "key", None) in ("kernel", "embedding"), params)
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, config.learning_rate, config.warmup_steps, config.num_steps,
      config.learning_rate * 0.1)
  return optax.chain(optax.clip_by_global_norm(config.grad_clip),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=config.weight_decay,
                                 mask=decay_mask))


def replicated_chunk(config):
  """One stage's blocks (L / S, scanned) on one micro-batch, as the pipeline applies them."""
  block = models.TransformerBlock(width=config.width, num_heads=config.num_heads,
                                  mlp_dim=config.mlp_dim, dropout_rate=config.dropout,
                                  dtype=jnp.dtype(config.dtype))
  rows = config.batch_size // (config.num_data * config.num_microbatches)
  h = jax.ShapeDtypeStruct((rows, config.seq_len, config.width), jnp.dtype(config.dtype))
  mask = models.causal_mask(config.seq_len)
  one = jax.eval_shape(lambda: block.init(jax.random.key(0), jnp.zeros(h.shape, h.dtype),
                                          mask)["params"])
  count = config.num_layers // config.num_stages
  params = jax.tree.map(lambda a: jax.ShapeDtypeStruct((count,) + a.shape, a.dtype), one)

  def fn(params, h):
    def body(h, p):
      y = block.apply({"params": p}, h, models.causal_mask(config.seq_len),
                      deterministic=False, rngs={"dropout": jax.random.key(0)})
      return y, None

    return lax.scan(body, h, params)[0]

  return fn, (params, h)


def measure_replicated(config) -> dict[str, Any]:
  mesh = tpipe.make_mesh(stages=config.num_stages, data=config.num_data)
  model = ReplicatedLM(ml_collections.FrozenConfigDict(config), mesh)
  optimizer = replicated_optimizer(config)
  tokens_shape = (config.batch_size, config.seq_len)

  def init_fn(rng):
    params = model.init({"params": rng}, jnp.zeros(tokens_shape, jnp.int32))["params"]
    return tpipe.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                            opt_state=optimizer.init(params))

  def loss_fn(params, batch, rng):
    logits = model.apply({"params": params}, batch["inputs"], train=True, rngs={"dropout": rng})
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  shapes = jax.eval_shape(init_fn, jax.random.key(0))
  shardings = tpipe.shardings(shapes, mesh, ("blocks",))
  state = _common.placed(shapes, shardings)
  data = tpipe.data_sharding(mesh)
  batch = {k: jax.ShapeDtypeStruct(tokens_shape, jnp.int32, sharding=data)
           for k in ("inputs", "targets")}
  step = tpipe.make_train_step(loss_fn, optimizer, shardings=shardings)
  start = time.perf_counter()
  compiled = step.lower(state, batch, jax.random.key(0)).compile()
  seconds = time.perf_counter() - start
  schedule = schedules.build("gpipe", config.num_stages, config.num_microbatches)
  result = analysis.analyze(compiled, mesh=mesh, schedule=schedule,
                            inputs={"params": state.params, "opt_state": state.opt_state,
                                    "batch": batch})
  # Every device holds the same bytes: its 1/S of the blocks and all of the rest.
  params = analysis.input_bytes(state.params)[1]
  opt = analysis.input_bytes(state.opt_state)[1]
  replicated = {k: v for k, v in shapes.params.items() if k != "blocks"}
  replicated_bytes = stage_costs.tree_bytes(replicated)
  fn, args = replicated_chunk(config)
  working = stage_costs.working_set_bytes(stage_costs.compile_forward_backward(fn, *args))
  floor = stage_costs.memory_floor(
      state_bytes=2 * params + opt,
      stash_bytes=int(schedule.stash_slots().max()) * stage_costs.tree_bytes(args[1]),
      working_set_bytes=working)
  head = shapes.params["head"]["kernel"]
  return {
      "name": "replicated", "memory": result.memory, "analysis": result, "compiled": compiled,
      "compile_seconds": seconds, "floor": floor,
      # tpipe.pipeline cuts the stack evenly: every stage's chunk runs the same program.
      "programs": [0] * config.num_stages,
      "stage_state": [params + opt] * config.num_stages,
      "replicated_param_bytes": replicated_bytes,
      "head_placement": (f"`head/kernel` {tuple(head.shape)} replicated on all "
                         f"{config.num_stages} stages (sharding "
                         f"{state.params['head']['kernel'].sharding.spec})"),
  }


# --------------------------------------------------------------------------------------------
# Sequential: the whole model in a tpipe.Sequential, through the trainer's experiment.


def unit_flops(config) -> tuple[float, ...]:
  """Every layer unit's forward+backward FLOPs on one micro-batch (what balance="flops" uses).

  They do not depend on the stage count, so they are measured once and the split for each S is
  ``partition.balanced_split`` of them: the split ``balance="flops"`` chooses (the experiment
  plans with the same call).
  """
  model = translate.make_model(config, None).clone(balance="flops")
  tokens = jax.ShapeDtypeStruct((config.batch_size // config.num_data, config.seq_len),
                                jnp.int32)
  return model.pipeline_for(tokens, rng_names=("dropout",), targets=tokens).plan.costs


def measure_sequential(config, costs) -> dict[str, Any]:
  counts = partition.balanced_split(costs, config.num_stages * config.num_repeats)
  config.balance = ",".join(str(n) for n in counts)
  rep = config_costs.analyze_config(config, unit_flops=costs)
  layout = rep.layout
  head_chunks = [c for c, groups in enumerate(layout.groups)
                 if any(g.layer == len(layout.logical) - 1 for g in groups)]
  return {
      "name": "sequential", "memory": rep.analysis.memory, "analysis": rep.analysis,
      "compiled": rep.compiled, "compile_seconds": rep.compile_seconds, "floor": rep.floor,
      "stage_state": [s.param_bytes + s.optimizer_bytes for s in rep.stages],
      "report": rep, "split": counts,
      # Which lax.switch branch runs each chunk (chunks with equal programs share one).
      "programs": experiment.build(config).pipeline.programs(),
      "head_placement": (f"`layers_2` (final norm and head kernel "
                         f"{tuple(layout.logical['layers_2']['head']['kernel'].shape)}) in chunk "
                         f"{head_chunks} of {layout.num_chunks} only, i.e. stage "
                         f"{[c % layout.num_stages for c in head_chunks]}"),
  }


# --------------------------------------------------------------------------------------------
# Reading the compiled programs.


def vocab_buffers(compiled, vocab: int) -> list[tuple[int, str, str]]:
  """Distinct array shapes in the program with a dimension of size ``vocab``, largest first:
  ``(elements, "dtype[dims]", an op name that makes one)``."""
  module = hlo.parse_hlo(compiled.as_text())
  found: dict[str, tuple[int, str]] = {}
  for _, ins in module.instructions():
    for a in hlo.parse_shape(ins.shape):
      if vocab in a.dims:
        key = f"{a.dtype}[{','.join(map(str, a.dims))}]"
        if key not in found:
          op = ins.attrs.split('op_name="', 1)[1].split('"', 1)[0] if 'op_name="' in ins.attrs \
              else ins.name
          found[key] = (a.size, op)
  return sorted(((size, key, op) for key, (size, op) in found.items()), reverse=True)


def _reachable(module, name: str) -> set[str]:
  seen, pending = set(), [name]
  while pending:
    current = pending.pop()
    if current in seen or current not in module.computations:
      continue
    seen.add(current)
    pending.extend(module._callees(current))  # pylint: disable=protected-access
  return seen


def vocab_placement(compiled, vocab: int, programs) -> dict[str, set[str]]:
  """Where each vocabulary-wide array shape of the program is made.

  ``"outside"`` the pipeline's stage switch, or ``"chunk k"``: inside a branch of a tick
  conditional (forward or backward) that runs chunk k. Such a conditional has one branch per
  distinct chunk program after the idle one; ``programs[c]`` is chunk c's (see
  :meth:`tpipe.core.engine.PlannedPipeline.programs`).
  """
  module = hlo.parse_hlo(compiled.as_text())
  runs: dict[int, list[int]] = {}
  for c, program in enumerate(programs):
    runs.setdefault(program, []).append(c)
  owners: dict[str, set[str]] = {}
  for _, ins in module.instructions():
    branches = ins.attr("branch_computations") if ins.opcode == "conditional" else None
    names = [n.strip().lstrip("%") for n in (branches or "{}").strip("{}").split(",")]
    if len(names) != len(runs) + 1:
      continue
    for k, branch in enumerate(names[1:]):
      label = "chunk " + ", ".join(map(str, runs[k]))
      for comp in _reachable(module, branch):
        owners.setdefault(comp, set()).add(label)
  placement: dict[str, set[str]] = {}
  for comp, ins in module.instructions():
    for a in hlo.parse_shape(ins.shape):
      if vocab in a.dims:
        key = f"{a.dtype}[{','.join(map(str, a.dims))}]"
        placement.setdefault(key, set()).update(owners.get(comp.name, {"outside"}))
  return placement


def collective_rows(result) -> list[str]:
  rows = []
  for (kind, axes), row in result.collective_summary().items():
    rows.append(f"{kind} over {','.join(axes or ()) or '-'}: {row['count']} per step "
                f"({row['instructions']} instructions, {row['in_loop']} in loops), "
                f"{row['bytes'] / 2**20:.1f} MiB")
  return rows


def per_block(rep) -> float:
  """The largest floor stage's chunk working set per unit it holds (its blocks)."""
  stage = rep.stages[rep.floor.stage]
  units = sum(g.stop - g.start for c in stage.chunks for g in rep.layout.groups[c])
  return stage.working_set_bytes / units


def summarize(m: dict[str, Any], config) -> dict[str, Any]:
  mem, floor = m["memory"], m["floor"]
  peak = mem.largest_device_total
  micro_logits = (config.batch_size // (config.num_data * config.num_microbatches)
                  * config.seq_len * config.vocab_size)
  wide = vocab_buffers(m["compiled"], config.vocab_size)
  placement = vocab_placement(m["compiled"], config.vocab_size, m["programs"])
  where: dict[str, int] = {}
  for places in placement.values():
    label = " and ".join(sorted(places))
    where[label] = where.get(label, 0) + 1
  return {
      "where": dict(sorted(where.items())), "placement": placement,
      "peak": peak, "arguments": mem.arguments, "temporaries": mem.temporaries,
      "outputs_not_aliased": mem.outputs - mem.aliased,
      "largest_state": max(m["stage_state"]), "smallest_state": min(m["stage_state"]),
      "floor": floor, "ratio": floor.ratio(peak), "wide": wide,
      "wider_than_micro": [w for w in wide if w[0] > micro_logits],
      "micro_logits": micro_logits,
  }


DESIGNS = ("replicated", "sequential")


def main():
  def arguments(parser):
    parser.add_argument("--stages", default=None,
                        help="stage counts, comma-separated (default 4,8; 4 with --smoke)")

  run = _common.start("sequential_memory", __doc__, smoke="a tiny model at S = 4",
                      arguments=arguments)
  sizes = SMOKE if run.smoke else GPIPE
  stages = run.args.stages or ("4" if run.smoke else "4,8")
  stage_counts = [int(s) for s in stages.split(",")]

  t0 = time.perf_counter()
  costs = unit_flops(make_config(sizes, stage_counts[0]))
  flops_seconds = time.perf_counter() - t0
  print(f"unit FLOPs measured in {flops_seconds:.0f} s: embedding {costs[0]:.4g}, block "
        f"{costs[1]:.4g}, head {costs[-1]:.4g}", flush=True)

  results = {}
  for num_stages in stage_counts:
    for name in DESIGNS:
      config = make_config(sizes, num_stages)
      t0 = time.perf_counter()
      m = measure_replicated(config) if name == "replicated" else measure_sequential(config, costs)
      m["seconds"] = time.perf_counter() - t0
      m["summary"] = summarize(m, config)
      results[(m["name"], num_stages)] = m
      s = m["summary"]
      print(f"{m['name']} S={num_stages}: peak {gib(s['peak'])} GiB, floor "
            f"{gib(s['floor'].total)} GiB (x{s['ratio']:.2f}), state largest/smallest "
            f"{gib(s['largest_state'])}/{gib(s['smallest_state'])} GiB, "
            f"compile {m['compile_seconds']:.0f} s, all {m['seconds']:.0f} s", flush=True)
      for row in collective_rows(m["analysis"]):
        print("   ", row, flush=True)
      print("    largest vocab-wide buffers:", s["wide"][:3], flush=True)
      print("    vocab-wide shapes by where they are made:", s["where"], flush=True)

  run.write("The GPipe paper's Transformer: embedding and head inside the pipeline",
            write_lines(results, sizes, stage_counts, costs, flops_seconds),
            "Every number comes from an ahead-of-time compile of the training step (forward, "
            "backward, AdamW update); nothing was run.")


def write_lines(results, sizes, stage_counts, costs, flops_seconds):
  c = make_config(sizes, stage_counts[0])
  num_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(
      results[("sequential", stage_counts[0])]["report"].layout.logical))
  lines = [
      f"Model: {c.num_layers} blocks, width {c.width}, MLP {c.mlp_dim}, {c.num_heads} heads, "
      f"sequence {c.seq_len}, vocabulary {c.vocab_size:,}, {num_params:,} parameters; batch "
      f"{c.batch_size} in M = {c.num_microbatches} micro-batches of "
      f"{c.batch_size // c.num_microbatches}; data = 1; GPipe schedule; remat {c.remat!r}; "
      f"{c.dtype} compute, float32 parameters and Adam state; dropout {c.dropout}.", "",
      "- **replicated**: embedding, positions, final norm and head under plain `jax.jit` on the "
      f"whole batch, replicated over stages; the {c.num_layers} blocks pipelined by "
      "`tpipe.pipeline(TransformerBlock, ...)`, stacked `[L, ...]` and split over `stage` "
      "(`tpipe.shardings`; the model is defined in the script).",
      "- **sequential**: `tpipe.train.cli.experiment.build(config)`: `tpipe.Sequential` "
      f"[TokenEmbedding, Repeat(TransformerBlock, {c.num_layers}), LMHead + loss], split by "
      "FLOPs, train state in the stage layout.", "",
      f"Per-unit forward+backward FLOPs on one micro-batch (measured once, {flops_seconds:.0f} s): "
      f"embedding {costs[0]:.3g}, block {costs[1]:.3g}, head with loss {costs[-1]:.3g}. The "
      "split for each S is `partition.balanced_split` of these costs, which is what "
      "`balance=\"flops\"` computes; it is passed as an explicit list so the costs are measured "
      "once.", "",
      "## Per-device memory", "",
      "| design | S | split (units per stage) | peak per device GiB | arguments GiB | "
      "temporaries GiB | largest stage params+opt GiB | smallest stage params+opt GiB | "
      "floor GiB (state + stash + chunk working set) | peak / floor | compile s |",
      "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for num_stages in stage_counts:
    for name in DESIGNS:
      m = results[(name, num_stages)]
      s, f = m["summary"], m["summary"]["floor"]
      split = ("emb+head on all, " + f"{c.num_layers // num_stages} blocks each"
               if name == "replicated" else ", ".join(map(str, m["split"])))
      lines.append(
          f"| {name} | {num_stages} | {split} | **{gib(s['peak'])}** | {gib(s['arguments'])} | "
          f"{gib(s['temporaries'])} | {gib(s['largest_state'])} | {gib(s['smallest_state'])} | "
          f"{gib(f.total)} ({gib(f.state_bytes)} + {gib(f.stash_bytes)} + "
          f"{gib(f.working_set_bytes)}) | **{s['ratio']:.2f}** | {m['compile_seconds']:.0f} |")
  peaks = {key: m["summary"]["peak"] for key, m in results.items()}
  ratios = ", ".join(
      f"S = {n}: {gib(peaks[('replicated', n)])} -> {gib(peaks[('sequential', n)])} GiB "
      f"({peaks[('sequential', n)] / peaks[('replicated', n)]:.2f}x)" for n in stage_counts)
  floors = {n: results[("sequential", n)]["summary"]["floor"] for n in stage_counts}
  lines += ["", f"Peak per device, replicated -> sequential: {ratios}. One chunk's working set is "
            + ", ".join(f"{floors[n].working_set_bytes / floors[n].total:.0%} (S = {n})"
                        for n in stage_counts)
            + " of the sequential floor: with remat 'full' a chunk is recomputed as a whole in its "
            "backward tick, so the residuals of all its blocks on one micro-batch are live at "
            "once (the floor stage's chunk working set per block: "
            + ", ".join(f"{per_block(results[('sequential', n)]['report']) / 2**30:.2f} GiB "
                        f"(S = {n})" for n in stage_counts) + ")."]
  lines += ["", "## Where the head lives", "",
            "Vocabulary-wide arrays are those with a dimension of size "
            f"{c.vocab_size}; \"chunk k\" means they are made inside the branch of the tick "
            "loop's stage switch that runs chunk k (forward or backward; chunks with the same "
            "program share a branch, \"chunk 1, 2\"), which only those chunks' stages execute; "
            "\"outside\" means every device computes them.", "",
            "| design | S | head parameters | vocabulary-wide buffers in the program (largest 3) "
            "| any larger than one micro-batch's logits? | distinct vocabulary-wide shapes, by "
            "where they are made |", "|---|---:|---|---|---|---|"]
  for num_stages in stage_counts:
    for name in DESIGNS:
      m = results[(name, num_stages)]
      s = m["summary"]
      wide = "; ".join(f"`{key}` ({op.rsplit('/', 1)[-1]})" for _, key, op in s["wide"][:3])
      bigger = ("yes: " + ", ".join(f"`{key}`" for _, key, _ in s["wider_than_micro"][:4])
                if s["wider_than_micro"] else "no")
      where = ", ".join(f"{label}: {count}" for label, count in s["where"].items())
      lines.append(f"| {name} | {num_stages} | {m['head_placement']} | {wide} | {bigger} | "
                   f"{where} |")
  lines += ["", "## Collectives per step", "",
            "| design | S | kind | axes | executions | instructions (in loops) | MiB per device |",
            "|---|---:|---|---|---:|---:|---:|"]
  for num_stages in stage_counts:
    for name in DESIGNS:
      summary = results[(name, num_stages)]["analysis"].collective_summary()
      for (kind, axes), row in summary.items():
        lines.append(f"| {name} | {num_stages} | {kind} | {','.join(axes or ()) or '-'} | "
                     f"{row['count']} | {row['instructions']} ({row['in_loop']}) | "
                     f"{row['bytes'] / 2**20:.1f} |")
  for num_stages in stage_counts:
    rep = results[("sequential", num_stages)]["report"]
    lines += ["", f"## Sequential, S = {num_stages}: the report's per-stage table", ""]
    lines += report_text.format_stages(rep)
  return lines


if __name__ == "__main__":
  main()
