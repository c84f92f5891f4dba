"""Shared helpers for the experiment scripts: devices, the model config, compiling, writing.

Every experiment compiles the real training step of ``configs/lm.py`` (with overrides) ahead of
time on emulated CPU devices and never runs it; see :mod:`tpipe.report`.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "experiments", "results")
NUM_DEVICES = 8


def setup() -> None:
  """8 emulated CPU devices (before JAX starts) and the repository on ``sys.path``."""
  if REPO not in sys.path:
    sys.path.insert(0, REPO)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from tpipe import report  # pylint: disable=g-import-not-at-top

  report.setup_cpu_devices(num_devices=NUM_DEVICES)


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


def measure(cfg):
  """AOT-compiles the train step for ``cfg`` and returns the :class:`tpipe.report.Report`."""
  from tpipe import report  # pylint: disable=g-import-not-at-top

  return report.analyze_config(cfg)


def gib(n: float) -> str:
  return f"{n / 2**30:.3f}"


def mib(n: float) -> str:
  return f"{n / 2**20:.1f}"


def header(title: str, command: str, started: float) -> list[str]:
  """Markdown header: title, the exact command, when, where and how long."""
  import jax  # pylint: disable=g-import-not-at-top

  return [
      f"# {title}", "",
      f"Command (from the repository root): `{command}`", "",
      f"Produced {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC with jax "
      f"{jax.__version__} on {platform.machine()} ({os.cpu_count()} cores), "
      f"{jax.device_count()} emulated CPU devices, in {time.time() - started:.0f} s. Every "
      "number comes from an ahead-of-time compile of the real training step "
      "(`tpipe.report.analyze_config`); nothing was run. Memory is per device: XLA's "
      "`memory_analysis()` peak (arguments + outputs - aliased + temporaries).", ""]


def write(name: str, lines: list[str]) -> str:
  os.makedirs(RESULTS, exist_ok=True)
  path = os.path.join(RESULTS, name)
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  print(f"wrote {path}")
  return path


def pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  return plt
