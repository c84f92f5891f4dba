"""Plans written by hand (no layer traced): chunks cut by ``group_units`` and the abstract
input of every layer given, for tests of what a plan's boundaries and groups decide."""

import jax
import jax.numpy as jnp

from tpipe.core.planning import plan as plan_lib


def rows(shape, dtype=jnp.float32, batch=2):
  """An abstract value with ``batch`` rows in front of ``shape``."""
  return jax.ShapeDtypeStruct((batch,) + tuple(shape), dtype)


def plan(copies, counts, layer_inputs, num_stages):
  """A :class:`tpipe.core.planning.plan.Plan` of layers with ``copies`` (None for a plain layer) cut
  into ``counts`` units per chunk; ``layer_inputs`` is every layer's input and last the
  output."""
  groups = plan_lib.group_units(list(copies), tuple(counts))
  return plan_lib.Plan(unit_names=(), costs=(), counts=tuple(counts), groups=groups,
                       layer_inputs=tuple(layer_inputs), num_stages=num_stages)
