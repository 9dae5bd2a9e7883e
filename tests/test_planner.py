"""The alpha-beta model against hand-derived formulas, and what `auto` picks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring._src import cost_model
from jaxring._src.algorithms.planner import make_plan

LOCAL = jaxring.Level("local", 4, 100e9, 5e-6)
NODE = jaxring.Level("node", 2, 1.25e8, 1e-4)


def test_ring_formulas_by_hand():
  n, p, a, bw = 32 << 20, 8, 1e-4, 1.25e8
  assert cost_model.ring_all_reduce(n, p, a, bw) == pytest.approx(14 * a + 2 * 7 / 8 * n / bw)
  assert cost_model.ring_reduce_scatter(n, p, a, bw, 0.25) == pytest.approx(7 * a + 7 / 8 * n / 4 / bw)
  assert cost_model.ring_all_reduce(n, 1, a, bw) == 0.0
  # BlueConnect: the slow level carries n / p_local
  t = cost_model.hierarchical_all_reduce(n, [LOCAL, NODE], [1.0, 0.25])
  want = (2 * 3 * 5e-6 + 2 * 3 / 4 * n / 100e9) + (2 * 1e-4 + 2 * 1 / 2 * (n / 4) * 0.25 / 1.25e8)
  assert t == pytest.approx(want)
  assert cost_model.link_bound(n, 4, bw, 0.5) == pytest.approx(2 * 3 / 4 * n * 0.5 / bw)


def test_native_is_one_operation_in_process_and_a_slow_ring_across_levels():
  n = 1 << 20
  assert cost_model.native_all_reduce(n, [LOCAL]) == pytest.approx(5e-6 + 2 * 3 / 4 * n / 100e9)
  assert cost_model.native_all_reduce(n, [LOCAL, NODE]) == pytest.approx(
      cost_model.ring_all_reduce(n, 8, 1e-4, 1.25e8))


def _plan(axes, sizes, nbytes, algorithm="auto", compression=None, topo=None, mp=False):
  mesh = jax.make_mesh(tuple(sizes), tuple(axes), axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
  out = {}
  def body(v):
    out["plan"] = make_plan(tuple(axes), tuple(sizes), nbytes, jnp.float32, algorithm, compression,
                            multi_process=mp)
    return v
  ctx = jaxring.use_topology(topo) if topo else jaxring.use_topology(jaxring.default_topology())
  with ctx:
    jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P()), jnp.ones(1))
  return out["plan"]


@pytest.mark.parametrize("nbytes", [4 << 10, 1 << 20, 32 << 20, 128 << 20])
def test_auto_picks_native_on_one_host(nbytes):
  assert _plan(("d",), (8,), nbytes).kind == "xla"
  assert _plan(("node", "local"), (2, 4), nbytes).kind == "xla"


def test_auto_picks_hierarchical_when_levels_differ_and_messages_are_large():
  topo = jaxring.Topology((LOCAL, NODE))
  assert _plan(("node", "local"), (2, 4), 32 << 20, topo=topo).kind == "hierarchical"
  big = _plan(("d",), (8,), 32 << 20, topo=topo)
  assert big.kind == "hierarchical" and [g.stride for g in big.groups] == [1, 4]


def test_auto_with_lossy_codec_never_picks_native():
  class Lossy(jaxring.codecs.Codec):
    lossy = True
  assert _plan(("d",), (8,), 1 << 20, compression=Lossy()).kind == "ring"
  topo = jaxring.Topology((LOCAL, NODE))
  plan = _plan(("node", "local"), (2, 4), 1 << 20, compression={"node": Lossy()}, topo=topo)
  assert plan.kind == "hierarchical" and plan.algos == ("xla", "ring")


def test_cross_process_levels_never_use_native_reduce_scatter():
  # lax.psum_scatter over gloo returned corrupt results across processes (ENVIRONMENT.md)
  plan = _plan(("node", "local"), (2, 4), 1 << 20, algorithm="hierarchical", mp=True)
  assert plan.algos == ("ring", "xla")


def test_mpi_slow_level_uses_the_ring_not_mpi_allreduce():
  # MPICH's MPI_Allreduce lost to the Sendrecv ring on the node level (docs/design.md)
  from jaxring._src.transport.groups import Hierarchy
  from jaxring._src.transport.groups import Group
  from jaxring._src.transport.mpi import MPI_TRANSPORT
  from jaxring._src.transport.xla import XLA
  groups = (Group(("local",), 4, 1, 4, "local"), Group(("node",), 2, 1, 2, "node"))
  for transport, slow in ((MPI_TRANSPORT, "ring"), (XLA, "xla")):
    h = Hierarchy(groups, (LOCAL, NODE), (1, 4), Group((), 8, 1, 8, "d"), transport)
    plan = make_plan(("d",), (8,), 32 << 20, jnp.float32, "hierarchical", None, hierarchy=h)
    assert plan.algos == ("ring", slow), transport


def test_auto_compiles_to_exactly_lax_psum_on_one_host():
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  x = jnp.ones(8 * 1024)
  hlo = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P())).lower(
      x).compile().as_text()
  ours = hlo(lambda v: jaxring.psum(v, "d"))
  ref = hlo(lambda v: jax.lax.psum(v, "d"))
  strip = lambda t: [l for l in t.splitlines() if "all-reduce" in l]
  assert strip(ours) and len(strip(ours)) == len(strip(ref))


def test_topology_construction_and_errors():
  topo = jaxring.Topology((LOCAL, NODE))
  assert topo.size == 8 and topo.strides() == (1, 4) and topo.names == ("local", "node")
  assert jaxring.Topology.from_processes().names == ("local",)
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  assert jaxring.Topology.from_mesh(mesh).names == ("local", "node")
  with pytest.raises(ValueError, match="size must be a positive integer"):
    jaxring.Level("x", 0)
  with pytest.raises(ValueError, match="names must be unique"):
    jaxring.Topology((LOCAL, LOCAL))
  with pytest.raises(TypeError, match="expected a jaxring.Topology"):
    jaxring.set_default_topology("2x4")
  x = jnp.ones(8)
  with jaxring.use_topology(jaxring.Topology((jaxring.Level("local", 3), NODE))):
    # a topology that does not factor the axis is ignored for that axis: one ring
    f = jax.jit(jax.shard_map(lambda v: jaxring.psum(v, "d", algorithm="hierarchical"),
                              mesh=jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,)),
                              in_specs=P("d"), out_specs=P()))
    np.testing.assert_array_equal(f(x), [8.0])


class _BackwardRing:
  """A new algorithm in a few lines: the ring, each member's chunks handed out in reverse."""

  name = "backward_ring"

  def __init__(self):
    from jaxring._src.algorithms import ring
    self.ring = ring.Ring()

  def plan(self, request):
    import dataclasses
    return dataclasses.replace(self.ring.plan(request), kind=self.name)

  def all_reduce(self, buf, plan, dtype, *, want_error):
    out, err = self.ring.all_reduce(buf[::-1], plan, dtype, want_error=want_error)
    return out[::-1], None if err is None else err[::-1]

  def reduce_scatter(self, buf, plan, dtype):
    return self.ring.reduce_scatter(buf, plan, dtype)

  def all_gather(self, payload, plan):
    return self.ring.all_gather(payload, plan)

  def chunk_order(self, plan):
    return self.ring.chunk_order(plan)


def test_a_registered_algorithm_runs_everywhere_algorithm_is_accepted():
  from jaxring._src.algorithms import base

  base.register(_BackwardRing())
  try:
    mesh = jax.make_mesh((8,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.device_put(jnp.arange(8 * 1000, dtype=jnp.float32).reshape(8, 1000) % 97,
                       jax.NamedSharding(mesh, P("i")))
    f = jax.jit(jax.shard_map(
        lambda v: (jaxring.psum(v, "i", algorithm="backward_ring"),
                   jaxring.psum_scatter(v, "i", scatter_dimension=1, tiled=True,
                                        algorithm="backward_ring"),
                   jaxring.all_gather(v, "i", algorithm="backward_ring", tiled=True)),
        mesh=mesh, in_specs=P("i"), out_specs=(P("i"), P("i"), P("i"))))
    g = jax.jit(jax.shard_map(
        lambda v: (jax.lax.psum(v, "i"), jax.lax.psum_scatter(v, "i", scatter_dimension=1,
                                                              tiled=True),
                   jax.lax.all_gather(v, "i", tiled=True)),
        mesh=mesh, in_specs=P("i"), out_specs=(P("i"), P("i"), P("i"))))
    for got, want in zip(f(x), g(x)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    hlo = f.lower(x).as_text()
    assert "reverse" in hlo   # the new algorithm's all-reduce ran, not the ring's
  finally:
    base._REGISTRY.pop("backward_ring")
  with pytest.raises(ValueError, match=r"one of \('auto', 'xla', 'ring', 'hierarchical'\)"):
    jaxring.psum(jnp.ones(3), "i", algorithm="backward_ring")
