"""`jaxring simulate`: the step timeline and the reductions' times against hand arithmetic."""
import json
import subprocess
import sys
import time

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


@pytest.mark.slow   # the simulator CLI in fresh processes (~2 s)
def test_cli_runs_to_1024_gpus_in_seconds_and_reproduces_baidus_400_ms(tmp_path):
  out = subprocess.run([sys.executable, "-m", "jaxring", "simulate", "--out-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  data = json.loads((tmp_path / "simulate.json").read_text())
  rows = data["clusters"]["h100-nvlink-ib400"]
  assert {r["gpus"] for r in rows} >= {8, 1024}
  out = subprocess.run([sys.executable, "-m", "jaxring", "simulate", "--reproduce", "baidu",
                        "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
  baidu = json.loads((tmp_path / "simulate-baidu.json").read_text())
  at40 = next(r["ms"] for r in baidu["rows"] if r["gpus"] == 40)
  assert abs(at40 - 400) / 400 < 0.25


def test_gradientflow_reproduction_orders_the_plans_as_the_paper_builds_them_up():
  from jaxring._src.tools.simulate import cli
  result = cli.gradientflow()
  at = {(r["gpus"], r["plan"]): r for r in result["rows"]}
  for gpus in (64, 512):
    speedups = [r["speedup"] for r in result["rows"] if r["gpus"] == gpus]
    assert speedups == sorted(speedups), gpus    # each step of the paper's build-up helps
  lazy = at[(512, "lazy all-reduce 25 MiB, overlapped, fp16 wire")]
  # the source: 434.1x at 512 GPUs; one GPU's rate is derived from its own figures
  assert result["images_per_s_per_gpu"] == pytest.approx(606.3, abs=0.5)
  assert abs(lazy["speedup"] / 434.1 - 1) <= 0.25
  assert at[(512, "per tensor, after backward, f32")]["speedup"] < 0.25 * lazy["speedup"]


def test_blueconnect_reproduction_hides_what_the_flat_rings_latencies_expose():
  from jaxring._src import cost_model
  from jaxring._src.tools.simulate import cli
  result = cli.blueconnect()
  rows = result["rows"]
  assert len(rows) == 2 * len(cli.BLUECONNECT_LATENCIES_US)
  for r in rows:   # the hierarchy never exposes more than the flat ring
    assert r["hierarchical_exposed_ms"] <= r["flat_exposed_ms"]
  per_blob = [r for r in rows if r["reductions"] == "every blob by itself"]
  # the flat ring's 2 (p - 1) latencies per blob: its exposed time grows with the latency
  assert [r["flat_exposed_ms"] for r in per_blob] == sorted(r["flat_exposed_ms"] for r in per_blob)
  assert all(r["reduction"] >= 0.8 for r in per_blob)
  # one blob alone, by the formula the timeline uses: 382 latencies of the flat ring
  lat = cli.BLUECONNECT_LATENCIES_US[-1] * 1e-6
  assert cost_model.ring_all_reduce(4.0, 192, lat, 12.5e9) == pytest.approx(382 * lat, rel=1e-3)


def test_any_flax_model_by_module_and_function(tmp_path, monkeypatch):
  import json

  from jaxring._src.tools.simulate import cli
  (tmp_path / "simmodel.py").write_text(
      "import jax, jax.numpy as jnp, flax.linen as nn\n"
      "class MLP(nn.Module):\n"
      "  @nn.compact\n"
      "  def __call__(self, x):\n"
      "    return nn.Dense(10)(nn.relu(nn.Dense(512)(x)))\n"
      "def params():\n"
      "  return jax.eval_shape(MLP().init, jax.random.key(0), jnp.zeros((1, 784)))['params']\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  layers = cli.load_model("simmodel:params", flops_per_example=1e6)
  assert sorted(lay.params for lay in layers) == [10, 512, 5120, 784 * 512]
  assert sum(lay.flops for lay in layers) == pytest.approx(1e6)
  assert cli.main(["--model", "simmodel:params", "--cluster", "8xh100-25gbe", "--gpus", "64",
                   "--codecs", "none", "--out-dir", str(tmp_path)]) == 0
  out = json.loads((tmp_path / "simulate.json").read_text())
  assert out["params"] == 407_050
  flat = next(r for r in out["clusters"]["8xh100-25gbe"] if r["plan"] == "flat none")
  one_bucket = timeline.all_reduce_seconds(4 * 407_050, 64, clusters.CLUSTERS["8xh100-25gbe"],
                                           timeline.Plan("flat"))   # 1.6 MB: a single bucket
  assert flat["comm_ms"] == pytest.approx(one_bucket * 1e3)
  with pytest.raises(SystemExit, match="MODULE:FUNCTION"):
    cli.load_model("simmodel.params")


def test_bench_cluster_rounds_call_quick_contenders_as_often_as_their_budget_allows():
  """Every contender once in the first round; then as many calls a round as fit in 1 s at
  the slowest process's first-round time, 2 to 30, the same count on every process; each round
  in an order of its own, the same on every process."""
  import types

  from jaxring._src.tools.bench import cluster_worker as cw
  made, seen, barriers = [], [], []
  ready = [(name, lambda name=name: made.append(name), {"x": name})
           for name in ("slow", "quick", "instant")]

  def agree(values):              # other processes took 0.3 s and 0.1 s for the first two
    seen.append(list(values))
    return [max(v, w) for v, w in zip(values, (0.3, 0.1, 0.0))]

  out = list(cw.time_rounds(ready, types.SimpleNamespace(reps=3), barriers.append, "lo", agree))
  assert len(seen) == 1 and len(seen[0]) == 3
  calls = {label: len(times) for label, times, _, _ in out}
  assert calls == {"slow": 1 + 2 * 3, "quick": 1 + 2 * 10, "instant": 1 + 2 * 30}
  assert made.count("quick") == 21 and len(barriers) == len(made) == 7 + 21 + 61
  # each round's order is a permutation of its own, drawn from the round's number alone
  orders = [cw.round_order(3, r) for r in range(3)]
  assert all(sorted(o) == [0, 1, 2] for o in orders) and len({tuple(o) for o in orders}) > 1
  assert orders == [cw.round_order(3, r) for r in range(3)]
  assert made[:3] == [("slow", "quick", "instant")[k] for k in orders[0]]   # one call each
  # later rounds: each contender's calls spread evenly among the others' (not in a row)
  second = made[3:3 + 3 + 10 + 30]
  assert second.count("slow") == 3 and second.count("quick") == 10
  slow_at = [i for i, name in enumerate(second) if name == "slow"]
  between = [second[a:b].count("instant") for a, b in zip(slow_at, slow_at[1:])]
  assert between == [10, 10], between         # 30 calls in a round of 3 slow ones
  assert max(len(run) for run in "".join(n[0] for n in second).split("s")) <= 16
  assert [extra["x"] for _, _, _, extra in out] == ["slow", "quick", "instant"]
  plain = list(cw.time_rounds(ready, types.SimpleNamespace(reps=2), barriers.append, "lo"))
  assert [len(times) for _, times, _, _ in plain] == [2, 2, 2]    # without agree: once a round
  # a call over half the budget (MPICH's 0.8 s) still gets two a round, not one
  long = list(cw.time_rounds(ready[:1], types.SimpleNamespace(reps=3), barriers.append, "lo",
                             lambda values: [0.8]))
  assert [len(times) for _, times, _, _ in long] == [1 + 2 * 2]
  # a slow first timed call (paging) does not cost the row its calls: the quickest of that call
  # and the warm-up calls sets the count, then the largest over the processes
  def rows(warm, others):
    first = []
    paging = [("slow", lambda: first or (first.append(1), time.sleep(0.26)), {})]
    return [len(t) for _, t, _, _ in cw.time_rounds(
        paging, types.SimpleNamespace(reps=2), barriers.append, "lo",
        lambda values: [max(v, others) for v in values], warm)]
  assert rows(None, 0.0) == [1 + 3]               # 0.26 s: 3 a round
  assert rows({"slow": [0.04, 0.05]}, 0.0) == [1 + 25]
  assert rows({"slow": [0.04, 0.05]}, 0.08) == [1 + 12]   # another process was slower
  from jaxring._src import timing
  seconds = timing.call_seconds(lambda: time.sleep(0.01), 3)
  assert len(seconds) == 3 and all(0.009 < t < 1 for t in seconds)

