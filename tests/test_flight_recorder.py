"""The flight recorder: planned collectives recorded, dumped, and merged to the first divergence."""
import json
import os
import signal
import time

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jaxring
import jaxring.distributed
from jaxring._src.reliability import flight_recorder


def test_planned_collectives_are_recorded_and_dumped(tmp_path):
  mesh = jax.make_mesh((8,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,))
  x = jax.device_put(jnp.ones(8 * 96, jnp.float32), jax.NamedSharding(mesh, P("i")))
  jax.jit(jax.shard_map(lambda v: jaxring.psum(v, "i", algorithm="ring") +
                        jaxring.psum(v[:5], "i", algorithm="ring").sum(),
                        mesh=mesh, in_specs=P("i"), out_specs=P("i")))(x)
  path = jaxring.distributed.dump(tmp_path)
  mine = json.loads(path.read_text())
  ops = [(e["op"], e["shape"], e["plan"]) for e in mine["entries"][-2:]]
  assert ops == [("psum", [96], "ring"), ("psum", [5], "ring")], mine["entries"][-2:]
  assert mine["pid"] == os.getpid() and mine["reason"] == "requested"
  assert json.loads((tmp_path / "summary.json").read_text())["first_divergence"] is None


def test_the_summary_names_the_first_collective_where_processes_differ(tmp_path):
  same = {"op": "psum", "axes": ["i"], "shape": [4], "dtype": "float32", "plan": "ring"}
  for p, third in ((0, dict(same, shape=[8])), (1, dict(same, shape=[9]))):
    (tmp_path / f"flight-{p}.json").write_text(json.dumps({"process": p, "entries": [
        {"seq": 0, **same}, {"seq": 1, **same}, {"seq": 2, **third}]}))
  (tmp_path / "flight-2.json").write_text(json.dumps({"process": 2, "entries": [
      {"seq": 0, **same}]}))
  summary = flight_recorder.summarize(tmp_path)
  first = summary["first_divergence"]
  assert first["seq"] == 1 and first["missing_on"] == [2], summary   # process 2 stopped early


def test_sigusr1_dumps(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXRING_FLIGHT_DIR", str(tmp_path))
  old = signal.getsignal(signal.SIGUSR1)
  signal.signal(signal.SIGUSR1, signal.SIG_DFL)
  try:
    flight_recorder.install_signal_handler()
    os.kill(os.getpid(), signal.SIGUSR1)
    deadline = time.monotonic() + 5
    while not (tmp_path / "flight-0.json").exists() and time.monotonic() < deadline:
      time.sleep(0.01)
    assert json.loads((tmp_path / "flight-0.json").read_text())["reason"] == "SIGUSR1"
  finally:
    signal.signal(signal.SIGUSR1, old)


def test_launched_processes_keep_where_to_write_but_not_who_they_are(monkeypatch, tmp_path):
  # `jaxring cluster run` and `bench faults` used to drop every JAXRING_* setting, so their
  # processes dumped flight records into the working directory (the checkout, under pytest)
  from jaxring._src.tools.bench import fault_jobs
  from jaxring._src.tools.cluster import launch
  monkeypatch.setenv("JAXRING_FLIGHT_DIR", str(tmp_path / "flight"))
  monkeypatch.setenv("JAXRING_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setenv("JAXRING_PROCESS_ID", "3")
  monkeypatch.setenv("JAXRING_COORDINATOR", "10.0.0.1:1234")
  monkeypatch.setenv("JAXRING_FAILURE_TIMEOUT", "0")   # settings of the watchdog stay too
  monkeypatch.setenv("JAXRING_LAUNCH_MARKERS", "0")
  for env in (launch.child_env(), fault_jobs.child_env()):
    assert env["JAXRING_FLIGHT_DIR"] == str(tmp_path / "flight")
    assert env["JAXRING_FAILURE_TIMEOUT"] == "0" and env["JAXRING_LAUNCH_MARKERS"] == "0"
    assert env["JAXRING_CACHE_DIR"] == str(tmp_path / "cache")
    assert "JAXRING_PROCESS_ID" not in env and "JAXRING_COORDINATOR" not in env
    assert "--xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", "")
