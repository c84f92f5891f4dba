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


def mesh_dcn(config) -> dict[str, int]:
  """``config.mesh.dcn``: slices each axis spans (``stage``, ``data``, ``fsdp``; 1 where absent),
  as :func:`tpipe.make_mesh`'s ``dcn`` takes it."""
  given = (config.get("mesh") or {}).get("dcn") or {}
  out = {}
  for name in ("stage", "data", "fsdp"):
    value = given.get(name, 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"config.mesh.dcn.{name} must be an int >= 1 (slices the {name!r} axis "
                       f"spans), got {value!r}.")
    out[name] = value
  unknown = sorted(set(given) - set(out))
  if unknown:
    raise ValueError(f"config.mesh.dcn has unknown axes {unknown}; use stage, data or fsdp.")
  return out


def slice_groups(config, devices) -> list[list] | None:
  """The devices as ``config.mesh.dcn``'s slices when ``config.mesh.emulate_slices``
  (consecutive equal groups, to try a multislice layout on one machine), else None (the
  devices' own slices)."""
  if not (config.get("mesh") or {}).get("emulate_slices", False):
    return None
  count = 1
  for value in mesh_dcn(config).values():
    count *= value
  devices = list(devices)[:num_devices(config)]
  size = len(devices) // count  # The dcn sizes divide the axes, so their product the devices.
  return [devices[i * size:(i + 1) * size] for i in range(count)]


def parse_transfer_delay(value):
  """``config.transfer_delay``: ``"auto"`` (delay the links that cross slices), ``"0"``,
  ``"1"``, or one 0/1 per link as ``"0,1,0,1"``; as :class:`tpipe.PipelineSpec` takes it."""
  if value is None or value == "auto":
    return None
  if isinstance(value, int) and not isinstance(value, bool):
    return value
  try:
    parts = [int(part) for part in str(value).split(",")]
  except ValueError:
    raise ValueError(f"config.transfer_delay={value!r}: write 'auto', '0', '1' or one 0/1 per "
                     "link such as '0,1,0,1'.") from None
  return parts[0] if len(parts) == 1 else tuple(parts)


def parse_tick_costs(value):
  """``config.tick_costs``: ``""`` (one action per tick) or per-action costs of one chunk as
  ``"F=1,B=3,BI=2,W=1"`` (compound ticks built for them); as :class:`tpipe.PipelineSpec` takes
  it (a dict, or None)."""
  if value is None or (isinstance(value, str) and not value.strip()):
    return None
  if not isinstance(value, str):
    return value
  costs = {}
  for part in value.split(","):
    name, _, number = part.partition("=")
    try:
      costs[name.strip()] = float(number)
    except ValueError:
      raise ValueError(f"config.tick_costs={value!r}: write per-action costs as "
                       "'F=1,B=3,BI=2,W=1', or '' for one action per tick.") from None
  return costs


def define_network_flags() -> None:
  """The flags that price communication (the report's and autotune's): the chip and overrides
  of its link figures (:func:`tpipe.tools.links.interconnect`)."""
  from absl import flags  # pylint: disable=g-import-not-at-top

  flags.DEFINE_string("chip", None, "Chip whose links price communication: v4, v5e, v5p or v6e "
                      "(default: the --topology's, else v5p).")
  flags.DEFINE_float("ici_gbps", None, "ICI bandwidth per device and direction for a "
                     "collective along one mesh axis, Gbit/s (default: the chip's).")
  flags.DEFINE_float("dcn_gbps", None, "DCN bandwidth per device and direction, Gbit/s "
                     "(default: the chip's).")
  flags.DEFINE_float("ici_latency_us", None, "Latency of one ICI transfer, microseconds.")
  flags.DEFINE_float("dcn_latency_us", None, "Latency of one DCN transfer, microseconds.")
  flags.DEFINE_float("efficiency", 0.5, "Share of the chip's peak FLOP/s the compute reaches.")


def network_from_flags(topology: str | None = None):
  """The :class:`tpipe.tools.links.Interconnect` the network flags describe."""
  from absl import flags  # pylint: disable=g-import-not-at-top

  from tpipe.tools import links  # pylint: disable=g-import-not-at-top

  f = flags.FLAGS
  return links.interconnect(f.chip or topology or "v5p", ici_gbps=f.ici_gbps,
                            dcn_gbps=f.dcn_gbps, ici_latency_us=f.ici_latency_us,
                            dcn_latency_us=f.dcn_latency_us)


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
