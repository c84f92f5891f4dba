"""``tpipe.tools.peak``: the buffers live at a compiled step's memory peak, each with a role."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import tpipe
from tpipe.tools import peak

# A loop whose carried value starts as zeros made in the forward pass (a stash), a body
# parameter and the loop's result aliasing it, and a parameter argument.
HLO = '''HloModule m

%body (p: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %p = (s32[], f32[8,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[8,4]{1,0}) %p), index=0
  %buf = f32[8,4]{1,0} get-tuple-element((s32[], f32[8,4]{1,0}) %p), index=1
  ROOT %t = (s32[], f32[8,4]{1,0}) tuple(s32[] %i, f32[8,4]{1,0} %buf)
}

%cond (q: (s32[], f32[8,4])) -> pred[] {
  %q = (s32[], f32[8,4]{1,0}) parameter(0)
  ROOT %c = pred[] constant(false)
}

ENTRY %main (w: f32[4,4], o: f32[4,4]) -> f32[8,4] {
  %w = f32[4,4]{1,0} parameter(0), metadata={op_name="state.params['kernel']"}
  %o = f32[4,4]{1,0} parameter(1), metadata={op_name="state.opt_state[0].mu['kernel']"}
  %z = f32[8,4]{1,0} broadcast(f32[] %zero), metadata={op_name="jit(step)/jvp()/broadcast"}
  %g = f32[4,4]{1,0} add(f32[4,4]{1,0} %w, f32[4,4]{1,0} %w), metadata={op_name="jit(step)/add"}
  %c16 = bf16[4,4]{1,0} convert(f32[4,4]{1,0} %w), metadata={op_name="jit(step)/convert"}
  %s = s32[] constant(0)
  %init = (s32[], f32[8,4]{1,0}) tuple(s32[] %s, f32[8,4]{1,0} %z)
  %loop = (s32[], f32[8,4]{1,0}) while((s32[], f32[8,4]{1,0}) %init), condition=%cond, body=%body
  ROOT %out = f32[8,4]{1,0} get-tuple-element((s32[], f32[8,4]{1,0}) %loop), index=1
}'''

LIVE = '''HloLiveRange (max 9):
  Live ranges at 7 (peak):
    w{}: 64 bytes (cumulative: 64 bytes)
    o{}: 64 bytes (cumulative: 128 bytes)
    z{}: 128 bytes (cumulative: 256 bytes)
    p{1}: 128 bytes (cumulative: 384 bytes)
    g{}: 64 bytes (cumulative: 448 bytes)
    c16{}: 32 bytes (cumulative: 480 bytes)
  Stack trace breakdown for peak usage: 480 bytes'''

ASSIGNMENT = '''allocation 0: size 64, parameter 0, shape |f32[4,4]| at ShapeIndex {}:
 value: <1 w @0> (size=64,offset=0): f32[4,4]{1,0}
allocation 1: size 64, parameter 1, shape |f32[4,4]| at ShapeIndex {}:
 value: <2 o @0> (size=64,offset=0): f32[4,4]{1,0}
allocation 2: size 2048, preallocated-temp:
 value: <3 z @0> (size=512,offset=0): f32[8,4]{1,0}
 value: <4 p{1} (phi) @0> (size=512,offset=0): f32[8,4]{1,0}
 value: <5 g @0> (size=64,offset=512): f32[4,4]{1,0}
 value: <6 c16 @0> (size=32,offset=576): bf16[4,4]{1,0}'''


@pytest.mark.unit  # Text only.
def test_roles_from_the_origin_of_each_value():
  values = {v.name: v for v in peak.peak_values(LIVE, HLO)}
  assert {n: v.role for n, v in values.items()} == {
      "w{}": "parameters", "o{}": "optimizer state", "z{}": "forward working set",
      "p{1}": "stash", "g{}": "gradient accumulators", "c16{}": "weight casts"}
  # The loop's body parameter is traced to the zeros that started it.
  assert values["p{1}"].origin == "jit(step)/jvp()/broadcast"
  assert values["p{1}"].shape == "f32[8,4]"


@pytest.mark.unit  # Text only.
def test_values_sharing_a_buffer_count_once_at_the_allocated_size():
  values = peak.peak_values(LIVE, HLO, assignment_text=ASSIGNMENT)
  breakdown = peak.PeakBreakdown(tuple(values))
  # z and p{1} are one buffer (offset 0 of the temp allocation), 512 bytes with padding; it is
  # named by the more specific role (the loop's stash, not the zeros' working set).
  assert [(v.name, v.bytes, v.role) for v in values] == [
      ("p{1}", 512, "stash"), ("w{}", 64, "parameters"), ("o{}", 64, "optimizer state"),
      ("g{}", 64, "gradient accumulators"), ("c16{}", 32, "weight casts")]
  assert breakdown.total == 736 and breakdown.arguments == 128
  assert breakdown.temporaries == 608 and breakdown.unexplained == 0
  assert breakdown.by_role()["stash"] == 512
  assert peak.temporary_allocation(ASSIGNMENT) == 2048
  assert "| stash | 512 B | 69.6% |" in breakdown.format()


@pytest.mark.unit  # Text only.
def test_a_temporary_kept_in_an_output_buffer_is_not_counted_in_the_temporaries_allocation():
  # g (a gradient sum) lives in the buffer of an output that is not a donated argument, as the
  # TPU compiler keeps the gradient sums in the new parameters' buffers.
  assignment = ASSIGNMENT.replace(
      " value: <5 g @0> (size=64,offset=512): f32[4,4]{1,0}\n", "") + (
      "\nallocation 3: size 64, maybe-live-out:\n"
      " value: <5 g @0> (size=64,offset=0): f32[4,4]{1,0}")
  assert peak.output_allocations(assignment) == {3}
  values = {v.name: v for v in peak.peak_values(LIVE, HLO, assignment_text=assignment)}
  assert [n for n, v in values.items() if v.in_output] == ["g{}"]
  breakdown = peak.PeakBreakdown(tuple(values.values()))
  assert breakdown.temporaries == 608 and breakdown.in_outputs == 64
  assert breakdown.in_temporaries == 544
  # Donated arguments' buffers may hold outputs too; the arguments themselves are not counted.
  donated = assignment.replace("parameter 0, shape |f32[4,4]| at ShapeIndex {}:",
                               "parameter 0, shape |f32[4,4]| at ShapeIndex {}, maybe-live-out:")
  assert peak.output_allocations(donated) == {0, 3}
  values = peak.peak_values(LIVE, HLO, assignment_text=donated)
  assert peak.PeakBreakdown(tuple(values)).in_outputs == 64


# The same program's values with their schedule positions; the dump's own (peak) section names
# position 3, where fewer bytes are in use than at 5.
RANGES = '''HloLiveRange (max 9):
  BufferLiveRange:
    w{}:0-9
    o{}:0-9
    z{}:2-4
    c16{}:3-3
    p{1}:4-8
    g{}:5-6
  Live ranges at 3 (peak):
    w{}: 64 bytes (cumulative: 64 bytes)
    o{}: 64 bytes (cumulative: 128 bytes)
    z{}: 128 bytes (cumulative: 256 bytes)
    c16{}: 32 bytes (cumulative: 288 bytes)'''


@pytest.mark.unit  # Text only.
def test_the_peak_is_where_the_assigned_buffers_hold_the_most_bytes():
  ranges = peak.parse_live_ranges(RANGES)
  assert ranges[3] == ("c16", (), 3, 3) and ranges[4] == ("p", (1,), 4, 8)
  placed = peak.parse_assignment(ASSIGNMENT)
  # At 3: w, o, z and c16 (672 bytes); at 4, z and the loop's p{1} are one buffer (640); at 5:
  # w, o, p{1} and g (704).
  assert peak.busiest_time(ranges, placed) == 5
  values = peak.peak_values(RANGES, HLO, assignment_text=ASSIGNMENT)
  assert [(v.name, v.bytes) for v in values] == [
      ("p{1}", 512), ("w{}", 64), ("o{}", 64), ("g{}", 64)]
  # Without the assignment, the dump's own list.
  assert [v.name for v in peak.peak_values(RANGES, HLO)] == ["z{}", "w{}", "o{}", "c16{}"]
  assert peak.busiest_time(ranges, {}) is None


# After the loop: the head's weight gradient copied by a layout copy XLA inserted (no name of
# its own), and a gradient summed over devices, copied on its way.
UNNAMED_HLO = '''HloModule m

ENTRY %main (w: f32[8,4], x: f32[64]) -> f32[64] {
  %w = f32[8,4]{1,0} parameter(0), metadata={op_name="state.params['kernel']"}
  %x = f32[64]{0} parameter(1), metadata={op_name="batch['inputs']"}
  %a = f32[8,4]{1,0} add(f32[8,4]{1,0} %w, f32[8,4]{1,0} %w)
  %h = f32[4,8]{1,0} transpose(%a), dimensions={1,0}, metadata={op_name="f/LMHead/dot"}
  %hc = f32[4,8]{0,1} copy(f32[4,8]{1,0} %h)
  %g = f32[64]{0} negate(f32[64]{0} %x)
  %gc = f32[64]{0} copy(f32[64]{0} %g)
  ROOT %s = f32[64]{0} all-reduce(f32[64]{0} %gc), replica_groups={{0,1}}, to_apply=%add
}'''

UNNAMED_LIVE = '''  Live ranges at 5 (peak):
    hc{}: 128 bytes (cumulative: 128 bytes)
    gc{}: 256 bytes (cumulative: 384 bytes)
    s{}: 256 bytes (cumulative: 640 bytes)'''


@pytest.mark.unit  # Text only.
def test_unnamed_copies_take_their_sources_name_and_device_sums_are_gradients():
  roles = {v.name: v.role for v in peak.peak_values(UNNAMED_LIVE, UNNAMED_HLO)}
  assert roles == {"hc{}": "logits and loss", "gc{}": "gradient accumulators",
                   "s{}": "gradient accumulators"}


# Circular R = 2: a stacked weight's staged argument is [R, 1, k, ...] on a device; the tick loop
# reads it, and sums its gradient, without the stage axis, [R, k, ...].
VIEW_HLO = '''HloModule m

ENTRY %main (w: f32[2,1,3,4]) -> f32[2,3,4] {
  %w = f32[2,1,3,4]{3,2,1,0} parameter(0), metadata={op_name="state.params['stacked']['kernel']"}
  %v = f32[2,3,4]{2,1,0} bitcast(f32[2,1,3,4]{3,2,1,0} %w)
  ROOT %g = f32[2,3,4]{2,1,0} add(f32[2,3,4]{2,1,0} %v, f32[2,3,4]{2,1,0} %v),
    metadata={op_name="jit(step)/while/body/cond"}
}'''

VIEW_LIVE = '''HloLiveRange (max 3):
  Live ranges at 2 (peak):
    w{}: 96 bytes (cumulative: 96 bytes)
    g{}: 96 bytes (cumulative: 192 bytes)
  Stack trace breakdown for peak usage: 192 bytes'''


@pytest.mark.unit  # Text only.
def test_a_gradient_shaped_like_a_devices_view_of_its_weight_is_an_accumulator():
  roles = {v.name: v.role for v in peak.peak_values(VIEW_LIVE, VIEW_HLO)}
  assert roles == {"w{}": "parameters", "g{}": "gradient accumulators"}


@pytest.mark.unit  # Text only.
def test_a_dump_without_a_peak_section_is_refused():
  with pytest.raises(ValueError, match="no 'Live ranges at N \\(peak\\):' section"):
    peak.parse_peak("HloLiveRange (max 1):\n")
  with pytest.raises(FileNotFoundError, match="no \\*after_optimizations-live-range.txt"):
    peak.read_dump("/nonexistent")


class Block(nn.Module):

  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(4 * x.shape[-1])(x)))


def test_a_gpipe_step_on_cpu_is_explained():
  """The compiled train step of a 4-stage stack: the parameters and their gradient sums are
  live at the peak with the same bytes, the forward loop's stash is named, and what no rule
  explains is under a tenth of the temporaries."""
  mesh = tpipe.make_mesh(stages=4)
  model = tpipe.pipeline(Block, length=8, num_stages=4, num_microbatches=8, remat="full",
                         mesh=mesh)()
  x = jnp.ones((64, 128))
  params = {"blocks": model.init(jax.random.key(0), x)["params"]}
  optimizer = optax.sgd(0.1)
  state = tpipe.create_train_state(params, optimizer,
                                   tpipe.shardings(params, mesh, ("blocks",)))
  loss = lambda p, b, rng: jnp.mean(model.apply({"params": p["blocks"]}, b) ** 2)
  step = tpipe.make_train_step(loss, optimizer,
                               shardings=jax.tree.map(lambda a: a.sharding, state))
  lowered = step.lower(state, jax.device_put(x, tpipe.data_sharding(mesh)), jax.random.key(0))
  compiled, breakdown = peak.breakdown_of_lowered(lowered)
  roles = breakdown.by_role()
  per_device = sum(a.size * 4 for a in jax.tree.leaves(params)) // 4  # one stage's parameters
  assert roles["parameters"] == per_device, roles
  assert roles["gradient accumulators"] >= per_device, roles
  # The stash: at least every micro-batch's stage input (8 micro-batches of 8 rows of 128).
  assert roles["stash"] >= 8 * 8 * 128 * 4, breakdown.format(30)
  assert breakdown.unexplained < 0.1 * breakdown.temporaries, breakdown.format()
  memory = compiled.memory_analysis()
  assert breakdown.in_temporaries <= breakdown.allocated_temporaries <= memory.temp_size_in_bytes
  # The new parameters are not donated: the compiler may keep values of the step (the gradient
  # sums on the TPU, a parameter copy here) in their output buffers before the update writes
  # them; those are the only output buffers (SGD has no state), so they hold no more than that.
  assert 0 < breakdown.in_outputs <= per_device, breakdown.format(30)


@pytest.mark.unit
def test_the_scopes_it_reads_are_the_ones_the_tick_loops_write():
  from tpipe.core.base import spmd  # pylint: disable=g-import-not-at-top

  assert set(peak.SCOPE_ROLES) == {spmd.MAILBOX_SCOPE, spmd.BOUNDARY_SCOPE, spmd.STASH_SCOPE,
                                   spmd.GRADIENTS_SCOPE}


# A packed parameter buffer, cast whole, passed to a conditional branch that slices and
# re-shapes one weight out of it; and a same-dtype slice of it (a parameter copy).
PACKED_HLO = '''HloModule m

%b0 (b: bf16[24]) -> bf16[4,4] {
  %b = bf16[24]{0} parameter(0)
  %piece = bf16[16]{0} slice(bf16[24]{0} %b), slice={[0:16]}, metadata={op_name="jvp()/slice"}
  ROOT %kernel = bf16[4,4]{1,0} reshape(bf16[16]{0} %piece), metadata={op_name="LMHead/head"}
}

%b1 (c: bf16[24]) -> bf16[4,4] {
  %c = bf16[24]{0} parameter(0)
  ROOT %zeros = bf16[4,4]{1,0} broadcast(bf16[] %c), dimensions={}
}

ENTRY %main (packed: f32[24], i: s32[]) -> bf16[4,4] {
  %packed = f32[24]{0} parameter(0), metadata={op_name="state.params['packed']"}
  %i = s32[] parameter(1), metadata={op_name="batch"}
  %cast = bf16[24]{0} convert(f32[24]{0} %packed), metadata={op_name="jit(step)/jvp()/convert"}
  %copy = f32[16]{0} slice(f32[24]{0} %packed), slice={[8:24]}, metadata={op_name="jit(step)/slice"}
  ROOT %head = bf16[4,4]{1,0} conditional(%i, %cast, %cast), branch_computations={%b0, %b1}
}'''

PACKED_LIVE = '''  Live ranges at 3 (peak):
    packed{}: 96 bytes (cumulative: 96 bytes)
    cast{}: 48 bytes (cumulative: 144 bytes)
    copy{}: 64 bytes (cumulative: 208 bytes)
    piece{}: 32 bytes (cumulative: 240 bytes)
    kernel{}: 32 bytes (cumulative: 272 bytes)'''


@pytest.mark.unit  # Text only.
def test_casts_and_copies_of_a_packed_parameter_are_found_through_branches():
  roles = {v.name: v.role for v in peak.peak_values(PACKED_LIVE, PACKED_HLO)}
  # The slice and re-shaping inside the branch are weight casts though the branch's name stack
  # says LMHead (without the lineage rule the re-shaping counted as logits).
  assert roles == {"packed{}": "parameters", "cast{}": "weight casts",
                   "copy{}": "parameter copies", "piece{}": "weight casts",
                   "kernel{}": "weight casts"}
