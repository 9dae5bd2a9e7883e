"""The simulator against measurement: every ``jaxring bench cluster`` row it can model.

A ``bench cluster`` JSON holds the emulated cluster's shape (nodes, devices per node, link rate),
the buffer size and each contender's median time. The simulator predicts the same all-reduce from
the shipped ``emulated`` cluster description at that link rate (``timeline.all_reduce_seconds``:
the alpha-beta formulas of ``jaxring._src.cost_model``, the codec's wire ratio and encode/decode
rate) and nothing measured in that run: the error column is the model's. Where the run holds
the calibration that ``auto`` used (``jaxring calibrate``: a line ``alpha + beta * bytes`` per plan,
fitted from calls of other sizes on the same mesh), the calibrated prediction is that line at
the row's size.
"""
from __future__ import annotations

import dataclasses
import json
import re

from jaxring._src.tools.simulate import cluster as clusters
from jaxring._src.tools.simulate import timeline

# contender name -> (algorithm, codec); the rest (auto, the node ring alone, check_vma variants)
# repeat these plans or time part of one
PLANS = (
    (r"^gloo lax\.psum$", ("flat", "none")),
    (r"^MPICH MPI_Allreduce", ("flat", "none")),
    (r"^jaxring ring (none)$", ("flat", None)),
    (r"^jaxring hierarchical (none|bf16|int8|topk)( \(MPI transport\))?$", ("hierarchical", None)),
)


def plan_of(contender: str) -> tuple[str, str] | None:
  """``(algorithm, codec)`` of a ``bench cluster`` contender the simulator models, else None.

  Example:
    >>> plan_of("jaxring hierarchical int8 (MPI transport)")
    ('hierarchical', 'int8')
  """
  for pattern, (algorithm, codec) in PLANS:
    m = re.match(pattern, contender)
    if m:
      return algorithm, codec or m.group(1)
  return None


def emulated(nodes_link_bytes_per_s: float, devices_per_node: int) -> clusters.Cluster:
  """The shipped ``emulated`` cluster at another link rate and node width."""
  return dataclasses.replace(clusters.CLUSTERS["emulated"], inter_bandwidth=nodes_link_bytes_per_s,
                             gpus_per_node=devices_per_node)


CODEC_FITS = {"none": "Codec()", "bf16": "Bf16()", "int8": "Int8(", "topk": "TopKChunks("}


def calibrated_ms(result: dict, contender: str, algorithm: str, codec: str, n: float):
  """The calibration's fitted line at ``n`` bytes for this row's plan and job, or None."""
  job = "mpi" if "MPI" in contender else "jax"
  fits = next((r["fits"] for r in result.get("calibration", []) if r.get("job") == job), None)
  if not fits:
    return None
  alg = {"flat": "xla" if contender.startswith(("gloo", "MPICH")) else "ring"}.get(algorithm,
                                                                                  algorithm)
  for fit_alg, fit_codec, alpha, beta in fits:
    if fit_alg == alg and fit_codec.startswith(CODEC_FITS[codec]):
      return (alpha + beta * n) * 1e3
  return None


def predict_cluster_rows(result: dict, plan_for_codec) -> list[dict]:
  """Predicted against measured ms for each modelled row of a ``bench cluster`` result.

  ``plan_for_codec(algorithm, codec)`` builds the ``timeline.Plan`` (the codec's wire ratio).
  """
  args = result["args"]
  devices, nodes = int(args["devices_per_node"]), int(result["nodes"])
  c = emulated(float(result["bandwidth_bytes_per_s"]), devices)
  n = float(result["bytes_per_device"])
  rows = []
  for r in result["rows"]:
    plan = plan_of(r["contender"])
    if plan is None:
      continue
    predicted = timeline.all_reduce_seconds(n, nodes * devices, c, plan_for_codec(*plan)) * 1e3
    cal = calibrated_ms(result, r["contender"], *plan, n)
    rows.append({"contender": r["contender"], "measured_ms": r["ms"],
                 "predicted_ms": predicted, "error": predicted / r["ms"] - 1,
                 "calibrated_ms": cal, "calibrated_error": None if cal is None else cal / r["ms"] - 1})
  return rows


def load(path: str) -> dict:
  with open(path) as f:
    result = json.load(f)
  if result.get("bench") != "cluster":
    raise ValueError(f"{path}: not a `jaxring bench cluster` result (bench={result.get('bench')!r})")
  return result
