"""DiLoCo in the simulator: the fast level reduced every inner step, the slow level every H.

An inner step is ``timeline.step`` on one node: forward and backward, the gradients' buckets
reduced over the node's GPUs (NVLink) as they are ready. Inside a node the model is taken as
sharded (FSDP, as INTELLECT-1 trains): each step reduce-scatters the gradients and all-gathers the
parameters, the bytes of the all-reduce the timeline charges, and each GPU holds ``1/local`` of
the pseudo-gradient. A sync all-reduces that share over the nodes, the node level of the
hierarchical all-reduce (``timeline.node_level_seconds``), bucket by bucket, with the codec's wire
bytes (``Codec.wire_bytes`` of each hop's chunk). With ``fragments=P`` the layers are cut as
``jaxring.diloco`` cuts its leaves (``fragment_of``) and fragment ``p`` syncs at the inner steps
``t`` with ``(t - p * H // P) % H == 0``: one fragment every ``H/P`` steps.

Overlap. With ``delay=0`` a sync is exposed: the step that takes it waits for it. With
``delay=τ`` its transfer runs on the link while the next inner steps compute, in the link time
each step leaves free: its computation less the fast reductions it hides (one reduction at a
time, as in the timeline). A fragment has the next ``min(τ, steps to the next fragment's sync)``
steps; what does not fit is exposed:
``exposed = max(0, transfer - min(τ, gap) * (inner step - fast reductions))``.
The amortized inner step is the fast step plus every fragment's exposed time over ``H``.

With ``H = 1``, ``P = 1``, ``τ = 0`` and ``overlap=False`` this is the synchronous step of the
timeline (hierarchical plan), term by term. With overlap the synchronous step also hides its
node-level reductions behind backprop; a sync, which needs the inner update, cannot.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np

from jaxring._src.tools.simulate import timeline
from jaxring._src.tools.simulate.cluster import Cluster
from jaxring._src.tools.simulate.model import Layer


@dataclasses.dataclass(frozen=True)
class Schedule:
  """``jaxring.diloco``'s ``every`` (H), ``fragments`` (P) and ``delay`` (τ)."""
  every: int = 1
  fragments: int = 1
  delay: int = 0

  def __post_init__(self):
    if self.every < 1 or self.fragments < 1 or not 0 <= self.delay < self.every:
      raise ValueError(f"every >= 1, fragments >= 1 and 0 <= delay < every (as jaxring.diloco); "
                       f"got {self}")

  def windows(self) -> list[int]:
    """Per fragment, the inner steps whose link time its transfer may use."""
    offsets = [p * self.every // self.fragments for p in range(self.fragments)] + [self.every]
    return [min(self.delay, b - a) for a, b in zip(offsets, offsets[1:])]


@dataclasses.dataclass(frozen=True)
class InnerStep:
  gpus: int
  compute_s: float       # forward + backward of one GPU's batch
  fast_s: float          # an inner step with its fast-level reductions
  fast_comm_s: float     # those reductions, summed
  sync_s: float          # the slow-level transfers of one interval (every fragment once)
  exposed_s: float       # of sync_s, what the inner steps' free link time does not hide
  step_s: float          # amortized over the interval
  slow_bytes: float      # bytes one node sends over its slow link, per inner step (amortized)

  @property
  def utilization(self) -> float:
    return self.compute_s / self.step_s


def wire_ratio(codec, elements: float) -> float:
  """A chunk of ``elements`` f32 values' wire bytes over their own (``Codec.wire_bytes``)."""
  n = max(1, math.ceil(elements))
  return 1.0 if codec is None else codec.wire_bytes(n, np.float32) / (4 * n)


def fragments_of(layers: Sequence[Layer], fragments: int) -> tuple[int, ...]:
  """Each layer's fragment, by ``jaxring.diloco``'s rule (whole leaves in order, by bytes)."""
  return _fragments(tuple(lay.params for lay in layers), fragments)


@functools.lru_cache(maxsize=64)
def _fragments(sizes: tuple[int, ...], fragments: int) -> tuple[int, ...]:
  from jaxring._src.optim.diloco_parts import fragment_of
  # zero-stride views: the rule reads sizes and dtypes only
  return tuple(fragment_of([np.broadcast_to(np.float32(0), (n,)) for n in sizes], fragments))


def _buckets(layers: Sequence[Layer], bucket_bytes: float) -> list[float]:
  return [b for _, b in timeline.backward(layers, batch_per_gpu=0, flops_per_s=1.0,
                                          bucket_bytes=bucket_bytes)[2]]


def slow_sync(bucket_sizes: Sequence[float], gpus: int, cluster: Cluster,
              codec=None) -> tuple[float, float]:
  """(seconds, bytes over one node's slow link) to all-reduce f32 buckets of ``bucket_sizes``
  bytes (per GPU, before the node level's ``1/local`` share) over the nodes."""
  local, nodes = timeline.shape(gpus, cluster)
  seconds = sent = 0.0
  for nbytes in bucket_sizes:
    ratio = wire_ratio(codec, nbytes / 4 / local / nodes)   # one hop's chunk
    plan = timeline.Plan("hierarchical", ratio, "none" if codec is None else codec.name)
    seconds += timeline.node_level_seconds(nbytes, gpus, cluster, plan)
    sent += 2 * (nodes - 1) / nodes * nbytes * ratio if nodes > 1 else 0.0
  return seconds, sent


def step(layers: Sequence[Layer], cluster: Cluster, gpus: int, schedule: Schedule, codec=None, *,
         batch_per_gpu: int, flops_per_s: float, bucket_bytes: float = 25 << 20,
         overlap: bool = True) -> InnerStep:
  """An inner step of ``jaxring.diloco`` on ``gpus`` GPUs, amortized (the module docstring).

  Example:
    >>> from jaxring._src.tools.simulate import cluster, model
    >>> c = cluster.CLUSTERS["8xh100-25gbe"]
    >>> layers = model.decoder(*model.DECODERS["tinyllama-1.1b"])
    >>> s = step(layers, c, 1024, Schedule(every=100), batch_per_gpu=4,
    ...          flops_per_s=timeline.flops_per_s(c, layers))
    >>> round(s.slow_bytes / 1e6)   # 1.1 B f32 values: 2 x 127/128 x 4.4 GB, every 100 steps
    87
  """
  local, _ = timeline.shape(gpus, cluster)
  fast = timeline.step(layers, cluster, local, timeline.Plan(), batch_per_gpu=batch_per_gpu,
                       flops_per_s=flops_per_s, bucket_bytes=bucket_bytes, overlap=overlap)
  free = max(0.0, fast.step_s - fast.comm_s)     # link time an inner step leaves
  frag = fragments_of(layers, schedule.fragments)
  sync = exposed = sent = 0.0
  for p, window in enumerate(schedule.windows()):
    mine = [lay for lay, f in zip(layers, frag) if f == p]
    seconds, nbytes = slow_sync(_buckets(mine, bucket_bytes), gpus, cluster, codec)
    sync, sent = sync + seconds, sent + nbytes
    exposed += max(0.0, seconds - window * free)
  return InnerStep(gpus, fast.compute_s, fast.step_s, fast.comm_s, sync, exposed,
                   fast.step_s + exposed / schedule.every, sent / schedule.every)


def synchronous(layers: Sequence[Layer], cluster: Cluster, gpus: int, codec=None, *,
                batch_per_gpu: int, flops_per_s: float, bucket_bytes: float = 25 << 20,
                overlap: bool = True) -> tuple[timeline.Step, float]:
  """Synchronous data parallel (the timeline's hierarchical step, the codec on the node level)
  and the bytes one node sends over its slow link a step."""
  plan = timeline.Plan("hierarchical", wire_ratio(codec, 1 << 24),
                       "none" if codec is None else codec.name)
  s = timeline.step(layers, cluster, gpus, plan, batch_per_gpu=batch_per_gpu,
                    flops_per_s=flops_per_s, bucket_bytes=bucket_bytes, overlap=overlap)
  return s, slow_sync(_buckets(layers, bucket_bytes), gpus, cluster, codec)[1]


def projection(layers: Sequence[Layer], cluster: Cluster, gpus: int, codecs: Sequence[str],
               schedules: Sequence[Schedule], *, batch_per_gpu: int,
               bucket_bytes: float = 25 << 20, overlap: bool = True) -> list[dict]:
  """Rows for each codec: synchronous data parallel, then every schedule; ``speedup`` and
  ``less_traffic`` against synchronous data parallel without a codec."""
  from jaxring import codecs as registry
  flops = timeline.flops_per_s(cluster, layers)
  kw = dict(batch_per_gpu=batch_per_gpu, flops_per_s=flops, bucket_bytes=bucket_bytes,
            overlap=overlap)
  base, base_bytes = synchronous(layers, cluster, gpus, **kw)
  rows = []
  for spec in codecs:
    codec = registry.parse(spec)
    s, nbytes = synchronous(layers, cluster, gpus, codec, **kw)
    rows.append(_row(gpus, "sync DP", spec, s.step_s, s.compute_s, nbytes, base, base_bytes))
    for sch in schedules:
      d = step(layers, cluster, gpus, sch, codec, **kw)
      label = f"H={sch.every} P={sch.fragments} tau={sch.delay}"
      rows.append(_row(gpus, label, spec, d.step_s, d.compute_s, d.slow_bytes, base, base_bytes)
                  | {"every": sch.every, "fragments": sch.fragments, "delay": sch.delay,
                     "sync_ms": d.sync_s * 1e3, "exposed_sync_ms": d.exposed_s * 1e3})
  return rows


def _row(gpus, label, codec, step_s, compute_s, nbytes, base, base_bytes) -> dict:
  return {"gpus": gpus, "schedule": label, "codec": codec, "step_ms": step_s * 1e3,
          "utilization": compute_s / step_s, "slow_mb_per_step": nbytes / 1e6,
          "speedup": base.step_s / step_s, "less_traffic": base_bytes / max(nbytes, 1e-30)}


# INTELLECT-1 (arXiv 2412.01152): 10 B parameters, up to 14 nodes of 8 H100 (112 GPUs), DiLoCo
# with H = 100 and an int8 all-reduce of the pseudo-gradients: 400x less bandwidth than data
# parallel, 83-96% compute utilization. Their inter-node links are not in REFERENCES.md; the time
# per inner step is from a summary of the report (rohan-paul.com: 38 minutes of inner steps
# between syncs), so the model answers which link rate gives their utilization, bandwidth terms
# only (latency 0, as the Baidu reproduction), a blocking sync (delay 0).
INTELLECT1 = {"params": 10_000_000_000, "nodes": 14, "gpus_per_node": 8, "every": 100,
              "codec": "int8", "less_traffic": 400.0, "utilization": (0.83, 0.96),
              "inner_s": 38 * 60 / 100}
DILOCO = {"every": 500, "less_traffic": 500.0}     # DiLoCo (arXiv 2311.08105), f32 syncs


def published() -> dict:
  """The DiLoCo family's published figures beside the model's (see INTELLECT1 above)."""
  from jaxring import codecs as registry
  cfg = INTELLECT1
  gpus = cfg["nodes"] * cfg["gpus_per_node"]
  # 400 equal layers (25 M parameters: a bucket each), so backprop hides the fast reductions;
  # one FLOP forward each, the inner step's time set by the rate
  layers = [Layer(f"layer{i}", cfg["params"] // 400, 1.0) for i in range(400)]
  int8 = registry.parse(cfg["codec"])

  def link(rate_bytes: float) -> Cluster:
    return Cluster("intellect1", cfg["gpus_per_node"], 370e9, 0.0, rate_bytes, 0.0, 0.0, 1.2e12)

  def run(c: Cluster, schedule: Schedule, codec=None) -> InnerStep:
    return step(layers, c, gpus, schedule, codec, batch_per_gpu=1,
                flops_per_s=3.0 * len(layers) / cfg["inner_s"], bucket_bytes=25 << 20)

  c = link(1e9 / 8)
  sync_bytes = synchronous(layers, c, gpus, batch_per_gpu=1, flops_per_s=1.0)[1]
  rows = [{"source": "DiLoCo", "figure": f"less communication, H={DILOCO['every']}, f32",
           "paper": DILOCO["less_traffic"],
           "model": sync_bytes / run(c, Schedule(DILOCO["every"])).slow_bytes},
          {"source": "INTELLECT-1", "figure": f"less bandwidth, H={cfg['every']}, int8",
           "paper": cfg["less_traffic"],
           "model": sync_bytes / run(c, Schedule(cfg["every"]), int8).slow_bytes}]
  for r in rows:
    r["ratio"] = r["model"] / r["paper"]
  needs = {}
  for target in cfg["utilization"]:   # bisection on the link rate, in log space
    lo, hi = 1e3, 1e12
    for _ in range(50):
      mid = math.sqrt(lo * hi)
      if run(link(mid), Schedule(cfg["every"]), int8).utilization >= target:
        hi = mid
      else:
        lo = mid
    needs[f"{target:.0%}"] = hi * 8 / 1e6
  return {"rows": rows, "intellect1": cfg, "link_mbit_per_s_for_utilization": needs,
          "sync_gb_per_node": run(c, Schedule(cfg["every"]), int8).slow_bytes
          * cfg["every"] / 1e9}


def _ints(text: str) -> list[int]:
  return [int(x) for x in str(text).split(",") if x.strip()]


def schedules(every: str, fragments: str = "1", delay: str = "0") -> list[Schedule]:
  """Every valid (H, P, τ) of three comma lists (a delay must stay below H, as in
  ``jaxring.diloco``).

  Example:
    >>> [(s.every, s.delay) for s in schedules("1,100", "1", "0,1")]
    [(1, 0), (100, 0), (100, 1)]
  """
  return [Schedule(h, p, t) for h in _ints(every) for p in _ints(fragments) for t in _ints(delay)
          if t < h]


def run_cli(args, load_model, argv: Sequence[str]) -> int:
  """``jaxring simulate --every ...`` (``argv``, parsed into ``args``): prints a table per model,
  cluster and GPU count, writes ``simulate-diloco.json``."""
  import datetime
  import os
  import subprocess
  import sys

  from jaxring._src.tools.bench import common
  from jaxring._src.tools.simulate import cluster as clusters
  try:
    plans = schedules(args.every, args.fragments, args.delay)
    if not plans:
      raise ValueError("no schedule with 0 <= TAU < H")
  except ValueError as e:   # a malformed list or a schedule jaxring.diloco refuses
    print(f"jaxring simulate: --every {args.every} --fragments {args.fragments} --delay "
          f"{args.delay}: {e}", file=sys.stderr)
    return 2
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(__file__)).stdout.strip()
  out = {"command": " ".join(["jaxring simulate", *argv]), "commit": commit or None,
         "date": datetime.date.today().isoformat(), "batch_per_gpu": args.batch_per_gpu,
         "bucket_bytes": args.bucket_mib * (1 << 20), "overlap": not args.no_overlap,
         "model": "jaxring/_src/tools/simulate/diloco.py (its docstring)", "models": {}}
  for spec in args.model.split(","):
    layers = load_model(spec, args.flops_per_example)
    out["models"][spec] = {"params": sum(lay.params for lay in layers), "clusters": {}}
    for name in args.cluster.split(","):
      c = clusters.CLUSTERS[name]
      if not c.resnet50_images_per_s:
        print(f"{name}: no compute reference, skipped", file=sys.stderr)
        continue
      rows = []
      for g in _ints(args.gpus):
        rows += projection(layers, c, g, args.codecs.split(","), plans,
                           batch_per_gpu=args.batch_per_gpu,
                           bucket_bytes=args.bucket_mib * (1 << 20), overlap=not args.no_overlap)
      print(f"\n# {spec} ({out['models'][spec]['params'] / 1e9:.2f} B parameters), {name}: "
            f"{c.about}; batch {args.batch_per_gpu}/GPU; speed-up and less traffic against "
            f"synchronous data parallel, no codec")
      common.print_table(rows, [("gpus", "GPUs", "d"), ("schedule", "schedule", ""),
                                ("codec", "codec", ""), ("step_ms", "step ms", ".1f"),
                                ("utilization", "utilization", ".3f"),
                                ("slow_mb_per_step", "slow MB/step", ".2f"),
                                ("less_traffic", "less traffic", ".1f"),
                                ("speedup", "speed-up", ".2f")])
      out["models"][spec]["clusters"][name] = rows
  print(f"wrote {common.write_json('simulate-diloco', out, args.out_dir)}")
  return 0
