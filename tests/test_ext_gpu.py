"""The CUDA kernels against the CPU references (run with JAX_PLATFORMS=cuda,cpu on a GPU host)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxring._src.ext as ext_pkg
from jaxring._src import ext
from jaxring._src.ext import reference as ref


def _gpu():
  try:
    return jax.devices("gpu")[0]
  except RuntimeError:
    return None


GPU = _gpu()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPU is None, reason="needs a CUDA GPU visible to JAX (tests/conftest.py "
                       "defaults JAX_PLATFORMS to cpu: run with JAX_PLATFORMS=cuda,cpu)"),
    pytest.mark.skipif(not ext_pkg.CUDA_BUILT, reason="jaxring._ext was built without CUDA "
                       "(rebuild with JAXRING_CUDA=on pip install --no-build-isolation -e .)"),
]

# Odd sizes take the kernels' scalar path; multiples of 4 the vector path (16-byte accesses), a
# partial last block included (10**6 + 4 is not a multiple of 256).
SIZES = [0, 1, 255, 257, 10**6 + 3, 4096, 10**6 + 4]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def on_gpu(f, *args):
  return jax.jit(f)(*[jax.device_put(a, GPU) for a in args])  # runs where its inputs are


def on_cpu(f, *args):
  cpu = jax.devices("cpu")[0]
  return jax.jit(f)(*[jax.device_put(a, cpu) for a in args])


def same(a, b):
  a, b = np.asarray(a), np.asarray(b)
  if a.dtype.kind in "fV" or a.dtype == jnp.bfloat16:
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(a32), np.isnan(b32))
    np.testing.assert_array_equal(a32[~np.isnan(a32)], b32[~np.isnan(b32)])
  else:
    np.testing.assert_array_equal(a, b)


def data(n, seed=0):
  rng = np.random.default_rng(seed + n)
  return (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_dequantize(n, dtype, stochastic):
  x = jnp.asarray(data(n)).astype(dtype)
  f = lambda x: ext.quantize_int8(x, 256, stochastic, 11)  # noqa: E731
  for a, b in zip(on_gpu(f, x), on_cpu(lambda x: ref.quantize_int8(x, 256, stochastic, 11), x)):
    same(a, b)
  q, s = on_cpu(lambda x: ext.quantize_int8(x, 256), x)
  same(on_gpu(lambda q, s: ext.dequantize_int8(q, s, 256, dtype), q, s),
       on_cpu(lambda q, s: ref.dequantize_int8(q, s, 256, dtype), q, s))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_ring_hops(n, stochastic):
  q, s = on_cpu(lambda x: ext.quantize_int8(x, 256), data(n))
  p = data(n, 1)
  got = on_gpu(lambda q, s, p: ext.ring_hop_int8(q, s, p, 256, stochastic, 4), q, s, p)
  want = on_cpu(lambda q, s, p: ref.ring_hop_int8(q, s, p, 256, stochastic, 4), q, s, p)
  for a, b in zip(got, want):
    same(a, b)
  same(on_gpu(lambda q, s, p: ext.ring_hop_int8_last(q, s, p, 256), q, s, p), want[0])
  for dtype in DTYPES:
    r = jnp.asarray(data(n, 2)).astype(dtype)
    for a, b in zip(on_gpu(ext.ring_hop_cast, r, p), on_cpu(ref.ring_hop_cast, r, p)):
      same(a, b)


@pytest.mark.parametrize("blocks_per_warp", ["2", "4"])
@pytest.mark.parametrize("n", [8, 256 * 5, 256 * 7 + 8, 10**6 + 4, 4096 * 3])
@pytest.mark.parametrize("block", [64, 256])
def test_quantize_blocks_per_warp(monkeypatch, blocks_per_warp, n, block):
  """JAXRING_CUDA_QUANTIZE_BLOCKS: a warp loads several quantization blocks (one access per lane
  each: bf16/f16 blocks of up to 256 elements, f32 of up to 128) before reducing; the codes and
  scales are those of the reference bit for bit, a group of blocks cut short by the end of the
  input included (5 and 7 blocks of 256; 10**6 + 4 elements: a partial last block), rows of
  several groups (vmap); f32 in blocks of 256 keeps one block a warp."""
  monkeypatch.setenv("JAXRING_CUDA_QUANTIZE_BLOCKS", blocks_per_warp)
  for dtype in DTYPES:
    x = jnp.asarray(data(n)).astype(dtype)
    for stochastic in (False, True):
      f = lambda x: ext.quantize_int8(x, block, stochastic, 7)  # noqa: E731, B023
      want = on_cpu(lambda x: ref.quantize_int8(x, block, stochastic, 7), x)  # noqa: B023
      for a, b in zip(on_gpu(f, x), want):
        same(a, b)
    rows = jnp.stack([x, -x, 3 * x])
    for a, b in zip(on_gpu(jax.vmap(lambda x: ext.quantize_int8(x, block)), rows),
                    on_cpu(jax.vmap(lambda x: ref.quantize_int8(x, block)), rows)):
      same(a, b)


@pytest.mark.parametrize("block", [4, 100, 128, 1000, 1024, 2048])
def test_int8_block_sizes(block):
  """Every register-cache size of the vector paths (4- and 8-wide) and the fallbacks past them."""
  n = 40_000
  x, p = data(n), data(n, 1)
  for xt in (x, x.astype(jnp.bfloat16)):  # 4 f32 or 8 bf16 elements per 16-byte access
    for a, b in zip(on_gpu(lambda x: ext.quantize_int8(x, block, True, 5), xt),
                    on_cpu(lambda x: ref.quantize_int8(x, block, True, 5), xt)):
      same(a, b)
  q, s = on_cpu(lambda x: ext.quantize_int8(x, block), x)
  same(on_gpu(lambda q, s: ext.dequantize_int8(q, s, block), q, s),
       on_cpu(lambda q, s: ref.dequantize_int8(q, s, block), q, s))
  hop = lambda q, s, p: ext.ring_hop_int8(q, s, p, block, True, 4)  # noqa: E731
  for a, b in zip(on_gpu(hop, q, s, p),
                  on_cpu(lambda q, s, p: ref.ring_hop_int8(q, s, p, block, True, 4), q, s, p)):
    same(a, b)


@pytest.mark.parametrize("n", [1000, 1001, 1024])
def test_batched_rows(n):
  """vmap gives the kernels rows: each row's blocks and seed are its own (vector path at 1000;
  at 1024 the blocks tile every row, so dequantize takes its elementwise path over all rows)."""
  x = np.stack([data(n, r) for r in range(3)])
  p = np.stack([data(n, 10 + r) for r in range(3)])
  quant = jax.vmap(lambda x: ext.quantize_int8(x, 256, True, 3))
  for a, b in zip(on_gpu(quant, x), on_cpu(quant, x)):
    same(a, b)
  q, s = on_cpu(jax.vmap(lambda x: ext.quantize_int8(x, 256)), x)
  hop = jax.vmap(lambda q, s, p: ext.ring_hop_int8(q, s, p, 256, True, 4))
  for a, b in zip(on_gpu(hop, q, s, p), on_cpu(hop, q, s, p)):
    same(a, b)
  for dtype in DTYPES:
    deq = jax.vmap(lambda q, s: ext.dequantize_int8(q, s, 256, dtype))  # noqa: B023
    same(on_gpu(deq, q, s), on_cpu(deq, q, s))
  norms = jax.vmap(lambda x: ext.chunk_norms(x, 100))
  np.testing.assert_allclose(on_gpu(norms, x), on_cpu(norms, x), rtol=2e-7)


@pytest.mark.parametrize("n,chunk", [(1, 1), (4097, 4096), (10**6 + 3, 1000), (4096 * 40, 4096),
                                     (10**6 + 4, 1000), (3 * 20_000 + 8, 20_000)])
def test_chunk_kernels(n, chunk):
  x = data(n)
  nc = ext.num_chunks(n, chunk)
  got = np.asarray(on_gpu(lambda x: ext.chunk_norms(x, chunk), x))
  x64 = np.pad(x.astype(np.float64), (0, nc * chunk - n)).reshape(nc, chunk)
  want = np.sqrt((x64 * x64).sum(axis=1)).astype(np.float32)
  assert np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32)).max() <= 1
  idx = np.random.default_rng(n).permutation(nc)[: max(1, nc // 3)].astype(np.int32)
  packed = on_gpu(lambda x, i: ext.gather_chunks(x, i, chunk), x, idx)
  same(packed, ref.gather_chunks(x, idx, chunk))
  same(on_gpu(lambda x, i, p: ext.scatter_add_chunks(x, i, p, chunk), x, idx, packed),
       on_cpu(lambda x, i, p: ref.scatter_add_chunks(x, i, p, chunk), x, idx, packed))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8])
def test_gather_chunks_of_narrow_types(dtype):
  """Chunks of 2- and 1-byte elements: 16-byte copies where a chunk is a multiple of 16 bytes."""
  for n, chunk in [(64 * 1000 + 16, 64), (64 * 1000 + 17, 64), (999, 7)]:
    x = np.clip(data(n) * 10, -127, 127).astype(dtype)
    nc = ext.num_chunks(n, chunk)
    idx = np.random.default_rng(n).permutation(nc)[: max(1, nc // 3)].astype(np.int32)
    same(on_gpu(lambda x, i: ext.gather_chunks(x, i, chunk), x, idx),
         ref.gather_chunks(x, idx, chunk))


# --- fp4 (e2m1): two codes a byte; multiples of 8 take the vector path (8 values a lane access),
# other sizes, odd ones included, the pair-by-pair path

FP4_SIZES = [0, 1, 63, 64, 1001, 10**6 + 3, 4096, 10**6 + 8]


@pytest.mark.parametrize("n", FP4_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_fp4_quantize_dequantize(n, dtype, stochastic):
  x = data(n)
  if n > 10:
    x[7] = np.nan
  x = jnp.asarray(x).astype(dtype)
  f = lambda x: ext.quantize_fp4(x, 64, stochastic, 11)  # noqa: E731
  for a, b in zip(on_gpu(f, x), on_cpu(lambda x: ref.quantize_fp4(x, 64, stochastic, 11), x)):
    same(a, b)
  q, s = on_cpu(lambda x: ref.quantize_fp4(x, 64), x)
  same(on_gpu(lambda q, s: ext.dequantize_fp4(q, s, 64, dtype, n), q, s),
       on_cpu(lambda q, s: ref.dequantize_fp4(q, s, 64, dtype, n), q, s))


@pytest.mark.parametrize("n", FP4_SIZES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_fp4_ring_hops(n, stochastic):
  q, s = on_cpu(lambda x: ref.quantize_fp4(x, 64), data(n))
  p = data(n, 1)
  got = on_gpu(lambda q, s, p: ext.ring_hop_fp4(q, s, p, 64, stochastic, 4), q, s, p)
  want = on_cpu(lambda q, s, p: ref.ring_hop_fp4(q, s, p, 64, stochastic, 4), q, s, p)
  for a, b in zip(got, want):
    same(a, b)
  same(on_gpu(lambda q, s, p: ext.ring_hop_fp4_last(q, s, p, 64), q, s, p), want[0])


@pytest.mark.parametrize("block", [2, 6, 8, 250, 256, 4096])
def test_fp4_block_sizes_and_rows(block):
  """Blocks off the vector path (2, 6, 250: not multiples of 8) and on it, and vmap's rows (1001
  values a row: rows start off any alignment, so the pair path)."""
  x, p = data(40_000), data(40_000, 1)
  for a, b in zip(on_gpu(lambda x: ext.quantize_fp4(x, block, True, 5), x),
                  on_cpu(lambda x: ref.quantize_fp4(x, block, True, 5), x)):
    same(a, b)
  q, s = on_cpu(lambda x: ref.quantize_fp4(x, block), x)
  same(on_gpu(lambda q, s: ext.dequantize_fp4(q, s, block), q, s),
       on_cpu(lambda q, s: ref.dequantize_fp4(q, s, block), q, s))
  for a, b in zip(on_gpu(lambda q, s, p: ext.ring_hop_fp4(q, s, p, block, True, 4), q, s, p),
                  on_cpu(lambda q, s, p: ref.ring_hop_fp4(q, s, p, block, True, 4), q, s, p)):
    same(a, b)
  rows = np.stack([data(1001, r) for r in range(3)])
  quant = jax.vmap(lambda x: ext.quantize_fp4(x, 64, True, 3))
  for a, b in zip(on_gpu(quant, rows), on_cpu(quant, rows)):
    same(a, b)
