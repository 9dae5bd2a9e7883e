"""jaxring's drop-ins installed in ``jax.lax``'s place, as JAX's own test suites run them
(tools/jax_tests) and as a user switches a program over in one line.

jaxring's own calls to the native collective (the ``xla`` plan, a ``vmap`` axis, the tangent and
transpose rules) must stay lax's primitives (jaxring._src.native): second derivatives through
``ring`` and ``hierarchical`` are compared with the ones lax gives before the switch.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jaxring
from jaxring import codecs

OPS = ("psum", "pmean", "psum_scatter", "all_gather")
AUTO = jax.sharding.AxisType.Auto


@pytest.fixture
def lax_is_jaxring(monkeypatch):
  """Installs ``jaxring.<op>`` with the given keywords as ``jax.lax.<op>`` for the test."""
  def install(**kw):
    for op in OPS:
      monkeypatch.setattr(jax.lax, op, functools.partial(getattr(jaxring, op), **kw))
  return install


def _second_derivatives(axes, mesh, check_vma):
  """Reverse over reverse, forward over reverse and the Hessian of a loss whose gradient is
  reduced by ``jax.lax.pmean`` (what a gradient penalty or MAML differentiates twice)."""
  def loss(w, x):
    pred = jnp.tanh(x @ w)
    return jax.lax.pmean(jnp.mean(pred ** 2), axes)

  def body(w, x):
    g = lambda w: jax.lax.pmean(jax.grad(loss)(w, x), axes)
    penalty = jax.grad(lambda w: jnp.sum(g(w) ** 2))(w)
    hvp = jax.jvp(g, (w,), (jnp.ones_like(w),))[1]
    hess = jax.hessian(lambda w: loss(w, x))(w)
    return penalty, hvp, jax.lax.pmean(hess, axes)

  spec = P(axes)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), spec), out_specs=(P(), P(), P()),
                            check_vma=check_vma))
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((6, 3)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((8 * 4, 6)), jnp.float32)
  return [np.asarray(a) for a in f(w, x)]


# the quick loop keeps ring and hierarchical uncompressed with check_vma (~1 s each)
@pytest.mark.parametrize("check_vma", [True, pytest.param(False, marks=pytest.mark.slow)])
@pytest.mark.parametrize("codec", ["none", pytest.param("bf16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("algorithm", ["ring", "hierarchical",
                                       pytest.param("auto", marks=pytest.mark.slow)])
def test_second_derivatives_through_jaxring_in_lax_place(lax_is_jaxring, algorithm, codec,
                                                         check_vma):
  mesh = jax.make_mesh((4, 2), ("node", "local"), axis_types=(AUTO, AUTO))
  axes = ("node", "local")
  want = _second_derivatives(axes, mesh, check_vma)
  lax_is_jaxring(algorithm=algorithm, compression=codecs.parse(codec))
  got = _second_derivatives(axes, mesh, check_vma)
  # bf16 rounds the values reduced on the way; the derivative rules are lax's (exact)
  tol = 1e-5 if codec == "none" else 2e-2
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


@pytest.mark.parametrize("algorithm", ["ring", pytest.param("hierarchical", marks=pytest.mark.slow),
                                       pytest.param("auto", marks=pytest.mark.slow)])  # ~0.5-1 s
def test_jaxs_grad_of_psum_in_pmap(lax_is_jaxring, algorithm):
  """pmap_test.py's testGradOfPsum: second-order check_grads, forward and reverse."""
  lax_is_jaxring(algorithm=algorithm)
  f = jax.pmap(lambda x: jax.lax.psum(x, axis_name="i"), axis_name="i")
  x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
  check_grads(f, (x,), 2, ["fwd", "rev"], 1e-2, 1e-2, eps=1.)
  np.testing.assert_array_equal(np.asarray(f(x))[3], x.sum(axis=0))


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical"])
def test_a_vmap_axis_is_reduced_by_lax_not_by_jaxring_again(lax_is_jaxring, algorithm):
  x = jnp.arange(12.0).reshape(3, 4)
  grad = lambda: jax.vmap(jax.grad(lambda v: -jax.lax.psum(v, "b")), out_axes=None,
                          axis_name="b")(x[:, 0])   # batching_test.py's testGradOfPsum
  want = np.asarray(grad())
  lax_is_jaxring(algorithm=algorithm)
  got = jax.vmap(lambda v: jax.lax.psum(v, "b"), axis_name="b")(x)
  np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(x.sum(0), (3, 4)))
  np.testing.assert_array_equal(np.asarray(grad()), want)
