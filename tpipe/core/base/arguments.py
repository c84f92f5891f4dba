"""How a layer's extra call arguments reach it inside the pipeline.

A pipelined block is called as ``block(x, *args, **kwargs)``. Everything after ``x`` is bound to
the block's ``__call__`` signature (:func:`bind`), so an argument is found by its parameter name
whether the caller passed it by position or by keyword, and the layers get it by keyword. Then
every value is one of three kinds (:func:`split_keywords`):

* **per-example**: an argument whose parameter is named in ``per_example``. Each of its arrays
  has the batch as its leading axis and is split into micro-batches (and over data replicas)
  exactly like ``x``; a layer working on micro-batch ``m`` sees micro-batch ``m``'s slice.
* **broadcast**: any other array (``jax.Array`` or ``np.ndarray``, at any depth of a pytree such
  as a dict). Every layer and micro-batch sees the whole array.
* **static**: everything else (Python numbers, bools, strings, ``None``): passed through as is,
  never traced, so a block may branch on it (``deterministic=True``).

Example::

  >>> import numpy as np
  >>> class Block:
  ...   def __call__(self, x, mask, *, deterministic=False): ...
  >>> kwargs = bind(Block.__call__, (np.ones((4, 3)),), {"deterministic": True}, owner="Block")
  >>> sorted(kwargs)
  ['deterministic', 'mask']
  >>> split = split_keywords(kwargs, per_example=("mask",), batch_size=4, owner="Block")
  >>> [a.shape for a in split.per_example], split.broadcast
  ([(4, 3)], ())
  >>> split.rebuild(split.broadcast, split.per_example)["deterministic"]
  True

A broadcast array whose leading axis happens to be the batch is most often a per-example one
left out of ``per_example``: when the layers then fail on a micro-batch, :func:`hint_per_example`
says so, in every front end alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from typing import Any, Callable, Sequence

import jax
import numpy as np

_NAMED_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_STATIC, _BROADCAST, _PER_EXAMPLE = "static", "broadcast", "per_example"


def _is_array(value) -> bool:
  return isinstance(value, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def call_signature(call: Callable) -> inspect.Signature:
  """The signature of a ``__call__(self, x, ...)`` method."""
  return inspect.signature(call)


def extra_parameter_names(call: Callable) -> tuple[str, ...]:
  """Names of the parameters after ``self`` and ``x`` that can be passed by name."""
  params = list(call_signature(call).parameters.values())[2:]
  return tuple(p.name for p in params if p.kind in _NAMED_KINDS)


@functools.lru_cache(maxsize=None)
def keyword_names(call: Callable) -> tuple[str, ...] | None:
  """Names ``call(self, x, ...)`` takes by keyword after its input; None if it takes any
  (``**kwargs``): a layer's :attr:`tpipe.core.base.layers.Layer.keywords`."""
  params = list(call_signature(call).parameters.values())[2:]
  if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
    return None
  return extra_parameter_names(call)


def check_per_example(call: Callable, per_example: Sequence[str], owner: str) -> tuple[str, ...]:
  """Validates ``per_example`` against the signature; returns it as a tuple of names.

  Raises:
    TypeError: ``per_example`` is a string or holds non-strings.
    ValueError: a name is not a parameter of ``call`` (after ``self`` and ``x``).
  """
  if isinstance(per_example, str):
    raise TypeError(f"per_example must be a sequence of parameter names, got the string "
                    f"{per_example!r}; write per_example=({per_example!r},).")
  names = tuple(per_example)
  if not all(isinstance(n, str) for n in names):
    raise TypeError(f"per_example must hold parameter names (strings), got {per_example!r}.")
  params = list(call_signature(call).parameters)
  first = params[1] if len(params) > 1 else "x"
  allowed = extra_parameter_names(call)
  for name in names:
    if name == first:
      raise ValueError(f"per_example names {name!r}, the input {owner} pipelines; the input is "
                       "always split into micro-batches, so leave it out of per_example.")
    if name not in allowed:
      raise ValueError(f"per_example names {name!r}, which is not a parameter of "
                       f"{owner}.__call__; its parameters after the input are {list(allowed)}.")
  return names


@dataclasses.dataclass(frozen=True)
class SplitArguments:
  """A call's extra arguments split into static values, broadcast and per-example arrays.

  Attributes:
    broadcast: the broadcast arrays, in a fixed order.
    per_example: the per-example arrays (leading axis = batch), in a fixed order.
    names: for each array in ``broadcast + per_example``, the parameter it belongs to.
  """

  broadcast: tuple[Any, ...]
  per_example: tuple[Any, ...]
  names: tuple[str, ...]
  _treedef: Any
  _leaves: tuple[Any, ...]
  _kinds: tuple[str, ...]

  def rebuild(self, broadcast: Sequence[Any], per_example: Sequence[Any]) -> dict:
    """The keyword arguments, with the given arrays in place of the originals."""
    broadcast, per_example = iter(broadcast), iter(per_example)
    leaves = []
    for leaf, kind in zip(self._leaves, self._kinds):
      if kind == _BROADCAST:
        leaf = next(broadcast)
      elif kind == _PER_EXAMPLE:
        leaf = next(per_example)
      leaves.append(leaf)
    return dict(jax.tree.unflatten(self._treedef, leaves))

  def per_example_names(self) -> tuple[str, ...]:
    return self.names[len(self.broadcast):]

  def broadcast_names(self) -> tuple[str, ...]:
    return self.names[:len(self.broadcast)]


def bind(call: Callable, args: tuple, kwargs: dict, *, owner: str) -> dict:
  """``args`` and ``kwargs`` bound to ``call(self, x, ...)``: ``{parameter name: value}`` for
  each argument given, by position or by keyword (a ``**kwargs`` parameter's entries under their
  own names), as the layers take them.

  Args:
    call: the block's ``__call__`` (unbound function).
    args: positional arguments after ``x``.
    kwargs: keyword arguments.
    owner: the block's name, for messages.

  Raises:
    TypeError: the arguments do not fit the signature (unknown keyword, too many, missing, one
      given twice), or a value reaches a parameter that cannot be passed by name (``*args``, or
      positional-only).
  """
  signature = call_signature(call)
  try:
    bound = signature.bind(None, None, *args, **kwargs)
  except TypeError as e:
    raise TypeError(f"The arguments do not fit {owner}.__call__{signature}: {e}.") from None
  out = {}
  for name, value in list(bound.arguments.items())[2:]:  # After self and x.
    kind = signature.parameters[name].kind
    if kind == inspect.Parameter.VAR_KEYWORD:
      out.update(value)
    elif kind in _NAMED_KINDS:
      out[name] = value
    else:
      raise TypeError(f"{owner}.__call__{signature} takes {name!r} by position only, but the "
                      "pipeline passes its layers' arguments by name; make it a parameter that "
                      "can be passed by keyword.")
  return out


def split_keywords(kwargs: dict, *, per_example: Sequence[str], batch_size: int,
                   owner: str) -> SplitArguments:
  """Sorts every leaf of ``kwargs`` (name -> value, as :func:`bind` gives them) into static,
  broadcast or per-example.

  Args:
    kwargs: the keyword arguments.
    per_example: names of parameters whose arrays are split into micro-batches.
    batch_size: the leading size every per-example array must have.
    owner: the block's name, for messages.

  Raises:
    ValueError: a per-example array's leading axis is not ``batch_size``.
  """
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(
      dict(kwargs), is_leaf=lambda v: v is None)
  leaves, kinds = [], []
  broadcast, split, broadcast_names, split_names = [], [], [], []
  for path, leaf in leaves_with_path:
    name = path[0].key
    if not _is_array(leaf):
      kind = _STATIC
    elif name in per_example:
      shape = np.shape(leaf)
      if not shape or shape[0] != batch_size:
        where = jax.tree_util.keystr(path[1:])
        where = f" at {where}" if where else ""
        raise ValueError(
            f"per-example argument {name!r} of {owner} has an array{where} of shape {shape}, "
            f"but per-example arrays need the batch ({batch_size}) as their leading axis. Pass "
            f"it with a leading batch axis, or drop {name!r} from per_example to broadcast it "
            "to every micro-batch.")
      kind = _PER_EXAMPLE
      split.append(leaf)
      split_names.append(name)
    else:
      kind = _BROADCAST
      broadcast.append(leaf)
      broadcast_names.append(name)
    leaves.append(leaf)
    kinds.append(kind)
  return SplitArguments(broadcast=tuple(broadcast), per_example=tuple(split),
                        names=tuple(broadcast_names + split_names), _treedef=treedef,
                        _leaves=tuple(leaves), _kinds=tuple(kinds))


def batch_like_broadcast(split: SplitArguments, batch_size: int) -> tuple[str, ...]:
  """The names of the broadcast arguments with an array whose leading axis is ``batch_size``:
  per-example arguments, likely, that ``per_example`` does not name."""
  return tuple(sorted({name for name, a in zip(split.broadcast_names(), split.broadcast)
                       if np.ndim(a) and np.shape(a)[0] == batch_size}))


@contextlib.contextmanager
def hint_per_example(split: SplitArguments, batch_size: int, *, failed: str, owner: str):
  """Re-raises a failure of the layers with a hint when a broadcast argument looks per-example.

  Every layer sees a broadcast array whole while ``x`` is split into micro-batches, so an array
  with one row per example left out of ``per_example`` breaks a layer with a shape error that
  does not name the cause. Inside this context a ``TypeError`` or ``ValueError`` becomes a
  ``ValueError`` naming the broadcast arguments whose leading axis is ``batch_size``
  (:func:`batch_like_broadcast`) and the fix; without such an argument it passes unchanged.

  Args:
    split: the call's arguments, as :func:`split_keywords` sorted them.
    batch_size: the batch of ``x``.
    failed: what failed, for the message (the block's class name).
    owner: the API whose ``per_example`` setting is the fix (``tpipe.pipeline``).
  """
  try:
    yield
  except (TypeError, ValueError) as error:
    suspects = batch_like_broadcast(split, batch_size)
    if not suspects:
      raise
    raise ValueError(
        f"{failed} failed on one micro-batch: {type(error).__name__}: {error}\nThe broadcast "
        f"argument(s) {list(suspects)} have the batch size {batch_size} as their leading axis, "
        "but every layer sees broadcast arrays whole while x is split into micro-batches. If "
        f"they hold one row per example, pass per_example={suspects!r} to {owner}.") from error
