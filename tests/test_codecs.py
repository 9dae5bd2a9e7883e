"""Codecs on the ring and on hierarchical levels, against float64 NumPy references.

Exactly representable inputs (every partial sum representable on the wire too) must give exactly
the float64 sum; other inputs must stay within each codec's documented bound, derived for the
ring: an element whose partial sums round the ring are S_1..S_p (S_p the total, encoded once more
for the all-gather) errs by at most sum_j u |S_j| for a 16-bit float wire (unit roundoff u) and
sum_j max|S_j over its block| / 254 for int8 (/127 stochastic).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring import codecs
from jaxring._src.tools.bench.wire import wire_table
from jaxring._src.tools.hlo_bytes import wire_bytes

AUTO = jax.sharding.AxisType.Auto
TOPO = jaxring.Topology((jaxring.Level("local", 4), jaxring.Level("node", 2, 1.25e8, 1e-4)))
F32_EPS = np.finfo(np.float32).eps


def mesh_of(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))


# where each case runs: (mesh shape, mesh axis names, algorithm, compression -> argument, topology)
FLAT = ((8,), ("d",), "ring", lambda c: c, None)
MESH_2X4 = ((2, 4), ("node", "local"), "hierarchical", lambda c: {"node": c}, None)
MESH_2X4_BOTH = ((2, 4), ("node", "local"), "hierarchical",
                 lambda c: {"local": c, "node": c}, None)
SPLIT = ((8,), ("d",), "hierarchical", lambda c: {"node": c}, TOPO)
PLACES = {"ring": FLAT, "hier2x4": MESH_2X4, "hier2x4_both": MESH_2X4_BOTH, "split": SPLIT}


def run(x, codec, place=FLAT, *, op="psum", check_vma=True):
  """Each row of ``x`` (members in linear order) goes to one member; returns every member's
  result stacked, so that tests also see that the members agree."""
  shape, names, algorithm, comp, topo = place
  mesh = mesh_of(shape, names)
  axis = names if len(names) > 1 else names[0]
  fn = getattr(jaxring, op)

  def body(v):
    return fn(v[0], axis, algorithm=algorithm, compression=comp(codec))[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names), out_specs=P(names),
                            check_vma=check_vma))
  if topo is None:
    return np.asarray(f(x))
  with jaxring.use_topology(topo):
    return np.asarray(f(x))


def agree(out):
  for row in out[1:]:
    np.testing.assert_array_equal(row, out[0])
  return out[0]


def ring_partials(x, align, p=8):
  """float64 partial sums S_1..S_p of every element in the order the ring forms them: chunk c
  starts at member c+1 and collects members c+2, ..., c (then the total is encoded once more).
  The buffer is padded, as the ring pads it, to p chunks of a multiple of the codec's align."""
  n = x.shape[1]
  pad = -n % (p * align)
  xs = np.pad(np.asarray(x, np.float64), ((0, 0), (0, pad)))
  c = xs.shape[1] // p
  parts = np.zeros((p,) + xs.shape[1:])
  for chunk in range(p):
    acc = np.zeros(c)
    for j in range(p):
      acc = acc + xs[(chunk + 1 + j) % p, chunk * c:(chunk + 1) * c]
      parts[j, chunk * c:(chunk + 1) * c] = acc
  return parts, n


# --- exact inputs give exact sums -----------------------------------------------------------


def int8_exact_input(seed, n, block=256, p=8):
  """Block b of member m is w[m, b] * v_b with small positive integers w and an integer vector
  v_b holding a +-127: every partial sum of a block is (sum of w) * v_b, whose scale is exactly
  that sum, so every encode on every hop is exact."""
  rng = np.random.RandomState(seed)
  nb = -(-n // block)
  v = rng.randint(-127, 128, (nb, block))
  width = np.minimum(block, n - block * np.arange(nb))  # the last block may be partial
  v[np.arange(nb), rng.randint(0, width)] = 127 * rng.choice([-1, 1], nb)
  w = rng.randint(1, 5, (p, nb))
  x = (w[:, :, None] * v[None]).reshape(p, -1)[:, :n]
  return jnp.asarray(x, jnp.float32)


EXACT = {
    # partial sums of 8 values in [-16, 16] stay within 128: exact in bf16's 8 bits
    "bf16": (codecs.bf16(), lambda rng, n: rng.randint(-16, 17, (8, n))),
    # within 8 * 200 = 1600 < 2048: exact in fp16's 11 bits
    "fp16": (codecs.fp16(), lambda rng, n: rng.randint(-200, 201, (8, n))),
    "int8": (codecs.int8(), None),
    "int8_64": (codecs.int8(block_size=64), None),
}


@pytest.mark.parametrize("place", [p if p == "ring" else pytest.param(p, marks=pytest.mark.slow)
                                   for p in PLACES])   # the quick loop keeps the ring (~0.3 s each)
@pytest.mark.parametrize("name", list(EXACT))
def test_exactly_representable_inputs_give_exact_sums(name, place):
  codec, make = EXACT[name]
  n = 2 * 8 * 256 + 300  # padding and a partial last block
  if make is None:
    x = int8_exact_input(0, n, codec.block_size)
  else:
    x = jnp.asarray(make(np.random.RandomState(0), n), jnp.float32)
  want = np.asarray(x, np.float64).sum(0)
  got = agree(run(x, codec, PLACES[place]))
  np.testing.assert_array_equal(got.astype(np.float64), want)


@pytest.mark.parametrize("check_vma", [True, False])
def test_exact_pmean_int8_split_axis(check_vma):
  x = int8_exact_input(1, 4096 + 17)
  got = agree(run(x, codecs.int8(), SPLIT, op="pmean", check_vma=check_vma))
  np.testing.assert_array_equal(got.astype(np.float64), np.asarray(x, np.float64).mean(0))


# --- error bounds -----------------------------------------------------------------------------


def cast_bound(codec, parts, n):
  """u * sum_j |S_j|, plus for fp16 2**-39 * sum_j max|S_j over its block| (subnormals of the
  scaled wire), plus f32 rounding of the partial sums."""
  bound = codec.unit_roundoff * np.abs(parts).sum(0)
  if codec.name == "fp16":
    amax = np.abs(parts).reshape(parts.shape[0], -1, codec.block_size).max(axis=2)
    bound = bound + np.repeat(2.0 ** -39 * amax.sum(0), codec.block_size)
  return (bound + F32_EPS * np.abs(parts).sum(0))[:n]


@pytest.mark.parametrize("scale", [3.0, pytest.param(1e-7, marks=pytest.mark.slow),  # ~0.4 s each
                                   pytest.param(1e-20, marks=pytest.mark.slow),
                                   pytest.param(1e20, marks=pytest.mark.slow)])
@pytest.mark.parametrize("codec", [codecs.bf16(), codecs.fp16(), codecs.fp16(block_size=32)],
                         ids=["bf16", "fp16", "fp16_32"])
def test_cast_codec_error_within_ring_bound(codec, scale):
  rng = np.random.RandomState(2)
  x = rng.randn(8, 5000) * scale * np.exp(rng.randn(1, 5000))  # magnitudes vary across blocks
  x = jnp.asarray(x, jnp.float32)
  parts, n = ring_partials(x, codec.align)
  bound = cast_bound(codec, parts, n)
  err = np.abs(agree(run(x, codec)) - parts[-1, :n])
  assert (err <= bound).all(), (err / bound).max()
  assert err.max() > 0  # the inputs are not representable: the wire really is 16-bit


def test_fp16_small_gradients_keep_fp16_relative_precision():
  """The issue's case: values around 1e-7 lost 36% to fp16 subnormals on an unscaled wire."""
  x = jnp.asarray(np.random.RandomState(12).randn(8, 4096) * 1e-7, jnp.float32)
  x64 = np.asarray(x, np.float64)
  got = agree(run(x, codecs.fp16()))
  rel = np.abs(got - x64.sum(0)) / np.abs(x64).sum(0)
  # p + 1 = 9 encodes of partial sums, each at most 2**-11 of at most sum|x|
  assert rel.max() <= 9 * 2.0 ** -11, rel.max()


@pytest.mark.parametrize("stochastic", [False,
                                        pytest.param(True, marks=pytest.mark.slow)])  # ~0.4 s each
@pytest.mark.parametrize("block", [256, 32])
def test_int8_error_within_ring_bound(block, stochastic):
  codec = codecs.int8(block_size=block, stochastic=stochastic)
  rng = np.random.RandomState(3)
  x = rng.randn(8, 6000) * np.exp(rng.randn(1, 6000))  # magnitudes vary across blocks
  x = jnp.asarray(x, jnp.float32)
  parts, n = ring_partials(x, block)
  amax = np.abs(parts).reshape(8, -1, block).max(axis=2)  # [hop, block]
  per_block = (amax / (127.0 if stochastic else 254.0)).sum(0)
  bound = np.repeat(per_block, block)[:n] * 1.001 + 1e-5
  err = np.abs(agree(run(x, codec)) - parts[-1, :n])
  assert (err <= bound).all(), (err / bound).max()


@pytest.mark.parametrize("place", ["hier2x4", "split"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_int8_on_the_node_level_only(place, check_vma):
  """Full precision within a node, int8 between the 2 nodes: the node ring encodes each element
  twice (1 reduce-scatter hop + the all-gather), each partial at most the sum of |x| over members."""
  x = jnp.asarray(np.random.RandomState(4).randn(8, 3000), jnp.float32)
  x64 = np.asarray(x, np.float64)
  want = x64.sum(0)
  n = x.shape[1]
  absum = np.pad(np.abs(x64).sum(0), (0, -n % 256)).reshape(-1, 256).max(1)
  bound = np.repeat(2 * absum / 254, 256)[:n] * 1.001 + 1e-5
  got = agree(run(x, codecs.int8(), PLACES[place], check_vma=check_vma))
  err = np.abs(got - want)
  assert (err <= bound).all(), (err / bound).max()
  assert err.max() > 0


def test_fp16_wire_never_overflows_and_passes_inf_and_nan():
  f32_max = float(np.finfo(np.float32).max)
  x = np.ones((8, 2048), np.float32)
  x[:, 7] = 20000.0       # partial sums past fp16's 65504 (the unscaled wire made them inf)
  x[:3, 256] = 60000.0    # ... of both signs
  x[3:, 256] = -50000.0
  x[0, 512] = f32_max     # one member holds f32's largest value: it must not round up to inf
  x[:, 768] = f32_max / 8 * (1 - 2.0 ** -6)  # a total near f32's largest, within the bound
  x[2, 1024] = np.inf     # non-finite values travel as themselves
  x[5, 1280] = np.nan
  x[2, 1536], x[6, 1536] = np.inf, -np.inf
  got = agree(run(jnp.asarray(x), codecs.fp16()))
  x64 = np.asarray(x, np.float64)
  for col in (7, 256, 512, 768):
    want = x64[:, col].sum()
    assert np.isfinite(got[col]) and abs(got[col] - want) <= 9 * 2.0 ** -11 * abs(want), col
  assert got[1024] == np.inf and np.isnan(got[1280]) and np.isnan(got[1536])
  # the other values are exact, except next to f32's largest (blocks 2 and 3), far below 2**-39
  # times their block's largest magnitude
  rest = np.setdiff1d(np.r_[0:512, 1024:2048], [7, 256, 1024, 1280, 1536])
  np.testing.assert_array_equal(got[rest], 8.0)


def test_fp16_scale_exponents_from_the_bits_equal_frexp_and_ldexp():
  """The fp16 wire's scale is read off f32's exponent bits: the same exponents as ``jnp.frexp``
  for every finite non-negative f32 up to the clamp the encoder applies (zeros, subnormals and
  f32's largest included), and the same powers of two as ``jnp.ldexp``."""
  from jaxring._src.codecs import cast
  rng = np.random.default_rng(3)
  f32 = np.finfo(np.float32)
  edges = [0.0, -0.0, f32.smallest_subnormal, 1e-40, f32.tiny, 0.5, 1.0, 65504.0, f32.max]
  a = np.concatenate([edges,
                      np.abs(rng.standard_normal(2000)) * 2.0 ** rng.integers(-149, 128, 2000)])
  a = jnp.asarray(a.astype(np.float32))
  clamp = -f32.minexp                      # the encoder's k = min(15 - e, clamp)
  got = jnp.minimum(15 - cast._frexp_exponent(a), clamp)
  want = jnp.minimum(15 - jnp.frexp(a)[1], clamp)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  k = jnp.arange(-126, 128)
  np.testing.assert_array_equal(np.asarray(cast._pow2(k, jnp.float32)),
                                np.asarray(jnp.ldexp(jnp.ones((), jnp.float32), k)))


@pytest.mark.slow   # sums at many magnitudes (~2 s)
def test_fp16_and_int8_flush_thresholds_as_documented():
  # fp16: relative to the block's largest magnitude (1.0 here), 2**-38 survives, 2**-41 is zero
  x = np.zeros((8, 512), np.float32)
  x[0, 0], x[0, 1], x[0, 2] = 1.0, 2.0 ** -38, 2.0 ** -41
  got = agree(run(jnp.asarray(x), codecs.fp16()))
  assert got[1] == pytest.approx(2.0 ** -38, rel=2.0 ** -10) and got[2] == 0.0
  # and absolutely: a block of tiny values keeps them (no 2**-25 floor as on an unscaled wire)
  x = np.full((8, 512), 2.0 ** -100, np.float32)
  np.testing.assert_allclose(agree(run(jnp.asarray(x), codecs.fp16())), 2.0 ** -97, rtol=2 ** -10)
  # int8: a block whose largest magnitude is below 2**-64 decodes to zero, from 2**-64 on it stays
  for value, kept in ((2.0 ** -64, True), (2.0 ** -64.5, False)):
    x = np.zeros((8, 512), np.float32)
    x[0, :256] = value
    got = agree(run(jnp.asarray(x), codecs.int8()))
    assert (got[:256] != 0).all() == kept and (got[:256] == 0).all() != kept, value


def test_int8_nonfinite_is_nan_never_hidden():
  x = np.ones((8, 512), np.float32)
  x[2, 5] = np.inf
  got = agree(run(jnp.asarray(x), codecs.int8()))
  assert np.isnan(got[:256]).all()  # the block holding the inf
  np.testing.assert_array_equal(got[256:], 8.0)


# --- top-k chunks -----------------------------------------------------------------------------


def topk_reference(x, density, chunk):
  """float64 selection: chunks with the largest sum over members of their L2 norm."""
  x64 = np.asarray(x, np.float64)
  n = x64.shape[1]
  nc = -(-n // chunk)
  xs = np.pad(x64, ((0, 0), (0, nc * chunk - n))).reshape(8, nc, chunk)
  score = np.sqrt((xs ** 2).sum(2)).sum(0)
  k = max(1, int(np.ceil(density * nc - 1e-9)))
  chosen = np.sort(np.argsort(-score, kind="stable")[:k])
  want = np.zeros((nc, chunk))
  want[chosen] = xs[:, chosen].sum(0)
  return want.reshape(-1)[:n], chosen


@pytest.mark.parametrize("place", ["ring", "hier2x4", "split"])
@pytest.mark.parametrize("check_vma", [True,
                                       pytest.param(False, marks=pytest.mark.slow)])  # ~0.3 s each
def test_topk_chunks_sums_the_chunks_with_largest_summed_norm(place, check_vma):
  rng = np.random.RandomState(5)
  chunk, n = 64, 64 * 50 + 13
  # distinct chunk magnitudes so that the float64 and f32 rankings cannot differ
  mags = np.repeat(rng.permutation(51) + 1.0, chunk)[:n]
  x = jnp.asarray(rng.randn(8, n) * mags, jnp.float32)
  codec = codecs.topk_chunks(density=0.1, chunk_size=chunk)
  want, chosen = topk_reference(x, 0.1, chunk)
  assert len(chosen) == 6
  got = agree(run(x, codec, PLACES[place], check_vma=check_vma))
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-4)
  mask = np.zeros(n, bool)
  mask[(chosen[:, None] * chunk + np.arange(chunk)).ravel().clip(max=n - 1)] = True
  assert (got[~mask] == 0).all() and (got[mask] != 0).all()


def test_topk_ties_go_to_the_lower_chunk_index():
  x = jnp.ones((8, 32 * 40), jnp.float32)
  got = agree(run(x, codecs.topk_chunks(density=0.05, chunk_size=32)))
  np.testing.assert_array_equal(got[:64], 8.0)  # chunks 0 and 1
  np.testing.assert_array_equal(got[64:], 0.0)


def test_topk_with_int8_inner_codec():
  x = int8_exact_input(6, 8 * 256 * 4)
  codec = codecs.topk_chunks(density=0.5, chunk_size=512, inner=codecs.int8())
  want, _ = topk_reference(x, 0.5, 512)
  got = agree(run(x, codec))
  # chunks are whole int8 blocks, and the packed blocks stay exact scalar multiples
  np.testing.assert_array_equal(got.astype(np.float64), want)


def test_topk_has_no_reduce_scatter_or_all_gather():
  mesh = mesh_of((8,), ("d",))
  for op, kw in ((jaxring.psum_scatter, {"tiled": True}), (jaxring.all_gather, {})):
    f = jax.shard_map(lambda v: op(v, "d", algorithm="ring", compression=codecs.topk_chunks(),
                                   **kw), mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    with pytest.raises(NotImplementedError, match="topk_chunks wraps a whole all-reduce"):
      jax.jit(f)(jnp.ones(64))


# --- other collectives and dtypes -------------------------------------------------------------


def test_psum_scatter_and_all_gather_compressed():
  x = jnp.asarray(np.random.RandomState(7).randn(8, 8 * 512), jnp.float32)
  x64 = np.asarray(x, np.float64)
  mesh = mesh_of((8,), ("d",))
  f = jax.jit(jax.shard_map(
      lambda v: jaxring.psum_scatter(v[0], "d", tiled=True, algorithm="ring",
                                     compression=codecs.int8()),
      mesh=mesh, in_specs=P("d"), out_specs=P("d")))
  rs = np.asarray(f(x))  # member i holds block i, concatenated in member order
  absum = np.abs(x64).sum(0).reshape(-1, 256).max(1)
  bound = np.repeat(7 * absum / 254, 256) * 1.001 + 1e-5  # p - 1 encodes, no all-gather
  err = np.abs(rs - x64.sum(0))
  assert (err <= bound).all() and err.max() > 0
  f = jax.jit(jax.shard_map(
      lambda v: jaxring.all_gather(v[0], "d", algorithm="ring", compression=codecs.bf16())[None],
      mesh=mesh, in_specs=P("d"), out_specs=P("d")))
  got = agree(np.asarray(f(x)))
  np.testing.assert_allclose(got, x64, rtol=2.0 ** -8, atol=0)


@pytest.mark.parametrize("codec", [codecs.int8(), codecs.bf16(), None], ids=["int8", "bf16",
                                                                           "bf16-leaf"])
def test_hierarchical_compressed_all_gather_is_each_members_decoded_encoding(codec):
  """Every member's value crosses the slow level encoded once and comes back decoded, whatever
  decodes it (in one pass with the in-process gather, axes ordered fast level first, or after
  it): the same bits as lax.all_gather of decode(encode(x)), in member order (the slow level is
  the last axis named, and the members of one process share memory)."""
  dtype = jnp.float32 if codec is not None else jnp.bfloat16
  x = jnp.asarray(np.random.RandomState(3).randn(8, 3, 512), dtype)
  mesh = mesh_of((4, 2), ("node", "local"))
  axes = ("local", "node")

  def ours(v):
    return jaxring.all_gather(v[0], axes, axis=1, tiled=True, algorithm="hierarchical",
                              compression={"node": codec})[None]

  def ref(v):
    c = codec or codecs.none()
    back = c.decode(c.encode(v[0].reshape(-1), dtype), dtype).astype(dtype).reshape(v[0].shape)
    return jax.lax.all_gather(back, axes, axis=1, tiled=True)[None]
  got, want = (np.asarray(jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(("node", "local")),
                                                out_specs=P(("node", "local"))))(x))
               for fn in (ours, ref))
  np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_lossy_codecs_skip_integer_and_16bit_leaves():
  rng = np.random.RandomState(8)
  tree = {"i": jnp.asarray(rng.randint(-1000, 1000, (8, 300)), jnp.int32),
          "h": jnp.asarray(rng.randn(8, 300), jnp.bfloat16),
          "f": jnp.asarray(rng.randint(-16, 17, (8, 300)), jnp.float32)}
  mesh = mesh_of((8,), ("d",))
  f = jax.jit(jax.shard_map(
      lambda t: jaxring.psum(jax.tree.map(lambda v: v[0], t), "d", algorithm="ring",
                             compression=codecs.bf16()),
      mesh=mesh, in_specs=P("d"), out_specs=P()))
  got = f(tree)
  np.testing.assert_array_equal(np.asarray(got["i"]), np.asarray(tree["i"]).sum(0))
  assert got["h"].dtype == jnp.bfloat16 and got["f"].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got["f"]), np.asarray(tree["f"], np.float64).sum(0))
  # a bf16 leaf travels as bf16 with f32 partial sums: one rounding per encode
  h64 = np.asarray(tree["h"], np.float64)
  err = np.abs(np.asarray(got["h"], np.float64) - h64.sum(0))
  assert (err <= 2.0 ** -8 * (8 + 1) * np.abs(h64).sum(0) + 1e-6).all()


# --- wire sizes -------------------------------------------------------------------------------


def test_wire_bytes_arithmetic():
  assert codecs.none().wire_bytes(1000, jnp.float32) == 4000
  assert codecs.bf16().wire_bytes(1000, jnp.float32) == 2000
  assert codecs.bf16().wire_bytes(1000, jnp.bfloat16) == 2000  # already 16-bit
  assert codecs.fp16().wire_bytes(10, jnp.int32) == 40  # not compressed
  assert codecs.fp16().wire_bytes(1000, jnp.float32) == 2 * (1000 + 4)  # an exponent per block
  assert codecs.fp16(block_size=100).wire_bytes(1000) == 2 * (1000 + 10)
  assert codecs.int8().wire_bytes(1000) == 1000 + 4 * 4
  assert codecs.int8(block_size=100).wire_bytes(1000) == 1000 + 4 * 10
  tk = codecs.topk_chunks(0.01, chunk_size=4096)
  assert tk.num_selected(2048 * 4096) == 21 and tk.num_selected(100 * 4096) == 1
  assert tk.wire_bytes(2048 * 4096) == 21 * 4096 * 4 + 2048 * 4
  assert codecs.topk_chunks(0.07, 10).num_selected(1000) == 7
  assert codecs.int8().compression_ratio() == pytest.approx(0.25 + 1 / 256)


@pytest.mark.slow   # compiles a program per codec (~3-5 s)
def test_wire_ratios_from_compiled_hlo():
  rows = {r["codec"]: r for r in wire_table(32 << 20, 8)}
  base = rows["f32 ring (none)"]
  assert base["wire_bytes"] == pytest.approx(2 * 7 / 8 * (32 << 20))  # the ring's 2(p-1)/p n
  assert rows["bf16"]["ratio"] <= 0.51 and rows["fp16"]["ratio"] <= 0.51
  assert rows["bf16"]["wire_dtypes"] == ["u16"]  # bitcast: XLA:CPU would promote bf16 to f32
  assert rows["int8 (256)"]["ratio"] <= 0.27
  # a ring hop sends codes and scales as one message (u8); the closing all-gather of 1 MiB of
  # codes a member gathers each array alone (transport/xla.py PACK_BELOW): s8 codes, f32 scales
  assert rows["int8 (256)"]["wire_dtypes"] == ["f32", "s8", "u8"]
  assert rows["topk_chunks (1%, 4096)"]["ratio"] <= 0.03
  for r in rows.values():  # the codec's own wire_bytes predicts what the HLO moves
    assert r["ratio"] == pytest.approx(r["predicted"], rel=0.02), r


def test_hlo_byte_counter_on_native_collectives():
  mesh = mesh_of((2, 4), ("node", "local"))
  def body(v):
    a = jax.lax.psum(v, "local")                                   # all-reduce, groups of 4
    b = jax.lax.all_gather(v.astype(jnp.int8), "node", tiled=True)  # all-gather, groups of 2
    c = jax.lax.ppermute(v, "local", [(i, (i + 1) % 4) for i in range(4)])
    return a, b, c
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("node", "local")),
                            out_specs=(P(("node", "local")),) * 3, check_vma=False))
  wb = wire_bytes(f.lower(jnp.ones(8 * 1000)).compile().as_text())
  by_op = wb.by_op()
  assert by_op["all-reduce"] == pytest.approx(4000 * 2 * 3 / 4)
  assert by_op["all-gather"] == pytest.approx(1000 * 1)
  assert by_op["collective-permute"] == pytest.approx(4000)
  assert wb.operand_bytes == 4000 + 1000 + 4000


# --- bad arguments ----------------------------------------------------------------------------


@pytest.mark.parametrize("make,arg", [
    (lambda: codecs.int8(block_size=0), "block_size"),
    (lambda: codecs.int8(block_size=-3), "block_size"),
    (lambda: codecs.int8(block_size=2.5), "block_size"),
    (lambda: codecs.int8(stochastic="yes"), "stochastic"),
    (lambda: codecs.int8(block_size=2 ** 40), "block_size"),
    (lambda: codecs.int8(block_size=2 ** 63), "block_size"),
    (lambda: codecs.fp16(block_size=0), "block_size"),
    (lambda: codecs.fp16(block_size=2 ** 31), "block_size"),
    (lambda: codecs.topk_chunks(density=0.0), "density"),
    (lambda: codecs.topk_chunks(density=1.5), "density"),
    (lambda: codecs.topk_chunks(density=-0.1), "density"),
    (lambda: codecs.topk_chunks(density=float("nan")), "density"),
    (lambda: codecs.topk_chunks(chunk_size=0), "chunk_size"),
    (lambda: codecs.topk_chunks(inner=codecs.topk_chunks()), "inner"),
])
def test_bad_codec_arguments_raise_naming_the_argument(make, arg):
  with pytest.raises(ValueError, match=re.escape(arg)):
    make()


def test_codecs_are_hashable_values():
  assert codecs.int8() == codecs.int8(256, False) and codecs.int8() != codecs.int8(128)
  assert codecs.bf16() != codecs.fp16()
  assert len({codecs.int8(), codecs.int8(), codecs.topk_chunks()}) == 2


# --- the codecs run the extension's kernels -------------------------------------------------


@pytest.mark.parametrize("codec,targets", [
    # the ring's hops read the local chunk in place on the CPU (the ``_at`` targets, ext/window.py)
    (codecs.int8(), ["jaxring_quantize_int8", "jaxring_quantize_int8_at", "jaxring_ring_hop_int8_at",
                     "jaxring_ring_hop_int8_last_at", "jaxring_dequantize_int8"]),
    (codecs.bf16(), ["jaxring_ring_hop_cast_at", "jaxring_ring_hop_cast_last_at"]),
    (codecs.topk_chunks(0.1, 64), ["jaxring_chunk_norms", "jaxring_gather_chunks",
                                   "jaxring_scatter_add_chunks"]),
], ids=["int8", "bf16", "topk"])
def test_codecs_call_the_ffi_kernels(codec, targets):
  from jaxring._src.codecs import kernels
  if kernels.backend() != "ffi":
    pytest.skip(f"the native extension is not available here: {kernels.backend()}")
  mesh = mesh_of((8,), ("d",))
  f = jax.jit(jax.shard_map(lambda v: jaxring.psum(v, "d", algorithm="ring", compression=codec),
                            mesh=mesh, in_specs=P("d"), out_specs=P()))
  text = f.lower(jnp.ones(8 * 4096)).compile().as_text()
  for t in targets:
    assert f'custom_call_target="{t}"' in text, t
