"""Several axes are reduced as their levels say, whatever order the caller names them in.

The native collective's replica group lists the members in the order of the axis names, and
gloo's and NCCL's rings follow that list: ``lax.psum(g, ("local", "node"))`` crosses a node link
at every hop, ``("node", "local")`` once per node (2.0x apart on the emulated cluster). jaxring's
plans name the slowest level first for every order the caller writes; the sums stay lax's.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxring
import multiproc as mp

AUTO = jax.sharding.AxisType.Auto
MESH_AXES = ("node", "local")   # node-major, as jaxring.distributed.process_mesh lays it out


def _mesh():
  return jax.make_mesh((4, 2), MESH_AXES, axis_types=(AUTO, AUTO))


def _compiled(body):
  x = jnp.arange(8 * 64, dtype=jnp.float32).reshape(8, 64) / 7
  f = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=P(MESH_AXES), out_specs=P()))
  return f(x), f.lower(x).compile().as_text()


def _replica_groups(hlo: str) -> list[str]:
  return re.findall(r"all-reduce(?:-start)?\(.*?replica_groups=(\{\{[\d,{}]*\}\})", hlo)


LAX_FAST = "{{0,1,2,3,4,5,6,7}}"   # lax.psum(g, ("node", "local")): a node's devices adjacent
LAX_SLOW = "{{0,2,4,6,1,3,5,7}}"   # lax.psum(g, ("local", "node")): every hop crosses nodes


def test_lax_itself_orders_the_group_as_the_names_are_written():
  assert _replica_groups(_compiled(lambda v: lax.psum(v, ("node", "local")))[1]) == [LAX_FAST]
  assert _replica_groups(_compiled(lambda v: lax.psum(v, ("local", "node")))[1]) == [LAX_SLOW]


@pytest.mark.parametrize("topology", ["mesh", "levels"])
@pytest.mark.parametrize("algorithm", ["auto", "xla"])
@pytest.mark.parametrize("axes", [("local", "node"), ("node", "local")])
def test_the_native_plan_names_the_slowest_level_first(axes, algorithm, topology):
  """Without a profile: the levels from the mesh (its last axis fastest), or from a topology
  naming the axes; the sum is lax's."""
  topo = jaxring.Topology((jaxring.Level("local", 2), jaxring.Level("node", 4, 1.25e8, 1e-4)))
  with jaxring.use_topology(topo if topology == "levels" else jaxring.default_topology()):
    got, hlo = _compiled(lambda v: jaxring.psum(v, axes, algorithm=algorithm))
  assert _replica_groups(hlo) == [LAX_FAST]
  want, _ = _compiled(lambda v: lax.psum(v, axes))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_a_topology_that_says_otherwise_reorders_the_native_group():
  """The levels decide, not the mesh's axis order: a topology whose slow level is ``local``."""
  topo = jaxring.Topology((jaxring.Level("node", 4), jaxring.Level("local", 2, 1.25e8, 1e-4)))
  with jaxring.use_topology(topo):
    _, hlo = _compiled(lambda v: jaxring.psum(v, ("node", "local")))
  assert _replica_groups(hlo) == [LAX_SLOW]


def test_pmean_and_the_tangents_of_a_ring_take_the_same_order():
  ring = lambda u: jaxring.pmean(u, ("local", "node"), algorithm="ring")
  # the ring moves the values by ppermute; lax.psum reduces their tangents, slowest level first
  _, hlo = _compiled(lambda v: jax.jvp(ring, (v,), (2 * v,))[1])
  assert _replica_groups(hlo) == [LAX_FAST]
  _, hlo = _compiled(lambda v: jaxring.pmean(v, ("local", "node")))
  assert _replica_groups(hlo) == [LAX_FAST]


def test_a_profile_is_found_for_the_same_axes_in_any_order(tmp_path, monkeypatch):
  from jaxring._src import profiles
  from jaxring._src.algorithms.planner import find_profile_for
  monkeypatch.setenv("JAXRING_CACHE_DIR", str(tmp_path))
  key = profiles.profile_key(("node", "local"), (4, 2), "xla", 1, jax.default_backend())
  fit = profiles.Fit("hierarchical", ("Codec()", "Codec()"), 0.0, 1e-12)
  prof = profiles.Profile(key, (fit,), "now")
  profiles.save_profile(prof)
  assert find_profile_for(("local", "node"), (2, 4)) == prof
  assert find_profile_for(("node", "local"), (4, 2)) == prof
  assert find_profile_for(("node", "local"), (2, 4)) is None    # other sizes: another mesh
  # a profile written with the caller's order (before keys were sorted) is found too
  old = profiles.Profile(dict(key, axes=["node", "local"], sizes=[4, 2]), (fit,), "then")
  with profiles.use_profile(old):
    assert find_profile_for(("local", "node"), (2, 4)) == old


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_across_processes_the_native_group_goes_process_by_process():
  """2 processes x 2 devices (jax.distributed, gloo): ``jaxring.psum(g, ("local", "node"))``
  compiles to the replica group of ``lax.psum(g, ("node", "local"))``, and sums as numpy does."""
  port = mp.free_port()
  env = lambda i: mp.clean_env(JAXRING_COORDINATOR=f"127.0.0.1:{port}", JAXRING_NUM_PROCESSES=2,
                               JAXRING_PROCESS_ID=i, JAXRING_LOCAL_DEVICE_COUNT=2)
  results = mp.spawn(2, lambda i: mp.python_worker("dist_axis_order.py"), env, timeout=150)
  mp.assert_all_ok(results)
  for r in results:
    groups = dict(re.findall(r"groups (\S+): (\S+)", r.stdout))
    assert groups["lax(node,local)"] == "{{0,1,2,3}}", mp.report(results)
    assert groups["lax(local,node)"] == "{{0,2,1,3}}", mp.report(results)
    for name in ("jaxring(local,node)", "jaxring(local,node)/xla", "jaxring(node,local)"):
      assert groups[name] == "{{0,1,2,3}}", mp.report(results)
    assert f"process {r.rank}: sums OK" in r.stdout, mp.report(results)
