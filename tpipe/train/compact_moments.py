"""The optimizer's moments of the shared leaves, kept without the stages' padding.

A shared leaf (:mod:`tpipe.core.layout.shared_leaves`) is a staged array ``[P, S, *shape]``: every
stage has ``P`` entries, though most stages hold no weight of that shape. A Llama-shaped LM
keeps its embedding on stage 0 and its head on stage ``S - 1`` in one ``[1, S, vocab, width]``
leaf, so ``S - 2`` of its ``S`` entries are padding. The pipeline reads the parameters in that
form, but Adam's two moments need not follow it: here they keep only the real entries, ``[E,
*shape]`` (``E`` weights), split over the stage axis as well as over ``fsdp`` and ``tensor``.
A device then holds ``E / S`` of an entry's moments instead of a whole entry: the 8B step's
peak falls by 0.12 GiB per device on stage 4 x fsdp 8 x tensor 2 and by 0.37 on stage 8 x fsdp
4 x tensor 2 (``experiments/results/memory_at_scale.md``).

:func:`plan` says which shared leaves are kept that way (those with padding and a dimension the
stage axis divides) and how they are split; :func:`without_padding` wraps an elementwise optax
transformation (``optax.scale_by_adam``) so that its state holds them compact, computing on the
real entries only and handing back staged updates (zero in the padding, as they would be).
:func:`compact` and :func:`expand` convert a parameter-shaped tree between the two forms.
Checkpoints hold the moments in the logical form, so they do not see the difference:
:func:`to_logical` and :func:`from_logical` move the compact entries to and from the logical
weights directly, never through the staged form.

The price is a move over the stage axis: each step the update sends the real entries' gradients
to where their moments live and the updates back, two all-to-alls over ``stage`` outside the
tick loop, which nothing overlaps. Inside a slice that is ICI traffic; where the stage axis
spans slices, half of it (two slices) crosses the data-centre network: at 8B on two v5p slices
125-250 MiB per device per step, 21-42 ms (0.9-1.7% of the step's compute), for 0.12-0.37 GiB
saved per device on chips of 95 (``experiments/results/multislice_moments.md``).
:func:`chosen_plan` therefore keeps the moments staged there unless told otherwise
(``config.compact_moments``: ``"auto"``, ``"on"``, ``"off"``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from tpipe import mesh as mesh_lib
from tpipe.core.layout import description as layout_description
from tpipe.core.layout import description as layout_lib
from tpipe.tools import analysis

SHARED = layout_lib.SHARED

# config.compact_moments: "auto" compacts unless the stage axis spans slices; "on", "off".
SETTINGS = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class CompactLeaf:
  """One shared leaf whose moments keep only its real entries.

  Attributes:
    name: the leaf's key in the staged tree's shared part.
    entries: the ``(slot, stage)`` of each real entry, in the compact array's order.
    staged_shape: the staged leaf's shape ``[P, S, *shape]``.
    spec: the compact array's partition spec (``[E, *shape]``, the stage axis added to the
      first dimension it divides).
    sources: per entry, the logical weight it holds: ``(layer, path, transposed)``
      (``layers_{layer}``'s leaf at keystr ``path``, stored transposed when ``transposed``).
  """

  name: str
  entries: tuple[tuple[int, int], ...]
  staged_shape: tuple[int, ...]
  spec: P
  sources: tuple[tuple[int, str, bool], ...] = ()

  @property
  def shape(self) -> tuple[int, ...]:
    return (len(self.entries),) + self.staged_shape[2:]


def _axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def plan(layout: layout_lib.StageLayout, mesh,
         stage_axis: str = "stage") -> dict[str, CompactLeaf]:
  """The shared leaves whose moments :func:`without_padding` keeps compact, by name.

  A leaf qualifies when it has padding (fewer weights than ``P * S`` entries) and one of the
  compact array's dimensions (its entries, then the entry's own dimensions in order) is
  divisible by the stage count times the mesh axes it is already split over; the stage axis
  joins the first such dimension. Other leaves keep their staged moments.

  Args:
    layout: the pipeline's stage layout.
    mesh: the mesh the state lives on (its ``fsdp`` and ``tensor`` sizes are read).
    stage_axis: the mesh's stage axis.
  """
  sizes = dict(mesh.shape)
  stages = layout.num_stages
  staged_specs = layout.partition_specs(stage_axis, mesh=mesh)[SHARED]
  staged_shapes = layout.staged_shapes()[SHARED]
  out = {}
  for group in layout.shared:
    place = lambda m: (m.slot, layout.position(m.chunk)[1])
    members = sorted(group.members, key=place)
    entries = tuple(place(m) for m in members)
    if len(entries) >= group.slots * stages:
      continue  # No padding.
    shape = (len(entries),) + tuple(group.shape)
    inner = list(staged_specs[group.name])[2:]
    specs = [None] + inner + [None] * (len(group.shape) - len(inner))
    for d, n in enumerate(shape):
      axes = _axes(specs[d])
      if n % (stages * math.prod(sizes[a] for a in axes)) == 0:
        specs[d] = axes + (stage_axis,) if axes else stage_axis
        while specs and specs[-1] is None:
          specs.pop()
        staged = tuple(staged_shapes[group.name].shape)
        sources = tuple((m.layer, m.path, m.transposed) for m in members)
        out[group.name] = CompactLeaf(group.name, entries, staged, P(*specs), sources)
        break
  return out


def check_setting(setting) -> str:
  """``setting`` (``config.compact_moments``) if it is one of :data:`SETTINGS`; else ValueError
  naming the choices."""
  if not isinstance(setting, str) or setting not in SETTINGS:
    raise ValueError(
        f"config.compact_moments={setting!r}: write 'auto' (the ends' Adam moments at their "
        "real entries split over the stages, unless the stage axis spans slices, where the "
        "update's move of their gradients would cross DCN every step), 'on' (also there) or "
        "'off' (staged, as the parameters).")
  return setting


def spans_slices(mesh, stage_axis: str = "stage") -> bool:
  """Whether the mesh's stage axis crosses slices (some link of the stage ring is on DCN)."""
  return any(mesh_lib.crossing_links(mesh, stage_axis))


def chosen_plan(setting: str, layout: layout_lib.StageLayout, mesh,
                stage_axis: str = "stage") -> dict[str, CompactLeaf]:
  """:func:`plan` where ``setting`` asks for it, else ``{}`` (every moment staged).

  ``"on"``: :func:`plan`. ``"off"``: none. ``"auto"``: :func:`plan` unless the stage axis spans
  slices (:func:`spans_slices`): there the two all-to-alls over ``stage`` that compact moments
  cost each step would cross DCN (see the module docstring), where otherwise only the
  pipeline's own traffic crosses.

  Raises:
    ValueError: ``setting`` is not one of :data:`SETTINGS`.
  """
  setting = check_setting(setting)
  if setting == "off" or (setting == "auto" and spans_slices(mesh, stage_axis)):
    return {}
  return plan(layout, mesh, stage_axis)


def saved_bytes(leaves: Mapping[str, CompactLeaf], mesh,
                staged_specs: Mapping[str, Any]) -> int:
  """Bytes per device (float32) one moment saves in the compact form of ``leaves``: each
  leaf's staged shard less its compact shard; Adam keeps two moments."""
  sizes = dict(mesh.shape)

  def shard(shape, spec):
    count = 1
    for d, n in enumerate(shape):
      entry = spec[d] if d < len(spec) else None
      count *= n // math.prod(sizes[a] for a in _axes(entry))
    return count * 4

  return sum(shard(leaf.staged_shape, tuple(staged_specs[SHARED][k]))
             - shard(leaf.shape, tuple(leaf.spec)) for k, leaf in leaves.items())


def describe(setting: str, layout: layout_lib.StageLayout, mesh,
             stage_axis: str = "stage") -> str:
  """Whether the ends' moments are compact under ``setting``, and what is at stake: the memory
  per device it saves (both moments) against two all-to-alls over ``stage`` per step, on DCN
  where the axis spans slices. One sentence for the report and the trainer's log; "" where no
  leaf qualifies (:func:`plan`)."""
  possible = plan(layout, mesh, stage_axis)
  if not possible:
    return ""
  staged_specs = layout.partition_specs(stage_axis, mesh=mesh)
  saved = analysis.format_bytes(2 * saved_bytes(possible, mesh, staged_specs))
  link = "DCN" if spans_slices(mesh, stage_axis) else "ICI"
  moves = (f"two all-to-alls of their gradients and updates over the stage axis ({link}) per "
           "step")
  if chosen_plan(setting, layout, mesh, stage_axis):
    return (f"Adam's moments of the ends compact (config.compact_moments={setting!r}): {saved} "
            f"less per device, for {moves}")
  why = ", the stage axis spans slices" if setting == "auto" else ""
  return (f"Adam's moments of the ends staged (config.compact_moments={setting!r}{why}): 'on' "
          f"would save {saved} per device, for {moves}")


def is_compact(tree: Mapping[str, Any], leaves: Mapping[str, CompactLeaf]) -> bool:
  """Whether ``tree`` is parameter-shaped and holds the compact form of ``leaves``."""
  if not isinstance(tree, Mapping):
    return False
  shared = tree.get(SHARED, {})
  return any(tuple(shared[k].shape) == leaf.shape for k, leaf in leaves.items() if k in shared)


def compact(tree: Mapping[str, Any], leaves: Mapping[str, CompactLeaf]) -> dict[str, Any]:
  """``tree`` (staged, parameter-shaped) with the shared leaves of ``leaves`` kept at their
  real entries only, ``[E, *shape]``."""
  shared = dict(tree.get(SHARED, {}))
  for k, leaf in leaves.items():
    shared[k] = jnp.stack([shared[k][p, s] for p, s in leaf.entries])
  return {**tree, SHARED: shared}


def from_logical(tree: Mapping[str, Any], staged: Mapping[str, Any],
                 leaves: Mapping[str, CompactLeaf]) -> dict[str, Any]:
  """The compact form of the logical tree ``tree`` (``layers_i`` per layer), given its staged
  form ``staged`` for everything but the compact leaves, whose entries are taken from ``tree``
  directly (never built in the staged form)."""
  shared = dict(staged.get(SHARED, {}))
  for k, leaf in leaves.items():
    weights = []
    for layer, path, transposed in leaf.sources:
      weight = layout_description.leaf_at(tree[f"layers_{layer}"], path)
      weights.append(weight.T if transposed else weight)
    shared[k] = jnp.stack(weights).astype(shared[k].dtype)
  return {**staged, SHARED: shared}


def to_logical(tree: Mapping[str, Any], compact_tree: Mapping[str, Any],
               leaves: Mapping[str, CompactLeaf]) -> dict[str, Any]:
  """The logical tree ``tree`` (``layers_i`` per layer) with the weights of ``leaves`` taken
  straight from their entries in ``compact_tree``."""
  out = dict(tree)
  for k, leaf in leaves.items():
    for i, (layer, path, transposed) in enumerate(leaf.sources):
      entry = compact_tree[SHARED][k][i]
      out[f"layers_{layer}"] = layout_description.with_leaf(
          out[f"layers_{layer}"], path, entry.T if transposed else entry)
  return out


def staged_zeros(tree: Mapping[str, Any], leaves: Mapping[str, CompactLeaf]) -> dict[str, Any]:
  """``tree`` in the staged form, zeros standing in for the shared leaves of ``leaves`` (a
  placeholder for a conversion whose results for them :func:`to_logical` replaces)."""
  shared = dict(tree.get(SHARED, {}))
  for k, leaf in leaves.items():
    shared[k] = jnp.zeros(leaf.staged_shape, shared[k].dtype)
  return {**tree, SHARED: shared}


def expand(tree: Mapping[str, Any], leaves: Mapping[str, CompactLeaf]) -> dict[str, Any]:
  """The inverse of :func:`compact`: the staged form, zeros in the padding."""
  shared = dict(tree.get(SHARED, {}))
  for k, leaf in leaves.items():
    entries = shared[k]
    where = {place: i for i, place in enumerate(leaf.entries)}
    zero = jnp.zeros(entries.shape[1:], entries.dtype)
    slots, stages = leaf.staged_shape[:2]
    # Stacked, which XLA writes in one fusion. Written into zeros with `.at[].set`, the TPU
    # compiler held a zero-filled staged copy beside it (shape C: 9.41 GiB against 8.51).
    shared[k] = jnp.stack([jnp.stack([entries[where[p, s]] if (p, s) in where else zero
                                      for s in range(stages)]) for p in range(slots)])
  return {**tree, SHARED: shared}


def partition_specs(staged_specs: Mapping[str, Any],
                    leaves: Mapping[str, CompactLeaf]) -> dict[str, Any]:
  """The partition specs of the compact form, given the staged tree's."""
  shared = dict(staged_specs.get(SHARED, {}))
  for k, leaf in leaves.items():
    shared[k] = leaf.spec
  return {**staged_specs, SHARED: shared}


def without_padding(inner: optax.GradientTransformation,
                    leaves: Mapping[str, CompactLeaf]) -> optax.GradientTransformation:
  """``inner`` with its state kept in the compact form of ``leaves``.

  ``inner`` sees the real entries of the shared leaves only, and the updates come back staged,
  zero in the padding. That is exact for a transformation that treats each element (or each
  entry) on its own and keeps zero state where the gradients are zero, as
  ``optax.scale_by_adam`` does: its updates in the padding were zero.
  """
  if not leaves:
    return inner

  def init(params):
    return inner.init(compact(params, leaves))

  def update(updates, state, params=None):
    params = None if params is None else compact(params, leaves)
    updates, state = inner.update(compact(updates, leaves), state, params)
    return expand(updates, leaves), state

  return optax.GradientTransformation(init, update)
