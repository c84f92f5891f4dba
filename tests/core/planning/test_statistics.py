"""tpipe.core.planning.statistics: the running statistics after one step, by GPipe's rule
(``momentum * old + (1 - momentum) * pooled``, the variance pooled as ``E[x^2] - E[x]^2``)."""

import jax.numpy as jnp
import numpy as np

from tpipe.core.planning import statistics


def _stats(mean, var):
  return {"mean": jnp.asarray(mean, jnp.float32), "var": jnp.asarray(var, jnp.float32)}


def test_update_moves_each_trained_normalization_once():
  old = {"layers_0": {"norm": _stats([1.0, 2.0], [4.0, 1.0])},
         "layers_1": {"outer": {"inner": _stats([0.5], [2.0])}},
         "layers_2": {"norm": _stats([3.0], [3.0])}}
  # Pooled E[x] and E[x^2] over the step's micro-batches.
  pooled = {"layers_0": {"norm": _stats([3.0, -2.0], [10.0, 5.0])},
            "layers_1": {"outer": {"inner": _stats([2.0], [1.0])}},
            "layers_2": {"norm": _stats([7.0], [9.0])}}
  momenta = {(0, ("norm",)): 0.9, (1, ("outer", "inner")): 0.5}  # layers_2 ran in eval mode.
  new = statistics.update(old, pooled, momenta)
  np.testing.assert_allclose(new["layers_0"]["norm"]["mean"],
                             [0.9 * 1 + 0.1 * 3, 0.9 * 2 + 0.1 * -2], rtol=1e-6)
  # Pooled variances: 10 - 9 = 1 and 5 - 4 = 1.
  np.testing.assert_allclose(new["layers_0"]["norm"]["var"], [0.9 * 4 + 0.1 * 1, 0.9 + 0.1],
                             rtol=1e-6)
  # E[x^2] - E[x]^2 = 1 - 4 < 0 (rounding in a real step): clamped to 0, never negative.
  np.testing.assert_allclose(new["layers_1"]["outer"]["inner"]["mean"], [1.25], rtol=1e-6)
  np.testing.assert_allclose(new["layers_1"]["outer"]["inner"]["var"], [1.0], rtol=1e-6)
  np.testing.assert_array_equal(new["layers_2"]["norm"]["mean"], [3.0])
  np.testing.assert_array_equal(new["layers_2"]["norm"]["var"], [3.0])


def test_update_keeps_the_structure_and_layers_without_statistics():
  old = {"layers_0": {}, "layers_1": {"norm": _stats([0.0], [1.0])}}
  pooled = {"layers_0": {}, "layers_1": {"norm": _stats([1.0], [1.0])}}
  new = statistics.update(old, pooled, {(1, ("norm",)): 0.0})
  assert new["layers_0"] == {}
  np.testing.assert_array_equal(new["layers_1"]["norm"]["mean"], [1.0])  # Momentum 0: pooled.
  np.testing.assert_array_equal(new["layers_1"]["norm"]["var"], [0.0])
