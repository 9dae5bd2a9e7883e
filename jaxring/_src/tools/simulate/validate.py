"""The simulator against measurement: every ``jaxring bench cluster`` row it can model.

A ``bench cluster`` JSON holds the emulated cluster's shape (nodes, devices per node, link rate),
the buffer size, each contender's median time and the calibration profiles ``auto`` used. Two
predictions per row:

- **alpha-beta**: the shipped ``emulated`` cluster description at that link rate
  (``timeline.all_reduce_seconds``: the formulas of ``jaxring._src.cost_model``, the codec's wire
  ratio and a nominal encode/decode rate); nothing measured.
- **calibrated**: the per-level model of ``calibrated`` fitted to a calibration profile, of this
  run or of another one (another link rate, another size): the same formulas plus what the
  profile measured beyond them.
"""
from __future__ import annotations

import dataclasses
import json
import re

from jaxring._src.codecs.base import name_of, parse, spellings
from jaxring._src.tools.simulate import calibrated, timeline
from jaxring._src.tools.simulate import cluster as clusters

# contender name -> (algorithm, codec); the rest (auto, the node ring alone, check_vma variants)
# repeat these plans or time part of one. CODEC: any name the codec registry reads (spellings).
PLANS = (
    (r"^gloo lax\.psum$", ("flat", "none")),
    (r"^MPICH MPI_Allreduce", ("flat", "none")),
    (r"^jaxring ring (CODEC)( \(MPI transport\))?$", ("flat", None)),
    (r"^jaxring hierarchical (CODEC)( \(MPI transport\))?$", ("hierarchical", None)),
)


def plan_of(contender: str) -> tuple[str, str] | None:
  """``(algorithm, codec)`` of a ``bench cluster`` contender the simulator models, else None
  (the codec by its registered name, ``codecs.base.name_of``).

  Example:
    >>> plan_of("jaxring hierarchical int8 (MPI transport)")
    ('hierarchical', 'int8')
  """
  names = "|".join(re.escape(n) for n in sorted(spellings(), key=len, reverse=True))
  for pattern, (algorithm, codec) in PLANS:
    m = re.match(pattern.replace("CODEC", names), contender)
    if m:
      return algorithm, codec or name_of(parse(m.group(1)))
  return None


def emulated(nodes_link_bytes_per_s: float, devices_per_node: int) -> clusters.Cluster:
  """The shipped ``emulated`` cluster at another link rate and node width."""
  return dataclasses.replace(clusters.CLUSTERS["emulated"], inter_bandwidth=nodes_link_bytes_per_s,
                             gpus_per_node=devices_per_node)


def job_of(contender: str) -> str:
  return "mpi" if "MPI" in contender else "jax"


def models(result: dict) -> dict:
  """``{job: calibrated.Calibrated}`` from the calibration profiles of a ``bench cluster`` result
  (one per job: ``mpi``, ``jax``); the JAX job's with the link bytes of its small calls (the
  result's ``link_probe``, where it has one)."""
  sizes = (int(result["args"]["devices_per_node"]), int(result["nodes"]))
  link = float(result["bandwidth_bytes_per_s"])
  out = {}
  for cal in result.get("calibration", []):
    if cal.get("job") not in out and cal.get("profile"):
      probe = result.get("link_probe") if cal["job"] == "jax" else None
      out[cal["job"]] = calibrated.fit(cal["profile"], sizes, link, probe)
  return out


def predict_cluster_rows(result: dict, plan_for_codec, calibration: dict | None = None) -> list:
  """Predicted against measured ms for each modelled row of a ``bench cluster`` result.

  ``plan_for_codec(algorithm, codec)`` builds the ``timeline.Plan`` (the codec's wire ratio);
  ``calibration`` is the ``bench cluster`` result whose profiles the calibrated model is fitted
  to (default: ``result`` itself).
  """
  args = result["args"]
  devices, nodes = int(args["devices_per_node"]), int(result["nodes"])
  link = float(result["bandwidth_bytes_per_s"])
  c = emulated(link, devices)
  n = float(result["bytes_per_device"])
  fitted = models(result if calibration is None else calibration)
  rows = []
  for r in result["rows"]:
    plan = plan_of(r["contender"])
    if plan is None:
      continue
    predicted = timeline.all_reduce_seconds(n, nodes * devices, c, plan_for_codec(*plan)) * 1e3
    model = fitted.get(job_of(r["contender"]))
    algorithm = plan[0] if plan[0] != "flat" else (
        "xla" if r["contender"].startswith(("gloo", "MPICH")) else "ring")
    known = model is not None and (plan[1] == "none" or f"kappa_{plan[1]}" in model.coef)
    cal = model.all_reduce_seconds(algorithm, plan[1], n, link) * 1e3 if known else None
    rows.append({"contender": r["contender"], "measured_ms": r["ms"],
                 "predicted_ms": predicted, "error": predicted / r["ms"] - 1,
                 "calibrated_ms": cal, "calibrated_error": None if cal is None else cal / r["ms"] - 1})
  return rows


def load(path: str, bench: str | tuple[str, ...] = "cluster") -> dict:
  """A ``jaxring bench <bench>`` result (ValueError if the file holds another benchmark's)."""
  with open(path) as f:
    result = json.load(f)
  wanted = (bench,) if isinstance(bench, str) else bench
  if result.get("bench") not in wanted:
    hint = (" (its steps are validated with --validate-steps)"
            if result.get("bench") in ("tta", "train-cluster") else "")
    raise ValueError(f"{path}: not a `jaxring bench {' / '.join(wanted)}` result "
                     f"(bench={result.get('bench')!r}){hint}")
  if result["bench"] in ("tta", "train-cluster") and "compute_s" not in result:
    raise ValueError(f"{path}: no measured computation (compute_s): a run from before "
                     f"`bench {result['bench']}` measured it")
  return result


# --- training steps -------------------------------------------------------------------------------
#
# XLA:CPU runs a collective and the computation beside it in turn (docs/design.md,
# "Investigations"), so on the emulated cluster a step is its computation plus its reductions; only the
# links' token buckets let link time hide behind the rest (predict_steps).

BURST = 256 * 1024   # bytes: the tbf bucket of every emulated link (jaxring cluster up's default)


def tta_reductions(contender: str, leaf_bytes: list[int], bucket_bytes: int, chunk_size: int):
  """The all-reduces one step of a ``bench tta`` contender issues: ``[(algorithm, codec, wire
  codec string, bytes per member)]``. The hand-written step reduces every gradient leaf by
  itself; ``train_step`` packs them into buckets (one, for this model) and reduces the loss too."""
  from jaxring._src.tools.bench import tta
  total = sum(leaf_bytes)
  buckets = [min(bucket_bytes, total - i) for i in range(0, total, bucket_bytes)]
  scalar = [("xla", "none", "Codec()", 4)]
  if contender == tta.HAND:
    return [("xla", "none", "Codec()", b) for b in leaf_bytes] + scalar
  if contender == tta.BASE:     # lossless auto without a profile: the native all-reduce
    return [("xla", "none", "Codec()", b) for b in buckets] + scalar
  if contender == tta.INT8:
    return [("hierarchical", "int8", "Int8(block_size=256, stochastic=False)", b)
            for b in buckets] + scalar
  if contender in (tta.TOPK, tta.TOPK_PT):   # the same chunks and bytes, chosen differently
    # with momentum correction the step chooses the chunks itself (optim.sparse): the norms
    # and then the packed chunks, each by the lossless default, the native all-reduce
    import jaxring
    codec = jaxring.codecs.topk_chunks(0.01, chunk_size=chunk_size)
    out = []
    for b in buckets:
      n = b // 4
      out += [("xla", "none", "Codec()", 4 * codec.num_chunks(n)),
              ("xla", "none", "Codec()", 4 * codec.num_selected(n) * chunk_size)]
    return out + scalar
  return None


def train_cluster_reductions(contender: str, leaf_bytes: dict, bucket_bytes: int,
                             fused_statistics: bool = True):
  """The all-reduces one step of a ``bench train-cluster`` contender issues, as
  :func:`tta_reductions` lists them: the gradients (leaf by leaf in the hand-written step, in
  ``train_step``'s buckets otherwise), the batch-norm statistics and the loss (leaf by leaf in
  the hand-written step; in ``train_step`` one fused ``pmean``, or leaf by leaf in runs from
  before it fused them: ``fused_statistics=False``)."""
  import numpy as np

  from jaxring._src.tools.bench import train_cluster
  from jaxring._src.train.buckets import make_buckets
  grads = leaf_bytes["grads"]
  each = [("xla", "none", "Codec()", b) for b in leaf_bytes["batch_stats"] + [4]]
  if contender == train_cluster.HAND:
    return [("xla", "none", "Codec()", b) for b in grads] + each
  native = ([("xla", "none", "Codec()", sum(leaf_bytes["batch_stats"]) + 4)] if fused_statistics
            else each)
  leaves = [np.zeros(b // 4, np.float32) for b in grads]
  buckets = [b.nbytes for b in make_buckets(leaves, range(len(leaves)), bucket_bytes)]
  if contender == train_cluster.BASE:    # lossless auto without a profile: the native all-reduce
    return [("xla", "none", "Codec()", b) for b in buckets] + native
  if contender.startswith("train_step int8+EF"):   # overlapped or not: XLA:CPU runs them in turn
    return [("hierarchical", "int8", "Int8(block_size=256, stochastic=False)", b)
            for b in buckets] + native
  return None


def step_plans(result: dict) -> tuple[dict, float]:
  """``({contender: its reductions}, bytes per second of a node's link)`` of a ``bench tta`` or
  ``bench train-cluster`` result."""
  from jaxring._src.tools.bench.models import MODELS
  from jaxring._src.tools.cluster import netns
  args = result["args"]
  link = netns.rate_bytes_per_second(result["link"])
  if result["bench"] == "train-cluster":
    bucket = int(args["bucket_mib"] * (1 << 20))
    fused = bool(result.get("fused_statistics", False))
    return {r["contender"]: train_cluster_reductions(r["contender"], result["leaf_bytes"], bucket,
                                                     fused)
            for r in result["rows"]}, link
  import jax
  init = MODELS[args.get("model", "resnet")][0]   # runs before --model existed trained "resnet"
  shapes = jax.eval_shape(init, jax.random.key(int(args.get("seed", 0))))
  leaf_bytes = [4 * int(s.size) for s in jax.tree.leaves(shapes)]
  return {r["contender"]: tta_reductions(r["contender"], leaf_bytes,
                                         int(args["bucket_mib"] * (1 << 20)),
                                         int(args["chunk_size"]))
          for r in result["rows"]}, link


def predict_steps(result: dict, fitted: dict) -> list[dict]:
  """Predicted against measured seconds per step for each contender of a ``bench tta`` or
  ``bench train-cluster`` result.

  A step is the measured computation (``compute_s``: one node's devices with nothing on the
  link; plus ``skew_s`` where the run measured it, what the first collective after it waits
  for the slowest device) and the calibrated model's time for each reduction at the run's link
  rate, ``other``
  (latencies, codecs) and ``link`` (bytes at the link rate). The emulated links are token
  buckets (tbf, ``BURST`` bytes): the bucket refills while the link is idle, during the
  computation and the latencies, and then sends at line rate what it holds. So the link time
  that remains is ``link - min(burst / rate, compute + other)``, not below zero. (A 32 MiB
  ``bench cluster`` call is ~130 buckets; there this is the plain sum.)
  """
  plans, link = step_plans(result)
  model = fitted.get("jax")
  rows = []
  for r in result["rows"]:
    plan = plans.get(r["contender"])
    if plan is None or model is None:
      continue
    link_s = other_s = 0.0
    for algorithm, codec, text, nbytes in plan:
      on_link, rest = model.with_wire(codec, calibrated.wire_of(text)).split(
          algorithm, codec, nbytes, link)
      link_s, other_s = link_s + on_link, other_s + rest
    compute = result["compute_s"] + result.get("skew_s", 0.0)
    idle = compute + other_s
    predicted = idle + max(0.0, link_s - min(BURST / link, idle))
    measured = r["s_per_step"] if "s_per_step" in r else r["ms"] / 1e3
    rows.append({"contender": r["contender"], "measured_s": measured,
                 "compute_s": compute, "link_s": link_s, "other_s": other_s,
                 "reduce_s": link_s + other_s, "predicted_s": predicted,
                 "error": predicted / measured - 1})
  return rows
