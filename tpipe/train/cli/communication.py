"""What the report and autotune say about a step's communication: per mesh axis the link it uses
(ICI inside a slice, DCN between slices), its bytes per step and the time the step cannot hide,
beside the compute time.

The compute time is the schedule's table simulated with the program's FLOPs per action
(:mod:`tpipe.tools.flops`) at ``efficiency`` of the chip's peak; the stage sends' exposed time
is the same simulation with each link's transfer time minus without
(:meth:`tpipe.schedules.FusedSchedule.simulate`), so a delayed link shows what delaying it
hides. Prices and links: :mod:`tpipe.experimental.links`. Imports of tpipe are deferred to the
calls, like the report's own (the command line sets the emulated device count before JAX starts).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Communication:
  """A step's communication priced on its links.

  Attributes:
    chip: the chip priced (:data:`tpipe.experimental.links.INTERCONNECTS`).
    efficiency: the share of the chip's peak FLOP/s the compute is taken to reach.
    compute_seconds: the step's compute time (the table's neighbour-synchronised time under the
      program's FLOPs per action, plus what runs outside the actions).
    rows: a :class:`tpipe.experimental.links.AxisTraffic` per group of mesh axes.
    links: per mesh axis, ``"ici"`` or ``"dcn"``.
    crossing: per link of the ring of stages, whether it crosses slices.
    delays: per link of the ring of stages, the schedule's transfer delay (0 or 1 tick).
    stage_transfer_seconds: per link of the ring, one tick's exchange time.
  """

  chip: str
  efficiency: float
  compute_seconds: float
  rows: tuple
  links: dict
  crossing: tuple
  delays: tuple
  stage_transfer_seconds: tuple

  @property
  def exposed_seconds(self) -> float:
    return float(sum(row.exposed_seconds for row in self.rows))

  @property
  def step_seconds(self) -> float:
    """Predicted step time: compute plus the communication it cannot hide."""
    return self.compute_seconds + self.exposed_seconds

  @property
  def dcn_bytes(self) -> int:
    return int(sum(row.bytes_per_step for row in self.rows if row.link == "dcn"))

  def to_json(self) -> dict[str, Any]:
    return {
        "chip": self.chip, "efficiency": self.efficiency,
        "compute_seconds": self.compute_seconds, "exposed_seconds": self.exposed_seconds,
        "step_seconds": self.step_seconds, "links": dict(self.links),
        "stage_links_crossing_slices": list(self.crossing),
        "stage_link_delays": list(self.delays),
        "stage_transfer_seconds": list(self.stage_transfer_seconds),
        "axes": [{"axes": ",".join(row.axes), "link": row.link, "kinds": list(row.kinds),
                  "bytes_per_step": row.bytes_per_step, "transfers": row.transfers,
                  "seconds": row.seconds, "exposed_seconds": row.exposed_seconds}
                 for row in self.rows],
    }


def _compute_and_stage_exposure(table, pipeline, executed: float, transfer, per_flop: float):
  """``(compute seconds, exposed stage-send seconds)`` of ``table`` (see the module docstring).

  The compute is the step in FLOPs (:func:`tpipe.tools.flops.step_flops`) at the
  chip's rate; the exposure is the table simulated with and without the links' transfer times,
  under the program's FLOPs per action (without them, the default costs scaled to the executed
  FLOPs)."""
  from tpipe import schedules  # pylint: disable=g-import-not-at-top
  from tpipe.tools import flops as flops_lib  # pylint: disable=g-import-not-at-top

  compute = flops_lib.step_flops(table, pipeline, executed) * per_flop
  whole = schedules.whole_step(table)
  if pipeline is not None and pipeline.action_costs:
    try:
      timing = whole.simulate(pipeline.action_costs, transfer / per_flop)  # In FLOPs.
      return compute, timing.exposed_transfer * per_flop
    except ValueError:  # The program's FLOPs miss an action kind the table runs.
      pass
  unit = executed * per_flop / whole.simulate().lockstep
  costs = {kind: cost * unit for kind, cost in schedules.DEFAULT_COSTS.items()}
  return compute, whole.simulate(costs, transfer).exposed_transfer


def check_efficiency(efficiency) -> None:
  """Raises ValueError unless ``efficiency`` (the share of peak FLOP/s reached) is in (0, 1]."""
  number = isinstance(efficiency, (int, float)) and not isinstance(efficiency, bool)
  if not (number and 0 < efficiency <= 1):
    raise ValueError(f"efficiency must be in (0, 1] (the share of peak FLOP/s reached), got "
                     f"{efficiency!r}.")


def summarize(mesh, table, analysis_result, net, *, efficiency: float = 0.5,
              stage_axis: str = "stage") -> Communication:
  """Prices the compiled step's collectives on their links.

  Args:
    mesh: the step's mesh (its devices' slices give the links).
    table: the table the step runs (:attr:`tpipe.PlannedPipeline.loss_table`).
    analysis_result: the step's :class:`tpipe.tools.analysis.Analysis`.
    net: the :class:`tpipe.experimental.links.Interconnect` to price with.
    efficiency: the share of peak FLOP/s the compute reaches.
    stage_axis: the stage axis's name.

  Raises:
    ValueError: ``efficiency`` not in (0, 1].
  """
  from tpipe import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from tpipe.experimental import links as links_lib  # pylint: disable=g-import-not-at-top

  check_efficiency(efficiency)
  per_flop = 1.0 / (net.flops_per_second * efficiency)
  crossing = mesh_lib.crossing_links(mesh, stage_axis)
  found = analysis_result.collectives
  transfer = links_lib.stage_transfer_seconds(found, crossing, net, stage_axis)
  delays = tuple(getattr(table, "delays", (0,) * len(crossing)))
  compute, stage_exposed = _compute_and_stage_exposure(
      table, analysis_result.pipeline, analysis_result.flops.executed, transfer, per_flop)
  axis_links = links_lib.axis_links(mesh)
  rows = links_lib.traffic(found, axis_links, net, compute, stage_exposed, stage_axis)
  return Communication(chip=net.name, efficiency=efficiency, compute_seconds=compute,
                       rows=tuple(rows), links=axis_links, crossing=tuple(crossing),
                       delays=delays, stage_transfer_seconds=tuple(float(t) for t in transfer))


def _seconds(x: float) -> str:
  return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def format_communication(comm: Communication) -> list[str]:
  """The communication part of ``report.md``."""
  from tpipe.tools import analysis  # pylint: disable=g-import-not-at-top

  lines = [f"Communication priced on {comm.chip} links (compute at {comm.efficiency:.0%} of "
           f"peak): compute {_seconds(comm.compute_seconds)}, exposed communication "
           f"{_seconds(comm.exposed_seconds)}, predicted step {_seconds(comm.step_seconds)}.",
           "Mesh axes: " + ", ".join(f"{axis} {link.upper()}"
                                     for axis, link in comm.links.items()) + ".",
           f"Stage links crossing slices: {list(comm.crossing)}; transfer delay per link: "
           f"{list(comm.delays)}.", "",
           "| axes | link | collectives | transfers/step | bytes/step | time | exposed |",
           "|---|---|---|---:|---:|---:|---:|"]
  for row in comm.rows:
    lines.append(f"| {','.join(row.axes)} | {row.link.upper()} | {', '.join(row.kinds)} | "
                 f"{row.transfers} | {analysis.format_bytes(row.bytes_per_step)} | "
                 f"{_seconds(row.seconds)} | {_seconds(row.exposed_seconds)} |")
  return lines
