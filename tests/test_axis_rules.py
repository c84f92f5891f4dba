"""tpipe.axis_rules: logical axis names to mesh axes, pure (no JAX computation)."""

import doctest

import flax.linen as nn
import jax
import pytest
from jax.sharding import PartitionSpec as P

from tpipe import axis_rules

pytestmark = pytest.mark.unit


def test_the_model_width_goes_over_fsdp_or_else_over_expert_never_both():
  spec = lambda shape, names, sizes, rules=None: axis_rules.weight_spec(
      shape, names, jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes)), rules)
  with_fsdp = {"stage": 2, "fsdp": 2, "expert": 4}
  without = {"stage": 2, "expert": 4, "tensor": 2}
  # A mixture's attention and ends: over fsdp where there is one, else over the expert devices.
  assert spec((64, 32), ("embed", "mlp"), with_fsdp) == P("fsdp")
  assert spec((64, 32), ("embed", "mlp"), without) == P("expert", "tensor")
  # Its experts over expert; the width of an expert's matrix then over fsdp, or whole.
  assert spec((4, 64, 32), ("expert", "embed", "mlp"), with_fsdp) == P("expert", "fsdp")
  assert spec((4, 64, 32), ("expert", "embed", "mlp"), without) == P("expert", None, "tensor")
  # fsdp (gathered by the tick loops) never shares a dimension with a partitioner's axis, in
  # whatever order a rule names them.
  for target in (("fsdp", "tensor"), ("tensor", "fsdp")):
    rules = (("embed", target),)
    assert spec((64,), ("embed",), {"fsdp": 2, "tensor": 2}, rules) == P(target[0])
  assert spec((64,), ("embed",), {"expert": 2, "tensor": 2}, (("embed", ("expert", "tensor")),)
              ) == P(("expert", "tensor"))


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
