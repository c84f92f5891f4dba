"""Stage-resident parameters for the NNX front end: :func:`shard`.

The executor keeps each stage's chunk parameters packed in one buffer per dtype, ``[R, S, n]``
split over the ``stage`` axis. An NNX stack keeps the per-layer state (``nnx.state(model,
nnx.Param)``: one entry per layer, a Repeat's copies stacked on a leading axis), so every call
builds the staged buffers from that state, and the gradients flow back through that build.

With replicated parameters (the default) the step re-lays them out every time: each device's
gradient holds its own chunk only, and turning the staged gradient into replicated per-layer
gradients is an all-reduce over ``stage`` of every parameter's gradient (and the measured step
also has one collective-permute over ``stage`` outside the tick loop).

What :func:`shard` changes, and what it cannot:

* A :class:`~tpipe.nnx.Repeat` whose copies are cut evenly over the stages (one chunk per stage;
  chunk ``s`` holds copies ``[s * n / S, (s + 1) * n / S)``) is **stage-resident**: its
  ``nnx.Param`` variables get ``out_sharding`` metadata ``(stage_axis, ...)`` (so
  ``nnx.get_partition_spec`` shows the stage axis on the copy axis, as ``nnx.with_partitioning``
  would) and are placed with ``jax.device_put`` on ``NamedSharding(mesh, P(stage_axis, ...))``.
  The call then packs each stage's buffer inside a ``shard_map`` from its own copies, so neither
  the build nor its transpose moves them: their gradients come back split over ``stage`` with no
  collective, and an optimizer update keeps them there. This is the per-layer state contract kept
  and the residency of the bulk of a deep model's parameters.
* Every other layer (an embedding, a head, a Repeat cut unevenly) has no stage axis to split:
  it stays replicated over the mesh (its own ``out_sharding`` metadata, if any, is honoured), and
  its gradient is still all-reduced over ``stage`` once per step (a ``psum``: each stage
  contributes its chunk's part). Making those resident would need a state entry per stage, which
  the per-layer contract excludes.
* Circular schedules (``num_repeats > 1``) give a stage non-contiguous copies; a leading-axis
  split cannot express that, so :func:`shard` rejects them. So does a ``balance`` computed from
  costs (``"params"``, ``"flops"``, ``"time"``): the cut must be known to place the copies; pass
  the unit counts (:func:`tpipe.nnx.pipeline` always splits evenly).

Measured (8-device CPU emulation, ``tpipe.tools.analysis.collectives`` of the compiled
``nnx.jit`` step ``nnx.value_and_grad`` + ``nnx.Optimizer.update``; tests/test_nnx_placement.py):
the LM of tests/test_nnx.py (embedding, Repeat of 6 blocks, head; 7,916 bytes of parameters, of
which the embedding and head are 812), S=2 with ``balance=[4, 4]``, data=2, M=2. Over ``stage``,
per step:

=========================  ==============================  ==============================
                           replicated (default)            after ``shard``
=========================  ==============================  ==============================
collective-permute         3 (2 in the tick loop, 1         2, both in the tick loop
                           outside it: 7,084 bytes total)   (3,072 bytes)
all-reduce                 8,024 bytes of gradients         812 bytes (embedding and head
                           + 32 bytes of losses             gradients) + 32 bytes of losses
all-gather, all-to-all     none                             none
=========================  ==============================  ==============================

The same holds with ``schedule="1f1b"`` and Adam (gradients all-reduced: 8,024 bytes before,
812 after; the Repeat's Adam moments are created and stay split over ``stage``). Placing the
Repeat's Params with ``jax.device_put`` alone, without the stage-local build, is worse than
replicated (measured with ``balance="params"``): 12 all-gathers (9,472 bytes) and 24 more
collective-permutes over ``stage`` per step, on top of the same 8,024-byte all-reduce. The
trainer (``--config.frontend=nnx``) is not affected: it trains the linen engine's staged state
(:meth:`tpipe.nnx.Sequential.as_linen`).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpipe.core import packing
from tpipe.core import stage_layout as stage_layout_lib
from tpipe.linen import sequential as linen_sequential


def _units(stack) -> list[int | None]:
  """Per layer, a Repeat's number of copies, or None for a plain layer."""
  from tpipe.nnx import sequential  # pylint: disable=g-import-not-at-top
  return [layer.n if isinstance(layer, sequential.Repeat) else None
          for layer in stack._pipeline_layers()]  # pylint: disable=protected-access


def _even_layers(groups, copies, num_stages: int) -> list[int]:
  """The Repeat layers whose copies chunk ``s`` holds exactly ``[s*n/S, (s+1)*n/S)`` of."""
  even = []
  for i, n in enumerate(copies):
    if n is None or n % num_stages:
      continue
    k = n // num_stages
    held = [[(g.start, g.stop) for g in chunk if g.layer == i] for chunk in groups]
    if all(h == [(s * k, (s + 1) * k)] for s, h in enumerate(held)):
      even.append(i)
  return even


def _suggested_balance(copies, num_stages: int) -> list[int] | None:
  """Unit counts that cut the largest Repeat dividing by S evenly (the layers before it in the
  first chunk, after it in the last), or None if there is none."""
  candidates = [(n, i) for i, n in enumerate(copies) if n is not None and n % num_stages == 0]
  if not candidates:
    return None
  n, i = max(candidates)
  units = [1 if c is None else c for c in copies]
  counts = [n // num_stages] * num_stages
  counts[0] += sum(units[:i])
  counts[-1] += sum(units[i + 1:])
  return counts


def _check_stack(stack, where: str) -> tuple[Mesh, list[int]]:
  """The mesh and the stage-resident Repeat layers of ``stack``; ValueError when there are none
  or the settings cannot place any."""
  from tpipe.nnx import sequential  # pylint: disable=g-import-not-at-top
  if not isinstance(stack, sequential._Stack):  # pylint: disable=protected-access
    raise TypeError(f"{where} takes a tpipe.nnx.Sequential or a tpipe.nnx.pipeline module, got "
                    f"{type(stack).__name__}.")
  if not isinstance(stack.mesh, Mesh):
    raise ValueError(f"{where}: the stack has mesh={stack.mesh!r}; placing parameters needs "
                     "the mesh, so build the stack with mesh=tpipe.make_mesh(...).")
  if stack.num_repeats != 1:
    raise ValueError(
        f"{where}: num_repeats={stack.num_repeats} gives each stage {stack.num_repeats} "
        "non-contiguous chunks, which a split of a Repeat's copy axis cannot place; use one "
        "chunk per stage (schedule='gpipe' or '1f1b') or keep the parameters replicated.")
  copies = _units(stack)
  num_stages = stack.num_stages
  suggestion = _suggested_balance(copies, num_stages)
  hint = (f" e.g. balance={suggestion}" if suggestion else
          f" (no Repeat has a number of copies divisible by num_stages={num_stages})")
  if isinstance(stack.balance, str):
    raise ValueError(
        f"{where}: balance={stack.balance!r} is computed from costs, so where a Repeat's copies "
        f"go is not known before the call; pass the unit counts per stage,{hint}.")
  groups = stage_layout_lib.group_units(copies, list(stack.balance))
  even = _even_layers(groups, copies, num_stages)
  if not even:
    raise ValueError(
        f"{where}: balance={list(stack.balance)} cuts no Repeat evenly over the "
        f"{num_stages} stages (chunk s holding copies [s*n/S, (s+1)*n/S)), so no parameter "
        f"can be stage-resident; use a balance that does,{hint}.")
  return stack.mesh, even


def _stage_spec(variable: nnx.Variable, stage_axis: str) -> tuple[Any, ...]:
  """``(stage_axis, ...)``: the variable's own ``out_sharding`` with the copy axis split."""
  ndim = len(variable.shape)
  own = tuple(variable.get_metadata().get("out_sharding") or ())
  if len(own) == ndim:  # The copy axis is named already (e.g. by nnx.vmap's metadata).
    if own[0] not in (None, stage_axis):
      raise ValueError(f"A Repeat's parameter has the copy axis sharded over {own[0]!r}; "
                       f"tpipe.nnx.shard splits it over {stage_axis!r}.")
    own = own[1:]
  return (stage_axis,) + tuple(own) + (None,) * (ndim - 1 - len(own))


def shard(stack):
  """Annotates and places ``stack``'s parameters on its mesh: stage-split where they can be.

  Every ``nnx.Param`` of a :class:`~tpipe.nnx.Repeat` whose copies the stack's ``balance`` cuts
  evenly over the stages gets ``out_sharding=(stage_axis, ...)`` metadata and is placed split
  over ``stage`` on its copy axis; every other variable of the stack is placed by its own
  ``nnx.get_partition_spec`` (replicated when it has none). Call it before creating the
  ``nnx.Optimizer``, so the optimizer state is created with the same placement. The state's
  structure and values do not change. See the module documentation for what the train step
  then communicates.

  Args:
    stack: a :class:`~tpipe.nnx.Sequential` or a :func:`~tpipe.nnx.pipeline` module with a
      ``mesh``, one chunk per stage and an explicit ``balance``.

  Returns:
    ``stack``, placed.

  Raises:
    TypeError, ValueError: for another object, no mesh, ``num_repeats > 1``, a ``balance``
      computed from costs (the message suggests unit counts), or no Repeat cut evenly.
  """
  mesh, even = _check_stack(stack, "tpipe.nnx.shard")
  layers = stack._pipeline_layers()  # pylint: disable=protected-access
  for i in even:
    for _, variable in nnx.iter_graph(layers[i].layer):
      if isinstance(variable, nnx.Param):
        variable.set_metadata(out_sharding=_stage_spec(variable, stack.stage_axis), mesh=mesh)
  for _, variable in nnx.iter_graph(stack):
    if isinstance(variable, nnx.Variable) and hasattr(variable.get_value(), "shape"):
      spec = nnx.spmd.get_var_pspec(variable)
      variable.set_value(jax.device_put(variable.get_value(), NamedSharding(mesh, spec)))
  return stack


def resident_layers(stack) -> list[int]:
  """The Repeat layers whose every ``nnx.Param`` is marked split over the stage axis on its copy
  axis (by :func:`shard`, or by the user's own ``out_sharding`` metadata)."""
  from tpipe.nnx import sequential  # pylint: disable=g-import-not-at-top
  found = []
  for i, layer in enumerate(stack._pipeline_layers()):  # pylint: disable=protected-access
    if not isinstance(layer, sequential.Repeat):
      continue
    params = [v for _, v in nnx.iter_graph(layer.layer) if isinstance(v, nnx.Param)]
    if params and all((v.get_metadata().get("out_sharding") or (None,))[0] == stack.stage_axis
                      for v in params):
      found.append(i)
  return found


def staged_params(stack, engine: linen_sequential.Sequential, params, resident: list[int], x,
                  kwargs) -> dict[str, jax.Array]:
  """The staged buffers ``{dtype: [1, S, n]}`` of logical ``params``, each stage's packed on its
  own devices from its own copies of the ``resident`` Repeat layers and the replicated rest."""
  mesh, even = _check_stack(stack, "tpipe.nnx (stage-resident parameters)")
  stray = sorted(set(resident) - set(even))
  if stray:
    raise ValueError(f"tpipe.nnx: layers {stray} have parameters split over "
                     f"{stack.stage_axis!r} but balance={list(stack.balance)} does not cut them "
                     "evenly over the stages; call tpipe.nnx.shard(model) with a balance that "
                     "does, or drop their out_sharding metadata.")
  layout = engine.stage_layout(x, **kwargs)
  stage_axis = stack.stage_axis
  names = {f"layers_{i}" for i in resident}
  local = {name: tree for name, tree in params.items() if name in names}
  shared = {name: tree for name, tree in params.items() if name not in names}

  def chunk_buffers(c):

    def pack(local, shared):
      trees = []
      for g in layout.groups[c]:
        name = f"layers_{g.layer}"
        if name in local:  # This stage's copies, exactly (checked above).
          trees.append(local[name])
        elif g.repeated:
          trees.append(jax.tree.map(lambda a, g=g: a[g.start:g.stop], shared[name]))
        else:
          trees.append(shared[name])
      return packing.pack(trees, layout.chunk_layouts[c], layout.sizes)

    return pack

  def build(local, shared):
    # The replicated layers vary per stage from here on (each packs its own chunk); the
    # transpose of this cast is the psum over stage of their gradients.
    shared = lax.pcast(shared, (stage_axis,), to="varying")
    buffers = lax.switch(lax.axis_index(stage_axis),
                         [chunk_buffers(c) for c in range(layout.num_chunks)], local, shared)
    return {k: v[None, None] for k, v in buffers.items()}

  return jax.shard_map(build, mesh=mesh, in_specs=(P(stage_axis), P()),
                       out_specs=P(None, stage_axis))(local, shared)
