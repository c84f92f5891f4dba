"""Tests for tpipe.train.cli.report: its figures are those of the real train step's compile."""

import json
import os

import flax.linen as nn
import jax
import numpy as np
import jax.numpy as jnp
import pytest

import tpipe
from configs import lm
from configs import transformer_gpipe
from tests.helpers import blocks
from tests.helpers import numerics
from tests.helpers import train_runs
from tpipe.core.layout import accounting
from tpipe.core.layout import description as layout_lib
from tpipe.core.layout import pack as layout_pack
from tpipe.core.layout import staging
from tpipe.experimental import links
from tpipe.tools import analysis
from tpipe.tools import stage_costs
from tpipe.train.cli import communication
from tpipe.train.cli import config_costs
from tpipe.train.cli import experiment
from tpipe.train.cli import report as report_program
from tpipe.train.cli import report_text

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tiny_config():
  config = lm.get_config("size=tiny")
  config.num_stages, config.num_data, config.num_microbatches = 4, 2, 4
  return config


def _tiny_3d_config():
  config = lm.get_config("size=tiny")
  config.num_stages, config.num_data = 2, 1
  config.mesh.fsdp, config.mesh.tensor = 2, 2
  return config


def _circular_config():
  """The GPipe config's tiny size on the circular schedule: 2 stages x 2 chunks, bfloat16, with
  dropout (as its full size trains)."""
  config = transformer_gpipe.get_config("size=tiny")
  config.dropout = 0.1
  config.num_layers, config.num_stages, config.num_data = 4, 2, 1
  config.num_microbatches, config.batch_size = 2, 4
  config.schedule, config.num_repeats = "circular", 2
  return config


@pytest.fixture(scope="module")
def tiny_report():
  return config_costs.analyze_config(_tiny_config())


@pytest.fixture(scope="module")
def circular_report():
  return config_costs.analyze_config(_circular_config())


@pytest.fixture(scope="module")
def fused_report():
  config = _tiny_config()
  config.schedule = "1f1b"
  return config_costs.analyze_config(config)


def test_memory_agrees_with_memory_analysis_of_the_real_train_step(tiny_report):
  # An independent compile of the same training step.
  exp = experiment.build(_tiny_config())
  compiled = exp.train_step.lower(
      exp.abstract_state(), exp.abstract_batch(), jax.random.key(0)).compile()
  stats = compiled.memory_analysis()
  mem = tiny_report.to_json()["memory_bytes_per_device"]
  assert mem["arguments"] == stats.argument_size_in_bytes
  assert mem["outputs"] == stats.output_size_in_bytes
  assert mem["temporaries"] == stats.temp_size_in_bytes
  assert mem["aliased"] == stats.alias_size_in_bytes
  assert mem["total"] == (stats.argument_size_in_bytes + stats.output_size_in_bytes
                          - stats.alias_size_in_bytes + stats.temp_size_in_bytes
                          + stats.generated_code_size_in_bytes)
  # The split of the arguments covers them exactly (the rest: step counter and RNG key).
  split = mem["params"] + mem["opt_state"] + mem["batch"]
  assert 0 <= stats.argument_size_in_bytes - split <= 16
  assert mem["gradients"] + mem["activations_and_temporaries"] == mem["temporaries"]


def test_parameter_bytes_follow_the_stage_split(tiny_report):
  config = tiny_report.config
  state = experiment.build(config).abstract_state()
  # Every parameter lives in the staged tree (the blocks per leaf, the rest packed), split
  # evenly over the stages.
  staged = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
  assert set(state.params) == {layout_lib.STACKED, layout_lib.PACKED, layout_lib.SHARED}
  assert tiny_report.params_bytes == staged // config.num_stages
  # Adam keeps two moments per parameter, the shared leaves' at their real entries only
  # (tpipe.train.compact_moments): less than twice the staged parameters.
  adam = state.opt_state[1]
  local = lambda x: int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
  moments = sum(local(x) for x in jax.tree.leaves((adam.mu, adam.nu)))
  assert moments < 2 * tiny_report.params_bytes
  assert moments <= tiny_report.opt_state_bytes <= moments + 16  # And Adam's step count.
  batch = 2 * config.batch_size // config.num_data * config.seq_len * 4  # inputs + targets.
  assert tiny_report.batch_bytes == batch


def test_parameters_split_over_each_mesh_axis(tiny_report):
  rows = {row["axis"]: row for row in tiny_report.state_split}
  assert {a: r["devices"] for a, r in rows.items()} == {"data": 2, "stage": 4}
  # Every staged leaf is split over stage, none over data (replicas hold the whole stage): a
  # device holds a quarter of the parameters.
  total = 4 * tiny_report.params_bytes
  assert rows["stage"] == {"axis": "stage", "devices": 4, "split_bytes": total, "whole_bytes": 0}
  assert rows["data"] == {"axis": "data", "devices": 2, "split_bytes": 0, "whole_bytes": total}
  text = report_text.format_report(tiny_report)
  assert "mesh data=2 x fsdp=1 x stage=4 x expert=1 x tensor=1 (8 devices)" in text
  assert "| stage | 4 | " in text and "(100.0%) | 0 B (0.0%) |" in text


def test_a_dense_report_has_no_moe_rows(tiny_report):
  # The MoE rows (tests/train/test_report_moe.py) only where the blocks have experts.
  text = report_text.format_report(tiny_report)
  assert tiny_report.moe is None and tiny_report.to_json()["moe_memory_bytes_per_device"] is None
  assert "| parameters |" in text and "| optimizer state |" in text
  assert "experts'" not in text and "MoE" not in text


def test_3d_parameters_split_over_fsdp_and_tensor():
  exp = experiment.build(_tiny_3d_config())
  split = analysis.axis_split(exp.abstract_state().params, exp.mesh)
  rows = {row["axis"]: row for row in split}
  assert set(rows) == {"fsdp", "stage", "tensor"}  # data has one device: left out.
  total = rows["stage"]["split_bytes"] + rows["stage"]["whole_bytes"]
  # fsdp splits every block weight and the packed buffers; tensor the annotated matrices only.
  assert 0.9 * total < rows["fsdp"]["split_bytes"] < total
  assert 0 < rows["tensor"]["split_bytes"] < rows["fsdp"]["split_bytes"]


def test_flops_and_collectives(tiny_report):
  out = tiny_report.to_json()
  flops = out["flops_per_device"]
  schedule = tiny_report.schedule
  assert flops["lockstep"] > flops["xla_cost_analysis"]
  bubble = schedule.bubble_fraction
  assert flops["useful"] == pytest.approx(flops["lockstep"] - bubble * flops["in_tick_loops"])
  # Idle ticks skip the stage's layers: most of the tick loops' work sits in that conditional.
  assert flops["gated_in_tick_loops"] > 0.5 * flops["in_tick_loops"]
  assert flops["executed"] == pytest.approx(
      flops["lockstep"] - bubble * flops["gated_in_tick_loops"])
  assert flops["useful"] <= flops["executed"] < flops["lockstep"]
  assert out["schedule"]["bubble_fraction"] == pytest.approx(3 / 7)  # (S-1)/(M+S-1).
  # One stash slot per forward tick (M + S - 1 = 7), M = 4 of them holding micro-batches.
  assert out["schedule"]["stash_slots_per_stage"] == 7
  assert out["schedule"]["stashed_microbatches_per_stage"] == 4
  roles = {(r["kind"], r["role"]): r for r in out["collectives_per_step"]}
  transfers = roles[("collective-permute", "stage-to-stage transfer")]
  # One send per tick in the forward loop and one in the backward loop, and the inputs'
  # conveyor to stage 0 in the forward loop (token inputs: no gradient goes back along it).
  assert transfers["count"] == 3 * schedule.num_ticks
  assert transfers["in_loop"] == transfers["instructions"]
  reductions = roles[("all-reduce", "data-parallel reduction")]
  assert reductions["in_loop"] == 0  # once per step, not per micro-batch.
  text = report_text.format_report(tiny_report)
  assert "peak total" in text and "stage-to-stage transfer" in text
  assert "stash per stage: 7 slots" in text


# The command lines run in this process (train_runs.run_program: the program's flags, main and
# error handling as python -m runs them), from the repository's directory.


def test_bad_config_is_a_clean_error(tmp_path, monkeypatch):
  monkeypatch.chdir(REPO)
  result = train_runs.run_program(
      "tpipe.train.cli.report", "--config=configs/lm.py:size=tiny",
      "--config.num_microbatches=3", f"--out_dir={tmp_path}")
  assert result.returncode == 2
  assert "error: " in result.stderr and "num_microbatches=3" in result.stderr
  assert "Traceback" not in result.stderr


def test_command_line_writes_report_and_timeline(tmp_path, monkeypatch):
  monkeypatch.chdir(REPO)
  result = train_runs.run_program(
      "tpipe.train.cli.report", "--config=configs/transformer_gpipe.py:size=tiny",
      "--config.num_layers=2", "--config.num_stages=2", "--config.num_data=1",
      "--config.num_microbatches=2", f"--out_dir={tmp_path}")
  assert result.returncode == 0, result.stderr[-2000:]
  assert "peak total" in result.stdout
  with open(tmp_path / "report.json") as f:
    numbers = json.load(f)
  assert numbers["config"]["num_stages"] == 2
  assert numbers["config"]["remat"] == "full"  # the GPipe config's setting.
  assert numbers["config"]["remat_granularity"] == "chunk"
  assert "remat=full remat_granularity=chunk," in result.stdout
  # Under remat full GPipe's loss runs its forward ticks and autodiff's backward ticks as one
  # fused table: 2 x (M + S - 1) ticks.
  assert numbers["schedule"]["num_ticks"] == 6 and numbers["schedule"]["name"] == "gpipe"
  assert "peak / floor" in result.stdout
  # One chunk per stage: [embedding, blocks] and [blocks, head].
  assert [[len(c) for c in s["layers"]] for s in numbers["stages"]] == [[2], [2]]
  floor = numbers["memory_floor"]
  assert floor["total"] == floor["state"] + floor["stash"] + floor["working_set"]
  assert floor["peak_over_floor"] >= 1
  with open(tmp_path / "timeline.png", "rb") as f:
    assert f.read(4) == b"\x89PNG"
  assert "python -m tpipe.train.cli.report" in (tmp_path / "report.md").read_text()


# --------------------------------------------------------------------------------------------
# Per stage and the memory floor.


@pytest.mark.parametrize("which", ["tiny_report", "circular_report", "fused_report"])
def test_stage_bytes_add_up_to_the_model_and_padding_follows_the_layout(which, request):
  report = request.getfixturevalue(which)
  layout, stages = report.layout, report.stages
  assert len(stages) == report.config.num_stages
  # Parameter bytes: each stage's own, summing to the model's (float32 parameters).
  logical = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(layout.logical))
  assert sum(s.param_bytes for s in stages) == logical == 4 * report.num_params
  # Each stage's buffers are padded to the fullest stage's: what the compiled step's parameter
  # arguments occupy on a device.
  for s in stages:
    assert s.chunks == tuple(range(s.stage, layout.num_chunks, layout.num_stages))
    assert s.buffer_bytes == accounting.stage_bytes(layout) == report.params_bytes
    chunk_bytes = accounting.chunk_bytes(layout)
    assert s.padding_bytes == s.buffer_bytes - sum(chunk_bytes[c] for c in s.chunks)
    assert s.padding_bytes >= 0
  assert sum(s.padding_bytes for s in stages) == (
      layout.num_stages * accounting.stage_bytes(layout) - sum(accounting.chunk_bytes(layout)))
  if layout.num_repeats == 1:  # A stage is one chunk: the fullest needs no padding.
    assert max(accounting.chunk_bytes(layout)) == accounting.stage_bytes(layout)
  # Adam's two float32 moments per own parameter, and nothing else (no stored decay mask).
  assert [s.optimizer_bytes for s in stages] == [2 * s.param_bytes for s in stages]


@pytest.mark.parametrize("which", ["tiny_report", "circular_report", "fused_report"])
def test_embedding_on_the_first_stage_and_head_on_the_last_only(which, request):
  stages = request.getfixturevalue(which).stages
  head = [s.stage for s in stages if any("LMHead" in name for name in s.layers)]
  embedding = [s.stage for s in stages if any("TokenEmbedding" in name for name in s.layers)]
  assert head == [len(stages) - 1]
  assert embedding == [0]
  assert stages[0].layers[0] == "layers_0 TokenEmbedding"
  assert stages[-1].layers[-1] == "layers_2 LMHead"
  # Every block appears exactly once, named by its copies (both ends included).
  blocks = []
  for s in stages:
    for name in s.layers:
      if name.startswith("layers_1["):
        assert name.endswith(" TransformerBlock")
        first, _, last = name[len("layers_1["):name.index("]")].partition("..")
        blocks += list(range(int(first), int(last or first) + 1))
  assert sorted(blocks) == list(range(request.getfixturevalue(which).config.num_layers))


@pytest.mark.parametrize("which", ["tiny_report", "circular_report"])
def test_memory_floor_parts_add_up_and_stay_below_the_peak(which, request):
  report = request.getfixturevalue(which)
  config, floor = report.config, report.floor
  assert floor.stage == max(report.stages, key=lambda s: s.floor.total).stage
  stage = report.stages[floor.stage]
  assert floor.state_bytes == 2 * stage.param_bytes + stage.optimizer_bytes
  assert floor.stash_bytes == stage.stash_slots * stage.input_bytes
  assert floor.working_set_bytes == stage.working_set_bytes > 0
  assert floor.total == floor.state_bytes + floor.stash_bytes + floor.working_set_bytes > 0
  assert floor.total < report.largest_device_bytes
  assert report.floor_ratio == pytest.approx(report.largest_device_bytes / floor.total)
  assert report.floor_ratio >= 1
  # Differentiated through its tick loop (the tiny LM: remat none) GPipe keeps a stash slot per
  # forward tick; under remat full (circular here) the step runs the forward and backward ticks
  # as one fused table (tpipe.schedules.whole_step): a slot per micro-batch chunk the stage
  # holds, R x M. Past the first stage, a slot holds one device's micro-batch of activations
  # [B / (data * M), seq, width] in the computation dtype.
  table, chunks = report.schedule, config.num_repeats * config.num_microbatches
  assert table.name == config.schedule
  fused = config.remat == "full"
  assert isinstance(table, tpipe.schedules.FusedSchedule) == fused
  assert table.num_ticks == (2 if fused else 1) * (chunks + config.num_stages - 1)
  rows = config.batch_size // (config.num_data * config.num_microbatches)
  activation = rows * config.seq_len * config.width * jnp.dtype(config.dtype).itemsize
  for s in report.stages:
    assert s.stash_slots == (chunks if fused else table.num_ticks)
    if s.stage > 0 or config.num_repeats > 1:
      assert s.input_bytes == activation
  assert report.ring_bytes == activation
  out = report.to_json()
  assert out["memory_floor"]["total"] == floor.total
  assert out["memory_floor"]["peak_over_floor"] == pytest.approx(report.floor_ratio)
  assert [s["param_bytes"] for s in out["stages"]] == [s.param_bytes for s in report.stages]
  text = report_text.format_report(report)
  assert "peak / floor" in text and "layers_2 LMHead" in text


def test_fused_schedule_reports_its_table_in_flight_and_simulated_step(fused_report, tmp_path):
  """1F1B at S = 4, M = 4, nothing typed: compound ticks for costs derived from the measured
  FLOPs; stage s keeps at most S - s stage inputs, not a slot per tick; the simulated step is
  under those costs and below GPipe's on the same layers and costs."""
  report, config = fused_report, fused_report.config
  table = report.schedule
  assert table.name == "1f1b" and table.is_compound and report.tick_costs_derived
  assert table.num_ticks < 2 * (4 + 4 - 1)  # Fewer than the one-action table's ticks.
  costs = dict(report.tick_costs)
  assert costs["F"] == 1 and costs["B"] > costs["F"]
  out = report.to_json()["schedule"]
  assert out["fused"] and out["num_ticks"] == table.num_ticks
  in_flight = out["in_flight_per_stage"]
  assert in_flight == [int(n) for n in table.peak_in_flight()]
  # Compound ticks may keep more than one-action 1F1B's S - s, still bounded by S, not M.
  assert all(n <= 2 * (4 - s) - 1 for s, n in enumerate(in_flight)), in_flight
  assert out["stash_slots_per_stage"] == out["stashed_microbatches_per_stage"] == max(in_flight)
  timing = table.simulate(costs)
  step = out["simulated_step"]
  assert step["costs"] == costs
  assert step["lockstep"] == timing.lockstep >= step["neighbour"] == timing.neighbour
  assert timing.neighbour >= step["natural"] - 1e-9 and step["natural"] == timing.natural
  assert step["neighbour"] < step["gpipe_neighbour"]
  for model in ("lockstep", "neighbour", "natural"):
    assert step[f"{model}_bubble"] == pytest.approx(getattr(timing, f"{model}_bubble"))
  # The floor counts each stage's own in-flight inputs; the tiny GPipe report's 4 slots per stage
  # (M) shrink to what each stage keeps.
  assert [s.stash_slots for s in report.stages] == in_flight
  stage = report.stages[report.floor.stage]
  assert report.floor.stash_bytes == stage.stash_slots * stage.input_bytes
  assert report.floor.total < report.largest_device_bytes
  # The train step is the fused table's one tick loop: two transfers (right, left) per tick.
  flops = report.analysis.pipeline
  assert len(flops.tick_loops) == 1 and flops.bubble_fraction == table.bubble_fraction
  roles = {(r["kind"], r["role"]): r for r in report.collective_rows()}
  assert roles[("collective-permute", "stage-to-stage transfer")]["count"] >= 2 * table.num_ticks
  assert roles[("all-reduce", "data-parallel reduction")]["in_loop"] == 0
  text = report_text.format_report(report)
  assert f"in flight per stage at most [{', '.join(map(str, in_flight))}]" in text
  assert "derived from measured per-unit FLOPs" in text
  assert "GPipe's neighbour-synchronised step on the same layers and costs: " in text
  assert f"lockstep (each tick as long as its slowest stage) {timing.lockstep:g}" in text
  assert (f"neighbour-synchronised (each tick starts when the stage and its neighbours "
          f"finished the last: the tick loop's sends) {timing.neighbour:g}") in text
  assert "one per forward tick" not in text
  # remat='none': F keeps the chunk's VJP residuals in its slot beside the input.
  assert "each slot also keeps the chunk's saved activations" in text
  # The timeline draws the fused table as it is (forward and backward already in it).
  paths = report_program.write_report(report, str(tmp_path))
  with open(paths["timeline"], "rb") as f:
    assert f.read(4) == b"\x89PNG"
  assert config.schedule in (tmp_path / "report.md").read_text()


def test_stage_flops_are_what_the_step_runs_per_tick(tiny_report):
  # Every tick, a device runs its stage's chunk on one micro-batch; XLA counts the costliest
  # branch, so the tick loops' conditionals cost about ticks x the largest stage's FLOPs.
  gated = tiny_report.to_json()["flops_per_device"]["gated_in_tick_loops"]
  largest = max(s.flops for s in tiny_report.stages)
  assert 0.9 < gated / (tiny_report.schedule.num_ticks * largest) < 1.3
  # The head (a 256-way projection and the loss) makes the last stage the dearest.
  flops = [s.flops for s in tiny_report.stages]
  assert flops.index(max(flops)) == len(flops) - 1


def test_compile_forward_backward_keeps_the_backward_pass():
  def fn(params, x, ids):
    return jnp.tanh(x @ params["w"]).sum(axis=-1) + ids.sum()

  args = ({"w": jax.ShapeDtypeStruct((64, 128), jnp.float32)},
          jax.ShapeDtypeStruct((32, 64), jnp.float32), jax.ShapeDtypeStruct((32,), jnp.int32))
  compiled = stage_costs.compile_forward_backward(fn, *args)
  # Outputs: the value [32] and the gradients of the floating arguments only (plus a few bytes
  # of tuple index tables).
  outputs = compiled.memory_analysis().output_size_in_bytes
  assert 0 <= outputs - 4 * (32 + 64 * 128 + 32 * 64) <= 64
  # The backward pass needs tanh's output [32, 128] beyond the inputs and outputs.
  assert stage_costs.working_set_bytes(compiled) >= 4 * 32 * 128
  floor = stage_costs.memory_floor(state_bytes=3, stash_bytes=4, working_set_bytes=5, stage=1)
  assert floor.total == 12 and floor.ratio(24) == 2.0
  with pytest.raises(ValueError, match="stash_bytes"):
    stage_costs.memory_floor(state_bytes=3, stash_bytes=-1, working_set_bytes=5)


def _layers_in_order(params, x):
  """The model of test_chunk_programs_in_order_are_the_model without a pipeline."""
  h = nn.Dense(8).apply({"params": params["layers_0"]}, x)
  h = blocks.apply_in_sequence(blocks.MLPBlock(width=8), params["layers_1"], h)
  return nn.Dense(4).apply({"params": params["layers_2"]}, h)


def test_chunk_programs_in_order_are_the_model():
  # Widths change at every layer and a Repeat is cut between chunks; running each chunk's
  # program on one micro-batch, in chunk order, gives what the layers in order give for it, as
  # the pipelined model does.
  layers = [nn.Dense(8), tpipe.Repeat(blocks.MLPBlock(width=8), 3), nn.Dense(4)]
  model = tpipe.Sequential(layers, num_stages=2, num_microbatches=2, schedule="circular",
                           num_repeats=2, balance=[1, 2, 1, 1], mesh=tpipe.make_mesh(stages=2))
  x = jax.random.normal(jax.random.key(1), (4, 6))
  variables = model.init({"params": jax.random.key(0)}, x, method="initialize")
  layout = model.stage_layout(x)
  staged = staging.to_staged(layout, variables["params"])
  # The Repeat is cut unevenly (2 copies, then 1), so its copies are packed with the rest.
  assert set(staged) == {layout_lib.STACKED, layout_lib.PACKED, layout_lib.SHARED}
  plan = model.plan_for(x)
  assert plan.counts == (1, 2, 1, 1)
  assert stage_costs.group_names(layout, plan.unit_names) == [
      ("layers_0 Dense",), ("layers_1[0..1] MLPBlock",), ("layers_1[2] MLPBlock",),
      ("layers_2 Dense",)]
  h = x[:2]
  for c in range(layout.num_chunks):
    fn, (trees, h_shape, side) = model.chunk_program(layout, c, x)
    assert (h_shape.shape, h_shape.dtype) == (h.shape, h.dtype)
    h = fn(layout_pack.chunk_trees(layout, layout.chunk_local(staged, c), c), h, side)
  plain = jax.jit(_layers_in_order)(variables["params"], x[:2])
  exact = numerics.float64_reference(jax.jit(_layers_in_order), variables["params"], x[:2])
  numerics.assert_as_close_as_plain(h, plain, exact, what="the chunk programs in order")
  numerics.assert_as_close_as_plain(model.apply(variables, x)[:2], plain, exact,
                                    what="the pipelined model")


# --------------------------------------------------------------------------------------------
# Communication priced on its links.


def _two_slice_config(**overrides):
  config = _tiny_config()
  config.mesh.dcn.stage, config.mesh.emulate_slices = 2, True
  for key, value in overrides.items():
    config[key] = value
  return config


@pytest.fixture(scope="module")
def two_slice_reports():
  """The tiny config with its stages over two emulated slices, with the default delay on the
  links between them and without."""
  return (config_costs.analyze_config(_two_slice_config(), per_stage=False),
          config_costs.analyze_config(_two_slice_config(transfer_delay="0"), per_stage=False))


def test_one_slice_prices_every_axis_on_ici(tiny_report):
  comm = tiny_report.communication
  assert set(comm.links.values()) == {"ici"} and comm.crossing == (False,) * 4
  assert {row.link for row in comm.rows} == {"ici"}
  assert comm.step_seconds == pytest.approx(comm.compute_seconds + comm.exposed_seconds)
  assert comm.compute_seconds > 0
  # Inside one slice the ends' moments are compact (config.compact_moments='auto').
  assert tiny_report.moments.startswith("Adam's moments of the ends compact")
  assert tiny_report.moments in report_text.format_report(tiny_report)


def test_stages_over_two_slices_send_over_dcn_and_a_delay_hides_what_a_tick_outlasts(
        two_slice_reports):
  delayed, plain = two_slice_reports
  for rep in (delayed, plain):
    comm = rep.communication
    assert comm.links == {"stage": "dcn", "data": "ici", "fsdp": "ici", "expert": "ici",
                          "tensor": "ici"}
    assert comm.crossing == (False, True, False, True)
    stage = next(row for row in comm.rows if row.axes == ("stage",))
    assert stage.link == "dcn" and 0 < stage.exposed_seconds <= stage.seconds
    assert comm.stage_transfer_seconds[1] > 10 * comm.stage_transfer_seconds[0]
  assert delayed.schedule.delays == delayed.communication.delays == (0, 1, 0, 1)
  assert plain.schedule.delays == plain.communication.delays == (0, 0, 0, 0)
  # The tiny model's tick computes far less than a DCN send takes: the delay hides nothing and
  # its extra ticks add sends. On a chip a million times slower a tick outlasts the send, and
  # the delayed links hide theirs.
  assert delayed.communication.exposed_seconds > plain.communication.exposed_seconds
  slow = links.interconnect("v5p", peak_tflops=459e-6)
  priced = [communication.summarize(rep.mesh, rep.schedule, rep.analysis, slow)
            for rep in (delayed, plain)]
  assert priced[0].compute_seconds > 10 * priced[0].stage_transfer_seconds[1]
  stage_exposed = [next(r for r in p.rows if r.axes == ("stage",)).exposed_seconds
                   for p in priced]
  assert stage_exposed[0] < 0.7 * stage_exposed[1]  # What is left: sends outside the loop.
  out = delayed.to_json()["communication"]
  assert out["stage_link_delays"] == [0, 1, 0, 1]
  assert {row["axes"]: row["link"] for row in out["axes"]}["stage"] == "dcn"
  text = report_text.format_report(delayed)
  assert "Communication priced on v5p links" in text and "stage DCN, data ICI" in text
  # Over DCN the ends' Adam moments stay staged (config.compact_moments='auto'): nothing but
  # the pipeline's own traffic crosses the stage axis, and the report says what 'on' would buy.
  assert not [c for c in delayed.analysis.collectives
              if c.kind == "all-to-all" and c.axes and "stage" in c.axes]
  assert "moments of the ends staged (config.compact_moments='auto', the stage axis spans " \
      "slices)" in text


@pytest.mark.unit  # Raises before anything is built or compiled.
@pytest.mark.parametrize("efficiency", [0, 1.5, True, "half"])
def test_a_bad_efficiency_is_an_error_before_the_compile(efficiency):
  with pytest.raises(ValueError, match=r"efficiency must be in \(0, 1\]"):
    config_costs.analyze_config(_two_slice_config(), efficiency=efficiency)


def test_a_compound_table_reports_its_costs_and_actions_per_tick():
  """ZB-H1 in compound ticks (config.tick_costs): the report simulates the table under the costs
  it was built for and reads the tick loop's lanes (one conditional per lane)."""
  config = _tiny_config()
  config.schedule, config.tick_costs = "zb_h1", "F=1,B=3,BI=2,W=1"
  report = config_costs.analyze_config(config, per_stage=False)
  table = report.schedule
  out = report.to_json()["schedule"]
  assert table.is_compound and out["steps_per_tick"] == table.lanes > 1
  costs = {"F": 1.0, "B": 3.0, "BI": 2.0, "W": 1.0}
  assert out["simulated_step"]["costs"] == costs
  assert out["simulated_step"]["neighbour"] == table.simulate(costs).neighbour
  assert f"compound: up to {table.lanes} actions per stage" in report_text.format_report(report)
  pipeline = report.analysis.pipeline
  assert pipeline is not None and pipeline.useful <= pipeline.executed <= pipeline.lockstep


def test_the_report_predicts_step_time_tokens_per_second_and_mfu(fused_report, tiny_report):
  """The step priced on v5p (the default chip off a topology): a fused table tick by tick, a
  forward one whole with its simulated bubble share; MFU from 6 x parameters x tokens plus
  attention at v5p's 459 TFLOP/s."""
  from tpipe import schedules  # pylint: disable=g-import-not-at-top
  from tpipe.tools import flops as flops_lib  # pylint: disable=g-import-not-at-top
  from tpipe.tools import pipeline_time  # pylint: disable=g-import-not-at-top
  from tpipe.tools import step_time  # pylint: disable=g-import-not-at-top
  from tpipe.train import architecture  # pylint: disable=g-import-not-at-top
  from tpipe.train.cli import throughput  # pylint: disable=g-import-not-at-top

  for report in (fused_report, tiny_report):
    p, config = report.prediction, report.config
    fused = isinstance(report.schedule, schedules.FusedSchedule)
    assert p.chip == "v5p" and p.tick_by_tick == fused
    assert set(p.parts) == {"compute", "memory", "exposed collectives", "bubble"}
    assert sum(p.parts.values()) == pytest.approx(p.seconds, rel=1e-9)
    assert 0 < p.parts["bubble"] < p.seconds
    if not fused:
      assert p.parts["bubble"] == pytest.approx(
          p.seconds * flops_lib.simulated_bubble(report.schedule))
    tokens = config.batch_size * config.seq_len
    model = throughput.lm_step_flops(architecture.lm_arguments(config),
                                     batch=config.batch_size, seq_len=config.seq_len)
    assert (p.tokens, p.model_flops) == (tokens, model)
    assert p.tokens_per_second == pytest.approx(tokens / p.seconds)
    assert p.mfu == pytest.approx(model / report.num_devices / p.seconds / 459e12)
    # The program's own figures are the estimator's on the compiled step.
    whole = step_time.estimate(report.compiled, "v5p", mesh=report.mesh)
    assert (p.step_time.flops, p.step_time.hbm_bytes) == (whole.flops, whole.hbm_bytes)
    # The collective waits: the actions' followed tick by tick, else the program's.
    if fused:
      piped = pipeline_time.pipeline_step_time(report.compiled, report.schedule, "v5p",
                                               mesh=report.mesh,
                                               programs=experiment.build(
                                                   config).pipeline.programs())
      assert p.exposed_by == piped.exposed_by
      # The stage sends and the sums after the loop wait outside the actions: not counted.
      assert set(p.exposed_by) < set(whole.exposed_by)
    else:
      assert p.exposed_by == whole.exposed_by
    assert report.to_json()["prediction"]["mfu"] == p.mfu
    text = report_text.format_report(report)
    assert "### Predicted step time on v5p" in text
    assert f"{p.tokens_per_second:,.0f} tokens/s, MFU {p.mfu:.1%}" in text
    assert "| bubble (stages idle or waiting) |" in text
