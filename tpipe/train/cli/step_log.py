"""What the trainer reports about a run: each logged step's record (``metrics.jsonl``,
TensorBoard) and log line with its rates, the loss's terms of a model whose layers sow auxiliary
losses or metrics, and the lines that describe the run's setup and pipeline.

Everything here writes or formats; nothing changes the run.
"""

from __future__ import annotations

import math

from absl import logging
import jax

import tpipe
from tpipe.train import compact_moments
from tpipe.train.cli import metrics as metrics_lib
from tpipe.train.cli import startup
from tpipe.train.cli import throughput


def format_eta(seconds: float) -> str:
  """``H:MM:SS``, or ``?`` for a time not known yet."""
  if not math.isfinite(seconds):
    return "?"
  seconds = int(seconds)
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def format_eval(metrics: dict) -> str:
  """The ``eval_*`` entries of ``metrics`` for a log line."""
  return " | ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k.startswith("eval_"))


def log_step(writer, record: dict, step: int, num_steps: int, timing, is_chief: bool,
             rates: throughput.Rates) -> None:
  """Adds the rates to ``record`` (``timing``: last logged time and step, now, and the seconds
  spent evaluating since), writes it and logs one line with the ETA."""
  t_last, step_last, now, eval_seconds = timing
  if t_last is not None:
    step_seconds = max(now - t_last - eval_seconds, 1e-9) / (step - step_last)
    record["steps_per_sec"] = 1.0 / step_seconds
    record.update(rates.of(step_seconds))
    eta = (num_steps - step) * step_seconds
  else:
    eta = float("nan")  # The first interval includes compilation.
  writer.write(step, record)
  if is_chief:
    parts = [f"step {step}/{num_steps}", f"loss {record['loss']:.4f}"]
    if "eval_loss" in record:
      parts.append(format_eval(record))
    parts.append(f"{record['steps_per_sec']:.2f} steps/s" if "steps_per_sec" in record
                 else "- steps/s")
    if "tokens_per_s" in record:
      parts.append(f"{record['tokens_per_s']:,.0f} tokens/s")
    if "tflops_per_device" in record:
      parts.append(f"{record['tflops_per_device']:.3g} TFLOP/s/device")
    if "mfu" in record:
      parts.append(f"MFU {100 * record['mfu']:.1f}%")
    parts.append(f"ETA {format_eta(eta)}")
    logging.info("%s", " | ".join(parts))


def rates(exp) -> throughput.Rates:
  """The throughput figures of ``exp``'s step: tokens and model FLOPs for the LM, and the
  devices' peak (``config.peak_tflops``, else from the device kind)."""
  config = exp.config
  tokens, step_flops = throughput.step_counts(config, exp.task.name)
  kind = exp.mesh.devices.flat[0].device_kind
  return throughput.Rates(step_flops, tokens, int(exp.mesh.devices.size),
                          throughput.peak_tflops(kind, config.get("peak_tflops", 0.0)))


def log_setup(exp, workdir, ckpt_dir: str, rates: throughput.Rates) -> None:
  """Where the run writes, idle devices, and what the throughput figures are based on."""
  used, available = int(exp.mesh.devices.size), jax.device_count()
  if used < available:
    sizes = startup.mesh_sizes(exp.config)
    logging.warning(
        "The mesh uses %d of the %d devices (num_stages %d x num_data %d x mesh.fsdp %d x "
        "mesh.expert %d x mesh.tensor %d); %d stay idle. Make the product %d to use them all.",
        used, available, exp.config.num_stages, exp.config.num_data, sizes["fsdp"],
        sizes["expert"], sizes["tensor"], available - used, available)
  logging.info("Workdir %s: checkpoints in %s, metrics in %s, TensorBoard events in %s "
               "(tensorboard --logdir=%s).", workdir, ckpt_dir,
               workdir / metrics_lib.METRICS_FILE, metrics_lib.tensorboard_logdir(workdir),
               metrics_lib.tensorboard_logdir(workdir))
  kind = exp.mesh.devices.flat[0].device_kind
  if rates.step_flops:
    peak = (f"peak {rates.peak:g} TFLOP/s per device ({kind})" if rates.peak else
            f"no peak known for device kind {kind!r}, so no MFU (set --config.peak_tflops)")
    logging.info("Model FLOPs per step: %.4g (3 x the forward's matrix multiplies; recompute "
                 "not counted); %s.", rates.step_flops, peak)


def log_pipeline(exp, config) -> None:
  """Logs the run's devices, mesh, pipeline table, backward plan and slices (the chief)."""
  logging.info("%d processes, %d devices (%s); mesh %s; %s parameters.", jax.process_count(),
               jax.device_count(), jax.devices()[0].platform, dict(exp.mesh.shape),
               f"{exp.num_params():,}")
  spec = exp.pipeline.spec
  logging.info("Pipeline: %s.", exp.pipeline.describe_inputs(config.batch_size, exp.mesh))
  logging.info("%s.", exp.pipeline.backward_plan.describe().capitalize())
  slices = int(tpipe.mesh.slice_of_devices(exp.mesh).max()) + 1
  if slices > 1 or any(spec.delays):
    logging.info("%d slices; stage links crossing them %s; transfers delayed per link %s.",
                 slices, tpipe.mesh.crossing_links(exp.mesh, spec.stage_axis), spec.delays)
  moments = compact_moments.describe(config.get("compact_moments", "auto"), exp.layout,
                                     exp.mesh, spec.stage_axis)
  if moments:
    logging.info("%s.", moments)


def logs_at(step: int, config) -> bool:
  """Whether ``step`` is logged on schedule (every ``log_every``, ``eval_every`` and
  ``checkpoint_every`` steps, and the last; a preemption's save logs too, unscheduled)."""
  return (step == config.num_steps
          or any(step % config[name] == 0
                 for name in ("log_every", "eval_every", "checkpoint_every")))


def loss_terms_record(terms, config) -> dict[str, float]:
  """The training loss's terms on a logged step (:meth:`tpipe.PlannedPipeline.loss_terms`):
  ``task_loss`` (the loss without the auxiliary losses), each auxiliary loss as the loss counts
  it (``aux_loss/...``: summed over the blocks), each auxiliary metric as the mean over the
  blocks (``aux_metric/...``: every block of the trainer's MoE models sows it)."""
  host = jax.device_get(terms)
  record = {"task_loss": float(host["loss"])}
  for name, value in host.items():
    if name.startswith("aux_loss/"):
      record[name] = float(value)
    elif name.startswith("aux_metric/"):
      record[name] = float(value) / config.num_layers
  return record


def log_initial_eval(exp, state, eval_set, is_chief: bool) -> None:
  """Evaluates the initial state, a baseline for the eval curve (logged only: the metrics
  records are of training steps)."""
  initial = exp.evaluate(state, eval_set)
  if is_chief:
    logging.info("step 0/%d | %s at initialisation", exp.config.num_steps,
                 format_eval(initial))
