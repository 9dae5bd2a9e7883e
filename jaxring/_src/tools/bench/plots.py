"""PNG plots beside the JSON of the benchmarks (``bench collectives``, ``cluster``, ``tta``) and
of ``jaxring simulate``.

matplotlib is an optional extra (``pip install 'jaxring[plot]'``): where it is not importable each
function returns None and draws nothing; the caller prints ``NO_MATPLOTLIB`` and goes on.
"""
from __future__ import annotations

import math
from typing import Any

from jaxring._src.extras import install_hint, require

NO_MATPLOTLIB = f"no plot: matplotlib is not installed ({install_hint('plot')})"
_NEEDS = "the plots need matplotlib"


def pyplot():
  """matplotlib.pyplot on the non-interactive Agg backend, or None where matplotlib is missing."""
  try:
    require("matplotlib", "plot", _NEEDS).use("Agg")
    return require("matplotlib.pyplot", "plot", _NEEDS)
  except ImportError:
    return None


def _members(result: dict[str, Any]) -> int:
  if result.get("devices"):
    return int(result["devices"])
  return math.prod(result.get("mesh") or [1])


def _busbw(row: dict[str, Any], p: int) -> float | None:
  """The row's bus bandwidth in GB/s: stored, or 2(p-1)/p * bytes / seconds."""
  if row.get("busbw_GBs") is not None:
    return float(row["busbw_GBs"])
  if not row.get("time_us") or p < 2:
    return None
  return 2 * (p - 1) / p * row["size"] / (row["time_us"] * 1e-6) / 1e9


def collectives(result: dict[str, Any], path: str) -> str | None:
  """Bus bandwidth (GB/s) against bytes per member, one line per algorithm/codec contender."""
  plt = pyplot()
  if plt is None:
    return None
  p = _members(result)
  lines: dict[str, list[tuple[int, float]]] = {}
  for row in result.get("rows", []):
    bw = _busbw(row, p)
    if bw is not None and "size" in row:
      lines.setdefault(row["algorithm"], []).append((int(row["size"]), bw))
  fig, ax = plt.subplots(figsize=(9, 5.5))
  try:
    for name, pts in lines.items():
      pts.sort()
      ax.plot([s for s, _ in pts], [b for _, b in pts], marker="o", markersize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes per member)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"all-reduce bus bandwidth, {p} members, mesh {result.get('mesh')}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
  finally:
    plt.close(fig)
  return path


def cluster(result: dict[str, Any], path: str) -> str | None:
  """Each contender's median ms as a bar (MPI shape and JAX shape coloured apart), with the
  uncompressed ring all-reduce link bound 2(nodes-1)/nodes * bytes / bandwidth as a line."""
  plt = pyplot()
  if plt is None:
    return None
  rows = [r for r in result.get("rows", []) if r.get("ms") is not None]
  names = [r["contender"] for r in rows]
  ms = [float(r["ms"]) for r in rows]
  colors = ["tab:orange" if "MPI" in n else "tab:blue" for n in names]
  nodes = int(result["nodes"])
  nbytes = float(result["bytes_per_device"])
  bw = float(result["bandwidth_bytes_per_s"])
  bound_ms = 2 * (nodes - 1) / nodes * nbytes / bw * 1e3 if nodes > 1 else 0.0
  fig, ax = plt.subplots(figsize=(10, 0.28 * len(rows) + 2))
  try:
    y = list(range(len(rows)))
    ax.barh(y, ms, color=colors)
    ax.set_yticks(y)
    ax.set_yticklabels(names, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(bound_ms, color="tab:red", linestyle="--", label="link bound, uncompressed")
    Patch = require("matplotlib.patches", "plot", _NEEDS).Patch
    handles = [Patch(color="tab:orange", label="MPI shape"),
               Patch(color="tab:blue", label="JAX shape"), ax.get_lines()[-1]]
    ax.legend(handles=handles, fontsize=8, loc="lower right")
    ax.set_xlabel("median ms per all-reduce")
    ax.set_title(f"all-reduce, {nodes} nodes, links {result.get('link')} "
                 f"({bw * 8 / 1e9:.2f} Gbit/s), {nbytes / (1 << 20):g} MiB per device")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
  finally:
    plt.close(fig)
  return path


def accuracy_curves(rows: list[dict], target: float, title: str, path: str) -> str | None:
  """Accuracy against training time per contender (``bench tta``), as a PNG (None without
  matplotlib)."""
  plt = pyplot()
  if plt is None:
    return None
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for r in rows:
    ax.plot([c[0] for c in r["curve"]], [c[2] for c in r["curve"]], marker=".",
            label=r["contender"])
  ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:g}%")
  ax.set_xlabel("training time (s)")
  ax.set_ylabel("test accuracy (%)")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
