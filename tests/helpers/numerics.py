"""What "equals the sequential model" means for a float32 result: as close to exact as plain is.

A pipelined computation adds and multiplies the same numbers as the plain sequential model, in
another order (micro-batches, stage boundaries, other kernels), so its float32 rounding errors
differ. A bare tolerance on ``|pipelined - plain|`` is machine-specific: FMA and vector widths
(AVX-512, AVX2, SSE) change the size of the difference, and a deep attention stack amplifies it.

Instead, both float32 results are measured against a float64 run of the plain model
(:func:`float64_reference`): the pipelined error may be at most ``factor`` times the plain model's
own error, plus a floor of a few float32 ulps (:func:`assert_as_close_as_plain`). A correct
pipeline reorders rounding errors without making them larger; a wrong one (a layer out of place, a
dropped micro-batch, a parameter off by 1e-4) is orders of magnitude further from the reference.

The plain model should do the same float32 work the tested code does, in the plain way: for a
pipeline, the sequential model on the same micro-batches
(``tests.helpers.blocks.apply_in_sequence(..., microbatches=M * data)``). XLA:CPU picks kernels by
shape, so the sequential model's own float32 error on 2-row micro-batches is up to 3x its error on
the whole 64-row batch (AVX2), while exact arithmetic gives the same result either way; the float64
reference may run the whole batch.

Typical use::

  plain = jax.jit(sequential)(params, x)
  reference = numerics.float64_reference(jax.jit(sequential), params, x)
  numerics.assert_as_close_as_plain(jax.jit(pipelined)(params, x), plain, reference)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

# Two float32 evaluations of one expression differ legitimately in order and in fusion: a fused
# multiply-add rounds once where a multiply and an add round twice, so one kernel's error bound is
# up to twice another's. Over many elements, error norms of equal-quality computations concentrate
# near each other; a bug (a layer out of place, a micro-batch dropped or counted twice, a stale
# parameter) is orders of magnitude beyond this.
FACTOR = 2.0
# The last few operations producing a value (a reduction's final additions, a division, the store)
# each round by up to half an ulp whatever came before. A scalar such as a loss has one error
# sample, and of two equal-sized random errors one exceeds twice the other in ~30% of cases, so
# for scalars this floor, not the factor, decides; 4 ulps is 4.8e-7 relative in float32.
ULPS = 4


def _is_float(leaf) -> bool:
  dtype = getattr(leaf, "dtype", None)
  return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def float64_reference(fn, *args):
  """``fn(*args)`` computed in float64: the "exact" result float32 errors are measured against.

  Inside ``jax.enable_x64(True)``, every floating array leaf of ``args`` is cast to float64 (the
  float32 values are exactly representable, so the inputs are the same numbers); integer, bool and
  PRNG-key leaves and non-array leaves (Python scalars, modules, functions) are passed unchanged.
  ``fn`` must take everything that depends on the dtype as an argument and build its constants
  from its inputs' dtypes: a float32 array captured in a closure stays float32, and a random draw
  made inside ``fn`` samples other bits in float64. Create random inputs and parameters in float32
  outside and pass them in. ``jax.jit`` keys its cache on argument dtypes and on the x64 flag, so
  one jitted ``fn`` may serve both the float32 and the float64 runs.

  Args:
    fn: the plain sequential model, e.g. ``lambda params, x: ...`` or a ``jax.grad`` of it.
    *args: its arguments, as given to the float32 run.

  Returns:
    ``fn``'s result with floating leaves as float64 NumPy arrays (safe to use outside x64).

  Raises:
    AssertionError: a floating leaf of the result is not float64 (``fn`` computed some part in a
      fixed lower precision, so it is no reference).
  """
  with jax.enable_x64(True):
    args64 = jax.tree.map(
        lambda leaf: jnp.asarray(np.asarray(leaf, np.float64)) if _is_float(leaf) else leaf, args)
    result = fn(*args64)
    result = jax.tree.map(lambda leaf: np.asarray(leaf) if _is_float(leaf) else leaf, result)
  lower = [jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_leaves_with_path(result)
           if _is_float(leaf) and leaf.dtype != np.float64]
  assert not lower, f"The float64 reference computed {', '.join(lower)} in lower precision."
  return result


@dataclasses.dataclass(frozen=True)
class Error:
  """Errors against the reference, in units of the reference tree's norm.

  Attributes:
    path: the leaf's path (``jax.tree_util.keystr``), or ``"<tree>"`` for the whole tree.
    actual: ``|actual - reference| / |reference tree|``.
    plain: ``|plain - reference| / |reference tree|``.
    bound: what ``actual`` may be: ``factor * plain + floor``, same units.
  """

  path: str
  actual: float
  plain: float
  bound: float

  @property
  def ratio(self) -> float:
    """``actual / plain``: how much further from exact the result under test is."""
    if self.plain > 0:
      return self.actual / self.plain
    return math.inf if self.actual > 0 else 1.0

  @property
  def ok(self) -> bool:
    return self.actual <= self.bound  # False for NaN

  def __str__(self):
    return (f"{self.path}: error {self.actual:.3g} vs plain {self.plain:.3g} "
            f"(ratio {self.ratio:.3g}, allowed {self.bound:.3g})")


def errors(actual, plain, reference, *, factor=FACTOR, ulps=ULPS) -> list[Error]:
  """Per-leaf errors of ``actual`` and ``plain`` against ``reference``, then the whole tree's.

  Norms are Euclidean over a leaf's elements (over all leaves for the tree), computed in float64.
  Every error is divided by the norm of the whole reference tree, so numbers are comparable across
  leaves; the verdict of a leaf depends only on its own errors and its floor.

  The floor of a leaf is ``ulps * eps * sqrt(sum_i max(r_i, rms) ** 2)`` over its reference
  elements ``r_i``, where ``eps`` is the machine epsilon of ``actual``'s dtype (2**-23 for float32)
  and ``rms`` the root-mean-square element of the whole reference tree: ``ulps`` ulps on every
  element, at its own magnitude or the tree's typical one, whichever is larger. Merely storing a
  result in float32 moves each element by up to half an ulp of itself, so errors below a few ulps
  carry no information, and without a floor an exact plain result (a loss rounding to the same
  float32 as the reference) would demand an exact pipelined one. An element's own magnitude sets
  its rounding (a final layer's large kernel gradient, seen on AVX-512 at 2.5x the plain error
  with both under 4 ulps); the tree's magnitude is the floor for elements near zero, because their
  rounding noise is set by the terms they are computed from: a gradient that is zero in exact
  arithmetic (an attention key bias, which the softmax cancels) is float32 noise at the scale of
  the other gradients, and relative to its own ~0 norm it would be arbitrarily large. The whole
  tree's floor is the same rule over all elements. (So, by the triangle inequality for Euclidean
  norms, a tree whose leaves all pass passes as a whole; the tree's line gives the overall ratio.)

  Args:
    actual: the result under test (e.g. pipelined, float32).
    plain: the same quantity from the plain sequential model at the same precision.
    reference: the same quantity in float64 (:func:`float64_reference`).
    factor: how many times the plain model's error the actual error may be.
    ulps: the floor, in ulps of ``actual``'s dtype per element at the larger of its own and the
      tree's RMS magnitude.

  Returns:
    One :class:`Error` per leaf, in tree order, then one for the whole tree (path ``"<tree>"``).

  Raises:
    ValueError: the trees' structures or leaf shapes differ, or ``plain`` or ``reference`` is not
      finite (then there is no meaningful error to compare with).
  """
  leaves = jax.tree_util.tree_leaves_with_path(reference)
  paths = [jax.tree_util.keystr(path) or "<root>" for path, _ in leaves]
  reference_leaves = [np.asarray(leaf, np.float64) for _, leaf in leaves]
  tree = jax.tree.structure(reference)
  for name, other in (("actual", actual), ("plain", plain)):
    if jax.tree.structure(other) != tree:
      raise ValueError(f"{name} has structure {jax.tree.structure(other)}, reference {tree}.")
  actual_leaves = jax.tree.leaves(actual)
  plain_leaves = [np.asarray(leaf, np.float64) for leaf in jax.tree.leaves(plain)]
  for path, a, p, r in zip(paths, actual_leaves, plain_leaves, reference_leaves):
    if np.shape(a) != r.shape or p.shape != r.shape:
      raise ValueError(f"{path}: shapes actual {np.shape(a)}, plain {p.shape}, reference "
                       f"{r.shape} differ.")
    for name, value in (("plain", p), ("reference", r)):
      if not np.all(np.isfinite(value)):
        raise ValueError(f"{path}: the {name} result is not finite; nothing to compare with.")

  eps = max(float(jnp.finfo(getattr(a, "dtype", np.float32)).eps) for a in actual_leaves)
  size = sum(r.size for r in reference_leaves)
  squares = sum(float(np.sum(r ** 2)) for r in reference_leaves)
  norm = math.sqrt(squares) or 1.0  # an all-zero reference: errors stay absolute
  rms = math.sqrt(squares / size) if size else 0.0
  result = []
  actual_squares = plain_squares = scale_squares = 0.0
  for path, a, p, r in zip(paths, actual_leaves, plain_leaves, reference_leaves):
    eps_leaf = float(jnp.finfo(getattr(a, "dtype", np.float32)).eps)
    actual_error = float(np.linalg.norm(np.asarray(a, np.float64) - r))
    plain_error = float(np.linalg.norm(p - r))
    actual_squares += actual_error ** 2
    plain_squares += plain_error ** 2
    # Each element at its own magnitude or the tree's typical one, whichever is larger.
    scale = float(np.sum(np.maximum(np.abs(r), rms) ** 2))
    scale_squares += scale
    floor = ulps * eps_leaf * math.sqrt(scale)
    result.append(Error(path, actual_error / norm, plain_error / norm,
                        (factor * plain_error + floor) / norm))
  floor = ulps * eps * math.sqrt(scale_squares)
  actual_error, plain_error = math.sqrt(actual_squares), math.sqrt(plain_squares)
  result.append(Error("<tree>", actual_error / norm, plain_error / norm,
                      (factor * plain_error + floor) / norm))
  return result


def assert_as_close_as_plain(actual, plain, reference, *, factor=FACTOR, ulps=ULPS, what=""):
  """Asserts ``actual`` is no further from ``reference`` than ``factor`` times ``plain`` is.

  The rule, per leaf and over the whole tree: ``|actual - reference| <= factor * |plain -
  reference| + floor``, with the floor a few ulps per element at the reference tree's RMS
  magnitude (see :func:`errors`). Put quantities of one scale in one call (a model's gradients,
  its outputs); compare a scalar such as a loss in its own call, where the floor is its own ulps.

  Args:
    actual: the result under test (e.g. pipelined, float32).
    plain: the plain sequential model's result at the same precision.
    reference: the plain model's result in float64 (:func:`float64_reference`).
    factor: how many times the plain model's error the actual error may be.
    ulps: the floor, in ulps per element of the tree's RMS magnitude.
    what: a name for the quantity, for the failure message.

  Returns:
    The list of :class:`Error`, per leaf then ``"<tree>"``, for callers that report margins.

  Raises:
    AssertionError: listing every failing leaf (and the tree) with both errors and their ratio.
  """
  found = errors(actual, plain, reference, factor=factor, ulps=ulps)
  failing = [e for e in found if not e.ok]
  if failing:
    lines = "\n".join(f"  {e}" for e in failing)
    raise AssertionError(
        f"{what or 'result'} is further from the float64 reference than {factor} x the plain "
        f"model's error + {ulps} ulps (errors relative to the reference's norm):\n{lines}")
  return found
