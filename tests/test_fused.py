"""Fused schedules in tpipe.Sequential: the loss and its gradients equal the layers in order.

With a fused schedule (1F1B, interleaved 1F1B, ZB-H1, ZB-V) the stack returns the mean over the
global batch of its last layer's per-example losses, and ``jax.grad`` of any function of that
scalar must give the sequential model's gradients, for parameters and float inputs (numerics
rule: :mod:`tests.numerics`). Cases cover every fused schedule with S in {1, 2, 4, 8}, M in
{1, 2, S, 4S} (below S, equal to it, above it, not a multiple of it), data in {1, 2}, every remat
policy, and three models: an MLP whose width changes, ending in a per-example regression loss; an
LM (embedding, blocks, head with per-example targets); and a homogeneous stack of residual
blocks with a loss at the end.

Memory is checked with compile-time quantities: the compiled step's temporaries grow with M under
GPipe (one stashed stage input per tick) and stay bounded under 1F1B (``min(S, M)`` stash slots).
The compiled program issues two neighbour sends per tick, none inside a branch, and reduces the
gradients over data replicas once, after the tick loop.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpipe
from tests import numerics
from tests.test_sequential import VOCAB, Block, DenseAct, Embed, HeadLoss, Residual
from tpipe.tools import analysis
from tpipe.tools import hlo as hlo_lib

BATCH = 24
SEQ = 4


class SquaredError(nn.Module):
  """Per-example mean squared error of a linear read-out: ``[batch]``."""

  @nn.compact
  def __call__(self, x, targets):
    return jnp.mean((nn.Dense(targets.shape[-1])(x) - targets) ** 2, axis=-1)


def _model(name, batch=BATCH, seq=SEQ, width=8):
  """(layers, x, targets, float input?)"""
  k1, k2 = jax.random.split(jax.random.key(42))
  if name == "blocks":  # 16 units: ZB-V's 2 chunks on each of 8 stages; M up to 4S = 32.
    return ([tpipe.Repeat(Residual(), 15), SquaredError()],
            jax.random.normal(k1, (32, 6)), jax.random.normal(k2, (32, 2)), True)
  if name == "mlp":
    layers = [DenseAct(16), tpipe.Repeat(Residual(), 3), DenseAct(12), DenseAct(6),
              SquaredError()]
    return (layers, jax.random.normal(k1, (batch, 5)), jax.random.normal(k2, (batch, 3)),
            True)
  layers = [Embed(width), tpipe.Repeat(Block(), 3), HeadLoss()]
  return (layers, jax.random.randint(k1, (batch, seq), 0, VOCAB),
          jax.random.randint(k2, (batch, seq), 0, VOCAB), False)


def _losses_in_order(layers, params, x, targets, microbatches):
  """The plain model: every layer in order on ``microbatches`` contiguous micro-batches."""

  def run(xt):
    h, t = xt
    for i, layer in enumerate(layers):
      p = params[f"layers_{i}"]
      if isinstance(layer, tpipe.Repeat):
        for j in range(layer.n):
          h = layer.module.apply({"params": jax.tree.map(lambda a, j=j: a[j], p)}, h)
      elif i == len(layers) - 1:
        h = layer.apply({"params": p}, h, t)
      else:
        h = layer.apply({"params": p}, h)
    return h

  split = lambda a: a.reshape(microbatches, -1, *a.shape[1:])
  return jax.lax.map(run, (split(x), split(targets))).reshape(-1)


def _objective(loss):
  """A nonlinear function of the loss, so the cotangent reaching the fused run is not 1."""
  return loss + 0.5 * loss ** 2


def _value_and_grad(loss_fn, float_input):
  """Gradients by params, and with float inputs also by ``x`` and the per-example targets."""
  return jax.value_and_grad(lambda p, x, t: _objective(loss_fn(p, x, t)),
                            argnums=(0, 1, 2) if float_input else 0)


@functools.cache
def _params(name):
  """Logical params, every element its own random value: shapes from an abstract init, values
  from NumPy (an eager init would run op by op)."""
  layers, x, targets, _ = _model(name)
  model = tpipe.Sequential(layers, num_stages=1, num_microbatches=1, per_example=("targets",))
  shapes = jax.eval_shape(model.init, {"params": jax.random.key(0)}, x, targets=targets)
  rng = np.random.default_rng(7)
  return jax.tree.map(lambda a: jnp.asarray(0.3 * rng.standard_normal(a.shape), a.dtype),
                      shapes["params"])


@functools.cache
def _reference(name):
  """The float64 plain model's (value, gradients)."""
  layers, x, targets, float_input = _model(name)
  loss = lambda p, x, t: jnp.mean(_losses_in_order(layers, p, x, t, 1))
  return numerics.float64_reference(jax.jit(_value_and_grad(loss, float_input)), _params(name),
                                    x, targets)


@functools.cache
def _plain(name, microbatches):
  """The float32 plain model's (value, gradients) on the pipeline's micro-batches."""
  layers, x, targets, float_input = _model(name)
  loss = lambda p, x, t: jnp.mean(_losses_in_order(layers, p, x, t, microbatches))
  return jax.jit(_value_and_grad(loss, float_input))(_params(name), x, targets)


# (model, schedule, stages, micro-batches per replica, data, remat): every fused schedule with
# S in {1, 2, 4, 8} and M < S, M = S, M > S (4S), M not a multiple of S; interleaved 1F1B and ZB-V
# hold 2 chunks per stage. The remat policy decides what a backward tick keeps between its
# recomputed forward and its backward, never what is kept across ticks.
CASES = [
    ("mlp", "1f1b", 1, 3, 2, "full"),
    ("mlp", "1f1b", 4, 2, 1, "dots"),
    ("lm", "1f1b", 4, 3, 1, "none"),
    ("blocks", "1f1b", 8, 32, 1, "full"),
    ("mlp", "interleaved_1f1b", 2, 4, 2, "full"),
    ("lm", "interleaved_1f1b", 2, 1, 1, "dots"),
    ("blocks", "interleaved_1f1b", 4, 8, 1, "none"),
    ("mlp", "zb_h1", 1, 2, 2, "none"),
    ("mlp", "zb_h1", 4, 1, 1, "full"),
    ("lm", "zb_h1", 4, 4, 2, "dots"),
    ("blocks", "zb_h1", 8, 8, 1, "full"),
    ("mlp", "zbv", 1, 3, 1, "dots"),
    ("mlp", "zbv", 2, 2, 2, "full"),
    ("lm", "zbv", 2, 3, 2, "none"),
    ("blocks", "zbv", 8, 16, 1, "full"),
]
CHUNKS_PER_STAGE = {"1f1b": 1, "zb_h1": 1, "interleaved_1f1b": 2, "zbv": 2}


def test_the_cases_cover_every_fused_schedule():
  assert {case[1] for case in CASES} == set(tpipe.schedules.FUSED_SCHEDULE_NAMES)


@pytest.mark.parametrize("name,schedule,stages,microbatches,data,remat", CASES)
def test_loss_and_gradients_equal_sequential(name, schedule, stages, microbatches, data, remat):
  layers, x, targets, float_input = _model(name)
  mesh = tpipe.make_mesh(stages=stages, data=data)
  model = tpipe.Sequential(layers, num_stages=stages, num_microbatches=microbatches,
                           schedule=schedule, num_repeats=CHUNKS_PER_STAGE[schedule],
                           remat=remat, per_example=("targets",), mesh=mesh)
  loss_fn = lambda p, x, t: model.apply({"params": p}, x, targets=t)
  x, targets = jax.device_put((x, targets), tpipe.data_sharding(mesh))
  value, grads = jax.jit(_value_and_grad(loss_fn, float_input))(_params(name), x, targets)
  plain_value, plain_grads = _plain(name, microbatches * data)
  ref_value, ref_grads = _reference(name)
  assert value.shape == ()
  numerics.assert_as_close_as_plain(value, plain_value, ref_value, what="loss")
  numerics.assert_as_close_as_plain(grads, plain_grads, ref_grads, what="gradients")


@pytest.mark.parametrize("schedule,repeats", [("1f1b", 1), ("zbv", 2)])
def test_a_call_without_gradients_runs_the_forward_ticks_only(schedule, repeats):
  """Evaluation takes the custom_vjp's primal path: the forward ticks of GPipe (of the circular
  schedule for two chunks per stage; ZB-V's chunks permuted into its order), one conditional per
  tick (no backward branches), and the same loss."""
  layers, x, targets, _ = _model("mlp")
  mesh = tpipe.make_mesh(stages=2, data=2)
  model = tpipe.Sequential(layers, num_stages=2, num_microbatches=3, schedule=schedule,
                           num_repeats=repeats, per_example=("targets",), mesh=mesh)
  loss_fn = lambda p, x, t: model.apply({"params": p}, x, targets=t)
  x, targets = jax.device_put((x, targets), tpipe.data_sharding(mesh))
  params = _params("mlp")
  evaluate = jax.jit(loss_fn).lower(params, x, targets).compile()
  module = hlo_lib.parse_hlo(evaluate.as_text())
  ticks = {loop.trip_count for loop in module.loops()}
  forward = tpipe.schedules.make_schedule("gpipe" if repeats == 1 else "circular", 2, 3, repeats)
  assert forward.num_ticks in ticks, ticks
  assert model.schedule_table().num_ticks not in ticks, ticks
  value, _ = jax.jit(jax.value_and_grad(loss_fn))(params, x, targets)
  np.testing.assert_allclose(evaluate(params, x, targets), value, rtol=1e-6)


def test_the_check_fails_for_a_dropped_microbatch():
  """The comparison is sharp: the mean over all but the last micro-batch is far outside it."""
  layers, x, targets, float_input = _model("mlp")
  loss_fn = lambda p, x, t: jnp.mean(_losses_in_order(layers, p, x, t, 6)[:-BATCH // 6])
  value, grads = jax.jit(_value_and_grad(loss_fn, float_input))(_params("mlp"), x, targets)
  _, plain_grads = _plain("mlp", 6)
  _, ref_grads = _reference("mlp")
  with pytest.raises(AssertionError):
    numerics.assert_as_close_as_plain(grads, plain_grads, ref_grads, what="gradients")


ROWS, MEMORY_SEQ, MEMORY_WIDTH = 4, 16, 32
# One micro-batch's activation between two blocks, in bytes.
ACTIVATION = ROWS * MEMORY_SEQ * MEMORY_WIDTH * 4


def _temporaries(schedule, microbatches, stages=2):
  """Per-device temporary bytes of the compiled gradient step, ``ROWS`` examples per micro-batch
  (the batch grows with M)."""
  layers, x, targets, _ = _model("lm", ROWS * microbatches, MEMORY_SEQ, MEMORY_WIDTH)
  mesh = tpipe.make_mesh(stages=stages)
  model = tpipe.Sequential(layers, num_stages=stages, num_microbatches=microbatches,
                           schedule=schedule, per_example=("targets",), mesh=mesh)
  apply = lambda p, x, t: model.apply({"params": p}, x, targets=t)
  loss_fn = (lambda p, x, t: jnp.mean(apply(p, x, t))) if schedule == "gpipe" else apply
  params = jax.eval_shape(model.clone(num_stages=1, num_microbatches=1, mesh=None).init,
                          {"params": jax.random.key(0)}, x, targets=targets)["params"]
  compiled = jax.jit(jax.grad(loss_fn)).lower(params, x, targets).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_fused_temporaries_stay_bounded_in_the_number_of_microbatches():
  gpipe = {m: _temporaries("gpipe", m) for m in (4, 16)}
  one_f_one_b = {m: _temporaries("1f1b", m) for m in (4, 16)}
  zb_h1 = {m: _temporaries("zb_h1", m) for m in (4, 16)}
  # GPipe stashes a stage input per tick: 12 more micro-batches, at least 12 more activations.
  assert gpipe[16] - gpipe[4] >= 12 * ACTIVATION, gpipe
  # 1F1B holds min(S, M) = 2 micro-batches on stage 0 whatever M; ZB-H1 as many, plus the
  # weight slots of the micro-batches awaiting W (at most 2 at S = 2).
  assert one_f_one_b[16] <= 1.05 * one_f_one_b[4], one_f_one_b
  assert zb_h1[16] <= 1.05 * zb_h1[4], zb_h1
  assert one_f_one_b[16] < gpipe[16], (one_f_one_b, gpipe)


def test_the_split_backward_does_the_work_of_one_backward():
  """ZB-H1's BI and W together execute the FLOPs of one fused backward B (the program holds B's
  branches too, unused), and BI alone saves the weight-gradient products W then forms."""
  layers, x, targets, _ = _model("blocks")
  mesh = tpipe.make_mesh(stages=2)
  model = tpipe.Sequential(layers, num_stages=2, num_microbatches=2, schedule="zb_h1",
                           per_example=("targets",), mesh=mesh)
  step = jax.jit(jax.grad(lambda p, x, t: model.apply({"params": p}, x, targets=t)))
  compiled = step.lower(_params("blocks"), x, targets).compile()
  found = analysis.fused_flops(compiled, model.schedule_table())
  split, fused_backward = found.actions["BI"] + found.actions["W"], found.actions["B"]
  np.testing.assert_allclose(split, fused_backward, rtol=0.05)
  assert np.all(found.actions["W"] > 0.2 * fused_backward), found.actions
  assert found.lockstep >= found.executed >= found.useful > 0, found


@pytest.mark.parametrize("schedule,repeats", [("1f1b", 1), ("zbv", 2)])
def test_collectives_are_neighbour_sends_every_tick_and_one_reduction_after_the_loop(
    schedule, repeats):
  stages, microbatches = (4, 4) if repeats == 1 else (2, 4)
  layers, x, targets, _ = _model("mlp")
  mesh = tpipe.make_mesh(stages=stages, data=2)
  model = tpipe.Sequential(layers, num_stages=stages, num_microbatches=microbatches,
                           schedule=schedule, num_repeats=repeats, per_example=("targets",),
                           mesh=mesh)
  x, targets = jax.device_put((x, targets), tpipe.data_sharding(mesh))
  step = jax.jit(jax.grad(lambda p, x, t: model.apply({"params": p}, x, targets=t)))
  compiled = step.lower(_params("mlp"), x, targets).compile()
  ticks = model.schedule_table().num_ticks
  found = analysis.collectives(compiled, mesh)
  in_loop = [c for c in found if c.in_loop]
  # Activations right, gradients left: two neighbour sends per tick, nothing else in the loop.
  assert sorted(c.kind for c in in_loop) == ["collective-permute"] * 2, in_loop
  assert all(c.count == ticks and c.axes == ("stage",) for c in in_loop), in_loop
  assert any(c.kind == "all-reduce" and not c.in_loop and "data" in (c.axes or ())
             for c in found), found
  # No collective inside a branch of the tick's conditional.
  module = hlo_lib.parse_hlo(compiled.as_text())
  branches = [c for _, ins in module.instructions() if ins.opcode == "conditional"
              for c in ins.called]
  assert branches
  seen, todo = set(), list(branches)
  while todo:
    name = todo.pop()
    if name in seen or name not in module.computations:
      continue
    seen.add(name)
    for ins in module.computations[name].instructions:
      assert not ins.opcode.lstrip("ragged-").startswith(analysis.COLLECTIVE_KINDS), (
          name, ins.opcode)
      todo += ins.called


class Logits(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(x)


def test_a_stack_without_per_example_losses_is_rejected():
  model = tpipe.Sequential([DenseAct(8), Logits()], num_stages=2, num_microbatches=2,
                           schedule="1f1b", mesh=tpipe.make_mesh(stages=2))
  x = jnp.ones((4, 5))
  with pytest.raises(ValueError, match=r"schedule='1f1b' returns the mean loss.*per-example "
                                       r"losses.*End the stack with a layer"):
    jax.eval_shape(model.init, {"params": jax.random.key(0)}, x)


def test_a_chunk_count_the_schedule_does_not_use_is_rejected_at_construction():
  with pytest.raises(ValueError, match=r"schedule='zbv' runs 2 chunk.*pass num_repeats=2"):
    tpipe.Sequential([nn.Dense(4)] * 4, num_stages=2, num_microbatches=2, schedule="zbv")
  with pytest.raises(ValueError, match="runs 1 chunk"):
    tpipe.Sequential([nn.Dense(4)] * 4, num_stages=2, num_microbatches=2, schedule="1f1b",
                     num_repeats=2)
  with pytest.raises(ValueError, match="interleaved_1f1b' needs num_repeats >= 2"):
    tpipe.Sequential([nn.Dense(4)] * 4, num_stages=2, num_microbatches=2,
                     schedule="interleaved_1f1b")
