"""The in-process level as a transport: its spellings, its custom calls, what it lacks; 8 CPU devices."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring._src.transport.groups import Group
from jaxring._src.transport.inprocess import INPROCESS
from jaxring._src.transport.mpi import MPI_TRANSPORT
from jaxring._src.transport.xla import XLA

pytestmark = pytest.mark.skipif(not INPROCESS.available(), reason="needs the CPU extension")

AXES = ("node", "local")


def _step(fn, check_vma=True, out=None):
  out = P() if out is None else out
  mesh = jax.make_mesh((2, 4), AXES, axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  step = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(AXES), out_specs=out,
                               check_vma=check_vma))
  return step, (lambda x: jax.device_put(x, jax.NamedSharding(mesh, P(AXES))))


def _psum(algorithm, compression=None):
  return lambda v: jaxring.psum(v, AXES, algorithm=algorithm, compression=compression)


def _x(n=8 * 4096, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(n), jnp.float32)


def _bits(a):
  return np.asarray(a).view(np.uint32)


def test_the_deprecated_shm_spelling_warns_and_reduces_to_the_same_bits():
  x = _x()
  step, put = _step(_psum({"local": "shm", "node": "ring"}))
  with pytest.warns(DeprecationWarning, match=r"\{'local': 'inprocess'\}"):
    old = step(put(x))
  new = _step(_psum({"local": "inprocess", "node": "ring"}))[0](put(x))
  auto = _step(_psum({"local": "auto", "node": "ring"}))[0](put(x))
  np.testing.assert_array_equal(_bits(old), _bits(new))
  np.testing.assert_array_equal(_bits(old), _bits(auto))
  lax_sum = _step(lambda v: jax.lax.psum(v, AXES))[0](put(x))
  np.testing.assert_allclose(np.asarray(old), np.asarray(lax_sum), rtol=1e-6, atol=1e-5)
  # the default per-level plan (hierarchical: local in-process, node native) alike
  with pytest.warns(DeprecationWarning):
    old = _step(_psum({"local": "shm", "node": "auto"}))[0](put(x))
  hier = _step(_psum("hierarchical"))[0](put(x))
  np.testing.assert_array_equal(_bits(old), _bits(hier))
  np.testing.assert_allclose(np.asarray(hier), np.asarray(lax_sum), rtol=1e-6, atol=1e-5)


def _custom_calls(fn, x, out=None, check_vma=True):
  step, put = _step(fn, check_vma, out)
  hlo = step.lower(put(x)).compile().as_text()
  return set(re.findall(r"jaxring_local_\w+", hlo)), hlo


@pytest.mark.parametrize("check_vma", [True, False])
def test_the_compiled_programs_keep_their_in_process_custom_calls(check_vma):
  x = _x(8 * 1024)
  rs_ag = {"jaxring_local_reduce_scatter", "jaxring_local_all_gather"}
  for algorithm in ({"local": "inprocess", "node": "ring"}, "hierarchical"):
    assert _custom_calls(_psum(algorithm), x, check_vma=check_vma)[0] == rs_ag, algorithm
  int8 = {"node": jaxring.codecs.int8(block_size=64)}
  assert _custom_calls(_psum("hierarchical", int8), x, check_vma=check_vma)[0] == {
      "jaxring_local_reduce_scatter", "jaxring_local_all_gather_decode"}
  scatter = lambda v: jaxring.psum_scatter(v, AXES, algorithm="hierarchical", tiled=True)
  assert _custom_calls(scatter, x, P(AXES), check_vma)[0] == {"jaxring_local_reduce_scatter"}
  gather = lambda v: jaxring.all_gather(v, AXES, algorithm="hierarchical", tiled=True)
  assert _custom_calls(gather, x, P(AXES), False)[0] == {"jaxring_local_all_gather"}
  # "xla" on the level stays lax's collective through XLA
  calls, hlo = _custom_calls(_psum({"local": "xla", "node": "ring"}), x, check_vma=check_vma)
  assert not calls and " reduce-scatter(" in hlo


def test_the_transport_declares_what_it_lacks_and_raises_if_asked():
  group = Group(("local",), 4, 1, 4, "local")
  assert INPROCESS.name == "inprocess" and INPROCESS.takes_order
  assert INPROCESS.has_reduce_scatter and not INPROCESS.spans_processes
  assert not XLA.takes_order and not MPI_TRANSPORT.takes_order
  assert XLA.spans_processes and MPI_TRANSPORT.spans_processes
  with pytest.raises(NotImplementedError, match="no ring step over level 'local'"):
    INPROCESS.shift((jnp.ones(4),), group)



def test_its_all_reduce_over_one_level_equals_lax_psum_typed_invariant():
  # what a reduction over this process's devices alone runs in a multi-process job
  group = Group(AXES, 8, 1, 8, "local")
  x = _x()
  step, put = _step(lambda v: INPROCESS.all_reduce(v, group))
  got = step(put(x))
  want = _step(lambda v: jax.lax.psum(v, AXES))[0](put(x))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-5)
  rows = np.asarray(x, np.float64).reshape(8, -1).sum(0)
  np.testing.assert_allclose(np.asarray(got), rows, rtol=1e-5, atol=1e-4)
  assert _custom_calls(lambda v: INPROCESS.all_reduce(v, group), x)[0] == {
      "jaxring_local_reduce_scatter", "jaxring_local_all_gather"}
