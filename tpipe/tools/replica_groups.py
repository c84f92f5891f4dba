"""The device groups of an HLO collective's ``replica_groups`` attribute, in every syntax XLA
prints: explicit lists, iota lists and the mesh-axes lists of the SPMD partitioner
(:func:`parse_replica_groups`). Python and NumPy, no JAX; :mod:`tpipe.tools.hlo` reads the
attribute's text from an instruction.

  >>> parse_replica_groups("{{0,1},{2,3}}")
  [[0, 1], [2, 3]]
"""

from __future__ import annotations

import math
import re

import numpy as np

_INTS = r"\d+(?:\s*,\s*\d+)*"
# The iota form, ``[groups,size]<=[dims]T(perm)``: also how tpipe.tools.hlo finds its end.
IOTA_GROUPS = re.compile(
    rf"\[(?P<shape>{_INTS})\]<=\[(?P<dims>{_INTS})\](?:T\((?P<perm>{_INTS})\))?")
_MESH_GROUPS = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\]"
    rf"(?:\s*,\s*device_ids=\((?P<ids>\[{_INTS}\](?:T\({_INTS}\))?|{_INTS})\))?"
    r"\s*\{(?P<groups>[^}]*)\}")


def _ints(text: str) -> list[int]:
  return [int(x) for x in re.findall(r"\d+", text)]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
  """``iota(prod(dims)).reshape(dims).transpose(perm)``: XLA's iota device-list notation."""
  ids = np.arange(math.prod(dims)).reshape(dims)
  return ids.transpose(perm) if perm else ids


def _mesh_axes_groups(text: str) -> list[list[int]]:
  """Groups of the mesh form ``mesh[axes], device_ids=(...) {grouping axes}``.

  The mesh lists its axes with sizes (``'a'=2``), major to minor. Its devices are ``iota`` in
  that shape unless ``device_ids`` gives them: explicitly (``0,4,1,5,...``) or as a transposed
  iota (``[4,2]T(1,0)``: ``iota(8).reshape(4, 2).transpose(1, 0)``, then read in the mesh's
  shape). A group holds the devices that differ only along the grouping axes. A grouping axis
  may be a sub-axis ``'a':(p)k``: axis ``a`` of size ``n`` seen as ``[p, k, n / (p * k)]``
  (major to minor), of which the middle dimension varies.
  """
  m = _MESH_GROUPS.fullmatch(text)
  if not m:
    raise ValueError(f"Unrecognised mesh-form replica groups {text!r}.")
  names, sizes = [], []
  for part in m.group("axes").split(","):
    axis = re.fullmatch(r"\s*'?([^'=]+?)'?\s*=\s*(\d+)\s*", part)
    if not axis:
      raise ValueError(f"Unrecognised mesh axis {part!r} in replica groups {text!r}.")
    names.append(axis.group(1))
    sizes.append(int(axis.group(2)))
  total = math.prod(sizes)
  ids = m.group("ids")
  if ids is None:
    devices = np.arange(total)
  elif ids.startswith("["):
    dims, _, perm = ids[1:].partition("]")
    devices = _iota(_ints(dims), _ints(perm) or None)
  else:
    devices = np.array(_ints(ids))
  if devices.size != total:
    raise ValueError(f"Replica groups {text!r}: {devices.size} device ids for a mesh of {total}.")
  # Each grouping axis (or sub-axis) as (mesh axis, pre-size, size).
  refs = []
  for part in m.group("groups").split(","):
    ref = re.fullmatch(r"\s*'?([^':]+?)'?(?::\((\d+)\)(\d+))?\s*", part)
    if not ref or ref.group(1) not in names:
      raise ValueError(f"Unknown grouping axis {part!r} in replica groups {text!r}.")
    axis = names.index(ref.group(1))
    pre, size = (int(ref.group(2)), int(ref.group(3))) if ref.group(2) else (1, sizes[axis])
    if sizes[axis] % (pre * size):
      raise ValueError(f"Replica groups {text!r}: sub-axis {part!r} does not divide its axis of "
                       f"size {sizes[axis]}.")
    refs.append((axis, pre, size))
  # Split every mesh axis at the boundaries of its grouping sub-axes; note where each one lands.
  split_sizes, position = [], {}
  for axis, size in enumerate(sizes):
    on_axis = sorted(r for r in refs if r[0] == axis)
    if not on_axis:
      split_sizes.append(size)
      continue
    prefix = 1
    for ref in on_axis:
      _, pre, sub = ref
      if pre % prefix:
        raise ValueError(f"Replica groups {text!r}: overlapping sub-axes of {names[axis]!r}.")
      if pre > prefix:
        split_sizes.append(pre // prefix)
      position[ref] = len(split_sizes)
      split_sizes.append(sub)
      prefix = pre * sub
    if prefix < size:
      split_sizes.append(size // prefix)
  grouped = [position[r] for r in refs]
  others = [d for d in range(len(split_sizes)) if d not in grouped]
  group_size = math.prod(split_sizes[d] for d in grouped)
  devices = devices.reshape(split_sizes).transpose(others + grouped)
  return devices.reshape(-1, group_size).tolist()


def parse_replica_groups(text: str | None, num_devices: int | None = None) -> list[list[int]]:
  """The device-id groups of a collective's ``replica_groups`` attribute.

  Understands every syntax XLA prints:

  * explicit lists: ``{{0,1},{2,3}}``; ``{}`` (or no attribute) is one group of all devices;
  * iota lists: ``[2,4]<=[8]`` (2 groups of 4: ``iota(8).reshape(2, 4)``) and transposed ones,
    ``[4,2]<=[2,4]T(1,0)`` (``iota(8).reshape(2, 4).transpose(1, 0).reshape(4, 2)``);
  * mesh-axes lists, which the SPMD partitioner gives the collectives it inserts (reshards,
    reductions over sharded dimensions): ``mesh['axis_0'=2,'axis_1'=4] {'axis_0'}``, possibly
    with device ids (``mesh[...], device_ids=([4,2]T(1,0)) {...}``) and sub-axes
    (``{'axis_1':(2)2}``). The mesh is XLA's own (``jax.make_mesh((4, 2), ...)`` may become
    three axes of 2), so map groups to JAX mesh axes through device ids, never by name;
  * ``maximal_mesh[device_id=3]``: the one device.

  Example::

    >>> parse_replica_groups("[4,2]<=[2,4]T(1,0)")
    [[0, 4], [1, 5], [2, 6], [3, 7]]

  Args:
    text: the attribute's value (:attr:`Instruction.replica_groups`), or None when absent.
    num_devices: devices of the module; needed for ``{}`` and an absent attribute.

  Returns:
    The groups, each a list of device ids (positions in the program's device assignment).

  Raises:
    ValueError: for text in none of these syntaxes, or ``{}`` without ``num_devices``.
  """
  text = (text or "{}").strip()
  if text.startswith("mesh["):
    return _mesh_axes_groups(text)
  maximal = re.fullmatch(r"maximal_mesh\[device_id=(\d+)\]", text)
  if maximal:
    return [[int(maximal.group(1))]]
  iota = IOTA_GROUPS.fullmatch(text)
  if iota:
    shape = _ints(iota.group("shape"))
    dims = _ints(iota.group("dims"))
    if math.prod(shape) != math.prod(dims):
      raise ValueError(f"Iota replica groups {text!r}: {shape} and {dims} differ in size.")
    perm = _ints(iota.group("perm")) if iota.group("perm") else None
    return _iota(dims, perm).reshape(shape).tolist()
  if re.fullmatch(r"\{\s*\}", text):
    if not num_devices:
      raise ValueError("replica_groups={} means all devices; pass num_devices.")
    return [list(range(num_devices))]
  if re.fullmatch(r"\{\s*(\{[\d,\s]*\}\s*,?\s*)*\}", text):
    return [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1])]
  raise ValueError(f"Unrecognised replica groups {text!r}: expected {{{{0,1}},...}}, "
                   "[a,b]<=[n]T(...) or mesh[...] {...}.")
