"""What the command-line programs (train, report, autotune) share: start-up and error handling."""

from __future__ import annotations

import os
import re
import sys
from typing import Callable

from absl import app


def user_cpu_device_count() -> int | None:
  """The CPU device count the user chose (``JAX_NUM_CPU_DEVICES`` or ``XLA_FLAGS``), if any."""
  if "JAX_NUM_CPU_DEVICES" in os.environ:
    return int(os.environ["JAX_NUM_CPU_DEVICES"])
  forced = re.search(r"xla_force_host_platform_device_count=(\d+)",
                     os.environ.get("XLA_FLAGS", ""))
  return int(forced.group(1)) if forced else None


def mesh_sizes(config) -> tuple[int, int]:
  """``(fsdp, tensor)`` from ``config.mesh`` (each 1 where the config has no such field).

  ``config.num_stages`` and ``config.num_data`` size the mesh's ``stage`` and ``data`` axes;
  ``config.mesh.fsdp`` and ``config.mesh.tensor`` its ``fsdp`` and ``tensor`` axes, which split
  each stage's weights and optimizer state (and each layer's matrices) over more devices.
  """
  mesh = config.get("mesh") or {}
  sizes = []
  for name in ("fsdp", "tensor"):
    value = mesh.get(name, 1)
    if isinstance(value, bool) or not isinstance(value, int):
      raise TypeError(f"config.mesh.{name} must be an int, got {value!r}.")
    if value < 1:
      raise ValueError(f"config.mesh.{name} must be >= 1, got {value}.")
    sizes.append(value)
  return tuple(sizes)


def num_devices(config) -> int:
  """The devices ``config``'s mesh needs: stages x data x fsdp x tensor."""
  fsdp, tensor = mesh_sizes(config)
  return int(config.num_stages) * int(config.num_data) * fsdp * tensor


def run(main: Callable[[list[str]], None]) -> None:
  """``absl.app.run(main)``, with a bad configuration reported in one line and exit status 2.

  ValueError and TypeError are what tpipe raises for bad configuration, with the fix in the
  message; a traceback would only hide it.
  """

  def main_with_clean_errors(argv):
    try:
      main(argv)
    except (ValueError, TypeError) as e:
      print(f"error: {e}", file=sys.stderr)
      raise SystemExit(2) from None

  app.run(main_with_clean_errors)
