r"""What a configuration costs per device, from an ahead-of-time compile of its training step.

Usage::

  python -m tpipe.train.cli.report --config=configs/lm.py --config.num_stages=8 \
      --config.num_data=1 --config.num_microbatches=32
  python -m tpipe.train.cli.report --config=configs/lm.py:size=tiny --out_dir=/tmp/report

The training step of the experiment (:func:`tpipe.train.cli.experiment.build`) is lowered and
compiled for the configured mesh (emulated CPU devices on a CPU-only machine, the real devices on
a TPU VM) and never run. The printed table gives, per device:

* memory: parameters, optimizer state and batch (the step's arguments, split by their
  shardings), gradients (the size of the parameters, part of XLA's temporaries), activations and
  other temporaries (the rest of the temporaries), the peak total and the largest device;
* FLOPs: executed per step (every loop body counted as many times as it runs), useful (minus the
  bubble slots' share of the tick loops) and the schedule's analytic bubble fraction;
* collectives per step by kind and mesh axes: stage-to-stage transfers (collective-permute over
  ``stage``) and data-parallel reductions (all-reduce over ``data``);
* per stage: the layers it holds (``layers_1[0..5] TransformerBlock``), its parameter bytes and
  the padding of its parameter slots, its optimizer state, its forward-and-backward
  FLOPs on one micro-batch (the per-unit costs of ``balance="flops"``), its input on one
  micro-batch and the working set of its chunks compiled alone;
* the **memory floor**: (parameters + optimizer state + gradients) of the largest stage + the
  schedule's in-flight stage inputs + the working set of one chunk on one micro-batch, and the
  real peak over it (:mod:`tpipe.tools.stage_costs`);
* the **predicted step time** on the topology's chip (v5p off a topology), tokens per second and
  MFU, and where the time goes: compute, memory, exposed collectives, bubble, recompute
  (:func:`tpipe.train.cli.config_costs.predict`, :mod:`tpipe.tools.step_time`).

The report (``report.md``, ``report.json``) and the schedule's timeline (``timeline.png``) are
saved in ``--out_dir`` (a new temporary directory by default, printed at the end). Python users
call :func:`tpipe.train.cli.config_costs.analyze_config`, and
:func:`tpipe.train.cli.report_text.format_report` for the text.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from absl import app
from absl import flags
from ml_collections import config_flags

from tpipe.train.cli import report_text
from tpipe.train.cli import schedule_summary
from tpipe.train.cli import startup

from tpipe.train.cli import config_costs


def write_report(report: config_costs.Report, out_dir: str) -> dict[str, str]:
  """Writes ``report.md``, ``report.json`` and ``timeline.png`` to ``out_dir``; returns paths."""
  from tpipe.tools import timeline  # pylint: disable=g-import-not-at-top

  os.makedirs(out_dir, exist_ok=True)
  paths = {"markdown": os.path.join(out_dir, "report.md"),
           "json": os.path.join(out_dir, "report.json"),
           "timeline": os.path.join(out_dir, "timeline.png")}
  command = " ".join(["python -m tpipe.train.cli.report"] + sys.argv[1:]) if sys.argv else ""
  with open(paths["markdown"], "w") as f:
    f.write(report_text.format_report(report)
            + f"\n\n![timeline](timeline.png)\n\nCommand: `{command}`\n")
  with open(paths["json"], "w") as f:
    json.dump(report.to_json(), f, indent=1, default=str)
  # A fused table holds its backward already; a forward one gets autodiff's, reversed.
  timeline.save_timeline(report.schedule, paths["timeline"],
                         backward=not schedule_summary.is_fused(report.schedule))
  return paths


def define_flags() -> None:
  """Defines the command-line flags (only when run as a program, so imports never clash)."""
  config_flags.DEFINE_config_file(
      "config", None, "Experiment config file, e.g. configs/lm.py:size=tiny.",
      lock_config=False)
  flags.DEFINE_string(
      "topology", None, "Compile for this TPU topology instead of this machine's devices, e.g. "
      "v5p:2x2x2 (needs the TPU compiler: pip install -e '.[tpu]'); nothing runs.")
  flags.DEFINE_string(
      "out_dir", None, "Directory for report.md, report.json and timeline.png (default: a new "
      "temporary directory).")
  startup.define_network_flags()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = flags.FLAGS.config
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/lm.py:size=tiny.")
  if not flags.FLAGS.topology:
    config_costs.setup_cpu_devices(config)
  report = config_costs.analyze_config(
      config, topology=flags.FLAGS.topology, breakdown=True,
      network=startup.network_from_flags(flags.FLAGS.topology), efficiency=flags.FLAGS.efficiency)
  out_dir = flags.FLAGS.out_dir or tempfile.mkdtemp(prefix="tpipe_report_")
  paths = write_report(report, out_dir)
  print(report_text.format_report(report))
  print(f"\nSaved {paths['markdown']}, {paths['json']} and {paths['timeline']}")


if __name__ == "__main__":
  define_flags()
  startup.run(main)
