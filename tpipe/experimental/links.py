"""What communication costs on the link it crosses: ICI inside a TPU slice, DCN between slices.

Experimental (research): a pricing model from public figures and assumed latencies, which the
report and the auto-tuner use to estimate communication; its figures and interface may change.

A mesh axis whose devices sit in one slice talks over the chips' inter-chip interconnect (ICI);
an axis that spans slices (``tpipe.make_mesh(..., dcn={...})``) talks over the data-centre
network (DCN), tens of times slower. This module prices a compiled step's collectives on the
link each one crosses:

* :class:`Link` / :class:`Interconnect`: bandwidth and latency of each link and the chip's
  peak FLOP/s; :data:`INTERCONNECTS` has TPU v4, v5e, v5p and v6e, and :func:`interconnect`
  returns one with overrides (the report's and autotune's flags).
* :func:`axis_links`: which link each mesh axis uses (from the devices' slices).
* :func:`traffic`: per mesh axis, the link, bytes per step per device, the time the transfers
  take, and how much of it the step cannot hide (:class:`AxisTraffic`).

**Defaults** (per chip, from the Cloud TPU system-architecture pages; bandwidth in one
direction). ICI: v4 2400 Gbps, v5e 1600 Gbps, v5p 4800 Gbps, v6e 3200 Gbps over all ports of the
chip (v4 and v5p 6 ports in a 3D torus, v5e and v6e 4 in a 2D torus); a collective along one mesh
axis uses the two ports of that torus dimension, so it gets ``2 / ports`` of the chip's figure.
DCN: v5e 25 Gbps (2 x 100 Gbps NICs per 8-chip host), v5p 50 Gbps (stated per chip), v6e
100 Gbps (4 x 200 Gbps NICs per 8-chip host); v4's table states none, so 50 Gbps is assumed (its
4-chip hosts have v5p's per-host share). Latencies are assumptions, not published figures: 1 us
per ICI transfer, 10 us per DCN transfer. Peak bf16 FLOP/s: v4 275 T, v5e 197 T, v5p 459 T,
v6e 918 T. Every figure can be overridden.

**Exposure.** The stage axis's sends run every tick of the tick loop; their exposed time comes
from simulating the schedule's table with each link's transfer time
(:meth:`tpipe.schedules.FusedSchedule.simulate`): a send over an undelayed link lies on the
path between ticks, one over a delayed link overlaps the next tick's compute. Collectives of the
other axes: those outside the loop (the step's one gradient reduction) are exposed whole, those
inside it at most by what exceeds the compute they can run beside (XLA's latency-hiding
scheduler at best).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

import numpy as np

LINK_NAMES = ("ici", "dcn")


@dataclasses.dataclass(frozen=True)
class Link:
  """One kind of link as one device sees it.

  Attributes:
    name: ``"ici"`` or ``"dcn"``.
    bytes_per_second: what one device moves over it per second, in one direction, for a
      collective along one mesh axis.
    latency_seconds: fixed cost of each transfer.
  """

  name: str
  bytes_per_second: float
  latency_seconds: float

  def seconds(self, nbytes: float, count: int = 1) -> float:
    """Time for ``count`` transfers moving ``nbytes`` in all."""
    return count * self.latency_seconds + nbytes / self.bytes_per_second


@dataclasses.dataclass(frozen=True)
class Interconnect:
  """A chip and its links.

  Attributes:
    name: the chip (``"v5p"``).
    flops_per_second: its peak bfloat16 FLOP/s.
    ici: the link between chips of one slice.
    dcn: the link between slices.
  """

  name: str
  flops_per_second: float
  ici: Link
  dcn: Link

  def link(self, name: str) -> Link:
    return {"ici": self.ici, "dcn": self.dcn}[name]


def _chip(name, tflops, ici_gbps, ports, dcn_gbps):
  # A collective along one mesh axis uses that torus dimension's two ports.
  return Interconnect(name, tflops * 1e12,
                      Link("ici", ici_gbps * 1e9 / 8 * 2 / ports, 1e-6),
                      Link("dcn", dcn_gbps * 1e9 / 8, 10e-6))


INTERCONNECTS: dict[str, Interconnect] = {
    "v4": _chip("v4", 275, 2400, 6, 50),
    "v5e": _chip("v5e", 197, 1600, 4, 25),
    "v5p": _chip("v5p", 459, 4800, 6, 50),
    "v6e": _chip("v6e", 918, 3200, 4, 100),
}


def interconnect(name: str = "v5p", *, ici_gbps: float | None = None,
                 dcn_gbps: float | None = None, ici_latency_us: float | None = None,
                 dcn_latency_us: float | None = None,
                 peak_tflops: float | None = None) -> Interconnect:
  """The interconnect of chip ``name`` (a key of :data:`INTERCONNECTS`, or a topology name such
  as ``"v5p:2x2x2"``), with any figure overridden: bandwidths in Gbit/s per device and
  direction for a collective along one axis, latencies in microseconds, peak in TFLOP/s.

  Raises:
    ValueError: an unknown chip, or a figure that is not positive.
  """
  chip = str(name).split(":")[0].lower()
  if chip not in INTERCONNECTS:
    raise ValueError(f"Unknown chip {name!r}; choose one of {tuple(INTERCONNECTS)} (or a "
                     "topology such as 'v5p:2x2x2'), and override figures with ici_gbps=, "
                     "dcn_gbps=, ...")
  base = INTERCONNECTS[chip]
  given = {"ici_gbps": ici_gbps, "dcn_gbps": dcn_gbps, "ici_latency_us": ici_latency_us,
           "dcn_latency_us": dcn_latency_us, "peak_tflops": peak_tflops}
  for key, value in given.items():
    if value is not None and not (isinstance(value, (int, float)) and value > 0):
      raise ValueError(f"{key} must be a positive number, got {value!r}.")

  def link(old: Link, gbps, latency_us) -> Link:
    return Link(old.name, old.bytes_per_second if gbps is None else gbps * 1e9 / 8,
                old.latency_seconds if latency_us is None else latency_us * 1e-6)

  return Interconnect(chip, base.flops_per_second if peak_tflops is None else peak_tflops * 1e12,
                      link(base.ici, ici_gbps, ici_latency_us),
                      link(base.dcn, dcn_gbps, dcn_latency_us))


def axis_links(mesh) -> dict[str, str]:
  """Per mesh axis, ``"dcn"`` where moving along it changes slice somewhere, else ``"ici"``
  (slices as :func:`tpipe.mesh.slice_of_devices` tells them)."""
  from tpipe import mesh as mesh_lib  # pylint: disable=g-import-not-at-top

  slices = mesh_lib.slice_of_devices(mesh)
  out = {}
  for i, axis in enumerate(mesh.axis_names):
    moved = np.moveaxis(slices, i, 0)
    out[axis] = "dcn" if np.any(moved != moved[:1]) else "ici"
  return out


@dataclasses.dataclass(frozen=True)
class AxisTraffic:
  """One mesh axis's communication in a step, per device.

  Attributes:
    axes: the mesh axes the collectives span (``("stage",)``, ``("data",)``, ...).
    link: ``"dcn"`` if any of them crosses slices, else ``"ici"``.
    kinds: the collective kinds (``"collective-permute"``, ``"all-reduce"``, ...).
    bytes_per_step: bytes moved per device per step.
    transfers: collective executions per step.
    seconds: the transfers' time on the link, one after another.
    exposed_seconds: the share of ``seconds`` the step cannot hide behind compute.
  """

  axes: tuple[str, ...]
  link: str
  kinds: tuple[str, ...]
  bytes_per_step: int
  transfers: int
  seconds: float
  exposed_seconds: float


def traffic(collectives: Iterable, links: Mapping[str, str], net: Interconnect,
            compute_seconds: float, stage_exposed: float | None = None,
            stage_axis: str = "stage") -> list[AxisTraffic]:
  """Per group of mesh axes, the step's collectives priced on their link.

  Args:
    collectives: :class:`tpipe.tools.analysis.Collective` of the compiled step (with ``axes``).
    links: :func:`axis_links` of the mesh.
    net: the :class:`Interconnect`.
    compute_seconds: the step's compute time (what loop collectives can run beside).
    stage_exposed: the stage sends' exposed time from the schedule's simulation (see the module
      docstring); None: as other loop collectives.
    stage_axis: the stage axis's name.

  Returns:
    One :class:`AxisTraffic` per distinct ``axes``, collectives over no axis left out.
  """
  groups: dict[tuple[str, ...], list] = {}
  for c in collectives:
    if c.axes:
      groups.setdefault(tuple(c.axes), []).append(c)
  out = []
  for axes, found in sorted(groups.items()):
    link = "dcn" if any(links.get(a) == "dcn" for a in axes) else "ici"
    chosen = net.link(link)
    seconds = sum(chosen.seconds(c.total_bytes, c.count) for c in found)
    looped = sum(chosen.seconds(c.total_bytes, c.count) for c in found if c.in_loop)
    if axes == (stage_axis,) and stage_exposed is not None:
      exposed = min(seconds, stage_exposed + (seconds - looped))
    else:
      exposed = (seconds - looped) + max(0.0, looped - compute_seconds)
    out.append(AxisTraffic(axes=axes, link=link,
                           kinds=tuple(sorted({c.kind for c in found})),
                           bytes_per_step=int(sum(c.total_bytes for c in found)),
                           transfers=int(sum(c.count for c in found)), seconds=seconds,
                           exposed_seconds=exposed))
  return out


def stage_transfer_seconds(collectives: Iterable, crossing: tuple[bool, ...], net: Interconnect,
                           stage_axis: str = "stage") -> np.ndarray:
  """Per link of the ring of stages, the time of one tick's exchange over it: the largest
  stage-axis collective-permute's bytes (one tick's message) on DCN where the link crosses
  slices (``crossing``, :func:`tpipe.mesh.crossing_links`), else on ICI."""
  sends = [c for c in collectives
           if c.kind == "collective-permute" and tuple(c.axes or ()) == (stage_axis,)]
  message = max((c.bytes for c in sends), default=0)
  return np.array([net.link("dcn" if cross else "ici").seconds(message) if message else 0.0
                   for cross in crossing])
