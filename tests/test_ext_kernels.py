"""The FFI kernels against their pure-jnp references (bit for bit) and float64 NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxring._src import ext
from jaxring._src.ext import reference as ref

BLOCK = 256
SIZES = [0, 1, BLOCK - 1, BLOCK + 1, 3 * BLOCK, 10**6 + 3]
# a jitted reference per size (~0.1-0.3 s each): the quick loop leaves out BLOCK - 1 and 3 * BLOCK
SIZES_QUICK = [n if n in (0, 1, BLOCK + 1, 10**6 + 3) else pytest.param(n, marks=pytest.mark.slow)
               for n in SIZES]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]

# The references are jitted: under jit XLA fuses and rewrites arithmetic, the harder case.
ref_quantize = jax.jit(ref.quantize_int8, static_argnums=(1, 2))
ref_dequantize = jax.jit(ref.dequantize_int8, static_argnums=(2, 3))
ref_hop_int8 = jax.jit(ref.ring_hop_int8, static_argnums=(3, 4))
ref_hop_int8_last = jax.jit(ref.ring_hop_int8_last, static_argnums=(3,))
ref_hop_cast = jax.jit(ref.ring_hop_cast)
ref_hop_cast_last = jax.jit(ref.ring_hop_cast_last)
ref_norms = jax.jit(ref.chunk_norms, static_argnums=(1,))
ref_gather = jax.jit(ref.gather_chunks, static_argnums=(2,))
ref_scatter = jax.jit(ref.scatter_add_chunks, static_argnums=(3,))


def bits(a):
  """The bit pattern of an array, so that NaNs and signed zeros compare exactly."""
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_bits_equal(got, want):
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype and got.shape == want.shape
  if got.dtype.kind == "f" or got.dtype == jnp.bfloat16:
    nan = np.isnan(got.astype(np.float32))
    np.testing.assert_array_equal(nan, np.isnan(want.astype(np.float32)))
    np.testing.assert_array_equal(bits(got)[~nan], bits(want)[~nan])
  else:
    np.testing.assert_array_equal(got, want)


def data(n, dtype=jnp.float32, seed=0):
  """Gaussian data whose scale varies by orders of magnitude from block to block."""
  rng = np.random.default_rng(seed + n)
  x = rng.standard_normal(n) * np.repeat(10.0 ** rng.uniform(-3, 3, n // BLOCK + 1), BLOCK)[:n]
  return jnp.asarray(x.astype(np.float32)).astype(dtype)


def distinct_chunks(n, chunk):
  """A third of the chunks in random order, always including the (partial) last one."""
  nc = ext.num_chunks(n, chunk)
  rest = np.random.default_rng(n).permutation(nc - 1)[: max(0, nc // 3 - 1)]
  return jnp.asarray(np.concatenate([[nc - 1], rest]).astype(np.int32))


@pytest.mark.parametrize("n", SIZES_QUICK)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stochastic", [False,
                                        pytest.param(True, marks=pytest.mark.slow)])  # ~0.1 s each
def test_quantize_matches_reference(n, dtype, stochastic):
  x = data(n, dtype)
  q, s = ext.quantize_int8(x, BLOCK, stochastic=stochastic, seed=1234)
  rq, rs = ref_quantize(x, BLOCK, stochastic, 1234)
  assert q.shape == (n,) and s.shape == (ext.num_blocks(n, BLOCK),)
  assert_bits_equal(q, rq)
  assert_bits_equal(s, rs)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_matches_reference(n, dtype):
  q, s = ext.quantize_int8(data(n), BLOCK)
  assert_bits_equal(ext.dequantize_int8(q, s, BLOCK, dtype), ref_dequantize(q, s, BLOCK, dtype))


@pytest.mark.parametrize("block", [7, 256, 4096])
def test_a_decode_of_4_mib_and_more_streams_the_same_bits(block):
  """f32 outputs past xla_ext/cpu_stream.h's threshold go through an L1 tile and non-temporal
  stores; a partial last block and a row count above one check the edges."""
  x = data(2 * ((1 << 20) // 2 + 3 * block + 5))
  q, s = ext.quantize_int8(x, block)
  assert_bits_equal(ext.dequantize_int8(q, s, block, jnp.float32),
                    ref_dequantize(q, s, block, jnp.float32))
  q2, s2 = (jnp.stack([a, a[::-1]]) for a in (q, s))  # two rows (vmap's batch)
  got = jax.vmap(lambda a, b: ext.dequantize_int8(a, b, block, jnp.float32))(q2, s2)
  assert_bits_equal(got[0], ref_dequantize(q, s, block, jnp.float32))


@pytest.mark.parametrize("block", [1, 7, 32, 256, 4096])
def test_quantize_against_float64_numpy(block):
  n = 5 * block + 3
  x = np.asarray(data(n))
  q, s = ext.quantize_int8(x, block)
  nb = ext.num_blocks(n, block)
  padded = np.zeros(nb * block, np.float64)
  padded[:n] = x
  amax = np.abs(padded.reshape(nb, block)).max(axis=1)
  # scale = amax * RN(1/127), one f32 rounding; within 1 ulp of the exact amax / 127.
  np.testing.assert_array_equal(np.asarray(s), amax.astype(np.float32) * ref.INV_QMAX)
  np.testing.assert_allclose(np.asarray(s), amax / 127.0, rtol=2**-23)
  exact = padded.reshape(nb, block) * (127.0 / amax)[:, None]
  err = np.abs(np.asarray(q, np.float64) - exact.reshape(-1)[:n])
  assert err.max() <= 0.5 + 1e-5  # round to nearest, up to f32 rounding of 127 / amax


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_error_within_half_a_step(dtype):
  n = 20 * BLOCK + 17
  x = data(n, dtype)
  y = ext.dequantize_int8(*ext.quantize_int8(x, BLOCK), BLOCK, jnp.float32)
  x64 = np.asarray(x.astype(jnp.float32), np.float64)
  nb = ext.num_blocks(n, BLOCK)
  amax = np.abs(np.pad(x64, (0, nb * BLOCK - n)).reshape(nb, BLOCK)).max(axis=1)
  bound = np.repeat(amax / 254.0, BLOCK)[:n]
  err = np.abs(np.asarray(y, np.float64) - x64)
  # max|x_block| / 254 per element, plus f32 rounding of the scale and of the product.
  assert np.all(err <= bound * (1 + 2**-20) + 2**-24 * np.abs(x64))


def test_stochastic_rounding_is_unbiased_and_within_one_step():
  x = data(BLOCK)
  s = ext.quantize_int8(x, BLOCK)[1]
  seeds = jnp.arange(400, dtype=jnp.uint32)
  decode = jax.jit(jax.vmap(lambda k: ext.fake_quantize_int8(x, BLOCK, True, k)))
  y = np.asarray(decode(seeds), np.float64)
  step = float(s[0])
  assert np.abs(y - np.asarray(x, np.float64)).max() < step * (1 + 1e-6)
  # The mean of 400 draws of a variable in {lo, lo + step} has std <= step / 40.
  assert np.abs(y.mean(axis=0) - np.asarray(x, np.float64)).max() < 5 * step / 40
  assert len({tuple(r) for r in np.asarray(y[:8])}) == 8  # seeds give different roundings


def constant_blocks(frac, blocks=4096):
  """Blocks of a constant whose code before rounding is 38 + frac, led by a 1.0 that sets the
  scale (127 / max|x| = 127); returns the f32 array and the float64 code of the constant."""
  c = np.float32((38 + frac) / 127)
  x = np.full((blocks, BLOCK), c, np.float32)
  x[:, 0] = 1.0
  return jnp.asarray(x.reshape(-1)), float(np.float64(c) * 127)


def rounded_up(q, v):
  """The rounding decisions (0 down, 1 up) of the constant elements: all but each block's first."""
  q = np.asarray(q, np.float64).reshape(-1, BLOCK)[:, 1:]
  assert set(np.unique(q)) <= {np.floor(v), np.floor(v) + 1}  # never more than one step away
  return q - np.floor(v)


@pytest.mark.parametrize("frac", [0.01, 0.25, 0.5, 0.9])
def test_stochastic_rounding_of_a_constant_converges_to_it(frac):
  x, v = constant_blocks(frac)
  q, s = ext.quantize_int8(x, BLOCK, stochastic=True, seed=7)
  assert np.all(np.asarray(s) == np.float32(1.0) * ref.INV_QMAX)
  d = rounded_up(q, v)
  # Each decision is Bernoulli(frac(v)) (to within 2^-17): the mean of N of them lies within
  # 5 standard deviations of frac(v), sqrt(frac (1 - frac) / N).
  p = v - np.floor(v)
  assert abs(d.mean() - p) < 5 * np.sqrt(p * (1 - p) / d.size) + 2**-16


@pytest.mark.parametrize("lag", [1, 2, 3, 8, BLOCK - 1])
def test_stochastic_rounding_decisions_of_neighbours_are_uncorrelated(lag):
  x, v = constant_blocks(0.5)
  d = rounded_up(ext.quantize_int8(x, BLOCK, stochastic=True, seed=11)[0], v).reshape(-1)
  r = np.corrcoef(d[:-lag], d[lag:])[0, 1]
  assert abs(r) < 5 / np.sqrt(d.size)  # ~1M pairs: 5 sigma of independent decisions


@pytest.mark.parametrize("seed", [0, 12345])
def test_random_bits_are_uniform_in_single_elements_and_in_neighbouring_pairs(seed):
  k = np.asarray(ref.random_bits16(seed, 1 << 20))
  assert k.min() >= 0 and k.max() < 1 << 16
  for lag in (1, 2, 7, 64):  # the top 4 bits of neighbours: 256 cells, ~4096 pairs each
    cells = np.bincount((k[:-lag] >> 12) * 16 + (k[lag:] >> 12), minlength=256)
    expected = (k.size - lag) / 256
    chi2 = np.sum((cells - expected) ** 2 / expected)
    assert chi2 < 255 + 6 * np.sqrt(2 * 255), (lag, chi2)  # 255 dof, 6 sigma
  cells = np.bincount(k >> 8, minlength=256)  # the top 8 bits alone
  assert np.sum((cells - k.size / 256) ** 2 / (k.size / 256)) < 255 + 6 * np.sqrt(2 * 255)


def test_stochastic_rounding_decisions_of_different_seeds_are_uncorrelated():
  x, v = constant_blocks(0.5)
  draws = [rounded_up(ext.quantize_int8(x, BLOCK, stochastic=True, seed=k)[0], v).reshape(-1)
           for k in (0, 1, 2**31)]
  for a, b in [(0, 1), (0, 2), (1, 2)]:
    r = np.corrcoef(draws[a], draws[b])[0, 1]
    assert abs(r) < 5 / np.sqrt(draws[a].size)


def test_zero_tiny_and_non_finite_blocks():
  x = np.array(data(6 * BLOCK))
  x[:BLOCK] = 0.0
  x[BLOCK : 2 * BLOCK] = 1e-25  # below 2^-64: encodes as zeros
  x[2 * BLOCK + 5] = np.nan
  x[3 * BLOCK + 7] = np.inf
  x[4 * BLOCK + 9] = -np.inf
  q, s = ext.quantize_int8(jnp.asarray(x), BLOCK)
  q, s = np.asarray(q).reshape(6, BLOCK), np.asarray(s)
  assert s[0] == 0 and s[1] == 0 and np.all(q[:2] == 0)
  assert np.all(np.isnan(s[2:5])) and np.all(q[2:5] == 0)
  assert np.isfinite(s[5]) and s[5] > 0
  y = np.asarray(ext.dequantize_int8(q.reshape(-1), s, BLOCK)).reshape(6, BLOCK)
  assert np.all(y[:2] == 0)
  assert np.all(np.isnan(y[2:5]))  # the whole block: a non-finite value is never hidden
  assert np.all(np.isfinite(y[5]))
  assert_bits_equal(ext.quantize_int8(jnp.asarray(x), BLOCK)[1],
                    ref_quantize(x, BLOCK, False, 0)[1])


@pytest.mark.parametrize("n", SIZES_QUICK)
@pytest.mark.parametrize("stochastic", [False, True])
def test_ring_hop_int8_matches_reference(n, stochastic):
  q, s = ext.quantize_int8(data(n), BLOCK)
  partial = data(n, seed=1)
  got = ext.ring_hop_int8(q, s, partial, BLOCK, stochastic=stochastic, seed=5)
  for g, w in zip(got, ref_hop_int8(q, s, partial, BLOCK, stochastic, 5)):
    assert_bits_equal(g, w)
  assert_bits_equal(ext.ring_hop_int8_last(q, s, partial, BLOCK),
                    ref_hop_int8_last(q, s, partial, BLOCK))


def test_ring_hop_int8_against_numpy():
  n = 3 * BLOCK + 5
  q, s = ext.quantize_int8(data(n), BLOCK)
  partial = np.asarray(data(n, seed=2))
  new, q2, s2 = ext.ring_hop_int8(q, s, partial, BLOCK)
  decoded = np.asarray(q, np.float32) * np.repeat(np.asarray(s), BLOCK)[:n]
  np.testing.assert_array_equal(np.asarray(new), decoded + partial)  # two f32 roundings
  assert_bits_equal(q2, ext.quantize_int8(new, BLOCK)[0])
  assert_bits_equal(s2, ext.quantize_int8(new, BLOCK)[1])


@pytest.mark.parametrize("n", SIZES_QUICK)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ring_hop_cast_matches_reference(n, dtype):
  recv, partial = data(n, dtype), data(n, seed=3)
  new, out = ext.ring_hop_cast(recv, partial)
  want_new, want_out = ref_hop_cast(recv, partial)
  assert_bits_equal(new, want_new)
  assert_bits_equal(out, want_out)
  assert_bits_equal(ext.ring_hop_cast_last(recv, partial), ref_hop_cast_last(recv, partial))
  want64 = np.asarray(recv.astype(jnp.float32), np.float64) + np.asarray(partial, np.float64)
  np.testing.assert_array_equal(np.asarray(new), want64.astype(np.float32))  # one rounding


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cast_rounding_edge_cases(dtype):
  info = jnp.finfo(dtype)
  # Normal f32 values only: XLA:CPU flushes f32 denormals, NumPy does not.
  specials = [0.0, -0.0, np.inf, -np.inf, np.nan, float(info.max), float(info.max) * 1.01,
              float(info.tiny), float(info.eps) / 2, 1 + float(info.eps) / 2,
              1 + 1.5 * float(info.eps), 65504.0, 65519.0, 65520.0, 2.0**-24, 2.0**-25,
              3 * 2.0**-26, 2.0**-14 - 2.0**-25, 1e-30]
  with np.errstate(over="ignore"):
    p = np.array(specials, np.float32)
    want = p.astype(dtype)  # NumPy's cast rounds to nearest even
  recv = jnp.asarray(np.where(np.signbit(p), -0.0, 0.0).astype(dtype))  # -0 + -0 stays -0
  _, out = ext.ring_hop_cast(recv, jnp.asarray(p))
  assert_bits_equal(out, want)


@pytest.mark.parametrize("n", [0, 1, 4095, 4097, 10**6 + 3])
@pytest.mark.parametrize("chunk", [1, 100, 4096])
def test_chunk_norms(n, chunk):
  x = data(n)
  got = np.asarray(ext.chunk_norms(x, chunk))
  nc = ext.num_chunks(n, chunk)
  x64 = np.pad(np.asarray(x, np.float64), (0, nc * chunk - n)).reshape(nc, chunk)
  want = np.sqrt((x64 * x64).sum(axis=1)).astype(np.float32)
  ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
  assert ulps.max(initial=0) <= 1  # f64 sums: correctly rounded up to the f64 summation error
  np.testing.assert_allclose(got, ref_norms(x, chunk), rtol=2e-6 * max(1, np.log2(chunk)))


def test_chunk_norms_overflow_and_non_finite():
  x = np.full(12, 1e30, np.float32)  # the f32 sum of squares would overflow
  x[8] = np.nan
  x[5] = -np.inf
  got = np.asarray(ext.chunk_norms(x, 4))
  np.testing.assert_allclose(got[0], 2e30, rtol=1e-6)
  assert np.isposinf(got[1]) and np.isnan(got[2])


@pytest.mark.parametrize("n,chunk", [(1, 1), (10, 4), (4096 * 7 + 5, 4096), (10**6 + 3, 1000)])
@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow),
                                   pytest.param(jnp.float16, marks=pytest.mark.slow),  # ~0.1 s each
                                   jnp.int8])
def test_gather_chunks(n, chunk, dtype):
  x = (data(n) * 10).astype(dtype)
  idx = distinct_chunks(n, chunk)
  got = ext.gather_chunks(x, idx, chunk)
  assert_bits_equal(got, ref_gather(x, idx, chunk))
  assert got.shape == (idx.shape[0] * chunk,)


@pytest.mark.parametrize("n,chunk", [(1, 1), (10, 4), (4096 * 7 + 5, 4096), (10**6 + 3, 1000)])
def test_scatter_add_chunks(n, chunk):
  x = data(n)
  idx = distinct_chunks(n, chunk)
  nc = ext.num_chunks(n, chunk)
  packed = data(idx.shape[0] * chunk, seed=9)
  assert_bits_equal(ext.scatter_add_chunks(x, idx, packed, chunk),
                    ref_scatter(x, idx, packed, chunk))
  # Round trip: adding back what was gathered doubles exactly those chunks.
  doubled = ext.scatter_add_chunks(x, idx, ext.gather_chunks(x, idx, chunk), chunk)
  mask = np.zeros(nc * chunk, bool).reshape(nc, chunk)
  mask[np.asarray(idx)] = True
  mask = mask.reshape(-1)[:n]
  np.testing.assert_array_equal(np.asarray(doubled)[mask], 2 * np.asarray(x)[mask])
  np.testing.assert_array_equal(np.asarray(doubled)[~mask], np.asarray(x)[~mask])


def test_scatter_add_duplicates_add_up():
  x = jnp.zeros(8, jnp.float32)
  idx = jnp.array([1, 1, 3], jnp.int32)
  packed = jnp.arange(1.0, 7.0, dtype=jnp.float32)
  got = np.asarray(ext.scatter_add_chunks(x, idx, packed, 2))
  np.testing.assert_array_equal(got, [0, 0, 4, 6, 0, 0, 5, 6])


def test_scatter_add_leaves_an_undonated_input_intact():
  x = data(1000)
  before = np.asarray(x).copy()
  f = jax.jit(lambda v: (ext.scatter_add_chunks(v, jnp.array([0], jnp.int32), jnp.ones(10), 10), v))
  y, same = f(x)
  np.testing.assert_array_equal(np.asarray(x), before)
  np.testing.assert_array_equal(np.asarray(same), before)
  np.testing.assert_array_equal(np.asarray(y)[:10], before[:10] + 1)


def test_split_over_threads_gives_the_same_bits(monkeypatch):
  n = (1 << 22) + 3  # 16 MiB of f32: large enough to be split (parts of >= 4 MiB)
  x, p = data(n), data(n, seed=1)
  q, s = ext.quantize_int8(x, BLOCK)
  calls = [
      lambda: ext.quantize_int8(x, BLOCK, stochastic=True, seed=3),
      lambda: ext.dequantize_int8(q, s, BLOCK, jnp.bfloat16),
      lambda: ext.ring_hop_int8(q, s, p, BLOCK),
      lambda: ext.ring_hop_cast(x.astype(jnp.float16), p),
      lambda: ext.chunk_norms(x, 4096),
      lambda: ext.gather_chunks(x, jnp.arange(0, 1024, 3, dtype=jnp.int32), 4096),
  ]
  monkeypatch.setenv("JAXRING_CPU_THREADS", "1")
  single = [jax.tree.map(np.asarray, f()) for f in calls]
  monkeypatch.setenv("JAXRING_CPU_THREADS", "3")
  for f, want in zip(calls, single):
    for g, w in zip(jax.tree.leaves(f()), jax.tree.leaves(want)):
      assert_bits_equal(g, w)


def test_f16c_and_portable_float16_paths_agree(monkeypatch):
  n = 5 * BLOCK + 7
  x = np.array(data(n, jnp.float16))
  x[3], x[BLOCK + 1], x[2 * BLOCK + 2] = np.nan, np.inf, -np.inf
  x = jnp.asarray(x)
  p = data(n, seed=4) * 1e4  # some sums overflow float16
  q, s = ext.quantize_int8(data(n) * 1e3, BLOCK)
  calls = [
      lambda: ext.quantize_int8(x, BLOCK),
      lambda: ext.quantize_int8(x, BLOCK, stochastic=True, seed=2),
      lambda: ext.dequantize_int8(q, s, BLOCK, jnp.float16),
      lambda: ext.ring_hop_cast(x, p),
  ]
  monkeypatch.setenv("JAXRING_CPU_F16C", "0")
  portable = [jax.tree.map(np.asarray, f()) for f in calls]
  monkeypatch.delenv("JAXRING_CPU_F16C")
  for f, want in zip(calls, portable):
    for g, w in zip(jax.tree.leaves(f()), jax.tree.leaves(want)):
      assert_bits_equal(g, w)
