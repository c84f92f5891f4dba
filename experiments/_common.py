"""The preamble, the argument parser, the writer and the helpers every experiment script shares.

Every script runs from the repository root as ``python -m experiments.<name>``. Python imports
the ``experiments`` package first, and its ``__init__`` calls :func:`preamble` before the
script's own imports start JAX: the repository goes on ``sys.path`` and JAX runs on the CPU
platform (unless ``JAX_PLATFORMS`` says otherwise) with :data:`NUM_DEVICES` emulated devices
(unless ``JAX_NUM_CPU_DEVICES`` or ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` chose a
count). Scripts therefore import ``jax`` and ``tpipe`` at the top, in the usual order.

A script writes ``experiments/results/<name>.md`` (figures beside it). :func:`start` parses the
arguments every script has: ``--out PATH`` writes elsewhere, and ``--smoke`` (alias ``--quick``),
where a script has it, runs a tiny variant in about a minute that writes under
:data:`SMOKE_RESULTS` unless ``--out`` is given, so checking a script never overwrites a result.
:meth:`Run.write` heads the file with the exact command, the date, the jax version, the machine
and the duration, and prints it::

  from experiments import _common

  def main():
    run = _common.start("remat", __doc__, smoke="a tiny model on 2 stages")
    ...
    run.write("Rematerialization: memory and FLOPs per device", lines)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import re
import shlex
import sys
import tempfile
import time
from typing import Callable, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "experiments", "results")
SMOKE_RESULTS = os.path.join(tempfile.gettempdir(), "tpipe_experiments_smoke")
NUM_DEVICES = 8

# What the ahead-of-time experiments (the ones that compile configs/lm.py) state under their header.
AOT_NOTE = (
    "Every number comes from an ahead-of-time compile of the real training step "
    "(`tpipe.train.cli.config_costs.analyze_config`); nothing was run. Memory is per device: XLA's "
    "`memory_analysis()` peak (arguments + outputs - aliased + temporaries).")


def preamble() -> None:
  """The repository on ``sys.path``; the CPU platform and :data:`NUM_DEVICES` devices.

  Called by ``experiments/__init__.py``, so before any script's imports; calling it again does
  nothing new.
  """
  if REPO not in sys.path:
    sys.path.insert(0, REPO)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  chosen = ("JAX_NUM_CPU_DEVICES" in os.environ or
            re.search(r"xla_force_host_platform_device_count=\d+", os.environ.get("XLA_FLAGS", "")))
  if not chosen:
    # Read when jax is imported, and inherited by the subprocesses a script starts.
    os.environ["JAX_NUM_CPU_DEVICES"] = str(NUM_DEVICES)
    if "jax" in sys.modules:  # Imported before the preamble: set it before the backend starts.
      sys.modules["jax"].config.update("jax_num_cpu_devices", NUM_DEVICES)


# --------------------------------------------------------------------------------------------
# Arguments and the writer.


@dataclasses.dataclass
class Run:
  """One invocation of an experiment script.

  Attributes:
    name: the script's module name under ``experiments``.
    args: the parsed arguments (``out``, ``smoke`` where the script has it, and its own).
    command: the exact command, as typed from the repository root.
    started: ``time.time()`` when the script started.
  """

  name: str
  args: argparse.Namespace
  command: str
  started: float

  @property
  def out(self) -> str:
    """The markdown file this run writes."""
    return self.args.out

  @property
  def smoke(self) -> bool:
    return bool(getattr(self.args, "smoke", False))

  def beside(self, filename: str) -> str:
    """A path next to :attr:`out` (for figures the markdown links by file name)."""
    directory = os.path.dirname(os.path.abspath(self.out))
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, filename)

  def header(self, title: str, note: str = "") -> list[str]:
    """Markdown header: the title, the exact command, when, with what, where and how long."""
    import jax  # pylint: disable=g-import-not-at-top

    backend = jax.default_backend()
    devices = f"{jax.device_count()} {'emulated CPU' if backend == 'cpu' else backend} devices"
    lines = [
        f"# {title}", "",
        f"Command (from the repository root): `{self.command}`", "",
        f"Produced {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC with jax "
        f"{jax.__version__} on {platform.machine()} ({os.cpu_count()} cores), {devices}, in "
        f"{time.time() - self.started:.0f} s.", ""]
    if note:
      lines += [note, ""]
    return lines

  def write(self, title: str, lines: Sequence[str], note: str = "") -> str:
    """Writes :meth:`header` and ``lines`` to :attr:`out`; prints and returns the path."""
    text = "\n".join(self.header(title, note) + list(lines)) + "\n"
    path = os.path.abspath(self.out)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      f.write(text)
    print(text)
    print(f"wrote {path}")
    return path


def start(name: str, doc: str, *, smoke: str | None = None,
          arguments: Callable[[argparse.ArgumentParser], None] | None = None,
          argv: Sequence[str] | None = None) -> Run:
  """Parses the script's arguments and starts its clock.

  Args:
    name: the module name under ``experiments`` (``python -m experiments.<name>``).
    doc: the module docstring; its first line is the ``--help`` description.
    smoke: what ``--smoke`` runs instead (help text); None for a script without it.
    arguments: adds the script's own arguments to the parser.
    argv: the arguments (default ``sys.argv[1:]``).

  Returns:
    A :class:`Run`; ``run.args.out`` is ``experiments/results/<name>.md`` unless ``--out`` was
    given (under :data:`SMOKE_RESULTS` with ``--smoke``).
  """
  started = time.time()
  parser = argparse.ArgumentParser(prog=f"python -m experiments.{name}",
                                   description=doc.strip().splitlines()[0])
  parser.add_argument("--out", default=None,
                      help=f"markdown file to write (default experiments/results/{name}.md)")
  if smoke is not None:
    parser.add_argument("--smoke", "--quick", action="store_true",
                        help=f"{smoke}; writes under {SMOKE_RESULTS} unless --out is given")
  if arguments is not None:
    arguments(parser)
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(argv)
  if args.out is None:
    directory = SMOKE_RESULTS if getattr(args, "smoke", False) else RESULTS
    args.out = os.path.join(directory, f"{name}.md")
  command = shlex.join(["python", "-m", f"experiments.{name}"] + argv)
  return Run(name=name, args=args, command=command, started=started)


# --------------------------------------------------------------------------------------------
# The LM config and its ahead-of-time report.


def config(*, num_layers: int, width: int = 256, num_heads: int = 4, mlp_dim: int = 1024,
           seq_len: int = 256, batch_size: int = 32, num_stages: int = 1, num_data: int = 1,
           num_microbatches: int = 1, schedule: str = "gpipe", num_repeats: int = 1,
           remat: str = "none"):
  """``configs/lm.py`` (byte-level decoder LM) with the given fields; dropout off."""
  from configs import lm  # pylint: disable=g-import-not-at-top

  c = lm.get_config("size=small")
  c.num_layers, c.width, c.num_heads, c.mlp_dim = num_layers, width, num_heads, mlp_dim
  c.seq_len, c.batch_size, c.dropout = seq_len, batch_size, 0.0
  c.num_stages, c.num_data, c.num_microbatches = num_stages, num_data, num_microbatches
  c.schedule, c.num_repeats, c.remat = schedule, num_repeats, remat
  return c


def measure(cfg, per_stage: bool = False):
  """AOT-compiles the train step for ``cfg``: a :class:`tpipe.train.cli.config_costs.Report`.

  ``per_stage`` also measures every stage and the memory floor (each distinct chunk compiled
  alone), which the step's own figures do not need.
  """
  from tpipe.train.cli import config_costs  # pylint: disable=g-import-not-at-top

  return config_costs.analyze_config(cfg, per_stage=per_stage)


# --------------------------------------------------------------------------------------------
# Formatting and figures.


def async_all_to_all_on_tpu() -> None:
  """Asks the TPU compiler for asynchronous all-to-alls (``--xla_tpu_enable_async_all_to_all``
  in ``LIBTPU_INIT_ARGS``, as MaxText runs its MoE models), before libtpu loads; once."""
  flags = os.environ.get("LIBTPU_INIT_ARGS", "")
  if "xla_tpu_enable_async_all_to_all" not in flags:
    os.environ["LIBTPU_INIT_ARGS"] = (flags + " --xla_tpu_enable_async_all_to_all=true").strip()


# --------------------------------------------------------------------------------------------
# Rows compiled in separate runs (a TPU-scale row takes minutes), their figures kept in a JSON
# file beside the results: ``--rows=2,0`` compiles those, ``--rows=none`` none.

ROWS_HELP = ("comma-separated row numbers (0-based) to compile, or 'none' to write the table "
             "from the stored results; the others keep their stored results")


def add_rows_argument(parser: argparse.ArgumentParser) -> None:
  """Adds ``--rows`` (:data:`ROWS_HELP`) to a script's parser."""
  parser.add_argument("--rows", default="", help=ROWS_HELP)


def rows_to_compile(run: "Run", rows: Sequence, smoke_rows: Sequence) -> list:
  """The rows ``--rows`` names (all of ``rows`` by default, none for ``none``); with
  ``--smoke`` and no ``--rows``, ``smoke_rows``."""
  if not run.args.rows:
    return list(smoke_rows if run.smoke else rows)
  return [] if run.args.rows == "none" else [rows[int(i)] for i in run.args.rows.split(",")]


class RowStore:
  """Each row's figures by key, in ``<results>.json`` beside the run's table (none read or
  written under ``--smoke``)."""

  def __init__(self, run: "Run"):
    self.smoke = run.smoke
    self.path = pathlib.Path(run.out).with_suffix(".json")
    self.results = (json.loads(self.path.read_text())
                    if self.path.exists() and not self.smoke else {})

  def save(self) -> None:
    if not self.smoke:
      self.path.write_text(json.dumps(self.results, indent=1) + "\n")


def measure_rows(run: "Run", rows: Sequence, smoke_rows: Sequence, key, measure) -> dict:
  """Each stored row's figures by ``key(row)`` (:class:`RowStore`), after measuring the rows
  ``--rows`` names (:func:`rows_to_compile`) with ``measure(row)``, each stored (and printed)
  as soon as it is measured, so that an interrupted run keeps the rows it finished."""
  store = RowStore(run)
  for row in rows_to_compile(run, rows, smoke_rows):
    store.results[key(row)] = measure(row)
    print(key(row), store.results[key(row)], flush=True)
    store.save()
  return store.results


def gib(n: float) -> str:
  """Bytes in GiB, two decimals (no unit)."""
  return f"{n / 2**30:.2f}"


def mib(n: float) -> str:
  """Bytes in MiB, one decimal (no unit)."""
  return f"{n / 2**20:,.1f}"


def size(n: float) -> str:
  """Bytes with a unit: GiB from 1 GiB up, else MiB (the smoke runs' sizes)."""
  return f"{n / 2**30:.4g} GiB" if n >= 2**30 else f"{n / 2**20:.4g} MiB"


def peak_bytes(memory) -> int:
  """A device's peak from ``compiled.memory_analysis()``: arguments + outputs - aliased
  (donated) + temporaries."""
  return int(memory.argument_size_in_bytes + memory.output_size_in_bytes
             - memory.alias_size_in_bytes + memory.temp_size_in_bytes)


def placed(shapes, shardings):
  """``jax.ShapeDtypeStruct`` s of ``shapes`` carrying ``shardings`` (trees of the same
  structure), to compile a step for the input layout a real, placed state has (without them
  XLA chooses the layout itself)."""
  import jax  # pylint: disable=g-import-not-at-top

  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
                      shardings)


def pyplot():
  """``matplotlib.pyplot`` with the non-interactive backend."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  return plt
