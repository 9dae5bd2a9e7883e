"""jaxring's collectives over MPI (mpi4jax), one process per device under ``mpirun``.

Each test launches tests/workers/mpi_collectives.py with the venv's ``mpirun`` (MPICH's hydra)
under a hard timeout. Every rank checks every call against a float64 NumPy reference of all ranks'
inputs (see the worker's docstring for the bounds); 30 calls per configuration at 2 ranks, 15 at 4
(where fewer configurations run: FOUR_RANKS).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import multiproc as mp

pytestmark = pytest.mark.multiprocess

MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
ALGORITHMS = ("xla", "ring", "hierarchical", "auto")
CODECS = ("none", "bf16", "fp16", "int8", "topk")
CALLS = 30


def _mpi_missing() -> str | None:
  if not os.path.exists(MPIRUN) and shutil.which("mpirun") is None:
    return "no mpirun next to this interpreter or on PATH (pip install mpich)"
  try:
    import mpi4jax  # noqa: F401
  except ImportError as exc:
    return f"mpi4jax is not installed ({exc}); see jaxring/_src/transport/mpi.py"
  return None


skip_without_mpi = pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))


def mpirun(n: int, *worker_args: str, timeout: float, launcher_args: tuple = (),
           worker: str = "mpi_collectives.py", **env: str) -> tuple[int | None, str, float]:
  """(exit status or None when killed at the timeout, output, seconds)."""
  cmd = [MPIRUN if os.path.exists(MPIRUN) else "mpirun", *launcher_args, "-n", str(n),
         *mp.python_worker(worker, *worker_args)]
  # one CPU device and one compute thread per rank: the ranks share 2 cores
  env = mp.clean_env(XLA_FLAGS="--xla_cpu_multi_thread_eigen=false "
                     "intra_op_parallelism_threads=1", **env)
  t0 = time.monotonic()
  p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       start_new_session=True)
  try:
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out, time.monotonic() - t0
  except subprocess.TimeoutExpired:
    mp._kill_session(p)
    return None, p.stdout.read() if p.stdout else "", time.monotonic() - t0


# 4 ranks: hierarchical (two levels only there) with every codec; the others' programs differ from
# 2 ranks' in the number of hops only, which the codec does not change: each with one lossless and
# one lossy codec (every codec with them at 2 ranks). Compilation dominates (2 to 5 s a config).
FOUR_RANKS = ("xla/none", "ring/none", "ring/int8", *(f"hierarchical/{c}" for c in CODECS),
              "auto/none", "auto/int8")


def _configs(n):
  if n == 2:   # one level: the hierarchical plan is the ring's program (Hierarchical.plan)
    return [f"{a}/{c}" for a in ALGORITHMS if a != "hierarchical"
            for c in (CODECS if a != "xla" else ("none",))]
  return list(FOUR_RANKS)


@skip_without_mpi
@pytest.mark.timeout(200)
@pytest.mark.parametrize("n", [2, 4])
def test_every_algorithm_and_codec_matches_float64_reference(n):
  configs = _configs(n)
  calls = CALLS if n == 2 else CALLS // 2
  args = ["--calls", str(calls), "--only", ",".join(configs)]
  if n == 2:
    args.append("--extras")   # eager calls, constants, pmean, grad, reduce_gradients, unbinding
  else:
    args.append("--topology")  # local=2 x node=2: hierarchical has two levels on one host
    args.append("--calibrate")  # and auto follows a profile measured over the MPI transport
  rc, out, _ = mpirun(n, *args, timeout=180)
  assert rc == 0, f"mpirun -n {n} exited {rc}\n{out[-8000:]}"
  for rank in range(n):
    if n == 2:
      assert f"rank {rank}: OK extras" in out, out[-8000:]
    for config in configs:
      assert re.search(rf"rank {rank}: OK {config} calls={calls}\b", out), (
          f"rank {rank} did not finish {config}\n{out[-8000:]}")
    assert len(re.findall(rf"rank {rank}: OK \w+/\w+ calls=", out)) == len(configs), out[-8000:]
  # every algorithm and every codec at both sizes
  assert {c.split("/")[0] for c in FOUR_RANKS} == set(ALGORITHMS)
  assert {c.split("/")[1] for c in FOUR_RANKS} == set(CODECS) == {
      c.split("/")[1] for c in _configs(2)}
  if n == 4:
    assert "levels [('local', 2), ('node', 2)]" in out, out[-4000:]
    picks = set(re.findall(r"rank \d: OK calibrate fits=5 transport=mpi reused=True (picks=.*)",
                           out))
    assert len(picks) == 1, f"every rank must plan alike after calibrating\n{out[-8000:]}"


FAILURE_TIMEOUT = 3.0
SLACK = 15.0   # start-up, and the 2-core machine's load, between the death and the last exit


@skip_without_mpi
@pytest.mark.timeout(90)
def test_a_rank_that_dies_mid_collective_is_named_by_every_other_rank():
  # -disable-auto-cleanup: hydra does not kill the survivors (it otherwise does, but names the dead
  # process unreliably), so they stay blocked in MPI_Sendrecv with the dead rank until jaxring's
  # watchdog names it and ends them.
  n, dead, limit = 4, 2, 60
  rc, out, seconds = mpirun(n, "--calls", "1000", "--algorithms", "ring", "--codecs", "int8",
                            "--die-rank", str(dead), "--die-at", "5",
                            "--failure-timeout", str(FAILURE_TIMEOUT), timeout=limit,
                            launcher_args=("-disable-auto-cleanup",))
  assert rc is not None, f"mpirun still running after {limit} s: a silent hang\n{out[-6000:]}"
  assert rc != 0, out[-6000:]
  died = re.search(rf"rank {dead}: dying at call 5 of ring/int8 at=([\d.]+)", out)
  assert died, out[-6000:]
  pid = re.search(rf"rank {dead}/{n}: pid (\d+)", out).group(1)
  for rank in set(range(n)) - {dead}:
    assert re.search(rf"rank {dead} of {n} \(pid {pid} on [^)]+\) died or hangs: no heartbeat "
                     rf"for [\d.]+ s \(failure timeout 3 s\)\. Rank {rank} exits", out), (
        f"rank {rank} did not name rank {dead}\n{out[-6000:]}")
  assert time.time() - float(died.group(1)) < FAILURE_TIMEOUT + SLACK, out[-6000:]
  assert "calls=1000" not in out   # nobody finished: the survivors were ended, not left hanging


@skip_without_mpi
@pytest.mark.timeout(90)
def test_a_rank_that_finishes_early_is_not_reported():
  # the watchdog is on by default (jaxring.distributed's 120 s; 3 s here): rank 0 exits normally
  # while the others run 3 failure timeouts longer; its "finished" message must keep them quiet
  rc, out, _ = mpirun(3, "--finish-rank", "0", "--linger", str(3 * FAILURE_TIMEOUT),
                      "--failure-timeout", str(FAILURE_TIMEOUT), timeout=60,
                      launcher_args=("-disable-auto-cleanup",))
  assert rc == 0, f"mpirun exited {rc}\n{out[-6000:]}"
  assert "died or hangs" not in out, out[-6000:]
  for rank in range(3):
    assert f"rank {rank}: finished" in out, out[-6000:]


def test_lax_psum_gradient_of_a_replicated_loss_is_the_identity_under_shard_map():
  """The rule jaxring.psum over MPI follows (the worker's --extras checks it over MPI): a loss
  computed identically from the sum on every member (invariant ``w``) sends its cotangent to every
  member unchanged. (With a member-dependent ``w`` lax sums the cotangents instead; MPI cannot tell
  the two apart, and jaxring follows mpi4jax.allreduce's identity rule.)"""
  mesh = jax.make_mesh((4,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
  w = jnp.asarray(np.random.RandomState(0).randn(3), jnp.float32)
  x = jnp.asarray(np.random.RandomState(1).randn(4, 3), jnp.float32)

  def member_grad(v, wv):
    return jax.grad(lambda u: jnp.sum(wv * jax.lax.psum(u, "i")))(v)

  g = jax.jit(jax.shard_map(member_grad, mesh=mesh, in_specs=(P("i"), P()),
                            out_specs=P("i")))(x, w)
  np.testing.assert_array_equal(np.asarray(g), np.tile(np.asarray(w), (4, 1)))


@skip_without_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["codec", "same"])
def test_ranks_that_plan_a_psum_differently_both_say_how(case):
  rc, out, _ = mpirun(2, "--case", case, timeout=100, worker="mpi_mismatch.py")
  if case == "same":
    assert rc == 0 and "rank 0: OK 2.0" in out and "rank 1: OK 2.0" in out, out[-4000:]
    return
  for rank in (0, 1):
    assert re.search(rf"rank {rank}: RAISED CollectiveMismatchError: jaxring: processes disagree "
                     rf"on collective #0; process {rank} of 2 plans psum over \(data\)", out), out
  assert "codecs=" in out and "Int8" in out, out[-4000:]


@skip_without_mpi
@pytest.mark.timeout(90)
def test_a_live_rank_stuck_between_collectives_is_named_by_every_rank():
  # Rank 1 sleeps before launching call 5 (alive, heartbeating); ranks 0 and 2 wait inside the
  # launched program (MPI_Sendrecv would wait for good). Every rank, rank 1 included, must say
  # who is stuck and in which collective, and exit non-zero (-disable-auto-cleanup: hydra leaves
  # each rank to end by itself).
  n, stuck, limit = 3, 1, 60
  rc, out, _ = mpirun(n, "--calls", "1000", "--algorithms", "ring", "--codecs", "int8",
                      "--die-rank", str(stuck), "--die-at", "5", "--die-how", "stuck",
                      "--failure-timeout", str(FAILURE_TIMEOUT), timeout=limit,
                      launcher_args=("-disable-auto-cleanup",))
  assert rc is not None, f"mpirun still running after {limit} s: a silent hang\n{out[-6000:]}"
  assert rc != 0, out[-6000:]
  died = re.search(rf"rank {stuck}: dying at call 5 of ring/int8 at=([\d.]+)", out)
  assert died, out[-6000:]
  for rank in set(range(n)) - {stuck}:
    assert re.search(rf"collective #\d+ over axis 'data' \(launch 6\) started here [\d.]+ s ago "
                     rf"and cannot complete: rank {stuck} of {n} \(pid \d+ on [^)]+\) launched it "
                     rf"5 time\(s\); alive \(heartbeating\) but stuck[^\n]*Rank {rank} exits",
                     out), f"rank {rank} did not name rank {stuck}\n{out[-6000:]}"
  # the stuck rank says so, unless (a loaded machine) the others' exits reach it first
  assert re.search(rf"rank {stuck} of {n} is stuck: it has launched collective #\d+ over axis "
                   rf"'data' 5 time\(s\), but rank \d of {n}|died or hangs[^\n]*Rank {stuck} "
                   rf"exits", out), out[-6000:]
  assert time.time() - float(died.group(1)) < FAILURE_TIMEOUT + SLACK, out[-6000:]


@skip_without_mpi
@pytest.mark.timeout(150)
def test_diloco_host_transfer_equals_the_in_program_sync():
  # 2 nodes x 2 ranks; the outer sync moved by a host thread during the delay steps: the same
  # parameters after every step as the sync inside the program (uncompressed; int8+EF within its
  # rounding, residual non-zero), the same outer parameters on every rank; a decayed residual
  # (residual_decay=0.5) follows its rule at each send
  rc, out, _ = mpirun(4, "--check", "equal", timeout=130, worker="mpi_diloco.py")
  assert rc == 0, f"mpirun exited {rc}\n{out[-6000:]}"
  for rank in range(4):
    assert f"rank {rank}: OK" in out, out[-6000:]


@skip_without_mpi
@pytest.mark.timeout(200)
def test_diloco_host_transfer_in_jax_shape_equals_the_in_program_sync():
  # 2 processes of jax.distributed under mpirun, 2 devices each (node = process, bound to MPI
  # too): train_step(grad_axes="local")'s host form, each device moving its half of a fragment,
  # gives the program form's parameters (int8: within its rounding); no all-reduce is left in
  # the step's program
  port = mp.free_port()
  rc, out, _ = mpirun(2, timeout=180, worker="mpi_diloco_jax_shape.py",
                      JAXRING_COORDINATOR=f"127.0.0.1:{port}", JAXRING_NUM_PROCESSES="2",
                      JAXRING_LOCAL_DEVICE_COUNT="2")
  assert rc == 0, f"mpirun exited {rc}\n{out[-6000:]}"
  for rank in range(2):
    assert f"rank {rank}: OK" in out, out[-6000:]


@skip_without_mpi
@pytest.mark.timeout(150)
def test_diloco_host_transfer_a_checkpoint_in_flight_resumes_exactly(tmp_path):
  # each rank's orbax checkpoint at step 5, fragment 0's transfer sent at 4 and due at 6: the
  # save waits for it and keeps its result, the resumed transform (made anew) gets it back
  rc, out, _ = mpirun(4, "--check", "resume", "--dir", str(tmp_path), timeout=130,
                      worker="mpi_diloco.py")
  assert rc == 0, f"mpirun exited {rc}\n{out[-6000:]}"
  for rank in range(4):
    assert f"rank {rank}: OK resumed" in out, out[-6000:]
    assert os.path.isdir(tmp_path / f"rank{rank}" / "5" / "transfers"), out[-6000:]


@skip_without_mpi
@pytest.mark.timeout(120)
def test_diloco_host_transfer_a_node_never_sends_is_named_not_a_hang():
  rc, out, seconds = mpirun(4, "--check", "stall", timeout=100, worker="mpi_diloco.py",
                            JAXRING_FAILURE_TIMEOUT=str(FAILURE_TIMEOUT))
  assert rc is not None, f"mpirun still running after 100 s: a silent hang\n{out[-6000:]}"
  for rank in (0, 1):
    assert re.search(rf"rank {rank}: OK gave up: jaxring: the host-side transfer 'diloco \d+ "
                     rf"fragment 0' over 'node' \(rank 0 of 2\) started \d+ s ago has not "
                     rf"completed", out), out[-6000:]
  for rank in (2, 3):
    assert f"rank {rank}: OK (never synced, as told)" in out, out[-6000:]
  assert seconds < 60, out[-6000:]
