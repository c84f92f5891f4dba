"""tpipe.core.adapter: one call built, staged, run, statistics handed back in the form given.

A two-stage sequence of linen layers (a Dense, then a BatchNorm in training mode, then a Dense)
run through the adapter with logical variables and with staged ones gives the same outputs bit for
bit, and the updated statistics come back logical or :class:`~tpipe.core.adapter.Staged` as they
were given; staged parameters without the model's logical shapes are refused before tracing.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpipe
from tpipe.core import adapter
from tpipe.core.layout import staging
from tpipe.linen import sequential

BATCH, WIDTH = 8, 4


class DenseNorm(nn.Module):
  """Dense -> BatchNorm (training mode) -> tanh."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(WIDTH)(x)
    return jnp.tanh(nn.BatchNorm(use_running_average=False, momentum=0.5)(x))


def _model():
  mesh = tpipe.make_mesh(stages=2, data=1)
  model = tpipe.Sequential([nn.Dense(WIDTH), DenseNorm(), nn.Dense(2)], num_stages=2,
                           num_microbatches=2, mesh=mesh)
  x = jax.random.normal(jax.random.key(0), (BATCH, 3))
  variables = model.init(jax.random.key(1), x)
  layers = sequential.LinenLayers(tuple(model.layer_list()), model.spec, "test")
  return model, layers.model(x, {}, ()), variables, x


def test_logical_and_staged_variables_give_the_same_call():
  model, front, variables, x = _model()
  logical = adapter.Variables(variables["params"], variables["batch_stats"])
  pipeline = adapter.build(front, x, {}, (), logical)
  staged_params, staged_stats = pipeline.stage(variables["params"], variables["batch_stats"])
  staged = adapter.Variables(adapter.Staged(staged_params), adapter.Staged(staged_stats))

  from_logical = adapter.call(front, logical, x)
  from_staged = adapter.call(front, staged, x)

  np.testing.assert_array_equal(from_logical.value, from_staged.value)
  logical_stats = from_logical.stats()
  staged_stats_back = from_staged.stats()
  assert isinstance(staged_stats_back, adapter.Staged)
  assert not isinstance(logical_stats, adapter.Staged)
  # Logical: every layer's entry, empty for the layers without statistics.
  assert sorted(logical_stats) == ["layers_0", "layers_1", "layers_2"]
  assert not jax.tree.leaves([logical_stats["layers_0"], logical_stats["layers_2"]])
  logical_stats = {"layers_1": logical_stats["layers_1"]}
  from_staged_logical = staging.to_logical(pipeline.stats_layout, staged_stats_back.tree)
  jax.tree.map(np.testing.assert_array_equal, logical_stats["layers_1"],
               from_staged_logical["layers_1"])
  # The step changed them (training mode), and the linen module's own call agrees.
  changed = jax.tree.map(lambda a, b: bool(np.any(a != b)), logical_stats,
                         variables["batch_stats"])
  assert any(jax.tree.leaves(changed))
  y, updated = model.apply(variables, x, mutable=["batch_stats"])
  np.testing.assert_array_equal(y, from_logical.value)
  jax.tree.map(np.testing.assert_array_equal, dict(updated["batch_stats"]), logical_stats)


def test_staged_parameters_need_the_models_shapes():
  _, front, variables, x = _model()
  bare = adapter.Model(front.layers, front.spec, "test")
  staged = adapter.Variables(adapter.Staged({}), variables["batch_stats"])
  with pytest.raises(ValueError, match=r"test: staged parameters need the model's logical "):
    adapter.build(bare, x, {}, (), staged)


def test_pipeline_is_exported_where_pipeline_for_returns_it():
  model, _, _, x = _model()
  assert isinstance(model.pipeline_for(x), tpipe.PlannedPipeline)
  assert "PlannedPipeline" in tpipe.__all__
