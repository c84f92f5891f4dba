"""Today's engine against a checkout of the previous one: compile and step time, peak memory.

Run from the repository root, with a checkout of the previous engine beside this one::

  git worktree add /tmp/old_tpipe bbc6337      # the last commit before the one-engine rewrite
  python -m experiments.engine_comparison --baseline /tmp/old_tpipe
  python -m experiments.engine_comparison --baseline /tmp/old_tpipe --smoke   # tiny sizes
  python -m experiments.engine_comparison --baseline /tmp/old_tpipe --granularity chunk

Two questions, each answered by running the same measurement in both trees in this one run:

1. **The homogeneous stack** (``--rounds`` rounds): the full train step (forward, backward, SGD)
   of a ``tpipe.pipeline`` of residual MLP blocks (width 256, batch 256, L = 16, S = 4, M = 8,
   gpipe, remat full): compile time (CPU and wall seconds of lowering + compiling), step time
   (``--runs`` steps after ``--warmup`` untimed ones) and the per-device bytes of
   ``memory_analysis()``. Reported: every round, the minimum and median of each tree, and new /
   old, both as the ratio of the medians and as the median of the per-round ratios (the two runs
   of a round are moments apart, so that ratio cancels most of what other work does to the
   shared cores). Are today's step and compile times within 3% of the previous engine's?
2. **Per-device peak of the GPipe configs** (``--sizes``): ``analyze_config(config,
   per_stage=False)`` of ``configs/transformer_gpipe.py`` at each size (``tpipe.report`` in the
   previous tree, ``tpipe.train.cli.report`` in this one), compile only: the per-device peak of the
   train step (``memory_analysis()``: arguments + outputs - aliased + temporaries) and its
   parameter and optimizer argument bytes. Is the per-leaf stage layout's peak no worse than the
   previous layout's?

Each measurement is a fresh subprocess (:mod:`experiments._engine_worker`) whose working
directory and ``PYTHONPATH`` are the tree under test, so it imports that tree's ``tpipe`` and
``configs`` (checked from ``tpipe.__file__``), with this script's emulated CPU devices. Rounds
alternate which tree runs first.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from experiments import _common

WORKER = os.path.join(_common.REPO, "experiments", "_engine_worker.py")
TREES = ("old", "new")
STACK = dict(width=256, batch=256, length=16, stages=4, microbatches=8)
SMOKE_STACK = dict(width=32, batch=32, length=8, stages=4, microbatches=4)
# (rounds, runs, warmup, sizes) of a full run and of --smoke; an explicit flag overrides either.
FULL = dict(rounds=5, runs=30, warmup=5, sizes="tiny,gpipe")
SMOKE = dict(rounds=2, runs=5, warmup=2, sizes="tiny")
TOLERANCE = 0.03  # Step and compile time: within 3% of the previous engine's.


def add_arguments(parser) -> None:
  parser.add_argument("--baseline", required=True,
                      help="a checkout of the previous engine (git worktree add PATH bbc6337)")
  parser.add_argument("--rounds", type=int, default=None,
                      help=f"rounds of the stack measurement, each running both trees "
                      f"(default {FULL['rounds']}; {SMOKE['rounds']} with --smoke)")
  parser.add_argument("--runs", type=int, default=None,
                      help=f"timed steps per measurement (default {FULL['runs']}; "
                      f"{SMOKE['runs']} with --smoke)")
  parser.add_argument("--warmup", type=int, default=None,
                      help=f"untimed steps before them (default {FULL['warmup']}; "
                      f"{SMOKE['warmup']} with --smoke)")
  parser.add_argument("--sizes", default=None,
                      help="sizes of configs/transformer_gpipe.py whose peak to compare, "
                      f"comma-separated (default {FULL['sizes']}; {SMOKE['sizes']} with --smoke)")
  parser.add_argument("--granularity", default=None,
                      help="the stack's remat_granularity in both trees (default: each tree's "
                      "own default), so that the engines are compared on the same checkpoints")


def describe_tree(path: str) -> str:
  """The tree's commit (and whether it has uncommitted changes), for the record."""
  def git(*args):
    done = subprocess.run(["git", "-C", path, *args], capture_output=True, text=True,
                          check=False)
    return done.stdout.strip() if done.returncode == 0 else ""

  commit = git("log", "-1", "--format=%h %s")
  if not commit:
    return f"`{path}` (not a git checkout)"
  if len(commit) > 80:
    commit = commit[:77].rsplit(" ", 1)[0] + " ..."
  dirty = " with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") \
      else ""
  return f"`{path}` at {commit}{dirty}"


def measure(tree: str, kind: str, arguments: dict) -> dict:
  """Runs the worker in ``tree``; returns its result (raises with its output if it failed)."""
  env = dict(os.environ, PYTHONPATH=tree)
  start = time.perf_counter()
  done = subprocess.run([sys.executable, "-P", WORKER, kind, json.dumps(arguments)], cwd=tree,
                        env=env, capture_output=True, text=True, check=False)
  lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
  if done.returncode or not lines:
    raise RuntimeError(f"{kind} measurement in {tree} failed (exit {done.returncode}):\n"
                       f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
  result = json.loads(lines[-1][len("RESULT "):])
  expected = os.path.join(os.path.realpath(tree), "")
  if not os.path.realpath(result["tpipe"]).startswith(expected):
    raise RuntimeError(f"the measurement meant for {tree} imported tpipe from {result['tpipe']}")
  result["wall_seconds"] = time.perf_counter() - start
  return result


def alternate(trees: dict[str, str], count: int, kind: str, arguments: dict) -> list[dict]:
  """``count`` rounds of the measurement in both trees, the first tree alternating."""
  out = []
  for i in range(count):
    order = TREES if i % 2 == 0 else TREES[::-1]
    r = {"first": order[0]}
    for tree in order:
      r[tree] = measure(trees[tree], kind, arguments)
      shown = {k: v for k, v in r[tree].items() if k != "step_seconds"}
      print(f"  {kind} round {i + 1}/{count} {tree}: {json.dumps(shown)}", flush=True)
    out.append(r)
  return out


def ratio(new: float, old: float) -> str:
  return f"{new / old:.3f}" if old else "-"


def ms(seconds: float) -> str:
  return f"{seconds * 1e3:.2f}"


def step_median(r: dict) -> float:
  """A measurement's step time: the median of its timed steps."""
  return statistics.median(r["step_seconds"])


def stack_section(rounds: list[dict], sizes: dict, runs: int, warmup: int,
                  granularity: str | None) -> list[str]:
  checkpoints = ("each tree's default remat granularity" if granularity is None else
                 f"remat_granularity={granularity!r} in both trees")
  lines = [
      "## The homogeneous stack: compile and step time", "",
      f"`tpipe.pipeline` of residual MLP blocks, width {sizes['width']} (hidden "
      f"{4 * sizes['width']}), batch {sizes['batch']}, L = {sizes['length']}, S = "
      f"{sizes['stages']}, M = {sizes['microbatches']}, gpipe, remat full ({checkpoints}), "
      "float32; the full "
      f"train step (forward, backward, SGD). {len(rounds)} rounds; in each, both trees compile "
      f"the step in a fresh process and time {runs} steps after {warmup} untimed ones.", "",
      "| round | first | compile CPU s old | new | compile wall s old | new | step ms old "
      "(median) | new | step new / old |",
      "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
  for i, r in enumerate(rounds):
    old, new = r["old"], r["new"]
    lines.append(
        f"| {i + 1} | {r['first']} | {old['compile_cpu_seconds']:.2f} | "
        f"{new['compile_cpu_seconds']:.2f} | {old['compile_seconds']:.2f} | "
        f"{new['compile_seconds']:.2f} | {ms(step_median(old))} | {ms(step_median(new))} | "
        f"{ratio(step_median(new), step_median(old))} |")
  # (label, the values of one tree's measurement, the per-round value, format)
  quantities = (
      ("compile CPU s", lambda r: [r["compile_cpu_seconds"]], lambda r: r["compile_cpu_seconds"],
       lambda v: f"{v:.2f}"),
      ("compile wall s", lambda r: [r["compile_seconds"]], lambda r: r["compile_seconds"],
       lambda v: f"{v:.2f}"),
      ("step ms (every timed step)", lambda r: r["step_seconds"], step_median, ms),
  )
  lines += ["", "| across rounds | old min | old median | new min | new median | new / old "
            "(medians) | median of per-round new / old |", "|---|---:|---:|---:|---:|---:|---:|"]
  verdict = {}
  for label, values, per_round, show in quantities:
    pooled = {tree: [v for r in rounds for v in values(r[tree])] for tree in TREES}
    old, new = statistics.median(pooled["old"]), statistics.median(pooled["new"])
    verdict[label] = statistics.median(per_round(r["new"]) / per_round(r["old"]) for r in rounds)
    lines.append(f"| {label} | {show(min(pooled['old']))} | {show(old)} | "
                 f"{show(min(pooled['new']))} | {show(new)} | {ratio(new, old)} | "
                 f"{verdict[label]:.3f} |")
  first = rounds[0]
  lines += ["", "Per-device bytes of the compiled step (`memory_analysis()`; the same in every "
            "round):", "",
            "| | old | new | new / old |", "|---|---:|---:|---:|"]
  for key in ("peak", "arguments", "outputs", "aliased", "temporaries"):
    label = "**peak** (arguments + outputs - aliased + temporaries)" if key == "peak" else key
    old, new = first["old"][key], first["new"][key]
    lines.append(f"| {label} | {_common.size(old)} | {_common.size(new)} | {ratio(new, old)} |")
  lines.append("")
  for label in ("compile CPU s", "step ms (every timed step)"):
    within = verdict[label] <= 1 + TOLERANCE
    lines.append(f"- {label.split(' (')[0]}: new / old {verdict[label]:.3f} (median of the "
                 f"per-round ratios): {'at most' if within else 'MORE than'} "
                 f"{TOLERANCE:.0%} above the previous engine's.")
  lines.append(f"- Loss after the last step (same data and initialisation): old "
               f"{rounds[-1]['old']['loss']:.6g}, new {rounds[-1]['new']['loss']:.6g}.")
  return lines


def report_section(results: list[dict]) -> list[str]:
  lines = [
      "## Per-device peak of the GPipe configs", "",
      "`analyze_config(transformer_gpipe.get_config('size=...'), per_stage=False)`: the previous "
      "tree's report library, this tree's `tpipe.train.cli.config_costs`; compile only. Peak: "
      "the largest device's arguments + outputs - aliased + temporaries (`memory_analysis()`).", "",
      "| config | tree | report module | **peak (largest device)** | parameters + optimizer "
      "arguments | parameters | optimizer state | temporaries | compile CPU s |",
      "|---|---|---|---:|---:|---:|---:|---:|---:|"]
  for r in results:
    for tree in TREES:
      m = r[tree]
      config = (f"size={m['size']}: S = {m['num_stages']}, data = {m['num_data']}, M = "
                f"{m['num_microbatches']}, {m['schedule']}")
      lines.append(f"| {config} | {tree} | `{m['report_module']}` | "
                   f"{_common.size(m['largest_device'])} | "
                   f"{_common.size(m['params'] + m['opt_state'])} | {_common.size(m['params'])} | "
                   f"{_common.size(m['opt_state'])} | {_common.size(m['temporaries'])} | "
                   f"{m['compile_cpu_seconds']:.0f} |")
  lines.append("")
  for r in results:
    old, new = r["old"], r["new"]
    state = lambda m: m["params"] + m["opt_state"]
    verdict = "no worse than" if new["largest_device"] <= old["largest_device"] else "ABOVE"
    lines.append(f"- size={old['size']}: peak new / old "
                 f"{ratio(new['largest_device'], old['largest_device'])} (the per-leaf layout's "
                 f"peak is {verdict} the previous layout's); parameters + optimizer arguments "
                 f"new / old {ratio(state(new), state(old))}.")
  return lines


def main():
  run = _common.start("engine_comparison", __doc__,
                      smoke="a tiny stack, 2 rounds of 5 steps, the GPipe config at size=tiny",
                      arguments=add_arguments)
  args = run.args
  settings = {key: value if getattr(args, key) is None else getattr(args, key)
              for key, value in (SMOKE if run.smoke else FULL).items()}
  baseline = os.path.abspath(args.baseline)
  if not os.path.isdir(os.path.join(baseline, "tpipe")):
    raise SystemExit(f"--baseline={args.baseline} holds no tpipe/; make one with "
                     "`git worktree add /tmp/old_tpipe bbc6337`.")
  trees = {"old": baseline, "new": _common.REPO}
  sizes = SMOKE_STACK if run.smoke else STACK
  stack_rounds = alternate(trees, settings["rounds"], "stack",
                           dict(sizes, runs=settings["runs"], warmup=settings["warmup"],
                                granularity=args.granularity))
  # The compiled program's memory is deterministic: one round per config.
  reports = [alternate(trees, 1, "report", dict(size=size))[0]
             for size in settings["sizes"].split(",")]
  lines = [f"- old: {describe_tree(baseline)}", f"- new: {describe_tree(_common.REPO)}", "",
           "Every measurement is a fresh process importing one tree's `tpipe` "
           "(`experiments/_engine_worker.py`); rounds alternate which tree runs first.", ""]
  lines += stack_section(stack_rounds, sizes, settings["runs"], settings["warmup"],
                         args.granularity) + [""]
  lines += report_section(reports)
  run.write("Today's engine against the previous one: compile time, step time, peak memory",
            lines)


if __name__ == "__main__":
  main()
