"""What the command-line programs (train, report, autotune) share: start-up and error handling."""

from __future__ import annotations

import glob
import math
import importlib.util
import os
import re
import sys
import traceback
from typing import Callable

from absl import app

from tpipe.train.cli import config_help


def user_cpu_device_count() -> int | None:
  """The CPU device count the user chose (``JAX_NUM_CPU_DEVICES`` or ``XLA_FLAGS``), if any."""
  if "JAX_NUM_CPU_DEVICES" in os.environ:
    return int(os.environ["JAX_NUM_CPU_DEVICES"])
  forced = re.search(r"xla_force_host_platform_device_count=(\d+)",
                     os.environ.get("XLA_FLAGS", ""))
  return int(forced.group(1)) if forced else None


def tpu_host() -> bool:
  """Whether this machine has TPU chips (their device files: ``/dev/accel*`` on TPU v4 and v5e,
  ``/dev/vfio/<n>`` on v5p and v6e)."""
  vfio = [p for p in glob.glob("/dev/vfio/*") if os.path.basename(p).isdigit()]
  return bool(glob.glob("/dev/accel*") or vfio)


def quiet_absent_tpu() -> None:
  """Keeps JAX from starting its TPU backend where libtpu is installed (the ``tpu`` and
  ``test`` extras) but the machine has no TPU and no GPU plugin: the failed start prints
  libtpu errors (``INVALID_ARGUMENT``, ``No jellyfish device found``, and a lockfile error with
  two runs at once) that read as a broken install. ``JAX_PLATFORMS``, when set, decides as
  usual. Call before the first JAX computation."""
  if os.environ.get("JAX_PLATFORMS") or tpu_host():
    return
  if importlib.util.find_spec("libtpu") is None:
    return
  plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin")
  if any(importlib.util.find_spec(name) for name in plugins):
    return
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")


def parse_profile_steps(value) -> tuple[int, int] | None:
  """``config.profile_steps``: ``""`` (no profile) or ``"FIRST,LAST"`` (trace steps FIRST to
  LAST, both included); as ``(first, last)`` or None."""
  if value is None or (isinstance(value, str) and not value.strip()):
    return None
  try:
    first, last = (int(part) for part in str(value).split(","))
  except ValueError:
    raise ValueError(f"config.profile_steps={value!r}: write the first and last step to "
                     "trace, such as '10,15', or '' for none.") from None
  if not 1 <= first <= last:
    raise ValueError(f"config.profile_steps={value!r}: need 1 <= first <= last.")
  return first, last


def mesh_sizes(config) -> dict[str, int]:
  """``{"fsdp": .., "expert": .., "tensor": ..}`` from ``config.mesh`` (each 1 where the config
  has no such field).

  ``config.num_stages`` and ``config.num_data`` size the mesh's ``stage`` and ``data`` axes;
  ``config.mesh.fsdp``, ``config.mesh.expert`` and ``config.mesh.tensor`` its ``fsdp``,
  ``expert`` and ``tensor`` axes, which split each stage's weights and optimizer state (fsdp),
  a mixture's experts (expert) and each layer's matrices (tensor) over more devices.
  """
  mesh = config.get("mesh") or {}
  sizes = {}
  for name in ("fsdp", "expert", "tensor"):
    value = mesh.get(name, 1)
    if isinstance(value, bool) or not isinstance(value, int):
      raise TypeError(f"config.mesh.{name} must be an int, got {value!r}.")
    if value < 1:
      raise ValueError(f"config.mesh.{name} must be >= 1, got {value}.")
    sizes[name] = value
  return sizes


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
  """``config.tick_costs``: ``""`` (compound ticks for costs derived from measured FLOPs),
  ``"plain"`` (one action per tick) or per-action costs of one chunk as ``"F=1,B=3,BI=2,W=1"``
  (compound ticks built for them); as :class:`tpipe.PipelineSpec` takes it (a dict, None or
  ``"plain"``)."""
  if value is None or (isinstance(value, str) and not value.strip()):
    return None
  if not isinstance(value, str):
    return value
  if value.strip() == "plain":
    return "plain"
  from tpipe.experimental import costs  # pylint: disable=g-import-not-at-top

  try:
    return costs.parse(value)
  except ValueError as error:
    raise ValueError(f"config.tick_costs={value!r}: {error} Or write '' for costs derived "
                     "from measured FLOPs, or 'plain' for one action per tick.") from None


def parse_bools(name: str, texts) -> list[bool]:
  """A list flag's ``true`` / ``false`` values (any case) as bools; a usage error naming the flag
  for anything else."""
  out = []
  for text in texts:
    if text.lower() not in ("true", "false"):
      raise app.UsageError(f"--{name} takes true and false, got {text!r}.")
    out.append(text.lower() == "true")
  return out


def define_network_flags() -> None:
  """The flags that price communication (the report's and autotune's): the chip and overrides
  of its link figures (:func:`tpipe.experimental.links.interconnect`)."""
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
  """The :class:`tpipe.experimental.links.Interconnect` the network flags describe."""
  from absl import flags  # pylint: disable=g-import-not-at-top

  from tpipe.experimental import links  # pylint: disable=g-import-not-at-top

  f = flags.FLAGS
  return links.interconnect(f.chip or topology or "v5p", ici_gbps=f.ici_gbps,
                            dcn_gbps=f.dcn_gbps, ici_latency_us=f.ici_latency_us,
                            dcn_latency_us=f.dcn_latency_us)


def num_devices(config) -> int:
  """The devices ``config``'s mesh needs: stages x data x fsdp x expert x tensor."""
  return int(config.num_stages) * int(config.num_data) * math.prod(mesh_sizes(config).values())


HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull")


def _startup_error(error: BaseException, argv: list[str]) -> str:
  """One line for an error raised while the flags and the config file were read."""
  text = str(error).strip("'\"")
  spec = config_help.config_spec(argv) or "?"
  path = spec.split(":", 1)[0]
  if isinstance(error, (AttributeError, KeyError)):
    name = re.search(r"'?([A-Za-z_][\w]*)'?", text)
    suggestion = re.search(r'Did you mean "([^"]+)"', text)
    given = [a.split("=", 1)[0] for a in argv if a.startswith("--config.")]
    flag = next((g for g in given if name and g.rsplit(".", 1)[-1] == name.group(1)),
                f"--config.{name.group(1) if name else '?'}")
    hint = (f"; did you mean {flag.rsplit('.', 1)[0]}.{suggestion.group(1)}?" if suggestion
            else "")
    return (f"{flag}: the config ({spec}) has no such field{hint} "
            f"(--config={spec} --help lists its fields).")
  if "No such file" in text or isinstance(error, FileNotFoundError):
    return (f"--config={spec}: no such config file {path!r} (relative to {os.getcwd()}); "
            "e.g. --config=configs/lm.py.")
  where = ""
  for frame in traceback.extract_tb(error.__traceback__)[::-1]:
    if os.path.basename(frame.filename) == os.path.basename(path):
      where = f" (line {frame.lineno})"
      break
  if isinstance(error, SyntaxError):
    where = f" (line {error.lineno})"
  detail = text.splitlines()[-1].strip() if text else ""
  return (f"--config={spec}: the config file could not be loaded{where}: "
          f"{type(error).__name__}: {detail}")


def run(main: Callable[[list[str]], None], doc: str | None = None) -> None:
  """``absl.app.run(main)``, with errors reported in one line and exit status 2, and a
  ``--help`` that lists the config's fields.

  ValueError and TypeError are what tpipe raises for bad configuration, with the fix in the
  message; a traceback would only hide it. An error while the flags and the config file are
  read (a misspelt ``--config.field``, a missing or broken config file) is one line too.

  Args:
    main: the program's ``main(argv)``.
    doc: the program's usage text, for ``--help`` (which then also lists the flags and, for a
      program with ``--config``, the config file's fields with defaults and meanings).
  """
  if doc is not None and any(arg in HELP_FLAGS for arg in sys.argv[1:]):
    print(config_help.help_text(doc, sys.argv[1:]))
    raise SystemExit(0)
  started = False

  def main_with_clean_errors(argv):
    nonlocal started
    started = True
    try:
      main(argv)
    except (ValueError, TypeError) as e:
      print(f"error: {e}", file=sys.stderr)
      raise SystemExit(2) from None
    except OSError as e:  # The config file failed to load; ml_collections says so on use.
      if "earlier failure to load" not in str(e):
        raise
      print(f"error: {_startup_error(e, sys.argv[1:])}", file=sys.stderr)
      raise SystemExit(2) from None

  try:
    app.run(main_with_clean_errors)
  except Exception as e:  # pylint: disable=broad-except  # Only before main: flags, config.
    if started:
      raise
    print(f"error: {_startup_error(e, sys.argv[1:])}", file=sys.stderr)
    raise SystemExit(2) from None
