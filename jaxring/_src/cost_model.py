"""The alpha-beta cost model of every algorithm jaxring runs. The formulas live here only.

Notation: ``n`` bytes per member, ``p`` members, ``alpha`` seconds per message, ``bw`` bytes/s per
link (beta = 1/bw), ``ratio`` wire bytes / uncompressed bytes. Reduction arithmetic (gamma) is
folded into the bandwidth term: on the hardware we target it is memory-bound like the copy.

Sources:
  R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of Collective Communication Operations in
  MPICH", IJHPCA 19(1), 2005 -- ring reduce-scatter / all-gather / all-reduce (sec. 4).
  M. Cho, U. Finkler, D. Kung, H. Hunter, "BlueConnect: Decomposing All-Reduce for Deep Learning
  on Heterogeneous Network Hierarchy", SysML 2019 -- the per-level decomposition.
"""
from __future__ import annotations

from collections.abc import Sequence


from jaxring._src.topology import Level


def ring_reduce_scatter(n: float, p: int, alpha: float, bw: float, ratio: float = 1.0) -> float:
  """(p-1) alpha + (p-1)/p n beta (Thakur et al. 2005)."""
  if p <= 1:
    return 0.0
  return (p - 1) * alpha + (p - 1) / p * n * ratio / bw


def ring_all_gather(n: float, p: int, alpha: float, bw: float, ratio: float = 1.0) -> float:
  """(p-1) alpha + (p-1)/p n beta, ``n`` the gathered size (Thakur et al. 2005)."""
  return ring_reduce_scatter(n, p, alpha, bw, ratio)


def ring_all_reduce(n: float, p: int, alpha: float, bw: float, ratio: float = 1.0) -> float:
  """2(p-1) alpha + 2(p-1)/p n beta: reduce-scatter then all-gather (Thakur et al. 2005)."""
  return 2 * ring_reduce_scatter(n, p, alpha, bw, ratio)


def hierarchical_all_reduce(n: float, levels: Sequence[Level],
                            ratios: Sequence[float] | None = None) -> float:
  """BlueConnect: level i reduce-scatters and all-gathers n / (p_1...p_{i-1}) bytes.

  sum_i [ 2(p_i-1) alpha_i + 2 (p_i-1)/p_i * n_i * r_i / bw_i ],  n_i = n / prod_{j<i} p_j.
  """
  ratios = [1.0] * len(levels) if ratios is None else list(ratios)
  t, ni = 0.0, float(n)
  for lv, r in zip(levels, ratios):
    t += ring_all_reduce(ni, lv.size, lv.latency, lv.bandwidth, r)
    ni /= lv.size
  return t


def native_all_reduce(n: float, levels: Sequence[Level]) -> float:
  """The framework's own all-reduce (gloo / NCCL / in-process), topology-oblivious.

  Over levels that are all alike (one host: every level in-process) it is one fused operation (one
  alpha) moving what a ring moves; across unlike levels it is a flat ring whose every step waits
  for the slowest link.
  """
  levels = [lv for lv in levels if lv.size > 1]
  if not levels:
    return 0.0
  p = 1
  for lv in levels:
    p *= lv.size
  slow = min(levels, key=lambda lv: lv.bandwidth)
  if len({(lv.bandwidth, lv.latency) for lv in levels}) == 1:  # no hierarchy to exploit
    return slow.latency + 2 * (p - 1) / p * n / slow.bandwidth
  return ring_all_reduce(n, p, slow.latency, slow.bandwidth)


def link_bound(n: float, p: int, bw: float, ratio: float = 1.0) -> float:
  """The link-rate lower bound of an all-reduce: 2(p-1)/p * n * ratio / bw."""
  return 0.0 if p <= 1 else 2 * (p - 1) / p * n * ratio / bw
