"""Several contenders timed side by side, and the order of their calls (no jax here:
the benchmark workers import it before jax is set up)."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from fractions import Fraction


def spread(counts: Sequence[int], order: Sequence[int] | None = None) -> list[int]:
  """The order of ``sum(counts)`` calls, ``counts[i]`` of them to contender ``i``: each
  contender's calls evenly spread over the whole span (its k-th of c calls at (k + 1/2)/c of it),
  ties in ``order`` (default: by index). Pure arithmetic: the same on every process, as
  collective calls must be.

  A quick plan timed beside slow ones (top-k: 30 ms a call against 500 ms at 32 MiB on the
  emulated cluster) gets many calls; made in a row, after the slow plans' (passes: every plan
  once, then those with calls left), most of them fell within half a second, and one slow phase
  of the shared machine decided its median: calibration timed top-k at 47 ms where the same
  run's rows, spread over minutes, took 40 (docs/simulations.md). Spread, they sample the same
  phases as the slow plans' calls.

  Example:
    >>> spread([1, 3]), spread([2, 2], order=[1, 0])
    ([1, 0, 1, 1], [1, 0, 1, 0])
  """
  rank = {i: n for n, i in enumerate(range(len(counts)) if order is None else order)}
  slots = sorted((Fraction(2 * k + 1, 2 * c), rank[i], i)
                 for i, c in enumerate(counts) for k in range(c))
  return [i for _, _, i in slots]


def side_by_side(calls: Sequence[Callable], counts: Sequence[int]) -> list[list[float]]:
  """Seconds of ``counts[i]`` calls of each ``calls[i]``, side by side: each one's calls spread
  evenly among the others' (:func:`spread`).

  Calibration times the plans of a size this way, as ``bench cluster`` times its rows, so that a
  slow phase of a shared machine falls on all of them rather than on whichever plan ran then,
  and each call follows another plan's traffic, as a reduction in a training step follows other
  work. Timed one plan after another, top-k's point came out 17-78 ms on the emulated cluster's
  MPI shape against 27 ms in the benchmark's rows (docs/simulations.md).

  Example:
    >>> made = []
    >>> times = side_by_side([lambda: made.append("a"), lambda: made.append("b")], [1, 3])
    >>> made, [len(t) for t in times]
    (['b', 'a', 'b', 'b'], [1, 3])
  """
  times: list[list[float]] = [[] for _ in calls]
  for i in spread(counts):
    t = time.perf_counter()
    calls[i]()
    times[i].append(time.perf_counter() - t)
  return times


def warm_up(calls: Sequence[Callable], n: int) -> list[float]:
  """Makes ``n`` calls of each of ``calls``, one after another; returns each one's mean seconds."""
  warm = []
  for call in calls:
    t = time.perf_counter()
    for _ in range(n):
      call()
    warm.append((time.perf_counter() - t) / max(n, 1))
  return warm
