"""The in-process transport (shared-memory custom calls) against lax, on 8 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring._src.transport import inprocess
from jaxring._src.transport.groups import Group

pytestmark = pytest.mark.skipif(not inprocess.available(), reason="needs the CPU extension")

AXES = ("node", "local")


def _mesh():
  return jax.make_mesh((2, 4), AXES, axis_types=(jax.sharding.AxisType.Explicit,) * 2)


def _run(fn, x, check_vma=True, out=P(AXES)):
  mesh = _mesh()
  x = jax.device_put(x, jax.NamedSharding(mesh, P(AXES)))
  got = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(AXES), out_specs=out,
                              check_vma=check_vma))(x)
  return tuple(map(np.asarray, got)) if isinstance(got, tuple) else np.asarray(got)


LOCAL = Group(("local",), 4, 1, 4, "local")


@pytest.mark.parametrize("check_vma", [True, False])
def test_reduce_scatter_and_all_gather_match_lax(check_vma):
  x = jnp.asarray(np.random.default_rng(0).standard_normal(8 * 1024), jnp.float32)
  got = _run(lambda v: inprocess.reduce_scatter(v, LOCAL), x, check_vma)
  want = _run(lambda v: jax.lax.psum_scatter(v, "local", tiled=True), x, check_vma)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  for dtype in (jnp.float32, jnp.int8, jnp.bfloat16):
    y = x.astype(dtype)
    got = _run(lambda v: inprocess.all_gather((v,), LOCAL)[0], y, check_vma)
    want = _run(lambda v: jax.lax.all_gather(v, "local", tiled=True), y, check_vma)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rows", [4, pytest.param(8, marks=pytest.mark.slow),  # ~3 s, ~5 s
                                  pytest.param(12, marks=pytest.mark.slow)])
def test_row_orders_are_read_and_written_in_place(rows):
  """``order`` equals permuting a copy: before the reduce-scatter, after the all-gather."""
  from jaxring._src.algorithms.base import permute_flat
  order = np.random.default_rng(rows).permutation(rows)
  x = jnp.asarray(np.random.default_rng(1).standard_normal(8 * rows * 6), jnp.float32)
  got = _run(lambda v: inprocess.reduce_scatter(v, LOCAL, order=order), x)
  want = _run(lambda v: jax.lax.psum_scatter(permute_flat(v, order), "local", tiled=True), x)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  for dtype in (jnp.float32, jnp.int8, jnp.bfloat16):
    y = x.astype(dtype)
    got = _run(lambda v: inprocess.all_gather((v, v[:rows // 4]), LOCAL, order=order), y,
               out=(P(AXES), P(AXES)))
    want = _run(lambda v: tuple(permute_flat(jax.lax.all_gather(a, "local", tiled=True), order)
                                for a in (v, v[:rows // 4])), y, out=(P(AXES), P(AXES)))
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("wire", ["int8", pytest.param("bfloat16", marks=pytest.mark.slow),
                                  pytest.param("float16", marks=pytest.mark.slow)])  # ~1 s each
def test_gather_and_decode_in_one_pass_equals_decoding_the_gathered_payload(wire):
  from jaxring._src.algorithms.base import permute_flat
  rows, bs = 8, 32
  order = np.random.default_rng(3).permutation(rows)
  x = np.random.default_rng(2).standard_normal(8 * rows * bs).astype(np.float32)
  x[5] = np.inf  # a non-finite int8 block decodes to NaN everywhere
  int8 = jaxring.codecs.int8(bs)

  def encode(v):
    return int8.encode(v, jnp.float32) if wire == "int8" else (v.astype(wire),)

  def decode(payload):
    return int8.decode(payload, jnp.float32) if wire == "int8" else payload[0].astype(jnp.float32)
  got = _run(lambda v: inprocess.all_gather_decode(encode(v), LOCAL, block_size=bs, order=order),
             jnp.asarray(x))
  want = _run(lambda v: decode(tuple(permute_flat(a, order)
                                     for a in inprocess.all_gather(encode(v), LOCAL))),
              jnp.asarray(x))
  np.testing.assert_array_equal(got, want)


@pytest.mark.slow   # reduces outputs of 4 MiB and more (~15 s)
def test_outputs_of_4_mib_and_more_are_streamed_with_the_same_values():
  """Past xla_ext/cpu_stream.h's threshold the copies and decodes go through L1 tiles and
  non-temporal stores; rows whose length is no multiple of the tile check the tails."""
  from jaxring._src.algorithms.base import permute_flat
  rows, bs = 8, 32
  order = np.random.default_rng(5).permutation(rows)
  n = 2 * (2048 * 70 + 96)  # per device: 4 members x n f32 = 4.4 MiB gathered
  x = jnp.asarray(np.random.default_rng(6).standard_normal(8 * n), jnp.float32)
  int8 = jaxring.codecs.int8(bs)
  got = _run(lambda v: inprocess.all_gather_decode(int8.encode(v, jnp.float32), LOCAL,
                                                  block_size=bs, order=order), x)
  want = _run(lambda v: int8.decode(tuple(permute_flat(a, order) for a in inprocess.all_gather(
      int8.encode(v, jnp.float32), LOCAL)), jnp.float32), x)
  np.testing.assert_array_equal(got, want)
  got = _run(lambda v: inprocess.all_gather_decode((v.astype(jnp.bfloat16),), LOCAL), x)
  want = _run(lambda v: jax.lax.all_gather(v.astype(jnp.bfloat16), "local", tiled=True).astype(
      jnp.float32), x)
  np.testing.assert_array_equal(got, want)
  got = _run(lambda v: inprocess.all_gather((v,), LOCAL, order=order)[0], x)
  want = _run(lambda v: permute_flat(jax.lax.all_gather(v, "local", tiled=True), order), x)
  np.testing.assert_array_equal(got, want)
  big = jnp.asarray(np.random.default_rng(7).standard_normal(8 * 4 * (1 << 20) + 8 * 4 * 96),
                    jnp.float32)  # 4 MiB and a tail per member's share
  got = _run(lambda v: inprocess.reduce_scatter(v, LOCAL), big)
  want = _run(lambda v: jax.lax.psum_scatter(v, "local", tiled=True), big)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_an_order_that_is_not_a_permutation_of_whole_rows_is_refused():
  x = jnp.zeros(8 * 12, jnp.float32)
  for order, what in (([0, 1, 2, 3, 4], "do not split"), ([0, 1, 2, 9], "names row 9")):
    with pytest.raises(Exception, match=what):
      _run(lambda v: inprocess.reduce_scatter(v, LOCAL, order=order), x)


@pytest.mark.slow   # compiles and runs a loop of calls (~3 s)
def test_a_call_inside_a_loop_meets_again_every_iteration():
  x = jnp.arange(8 * 64, dtype=jnp.float32) % 7

  def body(v):
    def step(i, acc):
      return acc + jnp.tile(inprocess.reduce_scatter(v + i, LOCAL), 4)
    return jax.lax.fori_loop(0, 25, step, jnp.zeros_like(v))

  def ref(v):
    def step(i, acc):
      return acc + jnp.tile(jax.lax.psum_scatter(v + i, "local", tiled=True), 4)
    return jax.lax.fori_loop(0, 25, step, jnp.zeros_like(v))
  for _ in range(3):   # and again, in new executions
    np.testing.assert_array_equal(_run(body, x), _run(ref, x))


def test_split_axis_groups_and_hierarchical_psum_match_lax():
  topo = jaxring.Topology((jaxring.Level("local", 4), jaxring.Level("node", 2, 1e8, 1e-4)))
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
  x = jax.device_put(jnp.arange(8 * 4096, dtype=jnp.float32) % 11,
                     jax.NamedSharding(mesh, P("d")))
  run = lambda fn: np.asarray(jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"),
                                                    out_specs=P()))(x))
  with jaxring.use_topology(topo):
    hlo = jax.jit(jax.shard_map(lambda v: jaxring.psum(v, "d", algorithm="hierarchical"),
                                mesh=mesh, in_specs=P("d"), out_specs=P())).lower(x).as_text()
    assert "jaxring_local_reduce_scatter" in hlo
    got = run(lambda v: jaxring.psum(v, "d", algorithm="hierarchical"))
  np.testing.assert_array_equal(got, run(lambda v: jax.lax.psum(v, "d")))


def test_a_member_that_never_arrives_is_named(monkeypatch):
  monkeypatch.setenv("JAXRING_INPROCESS_TIMEOUT", "2")
  x = jnp.ones(8 * 64, jnp.float32)

  def body(v):
    skip = jax.lax.axis_index("local") == 0
    return jax.lax.cond(skip, lambda u: u[:16] * 0,
                        lambda u: inprocess.reduce_scatter(u, LOCAL), v)
  # member 0 is named (on a loaded machine a slow member may be named beside it, or be the one
  # whose error XLA reports: it arrived after its group gave up)
  with pytest.raises(Exception, match=r"member\(s\) \[0[\],][^\]]*\]? of 4 never arrived|"
                                      r"arrived after its group gave up"):
    _run(body, x)
  # the process goes on: the next collective meets normally
  np.testing.assert_array_equal(_run(lambda v: inprocess.reduce_scatter(v, LOCAL), x),
                                np.full(8 * 16, 4.0, np.float32))


@pytest.mark.parametrize("codec", [pytest.param(jaxring.codecs.int8(block_size=64),  # ~1.5 s
                                                marks=pytest.mark.slow), jaxring.codecs.bf16()],
                         ids=["int8", "bf16"])
def test_hierarchical_all_reduce_gathers_in_shared_memory_to_the_same_bits(codec):
  """The all-gather phase's local level runs in shared memory with check_vma False and True (where
  it types the result invariant). Same reduce-scatter, same node ring, the payload decoded at the
  end either way: the same bits, on every device, and within the codec's error of the exact sum."""
  x = np.random.RandomState(7).randn(8 * 4096).astype(np.float32)

  def f(v):
    return jaxring.psum(v, ("local", "node"), algorithm="hierarchical",  # fast level first
                        compression={"node": codec})

  early, late = (_run(f, x, check_vma=c) for c in (False, True))
  rows = early.reshape(8, -1)
  assert (early.view(np.uint32) == late.view(np.uint32)).all()
  assert all((r.view(np.uint32) == rows[0].view(np.uint32)).all() for r in rows)
  exact = x.astype(np.float64).reshape(8, -1).sum(0)
  err = np.abs(rows[0] - exact).max()
  assert 0 < err < 0.05 * np.abs(exact).max()


@pytest.mark.parametrize("codec", [None, pytest.param(jaxring.codecs.int8(block_size=64),  # ~2 s
                                                      marks=pytest.mark.slow)],
                         ids=["none", "int8"])
def test_check_vma_all_reduce_returns_invariant_from_shared_memory(codec):
  """Under check_vma=True a hierarchical psum whose fast level is in-process ends in shared
  memory too, typed invariant: shard_map returns it with out_specs=P(), no all-gather over the
  local level is compiled, and the value is check_vma=False's to the bit (and lax.psum's without a codec)."""
  x = np.random.RandomState(3).randn(8 * 1024).astype(np.float32)
  comp = None if codec is None else {"node": codec}

  def f(v):
    return jaxring.psum(v, ("local", "node"), algorithm="hierarchical", compression=comp)

  mesh = _mesh()
  xs = jax.device_put(x, jax.NamedSharding(mesh, P(AXES)))
  step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(AXES), out_specs=P(), check_vma=True))
  hlo = step.lower(xs).compile().as_text()
  local_gathers = [ln for ln in hlo.splitlines() if " all-gather(" in ln and
                   "replica_groups={{0,1,2,3},{4,5,6,7}}" in ln]
  assert not local_gathers and "jaxring_local_all_gather" in hlo
  got = np.asarray(step(xs))
  free = _run(f, x, check_vma=False).reshape(8, -1)
  assert (got.view(np.uint32) == free[0].view(np.uint32)).all()
  exact = x.astype(np.float64).reshape(8, -1).sum(0)
  if codec is None:
    want = _run(lambda v: jax.lax.psum(v, AXES), x, out=P()).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
  else:
    assert 0 < np.abs(got - exact).max() < 0.05 * np.abs(exact).max()


@pytest.mark.slow   # runs programs that meet in opposite orders (~6 s)
def test_members_that_reach_independent_calls_in_opposite_orders_all_complete():
  # Devices of one process may reach two independent collectives in different orders (XLA:CPU
  # runs each device's operations as they become ready). Here half the members have the gather's
  # input at once and the reduce-scatter's after a chain of matrix products, the other half the
  # other way round. A member that held its thread while it waited for its peers kept its device
  # from ever reaching the other call, in which those peers waited: a deadlock.
  x = jnp.arange(8 * 4096, dtype=jnp.float32) % 13
  m = jnp.eye(64, dtype=jnp.float32) * 0.5 + 0.01

  def chain(u):
    y = u.reshape(64, 64)
    for _ in range(6):   # separate operations, each a step the device must take first
      y = jnp.tanh(y @ m)
    return y.reshape(-1)

  def inputs(v):
    even = jax.lax.axis_index("local") % 2 == 0
    return (jax.lax.cond(even, lambda u: u, chain, v), jax.lax.cond(even, chain, lambda u: u, v))

  def got(v):
    a, b = inputs(v)
    g, s = inprocess.all_gather((a,), LOCAL)[0], inprocess.reduce_scatter(b, LOCAL)
    return g[: v.shape[0]] + jnp.tile(s, 4)

  def ref(v):
    a, b = inputs(v)
    g, s = jax.lax.all_gather(a, "local", tiled=True), jax.lax.psum_scatter(b, "local", tiled=True)
    return g[: v.shape[0]] + jnp.tile(s, 4)
  for _ in range(3):
    np.testing.assert_allclose(_run(got, x), _run(ref, x), rtol=1e-6)


@pytest.mark.slow   # compiles and calls several programs (~5 s)
def test_a_jitted_function_called_twice_meets_once_per_call():
  # JAX traces and lowers a jitted function once, so its two calls in one program hold the same
  # custom call twice; XLA may run them at once, each device in its own order. Each call meets
  # its own members (the call site is the instruction, not the trace), with its own operands.
  x = jnp.asarray(np.random.default_rng(3).standard_normal(8 * 2048), jnp.float32)
  inner = jax.jit(lambda u: jaxring.psum(u, AXES, algorithm={"local": "inprocess", "node": "ring"}))
  mesh = _mesh()
  hlo = jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=P(AXES), out_specs=P())).lower(
      jax.device_put(x, jax.NamedSharding(mesh, P(AXES)))).as_text()
  assert "jaxring_local_reduce_scatter" in hlo   # the shared-memory level, not XLA's collectives

  def both(v):
    return inner(v) + 1000 * inner(v[::-1] * 3)

  def ref(v):
    return jax.lax.psum(v, AXES) + 1000 * jax.lax.psum(v[::-1] * 3, AXES)
  for _ in range(5):
    np.testing.assert_allclose(_run(both, x, out=P()), _run(ref, x, out=P()), rtol=1e-5,
                               atol=1e-2)
