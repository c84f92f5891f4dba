"""The JAX behaviours tpipe relies on beyond JAX's public API (:mod:`tpipe.core.base.jax_compat`),
each pinned by a small test: a JAX upgrade that changes one fails here, by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpipe.core.base import jax_compat


def test_a_vjp_is_a_pytree_of_its_residuals_and_reads_the_leaves_it_is_given():
  w, x = jnp.arange(6.0).reshape(2, 3), jnp.arange(8.0).reshape(4, 2)
  y, vjp = jax.vjp(lambda w: jnp.tanh(x @ w), w)
  leaves, treedef = jax_compat.vjp_residuals(vjp)
  assert leaves and all(hasattr(a, "shape") for a in leaves)
  g = jnp.ones_like(y)
  (same,) = jax_compat.vjp_with_residuals(treedef, leaves)(g)
  np.testing.assert_array_equal(same, vjp(g)[0])
  (zeroed,) = jax_compat.vjp_with_residuals(treedef, [jnp.zeros_like(a) for a in leaves])(g)
  assert not np.array_equal(zeroed, same)  # The residuals are what the backward reads.


def test_a_vjp_keeps_an_input_it_reads_as_that_very_value():
  def f(w, x):
    return x @ w

  w, x = jnp.ones((2, 3)), jnp.ones((4, 2))

  def residual_sources(w, x):
    _, vjp = jax.vjp(f, w, x)
    leaves, _ = jax_compat.vjp_residuals(vjp)
    return jax_compat.identical_positions(leaves, [w, x])

  found = []
  jax.eval_shape(lambda w, x: found.append(residual_sources(w, x)), w, x)  # Traced, as used.
  assert sorted(p for p in found[0] if p is not None) == [0, 1]
  assert jax_compat.identical_positions([jnp.ones(2)], [jnp.ones(2)]) == [None]  # Equal != same.


def test_inputs_needed_names_what_each_output_is_computed_from():
  closed = jax.make_jaxpr(lambda a, b, c: (a * 2.0, b + c, jnp.float32(1.0)))(1.0, 2.0, 3.0)
  needs = jax_compat.inputs_needed(closed)
  constants = len(closed.jaxpr.constvars)
  assert needs(0)[constants:] == [True, False, False]
  assert needs(1)[constants:] == [False, True, True]
  assert needs(2)[constants:] == [False, False, False]


def test_literals_and_variables_are_told_apart():
  closed = jax.make_jaxpr(lambda a: (a + 1.0, 3.0))(1.0)
  (eqn,) = closed.jaxpr.eqns
  a, one = eqn.invars
  assert jax_compat.is_var(a) and not jax_compat.is_literal(a)
  assert jax_compat.is_literal(one) and jax_compat.literal_value(one) == 1.0
  assert jax_compat.is_literal(closed.jaxpr.outvars[1])
  position = jax_compat.var_positions(closed.jaxpr.invars)
  assert position(a) == 0 and position(one) is None


@pytest.mark.parametrize("wrap", ["jit", "checkpoint"])
def test_a_call_body_receives_the_call_operands_as_they_are(wrap):
  inner = lambda w, x: (x @ w.astype(jnp.bfloat16)).astype(jnp.float32)
  call = jax.jit(inner) if wrap == "jit" else jax.checkpoint(inner)
  closed = jax.make_jaxpr(call)(jnp.ones((2, 3)), jnp.ones((4, 2), jnp.bfloat16))
  (eqn,) = closed.jaxpr.eqns
  body = jax_compat.call_body(eqn)
  assert body is not None and len(body.jaxpr.invars) == len(eqn.invars)
  casts = [jax_compat.casts_to(e) for e in body.jaxpr.eqns]
  assert jnp.bfloat16 in casts and jnp.float32 in casts
  assert jax_compat.call_body(body.jaxpr.eqns[0]) is None  # A cast is no call.


def test_bind_evaluates_an_equation_as_the_jaxpr_does():
  fn = lambda w, x: jax.nn.relu(jax.lax.dot_general(x, w, (((1,), (0,)), ((), ()))))
  w, x = jnp.arange(6.0).reshape(2, 3) - 2.0, jnp.arange(8.0).reshape(4, 2)
  closed = jax.make_jaxpr(fn)(w, x)
  env = dict(zip(closed.jaxpr.invars, (w, x)))
  for eqn in closed.jaxpr.eqns:
    values = [jax_compat.literal_value(v) if jax_compat.is_literal(v) else env[v]
              for v in eqn.invars]
    env.update(zip(eqn.outvars, jax_compat.bind(eqn, values)))
  np.testing.assert_array_equal(env[closed.jaxpr.outvars[0]], fn(w, x))


def test_a_scan_body_sees_constants_carry_and_one_step_of_the_scanned_inputs():
  w = jnp.ones((3, 3))

  def fn(h, xs):
    return jax.lax.scan(lambda h, x: (jnp.tanh(h @ w) + x, h.sum()), h, xs)

  closed = jax.make_jaxpr(fn)(jnp.ones(3), jnp.ones((5, 3)))
  (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
  body, consts, carries = jax_compat.scan_body(eqn)
  assert (consts, carries) == (1, 1)  # ``w``, then ``h``, then one step's ``x``.
  assert len(body.jaxpr.invars) == len(eqn.invars) == 3
  assert [v.aval.shape for v in body.jaxpr.invars] == [(3, 3), (3,), (3,)]
  assert jax_compat.scan_body(body.jaxpr.eqns[0]) is None


def test_a_closed_call_holding_a_shard_map_lowers_inline():
  """The lowering :func:`jax_compat.inline_calls_of_shard_maps` installs (tpipe.core.programs.fsdp
  does on import): the ``closed_call`` JAX's partial evaluation makes of a scan's body (here
  differentiating a scan whose body holds a ``shard_map``) is lowered inline, where JAX's own
  rule lowers it as a called function; the program computes the same."""
  from jax._src import core as jax_core  # pylint: disable=g-import-not-at-top
  from jax._src.interpreters import mlir  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import tpipe  # pylint: disable=g-import-not-at-top

  jax_compat.inline_calls_of_shard_maps()
  mesh = tpipe.make_mesh(stages=1, fsdp=2)
  summed = jax.shard_map(lambda a: jax.lax.psum(a, "fsdp"), mesh=mesh, in_specs=P("fsdp"),
                         out_specs=P("fsdp"), check_vma=False)

  def program():  # A new function each time: nothing lowered is reused.
    def loss(w, x):
      step = lambda c, _: (jnp.sin(summed(c * w)), None)
      return jnp.sum(jax.lax.scan(step, x, None, length=3)[0])
    return jax.jit(jax.grad(loss))

  w, x = jnp.float32(0.5), jnp.arange(4.0)
  inline = program().lower(w, x).as_text()
  ours = mlir._lowerings[jax_core.closed_call_p]
  mlir.register_lowering(jax_core.closed_call_p, jax_compat._CALL_LOWERING, cacheable=False)
  try:
    called = program().lower(w, x).as_text()
    want = program()(w, x)
  finally:
    mlir._lowerings[jax_core.closed_call_p] = ours
  assert called.count("call @") > inline.count("call @")
  assert inline.count("all_reduce") == called.count("all_reduce") > 0
  np.testing.assert_allclose(program()(w, x), want, rtol=1e-6)
