"""Several contenders timed side by side, and the order of their calls (no jax here:
the benchmark workers import it before jax is set up)."""
from __future__ import annotations

import random
import resource
import time
from collections.abc import Callable, Collection, Sequence
from fractions import Fraction

import numpy as np


def spread(counts: Sequence[int], order: Sequence[int] | None = None) -> list[int]:
  """The order of ``sum(counts)`` calls, ``counts[i]`` of them to contender ``i``: each
  contender's calls evenly spread over the whole span (its k-th of c calls at (k + 1/2)/c of it),
  ties in ``order``; without one, each group of ties in an order of its own, drawn from the
  group's position alone (the same on every process, as collective calls must be).

  A quick plan timed beside slow ones (top-k: 30 ms a call against 500 ms at 32 MiB on the
  emulated cluster) gets many calls; made in a row, after the slow plans' (passes: every plan
  once, then those with calls left), most of them fell within half a second, and one slow phase
  of the shared machine decided its median: calibration timed top-k at 47 ms where the same
  run's rows, spread over minutes, took 40 (docs/simulations.md). Spread, they sample the same
  phases as the slow plans' calls.

  Plans with as many calls tie at every slot. Ties in the plans' order made the MPI shape's
  uncompressed ring always follow MPICH's all-reduce and the hierarchical plan always follow the
  ring: calibration timed the hierarchical plan 3-8% above its ``bench cluster`` row in five of
  six jobs and the ring at or below its row in all six, and one job chose the ring, 1.14x the
  hierarchical row (docs/simulations.md). ``bench cluster`` draws each round's order for the
  same reason (``cluster_worker.round_order``).

  Example:
    >>> spread([1, 3], order=[0, 1]), spread([2, 2], order=[1, 0])
    ([1, 0, 1, 1], [1, 0, 1, 0])
    >>> sorted(spread([3, 3, 3])) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    True
  """
  calls = [(Fraction(2 * k + 1, 2 * c), i) for i, c in enumerate(counts) for k in range(c)]
  n = len(counts)
  if order is None:   # the g-th distinct slot's ties in an order drawn from g
    tie = {f: random.Random(g).sample(range(n), n)
           for g, f in enumerate(sorted({f for f, _ in calls}))}
  else:
    tie = dict.fromkeys((f for f, _ in calls), list(order))
  rank = {f: {i: r for r, i in enumerate(perm)} for f, perm in tie.items()}
  return [i for _, _, i in sorted((f, rank[f][i], i) for f, i in calls)]


def side_by_side(calls: Sequence[Callable], counts: Sequence[int],
                 before: Callable[[], object] | None = None) -> list[list[float]]:
  """Seconds of ``counts[i]`` calls of each ``calls[i]``, side by side: each one's calls spread
  evenly among the others' (:func:`spread`), ``before()`` (untimed) ahead of each call: a barrier
  of the processes for collective calls. Without one, process 0's time of a call holds the skew
  the call before left between the processes: on the emulated cluster's MPI shape, top-k at
  32 MiB timed beside calibration's other plans took 23.0 ms a call against 19.7 with a barrier
  (``benchmarks/scripts/calibration_barrier.py``).

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
    if before is not None:
      before()
    t = time.perf_counter()
    calls[i]()
    times[i].append(time.perf_counter() - t)
  return times


FRESH_PAGES = 8


def minor_faults() -> int:
  """This process's minor page faults so far (every thread's): pages it touched for the first
  time, each one zeroed by the kernel."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def unpaged(calls: Sequence[Callable], counts: Sequence[int], before: Callable[[], object],
            most: Callable[[list[int]], list[int]]) -> list[list[float]]:
  """:func:`side_by_side`, leaving out of each contender's seconds the calls during which some
  process paged in fresh memory (more than :data:`FRESH_PAGES` page faults), where at least a
  third of its calls (one at least) remain. ``most(faults)``: per call, the largest count over
  the processes (collective; ``faults`` is this process's, the same length on every process).

  On the emulated cluster's 2-core VM, touching fresh memory runs at 72-600 MiB/s (the kernel
  zeroes each page), and a program's first calls fault in its buffers: 18-45 huge pages per
  process, and 1534, 1500, 1134, 1261 ms against 560 for a flat ring at 32 MiB; calibration
  timed the JAX shape's flat-ring bf16 plan at 738 ms in a call that faulted 49 huge pages, 299-316
  without (docs/design.md, "Investigations"). A training step
  pays that once; the cost model must not pay it on every call. Where every call faults (an
  allocator that returns large buffers to the system after each), that is the steady state,
  and nothing is left out.

  Example:
    >>> touched = []
    >>> def fresh(): touched.append(bytearray(20 << 20))   # fresh pages, zeroed by the kernel
    >>> times = unpaged([fresh, lambda: None], [3, 3], lambda: None, lambda f: f)
    >>> [len(t) for t in times]            # fresh memory in every call: the steady state
    [3, 3]
  """
  faults: list[list[int]] = [[] for _ in calls]

  def counted(i: int, call: Callable) -> Callable:
    def run():
      f0 = minor_faults()
      call()
      faults[i].append(minor_faults() - f0)
    return run
  times = side_by_side([counted(i, c) for i, c in enumerate(calls)], counts, before)
  flat = most([f for fs in faults for f in fs])
  kept = []
  for ts in times:
    worst, flat = flat[:len(ts)], flat[len(ts):]
    clean = [t for t, f in zip(ts, worst) if f <= FRESH_PAGES]
    kept.append(clean if len(clean) >= max(1, len(ts) // 3) else ts)
  return kept


def call_seconds(call: Callable, n: int) -> list[float]:
  """Makes ``n`` calls of ``call`` in a row; returns the seconds of each."""
  seconds = []
  for _ in range(max(0, n)):
    t = time.perf_counter()
    call()
    seconds.append(time.perf_counter() - t)
  return seconds


def warm_up(calls: Sequence[Callable], n: int) -> list[float]:
  """Makes ``n`` calls of each of ``calls``, one after another; returns each one's mean seconds."""
  return [sum(call_seconds(call, n)) / max(n, 1) for call in calls]


def confirm(first: np.ndarray, groups: Sequence[str], retime,
            pooled: Collection[str] = ()) -> np.ndarray:
  """Times every contender again, in each column (a size), side by side; one with rivals in its
  group (calibration: the plans of one codec) keeps the lower of its two medians, one alone in
  its group, or in a group of ``pooled``, the median of all its calls.

  One slow phase of a shared machine (or a first use of links) can fall on one plan's calls and
  decide a choice: on the emulated cluster one MPI-shape calibration timed the hierarchical plan
  at 1034 ms against 553 ms in the benchmark's rounds, and ``auto`` chose a plan 1.6x slower.
  Timing again only the plans near the fastest is not enough, since a slow phase can push the
  fastest one out of any such window: one JAX-shape calibration timed the hierarchical plan at
  39.5 ms for 1 MiB (14.1-14.8 in four others), gloo's psum at 18.1, and ``auto`` ran gloo's at
  1.40x the hierarchical row. The second timing has no warm-up (the programs are compiled and
  warm). A plan alone in its codec (top-k) has no rival to be chosen over, but its cost sets
  the other plans' predictions (planner.predict) and the simulator's: one MPI-shape calibration
  timed top-k at 77.6 ms for 32 MiB, 26.7 ms in the rounds. Two medians of 16 calls drawn from
  a benchmark row's calls have a lower one 3.4% below the row's median on average over the
  top-k rows of ten runs; the median of all 32, 0.5% above (``benchmarks/scripts/
  confirm_bias.py``). Drawn in time order the two scatter more: in three MPI-shape jobs the
  top-k plans' first medians at 32 MiB were 26-41 ms, their second 25-32, rows of the same
  programs 27-35 (``benchmarks/scripts/topk_points_mpi.py``); where a group's plans differ by
  less than that, the lower of two only lowers the group's level, and ``pooled`` names it.

  ``first[contender, column]``: the first timings' medians, NaN where a contender is not timed
  (it is left out there). ``retime(contenders, column) ->``
  for each, ``(median of its new calls, median of its new and first calls together)``, the same
  on every process; the contenders are asked for in index order, the same on every process, as
  collective calls must be.

  Example:
    >>> first = np.array([[1.0], [1.2], [2.0], [0.5]])
    >>> again = {0: (1.1, 1.05), 1: (0.9, 1.0), 2: (1.0, 1.4), 3: (0.7, 0.6)}
    >>> confirm(first, ["a", "a", "a", "b"], lambda rows, j: [again[i] for i in rows])[:, 0]
    array([1. , 0.9, 1. , 0.6])
  """
  table = first.copy()
  alone = [list(groups).count(g) == 1 or g in pooled for g in groups]
  for j in range(table.shape[1]):
    rows = [i for i in range(len(groups)) if np.isfinite(table[i, j])]
    for i, (t, both) in zip(rows, retime(rows, j)):
      table[i, j] = both if alone[i] else min(table[i, j], t)
  return table
