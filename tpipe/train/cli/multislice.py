"""Which mesh axis should cross the slices of a multislice job: the stage axis, the data axis or
the fsdp axis over DCN, compared on one config.

For each axis whose size the slice count divides, the config is compiled with that axis spread
over ``num_slices`` slices (``config.mesh.dcn``; on emulated CPU devices grouped into slices,
or for a TPU topology of that many slices) and its step's communication priced on its links
(:mod:`tpipe.train.cli.communication`). Pipelining sends only stage-boundary activations per tick,
the data axis one gradient reduction per step, FSDP every weight gather of every layer on every
tick; which is cheapest over DCN depends on the model, the batch and the schedule, so the
choice is made from the numbers: the least predicted step time (compute plus exposed
communication) wins.

Usage: ``python -m tpipe.train.cli.autotune --config=configs/lm.py:size=tiny --dcn_slices=2``.
"""

from __future__ import annotations

import copy
import dataclasses

AXES = ("stage", "data", "fsdp")
_SIZE_FIELD = {"stage": "num_stages", "data": "num_data"}


@dataclasses.dataclass(frozen=True)
class Option:
  """One axis over DCN, measured.

  Attributes:
    axis: the axis spread over the slices.
    communication: the :class:`tpipe.train.cli.communication.Communication` of its step, or None
      when it could not be built (then ``reason`` says why).
    peak_bytes: per-device peak memory of the step.
    reason: why the option was not measured ("" when it was).
  """

  axis: str
  communication: object = None
  peak_bytes: int = 0
  reason: str = ""


def axis_size(config, axis: str) -> int:
  if axis in _SIZE_FIELD:
    return int(config[_SIZE_FIELD[axis]])
  return int((config.get("mesh") or {}).get(axis, 1))


def with_dcn(config, axis: str, num_slices: int, emulate: bool):
  """``config`` with ``axis`` spread over ``num_slices`` slices and the others within one."""
  new = copy.deepcopy(config)
  for name in AXES:
    new.mesh.dcn[name] = num_slices if name == axis else 1
  new.mesh.emulate_slices = emulate
  return new


def compare(config, num_slices: int, *, network=None, efficiency: float = 0.5,
            topology: str | None = None) -> list[Option]:
  """Compiles ``config`` with each of :data:`AXES` over ``num_slices`` slices and prices it.

  Args:
    config: the experiment config (``configs/lm.py``; needs its ``mesh.dcn`` fields).
    num_slices: slices of the job.
    network: a :class:`tpipe.experimental.links.Interconnect`; default the topology's chip, else
      v5p.
    efficiency: the share of peak FLOP/s the compute reaches.
    topology: compile for this TPU topology (``num_slices`` of them) instead of this machine's
      devices grouped into emulated slices.

  Raises:
    ValueError: ``num_slices`` < 2.
  """
  from tpipe.train.cli import config_costs  # pylint: disable=g-import-not-at-top

  if isinstance(num_slices, bool) or not isinstance(num_slices, int) or num_slices < 2:
    raise ValueError(f"num_slices must be an int >= 2 (the slices of a multislice job), got "
                     f"{num_slices!r}.")
  options = []
  for axis in AXES:
    size = axis_size(config, axis)
    if size % num_slices:
      options.append(Option(axis, reason=f"its size {size} does not divide into {num_slices} "
                                         "slices"))
      continue
    try:
      rep = config_costs.analyze_config(
          with_dcn(config, axis, num_slices, topology is None), per_stage=False,
          topology=topology, network=network, efficiency=efficiency)
    except (ValueError, TypeError) as error:
      options.append(Option(axis, reason=f"invalid: {error}"))
      continue
    options.append(Option(axis, rep.communication, rep.largest_device_bytes))
  return options


def best(options: list[Option]) -> Option | None:
  """The measured option with the least predicted step time."""
  measured = [o for o in options if o.communication is not None]
  return min(measured, key=lambda o: o.communication.step_seconds, default=None)


def format_choice(options: list[Option]) -> str:
  """The options side by side and the recommendation, as markdown."""
  from tpipe.tools import analysis  # pylint: disable=g-import-not-at-top

  fb, chosen = analysis.format_bytes, best(options)
  lines = ["| axis over DCN | DCN bytes/step/device | compute ms | exposed communication ms | "
           "predicted step ms | peak memory |", "|---|---:|---:|---:|---:|---:|"]
  for option in options:
    comm = option.communication
    if comm is None:
      lines.append(f"| {option.axis} | - | - | - | - ({option.reason}) | - |")
      continue
    mark = " **(recommended)**" if option is chosen else ""
    lines.append(f"| {option.axis}{mark} | {fb(comm.dcn_bytes)} | "
                 f"{comm.compute_seconds * 1e3:.4g} | {comm.exposed_seconds * 1e3:.4g} | "
                 f"{comm.step_seconds * 1e3:.4g} | {fb(option.peak_bytes)} |")
  lines.append("")
  lines.append(f"Recommended: --config.mesh.dcn.{chosen.axis}=<slices> (the least predicted "
               "step time)." if chosen else "No option could be measured.")
  return "\n".join(lines)
