"""The kernel wrappers as JAX functions: errors, jit, vmap, grad, loading the extension."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxring._src.ext as ext_pkg
import jaxring._src.ext.loader as ext_loader
from jaxring._src import ext, vma
from jaxring._src.ext import reference as ref

BS = 16


def data(n, seed=0, dtype=jnp.float32):
  x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
  return jnp.asarray(x).astype(dtype)


# --- errors ------------------------------------------------------------------------------------


Z, I8, I32, BF16 = jnp.zeros, jnp.int8, jnp.int32, jnp.bfloat16


def idx(*values):
  return jnp.array(values, I32)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: ext.quantize_int8(Z(4, I32)), TypeError, "x must have dtype float32"),
        (lambda: ext.quantize_int8(Z((2, 4))), ValueError, "x must be a flat 1-D array"),
        (lambda: ext.quantize_int8(Z(4), 0), ValueError, "block_size must be a positive"),
        (lambda: ext.quantize_int8(Z(4), 2.5), TypeError, "block_size must be a static"),
        # was an int64 overflow in the handler's block count, or an MLIR TypeError from 2**63
        (lambda: ext.quantize_int8(Z(4), 2**63 - 1), ValueError, "block_size must be at most"),
        (lambda: ext.quantize_int8(Z(4), 2**63), ValueError, "block_size must be at most"),
        (lambda: ext.dequantize_int8(Z(4, I8), Z(1), 2**40), ValueError,
         "block_size must be at most"),
        (lambda: ext.ring_hop_int8(Z(4, I8), Z(1), Z(4), 2**62), ValueError,
         "block_size must be at most"),
        (lambda: ext.quantize_int8(Z(4), seed=Z(2, jnp.uint32)), TypeError, "seed must be"),
        (lambda: ext.dequantize_int8(Z(4), Z(1), 4), TypeError, "q must have dtype int8"),
        (lambda: ext.dequantize_int8(Z(5, I8), Z(1), 4), ValueError,
         "scales has 1 elements but 5 values in blocks of 4 need 2"),
        (lambda: ext.dequantize_int8(Z(4, I8), Z(1), 4, I32), TypeError, "dtype must be"),
        (lambda: ext.ring_hop_int8(Z(4, I8), Z(1), Z(5), 4), ValueError,
         "partial has 5 elements but q has 4"),
        (lambda: ext.ring_hop_int8(Z(4, I8), Z(1), Z(4, BF16), 4), TypeError,
         "partial must have dtype float32"),
        (lambda: ext.ring_hop_cast(Z(4, I8), Z(4)), TypeError, "recv must have dtype"),
        (lambda: ext.ring_hop_cast_last(Z(3), Z(4)), ValueError, "partial has 4 elements"),
        (lambda: ext.chunk_norms(Z(4, BF16), 2), TypeError, "x must have dtype float32"),
        (lambda: ext.chunk_norms(Z(4), -1), ValueError, "chunk_size must be a positive"),
        (lambda: ext.gather_chunks(Z(4), idx(2), 2), ValueError,
         r"idx\[0\] = 2 is out of range: x has 2 chunks of 2"),
        (lambda: ext.gather_chunks(Z(4), Z(1, jnp.uint32), 2), TypeError,
         "idx must have dtype int32"),
        (lambda: ext.scatter_add_chunks(Z(4), idx(1), Z(3), 2), ValueError,
         "packed has 3 elements but 1 chunks of 2 need 2"),
        (lambda: ext.scatter_add_chunks(Z(4), idx(-1), Z(2), 2), ValueError,
         r"idx\[0\] = -1 is out of range"),
    ],
)
def test_bad_input_raises_before_launch(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_traced_out_of_range_index_is_reported_by_the_kernel():
  f = jax.jit(lambda x, i: ext.gather_chunks(x, i, 2))
  with pytest.raises(Exception, match=r"jaxring_gather_chunks: idx\[1\] = 7 is out of range"):
    jax.block_until_ready(f(Z(6), idx(0, 7)))
  g = jax.jit(lambda x, i, p: ext.scatter_add_chunks(x, i, p, 2))
  with pytest.raises(Exception, match=r"jaxring_scatter_add_chunks: idx\[0\] = -3"):
    jax.block_until_ready(g(Z(6), idx(-3), Z(2)))


def _raw(target, results, *args, **attrs):
  return jax.ffi.ffi_call(target, results)(*args, **attrs)


def _shapes(*specs):
  return tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: _raw("jaxring_quantize_int8", _shapes(((8,), I8), ((3,), jnp.float32)),
                      Z(8), jnp.uint32(0), block_size=np.int64(4), stochastic=False),
         r"jaxring_quantize_int8: scales \(result\) has shape \(3,\) but x has shape \(8,\), "
         r"so it must have shape \(2\)"),
        (lambda: _raw("jaxring_quantize_int8", _shapes(((8,), I8), ((2,), jnp.float32)),
                      Z(8), jnp.uint32(0), block_size=np.int64(0), stochastic=False),
         "jaxring_quantize_int8: block_size must be a positive integer, got 0"),
        (lambda: _raw("jaxring_dequantize_int8", _shapes(((4,), jnp.float32))[0],
                      Z(4, jnp.uint8), Z(1), block_size=np.int64(4)),
         "jaxring_dequantize_int8: q must be int8, got uint8"),
        (lambda: _raw("jaxring_chunk_norms", _shapes(((), jnp.float32))[0],
                      jnp.float32(1), chunk_size=np.int64(4)),
         "jaxring_chunk_norms: x must have rank >= 1"),
        (lambda: _raw("jaxring_ring_hop_cast", _shapes(((4,), jnp.float32), ((4,), jnp.float16)),
                      Z(4, BF16), Z(4)),
         r"jaxring_ring_hop_cast: out \(result\) must be bfloat16, got float16"),
    ],
)
def test_the_handlers_check_operands_themselves(call, match):
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(call())


# --- jit, vmap, grad ---------------------------------------------------------------------------


def test_jit_matches_eager():
  x, p = data(100), data(100, 1)
  q, s = ext.quantize_int8(x, BS)
  eager = ext.ring_hop_int8(q, s, p, BS, stochastic=True, seed=3)
  hop = jax.jit(lambda q, s, p, k: ext.ring_hop_int8(q, s, p, BS, True, k))
  jitted = hop(q, s, p, jnp.uint32(3))
  for a, b in zip(eager, jitted):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_vmap_quantize_and_dequantize_rowwise():
  xs = jnp.stack([data(37, k) * (k + 1) for k in range(4)])
  seeds = jnp.arange(4, dtype=jnp.uint32)
  q, s = jax.vmap(lambda x, k: ext.quantize_int8(x, BS, True, k))(xs, seeds)
  assert q.shape == (4, 37) and s.shape == (4, 3)
  for r in range(4):
    rq, rs = ext.quantize_int8(xs[r], BS, True, int(seeds[r]))
    np.testing.assert_array_equal(np.asarray(q[r]), np.asarray(rq))
    np.testing.assert_array_equal(np.asarray(s[r]), np.asarray(rs))
  y = jax.vmap(lambda a, b: ext.dequantize_int8(a, b, BS, BF16))(q, s)
  want = ext.dequantize_int8(q[2], s[2], BS, BF16)
  np.testing.assert_array_equal(np.asarray(y[2]), np.asarray(want))


def test_vmap_with_unbatched_operands_and_nested():
  q, s = ext.quantize_int8(data(50), BS)
  partials = jnp.stack([data(50, k) for k in range(3)])
  out = jax.vmap(ext.ring_hop_int8, in_axes=(None, None, 0, None))(q, s, partials, BS)
  for r in range(3):
    for a, b in zip(out, ext.ring_hop_int8(q, s, partials[r], BS)):
      np.testing.assert_array_equal(np.asarray(a[r]), np.asarray(b))
  grid = jnp.stack([jnp.stack([data(50, 10 * i + j) for j in range(3)]) for i in range(2)])
  norms = jax.vmap(jax.vmap(lambda x: ext.chunk_norms(x, 7)))(grid)
  assert norms.shape == (2, 3, 8)
  want = ext.chunk_norms(grid[1, 2], 7)
  np.testing.assert_array_equal(np.asarray(norms[1, 2]), np.asarray(want))


def test_vmap_gather_and_scatter_with_batched_indices():
  xs = jnp.stack([data(20, k) for k in range(3)])
  ids = jnp.array([[0, 4], [2, 1], [4, 4]], I32)
  packed = jax.vmap(lambda x, i: ext.gather_chunks(x, i, 4))(xs, ids)
  added = jax.vmap(lambda x, i, p: ext.scatter_add_chunks(x, i, p, 4))(xs, ids, packed)
  for r in range(3):
    want = ref.gather_chunks(xs[r], ids[r], 4)
    np.testing.assert_array_equal(np.asarray(packed[r]), np.asarray(want))
    want = ref.scatter_add_chunks(xs[r], ids[r], packed[r], 4)
    np.testing.assert_array_equal(np.asarray(added[r]), np.asarray(want))
  halves = xs.astype(jnp.float16)
  casts = jax.vmap(ext.ring_hop_cast, in_axes=(0, None))(halves, xs[0])
  want = ref.ring_hop_cast(halves[2], xs[0])[1]
  np.testing.assert_array_equal(np.asarray(casts[1][2]), np.asarray(want))


def test_straight_through_gradient_of_the_round_trip():
  x = data(40)
  g = jax.grad(lambda x: jnp.sum(ext.fake_quantize_int8(x, BS) * jnp.arange(40.0)))(x)
  np.testing.assert_array_equal(np.asarray(g), np.arange(40.0))
  round_trip = lambda x: jnp.sum(ext.fake_quantize_int8(x, BS).astype(jnp.float32))  # noqa: E731
  gb = jax.grad(round_trip)(x.astype(BF16))
  assert gb.dtype == jnp.bfloat16 and np.all(np.asarray(gb, np.float32) == 1)


def test_quantize_alone_is_not_differentiable():
  with pytest.raises(TypeError, match="quantize_int8 is not differentiable; use fake_quantize"):
    jax.grad(lambda x: jnp.sum(ext.quantize_int8(x, BS)[1]))(data(40))


def _reference_grads(f_ext, f_ref, args, argnums):
  shape = jax.eval_shape(f_ref, *args).shape
  w = data(int(np.prod(shape)), 99).reshape(shape)
  got = jax.grad(lambda *a: jnp.sum(f_ext(*a) * w), argnums)(*args)
  want = jax.grad(lambda *a: jnp.sum(f_ref(*a) * w), argnums)(*args)
  return got, want


@pytest.mark.slow   # compiles the gradient of every kernel (~3-5 s)
def test_gradients_match_the_references():
  x, p = data(45), data(45, 1)
  q, s = ext.quantize_int8(x, BS)
  ids = idx(2, 0)
  cases = [  # (function of the differentiated arguments, those arguments, argnums)
      (lambda k, s: k.dequantize_int8(q, s, BS), (s,), 0),
      (lambda k, s, p: k.ring_hop_int8_last(q, s, p, BS), (s, p), (0, 1)),
      (lambda k, r, p: k.ring_hop_cast_last(r, p), (x, p), (0, 1)),
      (lambda k, x: k.chunk_norms(x, 10), (x,), 0),
      (lambda k, x: k.gather_chunks(x, ids, 20), (x,), 0),
      (lambda k, x, v: k.scatter_add_chunks(x, ids, v, 20), (x, data(40, 3)), (0, 1)),
  ]
  for f, args, argnums in cases:
    got, want = _reference_grads(functools.partial(f, ext), functools.partial(f, ref), args,
                                 argnums)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_ring_hop_cast_gradient_is_straight_through():
  r, p = data(8, dtype=jnp.bfloat16), data(8, 1)
  def loss(r, p):
    new_partial, out = ext.ring_hop_cast(r, p)
    return jnp.sum(new_partial) + 2 * jnp.sum(out.astype(jnp.float32))

  dr, dp = jax.grad(loss, (0, 1))(r, p)
  assert dr.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(dp), np.full(8, 3.0))
  np.testing.assert_array_equal(np.asarray(dr, np.float32), np.full(8, 3.0))


def test_chunk_norm_gradient_of_a_zero_chunk_is_zero():
  x = jnp.zeros(8).at[5].set(3.0)
  g = jax.grad(lambda x: jnp.sum(ext.chunk_norms(x, 4)))(x)
  np.testing.assert_array_equal(np.asarray(g), [0, 0, 0, 0, 0, 1, 0, 0])


# --- loading -----------------------------------------------------------------------------------


def test_extension_matches_the_installed_jaxlib_and_registers_every_target():
  import jaxlib

  info = ext_pkg.build_info()
  assert info["jaxlib_version"] == jaxlib.__version__
  targets = ext_pkg.registered_targets()
  # written out, not derived from the table: a target dropped from the build or the table fails
  assert set(targets["cpu"]) == {
      "jaxring_" + name for name in ("quantize_int8", "dequantize_int8", "ring_hop_int8",
                                    "ring_hop_int8_last", "ring_hop_cast", "ring_hop_cast_last",
                                    "chunk_norms", "gather_chunks", "scatter_add_chunks",
                                    "quantize_fp4", "dequantize_fp4", "ring_hop_fp4",
                                    "ring_hop_fp4_last")} | {
      f"jaxring_{name}_at" for name in ("quantize_int8", "ring_hop_int8", "ring_hop_int8_last",
                                        "ring_hop_cast", "ring_hop_cast_last", "quantize_fp4",
                                        "ring_hop_fp4", "ring_hop_fp4_last")}
  assert set(targets["cpu"]) == set(ext_pkg.FFI_TARGETS) | set(ext_pkg.WINDOW_TARGETS)
  # the windowed targets read a chunk of a host buffer in place: CPU only
  assert set(targets["cuda"]) == (set(ext_pkg.FFI_TARGETS) if info["cuda"] else set())


def test_every_kernel_of_the_table_has_its_wrapper_and_every_target_its_reference():
  from jaxring._src.codecs import kernels as codec_kernels
  from jaxring._src.ext import kernels, reference

  assert sorted(kernels.__all__) == sorted(ext_pkg.KERNELS)
  assert sorted(reference.__all__) == sorted(ext_pkg.FFI_KERNELS)
  for name in ext_pkg.KERNELS:
    assert getattr(ext_pkg, name) is getattr(kernels, name) and kernels.__dict__[name].__doc__
  for name in ext_pkg.FFI_KERNELS:
    assert callable(reference.__dict__[name]), name
    assert callable(getattr(codec_kernels.ops(), name)), name


def test_a_mismatched_build_says_what_to_run(monkeypatch):
  import jaxring._ext as native

  monkeypatch.setattr(native, "build_info", lambda: {"jaxlib_version": "0.0.1", "cuda": False})
  with pytest.raises(ImportError, match=r"built against jaxlib 0\.0\.1 .*`make install`.*"
                                        r"`pip install --no-build-isolation --no-deps -e \.`"):
    ext_loader._load_extension()


@pytest.mark.parametrize("module", ["kernels", "chunks"])
def test_docstring_examples(module):
  import doctest
  import importlib

  mod = importlib.import_module(f"jaxring._src.ext.{module}")
  result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0


@pytest.mark.slow   # a fresh process (~1 s)
def test_a_missing_extension_fails_on_kernel_import_but_not_on_reference_import():
  import subprocess
  import sys
  import textwrap

  script = textwrap.dedent("""
      import sys
      sys.modules["jaxring._ext"] = None  # as if it had never been built
      from jaxring._src.ext import reference
      from jaxring._src import ext
      assert not ext.CUDA_BUILT
      for stmt in ("from jaxring._src.ext import quantize_int8", "import jaxring._src.ext.kernels",
                   "ext.gather_chunks"):
          try:
              exec(stmt)
          except ImportError as e:
              assert "make install" in str(e) and "pip install --no-build-isolation" in str(e), e
          else:
              raise AssertionError(stmt + " did not raise")
      print("ok")
  """)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# --- varying manual axes (shard_map with check_vma=True) ----------------------------------------


def in_shard_map(f, *args):
  """f on 8 devices, each with its own row of every argument, vma checked.

  Returns the psum over the devices of each of f's results and the axes each was typed varying over.
  """
  mesh = jax.make_mesh((8,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,))
  spec = jax.sharding.PartitionSpec("i")
  args = [jax.device_put(a, jax.sharding.NamedSharding(mesh, spec)) for a in args]
  vmas = []

  def body(*rows):
    outs = f(*(r[0] for r in rows))
    vmas.extend(vma.varying_axes(o) for o in outs)
    return tuple(jax.lax.psum(o.astype(jnp.float32), "i") for o in outs)

  sums = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec,
                               out_specs=jax.sharding.PartitionSpec(), check_vma=True))(*args)
  return sums, vmas


CALLS = {
    "quantize_int8": lambda k, x, p: k.quantize_int8(x, BS, True, 3),
    "dequantize_int8": lambda k, x, p: (k.dequantize_int8(*ext.quantize_int8(x, BS), BS),),
    "ring_hop_int8": lambda k, x, p: k.ring_hop_int8(*ext.quantize_int8(x, BS), p, BS, True, 1),
    "ring_hop_int8_last": lambda k, x, p: (k.ring_hop_int8_last(*ext.quantize_int8(x, BS), p,
                                                                BS),),
    "ring_hop_cast": lambda k, x, p: k.ring_hop_cast(x.astype(BF16), p),
    "ring_hop_cast_last": lambda k, x, p: (k.ring_hop_cast_last(x.astype(BF16), p),),
    "chunk_norms": lambda k, x, p: (k.chunk_norms(x, 8),),
    "gather_chunks": lambda k, x, p: (k.gather_chunks(x, idx(3, 0), 8),),
    "scatter_add_chunks": lambda k, x, p: (k.scatter_add_chunks(p, idx(1), x[:8], 8),),
}


@pytest.mark.parametrize("name", CALLS)
@pytest.mark.parametrize("module", [ext, pytest.param(ref, marks=pytest.mark.slow)],  # ~0.2 s each
                         ids=["ffi", "reference"])
def test_results_vary_over_the_manual_axes_their_inputs_vary_over(name, module):
  # Per-device inputs (varying over "i") next to invariant constants (seeds, indices): every
  # result is typed varying, so psum adds the 8 devices' results instead of taking one of them
  # 8 times, and equals the sum of the kernels run device by device.
  f = functools.partial(CALLS[name], module)
  xs, ps = data(8 * 40).reshape(8, 40), data(8 * 40, seed=1).reshape(8, 40)
  sums, vmas = in_shard_map(f, xs, ps)
  assert all(v == {"i"} for v in vmas), vmas
  rows = [jax.tree.map(np.asarray, f(xs[d], ps[d])) for d in range(8)]
  for k, got in enumerate(sums):
    want = np.sum([r[k].astype(np.float32) for r in rows], axis=0)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-5)


def test_the_codecs_run_the_reference_where_it_measured_faster(tmp_path, monkeypatch):
  import json

  import jaxring

  from jaxring._src.codecs import kernels as codec_kernels
  from jaxring._src.tools.bench.kernels import save_choice

  monkeypatch.setenv("JAXRING_CACHE_DIR", str(tmp_path))
  codec_kernels._resolve.cache_clear()
  rows = [{"kernel": "quantize_int8 f32", "size_mib": 64, "gbps": 10.0, "xla_reference_gbps": 20.0},
          {"kernel": "quantize_int8 bf16", "size_mib": 64, "gbps": 10.0, "xla_reference_gbps": 30},
          {"kernel": "ring_hop_cast bf16", "size_mib": 64, "gbps": 10.0, "xla_reference_gbps": 10.2},
          {"kernel": "quantize_int8 f32", "size_mib": 1, "gbps": 1.0, "xla_reference_gbps": 5.0}]
  save_choice(rows, "cpu")
  recorded = json.loads((tmp_path / "kernels-cpu.json").read_text())
  assert recorded["use_reference"] == ["quantize_int8"]   # 5% is noise: ring_hop_cast stays
  try:
    ops = codec_kernels.ops()
    assert ops.quantize_int8 is ref.quantize_int8 and ops.ring_hop_cast is ext.ring_hop_cast
    assert "references of ['quantize_int8']" in codec_kernels.backend()
    codec = jaxring.codecs.int8()
    x = jnp.asarray(np.random.default_rng(0).standard_normal(4096), jnp.float32)
    np.testing.assert_array_equal(codec.encode(x, jnp.float32)[0],
                                  ext.quantize_int8(x, 256)[0])   # bit for bit either way
  finally:
    codec_kernels._resolve.cache_clear()
  # another platform's record is not read here
  (tmp_path / "kernels-cpu.json").write_text(json.dumps({"platform": "gpu",
                                                          "use_reference": ["quantize_int8"]}))
  try:
    assert codec_kernels.ops().quantize_int8 is ext.quantize_int8
  finally:
    codec_kernels._resolve.cache_clear()


def test_the_kernel_choice_leaves_out_rows_of_settings_that_do_not_run_by_default(tmp_path,
                                                                                  monkeypatch):
  """``bench kernels`` times the GPU quantize kernel with several quantization blocks a warp
  (JAXRING_CUDA_QUANTIZE_BLOCKS) beside its default; a codec runs the default, so a faster
  variant row must not keep a kernel that lost to its reference as it runs."""
  import json

  from jaxring._src.tools.bench import kernels as bench_kernels

  monkeypatch.setenv("JAXRING_CACHE_DIR", str(tmp_path))
  rows = [{"kernel": "quantize_int8 bf16", "size_mib": 64, "gbps": 10.0,
           "xla_reference_gbps": 20.0},
          {"kernel": f"quantize_int8 bf16, 4 {bench_kernels.VARIANT}", "size_mib": 64,
           "gbps": 30.0, "xla_reference_gbps": 20.0}]
  bench_kernels.save_choice(rows, "cpu")
  recorded = json.loads((tmp_path / "kernels-cpu.json").read_text())
  assert recorded["use_reference"] == ["quantize_int8"]
  assert bench_kernels._blocks_per_warp_cases(None, None, None, 256, 0) == []   # not on a CPU


def test_a_kernel_slower_than_its_reference_at_some_sizes_runs_it_at_the_calls_nearest_those(
    tmp_path, monkeypatch):
  import json

  from jaxring._src.codecs import kernels as codec_kernels
  from jaxring._src.tools.bench.kernels import save_choice

  monkeypatch.setenv("JAXRING_CACHE_DIR", str(tmp_path))
  # as measured on an H200: XLA's fusion 8% ahead at 64 MiB only (within 5% at 256: noise)
  def row(kernel, mib, gbps, xla):
    return {"kernel": kernel, "size_mib": mib, "gbps": gbps, "xla_reference_gbps": xla}
  f32, bf16, last = "dequantize_int8 ->f32", "dequantize_int8 ->bf16", "ring_hop_int8_last"
  rows = [row(f32, 16, 2207, 1520), row(f32, 64, 2370, 2568), row(bf16, 64, 1797, 1420),
          row(f32, 256, 3396, 3401), row(last, 64, 2504, 2765), row(last, 256, 3780, 3859)]
  save_choice(rows, "cpu")
  recorded = json.loads((tmp_path / "kernels-cpu.json").read_text())
  assert recorded["use_reference"] == []
  m = 1 << 18   # f32 elements per MiB
  # every variant must lose at a size: bf16 did not at 64 MiB, so dequantize keeps its kernel there
  assert recorded["reference_by_size"] == {"ring_hop_int8_last": [[64 * m, True], [256 * m, False]]}
  rows[2]["xla_reference_gbps"] = 2000
  save_choice(rows, "cpu")
  recorded = json.loads((tmp_path / "kernels-cpu.json").read_text())
  assert recorded["reference_by_size"]["dequantize_int8"] == [
      [16 * m, False], [64 * m, True], [256 * m, False]]
  codec_kernels._resolve.cache_clear()
  try:
    ops = codec_kernels.ops()
    assert "dequantize_int8's reference at [16777216] elements" in codec_kernels.backend()

    def runs_ffi(n):
      q = jax.ShapeDtypeStruct((n,), jnp.int8)
      s = jax.ShapeDtypeStruct((n // 256,), jnp.float32)
      return "ffi_call" in str(jax.make_jaxpr(lambda q, s: ops.dequantize_int8(q, s, 256))(q, s))
    # nearest by ratio: 16 MiB's choice up to 32 MiB, 64 MiB's from there up to 128 MiB
    assert [runs_ffi(k * m) for k in (1, 16, 31, 33, 64, 127, 129, 1024)] == [
        True, True, True, False, False, False, True, True]
    assert ops.quantize_int8 is ext.quantize_int8     # not measured: the kernel
    q = jnp.asarray(np.random.default_rng(0).integers(-127, 128, 40 * m), jnp.int8)
    s = jnp.asarray(np.random.default_rng(1).random(40 * m // 256), jnp.float32)
    np.testing.assert_array_equal(ops.dequantize_int8(q, s, 256),
                                  ext.dequantize_int8(q, s, 256))   # bit for bit either way
  finally:
    codec_kernels._resolve.cache_clear()
