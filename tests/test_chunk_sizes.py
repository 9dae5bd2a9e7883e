"""Nonsense sizes for top-k chunks raise ValueError instead of aborting the process.

XLA aborts (SIGABRT, "overflow in static extent product") when asked for a shape whose byte size
overflows int64, and an abort cannot be caught: each case runs in its own process, so that an abort
fails the test instead of killing pytest.
"""
import subprocess
import sys
import textwrap

import pytest

import multiproc as mp

# Each case ends by printing the exception it raised; reaching XLA with the shape would abort.
_PRELUDE = """
import jax, jax.numpy as jnp
import jaxring
from jaxring._src.ext import chunks
from jax.sharding import NamedSharding, PartitionSpec as P
"""

CASES = {
    "codec_huge_chunk": "jaxring.codecs.topk_chunks(chunk_size=2**62)",
    "codec_chunk_over_int32": "jaxring.codecs.topk_chunks(chunk_size=2**31)",
    "gather_huge_chunk": "chunks.gather_chunks(jnp.arange(5.0), jnp.array([0], jnp.int32), 2**62)",
    "gather_huge_int8": ("chunks.gather_chunks(jnp.arange(5, dtype=jnp.int8), "
                         "jnp.array([0], jnp.int32), 2**63)"),
    "gather_many_chunks": ("chunks.gather_chunks(jnp.arange(5.0), jnp.zeros(4, jnp.int32), "
                           "2**61)"),
    "gather_traced_idx": ("jax.jit(lambda i: chunks.gather_chunks(jnp.arange(5.0), i, 2**62))("
                          "jnp.array([0], jnp.int32))"),
}


def _run(body: str, devices: int = 1) -> subprocess.CompletedProcess:
  code = _PRELUDE + textwrap.dedent(body)
  env = mp.clean_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=120, cwd=mp.REPO)


@pytest.mark.timeout(150)
@pytest.mark.slow   # each case in a fresh process (~1-2 s each)
@pytest.mark.parametrize("case", sorted(CASES))
def test_huge_chunk_size_raises_value_error(case):
  r = _run(f"""
      try:
        {CASES[case]}
      except ValueError as e:
        print("ValueError:", e)
      """)
  assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
  assert "ValueError:" in r.stdout and "chunk_size" in r.stdout, r.stdout + r.stderr[-3000:]


@pytest.mark.timeout(150)
def test_gradient_of_chunk_norms_with_a_chunk_longer_than_x():
  # The backward pass once built a chunks * chunk_size shape: 8 GiB for a 5-value x with the
  # largest chunk_size the wrappers accept (2**31 - 1).
  r = _run("""
      x = jnp.array([3.0, 4.0, 0.0, 12.0, 5.0])
      g = jax.grad(lambda x: chunks.chunk_norms(x, 2**31 - 1).sum())(x)
      print("GRAD", [round(v, 6) for v in g.tolist()])
      """)
  assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
  norm = (9 + 16 + 144 + 25) ** 0.5  # one chunk holds all of x: d|x|/dx = x / |x|
  want = [round(v / norm, 6) for v in (3.0, 4.0, 0.0, 12.0, 5.0)]
  assert f"GRAD {want}" in r.stdout, r.stdout + r.stderr[-3000:]


@pytest.mark.parametrize("kwargs", [
    dict(density=float("nan")), dict(density=float("inf")), dict(density=0.0),
    dict(density=-0.5), dict(density=1.5), dict(density=True), dict(density="0.1"),
    dict(density=None), dict(chunk_size=0), dict(chunk_size=-4), dict(chunk_size=True),
    dict(chunk_size=4.0), dict(chunk_size=2**31), dict(chunk_size=2**62),
    dict(inner="int8"),
])
def test_topk_chunks_refuses_nonsense_arguments(kwargs):
  import jaxring
  with pytest.raises(ValueError, match="topk_chunks: " + next(iter(kwargs))):
    jaxring.codecs.topk_chunks(**kwargs)


def test_topk_chunks_accepts_numpy_scalars_and_the_largest_chunk():
  import numpy as np

  import jaxring
  c = jaxring.codecs.topk_chunks(np.float32(0.25), np.int64(2**31 - 1))
  assert (c.density, c.chunk_size) == (0.25, 2**31 - 1)
  assert type(c.density) is float and type(c.chunk_size) is int
