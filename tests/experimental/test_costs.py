"""tpipe.experimental: hand-written costs and the compound layouts' knobs
(tpipe.experimental.costs), and the stable layers never import the experimental package (it
imports them)."""

import os
import subprocess
import sys

import pytest

from tpipe.experimental import costs
from tpipe.schedules import compound

COSTS = {"F": 1.0, "BI": 2.0, "W": 1.0}


@pytest.mark.unit
def test_parse_reads_hand_written_costs_and_names_the_fix():
  assert costs.parse("F=1, B=3, BI=2, W=1") == {"F": 1.0, "B": 3.0, "BI": 2.0, "W": 1.0}
  with pytest.raises(ValueError, match="write per-action costs as 'F=1,B=3,BI=2,W=1'"):
    costs.parse("F=1,B=x")
  with pytest.raises(ValueError, match=r"costs\['B'\] must be finite and > 0"):
    costs.parse("F=1,B=-3")
  with pytest.raises(ValueError, match="unknown action 'X'"):
    costs.parse("F=1,X=2")
  with pytest.raises(TypeError, match="must be written as"):
    costs.parse({"F": 1})


@pytest.mark.unit
def test_layout_packs_with_explicit_knobs_and_settle_never_lengthens_the_step():
  held = costs.layout("zb_h1", 4, 8, COSTS, weight_hold=0)
  assert held.actions() == compound.pack("zb_h1", 4, 8, 1, COSTS, weight_hold=0).actions()
  assert costs.layout("zbv", 4, 8, COSTS).num_chunks == 2
  settled = costs.settle(held, COSTS, 8)
  assert settled.simulate(COSTS).neighbour <= held.simulate(COSTS).neighbour + 1e-9
  with pytest.raises(ValueError, match="weight_hold must be None or an int >= 0"):
    costs.layout("1f1b", 4, 8, {"F": 1, "B": 3}, weight_hold=0)


@pytest.mark.unit
def test_the_stable_layers_do_not_import_the_experimental_package():
  code = ("import sys, tpipe, tpipe.schedules, tpipe.core.engine, tpipe.spec, tpipe.linen, "
          "tpipe.nnx; print(sorted(m for m in sys.modules if m.startswith('tpipe.experimental')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.stdout.strip() == "[]", out.stderr
