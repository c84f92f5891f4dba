"""tpipe.core.planning.plan: units grouped into chunks, the plan's description (one and several
chunks per
stage, ZB-V's "v" placement included), and the abstract trace of every layer's input, whose
errors name both layers of a mismatch."""

import doctest
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpipe
from tpipe import partition
from tpipe.core.base import arguments
from tpipe.core.planning import plan as plan_lib
from tpipe.linen import layers as linen_layers

Group = plan_lib.Group

NAMES = ("layers_0 Embed", "layers_1[0] Block", "layers_1[1] Block", "layers_1[2] Block",
         "layers_1[3] Block", "layers_2 Head")
COSTS = (5.0, 2.0, 2.0, 2.0, 2.0, 3.0)
COPIES = (None, 4, None)  # Embed, 4 x Block, Head: six units.


@pytest.mark.unit
def test_group_units_by_hand():
  assert plan_lib.group_units(COPIES, (2, 1, 2, 1)) == (
      (Group(layer=0, first_unit=0, start=0, stop=1, repeated=False),
       Group(layer=1, first_unit=1, start=0, stop=1, repeated=True)),
      (Group(layer=1, first_unit=2, start=1, stop=2, repeated=True),),
      (Group(layer=1, first_unit=3, start=2, stop=4, repeated=True),),
      (Group(layer=2, first_unit=5, start=0, stop=1, repeated=False),),
  )
  # Plain layers only: one group per unit.
  assert plan_lib.group_units([None] * 3, (2, 1)) == (
      (Group(0, 0, 0, 1, False), Group(1, 1, 0, 1, False)), (Group(2, 2, 0, 1, False),))
  # A repeated layer alone, cut evenly: each chunk one group of its copies.
  groups = plan_lib.group_units([6], (2, 2, 2))
  assert [(g.start, g.stop, g.first_unit, g.size) for (g,) in groups] == [
      (0, 2, 0, 2), (2, 4, 2, 2), (4, 6, 4, 2)]
  # Two repeated layers meeting inside a chunk stay two groups.
  assert [[(g.layer, g.start, g.stop) for g in chunk]
          for chunk in plan_lib.group_units([3, 2], (2, 3))] == [
              [(0, 0, 2)], [(0, 2, 3), (1, 0, 2)]]


@pytest.mark.unit
@pytest.mark.parametrize("counts", [(2, 2), (3, 4), (7,)])
def test_group_units_needs_counts_that_cover_the_units(counts):
  with pytest.raises(ValueError, match=re.escape(f"counts {counts} sum to {sum(counts)}, not the "
                                                 "6 units of the layers.")):
    plan_lib.group_units(COPIES, counts)


def _plan(counts, num_stages, placement="loop"):
  return plan_lib.Plan(unit_names=NAMES, costs=COSTS, counts=counts,
                       groups=plan_lib.group_units(COPIES, counts), layer_inputs=(),
                       num_stages=num_stages, placement=placement)


@pytest.mark.unit
def test_describe_one_chunk_per_stage():
  plan = _plan((3, 3), 2)
  assert plan.num_chunks == 2 and [plan.stage_of(c) for c in range(2)] == [0, 1]
  assert plan.describe() == (
      "stage  units                              cost  share\n"
      "    0  layers_0 Embed..layers_1[1] Block     9  56.2%\n"
      "    1  layers_1[2] Block..layers_2 Head      7  43.8%\n"
      "imbalance (max / mean stage cost): 1.12")
  assert plan.describe() == partition.describe_split((3, 3), COSTS, names=NAMES)


@pytest.mark.unit
def test_describe_several_chunks_per_stage_says_where_each_runs():
  table = ("stage  units                                 cost  share\n"
           "    0  layers_0 Embed..layers_1[0] Block        7  43.8%\n"
           "    1  layers_1[1] Block                        2  12.5%\n"
           "    2  layers_1[2] Block..layers_1[3] Block     4  25.0%\n"
           "    3  layers_2 Head                            3  18.8%\n"
           "imbalance (max / mean stage cost): 1.75\n")
  loop = _plan((2, 1, 2, 1), 2)
  assert [loop.stage_of(c) for c in range(4)] == [0, 1, 0, 1]
  assert loop.describe() == table + (
      "(loop placement: chunk 0 -> stage 0, chunk 1 -> stage 1, chunk 2 -> stage 0, "
      "chunk 3 -> stage 1)")
  # ZB-V: chunk 0 goes down to stage 0, 1 to stage 1; chunk 2 comes back up on stage 1 and
  # chunk 3 (with the loss) ends on stage 0.
  v = _plan((2, 1, 2, 1), 2, placement="v")
  assert [v.stage_of(c) for c in range(4)] == [0, 1, 1, 0]
  assert v.describe() == table + (
      "(v placement: chunk 0 -> stage 0, chunk 1 -> stage 1, chunk 2 -> stage 1, "
      "chunk 3 -> stage 0)")
  # Circular with three chunks per stage.
  three = _plan((1,) * 6, 2)
  assert three.describe().endswith(
      "(loop placement: chunk 0 -> stage 0, chunk 1 -> stage 1, chunk 2 -> stage 0, "
      "chunk 3 -> stage 1, chunk 4 -> stage 0, chunk 5 -> stage 1)")


class TakesThree(nn.Module):
  """Needs an input with 3 features (its kernel is [3, 2])."""

  @nn.compact
  def __call__(self, x):
    return x @ self.param("kernel", nn.initializers.ones, (3, 2))


class Widen(nn.Module):
  """Doubles the features: a repeated layer may not do that."""

  @nn.compact
  def __call__(self, x):
    return jnp.concatenate([x, nn.Dense(x.shape[-1])(x)], axis=-1)


def _trace(modules, copies, x, params, owner="tpipe.Sequential"):
  layers = [linen_layers.as_layer(m, c, owner) for m, c in zip(modules, copies)]
  split = arguments.split_keywords({}, per_example=(), batch_size=x.shape[0], owner=owner)
  return plan_lib.trace_inputs(layers, params, {}, x, plan_lib.Calls(split, owner=owner))


def _shapes(*shapes):
  return {f"layers_{i}": jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), tree,
                                      is_leaf=lambda s: isinstance(s, tuple))
          for i, tree in enumerate(shapes)}


def test_trace_inputs_gives_every_layer_input_and_the_output():
  x = jax.ShapeDtypeStruct((2, 5), jnp.float32)
  params = _shapes({"kernel": (5, 3), "bias": (3,)}, {"kernel": (4, 3, 3), "bias": (4, 3)},
                   {"kernel": (3, 2)})
  traced = _trace([nn.Dense(3), nn.Dense(3), TakesThree()], [None, 4, None], x, params)
  inputs = traced.layer_inputs
  assert traced.momenta == {}  # No running statistics.
  assert [(a.shape, a.dtype) for a in inputs] == [((2, 5), jnp.float32), ((2, 3), jnp.float32),
                                                  ((2, 3), jnp.float32), ((2, 2), jnp.float32)]


def test_trace_inputs_returns_the_momenta_of_training_mode_normalizations():
  # Two BatchNorms, momenta 0.8 and 0.5; the second runs on its running averages (nothing to
  # update), so only the first one's momentum comes back, keyed by layer and path.
  class Normed(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.BatchNorm(use_running_average=False, momentum=0.8, name="train")(x)
      return nn.BatchNorm(use_running_average=True, momentum=0.5, name="frozen")(x)

  x = jax.ShapeDtypeStruct((2, 3), jnp.float32)
  layers = [linen_layers.as_layer(nn.Dense(3), None, "t"), linen_layers.as_layer(Normed(), 2, "t")]
  variables = jax.eval_shape(Normed().init, jax.random.key(0), jnp.zeros((2, 3)))
  stacked = jax.tree.map(lambda a: jax.ShapeDtypeStruct((2, *a.shape), a.dtype), variables)
  params = {"layers_0": _shapes({"kernel": (3, 3), "bias": (3,)})["layers_0"],
            "layers_1": stacked["params"]}
  stats = {"layers_0": {}, "layers_1": stacked["batch_stats"]}
  split = arguments.split_keywords({}, per_example=(), batch_size=2, owner="t")
  traced = plan_lib.trace_inputs(layers, params, stats, x, plan_lib.Calls(split, owner="t"))
  assert traced.momenta == {(1, ("train",)): 0.8}
  assert traced.layer_inputs[-1].shape == (2, 3)


def test_trace_inputs_error_names_both_layers_of_a_mismatch():
  # layers[1] takes 3 features; layers[0] gives it 4.
  x = jax.ShapeDtypeStruct((2, 5), jnp.float32)
  params = _shapes({"kernel": (5, 4), "bias": (4,)}, {"kernel": (3, 2)})
  with pytest.raises(TypeError, match=r"^tpipe\.Sequential: layers\[1\] \(TakesThree\) failed on "
                                      r"the output of layers\[0\] \(Dense\), \(\(2, 4\), "
                                      r"'float32'\): TypeError: .*dot_general"):
    _trace([nn.Dense(4), TakesThree()], [None, None], x, params)
  # The first layer is reported against the pipeline's input.
  with pytest.raises(TypeError, match=r"^tpipe\.nnx\.Sequential: layers\[0\] \(TakesThree\) "
                                      r"failed on the pipeline's input, \(\(2, 5\), 'float32'\)"):
    _trace([TakesThree()], [None], x, _shapes({"kernel": (3, 2)}), owner="tpipe.nnx.Sequential")


def test_trace_inputs_refuses_a_repeated_layer_that_changes_its_input():
  x = jax.ShapeDtypeStruct((2, 3), jnp.float32)
  params = _shapes({"Dense_0": {"kernel": (2, 3, 3), "bias": (2, 3)}})
  with pytest.raises(ValueError, match=r"^tpipe\.Sequential: layers\[0\] repeats Widen, which "
                                       r"maps \(\(2, 3\), 'float32'\) to \(\(2, 6\), 'float32'\); "
                                       r"a repeated layer must keep its input's structure, shapes "
                                       r"and dtypes"):
    _trace([Widen()], [2], x, params)


@pytest.mark.parametrize("call", ["plan_for", "apply", "init"])
def test_a_sequential_whose_layers_do_not_fit_names_both_layers(call):
  # layers[1] takes 3 features; layers[0] gives it 4. Every entry point says so.
  model = tpipe.Sequential([nn.Dense(4), TakesThree()], num_stages=1, num_microbatches=2)
  x = jnp.ones((4, 5))
  params = {"layers_0": {"kernel": jnp.ones((5, 4)), "bias": jnp.ones(4)},
            "layers_1": {"kernel": jnp.ones((3, 2))}}
  calls = {"plan_for": lambda: model.plan_for(x),
           "apply": lambda: model.apply({"params": params}, x),
           "init": lambda: model.init(jax.random.key(0), x)}
  with pytest.raises(TypeError, match=r"^tpipe\.Sequential: layers\[1\] \(TakesThree\) failed on "
                                      r"the output of layers\[0\] \(Dense\), \(\(2, 4\), "
                                      r"'float32'\): TypeError: .*dot_general"):
    jax.eval_shape(calls[call])


def test_make_plan_balances_unit_costs_and_groups_them():
  x = jax.ShapeDtypeStruct((2, 3), jnp.float32)
  params = _shapes({"kernel": (3, 4), "bias": (4,)},
                   {"kernel": (3, 4, 4), "bias": (3, 4)}, {"kernel": (4, 2), "bias": (2,)})
  modules, copies = [nn.Dense(4), nn.Dense(4), nn.Dense(2)], [None, 3, None]
  layers = [linen_layers.as_layer(m, c, "tpipe.Sequential") for m, c in zip(modules, copies)]
  split = arguments.split_keywords({}, per_example=(), batch_size=2, owner="tpipe.Sequential")
  calls = plan_lib.Calls(split, owner="tpipe.Sequential")
  inputs = plan_lib.trace_inputs(layers, params, {}, x, calls)
  spec = tpipe.PipelineSpec(num_stages=2, num_microbatches=1)
  plan = plan_lib.make_plan(layers, spec, params, {}, inputs, calls)
  # Parameter counts 16 | 20 20 20 | 10: the best split of the 86 is 36 | 50.
  assert plan.costs == (16.0, 20.0, 20.0, 20.0, 10.0)
  assert plan.counts == (2, 3) == partition.balanced_split(plan.costs, 2)
  assert plan.unit_names == ("layers_0 Dense", "layers_1[0] Dense", "layers_1[1] Dense",
                             "layers_1[2] Dense", "layers_2 Dense")
  assert plan.groups == plan_lib.group_units(copies, (2, 3))
  assert (plan.chunk_input(1).shape, plan.chunk_output(0).shape) == ((2, 4), (2, 4))
  assert plan.chunk_output(1).shape == (2, 2)
  explicit = plan_lib.make_plan(layers, spec.replace(balance=[4, 1]), params, {}, inputs, calls)
  assert explicit.counts == (4, 1) and explicit.costs == plan.costs  # Parameter counts shown.
  with pytest.raises(ValueError, match=r"balance=\[1, 1\] sums to 2 layer units but the model "
                                       r"has 5"):
    plan_lib.make_plan(layers, spec.replace(balance=[1, 1]), params, {}, inputs, calls)
  with pytest.raises(ValueError, match=r"the layers have 5 units but num_stages \* num_repeats = "
                                       r"6 chunks need at least one each"):
    plan_lib.make_plan(layers, spec.replace(schedule="circular", num_repeats=3), params, {},
                       inputs, calls)


def test_a_models_plan_for_zbv_describes_the_v_placement():
  model = tpipe.Sequential([nn.Dense(4), tpipe.Repeat(nn.Dense(4), 2), nn.Dense(2)],
                           num_stages=2, num_microbatches=2, schedule="zbv", num_repeats=2,
                           balance=[1, 1, 1, 1], mesh=tpipe.make_mesh(stages=2))
  plan = model.plan_for(jax.ShapeDtypeStruct((4, 3), jnp.float32))
  assert (plan.placement, plan.num_stages, plan.counts) == ("v", 2, (1, 1, 1, 1))
  placement, costs = plan.describe().split("\n")[-2:]
  assert placement == ("(v placement: chunk 0 -> stage 0, chunk 1 -> stage 1, chunk 2 -> "
                       "stage 1, chunk 3 -> stage 0)")
  assert costs.startswith("compound ticks for per-action costs B = ") and plan.tick_costs
  assert np.isclose(sum(plan.costs), (3 * 4 + 4) + 2 * (4 * 4 + 4) + (4 * 2 + 2))


@pytest.mark.unit
def test_module_doctests_pass():
  result = doctest.testmod(plan_lib)
  assert result.attempted >= 1 and result.failed == 0
