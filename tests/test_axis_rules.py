"""tpipe.axis_rules: logical axis names to mesh axes, pure (no JAX computation)."""

import doctest

import flax.linen as nn
import jax
import pytest
from jax.sharding import PartitionSpec as P

from tpipe import axis_rules

pytestmark = pytest.mark.unit


def test_the_default_rules_and_unannotated_weights():
  mesh = jax.sharding.AbstractMesh((2, 2, 2, 2), ("data", "fsdp", "stage", "tensor"))
  assert axis_rules.weight_spec((8, 16), ("embed", "mlp"), mesh) == P("fsdp", "tensor")
  # No names: fsdp over the largest dimension it divides.
  assert axis_rules.weight_spec((3, 10), None, mesh) == P(None, "fsdp")
  assert axis_rules.weight_spec((3, 5), None, mesh) == P()
  # A size that does not divide leaves that dimension whole; the pipeline's axes are reserved.
  assert axis_rules.weight_spec((8, 11), ("embed", "vocab"), mesh) == P("fsdp")
  assert axis_rules.weight_spec((8,), ("stage",), mesh) == P()
  # Mesh axis names map to themselves (nn.with_partitioning); rules given win over the default.
  assert axis_rules.weight_spec((8, 4), (None, "tensor"), mesh) == P(None, "tensor")
  rules = (("embed", "tensor"), ("mlp", "fsdp"))
  assert axis_rules.weight_spec((8, 16), ("embed", "mlp"), mesh, rules) == P("tensor", "fsdp")
  with nn.logical_axis_rules(rules):
    assert axis_rules.weight_spec((8, 16), ("embed", "mlp"), mesh) == P("tensor", "fsdp")
  with pytest.raises(TypeError, match=r"rules\[0\] = 'embed' is not a \(logical name, mesh "):
    axis_rules.weight_spec((8,), ("embed",), mesh, rules=["embed"])
  with pytest.raises(ValueError, match=r"have 1 entries for a weight of shape \(8, 16\)"):
    axis_rules.weight_spec((8, 16), ("embed",), mesh)


def test_module_doctests_pass():
  result = doctest.testmod(axis_rules)
  assert result.attempted > 0 and result.failed == 0, result
