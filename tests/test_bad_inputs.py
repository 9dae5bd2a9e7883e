"""Bad and edge-case inputs get what ``jax.lax`` gives: the same result, or the same exception type
with lax's message inside ours.

Fills the gaps left by test_contract.py (repeated, int and unbound axis names, bools),
test_collectives.py (shape errors of a non-divisible scatter, bad algorithm/compression
arguments), test_codecs.py (most bad codec parameters), test_nonfinite.py (NaN/Inf),
test_train_contract.py (bad bucket_bytes, non-scalar and non-float losses) and
test_train_checkpoint.py (corrupt, truncated checkpoints, a different template): empty and scalar
operands, prime lengths and every dtype lax reduces, for every algorithm and codec;
out-of-range dimensions; the codec parameters still untested; compression dicts naming unknown
levels on every op.
"""
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
PLANS = {"xla": ("xla", None), "ring": ("ring", None), "hierarchical": ("hierarchical", None),
         "ring_bf16": ("ring", codecs.bf16()), "hier_int8": ("hierarchical", codecs.int8()),
         "ring_fp16": ("ring", codecs.fp16())}
LOSSY = {"ring_bf16", "hier_int8", "ring_fp16"}


def _quick_first(values, quick):
  """``values`` as parameters, all but ``quick`` marked slow (CI runs the quick ones)."""
  return [v if v in quick else pytest.param(v, marks=pytest.mark.slow) for v in values]


def _run(body, x, check_vma=True):
  """``body(member's block)`` on a 2 x 4 mesh; every member's result stacked on axis 0."""
  mesh = jax.make_mesh((2, 4), AXES, axis_types=(AUTO, AUTO))
  f = jax.shard_map(lambda v: jax.tree.map(lambda r: jnp.asarray(r)[None], body(v[0])),
                    mesh=mesh, in_specs=P(AXES), out_specs=P(AXES), check_vma=check_vma)
  return jax.jit(f)(x)


def _ops(plan):
  algorithm, comp = PLANS[plan]
  kw = dict(algorithm=algorithm, compression=comp)
  return {
      "psum": (lambda v: jaxring.psum(v, AXES, **kw), lambda v: lax.psum(v, AXES)),
      "pmean": (lambda v: jaxring.pmean(v, AXES, **kw), lambda v: lax.pmean(v, AXES)),
      "all_gather": (lambda v: jaxring.all_gather(v, AXES, **kw),
                     lambda v: lax.all_gather(v, AXES)),
      "psum_scatter": (lambda v: jaxring.psum_scatter(v, AXES, tiled=True, **kw),
                       lambda v: lax.psum_scatter(v, AXES, tiled=True)),
  }


def _message(exc) -> list[str]:
  """What an error says, less the source locations MLIR verifier errors carry."""
  return [line.strip() for line in str(exc).splitlines()
          if line.strip() and "at loc(" not in line and "JAX_DUMP_IR_TO" not in line]


def _same_outcome(ours, theirs, x, lossy=False):
  """Either both give the same values (lossy codecs: within their rounding), or both raise the
  same exception type and ours contains lax's message (where lax's error is an internal
  IndexError, ``tuple index out of range``, ours says which dimension instead)."""
  try:
    want = _run(theirs, x)
  except Exception as exc:  # noqa: BLE001 - lax's behaviour is the reference
    with pytest.raises(type(exc)) as info:
      _run(ours, x)
    if isinstance(exc, IndexError):
      assert "out of bounds" in str(info.value), str(info.value)
    else:
      theirs_says, ours_says = _message(exc), "\n".join(_message(info.value))
      assert all(line in ours_says for line in theirs_says), (theirs_says, ours_says)
    return None
  got = _run(ours, x)
  assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape,
                                                               want.dtype)
  if lossy:
    scale = 1 + float(np.max(np.abs(want), initial=0.0))
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               rtol=2e-2, atol=2e-2 * scale)
  else:
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  return got


# --- empty, scalar, prime lengths ----------------------------------------------------------------


SHAPES = {"scalar": (), "empty": (0,), "empty_2d": (8, 0), "one": (1,), "prime": (1009,),
          "odd_2d": (8, 13)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("plan", _quick_first(list(PLANS), {"ring"}))
@pytest.mark.parametrize("op", _quick_first(["psum", "pmean", "all_gather", "psum_scatter"],
                                            {"psum", "all_gather"}))
def test_empty_scalar_and_prime_shapes_behave_as_lax(op, plan, shape):
  ours, theirs = _ops(plan)[op]
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.randint(-8, 9, (8,) + SHAPES[shape]).astype(np.float32))
  _same_outcome(ours, theirs, x, lossy=plan in LOSSY)


# --- every dtype lax reduces ---------------------------------------------------------------------


DTYPES = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "float16", "bfloat16",
          "float32", "complex64", "bool"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plan", _quick_first(["xla", "ring", "hierarchical"], {"ring"}))
@pytest.mark.parametrize("op", _quick_first(["psum", "all_gather", "psum_scatter"], {"psum"}))
def test_every_dtype_lax_takes_gives_lax_result_or_error(op, plan, dtype):
  ours, theirs = _ops(plan)[op]
  rng = np.random.RandomState(1)
  x = jnp.asarray(rng.randint(0, 3, (8, 16)).astype(dtype))
  _same_outcome(ours, theirs, x)


@pytest.mark.parametrize("dtype", ["int32", "complex64", "bool"])
@pytest.mark.parametrize("codec", [codecs.bf16(), codecs.int8(), codecs.fp16()],
                         ids=["bf16", "int8", "fp16"])
def test_a_codec_given_a_dtype_it_does_not_compress_still_sums_exactly(codec, dtype):
  # integer (and bool, summed as int32 as lax does) leaves travel uncompressed; a lossy codec
  # never rounds them
  rng = np.random.RandomState(2)
  x = jnp.asarray(rng.randint(0, 3, (8, 16)).astype(dtype))
  try:
    want = _run(lambda v: lax.psum(v, AXES), x)
  except Exception as exc:  # noqa: BLE001
    pytest.skip(f"lax refuses {dtype}: {exc}")
  try:
    got = _run(lambda v: jaxring.psum(v, AXES, algorithm="ring", compression=codec), x)
  except (TypeError, ValueError, NotImplementedError) as exc:
    # a clear refusal is allowed where the codec cannot take the dtype: it must say which
    assert dtype in str(exc) and codec.name in str(exc), str(exc)
    return
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# --- dimensions out of range ---------------------------------------------------------------------


@pytest.mark.parametrize("plan", _quick_first(["xla", "ring", "hierarchical", "hier_int8"],
                                              {"ring"}))
@pytest.mark.parametrize("dim", [2, -3, 5])
@pytest.mark.parametrize("op", ["all_gather", "psum_scatter"])
def test_out_of_range_dimensions_raise_as_lax_does(op, dim, plan):
  algorithm, comp = PLANS[plan]
  kw = dict(algorithm=algorithm, compression=comp)
  if op == "all_gather":
    ours = lambda v: jaxring.all_gather(v, AXES, axis=dim, **kw)
    theirs = lambda v: lax.all_gather(v, AXES, axis=dim)
  else:
    ours = lambda v: jaxring.psum_scatter(v, AXES, scatter_dimension=dim, tiled=True, **kw)
    theirs = lambda v: lax.psum_scatter(v, AXES, scatter_dimension=dim, tiled=True)
  _same_outcome(ours, theirs, jnp.ones((8, 8, 16), jnp.float32), lossy=plan == "hier_int8")


def test_a_dimension_out_of_range_is_both_of_lax_s_error_types():
  # lax.all_gather raises ValueError, lax.psum_scatter an IndexError: ours is both
  with pytest.raises(ValueError, match="axis 3 is out of bounds for array of dimension 2"):
    _run(lambda v: jaxring.psum_scatter(v, AXES, scatter_dimension=3, algorithm="ring"),
         jnp.ones((8, 8, 16)))
  with pytest.raises(IndexError):
    _run(lambda v: jaxring.psum_scatter(v, AXES, scatter_dimension=3, algorithm="ring"),
         jnp.ones((8, 8, 16)))


@pytest.mark.parametrize("plan", _quick_first(["ring", "hierarchical", "hier_int8"], {"ring"}))
@pytest.mark.parametrize("n", [12, 7])
def test_non_divisible_scatter_raises_lax_message(plan, n):
  ours, theirs = _ops(plan)["psum_scatter"]
  x = jnp.ones((8, n), jnp.float32)
  with pytest.raises(Exception) as lax_info:
    _run(theirs, x)
  with pytest.raises(lax_info.type) as info:
    _run(ours, x)
  assert str(lax_info.value) in str(info.value), (str(lax_info.value), str(info.value))


# --- codec parameters and compression dicts ------------------------------------------------------


@pytest.mark.parametrize("make,arg", [
    (lambda: codecs.int8(block_size=-1), "block_size"),
    (lambda: codecs.int8(block_size=float("nan")), "block_size"),
    (lambda: codecs.int8(block_size=None), "block_size"),
    (lambda: codecs.fp16(block_size=-256), "block_size"),
    (lambda: codecs.fp16(block_size=float("nan")), "block_size"),
    (lambda: codecs.topk_chunks(density=float("inf")), "density"),
    (lambda: codecs.topk_chunks(density=None), "density"),
    (lambda: codecs.topk_chunks(chunk_size=-64), "chunk_size"),
    (lambda: codecs.topk_chunks(chunk_size=float("nan")), "chunk_size"),
    (lambda: codecs.topk_chunks(chunk_size=2.5), "chunk_size"),
])
def test_more_bad_codec_parameters_are_refused_naming_them(make, arg):
  with pytest.raises((ValueError, TypeError), match=re.escape(arg)):
    make()


@pytest.mark.parametrize("op", ["psum", "pmean", "all_gather", "psum_scatter"])
@pytest.mark.parametrize("algorithm", _quick_first(["ring", "hierarchical", "auto"], {"ring"}))
def test_a_compression_dict_naming_an_unknown_level_is_refused_by_every_op(op, algorithm):
  comp = {"nodes": codecs.int8()}
  fn = {"psum": lambda v: jaxring.psum(v, AXES, algorithm=algorithm, compression=comp),
        "pmean": lambda v: jaxring.pmean(v, AXES, algorithm=algorithm, compression=comp),
        "all_gather": lambda v: jaxring.all_gather(v, AXES, algorithm=algorithm,
                                                   compression=comp),
        "psum_scatter": lambda v: jaxring.psum_scatter(v, AXES, tiled=True, algorithm=algorithm,
                                                       compression=comp)}[op]
  with pytest.raises(ValueError, match=r"compression names levels \['nodes'\]"):
    _run(fn, jnp.ones((8, 16), jnp.float32))
