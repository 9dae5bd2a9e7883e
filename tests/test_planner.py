"""The alpha-beta model against hand-derived formulas, and what `auto` picks."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring._src import cost_model, profiles
from jaxring._src.algorithms.planner import MARGIN, make_plan
from jaxring._src.transport.inprocess import INPROCESS
from jaxring._src.transport.xla import XLA

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


def test_without_a_profile_auto_keeps_the_native_collective_even_across_unlike_levels():
  # the alpha-beta formulas alone said "hierarchical" at 1.41x gloo's time (docs/design.md)
  topo = jaxring.Topology((LOCAL, NODE))
  assert _plan(("node", "local"), (2, 4), 32 << 20, topo=topo).kind == "xla"
  assert _plan(("d",), (8,), 32 << 20, topo=topo).kind == "xla"


def _profile(axes, sizes, lines, codecs=None):
  """A profile with one line (alpha, beta) per algorithm, keyed as the planner keys them (over
  the mesh :func:`_plan` makes)."""
  from jaxring._src.algorithms import planner
  groups, _, _ = planner.levels_for(tuple(axes), tuple(sizes), mesh_names=tuple(axes))
  key = planner.codec_key([planner.codec_for(codecs, g.name, jnp.float32) for g in groups])
  return profiles.Profile(
      profiles.profile_key(axes, sizes, "xla", 1, "cpu"),
      tuple(profiles.Fit(a, key, alpha, beta) for a, (alpha, beta) in lines.items()))


def test_auto_follows_the_measured_profile_with_its_crossover():
  # native: cheap to start, slow per byte; hierarchical: the reverse; crossover at 1 MiB
  prof = _profile(("node", "local"), (2, 4), {"xla": (1e-4, 2e-9), "hierarchical": (1.1e-3, 1.05e-9),
                                              "ring": (5e-3, 3e-9)})
  with profiles.use_profile(prof):
    assert _plan(("node", "local"), (2, 4), 64 << 10).kind == "xla"
    assert _plan(("node", "local"), (2, 4), 32 << 20).kind == "hierarchical"
    assert _plan(("d",), (8,), 32 << 20).kind == "xla"   # another set of axes: not measured


def test_auto_leaves_its_default_only_for_a_measured_gain_above_the_margin():
  prof = _profile(("node", "local"), (2, 4), {"xla": (0.0, 1.0e-9), "hierarchical": (0.0, 0.98e-9)})
  with profiles.use_profile(prof):
    assert _plan(("node", "local"), (2, 4), 32 << 20).kind == "xla"   # 2%: noise
  prof = _profile(("node", "local"), (2, 4), {"xla": (0.0, 1.0e-9), "hierarchical": (0.0, 0.96e-9)})
  with profiles.use_profile(prof):
    assert _plan(("node", "local"), (2, 4), 32 << 20).kind == "hierarchical"


def test_auto_with_a_codec_reads_that_codecs_lines_only():
  int8 = jaxring.codecs.int8()
  comp = {"node": int8}
  prof = _profile(("node", "local"), (2, 4), {"ring": (1e-4, 1e-10), "hierarchical": (1e-3, 1e-9)},
                  codecs=comp)
  with profiles.use_profile(prof):
    assert _plan(("node", "local"), (2, 4), 32 << 20, compression=comp).kind == "ring"
    # bf16 was not measured: the default for a lossy codec over two levels
    bf = {"node": jaxring.codecs.bf16()}
    assert _plan(("node", "local"), (2, 4), 32 << 20, compression=bf).kind == "hierarchical"


def test_profile_round_trips_through_its_json_and_the_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXRING_CACHE_DIR", str(tmp_path))
  fit = profiles.Fit.from_points("ring", ("a",), [1e6, 2e6, 4e6], [0.003, 0.005, 0.009])
  assert fit.alpha == pytest.approx(1e-3) and fit.beta == pytest.approx(2e-9)
  prof = profiles.Profile(profiles.profile_key(("i",), (8,), "xla", 1, "cpu"), (fit,), "now")
  path = profiles.save_profile(prof)
  assert path.parent == tmp_path / "profiles" and json.loads(path.read_text())["fits"][0]["beta"]
  assert profiles.find_profile(prof.key) == prof
  monkeypatch.setenv("JAXRING_PROFILE", "off")
  assert profiles.find_profile(prof.key) is None
  monkeypatch.setenv("JAXRING_PROFILE", str(path))
  other = profiles.profile_key(("i",), (4,), "xla", 1, "cpu")
  assert profiles.find_profile(other) is None   # a profile of other axes is never used


def test_auto_with_lossy_codec_never_picks_native():
  class Lossy(jaxring.codecs.Codec):
    lossy = True
  assert _plan(("d",), (8,), 1 << 20, compression=Lossy()).kind == "ring"
  topo = jaxring.Topology((LOCAL, NODE))
  plan = _plan(("node", "local"), (2, 4), 1 << 20, compression={"node": Lossy()}, topo=topo)
  # one process: the fast level reduce-scatters in shared memory (transport/inprocess.py)
  assert plan.kind == "hierarchical" and plan.algos == ("xla", "ring")
  assert plan.transports == (INPROCESS, XLA)


@pytest.mark.skipif(not INPROCESS.available(), reason="needs the CPU extension")
def test_one_process_hierarchical_runs_the_fast_level_on_the_in_process_transport():
  # the in-process level is a transport: per-level "xla" there is its native collective
  plan = _plan(("node", "local"), (2, 4), 1 << 20, algorithm="hierarchical")
  assert [g.name for g in plan.groups] == ["local", "node"]
  assert plan.algos == ("xla", "xla") and plan.transports == (INPROCESS, XLA)
  spelled = _plan(("local", "node"), (4, 2), 1 << 20, algorithm={"local": "inprocess",
                                                                 "node": "auto"})
  assert spelled.transports == plan.transports and spelled.algos == plan.algos
  with pytest.warns(DeprecationWarning, match="in-process level is a transport.*'inprocess'"):
    old = _plan(("local", "node"), (4, 2), 1 << 20, algorithm={"local": "shm", "node": "auto"})
  assert old == spelled
  # "xla" on a level keeps meaning lax's collective through XLA, not the in-process one
  lax_level = _plan(("local", "node"), (4, 2), 1 << 20, algorithm={"local": "xla", "node": "ring"})
  assert lax_level.algos == ("xla", "ring") and lax_level.transports == (XLA, XLA)


@pytest.mark.skipif(not INPROCESS.available(), reason="needs the CPU extension")
def test_a_reduction_over_this_process_devices_alone_stays_in_shared_memory():
  # across processes XLA:CPU would run lax's collective over gloo's loopback (docs/design.md)
  for algorithm in ("auto", "hierarchical", {"local": "inprocess"}, {"local": "auto"}):
    plan = _plan(("local",), (8,), 1 << 20, algorithm=algorithm, mp=True)
    assert plan.kind == "hierarchical" and plan.algos == ("xla",), algorithm
    assert plan.transports == (INPROCESS,), algorithm
  # one process: lax's collective is in-process already, and the default keeps it
  assert _plan(("local",), (8,), 1 << 20).kind == "xla"
  assert _plan(("local",), (8,), 1 << 20, {"local": "inprocess"}).transports == (INPROCESS,)
  # asked for lax's collective, a codec, or a level spanning processes: not in shared memory
  assert _plan(("local",), (8,), 1 << 20, algorithm="xla", mp=True).kind == "xla"
  int8 = _plan(("local",), (8,), 1 << 20, compression=jaxring.codecs.int8(), mp=True)
  assert int8.kind == "ring" and int8.transports == (XLA,)
  topo = jaxring.Topology((jaxring.Level("local", 8),))
  assert _plan(("local",), (8,), 1 << 20, mp=True, topo=topo).kind == "xla"


def test_a_level_the_in_process_transport_cannot_serve_is_refused_with_the_fix():
  want = r"level 'node' cannot use 'inprocess'.*CPU backend.*level below the slowest.*'ring'"
  with pytest.raises(ValueError, match=want):
    _plan(("local", "node"), (4, 2), 1 << 20, algorithm={"local": "ring", "node": "inprocess"})
  topo = jaxring.Topology((LOCAL, NODE))   # a local level of devices in several processes
  with pytest.raises(ValueError, match="level 'local' cannot use 'inprocess'.*one process"):
    _plan(("local", "node"), (4, 2), 1 << 20, algorithm={"local": "inprocess", "node": "ring"},
          mp=True, topo=topo)
  with pytest.raises(ValueError, match=r"one of \('auto', 'xla', 'ring', 'inprocess'\)"):
    jaxring.psum(jnp.ones(8), ("local", "node"), algorithm={"local": "shared", "node": "ring"})


def test_cross_process_levels_never_use_native_reduce_scatter():
  # lax.psum_scatter over gloo returned corrupt results across processes (ENVIRONMENT.md)
  topo = jaxring.Topology((LOCAL, NODE))   # a local level of devices in several processes
  plan = _plan(("node", "local"), (2, 4), 1 << 20, algorithm="hierarchical", mp=True, topo=topo)
  assert plan.algos == ("ring", "xla") and plan.transports == (XLA, XLA)


def test_mpi_slow_level_uses_the_ring_not_mpi_allreduce():
  # MPICH's MPI_Allreduce lost to the Sendrecv ring on the node level (docs/design.md)
  from jaxring._src.transport.groups import Group, Hierarchy
  from jaxring._src.transport.mpi import MPI_TRANSPORT
  from jaxring._src.transport.xla import XLA
  groups = (Group(("local",), 4, 1, 4, "local"), Group(("node",), 2, 1, 2, "node"))
  for transport, slow in ((MPI_TRANSPORT, "ring"), (XLA, "xla")):
    h = Hierarchy(groups, (LOCAL, NODE), (1, 4), Group((), 8, 1, 8, "d"), transport)
    plan = make_plan(("d",), (8,), 32 << 20, jnp.float32, "hierarchical", None, hierarchy=h)
    assert plan.algos == ("ring", slow) and plan.transports == (transport,) * 2, transport


def test_without_a_profile_mpi_runs_the_hierarchical_plan_from_1_mib():
  # calibrated on the emulated cluster's MPI shape: MPI_Allreduce through mpi4jax 920 ms at
  # 32 MiB, the hierarchical plan 532; level at 1 MiB, the native one faster below
  from jaxring._src.transport.groups import Group, Hierarchy
  from jaxring._src.transport.mpi import MPI_TRANSPORT
  from jaxring._src.transport.xla import XLA
  groups = (Group(("local",), 4, 1, 4, "local"), Group(("node",), 2, 1, 2, "node"))
  for transport, large in ((MPI_TRANSPORT, "hierarchical"), (XLA, "xla")):
    h = Hierarchy(groups, (LOCAL, NODE), (1, 4), Group((), 8, 1, 8, "d"), transport)
    with profiles.use_profile(None):
      plan = lambda n: make_plan(("d",), (8,), n, jnp.float32, "auto", None, hierarchy=h).kind
      assert (plan(64 << 10), plan(1 << 20), plan(32 << 20)) == ("xla", large, large), transport
  flat = Hierarchy(groups[:1], (LOCAL,), (1,), Group((), 4, 1, 4, "d"), MPI_TRANSPORT)
  with profiles.use_profile(None):   # one level: MPI_Allreduce (no hierarchical plan)
    assert make_plan(("d",), (4,), 32 << 20, jnp.float32, "auto", None, hierarchy=flat).kind == "xla"


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

  def reduce_scatter(self, buf, plan, dtype, order=None):
    return self.ring.reduce_scatter(buf, plan, dtype, order)

  def all_gather(self, payload, plan, order=None):
    return self.ring.all_gather(payload, plan, order)

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


@pytest.mark.slow   # times every candidate plan (~6 s)
def test_calibrate_measures_every_candidate_and_auto_then_follows_it(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXRING_CACHE_DIR", str(tmp_path))
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  with pytest.raises(ValueError, match="at least two sizes"):
    jaxring.calibrate(mesh, sizes=(1 << 10,))
  prof = jaxring.calibrate(mesh, sizes=(4 << 10, 64 << 10), codecs=("none", "int8"), reps=1)
  int8 = "Int8(block_size=256, stochastic=False)"
  assert {(f.algorithm, f.codecs[-1]) for f in prof.fits} == {
      ("xla", "Codec()"), ("ring", "Codec()"), ("hierarchical", "Codec()"), ("ring", int8),
      ("hierarchical", int8)}
  assert all(len(f.seconds) == 2 and min(f.seconds) > 0 and f.beta >= 0 for f in prof.fits)
  assert json.loads(profiles.profile_path(prof.key).read_text())["key"]["axes"] == [
      "local", "node"]   # sorted: the same axes in any order run the same plans
  from jaxring._src.algorithms.planner import find_profile_for
  assert find_profile_for(("local", "node"), (4, 2)) == prof == find_profile_for(
      ("node", "local"), (2, 4))
  # the next call reuses the cached profile; auto picks the fitted minimum, and the result is
  # lax.psum's whatever it picked
  assert jaxring.calibrate(mesh, sizes=(1 << 10, 2 << 10)) == prof
  for nbytes in (4 << 10, 64 << 10, 8 << 20):
    lines = {f.algorithm: f.predict(nbytes) for f in prof.fits if f.codecs[-1] == "Codec()"}
    best = min(lines, key=lines.get)
    want = best if lines[best] < (1 - MARGIN) * lines["xla"] else "xla"   # auto's margin
    assert _plan(("node", "local"), (2, 4), nbytes).kind == want
  x = jax.device_put(jnp.arange(8 * 4096, dtype=jnp.float32) % 13,
                     jax.NamedSharding(mesh, P(("node", "local"))))
  run = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(("node", "local")),
                                         out_specs=P()))(x)
  np.testing.assert_array_equal(run(lambda v: jaxring.psum(v, ("node", "local"))),
                                run(lambda v: jax.lax.psum(v, ("node", "local"))))


@pytest.mark.slow   # times the chunk norms' plans (~2 s)
def test_topk_chunk_norms_take_the_lossless_plan_auto_measured_fastest():
  """The norms' all-reduce is ``auto``'s lossless choice: native over all 8 devices without a
  profile; the hierarchical plan (groups of 2 across the node level) where it measured faster.
  The chosen chunks, and so the sums, are the same."""
  import re
  mesh = jax.make_mesh((2, 4), ("node", "local"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  codec = jaxring.codecs.topk_chunks(0.25, chunk_size=8)
  x = jax.random.normal(jax.random.key(3), (8, 512), jnp.float32)

  def run():
    f = jax.jit(jax.shard_map(
        lambda v: jaxring.psum(v[0], ("node", "local"), algorithm="hierarchical",
                               compression={"node": codec})[None],
        mesh=mesh, in_specs=P(("node", "local")), out_specs=P(("node", "local")),
        check_vma=False))
    text = f.lower(x).as_text()
    every = r"all_reduce.*\n?.*replica_groups = dense<\[\[0, 1, 2, 3, 4, 5, 6, 7\]\]>"
    everyone = len(re.findall(every, text))
    return np.asarray(f(x)), everyone

  native_out, native_calls = run()
  prof = _profile(("node", "local"), (2, 4), {"xla": (1e-2, 1e-9), "hierarchical": (1e-3, 1e-9),
                                              "ring": (5e-3, 1e-9)})
  with profiles.use_profile(prof):
    planned_out, planned_calls = run()
  assert native_calls == 1 and planned_calls == 0
  np.testing.assert_allclose(planned_out, native_out, rtol=1e-6, atol=1e-6)
  total = np.asarray(x, np.float64).sum(0)
  sent = native_out[0] != 0
  assert 0 < sent.mean() <= 0.3                       # a quarter of the chunks, summed exactly
  np.testing.assert_allclose(native_out[0][sent], total[sent], rtol=1e-5, atol=1e-5)
