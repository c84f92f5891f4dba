"""Accelerators' published figures for pricing a compiled program (:mod:`tpipe.tools.step_time`):
dense bfloat16 peak FLOP/s, HBM bandwidth and capacity, and the fast and slow links between chips.

TPU v4, v5e, v5p and v6e take their peak and links from :mod:`tpipe.experimental.links` (one
table for the report's communication pricing and this one) and add the HBM bandwidth; H100 and
H200 (SXM) come from NVIDIA's datasheets. Each :class:`Chip` names its source.

  >>> chip("v5p:2x2x2").hbm_bytes_per_second
  2765000000000.0
  >>> chip("v5p").hbm_bytes / 2**30
  95.0
"""

from __future__ import annotations

import dataclasses

from tpipe.experimental import links as links_lib


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator's published figures.

  Attributes:
    name: ``"v5p"``, ``"h100"``, ...
    flops_per_second: dense bfloat16 peak FLOP/s.
    hbm_bytes_per_second: HBM bandwidth.
    hbm_bytes: HBM capacity, the memory one device's step must fit in.
    ici: the fast link (TPU ICI inside a slice, NVLink inside a GPU node), per device and
      direction for a collective along one mesh axis.
    dcn: the slow link (TPU DCN between slices, InfiniBand between GPU nodes).
    source: where the figures come from.
  """

  name: str
  flops_per_second: float
  hbm_bytes_per_second: float
  hbm_bytes: float
  ici: links_lib.Link
  dcn: links_lib.Link
  source: str

  def link(self, name: str) -> links_lib.Link:
    return {"ici": self.ici, "dcn": self.dcn}[name]


_TPU_SOURCE = ("Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v4, v5e, v5p, "
               "v6e): bf16 peak, HBM bandwidth and capacity per chip; ICI and DCN as "
               "tpipe.experimental.links states them")
# HBM bandwidth per chip, GB/s: v4 1200, v5e 819, v5p 2765, v6e 1640 (the pages above).
_TPU_HBM_GBPS = {"v4": 1200.0, "v5e": 819.0, "v5p": 2765.0, "v6e": 1640.0}
# HBM capacity per chip, GiB: v4 32, v5e 16, v5p 95, v6e 32 (the pages above).
_TPU_HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}


def _tpu(name: str) -> Chip:
  net = links_lib.INTERCONNECTS[name]  # Peak FLOP/s and links shared with the report's pricing.
  return Chip(name, net.flops_per_second, _TPU_HBM_GBPS[name] * 1e9, _TPU_HBM_GIB[name] * 2**30,
              net.ici, net.dcn, _TPU_SOURCE)


def _gpu(name: str, hbm_tbps: float, hbm_gb: float, source: str) -> Chip:
  # NVLink 4: 900 GB/s per GPU, both directions together: 450 GB/s each way. Between nodes one
  # 400 Gb/s InfiniBand NDR adapter per GPU (the DGX H100/H200 layout): 50 GB/s. Latencies are
  # assumptions as for TPUs: 1 us on NVLink, 10 us across nodes.
  return Chip(name, 989e12, hbm_tbps * 1e12, hbm_gb * 1e9, links_lib.Link("ici", 450e9, 1e-6),
              links_lib.Link("dcn", 400e9 / 8, 10e-6), source)


CHIPS: dict[str, Chip] = {
    **{name: _tpu(name) for name in ("v4", "v5e", "v5p", "v6e")},
    # H100 SXM5 datasheet (nvidia.com/en-us/data-center/h100): bf16 dense 989 TFLOP/s (1979
    # with sparsity), HBM3 80 GB at 3.35 TB/s, NVLink 900 GB/s.
    "h100": _gpu("h100", 3.35, 80, "NVIDIA H100 SXM5 datasheet: bf16 dense 989 TFLOP/s, HBM3 "
                 "80 GB at 3.35 TB/s, NVLink 900 GB/s"),
    # H200 SXM datasheet (nvidia.com/en-us/data-center/h200): the H100's compute, HBM3e 141
    # GB at 4.8 TB/s, NVLink 900 GB/s.
    "h200": _gpu("h200", 4.8, 141, "NVIDIA H200 SXM datasheet: bf16 dense 989 TFLOP/s, HBM3e "
                 "141 GB at 4.8 TB/s, NVLink 900 GB/s"),
}


def chip(name) -> Chip:
  """The :class:`Chip` called ``name``: a key of :data:`CHIPS`, a TPU topology
  (``"v5p:2x2x2"``), or a :class:`Chip` (returned as is).

  Raises:
    ValueError: an unknown chip, naming the choices.
  """
  if isinstance(name, Chip):
    return name
  key = str(name).split(":")[0].strip().lower()
  if key not in CHIPS:
    raise ValueError(f"Unknown chip {name!r}; choose one of {tuple(CHIPS)} (a TPU topology "
                     "such as 'v5p:2x2x2' names its chip), or pass a step_time.Chip with your "
                     "own figures.")
  return CHIPS[key]
