"""Stage-resident parameters for the NNX front end: :func:`shard`.

An NNX stack keeps its per-layer state (``nnx.state(model, nnx.Param)``: one entry per layer, a
Repeat's copies stacked on a leading axis), and every call stages it for the engine. A
:class:`~tpipe.nnx.Repeat` whose copies are cut evenly over the stages (one chunk per stage,
chunk ``s`` holding copies ``[s * n / S, (s + 1) * n / S)``) is staged by a reshape of its copy
axis (:mod:`tpipe.core.layout.description`). :func:`shard` places such a Repeat's ``nnx.Param``
variables
split over ``stage`` on that axis (with ``out_sharding`` metadata ``(stage_axis, ...)``, so
``nnx.get_partition_spec`` shows it): the reshape is then local to each device, neither it nor
its transpose moves a parameter, and an optimizer update keeps them there.

Every other layer (an embedding, a head, a Repeat cut unevenly) has no stage axis to split while
the state keeps one entry per layer: it stays at its home, whole over ``stage`` (split inside
its stage as its own ``out_sharding`` names say, :mod:`tpipe.nnx.homes`), and its gradient is
summed over ``stage`` once per step. Circular schedules (``num_repeats > 1``) give a stage
non-contiguous copies, which a split of the copy axis cannot express, and a ``balance`` computed
from costs leaves the cut unknown until the call: both are refused with the fix. What the
compiled train step then communicates over ``stage`` is checked in
``tests/nnx/test_placement.py``.
"""

from __future__ import annotations

from typing import Any

from flax import nnx
from jax.sharding import Mesh

from tpipe.core.planning import plan as plan_lib
from tpipe.nnx import stack as stack_lib


def _copies(stack) -> list[int | None]:
  """Per layer, a Repeat's number of copies, or None for a plain layer."""
  return [layer.n if isinstance(layer, stack_lib.Repeat) else None
          for layer in stack.pipeline_layers()]


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
  if not isinstance(stack, stack_lib.Stack):
    raise TypeError(f"{where} takes a tpipe.nnx.Sequential or a tpipe.nnx.pipeline module, got "
                    f"{type(stack).__name__}.")
  spec = stack.spec
  if not isinstance(spec.mesh, Mesh):
    raise ValueError(f"{where}: the stack has mesh={spec.mesh!r}; placing parameters needs "
                     "the mesh, so build the stack with mesh=tpipe.make_mesh(...).")
  if spec.num_repeats != 1:
    raise ValueError(
        f"{where}: num_repeats={spec.num_repeats} gives each stage {spec.num_repeats} "
        "non-contiguous chunks, which a split of a Repeat's copy axis cannot place; use one "
        "chunk per stage (schedule='gpipe' or '1f1b') or keep the parameters replicated.")
  copies = _copies(stack)
  suggestion = _suggested_balance(copies, spec.num_stages)
  hint = (f" e.g. balance={suggestion}" if suggestion else
          f" (no Repeat has a number of copies divisible by num_stages={spec.num_stages})")
  if isinstance(spec.balance, str):
    raise ValueError(
        f"{where}: balance={spec.balance!r} is computed from costs, so where a Repeat's copies "
        f"go is not known before the call; pass the unit counts per stage,{hint}.")
  groups = plan_lib.group_units(copies, list(spec.balance))
  even = _even_layers(groups, copies, spec.num_stages)
  if not even:
    raise ValueError(
        f"{where}: balance={list(spec.balance)} cuts no Repeat evenly over the "
        f"{spec.num_stages} stages (chunk s holding copies [s*n/S, (s+1)*n/S)), so no parameter "
        f"can be stage-resident; use a balance that does,{hint}.")
  return spec.mesh, even


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
  over ``stage`` on its copy axis; every other variable of the stack stays at its home, whole
  over ``stage`` (:mod:`tpipe.nnx.homes`). Call it before creating the ``nnx.Optimizer``, so
  the optimizer state is created with the same placement. The state's structure and values do
  not change.

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
  layers = stack.pipeline_layers()
  for i in even:
    for _, variable in nnx.iter_graph(layers[i].layer):
      if isinstance(variable, nnx.Param):
        variable.set_metadata(out_sharding=_stage_spec(variable, stack.spec.stage_axis),
                              mesh=mesh)
  stack._place_state()  # pylint: disable=protected-access
  return stack
