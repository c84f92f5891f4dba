"""Mixture-of-experts feed-forward layers: top-k routing, dropless or with a capacity, and the
router's auxiliary losses.

A token's router scores every expert (float32 softmax over ``E`` experts); it goes to its ``k``
best, whose SwiGLU outputs are mixed with the top-k probabilities renormalised to sum to one
(Mixtral's rule) or, with ``normalize_expert_weights=False``, with the probabilities as they are
(Qwen2-MoE's ``norm_topk_prob=False``). An optional **shared expert** (Qwen2-MoE's; DeepSeek's
models have them too) is a dense SwiGLU MLP every token goes through, its output scaled by a
per-token gate ``sigmoid(x @ shared_router)`` and added to the routed experts' mix. Two ways to
run the routed experts, the same numbers where no token is dropped:

* **dropless** (``capacity_factor=0``, the default): the ``N * k`` (token, expert) pairs sorted
  by expert and multiplied with one grouped matmul per projection
  (:func:`tpipe.train.experts.grouped_matmul`,
  ``jax.lax.ragged_dot``): no token dropped, no padding.
* **capacity** (``capacity_factor=c > 0``): each expert takes at most
  ``ceil(c * N * k / E)`` pairs, in token order; pairs beyond it are dropped (their share of
  the output is zero) and counted. The experts run as one batched matmul over ``[E, capacity]``
  slots, the GShard / Switch layout MaxText's capacity mode uses (under the explicit exchange
  below: the grouped matmul of the pairs kept, the same pairs dropped).

Where the experts split over an ``expert`` mesh axis, two ways to bring them their tokens
(``dispatch``):

* ``"partitioner"`` (the default): XLA's partitioner makes the exchange from the weights'
  sharding (it gathers the tokens to every expert device and sums the experts' outputs);
* ``"all_to_all"``: :mod:`tpipe.train.expert_dispatch` sends each device's
  pairs to the devices that hold their experts by an explicit all-to-all over ``expert`` and
  the outputs back: per layer, two all-to-alls of activations forward (and a small one of
  expert ids) and two backward.

Auxiliary losses (added to the training loss through :mod:`tpipe.core.planning.aux_losses`: linen's
``self.sow(tpipe.AUX_LOSS, ...)``, NNX's ``self.sow(tpipe.nnx.AuxLoss, ...)``): the
load-balancing loss as Switch and Mixtral define it, ``E * sum_e f_e * P_e`` with ``f_e`` the
fraction of tokens routed to expert ``e`` (over the ``k`` choices) and ``P_e`` its mean router
probability (``k`` when perfectly balanced), and the router z-loss
``mean(logsumexp(logits) ** 2)`` (ST-MoE), each times its coefficient.

Weights carry logical names: the experts' ``("expert", "embed", "mlp")`` and
``("expert", "mlp", "embed")``, the router's ``("embed", None)``; under
:data:`tpipe.DEFAULT_RULES` the experts split over the ``expert`` mesh axis. The shared expert's
``shared_gate``/``shared_up`` ``("embed", "mlp")`` and ``shared_down`` ``("mlp", "embed")``
split as a dense MLP's, its gate ``shared_router`` ``[D, 1]`` as the router.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import tpipe
from tpipe import mesh as mesh_lib
from tpipe.core.base import spmd
from tpipe.train import expert_dispatch
from tpipe.train import experts as experts_lib
from tpipe.train import model_args

_named = model_args.named


class Routing(NamedTuple):
  """Where each token goes.

  Attributes:
    experts: int32 ``[N, k]``, each token's experts, best first.
    weights: float32 ``[N, k]``, their mixing weights (the top-k probabilities, renormalised
      to sum to one unless the routing keeps them as they are).
    probs: float32 ``[N, E]``, the router's softmax.
    logits: float32 ``[N, E]``, the router's scores.
  """

  experts: jax.Array
  weights: jax.Array
  probs: jax.Array
  logits: jax.Array


DISPATCHES = ("partitioner", "all_to_all")


def check_routing(num_experts: int, experts_per_token: int, capacity_factor: float,
                  owner: str = "MixtureOfExperts", *, normalize_expert_weights: bool = True,
                  shared_expert_hidden: int = 0, dispatch: str = "partitioner",
                  exchange_chunks: int = 1) -> None:
  """Raises ValueError for a routing (or a shared expert) no layer can run, naming the value and
  the fix."""
  if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
    raise ValueError(f"{owner}: num_experts must be an int >= 1, got {num_experts!r}.")
  whole = isinstance(experts_per_token, int) and not isinstance(experts_per_token, bool)
  if not whole or not 1 <= experts_per_token <= num_experts:
    raise ValueError(f"{owner}: experts_per_token must be an int from 1 to num_experts = "
                     f"{num_experts}, got {experts_per_token!r}.")
  if not isinstance(capacity_factor, (int, float)) or capacity_factor < 0:
    raise ValueError(f"{owner}: capacity_factor must be >= 0 (0 = dropless), got "
                     f"{capacity_factor!r}.")
  if not isinstance(normalize_expert_weights, (bool, np.bool_)):
    raise ValueError(f"{owner}: normalize_expert_weights must be True (the top-k weights "
                     "renormalised to sum to one, Mixtral) or False (the router's probabilities "
                     f"as they are, Qwen2-MoE), got {normalize_expert_weights!r}.")
  whole = (isinstance(shared_expert_hidden, (int, np.integer))
           and not isinstance(shared_expert_hidden, bool))
  if not whole or shared_expert_hidden < 0:
    raise ValueError(f"{owner}: shared_expert_hidden (the shared expert's hidden width) must be "
                     f"an int >= 0 (0 = no shared expert), got {shared_expert_hidden!r}.")
  if dispatch not in DISPATCHES:
    raise ValueError(f"{owner}: dispatch must be one of {DISPATCHES}, got {dispatch!r}.")
  expert_dispatch.check_chunks(exchange_chunks, owner=owner)
  if exchange_chunks > 1 and dispatch != "all_to_all":
    raise ValueError(f"{owner}: exchange_chunks={exchange_chunks} splits the explicit "
                     f"all-to-all, and dispatch={dispatch!r} has none; use "
                     "dispatch='all_to_all' or exchange_chunks=1.")


def check_expert_axis(num_experts: int, owner: str = "MixtureOfExperts") -> None:
  """Raises ValueError when the ``expert`` axis of the mesh in context (inside a pipeline's
  ``shard_map`` or ``jax.set_mesh``) does not divide ``num_experts``: the experts would be kept
  whole on every device of the axis instead of split over it."""
  mesh = jax.sharding.get_abstract_mesh()
  size = 1 if mesh.empty else dict(mesh.shape).get(mesh_lib.EXPERT_AXIS, 1)
  if num_experts % size:
    raise ValueError(f"{owner}: num_experts={num_experts} is not divisible by the mesh's "
                     f"{mesh_lib.EXPERT_AXIS!r} axis of {size} devices; use a multiple of "
                     f"{size} experts or an expert axis that divides {num_experts}.")


def rows_over_expert(x: jax.Array) -> jax.Array:
  """``x`` with its rows (the leading axis) split over the ``expert`` axis inside a pipeline's
  stage, where that axis has devices and divides the rows; where the devices outnumber the
  rows, each row's positions split over the devices it spans
  (:func:`tpipe.core.base.spmd.split_over_expert`); ``x`` as it is elsewhere.

  Outside the mixture-of-experts layers the expert axis carries data: attention and norms hold
  ``1 / expert`` of a micro-batch's tokens per device instead of all of them, and so does the
  stash between stages where the rows divide over the devices (a packed stash keeps a split
  of positions whole: :func:`tpipe.core.base.spmd.rows_over_expert_axis`). The layers take the
  rows whole (:func:`rows_whole`) and hand them back split. Not beside a ``tensor`` axis (see
  :func:`tpipe.core.base.spmd.expert_devices_here`)."""
  size = spmd.expert_devices_here()
  split = None if size == 1 else spmd.split_over_expert(x, size)
  return x if split is None else split


def rows_whole(x: jax.Array) -> jax.Array:
  """``x`` whole on every device of the partitioner's axes inside a pipeline's stage that has an
  ``expert`` axis (the tokens a mixture-of-experts layer routes: the partitioner gathers them
  there); ``x`` as it is elsewhere."""
  if spmd.expert_devices_here() == 1:
    return x
  return jax.lax.with_sharding_constraint(x, P())


def route(x: jax.Array, router: jax.Array, experts_per_token: int,
          normalize: bool = True) -> Routing:
  """The top-k routing of tokens ``x`` ``[N, D]`` by router weights ``[D, E]``, in float32 (or
  wider, for wider inputs); the mixing weights are the top-k probabilities renormalised to sum
  to one (Mixtral) or, with ``normalize=False``, as they are (Qwen2-MoE)."""
  dtype = jnp.promote_types(x.dtype, jnp.float32)
  logits = jnp.dot(x.astype(dtype), router.astype(dtype))
  probs = jax.nn.softmax(logits, axis=-1)
  top, experts = jax.lax.top_k(probs, experts_per_token)
  weights = top / jnp.sum(top, axis=-1, keepdims=True) if normalize else top
  return Routing(experts.astype(jnp.int32), weights, probs, logits)


def balance_loss(routing: Routing) -> jax.Array:
  """``E * sum_e f_e * P_e``: Switch's / Mixtral's load-balancing loss (``k`` when balanced)."""
  num_tokens, num_experts = routing.probs.shape
  counts = expert_load(routing).astype(routing.probs.dtype)
  return num_experts * jnp.sum(counts / num_tokens * jnp.mean(routing.probs, axis=0))


def z_loss(routing: Routing) -> jax.Array:
  """ST-MoE's router z-loss: the mean over tokens of ``logsumexp(logits) ** 2``."""
  return jnp.mean(jax.nn.logsumexp(routing.logits, axis=-1) ** 2)


def expert_load(routing: Routing) -> jax.Array:
  """The (token, expert) pairs each expert got, float32 ``[E]``."""
  num_experts = routing.probs.shape[-1]
  return jnp.zeros((num_experts,), jnp.float32).at[routing.experts.reshape(-1)].add(1.0)


def load_imbalance(routing: Routing) -> jax.Array:
  """The busiest expert's pairs over the mean per expert (1 when the load is even, ``E`` when
  one expert takes every pair), float32."""
  load = expert_load(routing)
  return jnp.max(load) / jnp.mean(load)


def sow_metrics(sow, routing: Routing, dropped=None) -> None:
  """Sows the router's metrics with ``sow(name, value)``: ``expert_load``
  (:func:`load_imbalance`) and, with a capacity, ``dropped`` (the share of pairs dropped)."""
  sow("expert_load", load_imbalance(routing))
  if dropped is not None:
    sow("dropped", dropped / routing.experts.size)


def _swiglu(gate, up):
  return nn.silu(gate) * up


def dropless(x: jax.Array, routing: Routing, w_gate, w_up, w_down) -> jax.Array:
  """Every (token, expert) pair through its expert's SwiGLU by grouped matmuls; ``[N, D]``.

  ``w_gate``/``w_up`` ``[E, D, H]``, ``w_down`` ``[E, H, D]``."""
  num_tokens, k = routing.experts.shape
  num_experts = w_gate.shape[0]
  flat = routing.experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  tokens = x[order // k]
  sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
  out = experts_lib.swiglu(tokens, w_gate, w_up, w_down, sizes)
  pairs = jnp.zeros_like(out).at[order].set(out).reshape(num_tokens, k, -1)
  return jnp.einsum("nkd,nk->nd", pairs, routing.weights.astype(x.dtype))


def shared_expert(x: jax.Array, w_gate, w_up, w_down, w_router) -> jax.Array:
  """The shared expert: every token ``x [N, D]`` through one SwiGLU (``w_gate``/``w_up``
  ``[D, H]``, ``w_down [H, D]``), scaled by its gate ``sigmoid(x @ w_router)``
  (``w_router [D, 1]``); ``[N, D]`` in ``x``'s dtype."""
  hidden = _swiglu(x @ w_gate.astype(x.dtype), x @ w_up.astype(x.dtype))
  return jax.nn.sigmoid(x @ w_router.astype(x.dtype)) * (hidden @ w_down.astype(x.dtype))


def capacity_of(num_tokens: int, experts_per_token: int, num_experts: int,
                capacity_factor: float) -> int:
  """Slots per expert: ``ceil(capacity_factor * N * k / E)``, at least 1."""
  return max(1, math.ceil(capacity_factor * num_tokens * experts_per_token / num_experts))


def slot_positions(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
  """Each pair's expert and its place in that expert's queue: ``(onehot [kN, E], position
  [kN])``, the pairs of ``experts [N, k]`` choice-major (every token's best expert before any
  token's second), tokens in order. Pairs whose position is below the capacity keep a slot."""
  onehot = jax.nn.one_hot(experts.T.reshape(-1), num_experts, dtype=jnp.int32)
  return onehot, jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)


def kept_pairs(experts: jax.Array, num_experts: int, capacity: int) -> jax.Array:
  """Boolean ``[N, k]``: whether each (token, choice) pair of ``experts [N, k]`` has one of its
  expert's ``capacity`` slots (:func:`slot_positions`), the rule :func:`with_capacity` drops
  by."""
  num_tokens, k = experts.shape
  _, position = slot_positions(experts, num_experts)
  return (position < capacity).reshape(k, num_tokens).T


def with_capacity(x: jax.Array, routing: Routing, w_gate, w_up, w_down,
                  capacity_factor: float) -> tuple[jax.Array, jax.Array]:
  """The pairs that fit each expert's capacity through its SwiGLU, batched over ``[E, C]``
  slots; ``(output [N, D], dropped pairs (float32 scalar))``. A token's pairs claim slots in
  token order, its best expert first (:func:`slot_positions`)."""
  num_tokens, k = routing.experts.shape
  num_experts = w_gate.shape[0]
  capacity = capacity_of(num_tokens, k, num_experts, capacity_factor)
  onehot, position = slot_positions(routing.experts, num_experts)
  fits = position < capacity
  kept = fits[:, None] * onehot  # [kN, E]
  slots = jax.nn.one_hot(jnp.where(fits, position, 0), capacity, dtype=x.dtype)  # [kN, C]
  dispatch = kept.astype(x.dtype)[:, :, None] * slots[:, None, :]  # [kN, E, C]
  dispatch = dispatch.reshape(k, num_tokens, num_experts, capacity)
  inputs = jnp.einsum("knec,nd->ecd", dispatch, x)
  hidden = _swiglu(jnp.einsum("ecd,edh->ech", inputs, w_gate.astype(x.dtype)),
                   jnp.einsum("ecd,edh->ech", inputs, w_up.astype(x.dtype)))
  outputs = jnp.einsum("ech,ehd->ecd", hidden, w_down.astype(x.dtype))
  combine = dispatch * routing.weights.T.astype(x.dtype)[:, :, None, None]
  dropped = num_tokens * k - jnp.sum(kept).astype(jnp.float32)
  return jnp.einsum("knec,ecd->nd", combine, outputs), dropped


def mixture(x: jax.Array, router, experts, shared, settings, *, sow_loss, sow_metric):
  """A mixture-of-experts layer's computation on ``x`` ``[..., D]``, both front ends' (linen's
  :class:`MixtureOfExperts` and :class:`tpipe.train.models_nnx.MixtureOfExperts`).

  Args:
    x: the activations.
    router: ``[D, E]``.
    experts: ``(gate, up, down)``, ``[E, D, H]``, ``[E, D, H]``, ``[E, H, D]``.
    shared: the shared expert's ``(gate, up, down, router)``, or None.
    settings: the layer (its ``experts_per_token``, ``capacity_factor``,
      ``normalize_expert_weights``, ``router_aux_loss_coef``, ``router_z_loss_coef``,
      ``dispatch``, ``exchange_chunks`` and ``dtype``).
    sow_loss: ``sow_loss(name, value)`` adds an auxiliary loss.
    sow_metric: ``sow_metric(name, value)`` reports an auxiliary metric.

  Returns:
    ``[..., D]`` in ``settings.dtype`` (None: ``x``'s), its rows split over the expert axis
    where :func:`rows_over_expert` splits them.
  """
  dtype = settings.dtype or x.dtype
  exchange = settings.dispatch == "all_to_all" and expert_dispatch.devices_here() > 1
  tokens = x.reshape(-1, x.shape[-1]).astype(dtype)
  tokens = tokens if exchange else rows_whole(tokens)
  routing = route(tokens, router, settings.experts_per_token, settings.normalize_expert_weights)
  if exchange:
    kept = dropped = None
    if settings.capacity_factor:
      num_tokens, k = routing.experts.shape
      num_experts = experts[0].shape[0]
      capacity = capacity_of(num_tokens, k, num_experts, settings.capacity_factor)
      kept = kept_pairs(routing.experts, num_experts, capacity)
      dropped = num_tokens * k - jnp.sum(kept).astype(jnp.float32)
    pairs = expert_dispatch.expert_outputs(tokens, routing.experts, *experts, kept=kept,
                                           chunks=int(settings.exchange_chunks))
    out = jnp.einsum("nkd,nk->nd", pairs, routing.weights.astype(dtype))
  elif settings.capacity_factor:
    out, dropped = with_capacity(tokens, routing, *experts, settings.capacity_factor)
  else:
    out, dropped = dropless(tokens, routing, *experts), None
  if shared is not None:
    out = out + shared_expert(tokens, *shared)
  sow_metrics(sow_metric, routing, dropped)
  if settings.router_aux_loss_coef:
    sow_loss("router_balance", settings.router_aux_loss_coef * balance_loss(routing))
  if settings.router_z_loss_coef:
    sow_loss("router_z", settings.router_z_loss_coef * z_loss(routing))
  return rows_over_expert(out.reshape(x.shape).astype(dtype))


class MixtureOfExperts(nn.Module):
  """A mixture-of-experts SwiGLU feed-forward layer: ``[..., D]`` to ``[..., D]``.

  Attributes:
    num_experts: ``E``.
    experts_per_token: ``k``, the experts each token goes to.
    hidden: each expert's hidden width ``H``.
    capacity_factor: 0 for dropless routing, else the capacity factor (see the module).
    router_aux_loss_coef: the load-balancing loss's weight in the training loss.
    router_z_loss_coef: the router z-loss's weight.
    normalize_expert_weights: mix the ``k`` experts with their router probabilities
      renormalised to sum to one (True, Mixtral) or as they are (False, Qwen2-MoE).
    shared_expert_hidden: 0 for none, else the hidden width of a shared SwiGLU expert every
      token goes through, gated by ``sigmoid(x @ shared_router)`` (Qwen2-MoE's).
    dispatch: how tokens reach experts split over an ``expert`` mesh axis: ``"partitioner"``
      (XLA's partitioner, from the weights' sharding) or ``"all_to_all"`` (an explicit
      all-to-all; :mod:`tpipe.train.expert_dispatch`).
    exchange_chunks: with ``dispatch="all_to_all"``, the parts each device's tokens are
      exchanged in (:func:`tpipe.train.expert_dispatch.expert_outputs`): one part's all-to-all
      can run while the experts compute another's. 1: one exchange.
    dtype: the computation's dtype, None for the input's (routing is float32 or wider).
    param_dtype: the weights' dtype.
    kernel_init: the experts', the router's and the shared expert's initializer.

  Besides the auxiliary losses (collection ``tpipe.AUX_LOSS``) it sows auxiliary metrics
  (``tpipe.AUX_METRIC``, reported by ``loss_terms`` and the trainer): ``expert_load``, the busiest
  expert's pairs over the mean (:func:`load_imbalance`), and with a capacity ``dropped``, the
  share of pairs dropped.
  """

  num_experts: int
  experts_per_token: int
  hidden: int
  capacity_factor: float = 0.0
  router_aux_loss_coef: float = 0.0
  router_z_loss_coef: float = 0.0
  normalize_expert_weights: bool = True
  shared_expert_hidden: int = 0
  dispatch: str = "partitioner"
  exchange_chunks: int = 1
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Any = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, x):
    check_routing(self.num_experts, self.experts_per_token, self.capacity_factor,
                  normalize_expert_weights=self.normalize_expert_weights,
                  shared_expert_hidden=self.shared_expert_hidden, dispatch=self.dispatch,
                  exchange_chunks=self.exchange_chunks)
    check_expert_axis(self.num_experts)
    width = x.shape[-1]
    e, h = self.num_experts, self.hidden
    expert_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                   in_axis=-2, out_axis=-1, batch_axis=(0,))
    router = self.param("router", _named(self.kernel_init, ("embed", None)), (width, e),
                        self.param_dtype)
    w_gate = self.param("gate", _named(expert_init, ("expert", "embed", "mlp")), (e, width, h),
                        self.param_dtype)
    w_up = self.param("up", _named(expert_init, ("expert", "embed", "mlp")), (e, width, h),
                      self.param_dtype)
    w_down = self.param("down", _named(expert_init, ("expert", "mlp", "embed")), (e, h, width),
                        self.param_dtype)
    shared = None
    if self.shared_expert_hidden:
      hidden = self.shared_expert_hidden
      dense = lambda name, shape, names: self.param(name, _named(self.kernel_init, names), shape,
                                                    self.param_dtype)
      shared = (dense("shared_gate", (width, hidden), ("embed", "mlp")),
                dense("shared_up", (width, hidden), ("embed", "mlp")),
                dense("shared_down", (hidden, width), ("mlp", "embed")),
                dense("shared_router", (width, 1), ("embed", None)))
    return mixture(x, router, (w_gate, w_up, w_down), shared, self,
                   sow_loss=functools.partial(self.sow, tpipe.AUX_LOSS),
                   sow_metric=functools.partial(self.sow, tpipe.AUX_METRIC))
