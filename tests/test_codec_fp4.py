"""The fp4 (e2m1) block codec: its kernels against the jnp references bit for bit and the
references against a float64 NumPy definition of e2m1 rounding; the codec on the ring and on a
hierarchical level within its documented bound of a float64 mean; error feedback losing nothing,
and a compressed train step converging like the uncompressed one.

The bound: an element whose partial sums round the ring are S_1..S_p (S_p the total, encoded
once more for the all-gather) errs by at most sum_j max|S_j over its block| / 6 (/ 3 stochastic).
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import jaxring
import jaxring.train as jt
from jaxring import codecs
from jaxring._src.codecs import base
from jaxring._src.codecs import kernels as codec_kernels
from jaxring._src.ext import reference as ref

ext = pytest.importorskip("jaxring._src.ext.kernels", reason="the native extension is not built")
from jaxring._src.ext import window  # noqa: E402

AUTO = AxisType.Auto
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def data(n, seed=0):
  rng = np.random.default_rng(seed + n)
  return (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)).astype(np.float32)


def same(a, b):
  """Equal bits (NaN where NaN), for arrays of any dtype."""
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
  if a.dtype.kind == "f" or a.dtype == jnp.bfloat16:
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(a32), np.isnan(b32))
    ok = ~np.isnan(a32)
    np.testing.assert_array_equal(a32[ok].view(np.uint32), b32[ok].view(np.uint32))
  else:
    np.testing.assert_array_equal(a, b)


def unpack(q, n):
  q = np.asarray(q).astype(np.int64)
  return np.stack([q & 15, q >> 4], axis=1).reshape(-1)[:n]


# --- kernels ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 63, 65, 1001, 4096 + 2])
@pytest.mark.parametrize("block", [2, 64, 250])
@pytest.mark.parametrize("stochastic", [False, True])
def test_kernels_match_the_references_bit_for_bit(n, block, stochastic):
  x = data(n)
  if n > 10:
    x[3] = np.inf   # a non-finite block among finite ones
  p = data(n, 1)
  for dtype in DTYPES:
    xd = jnp.asarray(x).astype(dtype)
    got = jax.jit(lambda v: ext.quantize_fp4(v, block, stochastic, 7))(xd)  # noqa: B023
    want = ref.quantize_fp4(xd, block, stochastic, 7)
    for a, b in zip(got, want, strict=True):
      same(a, b)
    q, s = want
    same(jax.jit(lambda q, s: ext.dequantize_fp4(q, s, block, dtype, n))(q, s),  # noqa: B023
         ref.dequantize_fp4(q, s, block, dtype, n))
  q, s = ref.quantize_fp4(x, block)
  hop = jax.jit(lambda q, s, p: ext.ring_hop_fp4(q, s, p, block, stochastic, 3))
  want = ref.ring_hop_fp4(q, s, p, block, stochastic, 3)
  for a, b in zip(hop(q, s, p), want, strict=True):
    same(a, b)
  same(jax.jit(lambda q, s, p: ext.ring_hop_fp4_last(q, s, p, block))(q, s, p), want[0])


@pytest.mark.parametrize("n,block", [(4096 + 34, 64), (1001, 250), (96, 96)])
def test_the_avx2_and_portable_cpu_paths_agree(monkeypatch, n, block):
  """xla_ext/cpu_fp4_v3.cc against the portable loops (JAXRING_CPU_FP4_V3=0), bit for bit: whole
  steps of 32 values and the tails after them, non-finite and zero blocks included."""
  x = data(n)
  x[5], x[block:2 * block] = np.nan, 0.0
  p = data(n, 1)
  q, s = ref.quantize_fp4(data(n, 2), block)
  calls = [lambda: ext.quantize_fp4(x, block), lambda: ext.quantize_fp4(x, block, True, 9),
           lambda: ext.dequantize_fp4(q, s, block, n=n),
           lambda: ext.ring_hop_fp4(q, s, p, block),
           lambda: ext.ring_hop_fp4(q, s, p, block, True, 4),
           lambda: ext.ring_hop_fp4_last(q, s, p, block)]
  monkeypatch.setenv("JAXRING_CPU_FP4_V3", "0")
  portable = [jax.tree.map(np.asarray, f()) for f in calls]
  monkeypatch.delenv("JAXRING_CPU_FP4_V3")
  for f, want in zip(calls, portable, strict=True):
    for a, b in zip(jax.tree.leaves(f()), jax.tree.leaves(want), strict=True):
      same(a, b)


def test_batched_rows_and_the_windowed_targets():
  rows = np.stack([data(1001, r) for r in range(3)])
  for a, b in zip(jax.vmap(lambda v: ext.quantize_fp4(v, 64, True, 2))(rows),
                  jax.vmap(lambda v: ref.quantize_fp4(v, 64, True, 2))(rows), strict=True):
    same(a, b)
  base_ = jnp.asarray(data(2000))
  lo, n = 256, 640
  chunk = base_[lo:lo + n]
  q, s = ref.quantize_fp4(data(n, 5), 64)
  off = jnp.int32(lo)
  for a, b in zip(jax.jit(lambda b, o: window.quantize_fp4(b, o, n, 64))(base_, off),
                  ref.quantize_fp4(chunk, 64), strict=True):
    same(a, b)
  for a, b in zip(jax.jit(lambda b, o: window.ring_hop_fp4(q, s, b, o, n, 64))(base_, off),
                  ref.ring_hop_fp4(q, s, chunk, 64), strict=True):
    same(a, b)
  same(jax.jit(lambda b, o: window.ring_hop_fp4_last(q, s, b, o, n, 64))(base_, off),
       ref.ring_hop_fp4_last(q, s, chunk, 64))
  with pytest.raises(Exception, match="not inside base"):
    jax.jit(lambda b, o: window.ring_hop_fp4_last(q, s, b, o, n, 64))(base_, jnp.int32(1500))


def test_the_reference_rounds_to_the_nearest_e2m1_value_ties_to_even():
  """Against float64 NumPy: every scaled value to its nearest grid point, a tie to the one of even
  magnitude code (even mantissa), the sign kept but for zero; each midpoint and its float
  neighbours included."""
  mids = (E2M1[1:] + E2M1[:-1]) / 2
  v = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, 7), E2M1,
                      np.random.default_rng(0).uniform(0, 6, 4000)]).astype(np.float32)
  v = np.concatenate([v, -v, [6.0]])   # the block's largest is 6: inv = 1, the values as they are
  q, s = ref.quantize_fp4(v, v.size + v.size % 2)
  assert float(s[0]) == np.float32(6.0) * ref.FP4_SCALE_MUL
  dist = np.abs(np.abs(v.astype(np.float64))[:, None] - E2M1[None])
  nearest = dist == dist.min(1, keepdims=True)
  tie = nearest.sum(1) > 1        # two neighbours: the even magnitude code wins
  mag = np.where(tie, np.argmax(nearest & (np.arange(8) % 2 == 0), axis=1),
                 np.argmax(nearest, axis=1))
  want = np.where((v < 0) & (mag > 0), mag | 8, mag)
  np.testing.assert_array_equal(unpack(q, v.size), want)
  # decoding is value * scale, one rounding
  decoded = ref.dequantize_fp4(q, s, v.size + v.size % 2, n=v.size)
  np.testing.assert_array_equal(np.asarray(decoded), ref.FP4_VALUES[want] * np.asarray(s)[0])


def test_round_trip_within_its_bounds_and_stochastic_rounding_unbiased():
  x = data(64 * 512)
  blocks = np.abs(x.astype(np.float64)).reshape(-1, 64).max(1)
  q, s = ext.quantize_fp4(x, 64)
  err = np.abs(np.asarray(ext.dequantize_fp4(q, s, 64), np.float64) - x).reshape(-1, 64)
  assert (err <= blocks[:, None] / 6 * (1 + 1e-6)).all()
  big = np.abs(x).reshape(-1, 64) >= blocks[:, None] / 6   # a fifth of themselves from amax/6 on
  assert (err[big] <= np.abs(x).reshape(-1, 64)[big] / 5 * (1 + 1e-6)).all()
  # a constant between two grid points (3.3 of 6 scale units) averages to itself, per binade
  for frac in (0.3, 1.3, 2.6, 4.9):
    v = np.tile(np.array([6.0] + [frac] * 63, np.float32), 4096)
    qs, ss = ext.quantize_fp4(v, 64, stochastic=True, seed=11)
    dec = np.asarray(ext.dequantize_fp4(qs, ss, 64), np.float64).reshape(-1, 64)[:, 1:]
    assert abs(dec.mean() - frac) < 4 * dec.std() / np.sqrt(dec.size) + 1e-6, frac
    lo, hi = E2M1[E2M1 <= frac].max(), E2M1[E2M1 >= frac].min()   # only the two neighbours
    units = np.unique(dec) / float(ss[0])
    assert np.isclose(units[:, None], [lo, hi], rtol=1e-6).any(1).all() and len(units) == 2


def test_zero_tiny_and_non_finite_blocks_and_no_inf_from_finite_values():
  f32max = float(np.finfo(np.float32).max)
  x = np.ones(64 * 6, np.float32)
  x[:64] = 0.0
  x[64:128] = 2.0 ** -64                  # kept
  x[128:192] = 2.0 ** -64.5               # below the threshold: zeros
  x[200] = np.nan
  x[256:320] = -f32max                    # 6 * scale never rounds up to inf
  q, s = ext.quantize_fp4(x, 64)
  d = np.asarray(ext.dequantize_fp4(q, s, 64))
  assert (d[:64] == 0).all() and (d[64:128] > 0).all() and (d[128:192] == 0).all()
  assert np.isnan(d[192:256]).all() and np.isfinite(d[256:320]).all()
  np.testing.assert_allclose(d[256:320], -f32max, rtol=1e-6)
  assert (d[320:] == np.float32(6.0) * ref.FP4_SCALE_MUL).all()  # 1 within an ulp, below it
  partial = np.zeros_like(x)
  same(ext.ring_hop_fp4_last(q, s, partial, 64), ref.ring_hop_fp4_last(q, s, partial, 64))


def test_gradients_of_the_decodes_match_the_references():
  x, p = data(130), data(130, 1)
  q, s = ext.quantize_fp4(x, 64)
  for f, g in ((lambda s, p: ext.dequantize_fp4(q, s, 64, n=130).sum() * 2.0,
                lambda s, p: ref.dequantize_fp4(q, s, 64, n=130).sum() * 2.0),
               (lambda s, p: (ext.ring_hop_fp4_last(q, s, p, 64) ** 2).sum(),
                lambda s, p: (ref.ring_hop_fp4_last(q, s, p, 64) ** 2).sum())):
    for a, b in zip(jax.grad(f, (0, 1))(s, p), jax.grad(g, (0, 1))(s, p), strict=True):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)
  with pytest.raises(TypeError, match="not differentiable"):
    jax.grad(lambda v: ext.quantize_fp4(v, 64)[1].sum())(jnp.asarray(x))


@pytest.mark.parametrize("call,match", [
    (lambda: ext.quantize_fp4(np.ones(8, np.float32), 3), "even"),
    (lambda: ext.quantize_fp4(np.ones(8, np.int32), 4), "x must have dtype"),
    (lambda: ext.dequantize_fp4(np.zeros(3, np.uint8), np.ones(2, np.float32), 8, n=10), "bytes"),
    (lambda: ext.dequantize_fp4(np.zeros(4, np.uint8), np.ones(2, np.float32), 8), "need 1"),
    (lambda: ext.ring_hop_fp4(np.zeros(4, np.int8), np.ones(1, np.float32),
                              np.ones(8, np.float32), 8), "q must have dtype"),
    (lambda: window.quantize_fp4(jnp.ones(16), 0, 7, 4), "even count"),
])
def test_bad_input_raises_naming_the_argument(call, match):
  with pytest.raises((TypeError, ValueError), match=match):
    call()


def test_the_handlers_check_operands_themselves():
  """Past the wrappers: an odd block size and a wrong code count are refused by the C++ plan."""
  x = jnp.ones(8, jnp.float32)
  results = (jax.ShapeDtypeStruct((4,), jnp.uint8), jax.ShapeDtypeStruct((3,), jnp.float32))
  call = jax.ffi.ffi_call("jaxring_quantize_fp4", results)
  with pytest.raises(Exception, match="block_size must be even"):
    call(x, jnp.uint32(0), block_size=np.int64(3), stochastic=np.bool_(False))
  results = (jax.ShapeDtypeStruct((8,), jnp.uint8), jax.ShapeDtypeStruct((2,), jnp.float32))
  with pytest.raises(Exception, match=r"q \(result\) has shape"):
    jax.ffi.ffi_call("jaxring_quantize_fp4", results)(
        x, jnp.uint32(0), block_size=np.int64(4), stochastic=np.bool_(False))


# --- the codec ----------------------------------------------------------------------------------


def test_the_codec_is_registered_spelled_and_sized():
  assert codecs.parse("fp4") == codecs.fp4() == codecs.Fp4(64, False)
  assert codecs.parse("fp4:32:stochastic") == codecs.fp4(32, stochastic=True)
  assert "fp4" not in base.sweep() and "fp4" in base.spellings()   # asked for, as fp16
  assert "fp4[:block_size[:stochastic]]" in base.grammar()
  assert base.name_of(codecs.fp4(128)) == "fp4"
  assert base.from_repr(repr(codecs.fp4(32, True))) == codecs.fp4(32, True)
  assert codecs.fp4().align == 64 and codecs.fp4(8).align == 8
  # half a byte a value (a padding nibble after an odd count) + one f32 scale a block
  assert codecs.fp4().wire_bytes(1024) == 512 + 4 * 16
  assert codecs.fp4(block_size=100).wire_bytes(1001) == 501 + 4 * 11
  assert codecs.fp4().wire_bytes(10, jnp.int32) == 40   # not compressed
  assert codecs.fp4().compression_ratio() == pytest.approx(0.125 + 1 / 64)
  for bad in (0, 3, -2, 2.0, 2 ** 31):
    with pytest.raises(ValueError, match="block_size"):
      codecs.fp4(bad)
  with pytest.raises(ValueError, match="stochastic"):
    codecs.fp4(stochastic="yes")
  with pytest.raises(ValueError, match="even count"):
    codecs.fp4().encode(jnp.ones(7), jnp.float32)


def mesh_of(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))


def run(x, compression, shape=(8,), names=("d",), algorithm="ring", op="psum"):
  """Member i gets row i of x; returns every member's result stacked."""
  axis = names if len(names) > 1 else names[0]

  def body(v):
    return getattr(jaxring, op)(v[0], axis, algorithm=algorithm, compression=compression)[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh_of(shape, names), in_specs=P(names),
                            out_specs=P(names)))
  out = np.asarray(f(x))
  for row in out[1:]:
    np.testing.assert_array_equal(row, out[0])   # every member decodes the same payload
  return out[0]


def ring_partials(x, align, p=8):
  """float64 partial sums S_1..S_p of every element in the order the ring forms them (as
  tests/test_codecs.py): the buffer padded to p chunks of a multiple of align."""
  n = x.shape[1]
  xs = np.pad(np.asarray(x, np.float64), ((0, 0), (0, -n % (p * align))))
  c = xs.shape[1] // p
  parts = np.zeros((p,) + xs.shape[1:])
  for chunk in range(p):
    acc = np.zeros(c)
    for j in range(p):
      acc = acc + xs[(chunk + 1 + j) % p, chunk * c:(chunk + 1) * c]
      parts[j, chunk * c:(chunk + 1) * c] = acc
  return parts


@pytest.mark.parametrize("block,stochastic", [(64, False), (256, False), (32, True)])
def test_pmean_on_the_ring_within_the_documented_bound(block, stochastic):
  codec = codecs.fp4(block, stochastic)
  rng = np.random.RandomState(3)
  n = 6001   # odd: the collectives pad to the codec's align
  x = jnp.asarray(rng.randn(8, n) * np.exp(rng.randn(1, n)), jnp.float32)
  parts = ring_partials(x, block)
  amax = np.abs(parts).reshape(8, -1, block).max(axis=2)          # [hop, block]
  bound = np.repeat((amax * codec.max_error(1.0)).sum(0), block)[:n] / 8 * 1.001 + 1e-6
  got = run(x, codec, op="pmean")
  want = np.asarray(x, np.float64).mean(0)
  err = np.abs(got - want)
  assert (err <= bound).all(), (err / bound).max()
  assert err.max() > 0


def test_hierarchical_with_fp4_on_the_node_level():
  """Full precision within a node, fp4 between the 2 nodes: the node ring encodes each element
  twice (1 reduce-scatter hop + the all-gather), each partial at most the sum of |x|."""
  x = jnp.asarray(np.random.RandomState(4).randn(8, 3000), jnp.float32)
  x64 = np.asarray(x, np.float64)
  n = x.shape[1]
  absum = np.pad(np.abs(x64).sum(0), (0, -n % 64)).reshape(-1, 64).max(1)
  bound = np.repeat(2 * absum / 6, 64)[:n] / 8 * 1.001 + 1e-6
  got = run(x, {"node": codecs.fp4()}, (2, 4), ("node", "local"), "hierarchical", op="pmean")
  err = np.abs(got - x64.mean(0))
  assert (err <= bound).all(), (err / bound).max()
  assert err.max() > 0


def test_non_finite_values_are_nan_never_hidden():
  x = np.ones((8, 512), np.float32)
  x[2, 5] = np.inf
  got = run(jnp.asarray(x), codecs.fp4())
  assert np.isnan(got[:64]).all()  # the block holding the inf
  np.testing.assert_allclose(got[64:], 8.0, rtol=0.2)


def test_the_ring_runs_the_ffi_kernels_and_moves_half_a_byte_a_value():
  from jaxring._src.tools.hlo_bytes import wire_bytes
  if codec_kernels.backend() != "ffi":
    pytest.skip(f"the native extension is not available here: {codec_kernels.backend()}")
  n = 8 * 8192
  mesh = mesh_of((8,), ("d",))
  progs = {c: jax.jit(jax.shard_map(
      lambda v, c=c: jaxring.psum(v, "d", algorithm="ring", compression=c), mesh=mesh,
      in_specs=P("d"), out_specs=P())) for c in (None, codecs.fp4())}
  text = progs[codecs.fp4()].lower(jnp.ones(8 * n)).compile().as_text()
  for t in ("quantize_fp4_at", "ring_hop_fp4_at", "ring_hop_fp4_last_at", "dequantize_fp4"):
    assert f'custom_call_target="jaxring_{t}"' in text, t
  f32 = wire_bytes(progs[None].lower(jnp.ones(8 * n)).compile().as_text()).sent_bytes
  fp4 = wire_bytes(text).sent_bytes
  assert fp4 / f32 == pytest.approx(codecs.fp4().compression_ratio(jnp.float32, n), rel=0.02)


# --- error feedback ------------------------------------------------------------------------------


def test_error_feedback_loses_nothing():
  """Applied updates plus the final mean residual equal the sum of the true mean gradients."""
  steps, n = 20, 1500
  rng = np.random.RandomState(0)
  g = jnp.asarray(rng.randn(steps, 8, n) * np.exp(rng.randn(1, 1, n)) + 0.3, jnp.float32)
  tx = jaxring.reduce_gradients("d", algorithm="ring", compression=codecs.fp4(),
                                plain_sgd_after=True)

  def body(gs):
    def step(state, gt):
      upd, state = tx.update(gt, state)
      return state, upd
    state, applied = jax.lax.scan(step, tx.init(jnp.zeros(n)), gs[:, 0])
    return applied[None], state.residual[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh_of((8,), ("d",)), in_specs=P(None, "d"),
                            out_specs=(P("d"), P("d"))))
  applied, residual = (np.asarray(a, np.float64) for a in f(g))
  true = np.asarray(g, np.float64).mean(1).sum(0)
  got = applied[0].sum(0) + residual.mean(0)
  scale = np.abs(np.asarray(g, np.float64)).max()
  np.testing.assert_allclose(got, true, rtol=0, atol=steps * 8 * scale * 2e-7)
  assert np.abs(applied[0].sum(0) - true).max() > 10 * np.abs(got - true).max()


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(jnp.tanh(nn.Dense(32)(x)))


def test_a_train_step_with_fp4_and_error_feedback_converges_like_the_uncompressed_one():
  rng = np.random.RandomState(0)
  w = rng.randn(8, 4).astype(np.float32)
  xs = rng.randn(64, 8).astype(np.float32)
  batch = {"x": xs, "y": np.tanh(xs @ w).astype(np.float32)}
  mesh = Mesh(np.asarray(jax.devices()), ("data",), axis_types=(AUTO,))
  model = MLP()
  p0 = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8)))["params"]

  def train(compression, steps=60):
    state = jt.TrainState.create(apply_fn=model.apply, params=p0, tx=optax.sgd(0.2, 0.9))

    @jt.train_step(mesh, algorithm="ring", compression=compression)
    def step(state, batch):
      def loss_fn(p):
        return jnp.mean((state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2)
      loss, grads = jt.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), {"loss": loss}

    losses = []
    for _ in range(steps):
      state, m = step(state, batch)
      losses.append(float(m["loss"]))
    return losses

  plain, fp4 = train(None), train(codecs.fp4())
  assert plain[-1] < 0.2 * plain[0]                        # the problem is learnt
  assert fp4[-1] <= plain[-1] * 1.1, (fp4[-1], plain[-1])   # measured: 1.02


def test_docstring_examples():
  import doctest

  from jaxring._src.ext import fp4 as module
  result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0
