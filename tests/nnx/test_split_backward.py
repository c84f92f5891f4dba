"""The zero-bubble split backward of NNX layers: the weight gradients move to ``W``.

:mod:`tpipe.core.programs.taps` traces a layer's function to a jaxpr whatever the front end, so a
``tpipe.nnx.Sequential`` of NNX layers run with ``"zb_h1"`` (S=2, M=4) or ``"zbv"`` (S=2, two
chunks per stage) splits each chunk's backward as a linen ``tpipe.Sequential`` of the same
layers does. Measured on the compiled loss-gradient step (``tpipe.tools.analysis.fused_flops``,
which counts each action's branch of the tick loop per model chunk), for the LM of
:mod:`tests.helpers.nnx_models` (embedding, 6 pre-LayerNorm blocks of two ``nnx.Linear``, head
with its loss) and its linen twin (the same lookup, :mod:`tests.helpers.linen_models` blocks and
head):

* ``W`` runs at least the weight-gradient product ``x^T dy`` of every ``nnx.Linear`` kernel of
  the chunk (``2 * tokens * d_in * d_out`` FLOPs each, as many as the forward product);
* nothing is done twice: ``BI + W`` executes the FLOPs of one fused backward ``B`` (measured
  in the same model run with the unsplit schedule of the same chunks: 1F1B for ZB-H1,
  interleaved 1F1B for ZB-V; the split program compiles no ``B``), so ``BI`` is below ``B`` by
  those products;
* the NNX chunk programs execute the linen ones' FLOPs in every action, ``W`` included (5%);
* and the NNX gradients equal the plain model's (numerics rule: :mod:`tests.helpers.numerics`).
"""

import functools

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx

import tpipe
from tests.helpers import linen_models
from tests.helpers import nnx_models
from tests.helpers import numerics
from tpipe.tools import analysis

STAGES, MICROBATCHES = 2, 4
# schedule: (chunks per stage, units per chunk). The LM's units: the embedding, 6 blocks, the
# head; the counts are given so that the NNX and linen models are cut alike.
CASES = {"zb_h1": (1, (4, 4)), "zbv": (2, (2, 2, 2, 2))}
# The schedule that runs the same model chunks with a fused backward B.
UNSPLIT = {"zb_h1": "1f1b", "zbv": "interleaved_1f1b"}
BLOCKS = 6
# Per unit, the sizes of its matmul kernels (d_in * d_out): the embedding has none (its lookup's
# weight gradient is a scatter-add), a block up and down, the head its read-out.
W = nnx_models.WIDTH
KERNELS = [[]] + [[W * 2 * W, 2 * W * W]] * BLOCKS + [[W * nnx_models.VOCAB]]
TOKENS = nnx_models.BATCH // MICROBATCHES * nnx_models.SEQ  # Rows of a micro-batch's matmuls.


class LinenEmbed(nn.Module):
  """The linen twin of ``nnx_models.Embed``: the same lookup (``nn.Embed`` adds other ops)."""

  @nn.compact
  def __call__(self, tokens):
    table = self.param("table", nn.initializers.normal(1.0), (nnx_models.VOCAB, W))
    return table[tokens]


def _settings(schedule, run=None):
  """The case ``schedule``'s model, run with ``run`` (default the case's own schedule)."""
  repeats, balance = CASES[schedule]
  # Granularity "chunk": BI's and W's FLOPs are compared with one B's, each recomputing its
  # chunk once ("nested" checkpoints every unit inside the tapped BI program too, a second
  # forward per unit that the split itself does not add).
  return dict(num_stages=STAGES, num_microbatches=MICROBATCHES, schedule=run or schedule,
              num_repeats=repeats, balance=list(balance), remat_granularity="chunk",
              mesh=tpipe.make_mesh(stages=STAGES))


def _flops(compiled, pipeline):
  return analysis.fused_flops(compiled, pipeline.spec.table, pipeline.programs())


def _compiled(schedule, run=None):
  """The case's NNX LM (run with ``run``, default its own schedule): its compiled
  ``(objective(loss), gradients)`` step, the step's arguments and the pipeline's programs."""
  model, x, kwargs = nnx_models.pipelined("lm", **_settings(schedule, run))
  graphdef, state = nnx.split(model)

  def objective(state, x, kwargs):
    return nnx_models.objective(nnx.merge(graphdef, state).loss(x, **kwargs))

  compiled = jax.jit(jax.value_and_grad(objective)).lower(state, x, kwargs).compile()
  return compiled, (state, x, kwargs), model.pipeline_for(x, **kwargs)


@functools.cache
def _nnx(schedule):
  """The NNX LM's compiled ``(objective(loss), gradients)`` step, its results and FLOPs."""
  compiled, arguments, pipeline = _compiled(schedule)
  value, grads = compiled(*arguments)
  return value, grads, _flops(compiled, pipeline)


@functools.cache
def _fused_backward(schedule):
  """Per model chunk, the FLOPs of B in the case's NNX LM run with its :data:`UNSPLIT` twin."""
  compiled, _, pipeline = _compiled(schedule, UNSPLIT[schedule])
  return _flops(compiled, pipeline).actions["B"]


@functools.cache
def _linen(schedule):
  """The FLOPs of the linen twin's compiled loss-gradient step (abstract parameters)."""
  layers = [LinenEmbed(), tpipe.Repeat(linen_models.Block(), BLOCKS),
            linen_models.HeadLoss()]
  x, kwargs, per_example = nnx_models.inputs("lm")
  model = tpipe.Sequential(layers, per_example=per_example, **_settings(schedule))
  plain = tpipe.Sequential(layers, num_stages=1, num_microbatches=1, per_example=per_example)
  params = jax.eval_shape(functools.partial(plain.init, method="initialize"),
                          {"params": jax.random.key(0)}, x, **kwargs)["params"]
  loss = lambda p, x, t: nnx_models.objective(
      model.apply({"params": p}, x, targets=t, method="loss"))
  compiled = jax.jit(jax.value_and_grad(loss)).lower(params, x, kwargs["targets"]).compile()
  return _flops(compiled, model.pipeline_for(x, **kwargs))


def _weight_products(schedule):
  """Per model chunk, the FLOPs of its kernels' weight-gradient products on one micro-batch."""
  _, balance = CASES[schedule]
  bounds = np.cumsum((0,) + balance)
  return np.array([2 * TOKENS * sum(sum(KERNELS[u]) for u in range(start, stop))
                   for start, stop in zip(bounds[:-1], bounds[1:])], float)


def test_the_kernel_sizes_are_the_models():
  params = nnx.to_pure_dict(nnx.state(nnx.List(nnx_models.layers("lm")), nnx.Param))
  assert len(KERNELS) == 2 + params[1]["layer"]["up"]["kernel"].shape[0] == 2 + BLOCKS
  block = params[1]["layer"]
  assert KERNELS[1] == [block["up"]["kernel"][0].size, block["down"]["kernel"][0].size]
  assert KERNELS[-1] == [params[2]["out"]["kernel"].size]
  assert all(sum(CASES[s][1]) == len(KERNELS) for s in CASES)


@pytest.mark.parametrize("schedule", CASES)
def test_the_nnx_gradients_equal_the_layers_in_order(schedule):
  value, grads, _ = _nnx(schedule)
  plain_value, plain_grads = nnx_models.plain_loss(MICROBATCHES)
  exact_value, exact_grads = nnx_models.plain_loss(1, "float64")
  numerics.assert_as_close_as_plain(value, plain_value, exact_value, what="loss")
  numerics.assert_as_close_as_plain(nnx.to_pure_dict(grads)["layers"], plain_grads, exact_grads,
                                    what="gradients")


@pytest.mark.parametrize("schedule", CASES)
def test_w_forms_the_weight_gradient_products_and_bi_leaves_them_out(schedule):
  _, _, found = _nnx(schedule)
  actions = found.actions
  assert actions["F"].shape == (STAGES * CASES[schedule][0],)
  products = _weight_products(schedule)
  assert np.all(products > 0)
  # Every kernel's x^T dy runs in W (plus the embedding's scatter-add and the accumulation).
  assert np.all(actions["W"] >= products), (actions["W"], products)
  # No work twice: BI and W together are one backward B (recomputing the forward in W would
  # add F, over a fifth of B). The split program compiles no B.
  backward = _fused_backward(schedule)
  assert np.isnan(actions["B"]).all() and np.all(backward > 0), (actions, backward)
  np.testing.assert_allclose(actions["BI"] + actions["W"], backward, rtol=0.05)
  assert np.all(actions["F"] > 0.2 * backward), (actions, backward)
  # BI leaves those products out: it is below B by (nearly, as XLA fuses the rest alike) them.
  # (0.86 of them for ZB-V's head chunk, whose kernel's gradient B writes into its shared leaf
  # rather than adding it into a packed buffer's elements: 0.91 before.)
  assert np.all(backward - actions["BI"] >= 0.85 * products), (actions, backward, products)
  # Each stage runs F, BI and W once per micro-batch for each chunk it holds, and never B.
  table = tpipe.schedules.build(schedule, STAGES, MICROBATCHES, CASES[schedule][0])
  once = actions["F"] + actions["BI"] + actions["W"]
  held = [table.virtual_stage[s] for s in range(STAGES)]
  np.testing.assert_allclose(found.per_stage, [MICROBATCHES * once[v].sum() for v in held])


@pytest.mark.parametrize("schedule", CASES)
def test_the_nnx_split_executes_the_flops_of_the_linen_split(schedule):
  nnx_found, linen_found = _nnx(schedule)[2], _linen(schedule)
  assert np.isnan(nnx_found.actions["B"]).all() and np.isnan(linen_found.actions["B"]).all()
  for action in ("F", "BI", "W"):
    assert np.all(nnx_found.actions[action] > 0), (action, nnx_found.actions)
    np.testing.assert_allclose(nnx_found.actions[action], linen_found.actions[action],
                               rtol=0.05, err_msg=action)
  np.testing.assert_allclose(nnx_found.per_stage, linen_found.per_stage, rtol=0.05)
