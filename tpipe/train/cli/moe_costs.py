"""What a mixture-of-experts LM's experts hold per device: the report's MoE memory rows.

:func:`moe_memory` gives :mod:`tpipe.train.cli.report` three things about a ``block="moe"``
config (:class:`tpipe.train.moe.MixtureOfExperts` in every block), and None for a dense one:

* the **experts' weights** per device, their optimizer state and their gradients, **measured**:
  the bytes of the staged parameter tree's leaves whose logical names hold ``expert`` (the
  experts' ``gate``, ``up`` and ``down`` kernels of every stacked run of blocks), read from the
  leaves' shardings after the stage / expert / fsdp / tensor split, as the compiled step's
  arguments hold them; the optimizer state's leaves under the same paths likewise; the gradients
  equal the weights leaf for leaf (inside XLA's temporaries);
* the **dispatch buffers** of one MoE layer on one micro-batch on one device, an **estimate from
  the config's shapes** (:func:`dispatch_bytes`): the tokens grouped by expert, the experts'
  hidden activations and their outputs, as :func:`tpipe.train.moe.dropless` (or
  :func:`tpipe.train.moe.with_capacity`) forms them;
* the **routing metadata** of one MoE layer on one micro-batch on one device, an estimate from
  shapes (:func:`routing_bytes`): the router's logits and probabilities in float32, the top-k
  indices and weights, the sort order and the group sizes.

The two estimates are what the layer's code creates; XLA may fuse some away, keep them at once
or not, and under ``remat`` recompute them: they are not read from the compiled program. The
shared expert (Qwen2-MoE's) is a dense MLP every token goes through: its weights stay among the
other parameters and its activations are not dispatch buffers. Experts of a lone MoE layer
packed into a stage's parameter buffer (not in a stacked run) are not told apart there: the
trainer's LM stacks every block.

Example::

  memory = moe_memory(config, exp.layout, exp.abstract_state(), exp.pipeline.spec, exp.mesh)
  memory.expert_param_bytes, memory.dispatch_bytes, memory.routing_bytes
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from tpipe.train import moe

STACKED = "stacked"
EXPERT = "expert"
# The router's scores and softmax are float32 (tpipe.train.moe.route), as are its top-k weights;
# indices, the sort order and the group sizes are int32.
FLOAT32_BYTES = INT32_BYTES = 4


def dispatch_bytes(tokens: int, width: int, hidden: int, num_experts: int,
                   experts_per_token: int, capacity_factor: float, itemsize: int) -> int:
  """The dispatch buffers of one MoE layer on ``tokens`` tokens, in bytes (an estimate from
  shapes: the arrays the layer's code forms, in the compute dtype of ``itemsize`` bytes).

  Dropless (``capacity_factor == 0``), with ``T`` tokens, ``k`` experts per token, width ``D``
  and expert hidden width ``H``::

    T k (3 D + 3 H) itemsize

  the grouped tokens the experts multiply (``T k`` rows of width ``D``), the experts' hidden
  activations (gate and up outputs and their SwiGLU product: three ``T k x H``), the experts'
  outputs in group order and the same scattered back to token order (two ``T k x D``).

  With a capacity ``c > 0``, each of ``E`` experts has ``C = ceil(c T k / E)`` slots
  (:func:`tpipe.train.moe.capacity_of`)::

    (2 k T E C + E C (2 D + 3 H)) itemsize

  the dispatch and combine masks (``[k, T, E, C]`` each), the slots' inputs and outputs
  (``[E, C, D]`` each) and the hidden activations (three ``[E, C, H]``).

  ``hidden`` is the width one device holds: the experts' ``H`` over the devices their ``mlp``
  dimension splits over (``tensor``), whose shares of the hidden activations these are. The
  rows are not split over ``expert``: each device's buffers have a row for every pair (the
  groups of other devices' experts among them), as XLA's partitioner lays out the grouped
  matmul of rows held whole by weights split by group.
  """
  t, k, d, h, e = tokens, experts_per_token, width, hidden, num_experts
  if not capacity_factor:
    return t * k * (3 * d + 3 * h) * itemsize
  c = moe.capacity_of(t, k, e, capacity_factor)
  return (2 * k * t * e * c + e * c * (2 * d + 3 * h)) * itemsize


def routing_bytes(tokens: int, num_experts: int, experts_per_token: int,
                  capacity_factor: float) -> int:
  """The routing metadata of one MoE layer on ``tokens`` tokens, in bytes (an estimate from
  shapes). Dropless, with ``T`` tokens, ``E`` experts and ``k`` per token::

    4 (2 T E + 4 T k + E)

  the router's logits and softmax (float32 ``[T, E]`` each), the top-k probabilities, mixing
  weights (float32 ``[T, k]`` each) and expert indices (int32 ``[T, k]``), the sort order of
  the ``T k`` pairs (int32) and the group sizes (int32 ``[E]``). With a capacity, the sort
  order and group sizes give way to the slot bookkeeping, three int32 ``[k T, E]`` (one-hot
  experts, slot positions, kept pairs)::

    4 (2 T E + 3 T k + 3 k T E)
  """
  t, e, k = tokens, num_experts, experts_per_token
  router = 2 * t * e * FLOAT32_BYTES
  top_k = 2 * t * k * FLOAT32_BYTES + t * k * INT32_BYTES
  if not capacity_factor:
    return router + top_k + (t * k + e) * INT32_BYTES
  return router + top_k + 3 * k * t * e * INT32_BYTES


def hidden_shards(params, axes: dict) -> int:
  """The devices the experts' hidden width ``H`` splits over: read off the first stacked expert
  kernel whose last logical axis is ``mlp`` (its global over its per-device width); 1 without
  one."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    names = _expert_names(path, axes)
    if names and names[-1] == "mlp" and getattr(leaf, "sharding", None) is not None:
      return max(1, leaf.shape[-1] // leaf.sharding.shard_shape(leaf.shape)[-1])
  return 1


def _expert_names(path, axes: dict) -> tuple:
  """The logical names of the stacked leaf ``path`` leads to (a key path into the staged tree or
  into optimizer state that mirrors it) where they hold ``expert``, else ()."""
  keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
  for i, key in enumerate(keys[:-1]):
    if key == STACKED:
      rest = jax.tree_util.keystr(tuple(path[i + 2:]))
      names = tuple(axes.get(keys[i + 1], {}).get(rest) or ())
      return names if EXPERT in names else ()
  return ()


def _is_expert_leaf(path, axes: dict) -> bool:
  """Whether ``path`` (a key path into the staged tree or into optimizer state that mirrors it)
  leads to a stacked leaf whose logical names hold ``expert``."""
  return bool(_expert_names(path, axes))


def expert_leaf_bytes(tree, axes: dict) -> int:
  """Bytes on one device (the fullest) of ``tree``'s leaves under the stacked runs whose logical
  names hold ``expert`` (``axes``: :attr:`tpipe.core.layout.description.StageLayout.axes`),
  read from their shardings."""
  from tpipe.tools import analysis  # pylint: disable=g-import-not-at-top

  leaves = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
            if _is_expert_leaf(path, axes)]
  return analysis.input_bytes(leaves)[1] if leaves else 0


@dataclasses.dataclass(frozen=True)
class MoeMemory:
  """A MoE config's memory rows, bytes per device (see the module docstring for which are
  measured and which estimated).

  Attributes:
    expert_param_bytes: the experts' weights (measured from the staged tree's shardings).
    expert_opt_state_bytes: their optimizer state (likewise).
    dispatch_bytes: one MoE layer's dispatch buffers on one micro-batch (estimate).
    routing_bytes: one MoE layer's routing metadata on one micro-batch (estimate).
    tokens: the tokens one device routes per MoE layer and micro-batch (the micro-batch's rows
      on one device, :meth:`tpipe.PipelineSpec.microbatch_size`, times the sequence length).
    hidden: the experts' hidden width one device holds (``mlp_dim`` over the devices their
      ``mlp`` dimension splits over: :func:`hidden_shards`).
    moe_layers: the model's MoE layers.
    num_experts: ``E``.
    experts_per_token: ``k``.
    capacity_factor: 0 for dropless.
  """

  expert_param_bytes: int
  expert_opt_state_bytes: int
  dispatch_bytes: int
  routing_bytes: int
  tokens: int
  hidden: int
  moe_layers: int
  num_experts: int
  experts_per_token: int
  capacity_factor: float

  @property
  def expert_gradient_bytes(self) -> int:
    """The experts' gradients: their weights' bytes, leaf for leaf."""
    return self.expert_param_bytes

  def to_json(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), "expert_gradient_bytes": self.expert_gradient_bytes}


def moe_memory(config, layout, state, spec, mesh) -> MoeMemory | None:
  """The MoE memory rows of an LM ``config`` (None unless ``config.block == "moe"``).

  Args:
    config: the experiment config.
    layout: the model's :class:`tpipe.core.layout.description.StageLayout` (its ``axes``
      name each staged leaf's logical axes).
    state: the abstract train state (``params`` and ``opt_state`` with shardings).
    spec: the pipeline's :class:`tpipe.PipelineSpec`.
    mesh: the mesh the step runs on.
  """
  from tpipe.train import architecture  # pylint: disable=g-import-not-at-top

  if config.get("block") != "moe":
    return None
  args = architecture.lm_arguments(config)
  rows = spec.microbatch_size(config.batch_size, spec.row_shards(mesh))
  tokens = rows * config.seq_len
  e, k, cf = args["num_experts"], args["experts_per_token"], args["capacity_factor"]
  itemsize = jnp.dtype(args["dtype"]).itemsize
  hidden = -(-args["mlp_dim"] // hidden_shards(state.params, layout.axes))
  return MoeMemory(
      expert_param_bytes=expert_leaf_bytes(state.params, layout.axes),
      expert_opt_state_bytes=expert_leaf_bytes(state.opt_state, layout.axes),
      # The explicit exchange groups the pairs a capacity keeps as it groups all of them
      # (the dropped ones keep their rows): its buffers are the dropless ones either way.
      dispatch_bytes=dispatch_bytes(tokens, args["width"], hidden, e, k,
                                    0.0 if args.get("moe_dispatch") == "all_to_all" else cf,
                                    itemsize),
      routing_bytes=routing_bytes(tokens, e, k, cf),
      tokens=int(tokens), hidden=int(hidden), moe_layers=int(args["num_layers"]),
      num_experts=int(e), experts_per_token=int(k), capacity_factor=float(cf))


def describe_tokens(memory: MoeMemory) -> str:
  """One line on what the estimates count, for the report's text."""
  routing = ("dropless" if not memory.capacity_factor
             else f"capacity factor {memory.capacity_factor:g}")
  return (f"MoE: {memory.moe_layers} layers, top-{memory.experts_per_token} of "
          f"{memory.num_experts} experts, {routing}; the dispatch and routing rows are one MoE "
          f"layer on one micro-batch of {memory.tokens:,} tokens on one device (expert hidden "
          f"width {memory.hidden:,} per device), estimated from "
          "the config's shapes (tpipe.train.cli.moe_costs); the experts' rows are measured from "
          "the staged parameter tree's shardings.")
