"""jaxring's collectives against jax.lax: every algorithm, dtype, mesh and transformation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax import test_util as jtu
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring._src.algorithms import ring

ALGOS = ["xla", "ring", "hierarchical", "auto"]
AUTO = jax.sharding.AxisType.Auto
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.int16, jnp.int32, jnp.uint8,
          jnp.uint32, jnp.complex64, jnp.bool_]
# leaf shapes per device: scalar, 0-size, prime, fewer elements than devices, 2-D
SHAPES = [(), (0,), (37,), (3,), (5, 7)]


def mesh_of(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))


def make_tree(seed, n_dev):
  """Per-device inputs (leading axis n_dev) of every dtype and shape, small enough that integer
  sums cannot overflow and float sums of 8 values are exact in f32."""
  rng = np.random.RandomState(seed)
  tree = {}
  for dt in DTYPES:
    for shp in SHAPES:
      full = (n_dev,) + shp
      if dt == jnp.bool_:
        v = rng.rand(*full) > 0.5
      elif dt == jnp.complex64:
        v = rng.randint(-8, 8, full) + 1j * rng.randint(-8, 8, full)
      elif jnp.issubdtype(dt, jnp.unsignedinteger):
        v = rng.randint(0, 15, full)
      elif jnp.issubdtype(dt, jnp.integer):
        v = rng.randint(-15, 15, full)
      else:
        v = rng.randn(*full) * 4
      tree[f"{jnp.dtype(dt).name}{shp}"] = jnp.asarray(v, dt)
  return tree


def tol(dtype):
  return {jnp.dtype(jnp.bfloat16): 6e-2, jnp.dtype(jnp.float16): 6e-3}.get(jnp.dtype(dtype), 1e-5)


def assert_close(got, want):
  for k in want:
    g, w = np.asarray(got[k]), np.asarray(want[k])
    assert g.dtype == w.dtype and g.shape == w.shape, (k, g.dtype, w.dtype, g.shape, w.shape)
    if jnp.issubdtype(w.dtype, jnp.inexact):
      np.testing.assert_allclose(g.astype(np.complex128), w.astype(np.complex128),
                                 rtol=tol(w.dtype), atol=tol(w.dtype) * 8, err_msg=k)
    else:
      np.testing.assert_array_equal(g, w, err_msg=k)


def run_both(mesh, axes, fn, ref_fn, tree, check_vma, out_spec=P()):
  spec = P(tuple(mesh.axis_names))
  per_dev = {k: v.reshape((-1,) + v.shape[2:]) if v.ndim > 1 else v for k, v in tree.items()}
  specs = {k: spec for k in tree}
  outs = {k: out_spec for k in tree}
  def wrap(f):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(specs,), out_specs=outs,
                                 check_vma=check_vma))
  return wrap(fn)(per_dev), wrap(ref_fn)(per_dev)


def _inner(tree):
  return {k: (v[0] if v.ndim == 1 else v) for k, v in tree.items()}


MESHES = [((8,), ("d",)), ((2, 4), ("node", "local")), ((4, 2), ("node", "local")),
          ((8, 1), ("node", "local"))]


def _psum_vs_lax(algorithm, mesh_shape, names, check_vma, tree):
  mesh = mesh_of(mesh_shape, names)
  spec = P(names)
  f = lambda t: jaxring.psum(jax.tree.map(lambda v: v[0], t), names, algorithm=algorithm)
  g = lambda t: lax.psum(jax.tree.map(lambda v: v[0], t), names)
  mk = lambda h: jax.jit(jax.shard_map(h, mesh=mesh, in_specs=(spec,), out_specs=P(),
                                       check_vma=check_vma))
  got, want = mk(f)(tree), mk(g)(tree)
  assert_close(got, want)
  # float64 reference for the f32 leaf
  ref = np.asarray(tree["float32(37,)"], np.float64).sum(0)
  np.testing.assert_allclose(np.asarray(got["float32(37,)"]), ref, rtol=1e-6, atol=1e-5)


@pytest.mark.slow   # every dtype and leaf shape in one tree, per algorithm (~1.5-5 s each)
@pytest.mark.parametrize("algorithm", ALGOS)
def test_psum_matches_lax_every_dtype_and_shape(algorithm):
  _psum_vs_lax(algorithm, (2, 4), ("node", "local"), True, make_tree(0, 8))


SMALL = ["float32(37,)", "bfloat16(5, 7)", "int32(3,)", "bool()", "float16(0,)", "uint8()"]


# the quick loop keeps ring with check_vma on a flat and a two-level mesh (~0.5 s each)
@pytest.mark.parametrize("algorithm", ["ring", pytest.param("hierarchical", marks=pytest.mark.slow),
                                       pytest.param("auto", marks=pytest.mark.slow)])
@pytest.mark.parametrize("mesh_shape,names", [m if m in MESHES[:2] else pytest.param(
    *m, marks=pytest.mark.slow) for m in MESHES])
@pytest.mark.parametrize("check_vma", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_psum_matches_lax_on_meshes(algorithm, mesh_shape, names, check_vma):
  tree = {k: v for k, v in make_tree(0, 8).items() if k in SMALL}
  _psum_vs_lax(algorithm, mesh_shape, names, check_vma, tree)


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical"])
def test_psum_over_one_axis_of_2d_mesh(algorithm):
  mesh = mesh_of((2, 4), ("a", "b"))
  x = jnp.asarray(np.random.RandomState(1).randn(8, 11), jnp.float32)
  for ax in ("a", "b"):
    f = jax.jit(jax.shard_map(lambda v: jaxring.psum(v, ax, algorithm=algorithm), mesh=mesh,
                              in_specs=P(("a", "b")), out_specs=P(("a", "b"))))
    want = jax.jit(jax.shard_map(lambda v: lax.psum(v, ax), mesh=mesh, in_specs=P(("a", "b")),
                                 out_specs=P(("a", "b"))))(x)
    np.testing.assert_allclose(f(x), want, rtol=1e-6, atol=1e-6)


TOPO = jaxring.Topology((jaxring.Level("local", 4), jaxring.Level("node", 2, 1.25e8, 1e-4)))


@pytest.mark.parametrize("check_vma", [True, False])
def test_hierarchical_on_one_axis_split_by_topology(check_vma):
  mesh = mesh_of((8,), ("d",))
  x = jnp.asarray(np.random.RandomState(2).randn(8 * 29), jnp.float32)
  with jaxring.use_topology(TOPO):
    f = jax.jit(jax.shard_map(lambda v: jaxring.psum(v, "d", algorithm="hierarchical"),
                              mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False))
    out = np.asarray(f(x)).reshape(8, 29)
    ref = np.asarray(x, np.float64).reshape(8, 29).sum(0)
    for row in out:
      np.testing.assert_allclose(row, ref, rtol=1e-6, atol=1e-5)
    hlo = f.lower(x).as_text()
  # the node level's groups are devices 4 apart, the local level's contiguous
  assert "[[0, 4], [1, 5], [2, 6], [3, 7]]" in hlo or "source_target_pairs" in hlo


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical"])
def test_identical_on_every_device_and_run_to_run(algorithm):
  mesh = mesh_of((2, 4), ("node", "local"))
  x = jnp.asarray(np.random.RandomState(3).randn(8 * 1001) * 100, jnp.float32)
  f = jax.jit(jax.shard_map(
      lambda v: jaxring.psum(v, ("local", "node"), algorithm=algorithm)[None],
      mesh=mesh, in_specs=P(("node", "local")), out_specs=P(("node", "local")), check_vma=False))
  a = np.asarray(f(x))
  assert all((a[i].view(np.uint32) == a[0].view(np.uint32)).all() for i in range(8))
  b = np.asarray(f(x))
  assert (a.view(np.uint32) == b.view(np.uint32)).all()


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical", "auto"])
def test_pmap_and_pmean(algorithm):
  x = jnp.asarray(np.random.RandomState(4).randn(8, 13), jnp.float32)
  got = jax.pmap(lambda v: jaxring.pmean(v, "i", algorithm=algorithm), axis_name="i")(x)
  want = jax.pmap(lambda v: lax.pmean(v, "i"), axis_name="i")(x)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  ints = jnp.arange(8 * 3, dtype=jnp.int32).reshape(8, 3)
  got = jax.pmap(lambda v: jaxring.pmean(v, "i", algorithm=algorithm), axis_name="i")(ints)
  want = jax.pmap(lambda v: lax.pmean(v, "i"), axis_name="i")(ints)
  assert got.dtype == want.dtype
  np.testing.assert_allclose(got, want)


@pytest.mark.parametrize("algorithm", ALGOS)
def test_constants_and_bools(algorithm):
  mesh = mesh_of((8,), ("d",))
  def f(v):
    return (jaxring.psum(1, "d", algorithm=algorithm), jaxring.psum(2.5, "d", algorithm=algorithm),
            jaxring.psum(v > 0, "d", algorithm=algorithm))
  x = jnp.arange(-4.0, 4.0)
  one, c, b = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P()))(x)
  assert int(one) == 8 and float(c) == 20.0
  assert b.dtype == jnp.int32 and int(b[0]) == 3


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_grad_matches_lax(algorithm, check_vma):
  mesh = mesh_of((2, 4), ("node", "local"))
  x = jnp.asarray(np.random.RandomState(5).randn(8 * 6), jnp.float32)
  def loss(psum_fn):
    def per_dev(v):
      return jnp.sum(psum_fn(v * v, ("local", "node")) * jnp.arange(6.0))
    return lambda v: jax.shard_map(per_dev, mesh=mesh, in_specs=P(("node", "local")),
                                   out_specs=P(), check_vma=check_vma)(v)
  ours = lambda v, a: jaxring.psum(v, a, algorithm=algorithm)
  g = jax.jit(jax.grad(loss(ours)))(x)
  w = jax.jit(jax.grad(loss(lax.psum)))(x)
  np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("algorithm", ["ring",  # hierarchical ~2 s
                                       pytest.param("hierarchical", marks=pytest.mark.slow)])
def test_check_grads(algorithm):
  mesh = mesh_of((8,), ("d",))
  f = jax.jit(jax.shard_map(lambda v: jnp.sin(jaxring.psum(v, "d", algorithm=algorithm)),
                            mesh=mesh, in_specs=P("d"), out_specs=P()))
  x = jnp.asarray(np.random.RandomState(6).randn(16) * 0.1, jnp.float32)
  jtu.check_grads(f, (x,), order=2, modes=("fwd", "rev"), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical"])
def test_vmap_inside_shard_map(algorithm):
  mesh = mesh_of((8,), ("d",))
  x = jnp.asarray(np.random.RandomState(7).randn(8, 5, 3), jnp.float32)
  f = lambda psum_fn: jax.jit(jax.shard_map(jax.vmap(lambda v: psum_fn(v[0], "d")), mesh=mesh,
                                            in_specs=P("d"), out_specs=P(), check_vma=False))
  # the vmapped axis is 1: each device holds one (1, 5, 3) block, vmapped over the 1
  got = f(lambda v, a: jaxring.psum(v, a, algorithm=algorithm))(x.reshape(8, 1, 5, 3))
  want = f(lax.psum)(x.reshape(8, 1, 5, 3))
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_float64_where_enabled():
  mesh = mesh_of((8,), ("d",))
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.RandomState(8).randn(8 * 9), jnp.float64)
    for algo in ("ring", "hierarchical"):
      got = jax.jit(jax.shard_map(lambda v: jaxring.psum(v, "d", algorithm=algo), mesh=mesh,
                                  in_specs=P("d"), out_specs=P()))(x)
      assert got.dtype == jnp.float64
      np.testing.assert_allclose(got, np.asarray(x).reshape(8, 9).sum(0), rtol=1e-14)


@pytest.mark.parametrize("algorithm", ["ring", pytest.param("hierarchical", marks=pytest.mark.slow),
                                       pytest.param("auto", marks=pytest.mark.slow)])  # ~0.3 s each
@pytest.mark.parametrize("tiled,dim,shape", [(False, 0, (8, 5)), (False, 1, (3, 8)),
                                             (True, 0, (24, 2)), (True, 1, (2, 16, 3)),
                                             (True, 1, (3, 8))])
def test_psum_scatter_matches_lax(algorithm, tiled, dim, shape):
  mesh = mesh_of((2, 4), ("node", "local"))
  axes = ("node", "local")
  x = jnp.asarray(np.random.RandomState(9).randint(-9, 9, (8,) + shape), jnp.float32)
  mk = lambda fn: jax.jit(jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh, in_specs=P(axes),
                                        out_specs=P(axes)))
  got = mk(lambda v: jaxring.psum_scatter(v, axes, scatter_dimension=dim, tiled=tiled,
                                          algorithm=algorithm))(x)
  want = mk(lambda v: lax.psum_scatter(v, axes, scatter_dimension=dim, tiled=tiled))(x)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("algorithm", ["ring", pytest.param("hierarchical", marks=pytest.mark.slow),
                                       pytest.param("auto", marks=pytest.mark.slow)])  # ~0.2 s each
@pytest.mark.parametrize("tiled,axis,shape", [(False, 0, (5,)), (False, 1, (3, 2)), (True, 0, (4,)),
                                              (True, 1, (2, 3)), (False, 0, ())])
def test_all_gather_matches_lax(algorithm, tiled, axis, shape):
  mesh = mesh_of((4, 2), ("node", "local"))
  axes = ("node", "local")
  x = jnp.asarray(np.random.RandomState(10).randn(8, *shape), jnp.bfloat16)
  mk = lambda fn: jax.jit(jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh, in_specs=P(axes),
                                        out_specs=P(axes)))
  got = mk(lambda v: jaxring.all_gather(v, axes, axis=axis, tiled=tiled, algorithm=algorithm))(x)
  want = mk(lambda v: lax.all_gather(v, axes, axis=axis, tiled=tiled))(x)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op", ["all_gather", "psum_scatter"])
def test_hierarchical_chunk_order_is_restored_by_slices_not_a_gather(op):
  # the levels (local fast, node slow: TOPO) hand chunks out local-major; member order is
  # node-major. XLA:CPU runs a gather with constant indices element by element (35 ms a call for
  # 8 MiB on the emulated cluster)
  mesh = mesh_of((2, 4), ("node", "local"))
  axes = ("node", "local")
  x = jnp.asarray(np.random.RandomState(12).randint(-9, 9, (8, 1 << 14)), jnp.float32)
  kw = dict(algorithm="hierarchical", compression={"node": jaxring.codecs.int8()})
  ours = (lambda v: jaxring.all_gather(v, axes, tiled=True, **kw)) if op == "all_gather" else (
      lambda v: jaxring.psum_scatter(v, axes, tiled=True, algorithm="hierarchical"))
  ref = (lambda v: lax.all_gather(v, axes, tiled=True)) if op == "all_gather" else (
      lambda v: lax.psum_scatter(v, axes, tiled=True))
  mk = lambda fn: jax.jit(jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh, in_specs=P(axes),
                                        out_specs=P(axes)))
  got = mk(ours)
  with jaxring.use_topology(TOPO):
    np.testing.assert_allclose(got(x), mk(ref)(x), rtol=1e-2, atol=0.1)
    hlo = got.lower(x).compile().as_text()
  assert " gather(" not in hlo, [l for l in hlo.splitlines() if " gather(" in l][:2]


def test_psum_scatter_and_all_gather_split_axis():
  mesh = mesh_of((8,), ("d",))
  x = jnp.asarray(np.random.RandomState(11).randint(-9, 9, (8, 16, 3)), jnp.float32)
  with jaxring.use_topology(TOPO):
    rs = jax.jit(jax.shard_map(lambda v: jaxring.psum_scatter(v[0], "d", tiled=True,
                                                              algorithm="hierarchical")[None],
                               mesh=mesh, in_specs=P("d"), out_specs=P("d")))(x)
    ag = jax.jit(jax.shard_map(lambda v: jaxring.all_gather(v[0], "d", algorithm="hierarchical"),
                               mesh=mesh, in_specs=P("d"), out_specs=P(), check_vma=False))(x)
  np.testing.assert_array_equal(rs.reshape(16, 3), np.asarray(x).sum(0))
  np.testing.assert_array_equal(ag, x)


# ----------------------------------------------------------------------------- errors


def test_unbound_axis_raises_name_error():
  mesh = mesh_of((8,), ("d",))
  for fn in (jaxring.psum, jaxring.pmean, jaxring.all_gather):
    with pytest.raises(NameError, match="unbound axis name: nope"):
      jax.jit(jax.shard_map(lambda v: fn(v, "nope", algorithm="ring"), mesh=mesh,
                            in_specs=P("d"), out_specs=P("d")))(jnp.ones(8))


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical", "xla"])
def test_psum_scatter_shape_errors(algorithm):
  mesh = mesh_of((8,), ("d",))
  run = lambda tiled, n: jax.jit(jax.shard_map(
      lambda v: jaxring.psum_scatter(v, "d", tiled=tiled, algorithm=algorithm), mesh=mesh,
      in_specs=P(), out_specs=P("d")))(jnp.ones(n))
  with pytest.raises(ValueError, match="must be divisible by shard_count 8"):
    run(True, 12)
  with pytest.raises(ValueError, match="must match shard count 8"):
    run(False, 12)


def test_axis_index_groups():
  x = jnp.arange(8.0)
  groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
  got = jax.pmap(lambda v: jaxring.psum(v, "i", axis_index_groups=groups), axis_name="i")(x)
  np.testing.assert_array_equal(got, [6, 6, 6, 6, 22, 22, 22, 22])
  for algo in ("ring", "hierarchical"):
    with pytest.raises(NotImplementedError, match="axis_index_groups is supported only by"):
      jax.pmap(lambda v: jaxring.psum(v, "i", axis_index_groups=groups, algorithm=algo),
               axis_name="i")(x)


def test_bad_arguments():
  mesh = mesh_of((8,), ("d",))
  call = lambda **kw: jax.jit(jax.shard_map(lambda v: jaxring.psum(v, "d", **kw), mesh=mesh,
                                            in_specs=P("d"), out_specs=P()))(jnp.ones(8))
  with pytest.raises(ValueError, match="algorithm must be one of"):
    call(algorithm="tree")
  with pytest.raises(TypeError, match=r"compression must be None, .*codecs.parse\(.int8.\)"):
    call(compression="int8")
  with pytest.raises(ValueError, match="compression names levels \\['nodes'\\]"):
    call(algorithm="ring", compression={"nodes": jaxring.codecs.none()})

  class Lossy(jaxring.codecs.Codec):
    lossy = True
  with pytest.raises(ValueError, match="algorithm='xla' is the native collective and cannot"):
    call(algorithm="xla", compression=Lossy())


def test_per_level_algorithm_dict():
  mesh = mesh_of((2, 4), ("node", "local"))
  n = ring.GATHER_BELOW   # the node ring's shard, n / 4 f32 values, is n bytes: not gathered
  x = jnp.asarray(np.random.RandomState(12).randn(8 * n), jnp.float32)
  f = jax.jit(jax.shard_map(
      lambda v: jaxring.psum(v, ("node", "local"), algorithm={"local": "xla", "node": "ring"}),
      mesh=mesh, in_specs=P(("node", "local")), out_specs=P()))
  np.testing.assert_allclose(f(x), np.asarray(x, np.float64).reshape(8, n).sum(0), rtol=1e-5,
                             atol=1e-5)
  hlo = f.lower(x).as_text()
  assert "reduce_scatter" in hlo and "collective_permute" in hlo
  with pytest.raises(ValueError, match="per-level algorithm keys"):
    jax.jit(jax.shard_map(lambda v: jaxring.psum(v, ("node", "local"), algorithm={"local": "xla"}),
                          mesh=mesh, in_specs=P(("node", "local")), out_specs=P()))(x)


def test_xla_with_lossy_compression_is_refused_by_every_collective():
  mesh = mesh_of((8,), ("d",))
  run = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                                         check_vma=False))(jnp.ones(64))
  for name, fn in [("psum_scatter", lambda v: jaxring.psum_scatter(
                        v, "d", tiled=True, algorithm="xla", compression=jaxring.codecs.int8())),
                   ("all_gather", lambda v: jaxring.all_gather(
                        v, "d", tiled=True, algorithm="xla", compression=jaxring.codecs.int8()))]:
    with pytest.raises(ValueError, match=f"jaxring.{name}: algorithm='xla' is the native"):
      run(fn)


@pytest.mark.parametrize("check_vma", [True, False])
def test_xla_transport_moves_a_payload_of_several_arrays_as_lax_moves_each(check_vma):
  """A codec's payload (values, scales, ...) travels as one message of its bytes: shift and
  all_gather return, bit for bit, what lax.ppermute and lax.all_gather return for each array."""
  from jaxring._src.transport.groups import Group
  from jaxring._src.transport.xla import XLA
  mesh = mesh_of((8,), ("i",))
  group = Group(("i",), 8, 1, 8, "i")
  rng = np.random.RandomState(3)
  payload = (rng.randn(8, 6).astype(np.float32), rng.randint(-128, 128, (8, 6, 4)).astype(np.int8),
             rng.randn(8, 3).astype(jnp.bfloat16), rng.rand(8, 5) > 0.5,
             rng.randint(0, 2**31, (8, 2, 2)).astype(np.uint32), rng.randn(8, 1).astype(np.float16))

  def body(*xs):
    xs = tuple(x[0] for x in xs)
    perm = [(j, (j + 3) % 8) for j in range(8)]
    shifted = XLA.shift(xs, group, 3)
    want_shift = tuple(lax.ppermute(x, "i", perm) for x in xs)
    gathered = XLA.all_gather(xs, group)
    want_gather = tuple(lax.all_gather(x, "i", tiled=True) for x in xs)
    return tuple(v[None] for v in shifted + want_shift + gathered + want_gather)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"),
                            check_vma=check_vma))
  out = f(*payload)
  n = len(payload)
  for k in range(n):
    got, want = out[k], out[n + k]
    assert got.dtype == want.dtype == payload[k].dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    got, want = out[2 * n + k], out[3 * n + k]
    assert got.dtype == want.dtype and got.shape == want.shape == (8, 8 * payload[k].shape[1]) \
        + payload[k].shape[2:]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
