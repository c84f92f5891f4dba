"""What a configuration costs per device, from an ahead-of-time compile of its training step:
the library behind ``python -m tpipe.train.cli.report`` (:mod:`tpipe.train.cli.report`, which
documents every figure), the auto-tuner and the multislice comparison.

:func:`analyze_config` builds the experiment (:func:`tpipe.train.cli.experiment.build`), lowers
and compiles its training step for the configured mesh or a TPU topology, never runs it, and
returns a :class:`Report`: memory by kind, FLOPs, collectives, per-stage costs, the memory floor
and the predicted step time (:func:`predict`). :func:`tpipe.train.cli.report_text.format_report`
gives its text.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any


from tpipe.train.cli import schedule_summary
from tpipe.train.cli import startup

DEFAULT_CPU_DEVICES = 8


def setup_cpu_devices(config=None, num_devices: int | None = None) -> int:
  """Emulates CPU devices before JAX starts, as the trainer does; returns the count in effect.

  The count is ``num_devices``, else the devices of ``config``'s mesh, and at least
  :data:`DEFAULT_CPU_DEVICES`. A count the user chose (``JAX_NUM_CPU_DEVICES``, or
  ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS``) is left alone. The setting only
  matters on the CPU platform. Must be called before the first JAX computation.
  """
  import jax  # pylint: disable=g-import-not-at-top

  chosen = startup.user_cpu_device_count()
  if chosen is not None:
    return chosen
  needed = DEFAULT_CPU_DEVICES
  if num_devices is not None:
    needed = max(needed, int(num_devices))
  elif config is not None and "num_stages" in config and "num_data" in config:
    needed = max(needed, startup.num_devices(config))
  jax.config.update("jax_num_cpu_devices", needed)
  return needed


@dataclasses.dataclass(frozen=True)
class Report:
  """The measurements of one configuration's training step.

  Attributes:
    config: the experiment config.
    num_params: trainable parameters of the model.
    num_devices: devices in the mesh.
    schedule: the table the step runs (:attr:`tpipe.PlannedPipeline.loss_table`): a
      :class:`tpipe.schedules.FusedSchedule` (1F1B, ...; or GPipe's and circular's forward and
      backward ticks as one table under remat full) or a forward
      :class:`tpipe.schedules.Schedule` (autodiff through its tick loop gives the backward).
    analysis: the :class:`tpipe.tools.analysis.Analysis` of the compiled step.
    lower_seconds: wall-clock time to trace and lower the step.
    compile_seconds: wall-clock time for XLA to compile it.
    compiled: the :class:`jax.stages.Compiled` step (not run).
    cpu_seconds: this process's CPU time (all threads) to lower and compile: steadier than
      wall-clock time on a shared machine.
    stages: a :class:`tpipe.tools.stage_costs.StageCost` per stage: its layers, parameter
      bytes and padding, optimizer bytes, FLOPs and memory-floor parts.
    layout: the model's :class:`tpipe.core.layout.description.StageLayout` (its split into chunks).
    ring_bytes: one micro-batch in the format that crosses stage boundaries.
    floor_seconds: wall-clock time to measure the stages (per-unit FLOPs and each distinct
      chunk's forward and backward compiled alone).
    peak: the :class:`tpipe.tools.peak.PeakBreakdown` of the compiled step (what is live at
      its memory peak, by role), or None when not asked for.
    topology: the accelerator topology compiled for (``"v5p:2x2x2"``), or None for this
      machine's devices.
    mesh_shape: the mesh's axis sizes, ``{"data": 2, "fsdp": 2, "stage": 2, "tensor": 2}``.
    state_split: per mesh axis, how the parameters split over it
      (:func:`tpipe.tools.analysis.axis_split`).
    communication: the step's collectives priced on their links (ICI, DCN) beside its compute
      (:class:`tpipe.train.cli.communication.Communication`).
    mesh: the mesh the step was compiled for.
    backward: how the step's backward actions run
      (:meth:`tpipe.core.planning.backward_plan.BackwardPlan.describe`).
    tick_costs: the per-action costs the fused table was laid out for (the pipeline's
      ``spec.tick_costs``, pairs), also the costs its step is simulated under; None: one
      action per tick, or a forward schedule (simulated under the default costs).
    tick_costs_derived: whether those costs were derived from measured per-unit FLOPs
      (:mod:`tpipe.schedules.derived_costs`) rather than given.
    moments: whether Adam's moments of the ends are compact, and the memory and the moves over
      ``stage`` at stake (:func:`tpipe.train.compact_moments.describe`); "" where none qualify.
    prediction: the step's predicted time, tokens per second and MFU on the chip priced
      (:class:`Prediction`), or None.
    moe: a mixture-of-experts LM's memory rows (the experts' weights, the dispatch buffers and
      the routing metadata: :class:`tpipe.train.cli.moe_costs.MoeMemory`); None for a dense
      model.
  """

  config: Any
  num_params: int
  num_devices: int
  schedule: Any
  analysis: Any
  lower_seconds: float
  compile_seconds: float
  compiled: Any = dataclasses.field(repr=False, default=None)
  cpu_seconds: float = 0.0
  stages: tuple = ()
  layout: Any = None
  ring_bytes: int = 0
  floor_seconds: float = 0.0
  peak: Any = None
  topology: str | None = None
  mesh_shape: dict = dataclasses.field(default_factory=dict)
  state_split: tuple = ()
  communication: Any = None
  mesh: Any = dataclasses.field(repr=False, default=None)
  tick_costs: Any = None
  tick_costs_derived: bool = False
  backward: str = ""
  moments: str = ""
  prediction: Any = None
  moe: Any = None

  @property
  def floor(self):
    """The step's :class:`tpipe.tools.stage_costs.MemoryFloor`: its largest stage's."""
    from tpipe.tools import stage_costs  # pylint: disable=g-import-not-at-top

    return stage_costs.largest_floor(self.stages)

  @property
  def floor_ratio(self) -> float:
    """The real peak (the largest device's) over the memory floor."""
    return self.floor.ratio(self.largest_device_bytes)

  # Memory rows, bytes per device.
  @property
  def params_bytes(self) -> int:
    return self.analysis.memory.inputs.get("params", 0)

  @property
  def opt_state_bytes(self) -> int:
    return self.analysis.memory.inputs.get("opt_state", 0)

  @property
  def batch_bytes(self) -> int:
    return self.analysis.memory.inputs.get("batch", 0)

  @property
  def gradient_bytes(self) -> int:
    """Gradients match the parameters leaf for leaf; they live in XLA's temporaries."""
    return min(self.params_bytes, self.analysis.memory.temporaries)

  @property
  def activation_bytes(self) -> int:
    """Temporaries other than the gradients: stashed activations and workspace."""
    return self.analysis.memory.temporaries - self.gradient_bytes

  @property
  def total_bytes(self) -> int:
    return self.analysis.memory.total

  @property
  def largest_device_bytes(self) -> int:
    return self.analysis.memory.largest_device_total

  def collective_rows(self) -> list[dict[str, Any]]:
    """One row per (kind, axes): role, instructions, executions and bytes per step."""
    rows = []
    for (kind, mesh_axes), row in self.analysis.collective_summary().items():
      axes = tuple(mesh_axes or ())
      if kind == "collective-permute" and axes == ("stage",):
        role = "stage-to-stage transfer"
      elif "data" in axes and "stage" not in axes and kind in ("all-reduce", "reduce-scatter"):
        role = "data-parallel reduction"
      elif axes == ("stage",):
        role = "across stages"
      elif axes == ("expert",):  # The experts' tokens, and sums over the data it carries.
        role = "MoE dispatch, combine and gradient sums"
      elif mesh_axes == ():  # groups span no mesh axis: every group is one device.
        role = "no-op (1-device groups)"
      else:
        role = "other"
      rows.append({"kind": kind, "axes": ",".join(axes) or "-", "role": role, **row})
    return rows

  def to_json(self) -> dict[str, Any]:
    """The report's numbers as a JSON-serialisable dict."""
    mem, flops, pipe = self.analysis.memory, self.analysis.flops, self.analysis.pipeline
    return {
        "config": {k: self.config[k] for k in (
            "num_layers", "width", "num_stages", "num_data", "num_microbatches", "schedule",
            "num_repeats", "remat", "remat_granularity", "batch_size", "seq_len", "dtype")
            if k in self.config},
        "num_params": self.num_params,
        "num_devices": self.num_devices,
        "memory_bytes_per_device": {
            "params": self.params_bytes, "opt_state": self.opt_state_bytes,
            "batch": self.batch_bytes, "gradients": self.gradient_bytes,
            "activations_and_temporaries": self.activation_bytes,
            "arguments": mem.arguments, "outputs": mem.outputs, "aliased": mem.aliased,
            "temporaries": mem.temporaries, "generated_code": mem.generated_code,
            "total": self.total_bytes, "largest_device": self.largest_device_bytes,
        },
        "flops_per_device": {
            "xla_cost_analysis": flops.xla, "lockstep": flops.executed,
            "executed": pipe.executed if pipe else flops.executed,
            "useful": pipe.useful if pipe else flops.executed,
            "in_tick_loops": pipe.in_tick_loops if pipe else 0.0,
            "gated_in_tick_loops": pipe.gated if pipe else 0.0,
            "transcendentals": flops.transcendentals,
        },
        "schedule": schedule_summary.schedule_json(self.schedule, self.costs),
        "collectives_per_step": self.collective_rows(),
        "stages": [stage.to_json() for stage in self.stages],
        "ring_bytes_per_microbatch": self.ring_bytes,
        "memory_floor": self.floor.to_json(self.largest_device_bytes) if self.stages else None,
        "lower_seconds": self.lower_seconds,
        "compile_seconds": self.compile_seconds,
        "compile_cpu_seconds": self.cpu_seconds,
        "topology": self.topology,
        "mesh": dict(self.mesh_shape),
        "parameters_split_per_axis": list(self.state_split),
        "live_at_peak_bytes_by_role": self.peak.by_role() if self.peak else None,
        "communication": self.communication.to_json() if self.communication else None,
        "end_moments": self.moments,
        "prediction": self.prediction.to_json() if self.prediction else None,
        "moe_memory_bytes_per_device": self.moe.to_json() if self.moe else None,
    }

  @property
  def costs(self) -> dict[str, float] | None:
    """:attr:`tick_costs` as a dict (None without)."""
    return None if self.tick_costs is None else dict(self.tick_costs)


@dataclasses.dataclass(frozen=True)
class Prediction:
  """The step's predicted time on a chip (:func:`predict`), and where it goes.

  Attributes:
    chip: the chip priced (:data:`tpipe.tools.step_time.CHIPS`).
    seconds: the predicted step time.
    parts: seconds by where they go: ``compute`` (compute-bound instructions), ``memory``
      (memory-bound ones), ``exposed collectives``, ``bubble`` (stages idle or waiting for a
      neighbour); they add up to ``seconds``.
    recompute: the seconds of compute and memory spent rematerialising (a part of them).
    tick_by_tick: whether the table was followed tick by tick with each action's price
      (:func:`tpipe.tools.pipeline_time.pipeline_step_time`, fused tables); else the program's
      own time, its bubble the table's simulated share of it.
    tokens: tokens per step (None: not a language model).
    model_flops: the model's FLOPs per step, all devices (6 x active parameters x tokens plus
      attention: :func:`tpipe.train.cli.throughput.lm_step_flops`; a mixture's active
      parameters count k of its E experts and the router); None where unknown.
    num_devices: devices the step runs on.
    peak_flops: one chip's peak FLOP/s.
    step_time: the :class:`tpipe.tools.step_time.StepTime` of the program.
    exposed_by: the collective waits per step by ``(kind, mesh axes)``: the actions' followed
      tick by tick (:attr:`tpipe.tools.pipeline_time.PipelineTime.exposed_by`), else the
      program's (:attr:`tpipe.tools.step_time.StepTime.exposed_by`).
  """

  chip: str
  seconds: float
  parts: dict
  recompute: float
  tick_by_tick: bool
  tokens: int | None
  model_flops: float | None
  num_devices: int
  peak_flops: float
  step_time: Any = dataclasses.field(repr=False, default=None)
  exposed_by: dict = dataclasses.field(default_factory=dict)

  @property
  def tokens_per_second(self) -> float | None:
    return self.tokens / self.seconds if self.tokens and self.seconds else None

  @property
  def mfu(self) -> float | None:
    """Model FLOPs per device per second over the chip's peak."""
    if not self.model_flops or not self.seconds:
      return None
    return self.model_flops / self.num_devices / self.seconds / self.peak_flops

  def to_json(self) -> dict[str, Any]:
    return {"chip": self.chip, "seconds": self.seconds, "parts_seconds": dict(self.parts),
            "recompute_seconds": self.recompute, "tick_by_tick": self.tick_by_tick,
            "tokens": self.tokens, "tokens_per_second": self.tokens_per_second,
            "model_flops": self.model_flops, "mfu": self.mfu,
            "executed_flops_per_device": self.step_time.flops if self.step_time else None,
            "hbm_bytes_per_device": self.step_time.hbm_bytes if self.step_time else None}


def priced_chip(net):
  """The :class:`tpipe.tools.step_time.Chip` of interconnect ``net`` (its chip's HBM bandwidth,
  its peak and links as the network flags set them)."""
  from tpipe.tools import step_time  # pylint: disable=g-import-not-at-top

  return dataclasses.replace(step_time.chip(net.name), flops_per_second=net.flops_per_second,
                             ici=net.ici, dcn=net.dcn)


def predict(compiled, exp, schedule, chip) -> Prediction:
  """Prices ``exp``'s compiled step on ``chip`` (:mod:`tpipe.tools.step_time`).

  A fused table is followed tick by tick with each action's branch priced, so the bubble is its
  neighbour-synchronised one; a forward table (autodiff's backward) is priced as one program,
  its bubble the table's simulated share (:func:`tpipe.tools.flops.simulated_bubble`). The
  other parts split the rest in the program's proportions of compute, memory and exposed
  collectives.
  """
  from tpipe import schedules  # pylint: disable=g-import-not-at-top
  from tpipe.tools import flops as flops_lib  # pylint: disable=g-import-not-at-top
  from tpipe.tools import pipeline_time  # pylint: disable=g-import-not-at-top
  from tpipe.tools import step_time  # pylint: disable=g-import-not-at-top
  from tpipe.train.cli import throughput  # pylint: disable=g-import-not-at-top

  chip = step_time.chip(chip)
  module = step_time.with_trip_counts(compiled.as_text())
  whole = step_time.estimate(module, chip, mesh=exp.mesh)
  seconds, bubble, tick_by_tick, exposed_by = whole.seconds, 0.0, False, whole.exposed_by
  # Every fused table, one stage's too: the program prices each lane's conditional at its
  # slowest branch on every tick (F's tick then also pays for B's branch); the table runs one.
  if isinstance(schedule, schedules.FusedSchedule):
    try:
      piped = pipeline_time.pipeline_step_time(
          module, schedule, chip, mesh=exp.mesh, programs=exp.pipeline.programs(),
          overlap=exp.pipeline.spec.overlap_microbatches)
      seconds, bubble, tick_by_tick = piped.seconds, max(0.0, piped.bubble), True
      exposed_by = piped.exposed_by
    except ValueError:  # No tick loop matching the table (XLA rewrote it): priced whole.
      pass
  if not tick_by_tick and getattr(schedule, "num_stages", 1) > 1:
    bubble = seconds * flops_lib.simulated_bubble(schedule)
  share = (seconds - bubble) / whole.seconds if whole.seconds else 0.0
  parts = {part: value * share for part, value in whole.breakdown().items()}
  parts["bubble"] = bubble
  tokens, model_flops = throughput.step_counts(exp.config, exp.task.name)
  return Prediction(chip=chip.name, seconds=seconds, parts=parts,
                    recompute=whole.recompute_seconds * share, tick_by_tick=tick_by_tick,
                    tokens=tokens, model_flops=model_flops,
                    num_devices=int(exp.mesh.devices.size), peak_flops=chip.flops_per_second,
                    step_time=whole, exposed_by=dict(exposed_by))


def compile_train_step(exp, breakdown: bool = False):
  """AOT-compiles an experiment's train step for its abstract state and batch (never runs it).

  Args:
    exp: the experiment.
    breakdown: also read what is live at the peak from XLA's buffer assignment (compiles with
      its dump options into a temporary directory).

  Returns:
    ``(compiled, abstract_state, abstract_batch, lower_seconds, compile_seconds,
    cpu_seconds, peak)``: wall-clock times, the process CPU time of both together, and the
    :class:`tpipe.tools.peak.PeakBreakdown` (None without ``breakdown``).
  """
  from tpipe.tools import peak as peak_lib  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top

  state, batch = exp.abstract_state(), exp.abstract_batch()
  cpu_start = time.process_time()
  start = time.perf_counter()
  lowered = exp.train_step.lower(state, batch, jax.random.key(0))
  lowered_at = time.perf_counter()
  if breakdown:
    compiled, peak = peak_lib.breakdown_of_lowered(lowered)
  else:
    compiled, peak = lowered.compile(), None
  done = time.perf_counter()
  cpu = time.process_time() - cpu_start
  return compiled, state, batch, lowered_at - start, done - lowered_at, cpu, peak


def measure_stages(exp, schedule, unit_flops=None):
  """Per stage of ``exp``'s model: layers, bytes, FLOPs and memory-floor parts.

  FLOPs come from the per-unit costs a ``balance="flops"`` plan computes (each layer's forward and
  backward on one device's micro-batch), summed over the stage's split, whatever balance the
  experiment uses. The working set of each distinct chunk is its forward and backward compiled
  alone on one micro-batch, with dropout as in training.

  Args:
    exp: a :class:`tpipe.train.cli.experiment.Experiment`.
    schedule: the schedule its step runs.
    unit_flops: the per-unit FLOPs if already measured (``Plan.costs`` of a ``balance="flops"``
      plan for one device's micro-batch); measured here when None.

  Returns:
    ``(stages, ring_bytes)``: a :class:`tpipe.tools.stage_costs.StageCost` per stage, and the
    bytes of one micro-batch in the packed boundary format.
  """
  import jax  # pylint: disable=g-import-not-at-top

  from tpipe.tools import stage_costs  # pylint: disable=g-import-not-at-top

  config, layout, task = exp.config, exp.layout, exp.task
  # One data replica's batch: its micro-batches are what one device runs.
  replica = config.batch_size // config.num_data
  x, kwargs = task.model_inputs(jax.tree.map(
      lambda s: jax.ShapeDtypeStruct((replica,) + s.shape[1:], s.dtype),
      task.batch_shapes(config)))
  # As the train step runs it: dropout on, BatchNorm in training mode.
  kwargs = {**kwargs, **task.train_keywords}
  pipeline = exp.pipeline.rebuild(x, kwargs, rng_names=("dropout",))
  if unit_flops is None:
    unit_flops = pipeline.costs("flops", x, kwargs, rng_names=("dropout",))
  inputs, working_sets, compiled = [], [], {}
  for c, groups in enumerate(layout.groups):
    fn, args = pipeline.chunk_program(c, x, kwargs, rng_names=("dropout",))
    inputs.append(args[1])
    # Chunks with the same layers (e.g. the middle ones) have the same working set.
    key = tuple((g.layer, g.size) for g in groups)
    if key not in compiled:
      compiled[key] = stage_costs.working_set_bytes(
          stage_costs.compile_forward_backward(fn, *args))
    working_sets.append(compiled[key])
  stages = stage_costs.stage_costs(
      layout, schedule, unit_names=pipeline.plan.unit_names, unit_flops=unit_flops,
      chunk_inputs=inputs, chunk_working_sets=working_sets,
      opt_state=exp.abstract_state().opt_state)
  return tuple(stages), stage_costs.ring_bytes(inputs)


def analyze_config(config, unit_flops=None, per_stage: bool = True, *,
                   topology: str | None = None, breakdown: bool = False, network=None,
                   efficiency: float = 0.5) -> Report:
  """Builds the experiment for ``config``, compiles its train step and measures it.

  Args:
    config: an experiment config (``configs/lm.py``); validated by the experiment builder.
    unit_flops: per-unit FLOPs already measured (see :func:`measure_stages`), or None.
    per_stage: also measure every stage and the memory floor (:func:`measure_stages`: per-unit
      FLOPs and each distinct chunk compiled alone); without it ``stages`` is empty, as the
      auto-tuner, which needs only the step's own figures, asks. Not with ``topology``
      (the chunks would compile for it too; the step's own figures are what the target says).
    topology: compile for this accelerator topology (``"v5p:2x2x2"``,
      :func:`tpipe.mesh.topology_devices`) instead of this machine's devices. Its compiler
      prints no loop trip counts, so the report then has no pipeline FLOPs (useful against
      bubble) and counts each loop's FLOPs once; the predicted step time reads the trip counts
      off the loops' counters (:mod:`tpipe.tools.trip_counts`) and counts them all.
    breakdown: break the peak down by role (:mod:`tpipe.tools.peak`).
    network: the :class:`tpipe.experimental.links.Interconnect` to price communication with; default
      the topology's chip, else v5p's.
    efficiency: the share of the chip's peak FLOP/s the compute is taken to reach.

  Returns:
    A :class:`Report`.
  """
  import tpipe  # pylint: disable=g-import-not-at-top

  from tpipe.experimental import links  # pylint: disable=g-import-not-at-top
  from tpipe.tools import analysis  # pylint: disable=g-import-not-at-top
  from tpipe.train import compact_moments  # pylint: disable=g-import-not-at-top
  from tpipe.train.cli import communication  # pylint: disable=g-import-not-at-top
  from tpipe.train.cli import experiment  # pylint: disable=g-import-not-at-top
  from tpipe.train.cli import moe_costs  # pylint: disable=g-import-not-at-top

  communication.check_efficiency(efficiency)  # Before the compile, not after.
  num_slices = 1
  for count in startup.mesh_dcn(config).values():
    num_slices *= count
  devices = tpipe.topology_devices(topology, num_slices=num_slices) if topology else None
  per_stage = per_stage and topology is None
  exp = experiment.build(config, devices=devices)
  compiled, state, batch, lower_s, compile_s, cpu_s, peak = compile_train_step(exp, breakdown)
  schedule = exp.pipeline.loss_table  # Forward or fused: what the step runs.
  # The TPU compiler prints no trip counts, so there the tick loop's useful FLOPs cannot be
  # told from the bubble's: a topology report has no pipeline FLOPs (the memory is complete).
  result = analysis.analyze(
      compiled, mesh=exp.mesh, schedule=None if topology else schedule,
      programs=exp.pipeline.programs(),
      inputs={"params": state.params, "opt_state": state.opt_state, "batch": batch})
  start = time.perf_counter()
  stages, ring = measure_stages(exp, schedule, unit_flops) if per_stage else ((), 0)
  floor_s = time.perf_counter() - start
  net = network or links.interconnect(topology or "v5p")
  comm = communication.summarize(exp.mesh, schedule, result, net, efficiency=efficiency,
                                 stage_axis=exp.pipeline.spec.stage_axis)
  prediction = predict(compiled, exp, schedule, priced_chip(net))
  return Report(config=config, num_params=exp.num_params(),
                num_devices=int(exp.mesh.devices.size), schedule=schedule, analysis=result,
                lower_seconds=lower_s, compile_seconds=compile_s, compiled=compiled,
                cpu_seconds=cpu_s, stages=stages, layout=exp.layout, ring_bytes=ring,
                floor_seconds=floor_s, peak=peak, topology=topology,
                mesh_shape=dict(exp.mesh.shape),
                state_split=analysis.axis_split(state.params, exp.mesh), communication=comm,
                mesh=exp.mesh, tick_costs=exp.pipeline.spec.given_tick_costs,
                tick_costs_derived=exp.pipeline.plan.tick_costs is not None,
                backward=exp.pipeline.backward_plan.describe(),
                moments=compact_moments.describe(config.get("compact_moments", "auto"),
                                                 exp.layout, exp.mesh,
                                                 exp.pipeline.spec.stage_axis),
                prediction=prediction,
                moe=moe_costs.moe_memory(config, exp.layout, state, exp.pipeline.spec, exp.mesh))
