"""tpipe.experimental.links: the chips' link figures and overrides, which link each mesh axis
uses, and a step's collectives priced on their links (exposed time outside and inside the tick
loop)."""

import jax
import numpy as np
import pytest

import tpipe
from tpipe.tools import analysis
from tpipe.experimental import links

pytestmark = pytest.mark.unit  # Meshes and arithmetic: no JAX computation.


def test_the_chips_links_are_their_public_figures():
  v5p = links.interconnect("v5p")
  assert v5p.flops_per_second == 459e12
  assert v5p.dcn.bytes_per_second == 50e9 / 8  # 50 Gbit/s per chip.
  assert v5p.ici.bytes_per_second == pytest.approx(4800e9 / 8 * 2 / 6)  # One axis: 2 of 6 ports.
  assert links.interconnect("v5e").dcn.bytes_per_second == 25e9 / 8  # 2 x 100 Gbit/s per 8 chips
  assert links.interconnect("v6e").dcn.bytes_per_second == 100e9 / 8  # 4 x 200 Gbit/s per 8.
  assert links.interconnect("v5p:2x2x2") == v5p  # A topology name names its chip.
  for chip in links.INTERCONNECTS.values():
    assert chip.dcn.bytes_per_second < chip.ici.bytes_per_second / 10
    assert chip.dcn.latency_seconds > chip.ici.latency_seconds


def test_figures_can_be_overridden():
  net = links.interconnect("v4", dcn_gbps=100, ici_latency_us=2, peak_tflops=100)
  assert net.dcn.bytes_per_second == 100e9 / 8
  assert net.ici.latency_seconds == 2e-6
  assert net.flops_per_second == 100e12
  assert net.ici.bytes_per_second == links.INTERCONNECTS["v4"].ici.bytes_per_second
  # One transfer: latency plus bytes over bandwidth.
  assert net.dcn.seconds(12.5e6, count=2) == pytest.approx(2 * 10e-6 + 1e-3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(name="v9"), r"Unknown chip 'v9'; choose one of \('v4', 'v5e', 'v5p', 'v6e'\)"),
    (dict(dcn_gbps=0), "dcn_gbps must be a positive number, got 0"),
    (dict(ici_latency_us=-1.0), "ici_latency_us must be a positive number"),
])
def test_bad_figures_name_the_fix(kwargs, match):
  with pytest.raises(ValueError, match=match):
    links.interconnect(**kwargs)


def test_axis_links_follow_the_slices():
  devices = jax.devices()[:8]
  two = [devices[:4], devices[4:]]
  stage_over = tpipe.make_mesh(stages=4, data=2, dcn={"stage": 2}, slices=two)
  assert links.axis_links(stage_over) == {"stage": "dcn", "data": "ici", "fsdp": "ici",
                                          "expert": "ici", "tensor": "ici"}
  data_over = tpipe.make_mesh(stages=4, data=2, dcn={"data": 2}, slices=two)
  assert links.axis_links(data_over)["data"] == "dcn"
  assert links.axis_links(data_over)["stage"] == "ici"
  assert set(links.axis_links(tpipe.make_mesh(stages=4, data=2)).values()) == {"ici"}


def _collective(kind, nbytes, count, axes, in_loop):
  return analysis.Collective(kind=kind, name=kind, bytes=nbytes, count=count, in_loop=in_loop,
                             group_size=2, axes=axes, op_name="")


def test_traffic_prices_each_axis_on_its_link_and_exposes_what_compute_cannot_hide():
  net = links.interconnect("v5p")
  found = [
      _collective("collective-permute", 1_000_000, 10, ("stage",), True),
      _collective("all-reduce", 4_000_000, 1, ("data",), False),
      _collective("all-gather", 2_000_000, 20, ("fsdp",), True),
      _collective("all-reduce", 4, 1, (), False),  # One-device groups: no link.
  ]
  axis_links = {"stage": "dcn", "data": "ici", "fsdp": "ici", "tensor": "ici"}
  rows = {row.axes: row for row in links.traffic(found, axis_links, net, compute_seconds=1e-3,
                                                 stage_exposed=1e-3)}
  assert set(rows) == {("stage",), ("data",), ("fsdp",)}
  stage, data, fsdp = rows[("stage",)], rows[("data",)], rows[("fsdp",)]
  assert (stage.link, stage.bytes_per_step, stage.transfers) == ("dcn", 10_000_000, 10)
  assert stage.seconds == pytest.approx(10 * 10e-6 + 1e7 / (50e9 / 8))
  assert stage.exposed_seconds == pytest.approx(1e-3)  # The simulation's figure.
  # Outside the loop: exposed whole.
  assert data.exposed_seconds == data.seconds == pytest.approx(1e-6 + 4e6 / 200e9)
  # Inside the loop, beside 1 ms of compute: what exceeds it.
  assert fsdp.seconds == pytest.approx(20 * 1e-6 + 4e7 / net.ici.bytes_per_second)
  assert fsdp.exposed_seconds == pytest.approx(max(0.0, fsdp.seconds - 1e-3))


def test_stage_transfer_seconds_per_link():
  net = links.interconnect("v5p")
  found = [_collective("collective-permute", 2_000, 8, ("stage",), True),
           _collective("collective-permute", 1_000, 8, ("stage",), True)]
  seconds = links.stage_transfer_seconds(found, (False, True, False, True), net)
  assert np.allclose(seconds, [net.ici.seconds(2_000), net.dcn.seconds(2_000)] * 2)
  assert not links.stage_transfer_seconds([], (True, True), net).any()
