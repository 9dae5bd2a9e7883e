"""The ring's kernels reading the local chunk in place (jaxring._src.ext.window): the same bits as
the kernels on a slice, at static and traced offsets, the same derivatives, a clear error for a
window outside its buffer, and the ring using them on the CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring._src.codecs import kernels as codec_kernels
from jaxring._src.ext import kernels as K
from jaxring._src.ext import window

BS = 256
N = 4 * BS


def data(n, seed=0, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(n), dtype)


def same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


BASE = data(3 * N + 40, seed=1)
Q, S = K.quantize_int8(data(N, seed=2), BS)
R16 = data(N, seed=3, dtype=jnp.bfloat16)
CASES = {
    "quantize_int8": (lambda b, o: window.quantize_int8(b, o, N, BS),
                      lambda x: K.quantize_int8(x, BS)),
    "ring_hop_int8": (lambda b, o: window.ring_hop_int8(Q, S, b, o, BS),
                      lambda x: K.ring_hop_int8(Q, S, x, BS)),
    "ring_hop_int8_last": (lambda b, o: window.ring_hop_int8_last(Q, S, b, o, BS),
                           lambda x: K.ring_hop_int8_last(Q, S, x, BS)),
    "ring_hop_cast": (lambda b, o: window.ring_hop_cast(R16, b, o),
                      lambda x: K.ring_hop_cast(R16, x)),
    "ring_hop_cast_last": (lambda b, o: window.ring_hop_cast_last(R16, b, o),
                           lambda x: K.ring_hop_cast_last(R16, x)),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("offset", [0, N, 2 * N + 40, 7])   # the last one ends at the buffer's end
def test_a_window_gives_the_bits_of_the_kernel_on_the_slice(name, offset):
  in_place, sliced = CASES[name]
  want = sliced(BASE[offset:offset + N])
  same(in_place(BASE, offset), want)                                  # a static offset
  same(jax.jit(in_place)(BASE, jnp.int32(offset)), want)             # a traced one


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_window_outside_its_buffer_is_an_error_that_says_so(name):
  in_place, _ = CASES[name]
  with pytest.raises(Exception, match=rf"jaxring_{name}_at: the window \[3100, 4124\)"):
    jax.block_until_ready(jax.jit(in_place)(BASE, jnp.int32(3100)))


@pytest.mark.parametrize("name", ["ring_hop_int8_last", "ring_hop_cast", "ring_hop_cast_last"])
def test_a_window_is_differentiated_as_the_slice(name):
  in_place, sliced = CASES[name]
  loss = lambda out: sum(jnp.sum(jnp.sin(o.astype(jnp.float32))) for o in jax.tree.leaves(out))
  got = jax.grad(lambda b: loss(in_place(b, jnp.int32(N))))(BASE)
  want = jax.grad(lambda b: loss(sliced(b[N:2 * N])))(BASE)
  same(got, want)
  assert np.count_nonzero(np.asarray(got)[N:2 * N]) > 0 and not np.any(np.asarray(got)[:N])


def _psum(mesh, algorithm, codec):
  axes, codec = mesh.axis_names, jaxring.codecs.parse(codec)
  return jax.jit(jax.shard_map(
      lambda v: jaxring.psum(v, axes, algorithm=algorithm,
                             compression={axes[0]: codec} if len(axes) > 1 else codec),
      mesh=mesh, in_specs=P(axes), out_specs=P(axes)))


@pytest.mark.parametrize("algorithm", ["ring",  # ~0.3 s each
                                       pytest.param("hierarchical", marks=pytest.mark.slow)])
@pytest.mark.parametrize("codec, targets", [
    ("int8", ("quantize_int8_at", "ring_hop_int8_at", "ring_hop_int8_last_at")),
    ("bf16", ("ring_hop_cast_at", "ring_hop_cast_last_at")),
    # seeded from the chunk: sliced
    pytest.param("int8:256:stochastic", ("ring_hop_int8_last_at",), marks=pytest.mark.slow),
    # f32 as it is: the add in place, no fusion per hop
    pytest.param("none", ("ring_hop_cast_last_at",), marks=pytest.mark.slow),
])
def test_the_ring_reads_its_chunks_in_place_with_the_same_result(monkeypatch, algorithm, codec,
                                                                 targets):
  shape, names = ((8,), ("i",)) if algorithm == "ring" else ((4, 2), ("node", "local"))
  mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(shape))
  x = jax.device_put(data(8 * 64 * BS, seed=4), jax.NamedSharding(mesh, P(names)))
  if codec == "none" and algorithm == "hierarchical":
    targets = ()   # one process: the in-process levels and the native all-reduce, no ring hop
  f = _psum(mesh, algorithm, codec)
  hlo = f.lower(x).as_text()
  assert all(f"jaxring_{t}" in hlo for t in targets), targets
  if "stochastic" in codec:
    assert "jaxring_quantize_int8_at" not in hlo and "jaxring_ring_hop_int8_at" not in hlo
  got = np.asarray(f(x))
  monkeypatch.setattr(codec_kernels, "in_place", lambda *a, **k: None)
  sliced = _psum(mesh, algorithm, codec)
  assert "_at\"" not in sliced.lower(x).as_text()
  np.testing.assert_array_equal(got, np.asarray(sliced(x)))
  want = np.asarray(x, np.float64).reshape(8, -1).sum(0)
  for row in got.reshape(8, -1):
    np.testing.assert_allclose(row, want, rtol=0, atol=0.05 * np.abs(want).max())


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_window_under_vmap_is_the_kernel_on_each_row(name):
  in_place, sliced = CASES[name]
  bases = jnp.stack([BASE, BASE[::-1], 2 * BASE])
  offsets = jnp.array([0, N, 7], jnp.int32)
  got = jax.vmap(in_place)(bases, offsets)
  for i, (b, o) in enumerate(zip(bases, [0, N, 7])):
    same(jax.tree.map(lambda a, i=i: a[i], got), sliced(b[o:o + N]))
