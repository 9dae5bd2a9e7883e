"""Two processes x four devices: per-process batches, one global step, the same result as one
process with eight devices; metrics written by process 0 only."""
import functools
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxring._src.tools import ports

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "workers", "train_dist.py")
sys.path.insert(0, os.path.join(REPO, "tests", "workers"))
import train_dist  # noqa: E402

STEPS = 4


@functools.cache
def _reference(api):
  """This process's run: 8 devices, whole batches (the same for every mode)."""
  if api == "nnx":
    return train_dist.run_nnx(STEPS, None)[1]
  return train_dist.run(STEPS, None)[1].params


# Starting two processes that import JAX, and their jax.distributed, is most of a case's time: the
# modes initialized alike run one after the other in the same pair (params-hpz needs jaxring's
# topology, the others plain jax.distributed).
@pytest.mark.multiprocess
@pytest.mark.parametrize("shards,api", [("none,params", "linen"), ("params-hpz", "linen"),
                                        ("none,params", "nnx")])
def test_two_processes_match_one_process_with_the_same_devices(tmp_path, shards, api):
  """Also fully sharded: the parameters split over both processes' devices, gathered and
  reduce-scattered across processes, give the one-process replicated result; and a Flax NNX
  model stepped in place through jaxring.train.fit gives the same."""
  port = ports.free_port()
  metrics, out = tmp_path / "metrics-{shard}.jsonl", tmp_path / "params-{shard}.npz"
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "JAXRING_"))}
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
  procs, logs = [], []
  for pid in range(2):
    logs.append(open(tmp_path / f"worker{pid}.log", "w"))
    procs.append(subprocess.Popen(
        [sys.executable, WORKER, "--port", str(port), "--process-id", str(pid),
         "--steps", str(STEPS), "--metrics", str(metrics), "--out", str(out), "--shard", shards,
         "--api", api],
        stdout=logs[-1], stderr=subprocess.STDOUT, env=env, start_new_session=True))
  try:
    deadline = time.time() + 240
    while any(p.poll() is None for p in procs) and time.time() < deadline:
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    for log in logs:
      log.close()
  outputs = [(tmp_path / f"worker{pid}.log").read_text() for pid in range(2)]
  for p, output in zip(procs, outputs):
    assert p.returncode == 0 and "DONE" in output, output[-3000:]

  import jax
  assert jax.device_count() == 8
  reference = _reference(api)
  for shard in shards.split(","):
    records = [json.loads(line) for line in
               (tmp_path / f"metrics-{shard}.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # once, from process 0
    got = np.load(tmp_path / f"params-{shard}.npz")
    for path, want in jax.tree_util.tree_flatten_with_path(reference)[0]:
      key = "/".join(k.key for k in path)
      np.testing.assert_allclose(got[key], np.asarray(want), rtol=1e-5, atol=1e-6,
                                 err_msg=f"{shard}: {key}")
