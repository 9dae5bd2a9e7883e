"""`jaxring simulate`: the step timeline and the reductions' times against hand arithmetic."""
import json
import subprocess
import sys

import pytest

from jaxring._src import cost_model
from jaxring._src.tools.simulate import cluster as clusters
from jaxring._src.tools.simulate import model, timeline

C = clusters.Cluster("test", 4, 100e9, 1e-6, 10e9, 1e-4, 1000.0, 1e12)


def test_resnet50_has_torchvisions_parameter_count_and_4_1_gmacs():
  layers = model.resnet50()
  assert sum(lay.params for lay in layers) == 25_557_032
  assert sum(lay.flops for lay in layers) / 2 == pytest.approx(4.11e9, rel=0.01)


def test_reductions_by_hand():
  n = 64e6
  # one node: a ring over NVLink
  assert timeline.all_reduce_seconds(n, 4, C, timeline.Plan()) == pytest.approx(
      6 * 1e-6 + 2 * 3 / 4 * n / 100e9)
  # flat over 4 nodes x 4: one ring of 16 through the node NICs
  flat = timeline.all_reduce_seconds(n, 16, C, timeline.Plan("flat"))
  assert flat == pytest.approx(30 * 1e-4 + 2 * 15 / 16 * n / 10e9)
  # hierarchical: NVLink level, then 4 rings of n/4 side by side sharing each node's NIC
  hier = timeline.all_reduce_seconds(n, 16, C, timeline.Plan())
  local = 6 * 1e-6 + 2 * 3 / 4 * n / 100e9
  node = 6 * 1e-4 + 2 * 3 / 4 * (n / 4) / (10e9 / 4)
  assert hier == pytest.approx(local + node) and hier < flat
  # int8 on the node level: a quarter of the node bytes, plus encode/decode of each hop's chunk
  int8 = timeline.all_reduce_seconds(n, 16, C, timeline.Plan("hierarchical", 0.25, "int8"))
  assert int8 == pytest.approx(local + 6 * 1e-4 + 2 * 3 / 4 * (n / 4) * 0.25 / (10e9 / 4)
                               + 2 * 3 / 4 * (n / 4) / 1e12)
  assert cost_model.ring_all_reduce(n, 1, 1.0, 1.0) == 0.0


def test_step_timeline_overlaps_reductions_with_backward_by_hand():
  # three layers of 1 MFLOP forward (2 backward) per example, batch 1, 1 GFLOP/s: forward 3 ms,
  # backward 2 ms per layer; each layer's 1M params (4 MB) fills a bucket of 4 MB
  layers = [model.Layer(f"l{i}", 1_000_000, 1e6) for i in range(3)]
  cost = timeline.all_reduce_seconds(4e6, 16, C, timeline.Plan())
  s = timeline.step(layers, C, 16, timeline.Plan(), batch_per_gpu=1, flops_per_s=1e9,
                    bucket_bytes=4e6)
  assert s.buckets == 3 and s.compute_s == pytest.approx(0.009)
  ready = [0.005, 0.007, 0.009]
  end = 0.0
  for r in ready:
    end = max(end, r) + cost
  assert s.step_s == pytest.approx(max(0.009, end)) and s.comm_s == pytest.approx(3 * cost)
  serial = timeline.step(layers, C, 16, timeline.Plan(), batch_per_gpu=1, flops_per_s=1e9,
                         bucket_bytes=4e6, overlap=False)
  assert serial.step_s == pytest.approx(0.009 + 3 * cost) and serial.step_s >= s.step_s


def test_scaling_orders_as_the_source_works_say():
  layers, c = model.resnet50(), clusters.CLUSTERS["8xh100-25gbe"]
  f = timeline.flops_per_s(c, layers)
  eff = {}
  for algorithm, ratio, codec in (("flat", 1.0, "none"), ("hierarchical", 1.0, "none"),
                                  ("hierarchical", 0.254, "int8"),
                                  ("hierarchical", 0.01, "topk")):
    eff[codec if algorithm == "hierarchical" else "flat"] = timeline.step(
        layers, c, 192, timeline.Plan(algorithm, ratio, codec), batch_per_gpu=256,
        flops_per_s=f).efficiency
  # BlueConnect beats the flat ring at 192 GPUs; compression beats uncompressed
  assert eff["flat"] < eff["none"] < eff["int8"] < eff["topk"] <= 1.0


def test_cli_runs_to_1024_gpus_in_seconds_and_reproduces_baidus_400_ms(tmp_path):
  out = subprocess.run([sys.executable, "-m", "jaxring", "simulate", "--out-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  data = json.loads(next(tmp_path.glob("simulate-*.json")).read_text())
  rows = data["clusters"]["h100-nvlink-ib400"]
  assert {r["gpus"] for r in rows} >= {8, 1024}
  out = subprocess.run([sys.executable, "-m", "jaxring", "simulate", "--reproduce", "baidu",
                        "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
  baidu = json.loads(next(tmp_path.glob("simulate-baidu-*.json")).read_text())
  at40 = next(r["ms"] for r in baidu["rows"] if r["gpus"] == 40)
  assert abs(at40 - 400) / 400 < 0.25


def test_validation_predicts_bench_cluster_rows_by_hand():
  from jaxring._src.tools.simulate import validate
  n, bw = 32 << 20, 125e6
  result = {"bench": "cluster", "args": {"devices_per_node": 2}, "nodes": 4, "link": "1gbit",
            "bandwidth_bytes_per_s": bw, "bytes_per_device": n,
            "calibration": [{"job": "jax", "fits": [["hierarchical", "Int8(block_size=256)",
                                                     0.01, 2e-9]]}],
            "rows": [{"contender": "gloo lax.psum", "ms": 500.0},
                     {"contender": "jaxring hierarchical int8", "ms": 250.0},
                     {"contender": "jaxring auto int8", "ms": 240.0}]}   # auto: not modelled
  rows = validate.predict_cluster_rows(
      result, lambda alg, codec: timeline.Plan(alg, 0.25 if codec == "int8" else 1.0, codec))
  assert [r["contender"] for r in rows] == ["gloo lax.psum", "jaxring hierarchical int8"]
  e = clusters.CLUSTERS["emulated"]
  flat = 2 * 7 * e.inter_latency + 2 * 7 / 8 * n / bw               # one ring through 8 devices
  assert rows[0]["predicted_ms"] == pytest.approx(flat * 1e3)
  assert rows[0]["error"] == pytest.approx(flat * 1e3 / 500 - 1)
  local = 2 * e.intra_latency + 2 * 1 / 2 * n / e.intra_bandwidth
  node = 6 * e.inter_latency + 2 * 3 / 4 * (n / 2) * 0.25 / (bw / 2) + 2 * 3 / 4 * (n / 2) / 2e9
  assert rows[1]["predicted_ms"] == pytest.approx((local + node) * 1e3)
  assert rows[1]["calibrated_ms"] == pytest.approx((0.01 + 2e-9 * n) * 1e3)
  assert rows[0]["calibrated_ms"] is None
  assert validate.plan_of("jaxring hierarchical topk (MPI transport)") == ("hierarchical", "topk")
