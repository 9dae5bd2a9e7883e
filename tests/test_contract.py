"""jaxring's collectives keep lax's contract where a codec or an algorithm could break it.

Derivatives (lax's transpose whatever travels on the wire), dtypes, and the errors for arguments
lax refuses; each checked against jax.lax itself or a float64 NumPy reference.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring import codecs

AUTO = jax.sharding.AxisType.Auto
AXES = ("node", "local")
CODECS = {"none": None, "bf16": codecs.bf16(), "fp16": codecs.fp16(), "int8": codecs.int8(),
          "int8_stochastic": codecs.int8(64, stochastic=True),
          "topk": codecs.topk_chunks(0.5, 16)}
ALGOS = ["ring", "hierarchical", "auto"]


def mesh_of(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))


def _inputs(seed, n):
  rng = np.random.RandomState(seed)
  u = jnp.asarray(rng.randn(8 * n), jnp.float32)
  w = jnp.asarray(rng.randn(8 * n), jnp.float32)  # a different cotangent on every member
  return u, w


def _grad(collective, check_vma, u, w, out_len=None):
  """d/du of sum over members of <collective(u_member), w_member>."""
  mesh = mesh_of((2, 4), AXES)

  def per_member(v, c):
    y = collective(v)
    return jnp.sum(y * c[:y.size].reshape(y.shape))[None]

  f = jax.shard_map(per_member, mesh=mesh, in_specs=(P(AXES), P(AXES)), out_specs=P(AXES),
                    check_vma=check_vma)
  return np.asarray(jax.jit(jax.grad(lambda v: jnp.sum(f(v, w))))(u))


# --- item 1: derivatives are lax's ---------------------------------------------------------


# the quick loop keeps ring and hierarchical with check_vma (~0.3 s each)
@pytest.mark.parametrize("check_vma", [True, pytest.param(False, marks=pytest.mark.slow)])
@pytest.mark.parametrize("algorithm", [a if a != "auto" else pytest.param(a, marks=pytest.mark.slow)
                                       for a in ALGOS])
@pytest.mark.parametrize("codec", list(CODECS))
def test_psum_grad_is_lax_transpose_for_every_codec(codec, algorithm, check_vma):
  # psum is linear: the loss is linear in its result, so the gradient is lax's transpose applied
  # to w, the same whatever rounding the forward pass made
  u, w = _inputs(0, 40)
  ours = lambda v: jaxring.psum(v, AXES, algorithm=algorithm, compression=CODECS[codec])
  got = _grad(ours, check_vma, u, w)
  want = _grad(lambda v: lax.psum(v, AXES), check_vma, u, w)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("codec", ["bf16", "fp16", "int8"])
def test_pmean_grad_is_lax_transpose(codec, check_vma):
  u, w = _inputs(1, 24)
  ours = lambda v: jaxring.pmean(v, AXES, algorithm="hierarchical", compression=CODECS[codec])
  got = _grad(ours, check_vma, u, w)
  want = _grad(lambda v: lax.pmean(v, AXES), check_vma, u, w)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("check_vma", [True,
                                       pytest.param(False, marks=pytest.mark.slow)])  # ~0.5 s each
@pytest.mark.parametrize("algorithm", ["ring", "hierarchical"])
@pytest.mark.parametrize("codec", [pytest.param("bf16", marks=pytest.mark.slow), "int8", "none"])
def test_psum_scatter_and_all_gather_grads_are_lax_transposes(codec, algorithm, check_vma):
  u, w = _inputs(2, 64)
  w = jnp.tile(w, 8)  # all_gather's result is 8 times longer
  kw = dict(algorithm=algorithm, compression=CODECS[codec])
  for ours, ref in [
      (lambda v: jaxring.psum_scatter(v, AXES, tiled=True, **kw),
       lambda v: lax.psum_scatter(v, AXES, tiled=True)),
      (lambda v: jaxring.all_gather(v, AXES, tiled=True, **kw),
       lambda v: lax.all_gather(v, AXES, tiled=True)),
      (lambda v: jaxring.all_gather(v.reshape(8, 8), AXES, axis=1, **kw),
       lambda v: lax.all_gather(v.reshape(8, 8), AXES, axis=1))]:
    np.testing.assert_allclose(_grad(ours, check_vma, u, w), _grad(ref, check_vma, u, w),
                               rtol=1e-6, atol=1e-6)


# the quick loop keeps int8 on ring and hierarchical with check_vma (~0.7 s each)
@pytest.mark.parametrize("check_vma", [True, pytest.param(False, marks=pytest.mark.slow)])
@pytest.mark.parametrize("codec", ["int8", pytest.param("bf16", marks=pytest.mark.slow),
                                   pytest.param("fp16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("algorithm", [a if a != "auto" else pytest.param(a, marks=pytest.mark.slow)
                                       for a in ALGOS])
def test_grad_of_squared_sum_on_one_axis(algorithm, codec, check_vma):
  """The issue's case: d/du sum(psum(u)**2) = 2 psum(u) on every member, to within the codec's
  rounding of the forward sum (float64 reference), not off by the size of the gradient."""
  mesh = mesh_of((8,), ("i",))
  u = jnp.asarray(np.random.RandomState(3).randn(8 * 32), jnp.float32)
  f = lambda v: jnp.sum(jaxring.psum(v, "i", algorithm=algorithm,
                                     compression=CODECS[codec]) ** 2)
  loss = jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P(), check_vma=check_vma)
  got = np.asarray(jax.jit(jax.grad(loss))(u))
  x64 = np.asarray(u, np.float64).reshape(8, 32)
  want = np.tile(2 * x64.sum(0), 8)  # lax's, in both modes (checked below)
  # each of the p + 1 encodes of a partial sum errs by at most max|S| / 254 (int8, the loosest)
  atol = 2 * 9 * np.abs(x64).sum(0).max() / 254
  np.testing.assert_allclose(got, want, rtol=0, atol=atol)
  lax_loss = jax.shard_map(lambda v: jnp.sum(lax.psum(v, "i") ** 2), mesh=mesh, in_specs=P("i"),
                           out_specs=P(), check_vma=check_vma)
  np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(lax_loss))(u)), want, rtol=1e-5)


@pytest.mark.slow   # forward- and reverse-mode of every codec (~14 s)
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("codec", ["bf16", "int8", "topk"])
def test_jvp_and_linearize_are_lax_psum_of_the_tangent(codec, check_vma):
  mesh = mesh_of((2, 4), AXES)
  u, t = _inputs(4, 48)
  mk = lambda fn: jax.shard_map(lambda v: fn(v, AXES), mesh=mesh, in_specs=P(AXES),
                                out_specs=P(), check_vma=check_vma)
  ours = mk(lambda v, a: jaxring.psum(v, a, algorithm="hierarchical", compression=CODECS[codec]))
  ref = mk(lax.psum)
  y, dy = jax.jit(lambda a, b: jax.jvp(ours, (a,), (b,)))(u, t)
  want = np.asarray(t, np.float64).reshape(8, -1).sum(0)
  np.testing.assert_allclose(np.asarray(dy), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dy), np.asarray(jax.jvp(ref, (u,), (t,))[1]), rtol=1e-6,
                             atol=1e-6)
  _, lin = jax.linearize(ours, u)
  np.testing.assert_allclose(np.asarray(lin(t)), want, rtol=1e-5, atol=1e-5)


def test_second_derivative_through_a_codec():
  mesh = mesh_of((8,), ("i",))
  x = jnp.asarray(np.random.RandomState(5).randn(16) * 0.1, jnp.float32)
  f = lambda psum_fn: jax.shard_map(lambda v: jnp.sum(jnp.sin(psum_fn(v))), mesh=mesh,
                                    in_specs=P("i"), out_specs=P())
  ours = f(lambda v: jaxring.psum(v, "i", algorithm="ring", compression=codecs.int8()))
  ref = f(lambda v: lax.psum(v, "i"))
  hess = lambda g: np.asarray(jax.jit(jax.hessian(g))(x))
  np.testing.assert_allclose(hess(ours), hess(ref), rtol=2e-2, atol=2e-2)


# --- item 2: dtypes ----------------------------------------------------------------------------


@pytest.mark.parametrize("check_vma", [True, pytest.param(False, marks=pytest.mark.slow)])  # ~0.1 s
@pytest.mark.parametrize("algorithm", ["xla", "ring", "hierarchical", "auto"])
@pytest.mark.parametrize("codec", ["none", "bf16", "int8"])
def test_all_gather_of_bool_is_bool(algorithm, codec, check_vma):
  if algorithm == "xla" and codec != "none":
    pytest.skip("algorithm='xla' cannot compress (refused, tested in test_collectives)")
  mesh = mesh_of((2, 4), AXES)
  x = np.random.RandomState(6).rand(8, 5) > 0.5
  mk = lambda fn: jax.jit(jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh, in_specs=P(AXES),
                                        out_specs=P(AXES), check_vma=check_vma))
  got = mk(lambda v: jaxring.all_gather(v, AXES, algorithm=algorithm,
                                        compression=CODECS[codec]))(jnp.asarray(x))
  want = mk(lambda v: lax.all_gather(v, AXES))(jnp.asarray(x))
  assert got.dtype == want.dtype == jnp.bool_
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.asarray(got)[0], x)


@pytest.mark.parametrize("algorithm", ["xla", "ring", "hierarchical", "auto"])
def test_psum_scatter_of_bool_is_refused_as_lax_refuses_it(algorithm):
  mesh = mesh_of((8,), ("i",))
  mk = lambda fn: jax.jit(jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh, in_specs=P("i"),
                                        out_specs=P("i")))
  x = jnp.asarray(np.random.RandomState(7).rand(8, 16) > 0.5)
  with pytest.raises(Exception) as info:
    mk(lambda v: lax.psum_scatter(v, "i", tiled=True))(x)
  with pytest.raises(info.type, match=re.escape(str(info.value))):
    mk(lambda v: jaxring.psum_scatter(v, "i", tiled=True, algorithm=algorithm))(x)


# --- item 3 and friends: errors ----------------------------------------------------------------


def _call(fn, mesh_shape=(8,), names=("i",), check_vma=True):
  mesh = mesh_of(mesh_shape, names)
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(names), out_specs=P(names),
                               check_vma=check_vma))(jnp.ones(8 * 16))


def _lax_error(fn, **kw):
  with pytest.raises(Exception) as info:
    _call(fn, **kw)
  return info.type, str(info.value)


REPEATED = {
    "psum": (lambda a, **kw: jaxring.psum(jnp.ones(16), a, **kw),
             lambda a: lax.psum(jnp.ones(16), a)),
    "pmean": (lambda a, **kw: jaxring.pmean(jnp.ones(16), a, **kw),
              lambda a: lax.pmean(jnp.ones(16), a)),
    "all_gather": (lambda a, **kw: jaxring.all_gather(jnp.ones(16), a, tiled=True, **kw)[:16],
                   lambda a: lax.all_gather(jnp.ones(16), a, tiled=True)[:16]),
    "psum_scatter": (lambda a, **kw: jaxring.psum_scatter(jnp.ones(128), a, tiled=True, **kw),
                     lambda a: lax.psum_scatter(jnp.ones(128), a, tiled=True)),
}


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("op", list(REPEATED))
@pytest.mark.parametrize("kw", [dict(algorithm="ring"), dict(algorithm="hierarchical"),
                                dict(compression=codecs.int8()), dict(algorithm="xla")],
                         ids=["ring", "hierarchical", "auto_int8", "xla"])
def test_repeated_axis_name_raises_as_lax_does(op, kw, check_vma):
  ours, ref = REPEATED[op]
  lax_type, lax_msg = _lax_error(lambda v: ref(("i", "i")) + v[0], check_vma=check_vma)
  assert lax_type is ValueError
  with pytest.raises(lax_type, match=re.escape(lax_msg)) as info:
    _call(lambda v: ours(("i", "i"), **kw) + v[0], check_vma=check_vma)
  assert f"jaxring.{op}" in str(info.value)
  with pytest.raises(ValueError, match="names node more than once"):
    _call(lambda v: ours(("node", "local", "node"), **kw) + v[0], (2, 4), AXES, check_vma)


@pytest.mark.parametrize("op", ["all_gather", "psum_scatter"])
def test_int_axis_name_is_a_clear_value_error(op):
  ours, _ = REPEATED[op]
  lax_type, lax_msg = _lax_error(lambda v: lax.all_gather(v, 0))
  assert lax_type is ValueError
  with pytest.raises(ValueError, match=re.escape(lax_msg)) as info:
    _call(lambda v: ours(0, algorithm="ring") + v[0])
  assert f"jaxring.{op}: axis name 0 is an int" in str(info.value)


@pytest.mark.parametrize("op", ["psum", "pmean"])
def test_int_axis_names_reduce_positional_dimensions_as_lax_does(op):
  """lax.psum reads an int as an array dimension (alone, or beside mesh axes)."""
  ours, ref = getattr(jaxring, op), getattr(lax, op)

  def outcome(fn, axes):
    try:
      return _call(lambda v: fn(v.reshape(2, -1), axes).reshape(-1)[:8], check_vma=False)
    except ValueError as e:  # lax.pmean over ("i", 0) fails: so must jaxring, alike
      return str(e).splitlines()[0]
  for axes in (0, ("i", 0)):
    want, got = outcome(ref, axes), outcome(lambda v, a: ours(v, a, algorithm="ring"), axes)
    np.testing.assert_array_equal(got, want)
  if op == "psum":   # outside any map
    assert float(ours(jnp.ones(3), 0)) == float(ref(jnp.ones(3), 0)) == 3.0


@pytest.mark.parametrize("op", ["psum", "pmean", "all_gather", "psum_scatter"])
def test_unbound_axis_names_the_function_in_lax_words(op):
  ours, _ = REPEATED[op]
  with pytest.raises(NameError) as info:
    _call(lambda v: ours("nope", algorithm="ring") + v[0], check_vma=False)
  # lax.psum's wording (JAX's own tests match it), with the function the user called
  assert f"Found an unbound axis name: nope. To fix this, please call {op} under " \
         "`jax.shard_map`" in str(info.value)
  assert f"jaxring.{op}" in str(info.value)
  _, lax_msg = _lax_error(lambda v: lax.psum(v, "nope"), check_vma=False)
  if op == "psum":
    assert lax_msg in str(info.value)


def test_unknown_level_in_algorithm_dict_is_refused():
  with pytest.raises(ValueError, match=r"algorithm names levels \['nope'\]"):
    _call(lambda v: jaxring.psum(v, "i", algorithm={"nope": "ring"}))
  with pytest.raises(ValueError, match=r"algorithm names levels \['nope'\]"):
    with jaxring.use_topology(jaxring.Topology((jaxring.Level("local", 4),
                                                jaxring.Level("node", 2)))):
      _call(lambda v: jaxring.psum(v, "i", algorithm={"local": "xla", "nope": "ring"}))
  # the level names that do exist still work
  got = _call(lambda v: jaxring.psum(v, "i", algorithm={"i": "ring"}))
  np.testing.assert_array_equal(got, 8.0)


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical"])
def test_partially_manual_shard_map_reduces_like_lax(algorithm):
  """shard_map over two of three axes (the third left to the compiler): devices that differ
  only along it must not meet as one member in shared memory (that hung or aborted)."""
  mesh = mesh_of((2, 2, 2), ("a", "b", "c"))
  x = jnp.asarray(np.random.RandomState(4).randn(8, 64), jnp.float32)
  ops = {"psum": (lambda v: jaxring.psum(v, ("a", "b"), algorithm=algorithm),
                  lambda v: lax.psum(v, ("a", "b"))),
         "all_gather": (lambda v: jaxring.all_gather(v, ("a", "b"), tiled=True,
                                                     algorithm=algorithm),
                        lambda v: lax.all_gather(v, ("a", "b"), tiled=True))}
  for name, (ours, ref) in ops.items():
    run = [jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(("a", "b")), out_specs=P(("a", "b")),
                                 axis_names={"a", "b"}, check_vma=False)) for f in (ours, ref)]
    want = np.asarray(run[1](x))
    for _ in range(5):
      np.testing.assert_allclose(np.asarray(run[0](x)), want, rtol=1e-5, atol=1e-5,
                                 err_msg=name)


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical", "auto"])
def test_a_vmap_axis_beside_mesh_axes_reduces_like_lax(algorithm):
  mesh = mesh_of((8,), ("b",))
  x = jnp.asarray(np.arange(8 * 3 * 5), jnp.float32).reshape(8, 3, 5)

  def run(op):
    body = lambda t: jax.vmap(lambda r: op(r, ("b", "v")), axis_name="v")(t[0])[None]  # noqa: E731
    return np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("b"), out_specs=P("b"),
                                            check_vma=False))(x))
  np.testing.assert_array_equal(run(lambda r, a: jaxring.psum(r, a, algorithm=algorithm)),
                                run(lax.psum))


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical"])
def test_unreduced_values_are_reduced_like_lax(algorithm):
  mesh = mesh_of((8,), ("i",))
  x = jnp.arange(8 * 16, dtype=jnp.float32)

  def run(fn, out):
    return np.asarray(jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=out,
                                            check_vma=True))(x))
  u = lambda v: lax.pcast(v, "i", to="unreduced")  # noqa: E731
  np.testing.assert_array_equal(run(lambda v: jaxring.psum(u(v), "i", algorithm=algorithm), P()),
                                run(lambda v: lax.psum(u(v), "i"), P()))
  np.testing.assert_array_equal(
      run(lambda v: jaxring.psum_scatter(u(v), "i", tiled=True, algorithm=algorithm), P("i")),
      run(lambda v: lax.psum_scatter(u(v), "i", tiled=True), P("i")))


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical"])
def test_values_typed_reduced_keep_their_type_as_with_lax(algorithm):
  """JAX's shard_map_test.py::test_psum_reduced_input: a psum over "x" of a value typed reduced
  over "y" (``all_gather(..., to="reduced")``) keeps that type, and its gradient lax's."""
  mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  arr = jax.device_put(jnp.arange(32.0).reshape(8, 4), jax.NamedSharding(mesh, P("x", "y")))

  def step(psum):
    @jax.shard_map(out_specs=P(reduced={"y"}))
    def f(x):
      return psum(jnp.sum(lax.all_gather(x, "y", axis=1, tiled=True, to="reduced")), "x")
    return f

  ours = functools.partial(jaxring.psum, algorithm=algorithm)
  with jax.set_mesh(mesh):
    got, want = jax.jit(step(ours))(arr), jax.jit(step(lax.psum))(arr)
    assert got.sharding == want.sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.grad(step(ours)))(arr)),
                                  np.asarray(jax.jit(jax.grad(step(lax.psum)))(arr)))


def test_all_gather_takes_lax_to_keyword():
  mesh = mesh_of((8,), ("i",))
  f = lambda op, **kw: np.asarray(jax.jit(jax.shard_map(  # noqa: E731
      lambda v: op(v, "i", tiled=True, to="invarying", **kw), mesh=mesh, in_specs=P("i"),
      out_specs=P(), check_vma=True))(jnp.arange(16.0)))
  np.testing.assert_array_equal(f(jaxring.all_gather), f(lax.all_gather))
  with pytest.raises(ValueError, match="cannot compress"):
    f(jaxring.all_gather, compression=codecs.int8())


def test_psum_scatter_checks_the_shape_before_the_dtype_as_lax_does():
  bad = jnp.ones(12, bool)
  lax_type, _ = _lax_error(lambda v: lax.psum_scatter(bad, "i", tiled=True) + v[0])
  for algorithm in ("ring", "auto"):
    with pytest.raises(lax_type, match="must be divisible"):
      _call(lambda v: jaxring.psum_scatter(bad, "i", tiled=True, algorithm=algorithm) + v[0])
