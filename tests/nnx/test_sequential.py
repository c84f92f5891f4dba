"""tpipe.nnx.Sequential: NNX layers, pipelined, equal the layers applied in order.

Outputs and parameter gradients (through ``nnx.value_and_grad`` inside ``nnx.jit``) against a
float64 run of the plain model (the same NNX layers called one after another;
:mod:`tests.helpers.nnx_models`), for an MLP whose width changes and an LM (embedding ->
Repeat(block) -> head with per-example targets and loss), over a handful of (schedule, stages,
micro-batches, data) combinations. With every fused schedule (``FUSED_SCHEDULE_NAMES``, e.g.
``"1f1b"``) the LM's ``loss`` method returns its mean loss, whose value and gradients equal the
plain model's for S in {1, 2, 4} and data in {1, 2}, and calling the model returns the per-example
losses as under every schedule; the loss of a stack whose last layer returns no per-example
losses is refused, and so is differentiating a fused schedule's outputs. Also: the Param state's
names do not depend on the pipeline, the logical variables (``model.variables()``) are the Param
state by ``layers_i`` and load back, an ``nnx.Optimizer`` step runs under ``nnx.jit`` and equals
the plain model's step, the second step runs the first one's compiled program (the state comes
back where it was, with or without ``tpipe.nnx.shard``), bad arguments raise clear errors, a
layer's sown ``nnx.Intermediate`` values are refused (the pipeline would drop them), and dropout
masks come from the stack's rngs, not from the layout.
"""

import contextlib
import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import tpipe
from tests.helpers import nnx_models
from tests.helpers import numerics
from tpipe import nnx as tnnx

BATCH = nnx_models.BATCH
WIDTH = nnx_models.WIDTH
FUSED = tpipe.schedules.FUSED_SCHEDULE_NAMES

# (name, schedule, stages, micro-batches, data): each model with both schedules, S in {1, 2, 4},
# M = S and M > S, data in {1, 2}, each schedule with both data sizes. The fused schedules
# through NNX: below, and tests/test_heterogeneous_ends.py.
CASES = [("mlp", "gpipe", 1, 2, 2), ("lm", "gpipe", 4, 8, 1), ("lm", "circular", 2, 4, 2),
         ("mlp", "circular", 4, 4, 1)]


@pytest.mark.parametrize("name,schedule,stages,microbatches,data", CASES)
def test_outputs_and_gradients_equal_the_layers_in_order(name, schedule, stages, microbatches,
                                                         data):
  mesh = tpipe.make_mesh(stages=stages, data=data)
  model, x, kwargs = nnx_models.pipelined(
      name, num_stages=stages, num_microbatches=microbatches, schedule=schedule,
      num_repeats=2 if schedule == "circular" else 1, mesh=mesh)
  x, kwargs = jax.device_put((x, kwargs), tpipe.data_sharding(mesh))
  (_, y), grads = nnx_models.value_and_grad(model, x, kwargs)
  (_, y64), grads64 = nnx_models.reference(name)
  (_, plain_y), plain_grads = nnx_models.plain(name, microbatches * data)
  # The Sequential's Param state is layers[i]; the plain model's, a List of the layers, is [i].
  grads = nnx.to_pure_dict(grads)["layers"]
  numerics.assert_as_close_as_plain(y, plain_y, y64, what="outputs")
  numerics.assert_as_close_as_plain(grads, plain_grads, grads64, what="gradients")


# (schedule, stages, micro-batches per replica, data): every fused schedule once (the schedules
# themselves are checked on linen stacks in tests/linen; here the NNX plumbing), M < S, M = S,
# M > S, S in {1, 2, 4}, data in {1, 2}.
FUSED_CASES = [("1f1b", 1, 2, 2), ("interleaved_1f1b", 2, 4, 2), ("zb_h1", 4, 2, 1),
               ("zbv", 2, 2, 2)]
# Compound ticks (tick_costs): a forward, a backward and weight work in one tick. One case, with
# a split backward (BI and W), for the NNX plumbing; the compound tables themselves are checked on
# every fused schedule in tests/core/test_compound.py.
COMPOUND_COSTS = {"F": 1.0, "B": 3.0, "BI": 2.0, "W": 1.0}
COMPOUND_CASES = [("zbv", 2, 4, 2)]


def test_the_fused_cases_cover_every_fused_schedule():
  assert {case[0] for case in FUSED_CASES} == set(FUSED)


@pytest.mark.parametrize("schedule,stages,microbatches,data,costs",
                         [case + (None,) for case in FUSED_CASES]
                         + [case + (COMPOUND_COSTS,) for case in COMPOUND_CASES])
def test_fused_schedules_give_the_mean_loss_and_its_gradients(schedule, stages, microbatches,
                                                              data, costs):
  mesh = tpipe.make_mesh(stages=stages, data=data)
  model, x, kwargs = nnx_models.pipelined(
      "lm", num_stages=stages, num_microbatches=microbatches, schedule=schedule,
      num_repeats=nnx_models.fused_repeats(schedule), mesh=mesh, tick_costs=costs)
  assert model.spec.table.is_compound == (costs is not None)
  x, kwargs = jax.device_put((x, kwargs), tpipe.data_sharding(mesh))

  @nnx.jit
  def value_and_grad(model, x, kwargs):
    return nnx.value_and_grad(lambda m: nnx_models.objective(m.loss(x, **kwargs)))(model)

  value, grads = value_and_grad(model, x, kwargs)
  assert value.shape == ()
  plain_value, plain_grads = nnx_models.plain_loss(microbatches * data)
  ref_value, ref_grads = nnx_models.plain_loss(1, "float64")
  numerics.assert_as_close_as_plain(value, plain_value, ref_value, what="loss")
  numerics.assert_as_close_as_plain(nnx.to_pure_dict(grads)["layers"], plain_grads, ref_grads,
                                    what="gradients")
  # One return convention: calling the model gives the per-example losses (the table's forward
  # pass), as under every schedule.
  losses = nnx.jit(lambda m, x, kw: m(x, **kw))(model, x, kwargs)
  assert losses.shape == (BATCH,)
  numerics.assert_as_close_as_plain(losses, nnx_models.plain_losses(microbatches * data),
                                    nnx_models.plain_losses(1, "float64"), what="losses")


@pytest.mark.parametrize("schedule", FUSED)
def test_a_fused_stack_needs_per_example_losses_and_differentiates_its_loss(schedule):
  model, x, _ = nnx_models.pipelined(
      "mlp", num_stages=2, num_microbatches=2, schedule=schedule,
      num_repeats=nnx_models.fused_repeats(schedule), mesh=tpipe.make_mesh(stages=2))
  # The outputs are the last layer's, as under every schedule.
  assert nnx.eval_shape(lambda m: m(x), model).shape == (BATCH, 4)
  with pytest.raises(ValueError, match=r"mean of the last layer's per-example losses.*"
                                       r"End the layers with one that computes each example's"):
    nnx.eval_shape(lambda m: nnx.grad(lambda m: m.loss(x))(m), model)
  with pytest.raises(ValueError, match=rf"schedule='{schedule}'.*differentiate the loss "
                                       r"instead.*model\.loss"):
    nnx.eval_shape(lambda m: nnx.grad(lambda m: nnx_models.weighted(m(x)))(m), model)


def test_the_check_fails_for_layers_out_of_order():
  """The Repeat's copies reversed, in the MLP's case on 4 stages (whose compiled program
  ``nnx.jit`` finds again for this model of the same structure)."""
  name, schedule, stages, microbatches, data = case = ("mlp", "circular", 4, 4, 1)
  assert case in CASES
  mesh = tpipe.make_mesh(stages=stages, data=data)
  model, x, kwargs = nnx_models.pipelined(name, num_stages=stages, num_microbatches=microbatches,
                                          schedule=schedule, num_repeats=2, mesh=mesh)
  x, kwargs = jax.device_put((x, kwargs), tpipe.data_sharding(mesh))
  kernel = model.layers[1].layer.linear.kernel
  kernel[...] = kernel[...][::-1]
  (_, y), _ = nnx_models.value_and_grad(model, x, kwargs)
  (_, y64), _ = nnx_models.reference("mlp")
  (_, plain_y), _ = nnx_models.plain("mlp", microbatches * data)
  with pytest.raises(AssertionError):
    numerics.assert_as_close_as_plain(y, plain_y, y64, what="outputs")


def test_param_state_has_one_entry_per_layer_whatever_the_pipeline():
  trees = []
  for stages, schedule, repeats, balance in ((1, "gpipe", 1, "params"), (4, "gpipe", 1, "params"),
                                             (2, "circular", 2, [1, 3, 3, 1])):
    model, _, _ = nnx_models.pipelined("lm", num_stages=stages, num_microbatches=4,
                                       schedule=schedule, num_repeats=repeats, balance=balance,
                                       mesh=tpipe.make_mesh(stages=stages))
    trees.append(nnx.state(model, nnx.Param))
  paths = [path for path, _ in nnx.to_flat_state(trees[0])]
  assert {path[:2] for path in paths} == {("layers", 0), ("layers", 1), ("layers", 2)}
  assert ("layers", 1, "layer", "up", "kernel") in paths
  assert trees[0]["layers"][1]["layer"]["up"]["kernel"][...].shape == (6, WIDTH, 2 * WIDTH)
  for tree in trees[1:]:
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(tree),
                 nnx.to_pure_dict(trees[0]))
  kernels = trees[0]["layers"][1]["layer"]["up"]["kernel"][...]
  assert not np.allclose(kernels[0], kernels[1]), "each copy needs its own initial values"


def test_variables_are_the_param_state_by_layer_and_load_back():
  """``model.variables()`` (the engine's logical variables) holds layer i's Param state as a pure
  dict under ``layers_i`` (a Repeat's: its stacked copies' state, without the ``layer`` key);
  ``load_variables`` writes such variables into the layers."""
  model, _, _ = nnx_models.pipelined("lm", num_stages=2, num_microbatches=2,
                                     mesh=tpipe.make_mesh(stages=2))
  variables = model.variables()
  assert set(variables) == {"params"}  # No BatchNorm: no batch_stats.
  state = nnx.to_pure_dict(nnx.state(model, nnx.Param))["layers"]
  assert set(variables["params"]) == {f"layers_{i}" for i in range(3)}
  state = [state[0], state[1]["layer"], state[2]]
  for i in range(3):
    jax.tree.map(np.testing.assert_array_equal, variables["params"][f"layers_{i}"], state[i])
  assert variables["params"]["layers_1"]["up"]["kernel"].shape == (6, WIDTH, 2 * WIDTH)
  other, _, _ = nnx_models.pipelined("lm", num_stages=2, num_microbatches=2,
                                     mesh=tpipe.make_mesh(stages=2))
  other.load_variables(jax.tree.map(lambda a: a + 1.0, variables))
  loaded = nnx.to_pure_dict(nnx.state(other, nnx.Param))["layers"]
  loaded = [loaded[0], loaded[1]["layer"], loaded[2]]
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b + 1.0), loaded, state)


def _train_step():

  @nnx.jit
  def step(model, optimizer, x, kwargs):
    loss, grads = nnx.value_and_grad(lambda m: m(x, **kwargs).mean())(model)
    optimizer.update(model, grads)
    return loss

  return step


@functools.cache
def _plain_sgd(microbatches, steps=2, learning_rate=0.5):
  """``(params, x, kwargs) -> (losses, params)``: ``steps`` SGD steps of the plain LM on
  ``microbatches`` micro-batches (the loss before each step, the parameters after the last)."""
  graphdef = nnx.graphdef(nnx.List(nnx_models.layers("lm")))

  def run(params, x, kwargs):
    mean = lambda p: nnx_models.in_order(nnx.merge(graphdef, p), x, kwargs, microbatches).mean()
    losses = []
    for _ in range(steps):
      loss, grads = jax.value_and_grad(mean)(params)
      params = jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)
      losses.append(loss)
    return losses, params

  return jax.jit(run)


def test_an_optimizer_step_under_nnx_jit_equals_the_plain_models():
  mesh = tpipe.make_mesh(stages=2, data=2)
  model, x, kwargs = nnx_models.pipelined("lm", num_stages=2, num_microbatches=2, mesh=mesh)
  plain_params = nnx_models.params("lm")
  plain_losses, plain = _plain_sgd(4)(plain_params, x, kwargs)  # M * data micro-batches.
  exact_losses, exact = numerics.float64_reference(_plain_sgd(1), plain_params, x, kwargs)
  x, kwargs = jax.device_put((x, kwargs), tpipe.data_sharding(mesh))
  step = _train_step()
  with jax.set_mesh(mesh):  # The optimizer's step count on the mesh: one compile of the step.
    optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
  losses = [step(model, optimizer, x, kwargs) for _ in range(2)]
  assert losses[1] < losses[0]
  for i in range(2):
    numerics.assert_as_close_as_plain(losses[i], plain_losses[i], exact_losses[i],
                                      what=f"loss before step {i}")
  got = nnx.to_pure_dict(nnx.state(model, nnx.Param))["layers"]
  numerics.assert_as_close_as_plain(got, plain, exact, what="parameters after two SGD steps")

  # Adam through nnx.Optimizer: its state follows the model's Param names, and the loss falls.
  adam_model, _, _ = nnx_models.pipelined("lm", num_stages=2, num_microbatches=2, mesh=mesh)
  with jax.set_mesh(mesh):
    adam = nnx.Optimizer(adam_model, optax.adam(1e-2), wrt=nnx.Param)
  adam_step = _train_step()
  adam_losses = [float(adam_step(adam_model, adam, x, kwargs)) for _ in range(3)]
  assert adam_losses[-1] < adam_losses[0]
  moment = adam.opt_state[0].mu["layers"][1]["layer"]["up"]["kernel"]
  assert moment[...].shape == (6, WIDTH, 2 * WIDTH)


@contextlib.contextmanager
def _programs_compiled():
  """Yields a list that gets the name of every XLA program compiled inside the block (JAX records
  the event around each backend compile, a read of the session's persistent compilation cache
  included: tests/conftest.py)."""
  compiled = []

  def listener(event, seconds, *, fun_name="?", **_):
    if event == "/jax/core/compile/backend_compile_duration":
      compiled.append(fun_name)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield compiled
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.parametrize("shard", [False, True])
def test_a_second_optimizer_step_reuses_the_first_steps_program(shard):
  """The state a train step returns has the shardings it went in with (tpipe.nnx.homes), so the
  second step runs the first one's program; the steps equal the plain model's."""
  mesh = tpipe.make_mesh(stages=2, data=2)
  model, x, kwargs = nnx_models.pipelined("lm", num_stages=2, num_microbatches=2,
                                          balance=[4, 4], mesh=mesh)
  if shard:
    tnnx.shard(model)
  plain_params = nnx_models.params("lm")
  plain_losses, plain = _plain_sgd(4)(plain_params, x, kwargs)  # M * data micro-batches.
  exact_losses, exact = numerics.float64_reference(_plain_sgd(1), plain_params, x, kwargs)
  x, kwargs = jax.device_put((x, kwargs), tpipe.data_sharding(mesh))
  with jax.set_mesh(mesh):  # Flax makes the optimizer's step count here, else on one device.
    optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
  state = lambda: [nnx.to_pure_dict(nnx.state(tree)) for tree in (model, optimizer)]
  homes = jax.tree.map(lambda a: a.sharding, state())
  step = _train_step()
  with _programs_compiled() as compiled:
    losses = [step(model, optimizer, x, kwargs) for _ in range(2)]
  assert len(compiled) == 1, compiled  # The first step's program; no resharding of its inputs.

  def at_home(path, a, home):
    assert a.sharding.is_equivalent_to(home, a.ndim), (jax.tree_util.keystr(path), home)

  jax.tree_util.tree_map_with_path(at_home, state(), homes)
  for i in range(2):
    numerics.assert_as_close_as_plain(losses[i], plain_losses[i], exact_losses[i],
                                      what=f"loss before step {i}")
  got = nnx.to_pure_dict(nnx.state(model, nnx.Param))["layers"]
  numerics.assert_as_close_as_plain(got, plain, exact, what="parameters after two SGD steps")


def test_bad_arguments_raise_clear_errors():
  rngs = nnx.Rngs(0)
  block = nnx_models.Residual(4, rngs=rngs)
  make = lambda r: nnx_models.Residual(4, rngs=r)
  with pytest.raises(TypeError, match="function rngs -> layer"):
    tnnx.Repeat(block, 3, rngs=rngs)
  with pytest.raises(TypeError, match="must be an int"):
    tnnx.Repeat(make, 2.0, rngs=rngs)
  with pytest.raises(TypeError, match="rngs=nnx.Rngs"):
    tnnx.Repeat(make, 2, rngs=0)
  with pytest.raises(TypeError, match="nnx.Module"):
    tnnx.Sequential([block, lambda x: x], num_stages=1, num_microbatches=1)
  with pytest.raises(TypeError, match="tpipe.nnx.Sequential: per_example"):
    tnnx.Sequential(nnx_models.layers("lm"), num_stages=1, num_microbatches=1,
                    per_example="targets")
  with pytest.raises(ValueError, match="tpipe.nnx.Sequential: per_example names 'labels', "
                                       "which no layer's call takes"):
    tnnx.Sequential(nnx_models.layers("lm"), num_stages=1, num_microbatches=1,
                    per_example=("labels",))
  with pytest.raises(ValueError, match="chunks need at least one"):
    tnnx.Sequential([block, nnx_models.Residual(4, rngs=rngs)], num_stages=4,
                    num_microbatches=4)
  with pytest.raises(ValueError, match=r"tpipe.nnx.Sequential: num_stages=2 but the 'stage' "
                                       r"axis of the mesh given has size 4"):
    tnnx.Sequential(nnx_models.layers("lm"), num_stages=2, num_microbatches=2,
                    mesh=tpipe.make_mesh(stages=4))
  model = tnnx.Sequential(nnx_models.layers("lm"), num_stages=1, num_microbatches=1,
                          per_example=("targets",))
  x, kwargs, _ = nnx_models.inputs("lm")
  with pytest.raises(TypeError, match=r"no layer's call takes the keyword argument\(s\) "
                                      r"\['labels'\]"):
    model(x, labels=kwargs["targets"])


class SowsResidual(nnx.Module):
  """A residual layer that sows its update's mean square as ``kind`` (an ``nnx.Intermediate``)."""

  def __init__(self, width, kind, *, rngs):
    self.linear = nnx.Linear(width, width, rngs=rngs)
    self.kind = kind

  def __call__(self, x):
    update = self.linear(x)
    self.sow(self.kind, "norm", (update * update).mean())
    return x + update


def test_sown_intermediates_are_refused_as_linen_refuses_collections_asked_for():
  """Plain NNX keeps what a layer sows in the layer; the pipeline would drop it, so it refuses
  while planning traces the layer, as tpipe.Sequential and tpipe.pipeline refuse a collection the
  caller made mutable (tests/linen). Auxiliary losses and metrics are carried, not refused."""
  rngs = nnx.Rngs(0)
  x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
  model = tnnx.Sequential([nnx.Linear(WIDTH, WIDTH, rngs=rngs),
                           SowsResidual(WIDTH, nnx.Intermediate, rngs=rngs)],
                          num_stages=2, num_microbatches=2, mesh=tpipe.make_mesh(stages=2))
  with pytest.raises(ValueError, match=r"layers\[1\] \(SowsResidual\) failed .*tpipe.nnx."
                                       r"Sequential layers\[1\]: SowsResidual sows the "
                                       r"nnx.Intermediate value\(s\) \['norm'\] \(with "
                                       r"self.sow\), which its caller would receive outside a "
                                       r"pipeline.*sow them outside the pipelined layers"):
    model(x)
  stack = tnnx.pipeline(SowsResidual, length=2, num_stages=2, num_microbatches=2,
                        mesh=tpipe.make_mesh(stages=2))(WIDTH, nnx.Intermediate, rngs=rngs)
  with pytest.raises(ValueError, match=r"SowsResidual sows the nnx.Intermediate value\(s\)"):
    stack(x)
  metrics = tnnx.Sequential([SowsResidual(WIDTH, tnnx.AuxMetric, rngs=rngs)], num_stages=1,
                            num_microbatches=2)
  assert metrics(x).shape == (BATCH, WIDTH)


class DropoutResidual(nnx.Module):

  def __init__(self, width, *, rngs):
    self.linear = nnx.Linear(width, width, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return x + self.dropout(self.linear(x))


def _dropout_model(stages, schedule="gpipe", **kwargs):
  rngs = nnx.Rngs(0)
  layers = [nnx.Linear(5, 8, rngs=rngs),
            tnnx.Repeat(lambda r: DropoutResidual(8, rngs=r), 4, rngs=rngs),
            nnx.Linear(8, 3, rngs=rngs)]
  return tnnx.Sequential(layers, num_stages=stages, num_microbatches=4, schedule=schedule,
                         num_repeats=2 if schedule == "circular" else 1,
                         mesh=tpipe.make_mesh(stages=stages), **kwargs)


def test_dropout_keys_come_from_the_stacks_rngs_and_not_from_the_layout():
  x = jax.random.normal(jax.random.key(1), (BATCH, 5))
  apply = nnx.jit(lambda model, x: model(x))
  models = [_dropout_model(1, rngs=nnx.Rngs(dropout=7)),
            _dropout_model(2, rngs=nnx.Rngs(dropout=7)),
            _dropout_model(2, "circular", rngs=nnx.Rngs(dropout=7))]
  first = [np.asarray(apply(model, x)) for model in models]
  for y in first[1:]:
    np.testing.assert_array_equal(y, first[0])
  second = np.asarray(apply(models[0], x))
  assert not np.allclose(second, first[0]), "each call draws a new key"
  models[0].eval()
  evaluated = [np.asarray(apply(models[0], x)) for _ in range(2)]
  np.testing.assert_array_equal(evaluated[0], evaluated[1])
  assert not np.allclose(evaluated[0], first[0])
  with pytest.raises(ValueError, match="no rngs"):
    _dropout_model(1)
