"""How the example models take their arguments: checked sizes, rates and dtypes, named weights.

The checks raise before anything is traced, naming the field and what it accepts; :func:`named`
gives an initializer's weights their logical axis names, which split them over a mesh's
``fsdp`` and ``tensor`` axes (:mod:`tpipe.axis_rules`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

# The floating dtypes the models compute in or store parameters in.
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def check_int(name: str, value: Any, minimum: int = 1) -> None:
  """Raises unless ``value`` is an int (not a bool) of at least ``minimum``."""
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}.")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}.")


def check_rate(name: str, value: Any) -> None:
  """Raises unless ``value`` is a float (or int) rate in ``[0, 1)``."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
    raise ValueError(f"{name} must be a float in [0, 1), got {value!r}.")


def check_float_dtype(name: str, value: Any) -> jnp.dtype:
  """Returns ``value`` as a ``jnp.dtype``; raises unless it names one of :data:`FLOAT_DTYPES`.

  Args:
    name: the field's name, for the error message.
    value: a dtype, a dtype's name (``"bfloat16"``) or a scalar type (``jnp.bfloat16``).

  Returns:
    The dtype.

  Raises:
    TypeError: ``value`` is not a dtype at all.
    ValueError: ``value`` is a dtype but not one of :data:`FLOAT_DTYPES` (e.g. ``int32``).
  """
  if value is None or isinstance(value, bool):
    raise TypeError(f"{name} must be a floating dtype, one of {FLOAT_DTYPES}, got {value!r}.")
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    raise TypeError(f"{name} must be a floating dtype, one of {FLOAT_DTYPES}, got {value!r} "
                    f"which is not a dtype.") from None
  if dtype.name not in FLOAT_DTYPES:
    raise ValueError(f"{name} must be a floating dtype, one of {FLOAT_DTYPES}, got {dtype.name}.")
  return dtype


def named(init, names):
  """``init`` whose weights carry logical axis ``names`` (``nn.with_logical_partitioning``)."""
  return nn.with_logical_partitioning(init, names)
