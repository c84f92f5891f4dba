"""How a weight splits over the ``fsdp``, ``expert`` and ``tensor`` mesh axes inside its stage.

A layer says how its weights split with **logical** axis names, the Flax way:
``nn.with_logical_partitioning(init, ("embed", "mlp"))`` (linen) names each axis of a kernel.
**Rules** map logical names to mesh axes: a sequence of ``(logical name, mesh axis or axes or
None)`` pairs, the format ``nn.logical_axis_rules`` takes and MaxText's ``logical_axis_rules``
config uses. tpipe's default, :data:`DEFAULT_RULES`, is the usual FSDP + tensor-parallel split:
the model dimension (``embed``) over ``fsdp``; the MLP's hidden units, attention heads and the
vocabulary over ``tensor``; a mixture-of-experts layer's experts (``expert``) over ``expert``;
a batch's rows over ``data`` and ``fsdp``.

:func:`weight_spec` turns one weight's names into its partition spec (the axes inside a stage;
the pipeline adds ``stage`` in front):

* a name the rules map goes to its mesh axis; a name that is itself a mesh axis (Flax's
  ``nn.with_partitioning(init, ("tensor", None))``) to that axis; other names to None;
* an axis the weight cannot use is dropped: one of size 1 on the mesh, one already used by an
  earlier dimension, one reserved for the pipeline (``stage``, ``data``), or one whose size
  does not divide the dimension (that dimension is then replicated);
* ``fsdp`` splits a dimension alone: the tick loops gather it by hand
  (:mod:`tpipe.core.programs.fsdp`), the partitioner the other axes, so where a name maps to
  ``fsdp`` and another axis, the dimension takes the first of them the mesh has (the model
  width, ``embed``, goes over ``fsdp`` where the mesh has it, else over ``expert``);
* a weight without names (no annotation) is split over ``fsdp`` on its largest dimension the
  ``fsdp`` size divides (the first such, on ties), else kept whole.

Pure Python over shapes: nothing here traces or allocates.

  >>> import jax
  >>> mesh = jax.sharding.AbstractMesh((2, 2), ("fsdp", "tensor"))
  >>> weight_spec((512, 2048), ("embed", "mlp"), mesh)
  P('fsdp', 'tensor')
  >>> weight_spec((2048,), None, mesh)     # no names: FSDP over the largest dimension
  P('fsdp',)
"""

from __future__ import annotations

from typing import Sequence

from jax.sharding import PartitionSpec as P

from tpipe import mesh as mesh_lib

# (logical name, mesh axes): Flax's rule format. A batch's rows split over data and fsdp, the
# model width over fsdp (ZeRO-3: gathered one layer at a time) or, without fsdp, over expert (a
# mixture's attention, embedding and head split over the expert devices, not whole on each),
# and what a layer computes in parallel (MLP units, heads, vocabulary entries) over tensor; a
# mixture's experts over expert.
DEFAULT_RULES = (
    ("batch", (mesh_lib.DATA_AXIS, mesh_lib.FSDP_AXIS)),
    ("embed", (mesh_lib.FSDP_AXIS, mesh_lib.EXPERT_AXIS)),
    ("mlp", mesh_lib.TENSOR_AXIS),
    ("heads", mesh_lib.TENSOR_AXIS),
    ("kv_heads", mesh_lib.TENSOR_AXIS),
    ("vocab", mesh_lib.TENSOR_AXIS),
    ("expert", mesh_lib.EXPERT_AXIS),
)

# What a logical name may map to: one mesh axis, several, or None (replicated).
Target = str | tuple[str, ...] | None


def check_rules(rules, origin: str = "rules") -> tuple[tuple[str, Target], ...]:
  """``rules`` as a tuple of ``(name, target)`` pairs; raises TypeError naming the bad entry."""
  if isinstance(rules, (str, bytes)) or not hasattr(rules, "__iter__"):
    raise TypeError(f"{origin} must be a sequence of (logical name, mesh axis) pairs such as "
                    f"tpipe.DEFAULT_RULES; got {rules!r}.")
  out = []
  for i, rule in enumerate(rules):
    ok = isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
    target = rule[1] if ok else None
    if ok and target is not None and not isinstance(target, str):
      ok = isinstance(target, (tuple, list)) and all(isinstance(a, str) for a in target)
      target = tuple(target) if ok else target
    if not ok:
      raise TypeError(f"{origin}[{i}] = {rule!r} is not a (logical name, mesh axis) pair; "
                      "write e.g. ('embed', 'fsdp'), ('mlp', 'tensor') or ('vocab', None).")
    out.append((rule[0], target))
  return tuple(out)


def resolve_rules(rules=None) -> tuple[tuple[str, Target], ...]:
  """The rules to use: ``rules`` if given, else those of an enclosing
  ``nn.logical_axis_rules(...)`` context, else :data:`DEFAULT_RULES`."""
  if rules is not None:
    return check_rules(rules)
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  ambient = nn.get_logical_axis_rules()
  return check_rules(ambient, "the nn.logical_axis_rules context") if ambient else DEFAULT_RULES


def _targets(name, rules, mesh_axes) -> tuple[str, ...]:
  """The mesh axes logical ``name`` maps to (the first rule naming it wins)."""
  if name is None:
    return ()
  for logical, target in rules:
    if logical == name:
      if target is None:
        return ()
      return (target,) if isinstance(target, str) else tuple(target)
  return (name,) if name in mesh_axes else ()


def weight_spec(shape: Sequence[int], names: Sequence[str | None] | None, mesh, rules=None, *,
                reserved: Sequence[str] = (mesh_lib.STAGE_AXIS, mesh_lib.DATA_AXIS)) -> P:
  """The partition spec of one weight of ``shape`` inside its stage (see the module doc).

  Args:
    shape: the weight's shape (one copy of a repeated layer: no copy axis).
    names: a logical name (or None) per dimension, or None for a weight without annotation.
    mesh: a ``Mesh`` or ``AbstractMesh`` (its axis names and sizes are read).
    rules: ``(logical name, mesh axes)`` pairs; default :func:`resolve_rules`'s.
    reserved: mesh axes a weight's dimensions never use (the pipeline's manual axes).

  Returns:
    A ``PartitionSpec`` with one entry per dimension (trailing Nones dropped).

  Raises:
    ValueError: ``names`` has a different length from ``shape``.
  """
  shape = tuple(int(d) for d in shape)
  sizes = dict(mesh.shape)
  usable = {a for a, n in sizes.items() if n > 1 and a not in reserved}
  if names is None:
    fsdp = sizes.get(mesh_lib.FSDP_AXIS, 1)
    if mesh_lib.FSDP_AXIS not in usable or not shape:
      return P()
    fits = [d for d in range(len(shape)) if shape[d] % fsdp == 0]
    if not fits:
      return P()
    best = max(fits, key=lambda d: (shape[d], -d))
    return P(*([None] * best), mesh_lib.FSDP_AXIS)
  names = tuple(names)
  if len(names) != len(shape):
    raise ValueError(f"logical axis names {names} have {len(names)} entries for a weight of "
                     f"shape {shape}; give one name (or None) per dimension.")
  rules = resolve_rules(rules)
  used: set[str] = set()
  entries = []
  for dim, name in zip(shape, names):
    axes, ways = [], 1
    for axis in _targets(name, rules, sizes):
      if axis in usable and axis not in used and dim % (ways * sizes[axis]) == 0:
        if axes and mesh_lib.FSDP_AXIS in (axis, *axes):
          break  # fsdp splits a dimension alone (the tick loops gather it by hand).
        axes.append(axis)
        ways *= sizes[axis]
    used.update(axes)
    entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)
