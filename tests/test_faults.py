"""``jaxring bench faults`` and the faults only the emulated cluster can inject, run for real.

The bench's rows start real jobs (``jaxring._src.tools.bench.fault_scenarios``); here a few of
them run through the CLI as a user would, and the JSON is checked. Every test here is slow (real
processes; the cluster ones need root for network namespaces, which they create and delete).
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import multiproc as mp
import pytest

pytestmark = pytest.mark.multiprocess


def _bench(tmp_path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
  proc = subprocess.run([sys.executable, "-m", "jaxring", "bench", "faults", "--out-dir",
                         str(tmp_path), *args], capture_output=True, text=True, timeout=timeout,
                        env=mp.clean_env())
  files = glob.glob(str(tmp_path / "faults.json"))
  assert len(files) == 1, proc.stdout + proc.stderr
  return proc, json.load(open(files[0]))


@pytest.mark.timeout(200)
def test_bench_faults_runs_the_stuck_and_mismatch_rows_and_tabulates_detection(tmp_path):
  proc, result = _bench(tmp_path, "--only", "stuck between,mismatched shapes", "--skip",
                        "cluster,mpirun", "--failure-timeout", "4", timeout=180)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  rows = {r["name"]: r for r in result["rows"]}
  assert set(rows) == {"stuck between collectives (alive, heartbeating)", "mismatched shapes"}
  for r in rows.values():
    assert r["passed"] is True, r
    assert 0 < r["detection_s"] < 4 + 10, r
  stuck = rows["stuck between collectives (alive, heartbeating)"]
  assert stuck["detection_s"] > 4, stuck   # named after the failure timeout, not before
  assert "fault matrix, failure timeout 4 s" in proc.stdout


def _netns_missing() -> str | None:
  if os.geteuid() != 0:
    return "creating network namespaces needs root"
  if shutil.which("ip") is None or shutil.which("tc") is None:
    return "iproute2 (ip, tc) is not installed"
  return None


@pytest.mark.netns
@pytest.mark.timeout(300)
def test_cluster_run_ends_non_zero_naming_a_stuck_rank_and_loss_is_survived(tmp_path):
  if why := _netns_missing():
    pytest.skip(why)
  from jaxring._src.tools.cluster import netns
  proc, result = _bench(tmp_path, "--only", "cluster: stuck,cluster: 5%", "--failure-timeout",
                        "5", timeout=280)
  assert netns.load_state("jrflt") is None   # the bench deleted the cluster it created
  rows = {r["name"]: r for r in result["rows"]}
  stuck = rows["cluster: stuck between collectives (jaxring cluster run)"]
  assert stuck["passed"] is True and stuck["detection_s"] < 5 + 10, stuck
  loss = rows["cluster: 5% packet loss on one link (iptables statistic)"]
  if loss["outcome"].startswith("skipped"):
    assert netns.loss_unsupported() is not None, loss
  else:
    assert loss["passed"] is True and loss["note"].endswith("packets dropped"), loss
    assert int(loss["note"].split()[0]) > 0, loss
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
