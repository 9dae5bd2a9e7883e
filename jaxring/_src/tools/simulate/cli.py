"""``jaxring simulate``: projected step time and scaling efficiency of data-parallel training.

Examples:
  jaxring simulate                                   # ResNet-50, every shipped cluster, 8-1,024 GPUs
  jaxring simulate --cluster 8xh100-25gbe --codecs none,int8,topk --bucket-mib 25
  jaxring simulate --reproduce baidu                 # the ring all-reduce arithmetic of Baidu (2017)
  jaxring simulate --reproduce gradientflow          # lazy all-reduce + 1% chunks, 512 GPUs, 56 Gbit/s
  jaxring simulate --reproduce blueconnect           # hierarchical vs flat ring, ResNet-50, 192 GPUs
  jaxring simulate --reproduce intellect1            # DiLoCo's and INTELLECT-1's traffic, utilization
  jaxring simulate --model llama2-7b --gpus 1024 --every 100 --fragments 4 --delay 1  # DiLoCo
  jaxring simulate --validate benchmarks/results/cluster.json         # vs measured
  jaxring simulate --validate RUN.json --calibration OTHER_RUN.json  # model fitted elsewhere
  jaxring simulate --validate-steps TTA_OR_TRAIN_CLUSTER.json --calibration CLUSTER.json  # steps

Prints a table per cluster (step ms, reduction ms, exposed ms, efficiency, images/s), writes JSON
under benchmarks/results/ and, where matplotlib is installed (``pip install jaxring[plot]``), a
PNG of the scaling curves beside it.
"""
from __future__ import annotations

import argparse
import sys
import time

from jaxring._src.tools.simulate import cluster as clusters
from jaxring._src.tools.simulate import model, timeline

GPUS = (8, 16, 32, 64, 128, 256, 512, 1024)


def _codec_plan(spec: str, algorithm: str) -> timeline.Plan:
  import jax.numpy as jnp

  from jaxring import codecs
  codec = codecs.parse(spec)
  ratio = 1.0 if codec is None else float(codec.compression_ratio(jnp.float32, 1 << 24))
  return timeline.Plan(algorithm, ratio, "none" if codec is None else codec.name)


def _parser():
  from jaxring._src.codecs.base import grammar, sweep
  ap = argparse.ArgumentParser(prog="jaxring simulate", description=__doc__.splitlines()[0])
  ap.add_argument("--cluster", default=",".join(c for c in clusters.CLUSTERS if c != "emulated"),
                  help=f"comma list of {sorted(clusters.CLUSTERS)}")
  ap.add_argument("--gpus", default=",".join(map(str, GPUS)))
  ap.add_argument("--codecs", default=",".join(sweep()),
                  help=f"the hierarchical plan's codecs, comma-separated (default %(default)s); "
                  f"spellings: {grammar()}")
  ap.add_argument("--model", default="resnet50",
                  help=f"resnet50 or a decoder of {sorted(model.DECODERS)} (built in; an example "
                       f"is a sequence of {model.SEQ_LEN} tokens) or MODULE:FUNCTION, a callable "
                       "of no arguments that returns the parameter pytree (arrays or "
                       "jax.ShapeDtypeStruct, e.g. jax.eval_shape of a Flax module's init); one "
                       "layer per leaf; with --every a comma list")
  ap.add_argument("--flops-per-example", type=float, default=None,
                  help="with --model MODULE:FUNCTION: forward FLOPs per example (default 2 per "
                       "parameter, a dense layer's)")
  ap.add_argument("--batch-per-gpu", type=int, default=256)
  ap.add_argument("--bucket-mib", type=float, default=25.0)
  ap.add_argument("--no-overlap", action="store_true")
  ap.add_argument("--every", default=None, metavar="H[,H...]",
                  help="DiLoCo (jaxring.diloco): sync the slow level every H inner steps, the "
                       "fast level every step; one table row per H, P and TAU against "
                       "synchronous data parallel (writes simulate-diloco.json)")
  ap.add_argument("--fragments", default="1", metavar="P[,P...]",
                  help="with --every: streaming syncs, P fragments of the layers in turn, one "
                       "every H/P steps (default %(default)s)")
  ap.add_argument("--delay", default="0", metavar="TAU[,TAU...]",
                  help="with --every: a sync's result applied TAU inner steps later, its "
                       "transfer run in those steps' free link time; 0: the sync is exposed "
                       "(default %(default)s; TAU < H)")
  ap.add_argument("--reproduce", choices=("baidu", "gradientflow", "blueconnect", "intellect1"),
                  default=None)
  ap.add_argument("--validate", default=None, metavar="CLUSTER_JSON",
                  help="predict every row of a `jaxring bench cluster` result and compare")
  ap.add_argument("--validate-steps", default=None, metavar="RUN_JSON",
                  help="predict the step time of every contender of a `jaxring bench tta` or "
                       "`jaxring bench train-cluster` result (needs --calibration)")
  ap.add_argument("--calibration", default=None, metavar="CLUSTER_JSON",
                  help="fit the calibrated model to this `jaxring bench cluster` run's "
                       "calibration (--validate: default the validated run's own)")
  ap.add_argument("--out-dir", default=None)
  return ap


def load_model(spec: str, flops_per_example: float | None = None) -> list:
  """``resnet50``, or the layers of the parameter pytree ``MODULE:FUNCTION()`` returns.

  Example:
    >>> len(load_model("resnet50"))
    107
  """
  if spec == "resnet50":
    return model.resnet50()
  if spec in model.DECODERS:
    return model.decoder(*model.DECODERS[spec])
  import importlib
  module, sep, name = spec.partition(":")
  if not sep:
    raise SystemExit(f"jaxring simulate: --model {spec!r}: give resnet50 or MODULE:FUNCTION")
  params = getattr(importlib.import_module(module), name)()
  return model.from_params(params, flops_per_example)


def baidu() -> dict:
  """Baidu's ring all-reduce (Gibiansky 2017): a 300 M-parameter model (1.2 GB of f32
  gradients) on 5 nodes x 8 GPUs over ~6 GB/s InfiniBand, about 400 ms per iteration, and the
  ring's time nearly flat from 1 to 40 GPUs (bandwidth term 2(p-1)/p of the buffer)."""
  from jaxring._src import cost_model
  n, bw = 1.2e9, 6e9
  rows = [{"gpus": p, "ms": cost_model.ring_all_reduce(n, p, 0.0, bw) * 1e3}
          for p in (2, 4, 8, 16, 24, 32, 40)]
  return {"source_ms_at_40": 400.0, "rows": rows}


# GradientFlow (Sun et al. 2019): 512 GPUs over 56 Gbit/s, ResNet-50 in 7.3 minutes for 90
# epochs, 434.1x the speed of one GPU. 90 x 1,281,167 images / 438 s = 263,000 images/s, so one
# GPU of their framework trains 263,000 / 434.1 = 606 images/s. What the paper's summary does not
# give is assumed here: 8 GPUs per node on NVLink, 64 images per GPU, InfiniBand latency.
GRADIENTFLOW = clusters.Cluster(
    "gradientflow-v100-56g", 8, 100e9, 5e-6, 56e9 / 8, 5e-6, 90 * 1_281_167 / 438 / 434.1, 0.5e12,
    "GradientFlow's cluster as simulated: 8 V100 per node (NVLink assumed), 56 Gbit/s per node")
GRADIENTFLOW_SPEEDUP_512 = 434.1


def gradientflow(batch_per_gpu: int = 64) -> dict:
  """ResNet-50 on GradientFlow's cluster: speed-up over one GPU at 64 and 512 GPUs for the
  plans the paper builds up: every gradient reduced by itself after the backward pass (what it
  says open-source systems did), then overlapped, then fused into buckets (lazy all-reduce) with
  a half-precision wire, then 1% coarse-grained chunks."""
  layers = model.resnet50()
  flops = timeline.flops_per_s(GRADIENTFLOW, layers)
  topk = _codec_plan("topk", "flat")
  plans = [("per tensor, after backward, f32", timeline.Plan("flat"), 1, False),
           ("per tensor, overlapped, f32", timeline.Plan("flat"), 1, True),
           ("lazy all-reduce 25 MiB, overlapped, fp16 wire", timeline.Plan("flat", 0.5), 25 << 20,
            True),
           ("lazy all-reduce + 1% chunks", timeline.Plan("flat", topk.wire_ratio, "topk"), 25 << 20,
            True)]
  rows = []
  for gpus in (64, 512):
    for label, plan, bucket, overlap in plans:
      s = timeline.step(layers, GRADIENTFLOW, gpus, plan, batch_per_gpu=batch_per_gpu,
                        flops_per_s=flops, bucket_bytes=bucket, overlap=overlap)
      rows.append({"gpus": gpus, "plan": label, "step_ms": s.step_s * 1e3,
                   "efficiency": s.efficiency, "speedup": gpus * s.efficiency})
  return {"source_speedup_at_512": GRADIENTFLOW_SPEEDUP_512, "cluster": GRADIENTFLOW.about,
          "images_per_s_per_gpu": GRADIENTFLOW.resnet50_images_per_s,
          "batch_per_gpu": batch_per_gpu, "rows": rows}


# BlueConnect (Cho et al. 2019): ResNet-50 in Caffe2 on 192 GPUs, synchronization overhead 87%
# lower than prior schemes. The summary gives neither the machines nor the baseline; assumed
# here: IBM Minsky-like nodes (the authors' PowerAI DDL platform) of 4 P100 on NVLink (40 GB/s
# a GPU, 5 us), one 100 Gbit/s EDR InfiniBand port per node, 32 images per GPU as in Caffe2's
# ImageNet-in-an-hour recipe, 160 images/s of compute per P100, every gradient blob reduced by
# itself as Caffe2 does, overlapped with backprop; the prior scheme a ring through all GPUs.
BLUECONNECT_REDUCTION = 0.87
BLUECONNECT_LATENCIES_US = (5.0, 10.0, 20.0)


def _blueconnect_cluster(inter_latency_s: float) -> clusters.Cluster:
  return clusters.Cluster(
      "blueconnect-p100-edr", 4, 40e9, 5e-6, 100e9 / 8, inter_latency_s, 160.0, 0.5e12,
      "BlueConnect's hierarchy as simulated: 4 P100 per node on NVLink, one 100 Gbit/s EDR "
      "port per node")


def blueconnect(gpus: int = 192, batch_per_gpu: int = 32) -> dict:
  """The synchronization overhead (the reduction time backprop does not hide) of ResNet-50 on
  ``gpus`` GPUs of BlueConnect-like nodes, a flat ring against the hierarchical all-reduce,
  for a few inter-node latencies and for per-blob and 25 MiB-bucket reductions."""
  layers = model.resnet50()
  rows = []
  for lat in BLUECONNECT_LATENCIES_US:
    c = _blueconnect_cluster(lat * 1e-6)
    flops = timeline.flops_per_s(c, layers)
    for bucket, label in ((1, "every blob by itself"), (25 << 20, "25 MiB buckets")):
      exposed = {}
      for algorithm in ("flat", "hierarchical"):
        s = timeline.step(layers, c, gpus, timeline.Plan(algorithm), batch_per_gpu=batch_per_gpu,
                          flops_per_s=flops, bucket_bytes=bucket)
        exposed[algorithm] = s.exposed_s
      rows.append({"inter_latency_us": lat, "reductions": label,
                   "flat_exposed_ms": exposed["flat"] * 1e3,
                   "hierarchical_exposed_ms": exposed["hierarchical"] * 1e3,
                   "reduction": 1 - exposed["hierarchical"] / max(exposed["flat"], 1e-12)})
      rows[-1]["ratio"] = rows[-1]["reduction"] / BLUECONNECT_REDUCTION
  return {"source_reduction": BLUECONNECT_REDUCTION, "gpus": gpus,
          "cluster": _blueconnect_cluster(0.0).about, "batch_per_gpu": batch_per_gpu,
          "rows": rows}


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  from jaxring._src.tools.bench import common
  t0 = time.perf_counter()
  if args.validate or args.validate_steps:
    if args.validate_steps and not args.calibration:
      print("jaxring simulate: --validate-steps needs --calibration CLUSTER_JSON (a `jaxring "
            "bench cluster` run on the same emulated cluster shape)", file=sys.stderr)
      return 2
    from jaxring._src.tools.simulate import validate
    try:   # the input files only: an error past them is a bug, with its traceback
      result = validate.load(args.validate or args.validate_steps,
                             "cluster" if args.validate else ("tta", "train-cluster"))
      calibration = validate.load(args.calibration) if args.calibration else None
    except (OSError, ValueError) as e:   # a missing, unreadable or wrong result file
      print(f"jaxring simulate: {e}", file=sys.stderr)
      return 2
    if args.validate:
      return _validate(args.validate, result, args.out_dir, args.calibration, calibration)
    return _validate_steps(args.validate_steps, result, args.calibration, calibration,
                           args.out_dir)
  if args.every:
    from jaxring._src.tools.simulate import diloco
    return diloco.run_cli(args, load_model, sys.argv[1:] if argv is None else argv)
  if args.reproduce == "intellect1":
    return _intellect1(args.out_dir)
  if args.reproduce == "baidu":
    result = baidu()
    print("# Baidu ring all-reduce: 1.2 GB over 6 GB/s links, alpha ignored (source: ~400 ms "
          "at 40 GPUs)")
    common.print_table(result["rows"], [("gpus", "GPUs", "d"), ("ms", "ring ms", ".0f")])
    print(f"wrote {common.write_json('simulate-baidu', result, args.out_dir)}")
    return 0
  if args.reproduce == "gradientflow":
    result = gradientflow()
    print(f"# GradientFlow: ResNet-50 on 512 GPUs over 56 Gbit/s, source: "
          f"{GRADIENTFLOW_SPEEDUP_512}x one GPU; {result['cluster']}, "
          f"{result['images_per_s_per_gpu']:.0f} images/s per GPU, batch {result['batch_per_gpu']}")
    common.print_table(result["rows"], [("gpus", "GPUs", "d"), ("plan", "plan", ""),
                                        ("step_ms", "step ms", ".1f"),
                                        ("efficiency", "efficiency", ".3f"),
                                        ("speedup", "speed-up", ".1f")])
    print(f"wrote {common.write_json('simulate-gradientflow', result, args.out_dir)}")
    return 0
  if args.reproduce == "blueconnect":
    result = blueconnect()
    print(f"# BlueConnect: ResNet-50 on {result['gpus']} GPUs, source: synchronization overhead "
          f"{BLUECONNECT_REDUCTION:.0%} lower than prior schemes; {result['cluster']}, batch "
          f"{result['batch_per_gpu']}")
    common.print_table(result["rows"], [("inter_latency_us", "inter-node us", ".0f"),
                                        ("reductions", "reductions", ""),
                                        ("flat_exposed_ms", "flat ring exposed ms", ".1f"),
                                        ("hierarchical_exposed_ms", "hierarchical exposed ms",
                                         ".1f"),
                                        ("reduction", "less overhead", ".1%"),
                                        ("ratio", "model / paper", ".2f")])
    per_blob = [r["ratio"] for r in result["rows"] if r["reductions"] == "every blob by itself"]
    print(f"every blob by itself, as Caffe2 reduces: model / paper {min(per_blob):.2f} to "
          f"{max(per_blob):.2f} (paper: {BLUECONNECT_REDUCTION:.0%} less overhead)")
    print(f"wrote {common.write_json('simulate-blueconnect', result, args.out_dir)}")
    return 0
  layers = load_model(args.model, args.flops_per_example)
  gpus = [int(g) for g in args.gpus.split(",")]
  out = {"model": args.model, "params": sum(lay.params for lay in layers),
         "batch_per_gpu": args.batch_per_gpu,
         "bucket_bytes": args.bucket_mib * (1 << 20), "overlap": not args.no_overlap,
         "clusters": {}}
  for name in args.cluster.split(","):
    c = clusters.CLUSTERS[name]
    if not c.resnet50_images_per_s:
      print(f"{name}: no compute reference, skipped", file=sys.stderr)
      continue
    flops = timeline.flops_per_s(c, layers)
    plans = [("flat none", timeline.Plan("flat"))] + [
        (f"hierarchical {s}", _codec_plan(s, "hierarchical")) for s in args.codecs.split(",")]
    rows = []
    for g in gpus:
      for label, plan in plans:
        s = timeline.step(layers, c, g, plan, batch_per_gpu=args.batch_per_gpu,
                          flops_per_s=flops, bucket_bytes=args.bucket_mib * (1 << 20),
                          overlap=not args.no_overlap)
        rows.append({"gpus": g, "plan": label, "step_ms": s.step_s * 1e3,
                     "comm_ms": s.comm_s * 1e3, "exposed_ms": s.exposed_s * 1e3,
                     "efficiency": s.efficiency,
                     "images_per_s": g * args.batch_per_gpu / s.step_s})
    print(f"\n# {name}: {c.about}; {args.model}, batch {args.batch_per_gpu}/GPU, "
          f"{args.bucket_mib:g} MiB buckets, {'no ' if args.no_overlap else ''}overlap")
    common.print_table(rows, [("gpus", "GPUs", "d"), ("plan", "plan", ""),
                              ("step_ms", "step ms", ".1f"), ("comm_ms", "reduce ms", ".1f"),
                              ("exposed_ms", "exposed ms", ".1f"),
                              ("efficiency", "efficiency", ".3f"),
                              ("images_per_s", "images/s", ".0f")])
    out["clusters"][name] = rows
  path = common.write_json("simulate", out, args.out_dir)
  print(f"wrote {path} ({time.perf_counter() - t0:.2f} s)")
  _plot(out, path)
  return 0


def _intellect1(out_dir) -> int:
  from jaxring._src.tools.bench import common
  from jaxring._src.tools.simulate import diloco
  result = diloco.published()
  cfg = result["intellect1"]
  print("# DiLoCo and INTELLECT-1: bytes over a node's slow link per inner step, synchronous "
        "data parallel (f32) over DiLoCo")
  common.print_table(result["rows"], [("source", "source", ""), ("figure", "figure", ""),
                                      ("paper", "paper", ".0f"), ("model", "model", ".1f"),
                                      ("ratio", "model / paper", ".3f")])
  print(f"INTELLECT-1's setup ({cfg['params'] / 1e9:.0f} B parameters, {cfg['nodes']} nodes x "
        f"{cfg['gpus_per_node']} GPUs, H={cfg['every']}, blocking int8 syncs of "
        f"{result['sync_gb_per_node']:.1f} GB a node, {cfg['inner_s']:.1f} s an inner step): "
        + ", ".join(f"{u} compute utilization at {mbit:.0f} Mbit/s a node"
                    for u, mbit in result["link_mbit_per_s_for_utilization"].items()))
  print(f"wrote {common.write_json('simulate-intellect1', result, out_dir)}")
  return 0


def _validate(path: str, result: dict, out_dir, calibration_path: str | None = None,
              calibration: dict | None = None) -> int:
  from jaxring._src.tools.bench import common
  from jaxring._src.tools.simulate import validate
  rows = validate.predict_cluster_rows(result, lambda alg, codec: _codec_plan(codec, alg),
                                       calibration)
  print(f"# {path}: {result['nodes']} nodes x {result['args']['devices_per_node']} devices, "
        f"{result['link']}, {common.fmt_bytes(result['bytes_per_device'])} per device; "
        f"calibrated model fitted to {calibration_path or 'its own calibration'}")
  common.print_table(rows, [("contender", "contender", ""), ("measured_ms", "measured ms", ".0f"),
                            ("predicted_ms", "alpha-beta ms", ".0f"), ("error", "error", "+.0%"),
                            ("calibrated_ms", "calibrated ms", ".0f"),
                            ("calibrated_error", "error", "+.0%")])
  calibrated = [abs(r["calibrated_error"]) for r in rows if r["calibrated_error"] is not None]
  print(f"worst error: alpha-beta {max(abs(r['error']) for r in rows):.0%}"
        + (f", calibrated {max(calibrated):.0%}" if calibrated else ""))
  fitted = validate.models(calibration or result)
  out = {"source": path, "calibration": calibration_path or path, "rows": rows,
         "coefficients": {job: m.coef for job, m in fitted.items()},
         "left_out": _left_out(fitted)}
  print(f"wrote {common.write_json('simulate-validate', out, out_dir)}")
  return 0


def _validate_steps(path: str, result: dict, calibration_path: str, calibration: dict,
                    out_dir) -> int:
  from jaxring._src.tools.bench import common
  from jaxring._src.tools.simulate import validate
  fitted = validate.models(calibration)
  rows = validate.predict_steps(result, fitted)
  if result.get("auto_profile"):
    print("# note: the run's `auto` read a calibration profile of its mesh; the model takes "
          "`auto`'s lossless reductions as the native all-reduce (the default without one)")
  print(f"# {path} (bench {result['bench']}): {result['args'].get('batch_per_device')} images "
        f"per device, links "
        f"{result['link']}; computation {result['compute_s'] * 1e3:.0f} ms a step and its "
        f"skew {result.get('skew_s', 0.0) * 1e3:.0f} ms (measured), reductions from the model "
        f"fitted to {calibration_path}")
  common.print_table(rows, [("contender", "contender", ""), ("measured_s", "measured s/step", ".3f"),
                            ("reduce_s", "reductions s", ".3f"),
                            ("predicted_s", "predicted s/step", ".3f"), ("error", "error", "+.0%")])
  if rows:
    print(f"worst error: {max(abs(r['error']) for r in rows):.0%}")
  out = {"source": path, "calibration": calibration_path, "rows": rows,
         "coefficients": {job: m.coef for job, m in fitted.items()},
         "left_out": _left_out(fitted)}
  print(f"wrote {common.write_json('simulate-validate-steps', out, out_dir)}")
  return 0


def _left_out(fitted: dict) -> dict:
  """Prints and returns the calibration points each job's fit left out (calibrated.OUTLIER)."""
  out = {}
  for job, fit in fitted.items():
    out[job] = [dict(zip(("algorithm", "codec", "bytes", "seconds", "fitted_seconds"), d))
                for d in fit.dropped]
    for d in out[job]:
      print(f"left out of the {job} job's fit: {d['algorithm']} {d['codec']} at "
            f"{d['bytes'] >> 10} KiB, timed {d['seconds'] * 1e3:.1f} ms, "
            f"{d['fitted_seconds'] * 1e3:.1f} ms by the fit of the other points")
  return out


def _plot(out: dict, json_path) -> None:
  from jaxring._src.tools.bench.plots import pyplot
  plt = pyplot()
  if plt is None:
    return
  names = list(out["clusters"])
  fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
  for ax, name in zip(axes[0], names):
    rows = out["clusters"][name]
    for plan in dict.fromkeys(r["plan"] for r in rows):
      pts = [(r["gpus"], r["efficiency"]) for r in rows if r["plan"] == plan]
      ax.plot(*zip(*pts), marker="o", label=plan)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set(title=name, xlabel="GPUs", ylabel="scaling efficiency")
    ax.legend(fontsize=7)
  png = str(json_path).replace(".json", ".png")
  fig.tight_layout()
  fig.savefig(png, dpi=110)
  print(f"wrote {png}")


if __name__ == "__main__":
  sys.exit(main())
