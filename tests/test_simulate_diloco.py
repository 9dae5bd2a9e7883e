"""`jaxring simulate --every`: DiLoCo's inner steps, syncs and overlap against hand arithmetic and
the synchronous timeline; the BlueConnect and DiLoCo-family reproductions against their papers."""
import dataclasses
import doctest
import json

import numpy as np
import pytest

from jaxring import codecs
from jaxring._src import cost_model
from jaxring._src.tools.simulate import cli, diloco, model, timeline
from jaxring._src.tools.simulate import cluster as clusters

C = clusters.Cluster("test", 4, 100e9, 1e-6, 10e9, 1e-4, 1000.0, 1e12)
KW = dict(batch_per_gpu=1, flops_per_s=1e9)
TOLERANCE = 0.25     # what the Baidu and GradientFlow reproductions' tests allow


def _layers(sizes, flops=1e6):
  return [model.Layer(f"l{i}", n, flops) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("net", ["resnet50", "tinyllama-1.1b"])
@pytest.mark.parametrize("codec", ["none", "int8"])
def test_every_step_syncs_are_the_synchronous_step_without_overlap(net, codec):
  layers, c = cli.load_model(net), clusters.CLUSTERS["8xh100-25gbe"]
  kw = dict(batch_per_gpu=4, flops_per_s=timeline.flops_per_s(c, layers))
  co = codecs.parse(codec)
  plan = timeline.Plan("hierarchical", 1.0 if co is None else co.compression_ratio(), codec)
  for gpus in (8, 64, 1024):
    sync = timeline.step(layers, c, gpus, plan, overlap=False, **kw)
    d = diloco.step(layers, c, gpus, diloco.Schedule(1, 1, 0), co, overlap=False, **kw)
    # int8's block scales: each bucket's own chunk (a part block rounded up) against the plan's
    # ratio at 16 M values
    assert d.step_s == pytest.approx(sync.step_s, rel=1e-12 if co is None else 1e-3), gpus
    assert d.compute_s == sync.compute_s
  # with overlap the synchronous step may hide node-level reductions in backprop; a sync cannot
  for gpus in (64, 1024):
    sync = timeline.step(layers, c, gpus, plan, **kw)
    d = diloco.step(layers, c, gpus, diloco.Schedule(1), co, **kw)
    fast = timeline.step(layers, c, 8, timeline.Plan(), **kw)
    assert d.step_s == pytest.approx(fast.step_s + d.sync_s)
    assert d.step_s >= sync.step_s * (1 - 1e-3)


def test_one_sync_by_hand():
  # 4 nodes x 4 GPUs; two 4 MB layers, one bucket each; each GPU all-reduces its quarter over the
  # nodes, the node's 4 rings sharing its 10 GB/s
  layers = _layers([1_000_000, 1_000_000])
  d = diloco.step(layers, C, 16, diloco.Schedule(every=10), bucket_bytes=4e6, **KW)
  one = 2 * 3 * 1e-4 + 2 * 3 / 4 * (4e6 / 4) / (10e9 / 4)
  assert d.sync_s == pytest.approx(2 * one)
  fast = 2 * (2 * 3 * 1e-6 + 2 * 3 / 4 * 4e6 / 100e9)     # the two buckets over NVLink
  assert d.fast_comm_s == pytest.approx(fast)
  assert d.step_s == pytest.approx(d.fast_s + 2 * one / 10)
  assert d.slow_bytes == pytest.approx(2 * 2 * 3 / 4 * 4e6 / 10)   # a node's link, a step


@pytest.mark.parametrize("spec", ["none", "bf16", "int8", "int8:64", "fp16"])
def test_slow_link_bytes_scale_as_one_over_h_and_by_the_codecs_wire(spec):
  # every hop's chunk a whole number of blocks: 16 GPUs of 4 nodes, chunks of 256 x k values
  sizes = [16 * 256 * k for k in (1, 3, 8, 40)]
  layers, co = _layers(sizes), codecs.parse(spec)
  per_bucket = dict(bucket_bytes=1, **KW)
  _, base_bytes = diloco.synchronous(layers, C, 16, **per_bucket)
  assert base_bytes == pytest.approx(sum(2 * 3 / 4 * 4 * n for n in sizes), rel=1e-12)
  chunk = 256
  wire = 1.0 if co is None else co.wire_bytes(chunk, np.float32) / (4 * chunk)
  for h in (1, 50, 100, 500):
    for p in (1, 2):
      d = diloco.step(layers, C, 16, diloco.Schedule(h, p, 0), co, **per_bucket)
      assert d.slow_bytes == pytest.approx(base_bytes * wire / h, rel=1e-12), (h, p)
  assert {"none": 1.0, "bf16": 0.5, "int8": (256 + 4) / 1024, "int8:64": (64 + 4) / 256,
          "fp16": None}[spec] in (wire, None)


def test_a_delay_hides_at_most_tau_steps_of_free_link_time():
  # one layer per bucket, a slow sync far longer than a step: each step of delay hides one
  # step's link time (its compute less the fast reductions it hides), never more than compute
  layers, slow = _layers([4_000_000] * 4, flops=1e6), dataclasses.replace(C, inter_bandwidth=1e8)
  for overlap in (True, False):
    d0 = diloco.step(layers, slow, 16, diloco.Schedule(every=100), overlap=overlap, **KW)
    free = d0.fast_s - d0.fast_comm_s
    assert 0 < free <= d0.compute_s and d0.sync_s > 10 * d0.compute_s
    for tau in (1, 2, 5):
      d = diloco.step(layers, slow, 16, diloco.Schedule(100, 1, tau), overlap=overlap, **KW)
      assert d.exposed_s == pytest.approx(d0.sync_s - tau * free)
      assert d.exposed_s >= d0.sync_s - tau * d0.compute_s
  # a short sync hides entirely; fragments share the interval: min(tau, steps to the next)
  small = diloco.step(_layers([1000] * 4), C, 16, diloco.Schedule(10, 1, 1), **KW)
  assert small.exposed_s == 0 and small.step_s == small.fast_s
  assert diloco.Schedule(50, 4, 20).windows() == [12, 13, 12, 13]
  assert diloco.Schedule(50, 4, 1).windows() == [1, 1, 1, 1]
  for bad in (dict(every=0), dict(every=4, delay=4), dict(every=4, fragments=0)):
    with pytest.raises(ValueError, match="delay < every"):
      diloco.Schedule(**bad)


def test_fragments_are_jaxring_dilocos_and_share_the_sync():
  from jaxring._src.optim.diloco_parts import fragment_of
  layers = cli.load_model("resnet50")
  leaves = [np.zeros(lay.params, np.float32) for lay in layers]
  assert diloco.fragments_of(layers, 4) == tuple(fragment_of(leaves, 4))
  one = diloco.step(layers, C, 16, diloco.Schedule(100, 1, 0), **KW)
  four = diloco.step(layers, C, 16, diloco.Schedule(100, 4, 0), **KW)
  assert four.slow_bytes == pytest.approx(one.slow_bytes)
  assert four.sync_s >= one.sync_s        # as many bytes, a few more partial buckets' latencies


def test_diloco_and_intellect1_figures_by_hand():
  result = diloco.published()
  rows = {r["source"]: r for r in result["rows"]}
  assert rows["DiLoCo"]["model"] == pytest.approx(500.0, rel=1e-9)
  # int8 of 256-value blocks with an f32 scale each: 100 steps x 4 bytes / (1 + 4/256) (a
  # hop's chunk of 223,214 values ends in a part block)
  assert rows["INTELLECT-1"]["model"] == pytest.approx(100 * 4 / (1 + 4 / 256), rel=1e-5)
  for r in rows.values():
    assert abs(r["ratio"] - 1) <= TOLERANCE
  need = result["link_mbit_per_s_for_utilization"]
  assert 0 < need["83%"] < need["96%"]
  # bandwidth terms only: 18.9 GB a node over 100 steps of 22.8 s at 96% utilization
  sync_bytes = 2 * 13 / 14 * 10e9 * (1 + 4 / 256)
  assert need["96%"] == pytest.approx(sync_bytes * 8 / 1e6 / (2280 / 0.96 - 2280), rel=0.01)


def test_blueconnect_reproduction_is_within_the_reproductions_tolerance():
  result = cli.blueconnect()
  per_blob = [r for r in result["rows"] if r["reductions"] == "every blob by itself"]
  for r in per_blob:     # Caffe2 reduces blob by blob: the paper's 87% less overhead
    assert r["ratio"] == pytest.approx(r["reduction"] / 0.87)
    assert abs(r["ratio"] - 1) <= TOLERANCE, r
  assert min(abs(r["ratio"] - 1) for r in per_blob) < 0.01
  lat = cli.BLUECONNECT_LATENCIES_US[-1] * 1e-6     # a flat ring's 382 latencies a blob
  assert cost_model.ring_all_reduce(4.0, 192, lat, 12.5e9) == pytest.approx(382 * lat, rel=1e-3)


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
  argv = ["--model", "tinyllama-1.1b", "--cluster", "8xh100-25gbe", "--gpus", "64,1024",
          "--codecs", "none,int8", "--every", "100", "--fragments", "4", "--delay", "1",
          "--batch-per-gpu", "4", "--out-dir", str(tmp_path)]
  assert cli.main(argv) == 0
  text = capsys.readouterr().out
  assert "tinyllama-1.1b (1.10 B parameters), 8xh100-25gbe" in text
  assert "H=100 P=4 tau=1" in text and "sync DP" in text and "speed-up" in text
  out = json.loads((tmp_path / "simulate-diloco.json").read_text())
  assert out["command"] == "jaxring simulate " + " ".join(argv)
  rows = out["models"]["tinyllama-1.1b"]["clusters"]["8xh100-25gbe"]
  assert len(rows) == 2 * 2 * 2          # GPU counts x codecs x (sync DP, the schedule)
  for r in rows:
    if r["schedule"] != "sync DP":
      assert r["speedup"] > 1 and r["utilization"] <= 1
  assert cli.main(argv[:-8] + ["--every", "1", "--delay", "1"]) == 2
  assert "0 <= TAU < H" in capsys.readouterr().err


@pytest.mark.parametrize("module", [diloco, model])
def test_docstring_examples(module):
  result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0
