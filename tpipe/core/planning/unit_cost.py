"""What one layer unit costs, measured on one micro-batch: FLOPs or wall time, cached.

Balancing a layer sequence by ``"flops"`` or ``"time"`` needs one number per distinct layer: the
cost of its forward and backward on one micro-batch. Both come from one ahead-of-time compile of
that computation as a training step runs it (:func:`forward_backward`: the gradients of the
parameters and of the input, for an output cotangent XLA cannot fold away):

* ``"flops"``: XLA's ``cost_analysis()`` of the compiled program. It counts a loop body once and
  a conditional as its costliest branch. While it traces the layer, :func:`counting_flops` is
  True: a layer whose operation XLA:CPU expands into more work than it does on an accelerator
  (``jax.lax.ragged_dot``, a product with every group) can stand in an operation of the same
  FLOPs (:func:`tpipe.train.experts.grouped_matmul`: one dense product of its shape).
* ``"time"``: the program's wall time, run on example inputs of the right shapes: a few warm-up
  runs, then the median of several timed runs, each waited for with ``block_until_ready``. Meant
  for real accelerators. On shared CPUs (and anywhere other work competes) the timings are noisy,
  so the split they give may differ from run to run.

Costs are cached for the life of the process by :func:`cost`'s key: the cost kind, the backend,
a description of the layer (its class and fields, keyword arguments, RNG streams) and the abstract
shapes of its parameters and input. Tracing a model again (``init`` then ``apply``, every
``apply`` under a new ``jit``) therefore neither compiles nor measures a layer again, and a
measured split stays the same within the process.

Example::

  f = lambda params, h, broadcast, per_example: h @ params["w"]
  params = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
  h = jax.ShapeDtypeStruct((4, 8), jnp.float32)
  flops = cost("flops", f, params, h, ((), ()), identity=("matmul",))
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("flops", "time")
# "time": untimed runs first (caches, clocks, lazy allocations), then the median of timed runs.
WARMUP_RUNS = 2
TIMED_RUNS = 7

_CACHE: dict[Hashable, float] = {}
# The parts of one unit's step :func:`action_flops` counts.
PARTS = ("forward", "backward_input", "backward_weight")


_COUNTING = [0]  # How many FLOP counts are tracing now (nested counts stay True).


def counting_flops() -> bool:
  """Whether tpipe is tracing a layer now to count its FLOPs (``balance="flops"``, the tick
  costs a fused schedule is laid out for, the report's per-stage FLOPs), not to run it.

  A layer may then trace a stand-in of the same FLOPs where XLA's count of its own operation
  would mislead: ``jax.lax.ragged_dot`` is counted on the CPU as a product with every group
  (E times the work of a mixture's k-of-E routing). The stand-in's values are never used.

  Example::

    >>> counting_flops()
    False
  """
  return _COUNTING[0] > 0


@contextlib.contextmanager
def _counting():
  _COUNTING[0] += 1
  try:
    yield
  finally:
    _COUNTING[0] -= 1


def abstract_key(tree) -> Hashable:
  """A hashable description of a pytree: its structure, each array leaf's shape, dtype and weak
  type, and every other leaf (a static value) as itself."""
  leaves, treedef = jax.tree.flatten(tree)
  described = []
  for leaf in leaves:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
      described.append(("array", tuple(np.shape(leaf)), str(leaf.dtype),
                        bool(getattr(leaf, "weak_type", False))))
    else:
      described.append(("static", leaf))
  return treedef, tuple(described)


def cost(kind: str, layer_apply: Callable, params, h, side, *, identity: Hashable) -> float:
  """The cost of one unit's forward and backward on one micro-batch, cached.

  Args:
    kind: ``"flops"`` or ``"time"`` (see the module docstring).
    layer_apply: ``f(params, h, broadcast, per_example) -> output``.
    params: the unit's parameters, abstract (``jax.ShapeDtypeStruct``) or arrays.
    h: its input on one micro-batch, abstract or arrays.
    side: ``(broadcast, per_example)``, the side inputs ``layer_apply`` takes, abstract.
    identity: everything ``layer_apply`` depends on besides the shapes of ``params`` and ``h``:
      for a Flax layer its module (class and fields), the abstract keyword arguments it is given
      and its RNG stream names. Two calls with equal identities and shapes share one measurement.
      If it (or a static leaf) cannot be hashed, the cost is measured and not cached.

  Returns:
    FLOPs, or seconds (the median wall time): a finite float >= 0.
  """
  if kind not in KINDS:
    raise ValueError(f"Unknown cost kind {kind!r}; choose one of {KINDS}.")
  key = (kind, jax.default_backend(), identity, abstract_key(params), abstract_key(h))
  return _cached(key, lambda: measure(kind, layer_apply, params, h, side))


def _cached(key, compute: Callable):
  """``compute()``, kept in the cache under ``key``; measured every time where something in the
  key cannot be hashed."""
  try:
    found = _CACHE.get(key)
  except TypeError:
    return compute()
  if found is None:
    found = _CACHE[key] = compute()
  return found


def action_flops(layer_apply: Callable, params, h, side, *,
                 identity: Hashable) -> dict[str, float]:
  """One unit's FLOPs on one micro-batch split the way a fused schedule's actions split them,
  cached as :func:`cost` caches them (not cached with ``identity=None``: nothing tells the unit
  from another of the same shapes).

  Three compiles: the forward alone; the forward and its VJP in every floating argument (what
  :func:`cost` counts for ``"flops"``); the forward and its VJP in the input ``h`` and the side
  inputs alone. Their differences give the backward's two parts.

  Returns:
    ``{"forward": .., "backward_input": .., "backward_weight": ..}``, each a float >= 0: the
    forward; the backward for the gradients of the input (what ``BI`` computes besides a
    recomputed forward); the rest of the backward, for the weights (what ``W`` computes).
  """
  if identity is None:  # Nothing tells this unit from another of the same shapes.
    return _measure_actions(layer_apply, params, h, side, identity)
  key = ("actions", jax.default_backend(), identity, abstract_key(params), abstract_key(h))
  return dict(_cached(key, lambda: _measure_actions(layer_apply, params, h, side, identity)))


def _measure_actions(layer_apply: Callable, params, h, side, identity) -> dict[str, float]:
  fn = lambda p, x, s: layer_apply(p, x, *s)
  forward = _compiled_flops(jax.jit(fn), _abstract((params, h, side)))
  # The whole step's count is balance="flops"'s: measured once for both.
  total = (measure("flops", layer_apply, params, h, side) if identity is None
           else cost("flops", layer_apply, params, h, side, identity=identity))
  # The VJP in the input and the side inputs only: the parameters held fixed.
  with _counting():
    with_input = _compiled_flops(*forward_backward(fn, params, h, side,
                                                   differentiate=(False, True, True)))
  backward = max(total - forward, 0.0)
  backward_input = min(max(with_input - forward, 0.0), backward)
  return {"forward": forward, "backward_input": backward_input,
          "backward_weight": backward - backward_input}


def _compiled_flops(program, abstract) -> float:
  """XLA's FLOP count of ``program`` compiled for ``abstract`` arguments, traced with
  :func:`counting_flops` True."""
  with _counting():
    lowered = program.lower(*abstract)
  analysis = lowered.compile().cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  return float((analysis or {}).get("flops", 0.0))


def measure(kind: str, layer_apply: Callable, params, h, side) -> float:
  """Compiles one unit's forward and backward once and returns its FLOPs or median seconds.

  Safe to call while tracing (e.g. inside ``jax.jit``): the compile and the timed runs happen
  eagerly, on concrete example inputs.
  """
  with _counting() if kind == "flops" else contextlib.nullcontext():
    program, abstract = forward_backward(lambda p, x, s: layer_apply(p, x, *s), params, h, side)
  if kind == "flops":
    return _compiled_flops(program, abstract)
  compiled = program.lower(*abstract).compile()
  with jax.ensure_compile_time_eval():
    return median_seconds(compiled, jax.device_put(_example_arrays(abstract)))


def median_seconds(compiled, args, warmup: int = WARMUP_RUNS, runs: int = TIMED_RUNS) -> float:
  """The median wall time of ``compiled(*args)`` over ``runs`` timed runs, each waited for,
  after ``warmup`` untimed ones."""
  for _ in range(warmup):
    jax.block_until_ready(compiled(*args))
  seconds = []
  for _ in range(runs):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    seconds.append(time.perf_counter() - start)
  return float(statistics.median(seconds))


def forward_backward(fn: Callable, *args, differentiate=None) -> tuple[Callable, tuple]:
  """``(program, abstract arguments)``: ``fn``'s forward and its VJP with respect to every
  floating leaf of ``args`` (integer leaves, such as token ids, held fixed), as a training step
  runs them, jitted, and the abstract arguments it takes.

  The output cotangent is an argument of the program, not a constant, so XLA cannot simplify
  the backward pass (with a cotangent of ones, a weight gradient ``x^T g`` becomes sums of
  ``x``'s columns); and the input's gradient is formed too, as a pipeline stage forms it for
  the stage before.

  Args:
    fn: a JAX-traceable function.
    *args: its arguments as ``jax.ShapeDtypeStruct`` (or arrays).
    differentiate: per argument, whether its floating leaves are differentiated; None: all.
  """
  leaves, treedef = jax.tree.flatten(args)
  wanted = []
  for i, arg in enumerate(args):
    wanted += [differentiate is None or bool(differentiate[i])] * len(jax.tree.leaves(arg))
  floating = [jnp.issubdtype(leaf.dtype, jnp.inexact) and w for leaf, w in zip(leaves, wanted)]
  out_shapes = jax.eval_shape(fn, *args)

  def program(diff, fixed, cotangent):
    def f(diff):
      it_diff, it_fixed = iter(diff), iter(fixed)
      merged = [next(it_diff) if d else next(it_fixed) for d in floating]
      return fn(*jax.tree.unflatten(treedef, merged))

    out, vjp = jax.vjp(f, diff)
    return out, vjp(cotangent)

  diff = [leaf for leaf, d in zip(leaves, floating) if d]
  fixed = [leaf for leaf, d in zip(leaves, floating) if not d]
  return jax.jit(program), _abstract((diff, fixed, out_shapes))


def _abstract(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def _example_arrays(abstract) -> Any:
  """NumPy inputs of the given shapes for timing: standard normal floats (fixed seed), zeros for
  integers and booleans (valid token ids and indices for any table)."""
  rng = np.random.default_rng(0)

  def example(a):
    if jnp.issubdtype(a.dtype, jnp.inexact):
      return rng.standard_normal(a.shape).astype(a.dtype)
    return np.zeros(a.shape, a.dtype)

  return jax.tree.map(example, abstract)
