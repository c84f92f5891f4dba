"""Tests for tpipe.train.cli.autotune: a tight budget forces more stages or remat; the choice
fits."""

import dataclasses
import re

import pytest

from configs import lm
from tpipe import schedules
from tpipe.tools import flops as flops_lib
from tpipe.train.cli import autotune
from tpipe.train.cli import config_costs
from tpipe.train.cli import multislice
from tpipe.train.cli import search_space


def _config():
  config = lm.get_config("size=tiny")
  config.num_layers, config.batch_size, config.num_microbatches = 2, 8, 2
  config.num_stages, config.num_data = 1, 2
  return config


@pytest.mark.unit  # No JAX computation.
def test_search_space_and_invalid_points():
  config = _config()
  valid, invalid = autotune.candidates(config, 8, microbatches=[2, 3], remats=["full", "none"],
                                       schedules=["gpipe"])
  # 2 layers: 1 or 2 stages; 8 devices -> data 8 or 4; batch 8 -> per replica 1 or 2.
  assert {(c.num_stages, c.num_data) for c in valid} == {(2, 4)}
  # Cheapest FLOPs first; granularities (same FLOPs) only where something is recomputed.
  assert [(c.remat, c.remat_granularity) for c in valid] == [
      ("none", "chunk"), ("full", "chunk"), ("full", "layer")]
  reasons = " | ".join(r for _, r in invalid)
  assert "num_layers=2 is not divisible by stages*repeats=4" in reasons
  assert "per-replica batch 1 is not divisible by 2 micro-batches" in reasons
  assert "not divisible by 3 micro-batches" in reasons
  with pytest.raises(ValueError, match="remat"):
    autotune.candidates(config, 8, remats=["everything"])
  valid, _ = autotune.candidates(config, 8, microbatches=[2], remats=["dots"],
                                 granularities=[2, "chunk"], schedules=["gpipe"])
  assert [c.remat_granularity for c in valid] == [2, "chunk"]
  assert "--config.remat_granularity=2" in valid[0].overrides()
  assert autotune._apply(config, valid[0]).remat_granularity == "2"  # the field is a string.
  # A base config's compound-tick costs go to fused candidates, not to forward ones.
  config.tick_costs = "F=1,B=3"
  assert autotune._apply(config, valid[0]).tick_costs == ""
  fused = autotune.Candidate(2, 4, 2, "full", schedule="1f1b")
  assert autotune._apply(config, fused).tick_costs == "F=1,B=3"
  config.tick_search = 1  # Nor a search over them.
  assert autotune._apply(config, valid[0]).tick_search == 0
  assert autotune._apply(config, fused).tick_search == 1
  with pytest.raises(ValueError, match="Unknown remat_granularity 'stage'"):
    autotune.candidates(config, 8, granularities=["chunk", "stage"])
  with pytest.raises(ValueError, match="remat_granularity must be >= 1"):
    autotune.candidates(config, 8, granularities=[0])


@pytest.mark.unit  # No JAX computation.
def test_a_granularity_that_fits_ends_its_group(monkeypatch):
  """Within (stages, micro-batches): the first (remat, granularity) that fits wins the group;
  the rest are dominated and not compiled. Memory here is made up, to test the search alone."""
  peaks = {("none", "chunk"): 9, ("full", "chunk"): 6, ("full", "layer"): 4, ("full", 2): 3}
  compiled = []

  def fake_measure(config, cand, budget_bytes, chip, topology=None):
    compiled.append((cand.remat, cand.remat_granularity))
    memory = peaks[compiled[-1]]
    return autotune.Trial(cand, memory, 1.0, 1.0, 0, 1.0, 0.0, memory <= budget_bytes)

  monkeypatch.setattr(autotune, "measure", fake_measure)
  result = autotune.autotune(_config(), 5, num_devices=2, stages=[1], microbatches=[2],
                             remats=["none", "full"], granularities=["chunk", "layer", 2],
                             schedules=["gpipe"])
  assert compiled == [("none", "chunk"), ("full", "chunk"), ("full", "layer")]
  assert (result.best.candidate.remat, result.best.candidate.remat_granularity) == (
      "full", "layer")
  assert result.config.remat_granularity == "layer"
  dominated = [c.remat_granularity for c, r in result.rejected if r.startswith("dominated")]
  assert dominated == [2]
  assert "| gpipe | 1 | full | layer | none | no **(chosen)** |" in autotune.format_result(result)


@pytest.mark.unit  # No JAX computation.
def test_the_budget_is_the_chips_hbm_unless_given(monkeypatch):
  chips_seen = []

  def fake_measure(config, cand, budget_bytes, chip, topology=None):
    chips_seen.append(chip)
    return autotune.Trial(cand, 2**30, 1.0, 1.0, 0, 1.0, 0.0, 2**30 <= budget_bytes)

  monkeypatch.setattr(autotune, "measure", fake_measure)
  search = dict(num_devices=2, stages=[1], microbatches=[2], remats=["none"],
                schedules=["gpipe"])
  result = autotune.autotune(_config(), chip="v4", **search)
  assert result.budget_bytes == 32 * 2**30 and result.chip == "v4" and chips_seen == ["v4"]
  assert "step times predicted on v4" in autotune.format_result(result)
  assert autotune.autotune(_config(), **search).budget_bytes == 95 * 2**30  # v5p's.
  assert autotune.autotune(_config(), 2**29, **search).best is None  # Given: 0.5 GiB.
  with pytest.raises(ValueError, match="Unknown chip 'h100'; choose one of .*v5p"):
    autotune.autotune(_config(), chip="h100", **search)  # The report prices TPU links only.
  with pytest.raises(ValueError, match="Unknown chip 'v9'"):
    autotune.autotune(_config(), chip="v9", **search)


@pytest.mark.unit  # No JAX computation.
def test_schedule_is_a_search_dimension_with_the_fused_schedules():
  config = _config()  # num_repeats = 1.
  valid, invalid = autotune.candidates(config, 2, stages=[2], microbatches=[2], remats=["full"])
  names = [c.schedule for c in valid]
  # Every schedule the Sequential runs whose table exists for R = 1, fused ones included.
  assert "gpipe" in names and "1f1b" in names
  assert set(names) | {c.schedule for c, _ in invalid} == set(search_space.schedule_names())
  assert set(schedules.FUSED_SCHEDULE_NAMES) <= set(search_space.schedule_names())
  for cand in valid:  # Each valid one has a table, whose bubble the trials carry.
    table = search_space.schedule_table(cand.schedule, 2, 2, cand.num_repeats)
    assert 0 < flops_lib.simulated_bubble(table) < 1
  # 1F1B's ticks (each as long as the slowest of a stage and its neighbours) lose more than
  # GPipe's; the bubble is the neighbour-synchronised one, no larger than the lockstep one.
  one_f_one_b = search_space.schedule_table("1f1b", 4, 8, 1)
  assert (flops_lib.simulated_bubble(one_f_one_b)
          > flops_lib.simulated_bubble(search_space.schedule_table("gpipe", 4, 8, 1)))
  timing = flops_lib.simulated_timing(one_f_one_b)
  assert flops_lib.simulated_bubble(one_f_one_b) == timing.neighbour_bubble
  assert timing.natural_bubble < timing.neighbour_bubble <= timing.lockstep_bubble
  with pytest.raises(ValueError, match="Unknown schedule 'pipedream'"):
    autotune.candidates(config, 2, schedules=["pipedream"])
  assert "--config.schedule=1f1b" in autotune.Candidate(2, 1, 2, "full", "1f1b").overrides()


@pytest.mark.unit  # No JAX computation.
def test_every_schedule_is_tried_with_the_repeats_it_takes():
  config = _config()
  config.num_layers = 8
  valid, invalid = autotune.candidates(config, 2, stages=[2], microbatches=[2], remats=["none"])
  points = {(c.schedule, c.num_repeats) for c in valid}
  # 4 layers per stage: circular and interleaved 1F1B with 2 and 4 chunks, ZB-V with its 2.
  assert points == {("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("zbv", 2), ("circular", 2),
                    ("circular", 4), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4)}
  assert {c.schedule for c in valid} == set(search_space.schedule_names())
  assert "--config.num_repeats=4" in next(c for c in valid if c.num_repeats == 4).overrides()
  assert autotune._apply(config, autotune.Candidate(2, 1, 2, "none", "zbv", num_repeats=2)
                         ).num_repeats == 2
  # 3 layers per stage: no repeats for ZB-V; the reason says so.
  config.num_layers = 6
  valid, invalid = autotune.candidates(config, 2, stages=[2], microbatches=[2], remats=["none"])
  assert "zbv" not in {c.schedule for c in valid}
  assert any(c.schedule == "zbv" and "stages*repeats=4" in r for c, r in invalid)
  assert {(c.schedule, c.num_repeats) for c in valid if c.schedule == "circular"} == {
      ("circular", 3)}


@pytest.mark.unit  # No JAX computation.
def test_a_split_backward_is_tried_with_what_w_recomputes(monkeypatch):
  """ZB-H1 and ZB-V take weight_recompute none, forward and backward, least FLOPs first with
  remat and its granularity; every other schedule takes none alone. Where only a recomputing W
  fits, the search picks it, and the config and command it gives carry it."""
  config = _config()
  config.num_layers = 4
  config.weight_recompute = "forward"  # The base config's: a whole backward drops it.
  valid, _ = autotune.candidates(config, 2, stages=[2], microbatches=[2],
                                 remats=["none", "full"], schedules=["1f1b", "zbv"])
  settings = lambda name: [(c.remat, c.remat_granularity, c.weight_recompute)
                           for c in valid if c.schedule == name]
  assert settings("1f1b") == [("none", "chunk", "none"), ("full", "chunk", "none"),
                              ("full", "layer", "none")]
  # F + BI + W in forwards: 3, 4, 4, 4, 5, 5, 6, 6, 8.
  assert settings("zbv") == [
      ("none", "chunk", "none"), ("none", "chunk", "forward"), ("none", "chunk", "backward"),
      ("full", "chunk", "none"), ("full", "chunk", "forward"), ("full", "layer", "none"),
      ("full", "chunk", "backward"), ("full", "layer", "forward"),
      ("full", "layer", "backward")]
  flops = [search_space.recompute_flops(*o) for o in settings("zbv")]
  assert flops == sorted(flops) and flops[0] < flops[-1]
  gpipe = autotune._apply(config, autotune.Candidate(2, 1, 2, "full"))
  assert gpipe.weight_recompute == "none"
  zbv = autotune.Candidate(2, 1, 2, "full", "zbv", num_repeats=2, weight_recompute="backward")
  assert autotune._apply(config, zbv).weight_recompute == "backward"
  assert "--config.weight_recompute=backward" in zbv.overrides()
  # W's recomputation costs step time before anything compiles.
  steps = [autotune.analytic_step(config, dataclasses.replace(zbv, weight_recompute=w))
           for w in ("none", "forward", "backward")]
  assert steps[0] < steps[1] < steps[2]
  with pytest.raises(ValueError, match="Unknown weight_recompute 'all'"):
    autotune.candidates(config, 2, weight_recomputes=["all"])
  with pytest.raises(ValueError, match="non-empty list"):
    autotune.candidates(config, 2, weight_recomputes="backward")

  def fake_measure(config, cand, budget_bytes, chip, topology=None):
    memory = 1 if cand.weight_recompute == "backward" else 9  # Only W's rerun fits.
    return autotune.Trial(cand, memory, 1.0, 1.0, 0, 1.0, 0.0, memory <= budget_bytes)

  monkeypatch.setattr(autotune, "measure", fake_measure)
  result = autotune.autotune(config, 5, num_devices=2, stages=[2], microbatches=[2],
                             remats=["full"], granularities=["chunk"], schedules=["zbv"])
  assert [t.candidate.weight_recompute for t in result.trials] == [
      "none", "forward", "backward"]
  assert result.config.weight_recompute == "backward"
  assert "--config.weight_recompute=backward" in autotune.format_result(result)


@pytest.mark.unit  # No JAX computation.
def test_micro_batches_overlap_where_a_stage_spans_several_devices():
  """overlap_microbatches is tried (lanes apart first) with the fused schedules in compound ticks
  where config.mesh spreads a stage's replica over several devices, so there are collectives
  inside a stage for the other micro-batch to hide; nowhere else unless asked."""
  config = _config()
  config.num_layers = 4
  space = lambda **kw: autotune.candidates(config, 2, stages=[2], microbatches=[2],
                                           remats=["none"], **kw)[0]
  overlapped = lambda valid: {c.schedule for c in valid if c.overlap_microbatches}
  assert overlapped(space()) == set()  # stage x data alone: nothing inside a stage to hide.
  config.mesh.expert = 2
  assert overlapped(space()) == {"1f1b", "interleaved_1f1b", "zb_h1", "zbv"}  # Not forward ones.
  valid = space(schedules=["1f1b"])
  assert [c.overlap_microbatches for c in valid] == [False, True]
  assert valid[1].lanes_apart == valid[0] and valid[1].group != valid[0].group
  assert valid[1].overrides() == valid[0].overrides() + " --config.overlap_microbatches=true"
  assert autotune._apply(config, valid[1]).overlap_microbatches is True
  assert autotune._apply(config, valid[0]).overlap_microbatches is False
  assert overlapped(space(overlaps=[False])) == set()
  config.mesh.expert = 1
  every_fused = {"1f1b", "interleaved_1f1b", "zb_h1", "zbv"}
  assert overlapped(space(overlaps=[False, True])) == every_fused
  config.tick_costs = "plain"  # One action per tick: no two micro-batches share a tick.
  assert overlapped(space(overlaps=[True])) == set()
  for bad in (True, "true", [], [1], 5):
    with pytest.raises(ValueError, match="overlaps must be None .* or a non-empty list"):
      space(overlaps=bad)


@pytest.mark.unit  # No JAX computation.
def test_overlapped_micro_batches_compile_beside_lanes_apart_and_the_faster_wins(monkeypatch):
  """The analytic step cannot see the collectives overlap hides: an overlapped candidate is
  compiled once its point with lanes apart fits (here with remat none, so overlapped remat full
  is compiled too when overlapped remat none is over), never where the same setting with lanes
  apart is over budget, and the compiled steps choose. Memory and steps are made up here, to
  test the search."""
  config = _config()
  config.num_layers, config.mesh.expert = 4, 2
  compiled = []

  def fake_measure(config, cand, budget_bytes, chip, topology=None):
    compiled.append(cand)
    memory = (6 if cand.overlap_microbatches else 4) + (cand.remat == "none")
    step = 0.8 if cand.overlap_microbatches else 1.0
    return autotune.Trial(cand, memory, 1.0, 1.0, 0, step, 0.0, memory <= budget_bytes)

  monkeypatch.setattr(autotune, "measure", fake_measure)
  search = dict(num_devices=2, stages=[2], microbatches=[2], remats=["none", "full"],
                granularities=["chunk"], schedules=["1f1b"])
  lines = []
  result = autotune.autotune(config, 6, verbose=True, out=lines.append, **search)
  assert "about 2 compiles" in lines[0]  # The mesh's first fitting trial, and it overlapped.
  settings = [(c.remat, c.overlap_microbatches) for c in compiled]
  assert settings == [("none", False), ("none", True), ("full", True)]
  assert result.best.candidate == compiled[2]
  assert result.config.overlap_microbatches is True
  text = autotune.format_result(result)
  assert "| 1f1b | 1 | full | chunk | none | yes **(chosen)** |" in text
  assert "--config.overlap_microbatches=true" in text.splitlines()[-1]
  compiled.clear()  # Only lanes apart with remat full fits: overlapped remat none, whose
  result = autotune.autotune(config, 4, **search)  # lanes apart is over, is not compiled.
  assert [(c.remat, c.overlap_microbatches) for c in compiled] == [
      ("none", False), ("full", False), ("full", True)]
  assert not result.best.candidate.overlap_microbatches and not result.trials[2].fits
  reasons = [r for c, r in result.rejected if c.overlap_microbatches]
  assert any(r.startswith("pruned: the same setting with lanes apart is over budget")
             for r in reasons), reasons
  assert any("overlap_microbatches=true: pruned" in line
             for line in autotune.format_result(result).splitlines())


@pytest.mark.unit  # No JAX computation.
def test_the_analytic_step_of_a_fused_schedule_is_its_compound_tables():
  """The trainer lays a fused schedule out in compound ticks for its per-action costs; priced by
  the one-action table's neighbour-synchronised step instead, 1F1B looked slower than GPipe and
  was pruned."""
  config = _config()
  config.num_layers, config.batch_size = 8, 64
  step = lambda schedule, m: autotune.analytic_step(
      config, autotune.Candidate(4, 1, m, "full", schedule))
  for m in (4, 8, 16):
    assert step("1f1b", m) <= step("gpipe", m) * (1 + 1e-9), m
  # What the trainer runs: the compound table built for the same costs.
  # ZB-V's compound ticks land a few percent either side of its dependency-driven step.
  for schedule, repeats, within in (("1f1b", 1, 0.02), ("zb_h1", 1, 0.02),
                                    ("interleaved_1f1b", 2, 0.02), ("zbv", 2, 0.05)):
    cand = autotune.Candidate(4, 1, 8, "full", schedule, num_repeats=repeats)
    table = schedules.build(schedule, 4, 8, repeats, costs=search_space.action_costs(config, cand))
    compound = schedules.whole_step(table).simulate(search_space.action_costs(config, cand))
    examples = config.batch_size / 8
    assert autotune.analytic_step(config, cand) == pytest.approx(
        compound.neighbour * examples / (4 * repeats), rel=within), schedule
  config.tick_costs = "plain"  # One action per tick, as the trainer then runs it: slower.
  assert step("1f1b", 8) > 1.2 * step("gpipe", 8)


def _fake_measure(compiled, peaks=None, interrupt_at=None):
  def fake(config, cand, budget_bytes, chip, topology=None):
    if interrupt_at is not None and len(compiled) == interrupt_at:
      raise KeyboardInterrupt
    compiled.append(cand)
    memory = (peaks or {}).get(cand.num_stages, 1)
    step = autotune.analytic_step(config, cand)
    return autotune.Trial(cand, memory, 1.0, 1.0, 0, step, 1.0, memory <= budget_bytes,
                          num_params=1000)
  return fake


@pytest.mark.unit  # No JAX computation.
def test_the_plan_and_progress_are_printed(monkeypatch):
  compiled, lines = [], []
  monkeypatch.setattr(autotune, "measure", _fake_measure(compiled))
  result = autotune.autotune(_config(), 10**9, num_devices=2, microbatches=[2],
                             remats=["none"], verbose=True, out=lines.append)
  valid, invalid = autotune.candidates(_config(), 2, microbatches=[2], remats=["none"])
  assert lines[0].startswith(f"autotune: {len(valid)} candidates ({len(invalid)} invalid")
  assert re.search(r"about \d+ compiles", lines[0]) and "Ctrl-C" in lines[0]
  progress = [line for line in lines[1:] if line.startswith("[")]
  assert len(progress) == len(compiled) >= 1
  assert f"/{len(valid)}]" in progress[0] and "best so far" in progress[-1]
  assert "min left" in progress[0]
  assert not result.interrupted and result.best is not None


@pytest.mark.unit  # No JAX computation.
def test_an_interrupted_search_prints_the_best_so_far_and_its_command(monkeypatch):
  compiled, lines = [], []
  monkeypatch.setattr(autotune, "measure", _fake_measure(compiled, interrupt_at=1))
  monkeypatch.setattr(autotune, "PRUNE_RATIO", 100.0)  # Compile another mesh after the first.
  config = _config()
  config.num_layers = 4
  result = autotune.autotune(config, 10**9, num_devices=4, microbatches=[2], remats=["none"],
                             verbose=True, out=lines.append, config_path="configs/lm.py")
  assert result.interrupted and len(result.trials) == 1
  assert result.best.candidate == compiled[0]
  assert lines[-1].startswith("Interrupted after 1 compiles; best so far")
  assert (f"python -m tpipe.train --config=configs/lm.py {compiled[0].overrides()}"
          in lines[-1])
  assert any(r == "not tried: interrupted" for _, r in result.rejected)
  text = autotune.format_result(result, "configs/lm.py")
  assert "Best so far (interrupted)" in text and "Run it: python -m tpipe.train" in text


@pytest.mark.unit  # No JAX computation.
def test_pruning_rejects_before_compiling_with_reasons(monkeypatch):
  compiled = []
  # A fitting trial prunes slower analytic steps on its mesh, and on others beyond the ratio;
  # a known parameter count prunes what cannot fit.
  monkeypatch.setattr(autotune, "measure", _fake_measure(compiled))
  config = _config()
  config.num_layers = 4
  result = autotune.autotune(config, 10**9, num_devices=4, microbatches=[1, 2, 4],
                             remats=["none", "full"])
  reasons = [r for _, r in result.rejected]
  assert any(r.startswith("pruned: analytic step") for r in reasons)
  assert any("on the same" in r for r in reasons)
  assert len(compiled) < len(autotune.candidates(config, 4, microbatches=[1, 2, 4],
                                                 remats=["none", "full"])[0]) // 4
  memory = autotune.analytic_memory(config, compiled[0], 10**9)
  assert memory >= search_space.STATE_BYTES_PER_PARAM * 10**9 // compiled[0].num_stages
  tight = autotune._Search(config, 10, "v5p", print, num_params=10**6)
  tight.steps = {compiled[0]: 1.0}
  assert tight.skip_reason(compiled[0]).startswith("pruned: analytic memory")


@pytest.mark.unit  # No JAX computation.
def test_the_cli_searches_stages_x_data_and_compiles_for_its_topology(monkeypatch):
  """--num_devices counts every mesh axis; the search places stages x data, each replica
  holding config.mesh's fsdp x tensor devices. --topology reaches every compile and names the
  chip. The analytic memory bound splits over those devices too (a lower bound still)."""
  import types  # pylint: disable=g-import-not-at-top

  seen = {}
  monkeypatch.setattr(autotune, "autotune", lambda config, budget, **kw: seen.update(kw))
  config = _config()
  config.mesh.fsdp, config.mesh.tensor = 2, 2
  f = types.SimpleNamespace(budget_gib=None, chip=None, topology="v5p:2x2x2", stages=None,
                            microbatches=None, remats=["full"], remat_granularities=["chunk"],
                            schedules=None, weight_recomputes=["none", "backward"],
                            overlaps=None)
  autotune._search_from_flags(f, config, 8, "configs/lm.py")
  assert (seen["num_devices"], seen["topology"], seen["chip"]) == (2, "v5p:2x2x2", "v5p")
  assert seen["weight_recomputes"] == ["none", "backward"] and seen["overlaps"] is None
  f.overlaps = ["False", "true"]
  autotune._search_from_flags(f, config, 8, "configs/lm.py")
  assert seen["overlaps"] == [False, True]
  f.overlaps = ["yes"]
  with pytest.raises(autotune.app.UsageError, match="--overlaps takes true and false, got 'yes'"):
    autotune._search_from_flags(f, config, 8, "configs/lm.py")
  f.overlaps = None
  with pytest.raises(autotune.app.UsageError, match="not divisible by .* = 4 devices"):
    autotune._search_from_flags(f, config, 6, "configs/lm.py")
  cand = autotune.Candidate(1, 2, 2, "full")
  plain = _config()
  assert autotune.analytic_memory(config, cand, 10**6) == (
      autotune.analytic_memory(plain, cand, 10**6) // 4)
  asked = []
  monkeypatch.setattr(config_costs, "analyze_config",
                      lambda *a, **kw: asked.append(kw["topology"]) or 1 / 0)
  with pytest.raises(ZeroDivisionError):
    autotune.measure(plain, cand, 2**30, "v5p", topology="v5p:2x2x2")
  assert asked == ["v5p:2x2x2"]


@pytest.mark.unit  # No JAX computation.
def test_a_program_the_tpu_compiler_refuses_for_memory_does_not_fit(monkeypatch):
  """Compiled for a TPU topology, a program beyond HBM fails to compile: that candidate is over
  budget (the search goes on to the next remat); any other runtime error is raised."""
  import jax  # pylint: disable=g-import-not-at-top

  def fake(config, cand, budget_bytes, chip, topology=None):
    if cand.remat == "none":
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, 462G")
    return autotune.Trial(cand, 1, 1.0, 1.0, 0, 1.0, 0.0, True)

  monkeypatch.setattr(autotune, "measure", fake)
  search = dict(num_devices=2, stages=[1], microbatches=[2], remats=["none", "full"],
                granularities=["chunk"], schedules=["gpipe"])
  result = autotune.autotune(_config(), **search)
  assert result.best.candidate.remat == "full"
  assert [r for c, r in result.rejected if c.remat == "none"] == [
      "over budget: the compiler ran out of device memory (RESOURCE_EXHAUSTED: Ran out of "
      "memory on HBM, 462G)"]
  monkeypatch.setattr(autotune, "measure", lambda *a, **kw: (_ for _ in ()).throw(
      jax.errors.JaxRuntimeError("INTERNAL: something else")))
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
    autotune.autotune(_config(), **search)


@pytest.mark.unit  # No JAX computation.
def test_the_step_lasts_the_tables_neighbour_synchronised_time():
  zb = schedules.build("zb_h1", 8, 32)
  measured = lambda costs: flops_lib.PipelineFlops(
      lockstep=1e5, executed=9e4, useful=8e4, in_tick_loops=9e4, gated=8e4, tick_loops=("w",),
      bubble_fraction=zb.bubble_fraction, action_costs=costs, outside_actions=7.0)
  costs = {"F": 100.0, "B": 330.0, "BI": 230.0, "W": 100.0}
  timing = zb.simulate(costs)
  # A fused table: simulated with the program's FLOPs per action, plus the FLOPs outside them;
  # with these costs a stage waits less than for the slowest stage of every tick.
  assert flops_lib.step_flops(zb, measured(costs), 9e4) == timing.neighbour + 7.0
  assert timing.neighbour < 0.9 * timing.lockstep
  # Costs without the actions the table runs, or no tick-loop analysis (a TPU topology's
  # program): the executed FLOPs scaled by neighbour / lockstep under the default costs (equal
  # for these tables: their default-cost ticks hold one kind of action or equal costs).
  default = zb.simulate()
  expected = 9e4 * default.neighbour / default.lockstep
  assert flops_lib.step_flops(zb, measured({"F": 100.0}), 9e4) == pytest.approx(expected)
  assert flops_lib.step_flops(schedules.build("gpipe", 4, 8), None, 9e4) == pytest.approx(9e4)


def test_a_tight_budget_forces_remat_or_stages_and_the_choice_fits():
  config = _config()
  baseline = autotune.measure(config, autotune.Candidate(1, 2, 2, "none"), budget_bytes=2**40)
  budget = baseline.memory_bytes - 1  # the one-stage, no-remat layout no longer fits.
  result = autotune.autotune(config, budget, num_devices=2, microbatches=[2],
                             remats=["none", "full"], granularities=["chunk"],
                             schedules=["gpipe"])
  assert result.best is not None
  choice = result.best.candidate
  assert (choice.num_stages, choice.remat) != (1, "none")
  assert result.best.memory_bytes <= budget
  over = [c for c, reason in result.rejected if reason.startswith("over budget")]
  assert autotune.Candidate(1, 2, 2, "none") in over
  # The chosen configuration compiles and fits when built from the returned config.
  check = config_costs.analyze_config(result.config, per_stage=False)
  assert check.largest_device_bytes == result.best.memory_bytes <= budget
  # Ranked by the report's step time predicted on the chip (v5p), with its MFU.
  assert result.best.predicted_seconds == check.prediction.seconds > 0
  assert result.best.predicted_mfu == check.prediction.mfu
  assert 0 < result.best.predicted_mfu < 1
  fitting = [t for t in result.trials if t.fits]
  assert result.best.predicted_seconds == min(t.predicted_seconds for t in fitting)
  assert f"{result.best.predicted_mfu:.1%}" in autotune.format_result(result)
  assert ((result.config.num_stages, result.config.remat, result.config.schedule)
          == (choice.num_stages, choice.remat, "gpipe"))
  assert "Best: --config.num_stages=" in autotune.format_result(result)


def test_nothing_fits_a_one_byte_budget():
  # A fused schedule, compiled and measured as the others are.
  result = autotune.autotune(_config(), 1, num_devices=2, stages=[1], microbatches=[2],
                             remats=["full"], granularities=["chunk"], schedules=["1f1b"])
  assert result.best is None and result.config is None
  assert len(result.trials) == 1 and not result.trials[0].fits
  trial = result.trials[0]
  assert trial.candidate.schedule == "1f1b" and trial.executed_flops > 0
  assert trial.simulated_bubble == flops_lib.simulated_bubble(
      search_space.schedule_table("1f1b", 1, 2, 1))
  assert "| 1f1b | 1 | full | chunk |" in autotune.format_result(result)
  assert "Nothing fits" in autotune.format_result(result)
  with pytest.raises(ValueError, match="budget_bytes"):
    autotune.autotune(_config(), 0)


def test_the_axis_over_dcn_is_chosen_from_the_priced_steps():
  config = lm.get_config("size=tiny")
  config.num_stages, config.num_data, config.num_microbatches = 2, 2, 2
  config.mesh.fsdp = 2
  options = multislice.compare(config, 2)
  assert [o.axis for o in options] == ["stage", "data", "fsdp"]
  assert all(o.communication is not None and o.peak_bytes > 0 for o in options)
  for option in options:  # The axis spread over the slices is the one priced on DCN.
    assert option.communication.links[option.axis] == "dcn"
    assert {a for a, link in option.communication.links.items() if link == "dcn"} == {
        option.axis}
    assert option.communication.dcn_bytes > 0
  best = multislice.best(options)
  assert best.communication.step_seconds == min(o.communication.step_seconds for o in options)
  # FSDP over DCN gathers every layer's weights there on every tick: the most DCN bytes.
  by_axis = {o.axis: o.communication for o in options}
  assert by_axis["fsdp"].dcn_bytes > max(by_axis["stage"].dcn_bytes, by_axis["data"].dcn_bytes)
  text = multislice.format_choice(options)
  assert f"| {best.axis} **(recommended)** |" in text
  assert f"--config.mesh.dcn.{best.axis}=<slices>" in text
  # An axis the slices do not divide is named, not compiled; fewer than 2 slices is an error.
  options = multislice.compare(config, 4)
  assert [o.reason for o in options] == ["its size 2 does not divide into 4 slices"] * 3
  assert multislice.best(options) is None
  assert "No option could be measured." in multislice.format_choice(options)
  with pytest.raises(ValueError, match="num_slices must be an int >= 2"):
    multislice.compare(config, 1)
