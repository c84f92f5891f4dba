"""Expert parallelism by an explicit all-to-all: a mixture-of-experts layer's tokens sent to the
devices that hold their experts over the ``expert`` mesh axis, and the experts' outputs sent back.

Inside a pipeline's stage the ``expert`` axis is left to XLA's partitioner. Given experts split
over it and only the weights' sharding to go by, the partitioner gathers every token to every
expert device, runs each device's experts on the pairs routed to them, and sums the outputs
with an all-reduce. :func:`expert_outputs` spells the exchange out instead, so the program holds
all-to-alls over ``expert``: per layer forward, the pairs' tokens there (with a small one of
their experts' ids) and their outputs back; backward, the outputs' gradients there and the
tokens' back:

1. the tokens are viewed as ``[devices, n, D]``, a block of rows per device of the axis, and
   every step below runs per block (``vmap`` over that leading axis, which stays split over
   ``expert``, so each device computes only its own);
2. each device sorts its ``n * k`` (token, expert) pairs by expert and writes them into one
   block per destination device (the device that holds the expert): ``[devices, devices, n * k,
   D]``, split over ``expert`` on the first axis (the source);
3. swapping the two leading axes under a sharding constraint on the first is the all-to-all:
   each device now holds the pairs routed to its experts, ``devices * n * k`` rows;
4. its experts run as one grouped matmul per projection (``jax.lax.ragged_dot`` on each
   device's rows, in a ``shard_map`` over ``expert`` of that one operation), no pair dropped;
5. the outputs travel back by the inverse swap and are put back in token order.

With a capacity (:func:`tpipe.train.moe.kept_pairs`: which pairs keep a slot, by the global
order every device's pairs claim them in) the pairs dropped still travel in their blocks but join
no expert's group: no expert computes them and their output is zero, as the batched capacity
layout drops them.

The exchange is expressed through sharding constraints, not inside a ``shard_map``: JAX's
partial evaluation (rematerialization, the zero-bubble schedules' split backward) splits a
``shard_map`` over ``expert`` inside a stage's ``shard_map`` into parts whose residuals' specs
name the stage's manual axes (every value there varies over them), which JAX 0.10 cannot lower.
Autodiff of the swaps gives the backward's all-to-alls.

Blocks have a fixed size: a device may route all of its pairs to one device's experts, so each
block has room for ``n * k`` rows (dropless, whatever the routing), ``expert`` times the pairs a
device holds. Even so, compiled for ``v5p:2x2x2`` (``experiments/moe_dispatch.py``) the exchange
moves 1.7-3.2x fewer bytes over ``expert`` per step than the partitioner's gathers of every
token, and the TPU compiler runs its all-to-alls asynchronously, other work scheduled between
start and done (``--xla_tpu_enable_async_all_to_all=true``).

Every step above depends on the one before, so within one exchange the all-to-alls have little
to overlap with. ``chunks`` (the layer's ``exchange_chunks``) splits each device's rows into
that many equal parts, each exchanged and computed on its own: the same bytes and FLOPs, and
the same outputs (a capacity's ``kept`` pairs are chosen over all the rows first), but the TPU
compiler can run one part's all-to-all while the experts compute another's. Compiled for
``v5p:2x2x2`` and priced as the report prices a step (``experiments/moe_exchange_parts.py``),
four parts leave 0.62x of a Mixtral-like step's all-to-all exposed and predict the step 0.90x as
long; on a shape of many small experts, 0.96x and 0.93x.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from tpipe import mesh as mesh_lib
from tpipe.train import experts as experts_lib

EXPERT = mesh_lib.EXPERT_AXIS
_ROWS = P(EXPERT)


def devices_here() -> int:
  """Devices of the ``expert`` axis of the mesh in context when XLA's partitioner owns it (an
  Auto axis, as inside a pipeline's stage or under ``jax.set_mesh``), else 1."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or EXPERT not in mesh.axis_names:
    return 1
  kind = dict(zip(mesh.axis_names, mesh.axis_types))[EXPERT]
  return int(dict(mesh.shape)[EXPERT]) if kind == AxisType.Auto else 1


def check_alone(owner: str = "MixtureOfExperts") -> None:
  """Raises ValueError when the mesh in context leaves another axis of more than one device
  (``tensor``) to the partitioner beside ``expert``: the exchange's sharding constraints split
  rows over ``expert`` there, and the TPU compiler's SPMD partitioner (jax 0.10.2's libtpu;
  XLA:CPU's too) stops the process on a failed check (``spmd_partitioner_util.cc:497``) instead
  of an error (reproduced on ``v5p:2x2x2``, stage 2 x expert 2 x tensor 2)."""
  mesh = jax.sharding.get_abstract_mesh()
  sizes = dict(mesh.shape)
  others = [name for name, kind in zip(mesh.axis_names, mesh.axis_types)
            if kind == AxisType.Auto and sizes[name] > 1 and name != EXPERT]
  if others:
    raise ValueError(
        f"{owner}: dispatch='all_to_all' runs on an {EXPERT!r} axis with no other axis left "
        f"to XLA's partitioner, but the mesh has {', '.join(f'{n}={sizes[n]}' for n in others)}"
        f" beside it (XLA's SPMD partitioner aborts on that layout); use "
        f"dispatch='partitioner', or fsdp instead of {others[0]!r}.")


def check_tokens(num_tokens: int, devices: int, owner: str = "MixtureOfExperts") -> None:
  """Raises ValueError when the ``expert`` axis does not divide the tokens a layer routes: each
  of its devices sends its own equal share."""
  if num_tokens % devices:
    raise ValueError(
        f"{owner}: dispatch='all_to_all' splits the {num_tokens} tokens of a micro-batch "
        f"(rows x sequence on one data replica) over the {devices} devices of the "
        f"{EXPERT!r} axis, which does not divide them; use a micro-batch whose tokens divide "
        f"by {devices}, or dispatch='partitioner'.")


def _by_device(x: jax.Array) -> jax.Array:
  """``x`` split over ``expert`` on its leading axis, its other axes left to the partitioner."""
  return lax.with_sharding_constraint(x, P(EXPERT, *([P.UNCONSTRAINED] * (x.ndim - 1))))


def _route_locally(experts, local_experts: int, devices: int):
  """One device's pairs (``experts [n, k]``): ``(order, dest, slot)``, the pairs sorted by
  expert, each one's destination device and its row in the block sent there."""
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  dest = flat[order] // local_experts
  per_device = jnp.zeros((devices,), jnp.int32).at[dest].add(1)
  slot = jnp.arange(flat.shape[0]) - (jnp.cumsum(per_device) - per_device)[dest]
  return order, dest, slot


def _pack(tokens, experts, kept, order, dest, slot, local_experts: int, devices: int):
  """One device's blocks to send: the pairs' tokens ``[devices, n * k, D]`` and their experts'
  ids on the destination ``[devices, n * k]`` (``local_experts`` where no pair filled a row, or
  where the pair there is not ``kept``)."""
  n, k = experts.shape
  blocks = jnp.zeros((devices, n * k, tokens.shape[-1]), tokens.dtype)
  blocks = blocks.at[dest, slot].set(tokens[order // k])
  local_ids = jnp.where(kept.reshape(-1)[order], experts.reshape(-1)[order] % local_experts,
                        local_experts)
  ids = jnp.full((devices, n * k), local_experts, jnp.int32)
  ids = ids.at[dest, slot].set(local_ids)
  return blocks, ids


def _swap(blocks: jax.Array) -> jax.Array:
  """``[a, b, ...]`` split over ``expert`` on ``a`` to ``[b, a, ...]`` split on ``b``: the
  all-to-all."""
  return _by_device(jnp.swapaxes(_by_device(blocks), 0, 1))


def _grouped(x, w, sizes):
  """Per device: rows ``x [devices, M, K]`` in groups of ``sizes [devices, G]`` times its
  experts ``w [devices * G, K, N]`` (split over ``expert``, in ``x``'s dtype); ``[devices, M,
  N]``.

  The product runs per device in a ``shard_map`` over ``expert`` holding one ``ragged_dot``: the
  TPU compiler takes a ragged dot without batch dimensions only, and a body of one operation
  leaves JAX's partial evaluation nothing to split off (see the module documentation)."""
  devices, rows, width = x.shape
  local = jax.shard_map(lax.ragged_dot, in_specs=(_ROWS, _ROWS, _ROWS), out_specs=_ROWS,
                        axis_names={EXPERT})
  out = local(x.reshape(devices * rows, width), w, sizes.reshape(-1))
  return out.reshape(devices, rows, -1)


def expert_outputs(tokens: jax.Array, experts: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   w_down: jax.Array, kept: jax.Array | None = None,
                   chunks: int = 1) -> jax.Array:
  """Each (token, choice) pair's expert output, the tokens exchanged over the ``expert`` axis
  of the mesh in context (see the module documentation); ``[N, k, D]``.

  Args:
    tokens: ``[N, D]``; each device of the ``expert`` axis routes its ``N / devices`` rows.
    experts: int32 ``[N, k]``, each token's experts (global ids), as the routing chose them.
    w_gate, w_up: ``[E, D, H]``; w_down: ``[E, H, D]``; split over ``expert`` on ``E``.
    kept: boolean ``[N, k]``, the pairs a capacity leaves a slot
      (:func:`tpipe.train.moe.kept_pairs`); the others join no expert's group, so no expert
      computes them and their output is zero. None: every pair (dropless).
    chunks: each device's rows are exchanged in this many equal parts, each through its own
      all-to-alls and grouped matmuls (the same bytes and FLOPs in all): the parts depend on
      none of each other, so the TPU compiler can run one part's all-to-all while the experts
      compute another's (see the module documentation). 1: one exchange.

  Returns:
    ``[N, k, D]`` in ``tokens``' dtype, split by rows over ``expert``; a pair's output is its
    expert's SwiGLU of its token (not yet weighted by the routing).
  """
  devices = devices_here()
  num_experts = w_gate.shape[0]
  if num_experts % devices:
    raise ValueError(f"expert_outputs: {num_experts} experts do not split over the "
                     f"{devices} devices of the {EXPERT!r} axis; use a multiple of {devices} "
                     "experts or an expert axis that divides them.")
  check_alone(owner="expert_outputs")
  check_tokens(tokens.shape[0], devices, owner="expert_outputs")
  check_chunks(chunks, rows=tokens.shape[0] // devices, owner="expert_outputs")
  (num_tokens, width), k = tokens.shape, experts.shape[-1]
  kept = jnp.ones(experts.shape, bool) if kept is None else kept
  if chunks == 1:
    return _exchange(tokens, experts, kept, w_gate, w_up, w_down, devices)
  n = num_tokens // devices
  # Part c holds rows [c * n / chunks, (c + 1) * n / chunks) of every device's rows. The parts
  # are unrolled, not a loop: a loop would run one part's exchange after another's.
  by_part = lambda a: a.reshape(devices, chunks, n // chunks, *a.shape[1:])
  parts = [_exchange(*(by_part(a)[:, c].reshape(-1, *a.shape[1:])
                       for a in (tokens, experts, kept)), w_gate, w_up, w_down, devices)
           for c in range(chunks)]
  out = jnp.stack([p.reshape(devices, n // chunks, k, width) for p in parts], axis=1)
  return _by_device(out).reshape(num_tokens, k, width)


def check_chunks(chunks: int, rows: int | None = None,
                 owner: str = "MixtureOfExperts") -> None:
  """Raises ValueError unless ``chunks`` is an integer >= 1 and, where ``rows`` (the tokens each
  device of the ``expert`` axis routes) is given, divides them."""
  if isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or chunks < 1:
    raise ValueError(f"{owner}: exchange_chunks must be an int >= 1 (1: one exchange), got "
                     f"{chunks!r}.")
  if rows is not None and rows % chunks:
    raise ValueError(
        f"{owner}: exchange_chunks={chunks} parts do not divide the {rows} tokens each device "
        f"of the {EXPERT!r} axis routes; use a divisor of {rows}.")


def _exchange(tokens, experts, kept, w_gate, w_up, w_down, devices: int) -> jax.Array:
  """:func:`expert_outputs` with every device's rows in one exchange; ``[N, k, D]``."""
  local = w_gate.shape[0] // devices
  (num_tokens, width), k = tokens.shape, experts.shape[-1]
  n, pairs = num_tokens // devices, num_tokens // devices * k
  tokens = _by_device(tokens.reshape(devices, n, width))
  experts = _by_device(experts.astype(jnp.int32).reshape(devices, n, k))
  kept = _by_device(kept.reshape(devices, n, k))
  order, dest, slot = jax.vmap(lambda e: _route_locally(e, local, devices))(experts)
  pack = lambda *a: _pack(*a, local, devices)
  blocks, ids = jax.vmap(pack)(tokens, experts, kept, order, dest, slot)
  received = _swap(blocks).reshape(devices, devices * pairs, width)
  received_ids = _swap(ids).reshape(devices, devices * pairs)
  by_expert = jnp.argsort(received_ids, axis=1, stable=True)
  x = jnp.take_along_axis(received, by_expert[..., None], axis=1)
  sizes = jax.vmap(lambda r: jnp.zeros((local + 1,), jnp.int32).at[r].add(1)[:local])(
      received_ids)
  y = experts_lib.swiglu(x, w_gate, w_up, w_down, sizes, product=_grouped)
  filled = jnp.take_along_axis(received_ids, by_expert, axis=1)[..., None] < local
  y = jnp.where(filled, y, 0)  # Rows outside every group: no pair, no output.
  unsorted = jax.vmap(lambda y, by: jnp.zeros_like(y).at[by].set(y))(y, by_expert)
  returned = _swap(unsorted.reshape(devices, devices, pairs, width))
  out = jax.vmap(lambda r, order, dest, slot: jnp.zeros((pairs, width), r.dtype).at[order].set(
      r[dest, slot]))(returned, order, dest, slot)
  return out.reshape(num_tokens, k, width)


__all__ = ["check_alone", "check_chunks", "check_tokens", "devices_here", "expert_outputs"]
