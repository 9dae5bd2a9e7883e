"""The order of timed calls when several contenders are measured side by side (no jax here:
the benchmark workers import it before jax is set up)."""
from __future__ import annotations

from collections.abc import Sequence
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
