"""Tests for tpipe.tools.analysis (and tpipe.tools.flops, tpipe.tools.hlo) on tiny programs with
answers known by hand."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpipe import schedules
from tpipe.core.loops import tick_rows
from tpipe.tools import analysis
from tpipe.tools import hlo
from tpipe.tools import replica_groups

DOT = 2 * 4 * 16 * 16  # FLOPs of one [4, 16] @ [16, 16] matmul.


def _compile(f, *args):
  return jax.jit(f).lower(*args).compile()


def _nested_scans(w, x):
  """5 outer x 3 inner iterations of one [4,16] @ [16,16] matmul: 15 matmuls in all."""

  def inner(c, _):
    return c @ w, None

  def outer(c, _):
    c, _ = lax.scan(inner, c, None, length=3)
    return c, None

  y, _ = lax.scan(outer, x, None, length=5)
  return y


@pytest.fixture(scope="module")
def nested():
  return _compile(_nested_scans, jnp.ones((16, 16)), jnp.ones((4, 16)))


def test_cost_analysis_counts_a_loop_body_once(nested):
  # The fact executed FLOPs correct for: XLA's number holds one matmul, not fifteen.
  xla = nested.cost_analysis()["flops"]
  assert DOT <= xla < 2 * DOT


def test_executed_flops_multiply_nested_trip_counts(nested):
  count = analysis.flop_count(nested)
  # 15 matmuls, plus a few integer ops per iteration for the loop counters and conditions.
  assert 15 * DOT <= count.executed <= 15 * DOT + 100
  assert sorted((trips, outer) for _, trips, outer in count.loops) == [(3, 5), (5, 1)]
  assert count.loop_factor > 14


def test_multipliers_of_nested_loop_bodies(nested):
  module = hlo.parse_hlo(nested.as_text())
  mult = module.multipliers()
  loops = {loop.trip_count: loop for loop in module.loops()}
  assert mult[module.entry] == 1
  assert mult[loops[5].body] == 5
  assert mult[loops[3].body] == 15


def _mlp_loss(w, x):
  def layer(h, wi):
    h = jax.nn.gelu(h @ wi)
    h = (h - h.mean(-1, keepdims=True)) * lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
    return h, None

  y, _ = lax.scan(layer, x, w)
  return jax.nn.log_softmax(y).mean()


def _attention(x):
  q = x.reshape(2, 4, 4, 8)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, q)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), q).sum()


def _adam_step(w, opt_state, x):
  opt = optax.adamw(1e-3)
  loss, g = jax.value_and_grad(_mlp_loss)(w, x)
  updates, opt_state = opt.update(g, opt_state, w)
  return optax.apply_updates(w, updates), opt_state, loss


@pytest.mark.parametrize("name", ["mlp", "grad", "attention", "adam", "argmax", "cond"])
def test_our_static_count_reproduces_xla(name):
  w, x = jnp.ones((3, 32, 32)), jnp.ones((8, 32))
  programs = {
      "mlp": (_mlp_loss, (w, x)),
      "grad": (jax.grad(_mlp_loss), (w, x)),
      "attention": (_attention, (x,)),
      "adam": (_adam_step, (w, optax.adamw(1e-3).init(w), x)),
      "argmax": (lambda a: jnp.argmax(a, axis=1), (x,)),
      "cond": (lambda a: lax.cond(a.sum() > 0, lambda y: y @ w[0], lambda y: y + 1, a), (x,)),
  }
  f, args = programs[name]
  count = analysis.flop_count(_compile(f, *args))
  assert count.static == pytest.approx(count.xla, rel=1e-3)


def test_loop_free_program_executed_equals_xla():
  c = _compile(lambda a, b: jnp.tanh(a @ b), jnp.ones((8, 32)), jnp.ones((32, 16)))
  count = analysis.flop_count(c)
  assert count.executed == count.xla == 2 * 8 * 32 * 16
  assert count.transcendentals == 8 * 16
  assert count.loops == ()


def test_flops_from_text_alone(nested):
  count = analysis.flop_count(nested.as_text())
  assert count.xla is None
  assert 15 * DOT <= count.executed <= 15 * DOT + 100


_HAND_WRITTEN = """HloModule m, num_partitions=4

%body (p: (s32[], f32[2,8])) -> (s32[], f32[2,8]) {
  %p = (s32[], f32[2,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[2,8]{1,0} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %y = f32[2,8]{1,0} multiply(%x, %x)
  %z = f32[2,8]{1,0} collective-permute(%y), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  ROOT %t = (s32[], f32[2,8]{1,0}) tuple(%next, /*index=1*/%z)
}

%cond (q: (s32[], f32[2,8])) -> pred[] {
  %q = (s32[], f32[2,8]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = f32[] add(%a, %b)
}

ENTRY %main (x0: f32[2,8]) -> f32[2,8] {
  %x0 = f32[2,8]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[2,8]{1,0}) tuple(%zero, %x0)
  %w = (s32[], f32[2,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  %out = f32[2,8]{1,0} get-tuple-element(%w), index=1
  ROOT %r = f32[2,8]{1,0} all-reduce(%out), channel_id=2, replica_groups=[2,2]<=[4], to_apply=%sum
}
"""


_BRANCHES = """HloModule m, num_partitions=4

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = f32[] add(%a, %b)
}

%first (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %r = f32[8]{0} all-reduce(%p), channel_id=1, replica_groups=[2,2]<=[4], to_apply=%sum
}

%second (q: f32[8]) -> f32[8] {
  %q = f32[8]{0} parameter(0)
  %g = f32[8]{0} all-reduce(%q), channel_id=2, replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%sum
  ROOT %s = f32[8]{0} collective-permute(%g), channel_id=3, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
}

ENTRY %main (i: s32[], x: f32[8]) -> f32[8] {
  %i = s32[] parameter(0)
  %x = f32[8]{0} parameter(1)
  ROOT %c = f32[8]{0} conditional(%i, %x, %x), branch_computations={%first, %second}
}
"""


@pytest.mark.unit  # HLO text and numbers only: no JAX computation.
def test_cross_branch_collectives_names_what_waits_for_other_branches():
  # On a (stage 2, tensor 2) mesh: the first branch's all-reduce stays inside a stage (groups
  # {0, 1}, {2, 3} over tensor); the second's groups {0, 2}, {1, 3} span the stages, and its
  # collective-permute meets every device on emulated CPU devices.
  mesh = types.SimpleNamespace(devices=np.zeros((2, 2)), axis_names=("stage", "tensor"))
  found = analysis.cross_branch_collectives(_BRANCHES, mesh)
  assert [(c.kind, c.axes) for c in found] == [("all-reduce", ("stage",)),
                                               ("collective-permute", ("tensor",))]
  assert all(c.in_branch for c in analysis.collectives(_BRANCHES, mesh))
  # Without a mesh, the axes are unknown: the collective-permute alone.
  assert [c.kind for c in analysis.cross_branch_collectives(_BRANCHES)] == [
      "collective-permute"]


@pytest.mark.unit  # HLO text and numbers only: no JAX computation.
def test_hand_written_hlo():
  module = hlo.parse_hlo(_HAND_WRITTEN)
  assert module.num_partitions == 4
  assert module.multipliers()["body"] == 6
  count = analysis.flop_count(_HAND_WRITTEN)
  # Per trip: add (1) + multiply (16) in the body, compare (1) in the condition; then the
  # all-reduce adds 16 elements once.
  assert count.static == 1 + 16 + 1 + 16
  assert count.executed == 6 * (1 + 16 + 1) + 16
  found = analysis.collectives(_HAND_WRITTEN)
  permute, reduce = found
  assert (permute.kind, permute.count, permute.bytes, permute.in_loop) == (
      "collective-permute", 6, 64, True)
  assert (reduce.kind, reduce.count, reduce.bytes, reduce.in_loop, reduce.group_size) == (
      "all-reduce", 1, 64, False, 2)


@pytest.mark.unit  # HLO text and numbers only: no JAX computation.
def test_replica_group_forms():
  # Every syntax XLA prints. The expected groups were checked by running an all-reduce of
  # 2**device over each text with XLA itself on 8 CPU devices; within a group, the first listed
  # grouping axis is the major one, as in XLA.
  forms = {
      "{{0,4},{1,5}}": [[0, 4], [1, 5]],
      "{}": [[0, 1, 2, 3, 4, 5, 6, 7]],
      "[2,4]<=[8]": [[0, 1, 2, 3], [4, 5, 6, 7]],
      "[4,2]<=[2,4]T(1,0)": [[0, 4], [1, 5], [2, 6], [3, 7]],
      "[2,4]<=[2,2,2]T(2,1,0)": [[0, 4, 2, 6], [1, 5, 3, 7]],
      "mesh['a'=2,'b'=1,'c'=4] {'a'}": [[0, 4], [1, 5], [2, 6], [3, 7]],
      "mesh['a'=2,'c'=4] {'c'}": [[0, 1, 2, 3], [4, 5, 6, 7]],
      "mesh['a'=2,'c'=4] {'c','a'}": [[0, 4, 1, 5, 2, 6, 3, 7]],
      # Device ids, explicit or as a transposed iota, in the mesh's row-major order.
      "mesh['a'=2,'b'=4], device_ids=(0,4,1,5,2,6,3,7) {'a'}": [[0, 2], [4, 6], [1, 3], [5, 7]],
      "mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}": [[0, 1], [2, 3], [4, 5], [6, 7]],
      # Sub-axes 'b':(p)k: axis b seen as [p, k, rest], major to minor; k varies in a group.
      "mesh['a'=2,'b'=4] {'b':(1)2}": [[0, 2], [1, 3], [4, 6], [5, 7]],
      "mesh['a'=2,'b'=4] {'b':(2)2}": [[0, 1], [2, 3], [4, 5], [6, 7]],
      "mesh['a'=8] {'a':(1)2,'a':(4)2}": [[0, 1, 4, 5], [2, 3, 6, 7]],
      "mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0':(2)2}": [
          [0, 1], [2, 3], [4, 5], [6, 7]],
      "maximal_mesh[device_id=3]": [[3]],
  }
  for text, groups in forms.items():
    assert replica_groups.parse_replica_groups(text, num_devices=8) == groups, text
  for bad in ("{{0,1},{2", "[2,4]<=[6]", "mesh['a'=2] {'z'}", "mesh['a'=4] {'a':(2)4}",
              "devices=[2]0,1"):
    with pytest.raises(ValueError, match="(?i)replica groups"):
      replica_groups.parse_replica_groups(bad, num_devices=8)


@pytest.mark.unit  # HLO text and numbers only: no JAX computation.
def test_replica_groups_attribute_text_in_every_form():
  line = ("  %{name} = f32[2]{{0}} {op}(f32[2]{{0}} %x), channel_id=1, replica_groups={groups}, "
          "use_global_device_ids=true, to_apply=%add, metadata={{op_name=\"f\"}}")
  for groups in ("{{0,1},{2,3}}", "{}", "[2,2]<=[4]", "[2,2]<=[2,2]T(1,0)",
                 "mesh['a'=2,'b'=2] {'a'}", "mesh['a'=2,'b'=2], device_ids=(0,2,1,3) {'b'}",
                 "mesh['a'=4], device_ids=([2,2]T(1,0)) {'a':(2)2}"):
    ins = hlo._parse_instruction(line.format(name="r", op="all-reduce", groups=groups))
    assert ins.replica_groups == groups
  permute = hlo._parse_instruction(
      "  %p = f32[2]{0} collective-permute(f32[2]{0} %x), channel_id=1, "
      "source_target_pairs={{0,1},{1,0}}")
  assert permute.device_groups(2) == [[0, 1], [1, 0]]


def _auto_mesh(shape, names):
  return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def _partitioned(f, mesh, in_spec, out_spec=None, shape=(8, 8, 8)):
  """``f`` compiled by the SPMD partitioner: the collectives it inserts use mesh-form groups."""
  out = None if out_spec is None else NamedSharding(mesh, out_spec)
  return jax.jit(f, in_shardings=NamedSharding(mesh, in_spec), out_shardings=out).lower(
      jnp.zeros(shape)).compile()


@pytest.mark.parametrize("in_spec,f,out_spec,expected", [
    # Sums over a sharded dimension: an all-reduce over the axes that shard it.
    (P("c"), lambda v: v.sum(0), None, {("all-reduce", ("c",))}),
    (P(("a", "c")), lambda v: v.sum(0), None, {("all-reduce", ("a", "c"))}),
    (P("a", "b"), lambda v: v.sum(0), None, {("all-reduce", ("a",))}),
    # Moving a sharding to another dimension: an all-to-all within the axis.
    (P("c"), lambda v: v * 2, P(None, "c"), {("all-to-all", ("c",))}),
    (P(("a", "c")), lambda v: v * 2, P(None, ("a", "c")), {("all-to-all", ("a", "c"))}),
    # Unsharding: an all-gather over the axis.
    (P("a"), lambda v: v * 2, P(), {("all-gather", ("a",))}),
])
def test_mesh_form_groups_of_compiled_programs_map_to_the_right_axes(in_spec, f, out_spec,
                                                                     expected):
  mesh = _auto_mesh((2, 2, 2), ("a", "b", "c"))
  compiled = _partitioned(f, mesh, in_spec, out_spec)
  assert "replica_groups=mesh[" in compiled.as_text()
  found = analysis.collectives(compiled, mesh)
  assert {(c.kind, c.axes) for c in found} == expected
  for ins in (i for _, i in hlo.parse_hlo(compiled.as_text()).instructions()
              if i.opcode in ("all-reduce", "all-to-all", "all-gather")):
    groups = ins.device_groups(8)
    assert sorted(d for g in groups for d in g) == list(range(8))  # groups partition devices.


def test_xla_mesh_differs_from_the_jax_mesh():
  # Summing the rows of [8] split over a=4 seen as [2, 4]: devices a and a + 2 hold the two
  # halves of a column, so they reduce together. XLA prints its own mesh of three axes of 2.
  mesh = _auto_mesh((4, 2), ("a", "b"))
  compiled = _partitioned(lambda v: v.reshape(2, 4).sum(0), mesh, P("a"), P("a"), shape=(8,))
  (reduce,) = [c for c in analysis.collectives(compiled, mesh) if c.kind == "all-reduce"]
  module = hlo.parse_hlo(compiled.as_text())
  ins = next(i for _, i in module.instructions() if i.name == reduce.name)
  assert ins.replica_groups.startswith("mesh['axis_0'=2,'axis_1'=2,'axis_2'=2]")
  # Device ids are positions in mesh.devices.flat: a * 2 + b.
  assert sorted(ins.device_groups(8)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert reduce.axes == ("a",)


def test_sub_axis_groups_of_a_compiled_reshard():
  # [8, 8] from rows over data, columns over stage to rows over stage, columns over data. XLA
  # first swaps column pairs between stages 2k and 2k + 1 of a data row (an all-to-all over
  # half of the stage axis, printed as a sub-axis), so device (d, s) then holds rows
  # 4d + 2(s % 2) + {0, 1}, columns 4(s // 2) + 0..3; then a collective-permute sends each block
  # to its owner (data, stage) = (s // 2, 2d + s % 2).
  mesh = _mesh()
  compiled = _partitioned(lambda v: v * 2, mesh, P("data", "stage"), P("stage", "data"),
                          shape=(8, 8))
  module = hlo.parse_hlo(compiled.as_text())
  (all_to_all,) = [i for _, i in module.instructions() if i.opcode == "all-to-all"]
  assert ":(" in all_to_all.replica_groups  # the sub-axis syntax.
  assert all_to_all.device_groups(8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
  (permute,) = [i for _, i in module.instructions() if i.opcode == "collective-permute"]
  assert sorted(map(tuple, permute.device_groups(8))) == [
      (d * 4 + s, (s // 2) * 4 + 2 * d + s % 2) for d in range(2) for s in range(4)]
  axes = {c.kind: c.axes for c in analysis.collectives(compiled, mesh)}
  assert axes == {"all-to-all": ("stage",), "collective-permute": ("data", "stage")}


def _mesh():
  return jax.make_mesh((2, 4), ("data", "stage"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _ring_program(mesh, ticks=7):
  ring = [(i, (i + 1) % 4) for i in range(4)]

  def per_device(x, w):
    def tick(c, _):
      return lax.ppermute(jnp.tanh(c @ w[0]), "stage", ring), None

    c, _ = lax.scan(tick, lax.pcast(x, ("stage",), to="varying"), None, length=ticks)
    total = lax.psum(c, "data")
    gathered = lax.all_gather(c, "stage")
    return total + gathered.mean(0)

  return jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P("stage")),
                       out_specs=P("data"), check_vma=False)


def test_collectives_counts_bytes_and_axes():
  mesh = _mesh()
  c = _compile(_ring_program(mesh), jnp.ones((16, 32)), jnp.ones((4, 32, 32)))
  found = {x.kind: x for x in analysis.collectives(c, mesh)}
  assert set(found) == {"collective-permute", "all-reduce", "all-gather"}
  permute = found["collective-permute"]
  # One [8, 32] float32 block (8 rows of the 16 on each data shard) per tick, 7 ticks.
  assert (permute.bytes, permute.count, permute.in_loop, permute.axes) == (
      8 * 32 * 4, 7, True, ("stage",))
  reduce = found["all-reduce"]
  assert (reduce.bytes, reduce.count, reduce.in_loop, reduce.axes) == (
      8 * 32 * 4, 1, False, ("data",))
  gather = found["all-gather"]
  assert (gather.bytes, gather.axes, gather.group_size) == (4 * 8 * 32 * 4, ("stage",), 4)
  summary = analysis.summarize_collectives(list(found.values()))
  assert summary[("collective-permute", ("stage",))]["bytes"] == 7 * 8 * 32 * 4


def test_memory_breakdown_splits_arguments_per_device():
  mesh = _mesh()
  x = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(mesh, P("data")))
  w = jax.ShapeDtypeStruct((4, 32, 32), jnp.float32, sharding=NamedSharding(mesh, P("stage")))
  c = _compile(_ring_program(mesh), x, w)
  mem = analysis.memory_breakdown(c, {"batch": x, "params": w})
  stats = c.memory_analysis()
  assert mem.arguments == stats.argument_size_in_bytes == (8 * 32 + 32 * 32) * 4
  assert mem.inputs == {"batch": 8 * 32 * 4, "params": 32 * 32 * 4, "other": 0}
  assert mem.temporaries == stats.temp_size_in_bytes
  assert mem.total == (stats.argument_size_in_bytes + stats.output_size_in_bytes
                       - stats.alias_size_in_bytes + stats.temp_size_in_bytes
                       + stats.generated_code_size_in_bytes)


def test_input_bytes_per_device():
  mesh = _mesh()
  split = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P("stage")))
  replicated = jax.ShapeDtypeStruct((8,), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  first, largest = analysis.input_bytes({"a": split, "b": replicated})
  assert first == largest == 2 * 8 * 4 + 8 * 2
  no_sharding = jax.ShapeDtypeStruct((5,), jnp.float32)
  assert analysis.input_bytes([no_sharding]) == (20, 20)


def test_pipeline_flops_subtract_the_bubble_share():
  schedule = schedules.build("gpipe", num_stages=2, num_microbatches=3)  # 4 ticks, bubble 1/4.
  w = jnp.ones((16, 16))

  def f(x):
    def tick(c, _):
      return c @ w, None

    y, _ = lax.scan(tick, x, None, length=schedule.num_ticks)
    return y @ w  # one matmul outside the tick loop.

  c = _compile(f, jnp.ones((4, 16)))
  result = analysis.pipeline_flops(c, schedule)
  assert len(result.tick_loops) == 1
  assert 4 * DOT <= result.in_tick_loops <= 4 * DOT + 20
  assert result.bubble_fraction == pytest.approx(0.25)
  # No conditional in the loop: every tick runs its matmul, so all of it is executed.
  assert result.gated == 0 and result.executed == result.lockstep
  assert result.useful == pytest.approx(result.lockstep - 0.25 * result.in_tick_loops)
  assert result.useful_fraction < 1.0


def test_pipeline_flops_skip_the_idle_share_of_conditionals():
  schedule = schedules.build("gpipe", num_stages=2, num_microbatches=3)  # 4 ticks, bubble 1/4.
  w = jnp.ones((16, 16))

  def f(x, busy):
    def tick(c, b):
      return lax.cond(b, lambda c: c @ w, lambda c: c, c), None

    y, _ = lax.scan(tick, x, busy)
    return y

  c = _compile(f, jnp.ones((4, 16)), jnp.ones((schedule.num_ticks,), bool))
  result = analysis.pipeline_flops(c, schedule)
  assert 4 * DOT <= result.gated <= result.in_tick_loops <= 4 * DOT + 20
  assert result.executed == pytest.approx(result.lockstep - 0.25 * result.gated)
  assert result.useful_fraction == pytest.approx(1.0, abs=0.01)
  assert result.lockstep_efficiency == pytest.approx(0.75, abs=0.01)


def _fused_tick_program(schedule, branches):
  """A loop of ``schedule.num_ticks`` trips whose body switches over ``branches``: the shape of a
  fused schedule's compiled tick loop (:mod:`tpipe.core.loops.fused`)."""

  def f(x, index):
    y, _ = lax.scan(lambda c, i: (lax.switch(i, branches, c), None), x, index)
    return y

  return _compile(f, jnp.ones((4, 16)), jnp.zeros(schedule.num_ticks, jnp.int32))


def _matmuls(w, n):
  def run(c):
    for _ in range(n):
      c = c @ w
    return c
  return run


def test_fused_flops_weigh_each_chunk_programs_branch_by_the_table():
  # Interleaved 1F1B, S = 2, two chunks per stage: model chunks 0 and 2 share chunk program 0
  # (one matmul forward, two backward), chunks 1 and 3 program 1 (two forward, four backward).
  # The conditional has 1 + 2 * 2 branches: idle, F of programs 0 and 1, B of programs 0 and 1.
  schedule = schedules.build("interleaved_1f1b", 2, 2, 2)
  programs = [0, 1, 0, 1]
  w = jnp.ones((16, 16))
  compiled = _fused_tick_program(schedule, [lambda c: c] + [_matmuls(w, n) for n in (1, 2, 2, 4)])
  found = analysis.fused_flops(compiled, schedule, programs)
  np.testing.assert_array_equal(found.actions["F"], np.array([1, 2, 1, 2]) * DOT)
  np.testing.assert_array_equal(found.actions["B"], np.array([2, 4, 2, 4]) * DOT)
  assert np.isnan(found.actions["BI"]).all() and np.isnan(found.actions["W"]).all()
  assert found.costs() == {"F": 1.5 * DOT, "B": 3 * DOT}
  # Each table entry costs its chunk program's action, by hand from the table.
  per_tick = np.zeros(schedule.action.shape)
  for t, s in zip(*np.nonzero(schedule.busy)):
    v = schedule.virtual_stage[s, schedule.chunk[t, s]]
    per_tick[t, s] = (programs[v] + 1) * (1 if schedule.action[t, s] == schedules.Action.F
                                          else 2) * DOT
  np.testing.assert_array_equal(found.per_stage, per_tick.sum(axis=0))
  assert 0 <= found.overhead <= 100  # The loop counter's few integer ops per tick.
  assert found.lockstep == per_tick.max(axis=1).sum() + found.overhead
  assert found.useful == per_tick.sum() / 2
  assert found.executed == per_tick.sum(axis=0).max() + found.overhead
  # pipeline_flops and analyze take the same programs and report the same counts.
  for result in (analysis.pipeline_flops(compiled, schedule, programs=programs),
                 analysis.analyze(compiled, schedule=schedule, programs=programs).pipeline):
    assert (result.lockstep, result.executed, result.useful) == (
        found.lockstep, found.executed, found.useful)
    assert result.tick_loops == (found.tick_loop,)
    assert result.bubble_fraction == pytest.approx(schedule.bubble_fraction)
  # Without the programs, one per model chunk is assumed: 1 + 2 * 4 branches, not found.
  with pytest.raises(ValueError, match=r"conditionals of \[9\] branches was found; pass the "
                                       r"schedule the step was compiled with and its pipeline's "
                                       r"programs\(\)"):
    analysis.fused_flops(compiled, schedule)
  with pytest.raises(TypeError, match="use pipeline_flops for forward schedules"):
    analysis.fused_flops(compiled, schedules.build("gpipe", 2, 2))


def test_fused_flops_of_a_split_backward_count_bi_and_w():
  # ZB-H1, S = 2: one chunk program; the switch holds idle, F, BI and W (the table runs no B).
  schedule = schedules.build("zb_h1", 2, 2)
  assert tick_rows.lane_switches(schedule, [0, 0]) == [(0, 1, 3, 4)]
  w = jnp.ones((16, 16))
  compiled = _fused_tick_program(schedule, [lambda c: c] + [_matmuls(w, n) for n in (1, 1, 3)])
  found = analysis.fused_flops(compiled, schedule, programs=[0, 0])
  assert np.isnan(found.actions["B"]).all()
  assert {k: v.tolist() for k, v in found.actions.items() if k != "B"} == {
      "F": [DOT] * 2, "BI": [DOT] * 2, "W": [3 * DOT] * 2}
  assert found.costs() == {"F": DOT, "BI": DOT, "W": 3 * DOT}
  # Per stage: two F, two BI and two W.
  np.testing.assert_array_equal(found.per_stage, [2 * (1 + 1 + 3) * DOT] * 2)


def test_bad_inputs_raise_clear_errors():
  with pytest.raises(ValueError, match="ENTRY"):
    analysis.flop_count("not an hlo module")
  with pytest.raises(TypeError, match="compile"):
    analysis.flop_count(object())
  with pytest.raises(TypeError, match="jax.stages.Compiled"):
    analysis.memory_breakdown("text")
  c = _compile(lambda a: a + 1, jnp.ones(3))
  with pytest.raises(TypeError, match=r"tpipe.schedules.build\(name, S, M, R\)"):
    analysis.pipeline_flops(c, schedule="gpipe")
  with pytest.raises(TypeError, match="mapping"):
    analysis.memory_breakdown(c, inputs=[1, 2])


@pytest.mark.unit  # HLO text and numbers only: no JAX computation.
def test_format_bytes():
  assert analysis.format_bytes(512) == "512 B"
  assert analysis.format_bytes(1536) == "1.50 KiB"
  assert analysis.format_bytes(3 * 2**30) == "3.00 GiB"
  np.testing.assert_equal(analysis.format_bytes(0), "0 B")


def test_pipeline_flops_refuse_a_program_without_the_tick_loop():
  w = jnp.ones((16, 16))

  def f(x):
    y, _ = lax.scan(lambda c, _: (c @ w, None), x, None, length=3)
    return y

  c = _compile(f, jnp.ones((4, 16)))
  # gpipe(2, 3) has 4 ticks; the program's only loop runs 3 times.
  with pytest.raises(ValueError, match="No while loop with the schedule's 4 ticks"):
    analysis.pipeline_flops(c, schedules.build("gpipe", num_stages=2, num_microbatches=3))


def test_loops_without_a_trip_count_are_listed():
  w = jnp.ones((16, 16))

  def f(x):
    return lax.while_loop(lambda c: jnp.sum(c) < 1e6, lambda c: c @ w, x)

  flops = analysis.flop_count(_compile(f, jnp.ones((4, 16))))
  assert len(flops.loops_without_trip_count) == 1
  counted = analysis.flop_count(_compile(lambda x: lax.fori_loop(0, 3, lambda i, c: c @ w, x),
                                         jnp.ones((4, 16))))
  assert counted.loops_without_trip_count == ()
