"""Tests for tpipe.tools.step_time: hand-written HLO texts priced by hand from the chip table's
figures, and real compiled programs checked against tpipe.tools.flops."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from tpipe import schedules
from tpipe.tools import analysis
from tpipe.tools import flops as flops_lib
from tpipe.tools import pipeline_time
from tpipe.tools import step_time
from tpipe.tools import tick_conditionals as conditionals_lib

# TPU v5p's published figures, as the table must hold them.
PEAK = 459e12          # bf16 FLOP/s.
HBM = 2765e9           # bytes/s.
ICI = 4800e9 / 8 * 2 / 6   # One mesh axis's share of the chip's 4800 Gbps over 6 ports.
ICI_LATENCY = 1e-6
DCN = 50e9 / 8
DCN_LATENCY = 10e-6


def _module(entry: str, *others: str, header: str = "HloModule m, is_scheduled=true") -> str:
  return "\n\n".join([header] + list(others) + [entry])


# A bf16 [1024, 1024] @ [1024, 1024] matmul: compute-bound on v5p.
BIG_DOT = ("%d = bf16[1024,1024]{1,0} dot(%a, %b), lhs_contracting_dims={1}, "
           "rhs_contracting_dims={0}")
BIG_DOT_FLOPS = 2.0 * 1024 ** 3
BIG_DOT_SECONDS = BIG_DOT_FLOPS / PEAK


@pytest.mark.unit
def test_chip_table_holds_the_published_figures():
  v5p = step_time.chip("v5p:2x2x2")
  assert (v5p.flops_per_second, v5p.hbm_bytes_per_second) == (PEAK, HBM)
  assert v5p.ici.bytes_per_second == pytest.approx(ICI)
  assert step_time.chip("v5e").hbm_bytes_per_second == 819e9
  assert step_time.chip("v4").flops_per_second == 275e12
  assert step_time.chip("v6e").hbm_bytes_per_second == 1640e9
  h100, h200 = step_time.chip("H100"), step_time.chip("h200")
  assert (h100.flops_per_second, h100.hbm_bytes_per_second) == (989e12, 3.35e12)
  assert (h200.flops_per_second, h200.hbm_bytes_per_second) == (989e12, 4.8e12)
  assert h100.ici.bytes_per_second == 450e9  # NVLink: 900 GB/s both directions.
  assert step_time.chip(h100) is h100
  with pytest.raises(ValueError, match=r"Unknown chip 'a100'; choose one of \('v4', 'v5e', "
                                       r"'v5p', 'v6e', 'h100', 'h200'\)"):
    step_time.chip("a100")
  with pytest.raises(ValueError, match="Unknown chip 'tpu7'"):
    step_time.estimate(_module("ENTRY %e () -> f32[] {\n  ROOT %c = f32[] constant(0)\n}"),
                       "tpu7")


@pytest.mark.unit
def test_peaks_agree_with_the_trainers_mfu_table():
  from tpipe.train.cli import throughput  # pylint: disable=g-import-not-at-top

  for kind, name in (("TPU v4", "v4"), ("TPU v5 lite", "v5e"), ("TPU v5p", "v5p"),
                     ("TPU v6 lite", "v6e"), ("NVIDIA H100 80GB HBM3", "h100"),
                     ("NVIDIA H200", "h200")):
    assert throughput.peak_tflops(kind) * 1e12 == step_time.chip(name).flops_per_second


@pytest.mark.unit
def test_a_dot_is_priced_by_the_roofline():
  compute_bound = _module(
      "ENTRY %e (a: bf16[1024,1024], b: bf16[1024,1024]) -> bf16[1024,1024] {\n"
      "  %a = bf16[1024,1024]{1,0} parameter(0)\n  %b = bf16[1024,1024]{1,0} parameter(1)\n"
      f"  ROOT {BIG_DOT}\n}}")
  t = step_time.estimate(compute_bound, "v5p")
  assert t.flops == BIG_DOT_FLOPS
  assert t.hbm_bytes == 3 * 1024 * 1024 * 2
  assert t.seconds == pytest.approx(BIG_DOT_SECONDS, rel=1e-12)
  assert t.breakdown() == {"compute": t.seconds, "memory": 0.0, "exposed collectives": 0.0}
  assert t.mfu(BIG_DOT_FLOPS) == pytest.approx(1.0)
  # The same dot on H100: 989 TFLOP/s.
  assert step_time.estimate(compute_bound, "h100").seconds == pytest.approx(
      BIG_DOT_FLOPS / 989e12, rel=1e-12)
  # A thin one is memory-bound: 2 * 8 * 1024 * 1024 FLOPs, (8*1024 + 1024*1024 + 8*1024) * 2 B.
  thin = compute_bound.replace("bf16[1024,1024] {", "bf16[8,1024] {").replace(
      "%a = bf16[1024,1024]", "%a = bf16[8,1024]").replace(
      "%d = bf16[1024,1024]", "%d = bf16[8,1024]").replace(
      "(a: bf16[1024,1024]", "(a: bf16[8,1024]")
  t = step_time.estimate(thin, "v5p")
  nbytes = (8 * 1024 + 1024 * 1024 + 8 * 1024) * 2
  assert (t.flops, t.hbm_bytes) == (2.0 * 8 * 1024 * 1024, nbytes)
  assert t.seconds == pytest.approx(nbytes / HBM, rel=1e-12)
  assert t.memory_seconds == t.seconds and t.compute_seconds == 0.0


FUSED = """%fused (p0: f32[1024], p1: f32[1024]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  %p1 = f32[1024]{0} parameter(1)
  %m = f32[1024]{0} multiply(%p0, %p1)
  ROOT %s = f32[1024]{0} add(%m, %p0)
}"""


@pytest.mark.unit
def test_a_fusion_counts_its_operands_and_result_once():
  text = _module(
      "ENTRY %e (x: f32[1024], y: f32[1024]) -> f32[1024] {\n"
      "  %x = f32[1024]{0} parameter(0)\n  %y = f32[1024]{0} parameter(1)\n"
      "  ROOT %f = f32[1024]{0} fusion(%x, %y), kind=kLoop, calls=%fused\n}", FUSED)
  t = step_time.estimate(text, "v5e")
  # Two elementwise ops of 1024 elements inside; 2 operands and 1 result of 4 KiB outside (the
  # multiply's intermediate never reaches HBM).
  assert (t.flops, t.hbm_bytes) == (2048.0, 3 * 4096.0)
  assert t.seconds == pytest.approx(3 * 4096 / 819e9, rel=1e-12)
  assert t.per_computation["e"].hbm_bytes == 3 * 4096


@pytest.mark.unit
def test_on_chip_arrays_and_in_place_updates_are_not_hbm_traffic():
  # A TPU layout's S(1) is on-chip memory; a dynamic update slice writes its update in place.
  text = _module(
      "ENTRY %e (buf: f32[64,1024], u: f32[1,1024], i: s32[]) -> f32[64,1024] {\n"
      "  %buf = f32[64,1024]{1,0} parameter(0)\n  %u = f32[1,1024]{1,0:S(1)} parameter(1)\n"
      "  %i = s32[] parameter(2)\n  %z = s32[] constant(0)\n"
      "  ROOT %d = f32[64,1024]{1,0} dynamic-update-slice(%buf, %u, %i, %z)\n}")
  t = step_time.estimate(text, "v5p")
  # The update is on chip: read nothing of it; indices 2 x 4 B; write the 4 KiB update.
  assert step_time.hbm_bytes("f32[1,1024]{1,0:S(1)}") == 0
  assert t.hbm_bytes == 8 + 4096


STATE = "(s32[], bf16[1024,1024], bf16[1024,1024])"
WHILE_BODY = f"%body (s: {STATE}) -> {STATE} {{" + """
  %s = (s32[], bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %a = bf16[1024,1024]{1,0} get-tuple-element(%s), index=1
  %b = bf16[1024,1024]{1,0} get-tuple-element(%s), index=2
  """ + BIG_DOT + """
  ROOT %t = (s32[], bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}) tuple(%next, %d, %b)
}"""
WHILE_COND = """%cond (s: (s32[], bf16[1024,1024], bf16[1024,1024])) -> pred[] {
  %s = (s32[], bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}"""


def _while_module(attrs: str = "") -> str:
  return _module(
      "ENTRY %e (a: bf16[1024,1024], b: bf16[1024,1024]) -> bf16[1024,1024] {\n"
      "  %a = bf16[1024,1024]{1,0} parameter(0)\n  %b = bf16[1024,1024]{1,0} parameter(1)\n"
      "  %zero = s32[] constant(0)\n  %start = s32[] copy(%zero)\n"
      "  %init = (s32[], bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}) tuple(%start, %a, %b)\n"
      "  %w = (s32[], bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}) while(%init), "
      f"condition=%cond, body=%body{attrs}\n"
      "  ROOT %out = bf16[1024,1024]{1,0} get-tuple-element(%w), index=1\n}",
      WHILE_BODY, WHILE_COND)


@pytest.mark.unit
def test_a_while_loop_runs_its_body_trip_count_times():
  # Per trip: the dot; the counter's add (3 x 4 B, 1 FLOP) and the condition's compare (4 + 4
  # B read, 1 B written, 1 FLOP), both memory-bound. Outside: the copy of the counter (8 B).
  per_trip = BIG_DOT_SECONDS + 12 / HBM + 9 / HBM
  expected = 7 * per_trip + 8 / HBM
  printed = step_time.estimate(_while_module(', backend_config={"known_trip_count":{"n":"7"}}'),
                               "v5p")
  inferred = step_time.estimate(_while_module(), "v5p")  # As the TPU compiler prints it.
  for t in (printed, inferred):
    assert t.trip_counts == {"w": 7}
    assert t.seconds == pytest.approx(expected, rel=1e-12)
    assert t.flops == 7 * (BIG_DOT_FLOPS + 2)
    assert t.per_computation["body"].runs == 7
    assert t.per_computation["body"].flops == 7 * (BIG_DOT_FLOPS + 1)
  # The loop's trip count also reaches the FLOP counter.
  assert step_time.infer_trip_counts(_while_module()) == {"w": 7}
  assert flops_lib.flop_count(step_time.with_trip_counts(_while_module())).executed == t.flops
  assert flops_lib.flop_count(_while_module()).executed == BIG_DOT_FLOPS + 2  # Once, unknown.
  # A count down from 12 by 2 while i > 2 runs 5 times; i <= 7 from 0 runs 8.
  down = (_while_module().replace("constant(0)", "constant(12)")
          .replace("%one = s32[] constant(1)", "%one = s32[] constant(2)")
          .replace("add(%i, %one)", "subtract(%i, %one)")
          .replace("constant(7)", "constant(2)").replace("direction=LT", "direction=GT"))
  assert step_time.infer_trip_counts(down) == {"w": 5}
  assert step_time.infer_trip_counts(_while_module().replace("direction=LT", "direction=LE")) \
      == {"w": 8}
  # A bound that is not a constant: unknown, counted once.
  unknown = _while_module().replace("%n = s32[] constant(7)",
                                    "%n = s32[] get-tuple-element(%s), index=0")
  assert step_time.infer_trip_counts(unknown) == {"w": None}


def _collective_module(asynchronous: bool, elements: int, replica_groups: str,
                       opcode: str = "all-reduce") -> str:
  shape = f"f32[{elements}]{{0}}"
  add = """%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}"""
  reduce = ", to_apply=%sum" if opcode == "all-reduce" else ""
  if asynchronous:
    comm = (f"  %ar = {shape} {opcode}-start(%g), replica_groups={replica_groups}{reduce}\n"
            f"  {BIG_DOT}\n  %done = {shape} {opcode}-done(%ar)\n")
  else:
    comm = (f"  %done = {shape} {opcode}(%g), replica_groups={replica_groups}{reduce}\n"
            f"  {BIG_DOT}\n")
  return _module(
      f"ENTRY %e (g: f32[{elements}], a: bf16[1024,1024], b: bf16[1024,1024]) -> "
      f"(f32[{elements}], bf16[1024,1024]) {{\n"
      f"  %g = {shape} parameter(0)\n  %a = bf16[1024,1024]{{1,0}} parameter(1)\n"
      "  %b = bf16[1024,1024]{1,0} parameter(2)\n" + comm +
      f"  ROOT %t = ({shape}, bf16[1024,1024]{{1,0}}) tuple(%done, %d)\n}}",
      add, header="HloModule m, is_scheduled=true, num_partitions=8")


@pytest.mark.unit
def test_an_async_collective_overlaps_the_compute_between_start_and_done():
  everyone = "{{0,1,2,3,4,5,6,7}}"
  elements = 1 << 20  # 4 MiB: a ring all-reduce over 8 sends 2 * 7/8 of it.
  ring = ICI_LATENCY + 2 * 7 / 8 * 4 * elements / ICI
  assert ring > BIG_DOT_SECONDS  # Longer than the dot it overlaps.
  sync = step_time.estimate(_collective_module(False, elements, everyone), "v5p")
  overlapped = step_time.estimate(_collective_module(True, elements, everyone), "v5p")
  # The all-reduce's own sums: one FLOP per element.
  for t in (sync, overlapped):
    assert t.flops == BIG_DOT_FLOPS + elements
    assert t.collective_bytes == {("all-reduce", None): 4.0 * elements}
    assert t.compute_seconds == pytest.approx(BIG_DOT_SECONDS, rel=1e-12)
  assert sync.exposed_collective_seconds == pytest.approx(ring, rel=1e-12)
  assert sync.exposed_by == {("all-reduce", None): sync.exposed_collective_seconds}
  assert sync.seconds == pytest.approx(ring + BIG_DOT_SECONDS, rel=1e-12)
  assert overlapped.exposed_collective_seconds == pytest.approx(ring - BIG_DOT_SECONDS,
                                                                rel=1e-12)
  assert overlapped.hidden_collective_seconds == pytest.approx(BIG_DOT_SECONDS, rel=1e-12)
  assert overlapped.seconds == pytest.approx(ring, rel=1e-12)
  # A small one hides entirely behind the dot.
  small = step_time.estimate(_collective_module(True, 1024, everyone), "v5p")
  assert small.exposed_collective_seconds == 0.0
  assert small.exposed_by == {}
  assert small.seconds == pytest.approx(BIG_DOT_SECONDS, rel=1e-12)
  # Groups of one device move nothing.
  alone = step_time.estimate(_collective_module(False, elements, "{{0},{1},{2},{3},{4},{5},{6},"
                                                "{7}}"), "v5p")
  assert alone.exposed_collective_seconds == 0.0


@pytest.mark.unit
def test_collectives_are_priced_on_the_link_of_the_axes_they_span():
  # A 2 x 4 mesh whose first axis crosses slices: groups {0, 4}, ... span it.
  mesh = types.SimpleNamespace(devices=np.zeros((2, 4)), axis_names=("slice", "x"))
  pairs = "{{0,4},{1,5},{2,6},{3,7}}"
  elements = 1 << 20
  t = step_time.estimate(_collective_module(False, elements, pairs, "all-gather"), "v5p",
                         mesh=mesh, axis_links={"slice": "dcn", "x": "ici"})
  assert t.collective_bytes == {("all-gather", ("slice",)): 4.0 * elements}
  assert t.exposed_collective_seconds == pytest.approx(
      DCN_LATENCY + 1 / 2 * 4 * elements / DCN, rel=1e-12)
  within = "{{0,1,2,3},{4,5,6,7}}"
  t = step_time.estimate(_collective_module(False, elements, within, "all-gather"), "v5p",
                         mesh=mesh, axis_links={"slice": "dcn", "x": "ici"})
  assert t.collective_bytes == {("all-gather", ("x",)): 4.0 * elements}
  assert t.exposed_collective_seconds == pytest.approx(
      ICI_LATENCY + 3 / 4 * 4 * elements / ICI, rel=1e-12)
  assert t.exposed_by == {("all-gather", ("x",)): t.exposed_collective_seconds}


def _scanned_step(w, x):
  def loss(w):
    def body(c, _):
      return jnp.tanh(c @ w), None
    y, _ = lax.scan(body, x, None, length=6)
    return jnp.sum(y ** 2)
  return jax.grad(loss)(w)


def test_a_compiled_jit_step_agrees_with_the_flop_counter():
  compiled = jax.jit(_scanned_step).lower(jnp.ones((64, 64)), jnp.ones((16, 64))).compile()
  t = step_time.estimate(compiled, "h100")
  counted = flops_lib.flop_count(compiled.as_text())
  assert t.flops == counted.executed
  assert flops_lib.flop_count(compiled).executed == pytest.approx(t.flops, rel=1e-6)
  assert sorted(t.trip_counts.values()) == [6, 6]  # The forward scan and its transpose.
  assert t.seconds == pytest.approx(t.compute_seconds + t.memory_seconds)
  assert t.exposed_collective_seconds == 0.0 and t.collective_bytes == {}
  # At least the dots at the peak, and 12 matmuls' worth of FLOPs among them.
  assert t.seconds >= t.flops / 989e12
  assert t.flops >= 6 * 3 * 2 * 16 * 64 * 64
  assert sum(c.flops for c in t.per_computation.values()) == pytest.approx(t.flops)


def _fused_tick_program(schedule, branches):
  """A loop over a fused table's ticks switching over ``branches`` (the shape of
  tpipe.core.loops.fused's compiled tick loop), as tests/tools/test_analysis.py builds it."""

  def f(x, index):
    y, _ = lax.scan(lambda c, i: (lax.switch(i, branches, c), None), x, index)
    return y

  return jax.jit(f).lower(jnp.ones((64, 256)), jnp.zeros(schedule.num_ticks, jnp.int32)
                          ).compile()


def test_pipeline_step_follows_the_table_with_each_actions_price():
  # 1F1B, S = 2, M = 4: F one matmul, B two.
  schedule = schedules.build("1f1b", 2, 4)
  w = jnp.ones((256, 256))

  def matmuls(n):
    def run(c):
      for _ in range(n):
        c = jnp.tanh(c @ w)
      return c
    return run

  compiled = _fused_tick_program(schedule, [lambda c: c, matmuls(1), matmuls(2)])
  priced = pipeline_time.fused_action_seconds(compiled, schedule, "v5p", programs=[0, 0])
  assert set(priced.actions) == {"F", "B"}
  # B runs two of F's matmul and tanh (what else the branches do, copies, is memory-bound).
  assert priced.actions["F"] < priced.actions["B"] < 3 * priced.actions["F"]
  step = pipeline_time.pipeline_step_time(compiled, schedule, "v5p", programs=[0, 0])
  timing = schedule.simulate(priced.actions)
  assert step.seconds == pytest.approx(timing.neighbour + priced.outside)
  assert step.busy == pytest.approx(4 * (priced.actions["F"] + priced.actions["B"]))
  # The bubble: at least 1F1B's natural (S - 1) (F + B) per stage.
  assert step.bubble == pytest.approx(timing.neighbour - step.busy)
  assert step.bubble >= (priced.actions["F"] + priced.actions["B"]) * (1 - 1e-9)
  # The program's own time runs every tick's slowest branch: no faster than the table.
  assert priced.lockstep >= step.seconds - 1e-15
  assert priced.outside >= 0


def test_a_collective_inside_an_action_is_counted_as_that_actions_wait():
  # 1F1B, S = 2, M = 4, on 2 devices: B sums its result over them (a synchronous all-reduce,
  # exposed whole), F has no collective.
  schedule = schedules.build("1f1b", 2, 4)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
  w = jnp.ones((256, 256))
  forward = lambda c: jnp.tanh(c @ w)
  backward = lambda c: c + lax.psum(jnp.tanh(c @ w), "x")

  def f(x, index):
    y, _ = lax.scan(lambda c, i: (lax.switch(i, [lambda c: c, forward, backward], c), None),
                    x, index)
    return y

  sharded = jax.shard_map(f, mesh=mesh, in_specs=(jax.P("x"), jax.P()), out_specs=jax.P("x"))
  compiled = jax.jit(sharded).lower(jnp.ones((128, 256)),
                                    jnp.zeros(schedule.num_ticks, jnp.int32)).compile()
  key = ("all-reduce", ("x",))
  (summed,) = [c for c in analysis.collectives(compiled, mesh) if c.kind == "all-reduce"]
  alone = step_time.ring_factor("all-reduce", 2) * summed.bytes / ICI + ICI_LATENCY
  priced = pipeline_time.fused_action_seconds(compiled, schedule, "v5p", programs=[0, 0],
                                              mesh=mesh)
  assert priced.exposed_by == {"F": {}, "B": {key: pytest.approx(alone, rel=1e-9)}}
  assert priced.actions["B"] > priced.exposed_by["B"][key]
  step = pipeline_time.pipeline_step_time(compiled, schedule, "v5p", programs=[0, 0],
                                          mesh=mesh)
  # Each stage runs B once per micro-batch.
  assert step.exposed_by == {key: pytest.approx(4 * alone, rel=1e-9)}


def test_rematerialised_work_is_told_apart():
  w, x = jnp.ones((256, 256)), jnp.ones((64, 256))
  layer = lambda w, x: jnp.tanh(jnp.tanh(x @ w) @ w)
  plain = jax.jit(jax.grad(lambda w: layer(w, x).sum())).lower(w).compile()
  remat = jax.jit(jax.grad(lambda w: jax.checkpoint(layer)(w, x).sum())).lower(w).compile()
  assert step_time.estimate(plain, "v5p").recompute_seconds == 0.0
  t = step_time.estimate(remat, "v5p")
  # The recomputed forward: a share of the step, no more than the forward's own time.
  assert 0.0 < t.recompute_seconds < t.seconds / 2


@pytest.mark.unit
def test_a_tpu_prefetch_and_permute_overlap_the_work_between_start_and_done():
  # As the TPU compiler prints them: a copy to on-chip memory (S(1)) and a collective-permute
  # whose start returns (operand, result, context).
  text = _module(
      "ENTRY %e (g: f32[1048576], a: bf16[1024,1024], b: bf16[1024,1024]) -> "
      "(f32[1048576], f32[1048576], bf16[1024,1024]) {\n"
      "  %g = f32[1048576]{0} parameter(0)\n  %a = bf16[1024,1024]{1,0} parameter(1)\n"
      "  %b = bf16[1024,1024]{1,0} parameter(2)\n"
      "  %cs = (f32[1048576]{0:S(1)}, f32[1048576]{0}, u32[]{:S(2)}) copy-start(%g)\n"
      "  %ps = (f32[1048576]{0}, f32[1048576]{0}, u32[], u32[]) collective-permute-start(%g), "
      "source_target_pairs={{0,1},{1,0}}\n"
      f"  {BIG_DOT}\n"
      "  %cd = f32[1048576]{0:S(1)} copy-done(%cs)\n"
      "  %pd = f32[1048576]{0} collective-permute-done(%ps)\n"
      "  ROOT %t = (f32[1048576]{0:S(1)}, f32[1048576]{0}, bf16[1024,1024]{1,0}) "
      "tuple(%cd, %pd, %d)\n}", header="HloModule m, is_scheduled=true, num_partitions=2")
  t = step_time.estimate(text, "v5p")
  copy = 4 * 2 ** 20 / HBM  # The HBM side of the copy only.
  permute = ICI_LATENCY + 4 * 2 ** 20 / ICI  # One neighbour's payload.
  assert copy < BIG_DOT_SECONDS < permute
  assert t.collective_bytes == {("collective-permute", None): 4.0 * 2 ** 20}
  assert t.memory_seconds == 0.0  # The copy hides behind the dot.
  assert t.exposed_collective_seconds == pytest.approx(permute - BIG_DOT_SECONDS, rel=1e-12)
  assert t.exposed_by == {("collective-permute", None): t.exposed_collective_seconds}
  assert t.seconds == pytest.approx(permute, rel=1e-12)
  assert t.hbm_bytes == 4 * 2 ** 20 + 3 * 2 * 2 ** 20


@pytest.mark.unit
def test_an_asynchronous_all_to_all_overlaps_the_work_between_start_and_done():
  # As the TPU compiler prints one with --xla_tpu_enable_async_all_to_all: the start returns
  # (operands, result, contexts); 4 devices, each keeping a quarter of its 8 MiB.
  text = _module(
      "ENTRY %e (g: f32[4,524288], a: bf16[1024,1024], b: bf16[1024,1024]) -> "
      "(f32[4,524288], bf16[1024,1024]) {\n"
      "  %g = f32[4,524288]{1,0} parameter(0)\n  %a = bf16[1024,1024]{1,0} parameter(1)\n"
      "  %b = bf16[1024,1024]{1,0} parameter(2)\n"
      "  %s = ((f32[4,524288]{1,0}), f32[4,524288]{1,0}, u32[], u32[]) all-to-all-start(%g), "
      "replica_groups={{0,1,2,3}}, dimensions={0}\n"
      f"  {BIG_DOT}\n"
      "  %x = f32[4,524288]{1,0} all-to-all-done(%s)\n"
      "  ROOT %t = (f32[4,524288]{1,0}, bf16[1024,1024]{1,0}) tuple(%x, %d)\n}",
      header="HloModule m, is_scheduled=true, num_partitions=4")
  (found,) = analysis.collectives(text)
  assert (found.kind, found.group_size) == ("all-to-all", 4)
  assert 0 <= found.bytes - 8 * 2 ** 20 <= 8  # The payload, and the start's two contexts.
  t = step_time.estimate(text, "v5p")
  exchange = ICI_LATENCY + 3 / 4 * 8 * 2 ** 20 / ICI
  assert t.collective_bytes == {("all-to-all", None): 8.0 * 2 ** 20}
  assert t.exposed_collective_seconds == pytest.approx(exchange - BIG_DOT_SECONDS, rel=1e-12)
  assert t.exposed_by == {("all-to-all", None): t.exposed_collective_seconds}
  assert t.seconds == pytest.approx(exchange, rel=1e-12)


@pytest.mark.parametrize("shapes, options", [
    (((2, 4, 5), (6, 4, 3)), dict(window_strides=(1,), padding=[(1, 1)], lhs_dilation=(3,))),
    (((2, 4, 9), (6, 4, 3)), dict(window_strides=(2,), padding=[(2, 0)], rhs_dilation=(2,))),
])
def test_convolutions_count_only_the_taps_that_meet_the_input_as_xla_does(shapes, options):
  # The TPU compiler writes a batched matmul as a convolution over a dilated input: only the
  # taps that meet an input element (not a hole or padding) multiply anything.
  conv = lambda x, k: lax.conv_general_dilated(x, k, dimension_numbers=("NCH", "OIH", "NCH"),
                                               **options)
  compiled = jax.jit(conv).lower(*(jnp.ones(s) for s in shapes)).compile()
  assert step_time.estimate(compiled, "v5p").flops == compiled.cost_analysis()["flops"]
  count = flops_lib.flop_count(compiled)  # The FLOP counter both read.
  assert count.static == count.xla == compiled.cost_analysis()["flops"]
  # By hand for the first: 5 inputs dilated by 3 (13 positions, 4 holes between each), padded
  # 1 each side, window 3: 13 outputs; 5 x 3 of the (output, tap) pairs meet an input element
  # (each input under each tap once, padding permitting) less the two that fall off the ends.
  if "lhs_dilation" in options:
    assert compiled.cost_analysis()["flops"] == 2 * 2 * 6 * 13 * 4


@pytest.mark.unit
def test_a_fusion_reads_only_the_slices_it_takes_through_bitcasts():
  fused = """%slicing (p0: f32[64,1024], i: s32[]) -> f32[1,1024] {
  %p0 = f32[64,1024]{1,0} parameter(0)
  %b = f32[64,1024]{1,0} bitcast(%p0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,1024]{1,0} dynamic-slice(%b, %i, %z), dynamic_slice_sizes={1,1024}
}"""
  text = _module(
      "ENTRY %e (buf: f32[64,1024], i: s32[]) -> f32[1,1024] {\n"
      "  %buf = f32[64,1024]{1,0} parameter(0)\n  %i = s32[] parameter(1)\n"
      "  ROOT %f = f32[1,1024]{1,0} fusion(%buf, %i), kind=kLoop, calls=%slicing\n}", fused)
  # One row read (4 KiB) of the 256 KiB buffer, the index (4 B), the row written (4 KiB).
  assert step_time.estimate(text, "v5p").hbm_bytes == 4096 + 4 + 4096


@pytest.mark.unit
def test_lanes_meet_their_conditionals_in_the_order_the_program_made_them():
  # The TPU compiler printed a one-stage table's backward conditional (made second) first.
  def order(*names):
    """The branch lists tick_conditionals returns for conditionals printed as ``names`` (each
    conditional's one branch named after it)."""
    body = types.SimpleNamespace(instructions=[
        types.SimpleNamespace(name=n, opcode="conditional",
                              attr=lambda key, n=n: ("{%s_branch}" % n
                                                     if key == "branch_computations" else None))
        for n in names])
    module = types.SimpleNamespace(computations={"body": body})
    return [branches[0].removesuffix("_branch")
            for branches in conditionals_lib.tick_conditionals(module, "body")]

  assert order("conditional.9", "conditional.8") == ["conditional.8", "conditional.9"]
  assert order("conditional.10", "conditional.9") == ["conditional.9", "conditional.10"]
  # Without a number on every name: as printed.
  assert order("conditional", "conditional.1") == ["conditional", "conditional.1"]
