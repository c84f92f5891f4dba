"""Tests for tpipe.training: the train state, its shardings and the synchronous-SGD step.

Pipelined + data-parallel equals plain single-device SGD. "Equals" is
:mod:`tests.helpers.numerics`' rule: against float64 SGD (Adam) on the sequential model, the
pipelined float32 step is at most twice as far off as float32 SGD on the sequential model run on
the same micro-batches.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import tpipe
from tpipe.tools import analysis
from tests.helpers import blocks
from tests.helpers import numerics

WIDTH = 8
LENGTH = 8


class Regressor(nn.Module):
  """Dense -> pipelined MLP stack -> Dense: a model with params outside and inside the stack."""

  stages: int
  microbatches: int
  data: int
  schedule: str = "gpipe"
  repeats: int = 1

  @nn.compact
  def __call__(self, x):
    mesh = tpipe.make_mesh(stages=self.stages, data=self.data)
    stack = tpipe.pipeline(blocks.MLPBlock, length=LENGTH, num_stages=self.stages,
                           num_microbatches=self.microbatches, schedule=self.schedule,
                           num_repeats=self.repeats, mesh=mesh)
    h = stack(WIDTH, name="blocks")(nn.Dense(WIDTH)(x))
    return nn.Dense(1)(h)[:, 0]


def _sequential_regressor(params, x, microbatches):
  """``Regressor`` without the pipeline, the stack run on ``microbatches`` parts of the batch."""
  h = nn.Dense(WIDTH).apply({"params": params["Dense_0"]}, x)
  h = blocks.apply_in_sequence(blocks.MLPBlock(WIDTH), params["blocks"], h,
                               microbatches=microbatches)
  return nn.Dense(1).apply({"params": params["Dense_1"]}, h)[:, 0]


def _loss_fn(apply):

  def loss(params, batch, rng):
    del rng
    prediction = apply(params, batch["x"])
    return jnp.mean((prediction - batch["y"]) ** 2)

  return loss


def _pipelined_loss_fn(model):
  return _loss_fn(lambda params, x: model.apply({"params": params}, x))


def _sequential_steps(optimizer, params, batch, steps, microbatches):
  """``steps`` optimizer steps on the sequential model: (losses, grad norms, final params)."""
  loss_fn = _loss_fn(lambda p, x: _sequential_regressor(p, x, microbatches))
  opt_state = optimizer.init(params)
  losses, grad_norms = [], []
  for _ in range(steps):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, None)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    losses.append(loss)
    grad_norms.append(optax.tree.norm(grads))
  return jnp.stack(losses), jnp.stack(grad_norms), params


def _plain_and_float64(optimizer, params, batch, steps, microbatches):
  """The sequential model's ``steps`` in float32 on ``microbatches`` (plain) and in float64.

  The float64 reference runs the whole batch at once (the same in exact arithmetic).
  """
  run = jax.jit(lambda p, b: _sequential_steps(optimizer, p, b, steps, microbatches))
  exact = jax.jit(lambda p, b: _sequential_steps(optimizer, p, b, steps, 1))
  return run(params, batch), numerics.float64_reference(exact, params, batch)


def _batch(size=32):
  kx, ky = jax.random.split(jax.random.key(5))
  return {"x": jax.random.normal(kx, (size, 4)), "y": jax.random.normal(ky, (size,))}


@pytest.mark.parametrize("schedule,repeats", [("gpipe", 1), ("circular", 2)])
def test_one_step_on_data2_stage4_equals_plain_sgd(schedule, repeats):
  batch = _batch()
  params = Regressor(stages=1, microbatches=1, data=1).init(jax.random.key(0), batch["x"])["params"]
  optimizer = optax.sgd(0.1)
  (plain_losses, plain_norms, plain_params), (exact_losses, exact_norms, exact_params) = (
      _plain_and_float64(optimizer, params, batch, steps=1, microbatches=4 * 2))  # M x data

  model = Regressor(stages=4, microbatches=4, data=2, schedule=schedule, repeats=repeats)
  mesh = tpipe.make_mesh(stages=4, data=2)
  state = tpipe.create_train_state(params, optimizer,
                                   tpipe.shardings(params, mesh, stacked=("blocks",)))
  step = tpipe.make_train_step(_pipelined_loss_fn(model), optimizer,
                               shardings=_own_shardings(state))
  new_state, metrics = step(state, jax.device_put(batch, tpipe.data_sharding(mesh)),
                            jax.random.key(0))

  assert int(new_state.step) == 1
  numerics.assert_as_close_as_plain(metrics["loss"], plain_losses[0], exact_losses[0], what="loss")
  numerics.assert_as_close_as_plain(metrics["grad_norm"], plain_norms[0], exact_norms[0],
                                    what="grad_norm")
  numerics.assert_as_close_as_plain(new_state.params, plain_params, exact_params,
                                    what="params after one step")
  # The parameters really moved, and the stack stayed split over the 4 stages.
  assert not np.allclose(new_state.params["Dense_0"]["kernel"], params["Dense_0"]["kernel"])
  kernel = new_state.params["blocks"]["Dense_0"]["kernel"]
  assert {shard.data.shape[0] for shard in kernel.addressable_shards} == {LENGTH // 4}


def test_several_steps_track_plain_adam():
  batch = _batch()
  params = Regressor(stages=1, microbatches=1, data=1).init(jax.random.key(0), batch["x"])["params"]
  optimizer = optax.adam(1e-2)
  (plain_losses, _, plain_params), (exact_losses, _, exact_params) = _plain_and_float64(
      optimizer, params, batch, steps=5, microbatches=8 * 2)  # M x data

  model = Regressor(stages=2, microbatches=8, data=2)
  mesh = tpipe.make_mesh(stages=2, data=2)
  state = tpipe.create_train_state(params, optimizer,
                                   tpipe.shardings(params, mesh, stacked=("blocks",)))
  step = tpipe.make_train_step(_pipelined_loss_fn(model), optimizer,
                               shardings=_own_shardings(state))
  sharded_batch = jax.device_put(batch, tpipe.data_sharding(mesh))
  losses = []
  for _ in range(5):
    state, metrics = step(state, sharded_batch, jax.random.key(0))
    losses.append(metrics["loss"])
  numerics.assert_as_close_as_plain(jnp.stack(losses), plain_losses, exact_losses, what="losses")
  numerics.assert_as_close_as_plain(state.params, plain_params, exact_params,
                                    what="params after five steps")
  assert losses[-1] < losses[0]


def _own_shardings(state):
  """A placed state's own shardings (what the step must keep it in)."""
  return jax.tree.map(lambda a: a.sharding, state)


def test_shardings_validation():
  params = {"blocks": {"w": jnp.zeros((6, 2))}, "head": {"w": jnp.zeros((2,))}}
  mesh = tpipe.make_mesh(stages=4)
  with pytest.raises(TypeError, match=r"write stacked=\('blocks',\)"):
    tpipe.shardings(params, mesh, stacked="blocks")
  with pytest.raises(ValueError, match=r"\['stack'\] are not top-level keys"):
    tpipe.shardings(params, mesh, stacked=("stack",))
  with pytest.raises(ValueError, match="has 6 layers, not divisible by the 4 stages"):
    tpipe.shardings(params, mesh, stacked=("blocks",))
  # A train state is checked by its parameters.
  state = tpipe.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=())
  with pytest.raises(ValueError, match=r"\['stack'\] are not top-level keys"):
    tpipe.shardings(state, mesh, stacked=("stack",))


def test_shardings_split_the_stacks_and_replicate_the_rest():
  params = {"blocks": {"w": jnp.zeros((8, 2)), "b": jnp.zeros((8,))},
            "head": {"w": jnp.zeros((2, 3))}}
  mesh = tpipe.make_mesh(stages=4, data=2)
  found = tpipe.shardings(params, mesh, stacked=("blocks",))
  assert {leaf.spec for leaf in jax.tree.leaves(found["blocks"])} == {P("stage")}
  assert found["head"]["w"].spec == P() and found["head"]["w"].mesh == mesh
  # Of a train state: the optimizer's moments follow their parameters, the step and Adam's
  # count are replicated, and so is the model state.
  opt_state = optax.adam(0.1).init(params)
  state = tpipe.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state,
                           model_state={"mean": jnp.zeros((8,))})
  found = tpipe.shardings(state, mesh, stacked=("blocks",))
  assert isinstance(found, tpipe.TrainState) and found.step.spec == P()
  assert found.params == tpipe.shardings(params, mesh, stacked=("blocks",))
  assert found.opt_state[0].mu["blocks"]["w"].spec == P("stage")
  assert found.opt_state[0].nu["head"]["w"].spec == P()
  assert found.opt_state[0].count.spec == P()
  assert found.model_state["mean"].spec == P()
  # Abstract leaves (jax.eval_shape) give the same shardings.
  abstract = jax.eval_shape(lambda: state)
  assert tpipe.shardings(abstract, mesh, stacked=("blocks",)) == found


def test_shardings_on_fsdp_and_tensor_follow_the_annotations():
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  mesh = tpipe.make_mesh(stages=2, fsdp=2, tensor=2)
  boxed = {"blocks": {"w": nn.LogicallyPartitioned(jnp.zeros((4, 8, 16)), ("embed", "mlp")),
                      "b": jnp.zeros((4, 6))},
           "head": {"w": nn.LogicallyPartitioned(jnp.zeros((8, 6)), ("embed", "vocab")),
                    "scale": jnp.zeros((3,))}}
  found = tpipe.shardings(boxed, mesh, stacked=("blocks",))
  # Stacks over stage, then the weight's own axes; unannotated: fsdp on the largest dimension
  # it divides; a dimension tensor does not divide (vocab 6 / 2 divides; 3 does not) is whole.
  assert found["blocks"]["w"].spec == P("stage", "fsdp", "tensor")
  assert found["blocks"]["b"].spec == P("stage", "fsdp")
  assert found["head"]["w"].spec == P("fsdp", "tensor")
  assert found["head"]["scale"].spec == P()
  # Other rules, given or from Flax's context, move the axes.
  rules = (("embed", None), ("mlp", "fsdp"))
  assert tpipe.shardings(boxed, mesh, ("blocks",), rules=rules)["blocks"]["w"].spec == P(
      "stage", None, "fsdp")
  with nn.logical_axis_rules(rules):
    assert tpipe.shardings(boxed, mesh, ("blocks",))["blocks"]["w"].spec == P(
        "stage", None, "fsdp")


def test_make_train_step_validation():
  with pytest.raises(TypeError, match="optimizer must be an optax.GradientTransformation"):
    tpipe.make_train_step(lambda p, b, r: 0.0, "sgd")
  with pytest.raises(TypeError, match="loss_fn must be callable"):
    tpipe.make_train_step(None, optax.sgd(0.1))
  with pytest.raises(ValueError, match="donate_params=True needs donate=True"):
    tpipe.make_train_step(lambda p, b, r: 0.0, optax.sgd(0.1), donate=False, donate_params=True)
  with pytest.raises(TypeError, match="donate_params must be True or False, got 'yes'"):
    tpipe.make_train_step(lambda p, b, r: 0.0, optax.sgd(0.1), donate_params="yes")
  step = tpipe.make_train_step(lambda p, b, r: 0.0, optax.sgd(0.1))
  with pytest.raises(TypeError, match="takes a tpipe.TrainState, got dict"):
    step({"params": {}}, {}, jax.random.key(0))


def _abstract_state(mesh, optimizer, batch):
  """The TrainState as ShapeDtypeStructs carrying the shardings a real state has.

  ``jax.eval_shape`` returns leaves without shardings; compiled from those, XLA would choose the
  layout itself (replicated stacks for the circular schedule). The shardings come from
  :func:`tpipe.shardings`: ``blocks`` leaves of the parameters and of the optimizer state split
  over 'stage' on axis 0, the rest replicated.
  """
  shapes = jax.eval_shape(lambda: tpipe.create_train_state(
      Regressor(stages=1, microbatches=1, data=1).init(jax.random.key(0), batch["x"])["params"],
      optimizer))
  shardings = tpipe.shardings(shapes, mesh, stacked=("blocks",))
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      shapes, shardings)


@functools.cache
def _compile_step(microbatches, schedule="gpipe", repeats=1):
  """The data=2 x stage=4 step compiled ahead of time from abstract inputs, and its state."""
  batch = _batch(64)
  mesh = tpipe.make_mesh(stages=4, data=2)
  model = Regressor(stages=4, microbatches=microbatches, data=2, schedule=schedule,
                    repeats=repeats)
  optimizer = optax.sgd(0.1, momentum=0.9)  # a momentum per parameter: opt_state is placed too.
  state = _abstract_state(mesh, optimizer, batch)
  batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                      sharding=tpipe.data_sharding(mesh)), batch)
  step = tpipe.make_train_step(_pipelined_loss_fn(model), optimizer)
  return step.lower(state, batch, jax.random.key(0)).compile(), state, mesh


@pytest.mark.parametrize("donate,donate_params", [(True, False), (True, True), (False, False)])
def test_the_step_donates_the_optimizer_state_and_the_parameters_if_asked(donate,
                                                                          donate_params):
  batch = _batch(64)
  mesh = tpipe.make_mesh(stages=4, data=2)
  model = Regressor(stages=4, microbatches=4, data=2)
  optimizer = optax.sgd(0.1, momentum=0.9)
  state = _abstract_state(mesh, optimizer, batch)
  batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                      sharding=tpipe.data_sharding(mesh)), batch)
  step = tpipe.make_train_step(_pipelined_loss_fn(model), optimizer, donate=donate,
                               donate_params=donate_params)
  lowered = step.lower(state, batch, jax.random.key(0))
  # The donated leaves: the parameters' if asked, the rest of the state's; never the batch's.
  info, batch_info, _ = lowered.args_info[0]
  params, rest = len(jax.tree.leaves(state.params)), len(jax.tree.leaves(state)) - len(
      jax.tree.leaves(state.params))
  assert [leaf.donated for leaf in jax.tree.leaves(info.params)] == [donate_params] * params
  assert [leaf.donated for leaf in jax.tree.leaves(info.replace(params=None))] == [donate] * rest
  assert not any(leaf.donated for leaf in jax.tree.leaves(batch_info))

  # Called for real: the new state is whole and the donated input buffers are gone.
  params = Regressor(stages=1, microbatches=1, data=1).init(jax.random.key(0), _batch()["x"])
  real = tpipe.create_train_state(params["params"], optimizer,
                                  tpipe.shardings(params["params"], mesh, stacked=("blocks",)))
  step = tpipe.make_train_step(_pipelined_loss_fn(model), optimizer,
                               shardings=_own_shardings(real), donate=donate,
                               donate_params=donate_params)
  new_state, _ = step(real, jax.device_put(_batch(64), tpipe.data_sharding(mesh)),
                      jax.random.key(0))
  assert int(new_state.step) == 1
  kernel = real.params["Dense_0"]["kernel"]
  momentum = jax.tree.leaves(real.opt_state)[0]
  assert kernel.is_deleted() == donate_params
  assert momentum.is_deleted() == donate


def test_the_step_compiled_ahead_of_time_runs_as_the_step_does():
  """Compile once, read its memory, then run the compiled step: on ``(state, batch, rng)``, bit
  for bit the jitted step's result."""
  batch = _batch(16)
  mesh = tpipe.make_mesh(stages=2, data=2)
  params = Regressor(stages=1, microbatches=1, data=1).init(jax.random.key(0), batch["x"])
  optimizer = optax.sgd(0.1, momentum=0.9)
  placement = tpipe.shardings(params["params"], mesh, stacked=("blocks",))
  # The step donates the optimizer state: a fresh state for each call.
  fresh = lambda: tpipe.create_train_state(params["params"], optimizer, placement)
  batch, rng = jax.device_put(batch, tpipe.data_sharding(mesh)), jax.random.key(1)
  step = tpipe.make_train_step(_pipelined_loss_fn(Regressor(stages=2, microbatches=2, data=2)),
                               optimizer, shardings=_own_shardings(fresh()))

  state = fresh()
  lowered = step.lower(state, batch, rng)
  assert "stablehlo" in lowered.as_text() and lowered.compiler_ir() is not None
  compiled = lowered.compile()
  assert compiled.memory_analysis().argument_size_in_bytes > 0
  assert compiled.cost_analysis()["flops"] > 0
  assert "ENTRY" in compiled.as_text()
  state_shardings = compiled.input_shardings[0][0]
  assert state_shardings.params["blocks"]["Dense_0"]["kernel"].spec == P("stage")
  assert isinstance(compiled.output_shardings[0], tpipe.TrainState)

  new_state, metrics = compiled(state, batch, rng)
  expected = step(fresh(), batch, rng)
  assert int(new_state.step) == 1
  jax.tree.map(np.testing.assert_array_equal, (new_state, metrics), expected)
  with pytest.raises(TypeError, match="takes a tpipe.TrainState, got dict"):
    compiled({"params": params["params"]}, batch, rng)


def _specs_by_path(tree):
  return {jax.tree_util.keystr(path): sharding.spec
          for path, sharding in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("schedule,repeats", [("gpipe", 1), ("circular", 2)])
def test_data_parallel_reduction_happens_once_per_step_not_per_microbatch(schedule, repeats):
  for microbatches in (4, 16):
    compiled, state, mesh = _compile_step(microbatches, schedule, repeats)
    # The step compiled for the stage-split layout: stacked parameters and their momenta over
    # 'stage', the rest replicated, exactly as the abstract state says.
    compiled_state = compiled.input_shardings[0][0]
    specs = _specs_by_path(compiled_state.params)
    specs.update(_specs_by_path(compiled_state.opt_state))
    stacked = {path: spec for path, spec in specs.items() if "'blocks'" in path}
    assert len(stacked) == 8 and set(stacked.values()) == {P("stage")}, specs
    assert set(specs.values()) == {P(), P("stage")}, specs
    expected = _specs_by_path(jax.tree.map(lambda a: a.sharding, state.params))
    expected.update(_specs_by_path(jax.tree.map(lambda a: a.sharding, state.opt_state)))
    assert specs == expected

    found = analysis.collectives(compiled, mesh)
    over_data = [c for c in found if c.axes and "data" in c.axes]
    assert over_data, "gradients must be reduced across data replicas"
    # Outside the tick loop, executed once per step, whatever the number of micro-batches.
    assert all(not c.in_loop and c.count == 1 for c in over_data), over_data
    # Stage-to-stage sends run every tick: R * M + S - 1 forward ticks (laps of max(M, S) when
    # R > 1), and as many backward.
    sends = [c for c in found if c.kind == "collective-permute" and c.axes == ("stage",)]
    assert sum(c.count for c in sends) >= 2 * (repeats * microbatches + 4 - 1)


@pytest.mark.parametrize("schedule,repeats", [("gpipe", 1), ("circular", 2)])
def test_every_collective_of_a_step_is_labelled_with_its_mesh_axes(schedule, repeats):
  compiled, _, mesh = _compile_step(4, schedule, repeats)
  found = analysis.collectives(compiled, mesh)
  # Every group has 2+ devices here (no data axis of size 1), so every collective spans an axis.
  unlabelled = [(c.kind, c.name) for c in found if not c.axes]
  assert not unlabelled, unlabelled
  # Over both axes at once, only what runs once per step after the pipeline (the loss's sums of
  # its outputs, which leave split over the stages as over the data replicas).
  assert {c.axes for c in found} <= {("stage",), ("data",), ("data", "stage")}
  assert all(not c.in_loop and c.count == 1 for c in found if c.axes == ("data", "stage"))
  if schedule == "circular":
    # The re-layout between the stage-split state and the circular chunk order: all-to-alls
    # within each data replica, which XLA prints with mesh-form replica groups.
    relayout = [c for c in found if c.kind == "all-to-all"]
    assert relayout and all(c.axes == ("stage",) for c in relayout), relayout
    assert "mesh[" in compiled.as_text()


def test_no_gradient_all_reduce_without_data_parallelism():
  batch = _batch(32)
  mesh = tpipe.make_mesh(stages=4, data=1)
  model = Regressor(stages=4, microbatches=4, data=1)
  params = Regressor(stages=1, microbatches=1, data=1).init(jax.random.key(0), batch["x"])
  state = tpipe.create_train_state(params["params"], optax.sgd(0.1), tpipe.shardings(
      params["params"], mesh, stacked=("blocks",)))
  step = tpipe.make_train_step(_pipelined_loss_fn(model), optax.sgd(0.1))
  compiled = step.lower(state, jax.device_put(batch, tpipe.data_sharding(mesh)),
                        jax.random.key(0)).compile()
  # Only the stage-axis sums of outputs and input gradients; not even a no-op over 1-device groups.
  reductions = [c for c in analysis.collectives(compiled, mesh)
                if c.kind == "all-reduce" and c.axes != ("stage",)]
  assert not reductions, reductions


# ------------------------------------------------------------------------------------------------
# Where a tpipe.Sequential's state lives: the boxes init returns, the shardings they give, and
# the optimizer state created beside its parameters.

def _named(*names):
  return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class NamedMLP(nn.Module):
  """A block whose matrices name their axes, the first like an attention kernel."""

  @nn.compact
  def __call__(self, x):
    w_in = self.param("w_in", _named("embed", "heads"), (x.shape[-1], 32))
    w_out = self.param("w_out", _named("heads", "embed"), (32, x.shape[-1]))
    return x + jnp.tanh(x @ w_in) @ w_out


class NamedHead(nn.Module):

  @nn.compact
  def __call__(self, x):
    return jnp.sum(x @ self.param("w", _named("embed", "vocab"), (x.shape[-1], 16)), -1)


def _named_sequential(mesh, stages):
  model = tpipe.Sequential([nn.Dense(WIDTH), tpipe.Repeat(NamedMLP(), 2 * stages), NamedHead()],
                           num_stages=stages, num_microbatches=2, mesh=mesh)
  x = jax.random.normal(jax.random.key(1), (8, 4))
  return model, x, model.init(jax.random.key(0), x)["params"]


MESHES = {"stage2-fsdp2-tensor2": dict(stages=2, fsdp=2, tensor=2),
          "stage4-data2": dict(stages=4, data=2)}


def _bytes_per_device(tree) -> dict[int, int]:
  out = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
  return out


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_sequential_init_keeps_the_boxes_and_shardings_read_them(mesh_name):
  """``init`` returns the layers' boxes (a Repeat's copy axis named ``stage``), so
  ``tpipe.shardings`` splits each weight as the trainer's stage layout does: the same axes
  inside a stage, ``tensor`` included."""
  sizes = MESHES[mesh_name]
  mesh = tpipe.make_mesh(**sizes)
  model, x, params = _named_sequential(mesh, sizes["stages"])
  kernel = params["layers_1"]["w_in"]
  assert isinstance(kernel, nn.LogicallyPartitioned)
  assert kernel.names == ("stage", "embed", "heads")
  found = tpipe.shardings(params, mesh)
  trainer = model.pipeline_for(x).layout.partition_specs(mesh=mesh)["stacked"]["layers_1"]
  for name in ("w_in", "w_out"):
    inner = tuple(trainer[name])[3:]  # The trainer's [R, S, k, ...]: the weight's own axes.
    assert tuple(found["layers_1"][name].spec) == ("stage",) + inner
  if "tensor" in sizes:
    assert found["layers_1"]["w_in"].spec == P("stage", "fsdp", "tensor")
    assert found["layers_2"]["w"].spec == P("fsdp", "tensor")
  # The boxes are what apply takes, and the result does not depend on them.
  y = jax.jit(model.apply)({"params": params}, x)
  assert np.array_equal(y, jax.jit(model.apply)({"params": nn.meta.unbox(params)}, x))


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_create_train_state_creates_each_moment_split_like_its_parameter(mesh_name):
  sizes = MESHES[mesh_name]
  mesh = tpipe.make_mesh(**sizes)
  _, _, params = _named_sequential(mesh, sizes["stages"])
  shardings = tpipe.shardings(params, mesh)
  state = tpipe.create_train_state(params, optax.adam(1e-3), shardings)
  adam = state.opt_state[0]
  unbox = lambda tree: nn.meta.unbox(tree)
  for moment in (adam.mu, adam.nu):
    assert jax.tree.map(lambda a: a.sharding, unbox(moment)) == shardings
  assert adam.count.sharding.spec == P() and len(adam.count.sharding.device_set) == mesh.size
  # Each device holds its share: its parameters' shards and two moments of the same size, plus
  # the replicated scalars (the step and Adam's count) - never a whole moment it does not own.
  held = _bytes_per_device(unbox(state.params))
  share = sum(np.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
              for a, s in zip(jax.tree.leaves(unbox(params)), jax.tree.leaves(shardings)))
  assert set(held.values()) == {share}
  everything = _bytes_per_device(unbox(state))
  assert max(everything.values()) == 3 * share + 2 * 4
  # A whole TrainState's shardings give the moments their parameters' shardings too.
  assert jax.tree.map(lambda s: s.spec, tpipe.shardings(state, mesh).opt_state[0].mu) == (
      jax.tree.map(lambda s: s.spec, shardings))
