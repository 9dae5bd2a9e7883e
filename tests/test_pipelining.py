"""Sub-chunked ring hops (``Level.pieces``), the all-gather that carries the slow level's payload,
and the ring's small-message gather.

The first two change how bytes move, never the values: results must be bit-identical to the plain
schedule and within float32 rounding of a float64 NumPy sum; the gather rounds each value once, so
its sum is within float32 rounding of the decoded values'. The compiled HLO must show the schedule.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring import codecs
from jaxring._src.tools.hlo_bytes import compiled_wire_bytes

AUTO = jax.sharding.AxisType.Auto


def topology(pieces: int):
  return jaxring.Topology((jaxring.Level("local", 4),
                           jaxring.Level("node", 2, 1.25e8, 1e-4, pieces=pieces)))


def reducer(place: str, algorithm: str, codec, op="psum"):
  """A jitted SPMD function reducing row ``i`` of its input on member ``i``, and its input spec."""
  if place == "mesh":
    mesh, names, axis = jax.make_mesh((2, 4), ("node", "local"), axis_types=(AUTO, AUTO)), \
        ("node", "local"), ("node", "local")
  else:  # one flat axis, split into the topology's levels
    mesh, names, axis = jax.make_mesh((8,), ("d",), axis_types=(AUTO,)), ("d",), "d"
  comp = {"node": codec} if (codec is not None and algorithm == "hierarchical") else codec

  def body(v):
    return getattr(jaxring, op)(v[0], axis, algorithm=algorithm, compression=comp)[None]

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names), out_specs=P(names)))


CASES = [("mesh", "hierarchical", None), ("mesh", "hierarchical", codecs.int8()),
         ("split", "hierarchical", codecs.bf16()), ("split", "hierarchical", codecs.int8()),
         ("mesh", "ring", codecs.int8()), ("split", "ring", None)]


# the quick loop keeps 3 pieces on the unquantized mesh and the hierarchical split (~1-2 s each)
@pytest.mark.parametrize("place,algorithm,codec", [
    pytest.param(p, a, c, id=f"{p}-{a}-{c.name if c else 'none'}",
                 marks=pytest.mark.slow if (p, a) == ("split", "ring") or p == "mesh" and c else ())
    for p, a, c in CASES])
@pytest.mark.parametrize("pieces", [3, pytest.param(4, marks=pytest.mark.slow)])
def test_pieces_change_the_schedule_not_the_sum(place, algorithm, codec, pieces):
  # a length whose padding is the same for every number of pieces (8 members x lcm(3, 4) x 256),
  # so that each element meets the same partners in the same order; odd lengths: below
  x = np.random.default_rng(pieces).standard_normal((8, 8 * 12 * 256)).astype(np.float32)
  # a new jitted function under each topology: the topology is read at trace time
  with jaxring.use_topology(topology(1)):
    whole = np.asarray(reducer(place, algorithm, codec)(x))
  with jaxring.use_topology(topology(pieces)):
    piecewise = np.asarray(reducer(place, algorithm, codec)(x))
  np.testing.assert_array_equal(piecewise, whole)
  exact = x.astype(np.float64).sum(0)
  tol = 8 * np.finfo(np.float32).eps * np.abs(x).sum(0) if codec is None else \
      np.abs(x).sum(0).max() * (0.05 if codec.name == "int8" else 0.02)
  assert np.all(np.abs(piecewise - exact) <= tol)


@pytest.mark.parametrize("place,algorithm,codec", [  # mesh: ~1.5 s, in the slow loop
    pytest.param(p, a, c, id=f"{p}-{a}-{c.name}", marks=pytest.mark.slow if p == "mesh" else ())
    for p, a, c in CASES[1:4]])
def test_pieces_with_odd_lengths_stay_within_the_codec_bound(place, algorithm, codec):
  x = np.random.default_rng(1).standard_normal((8, 5003)).astype(np.float32)
  with jaxring.use_topology(topology(4)):
    got = np.asarray(reducer(place, algorithm, codec)(x))
  for row in got[1:]:
    np.testing.assert_array_equal(row, got[0])
  # int8: each of the <= 2 p encodings of an element errs by at most its block's max / 254
  bound = 2 * 8 * np.abs(x).sum(0).max() / (254 if codec.name == "int8" else 256)
  assert np.abs(got[0] - x.astype(np.float64).sum(0)).max() <= bound


def count_permutes(f, x) -> int:
  return sum(c.op == "collective-permute" for c in compiled_wire_bytes(f, x).collectives)


def test_pieces_split_every_hop_of_the_node_ring():
  x = jnp.zeros((8, 16384), jnp.float32)   # the node ring's 8 KiB of bf16: not gathered
  with jaxring.use_topology(topology(1)):
    one = count_permutes(reducer("mesh", "hierarchical", codecs.bf16()), x)
  with jaxring.use_topology(topology(4)):
    four = count_permutes(reducer("mesh", "hierarchical", codecs.bf16()), x)
  # the node ring's reduce-scatter has p_node - 1 = 1 hop; the local level (pieces=1) is unchanged
  assert four - one == 3, (one, four)


def test_psum_scatter_with_pieces_matches_lax():
  x = np.random.default_rng(0).standard_normal((8, 8 * 97)).astype(np.float32)
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AUTO,))

  def body(v, fn, **kw):
    return fn(v[0], "d", scatter_dimension=0, tiled=True, **kw)[None]

  ref = jax.jit(jax.shard_map(lambda v: body(v, jax.lax.psum_scatter), mesh=mesh,
                              in_specs=P("d"), out_specs=P("d")))
  with jaxring.use_topology(topology(4)):
    ours = jax.jit(jax.shard_map(lambda v: body(v, jaxring.psum_scatter, algorithm="ring"),
                                 mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    assert count_permutes(ours, x) == 7 * 4  # 7 hops of the 8-member ring, 4 pieces each
    np.testing.assert_allclose(np.asarray(ours(x)), np.asarray(ref(x)), rtol=1e-5, atol=1e-5)


def test_local_all_gather_carries_the_node_levels_int8():
  """After the node ring, the local level's all-gather (in shared memory: every member of it is
  in this process) moves the int8 payload, a quarter of the f32 bytes, and the result is decoded
  as it is gathered; no native all-gather spans the local level."""
  n = 1 << 16
  x = jnp.zeros((8, n), jnp.float32)
  with jaxring.use_topology(topology(1)):
    f = reducer("mesh", "hierarchical", codecs.int8())
    gathers = [c for c in compiled_wire_bytes(f, x).collectives if c.op == "all-gather"]
    hlo = f.lower(x).compile().as_text()
  assert not [c for c in gathers if c.group_size == 4], gathers
  # each member contributes the node-reduced n/4 elements of its local shard: int8 values and
  # one f32 scale per 256 (decoded first, they would be 4 n/4 bytes)
  # (the gather decodes as it copies: one call reads the codes and the scales of each member)
  operands = re.findall(r'custom_call_target="jaxring_local_all_gather_decode", '
                        r'operand_layout_constraints=\{(\w+)\[(\d+)\]\{0\}, (\w+)\[(\d+)\]', hlo)
  assert operands == [("s8", str(n // 4), "f32", str(n // 4 // 256))], operands


def ops_of(f, x) -> list[str]:
  return [c.op for c in compiled_wire_bytes(f, x).collectives]


@pytest.mark.parametrize("codec", [codecs.bf16(), codecs.int8(block_size=32)], ids=["bf16", "int8"])
def test_a_small_lossy_ring_is_one_all_gather_rounding_each_value_once(codec):
  """Under ring.GATHER_BELOW the ring gathers every member's encoded buffer and sums it: one
  collective, the sum of each member's decoded values (the ring would re-round partial sums)."""
  from jaxring._src.algorithms import engine, ring
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AUTO,))
  x = np.random.default_rng(3).standard_normal((8, 96)).astype(np.float32) * 100

  def body(v):
    binding = engine.bind(("d",), "psum")
    total, err = engine.all_reduce_flat(v[0], jnp.float32, binding, "ring", codec, want_error=True)
    return total[None], err[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=(P("d"), P("d"))))
  assert 7 * codec.wire_bytes(96) < ring.GATHER_BELOW
  assert ops_of(f, x) == ["all-gather"]
  total, err = map(np.asarray, f(x))
  decoded = x.astype(np.float64) - err          # each member's one encoding, as sent
  np.testing.assert_array_equal(decoded.astype(np.float32),
                                np.stack([codec.decode(codec.encode(jnp.asarray(r), jnp.float32),
                                                       jnp.float32) for r in x]))
  for row in total[1:]:
    np.testing.assert_array_equal(row, total[0])
  exact = decoded.sum(0)
  bound = 8 * np.finfo(np.float32).eps * np.abs(decoded).sum(0).max()
  assert np.abs(total[0] - exact).max() <= bound

  big = np.random.default_rng(4).standard_normal((8, 4096)).astype(np.float32)
  assert 7 * codec.wire_bytes(4096) >= ring.GATHER_BELOW
  assert ops_of(f, big).count("collective-permute") == 7   # the ring's reduce-scatter hops
