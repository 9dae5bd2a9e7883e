"""Measured planning: time every candidate plan on the real mesh, fit its cost line, keep it.

``auto`` (the planner) reads the profile this writes (jaxring._src.profiles.find_profile). Each
candidate is ``jaxring.psum`` of f32 over the axes with one algorithm (``xla``, ``ring``,
``hierarchical``) and one codec, the codec on the slowest level only over several levels (the
BlueConnect way: ``compression={"node": codec}``), timed at a few sizes (the median of a few
calls); ``auto`` interpolates between them. Top-k's chunk norms are summed by the lossless plan
``auto`` picks from this calibration's first timings of the lossless plans, not from whatever
profile was cached before (:func:`_norms_profile`). Every process of a multi-process job must
call :func:`calibrate` together: the timings are process 0's, broadcast, so that every process
plans alike (different plans on different processes would not meet).
"""
from __future__ import annotations

import datetime
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxring._src import profiles, timing
from jaxring._src.algorithms import planner
from jaxring._src.algorithms.base import candidates as plan_candidates
from jaxring._src.calibrate import targets
from jaxring._src.codecs.base import parse as parse_codec
from jaxring._src.codecs.base import sweep
from jaxring._src.transport.mpi import MPI_TRANSPORT
from jaxring._src.transport.xla import XLA

# Log-spaced over what gradient buckets and psums take: 1 KiB pins the per-call latency (a step's
# statistics, losses, chunk norms), 64 KiB small buckets and top-k's packed chunks, 32 MiB the
# cost where plans part (a line through 1 and 16 MiB chose the slower plan at 32 MiB).
DEFAULT_SIZES = (1 << 10, 64 << 10, 1 << 20, 32 << 20)
#: Seconds of timed calls a large point gets at most: a quick plan (top-k) is called more than
#: ``reps`` times, up to :data:`QUICK_REPS_FACTOR` times as many (docs/simulations.md).
POINT_BUDGET_S = 0.5
#: A plan whose calls take under QUICK_S gets QUICK_BUDGET_S: the shared cores' jitter is
#: milliseconds a call, tens of percent of a quick one (top-k at 32 MiB, MPI shape: 19-53 ms in
#: one row of ``cluster-20261129-054641.json``, 21-35 between its deciles). With 16 calls a
#: timing its points were 25-32 ms in three jobs (the lower of two medians), with 36 pooled over
#: both timings 25-29 (``benchmarks/scripts/topk_points_mpi.py``), where ``bench cluster``'s rows
#: of the same programs take ~27.
QUICK_S = 0.1
QUICK_BUDGET_S = 1.0
#: Top-k's 32 MiB point (~30 ms a call on the emulated cluster) took 24.5-34.5 ms on 9 calls.
QUICK_REPS_FACTOR = 12
#: The codecs timed by default: the codec registry's sweep (``codecs.base.sweep``), as the
#: codec modules registered it at import; ``calibrate(codecs=None)`` asks the registry anew.
DEFAULT_CODECS = sweep()
#: Compressed plans are timed from this size up: below, a call is latency, which the lossless
#: plans' small points pin (docs/design.md, "What calibration compiles").
COMPRESSED_FROM = 1 << 20


def _candidates(groups, codecs: Sequence[str]):
  """(algorithm, compression argument) pairs worth timing over these levels: every plan with
  every codec, and the dense codec a sparsifying one (top-k) sends its chunks with.

  Top-k was timed with the default plan only, the others predicted from the dense codec's
  timings at the packed size (planner.predict, still used for a profile without them): on the
  emulated cluster's JAX shape that predicted the flat ring's top-k 10-23% low in most runs, its
  14 latency-bound hops running beside the other processes' chunk work on the shared cores
  (docs/design.md, "Planner").
  """
  algorithms = plan_candidates(len(groups))
  parsed = [parse_codec(spec) for spec in codecs]
  for codec in list(parsed):
    if codec is not None and not codec.per_hop:
      dense = codec.dense_codec(jnp.float32)
      if not any(_same(dense, c) for c in parsed):
        parsed.append(None if not dense.lossy else dense)
  out = []
  for codec in parsed:
    comp = None if codec is None else ({groups[-1].name: codec} if len(groups) > 1 else codec)
    out += [(a, comp) for a in (("xla",) if codec is None else ()) + algorithms]
  return out


#: The transport a profile's key names (what ``auto``'s default depends on: planner.choose).
_TRANSPORTS = {"xla": XLA, "mpi": MPI_TRANSPORT}


def _same(codec, other) -> bool:
  """Whether two parsed codecs (None: lossless) put the same on the wire."""
  if other is None:
    return not codec.lossy
  return repr(codec) == repr(other)


def _large_reps(reps: int, slowest: float) -> int:
  """Calls at a large size for a plan whose warm-up call took ``slowest`` seconds on the slowest
  process: as many as fit in :data:`POINT_BUDGET_S` (:data:`QUICK_BUDGET_S` under
  :data:`QUICK_S`), between ``reps`` and :data:`QUICK_REPS_FACTOR` times that.

  Example:
    >>> _large_reps(3, 0.5), _large_reps(3, 0.15), _large_reps(3, 0.03), _large_reps(3, 0.001)
    (3, 3, 33, 36)
  """
  budget = QUICK_BUDGET_S if slowest < QUICK_S else POINT_BUDGET_S
  return min(QUICK_REPS_FACTOR * reps, max(reps, int(budget / max(slowest, 1e-9))))


_LARGE = 4 << 20


def _reps(nbytes: int, reps: int) -> int:
  """Calls timed at a size: three times ``reps`` below 4 MiB, where a call costs tens of ms and
  varies by 2x on the emulated cluster's shared cores (the same on every process)."""
  return reps if nbytes >= _LARGE else 3 * reps


def _counts(target, nbytes: int, reps: int, calls, warmup: int) -> list[int]:
  """Makes ``warmup`` untimed calls of each of ``calls`` (plans at one size), then returns how
  many to time: :func:`_reps`, at a large size :func:`_large_reps` of the slowest process's
  warm-up, collectively (the same on every process). There a plan whose warm-up fits
  :data:`POINT_BUDGET_S` is called once more and counted by the quicker call: a program's first
  calls are slow, and top-k got 3 calls instead of 18 (docs/simulations.md)."""
  warm = timing.warm_up(calls, warmup)
  if nbytes < _LARGE or not warmup:
    return [_reps(nbytes, reps)] * len(calls)
  slowest = lambda ts: [t / 1e3 for t in target.most([int(1e3 * t) + 1 for t in ts])]  # noqa: E731
  slow = slowest(warm)
  again = [i for i, t in enumerate(slow) if t < POINT_BUDGET_S]
  for i, t in zip(again, slowest(timing.warm_up([calls[i] for i in again], 1))):
    slow[i] = min(slow[i], t)
  return [_large_reps(reps, t) for t in slow]


def _again(nbytes: int, reps: int, kept: int, median: float) -> int:
  """Calls a plan gets in the second timing (:func:`timing.confirm`): as many as its first
  timing kept, at least :func:`_reps`, and at a large size as many as its first median says fit
  its budget (:func:`_large_reps`; ``median`` is process 0's, the same on every
  process). A plan whose first calls paged in fresh memory gets its count there: in the MPI
  shape top-k's first call at 32 MiB took 0.97 s and its second 0.54, where the later ones took
  36-46 ms, and its count from them was 3 (that point has been 20-47% off its rows in the MPI
  shape's runs, docs/simulations.md).

  Example:
    >>> _again(32 << 20, 3, 3, 0.046), _again(32 << 20, 3, 3, 0.5), _again(1 << 20, 3, 7, 0.01)
    (21, 3, 9)
  """
  count = max(kept, _reps(nbytes, reps))
  return count if nbytes < _LARGE or not np.isfinite(median) else max(
      count, _large_reps(reps, median))


def _sizes_for(comp, sizes: Sequence[int]) -> tuple[int, ...]:
  """The sizes a plan is timed at: all for a lossless plan (``comp`` None), from
  :data:`COMPRESSED_FROM` up for a compressed one (all, where fewer than two sizes are that large).

  Example:
    >>> _sizes_for({"node": parse_codec("int8")}, DEFAULT_SIZES)
    (1048576, 33554432)
  """
  large = tuple(n for n in sizes if n >= COMPRESSED_FROM)
  return tuple(sizes) if comp is None or len(large) < 2 else large


def _codec_of(comp):
  return next(iter(comp.values())) if isinstance(comp, dict) else comp


def _norms_bytes(comp, nbytes: int) -> int:
  """Bytes of the chunk norms (an f32 per chunk) a sparsifying codec sums for ``nbytes`` of f32."""
  return 4 * _codec_of(comp).num_chunks(max(1, nbytes // 4))


def _compiled(program, x):
  """``program`` (a ``jax.jit``) compiled for ``x`` before any clock starts. Not the AOT
  ``Compiled``: in jax 0.10 its fast path drops an ordered effect's token (mpi4jax's)."""
  program.lower(x).compile()
  return program


def _norms_profile(target, key, plans, compiled, sizes, inputs, reps: int, warmup: int,
                   log) -> tuple[profiles.Profile, dict]:
  """The lossless plans timed at the sizes a sparsifying codec's chunk norms take, as the
  profile under which its programs are traced, and ``{size index: {plan index: this process's
  seconds of each call}}``: the first timing at those sizes, where only lossless plans are
  timed (below :data:`COMPRESSED_FROM`), is this one.

  Top-k sums its chunk norms with the lossless plan ``auto`` picks (``engine.sum_norms``).
  Traced under a cached profile (or none), the top-k timed would not be the one this profile
  runs (emulated cluster, JAX shape: 8 KiB of norms 10 ms by gloo's psum, 6.6 by hierarchical;
  docs/simulations.md). So the lossless plans are timed first up to the norms' largest size.
  """
  largest = max(_norms_bytes(c, max(sizes)) for _, c in plans if _sparsifying(c))
  ascending = sorted(range(len(sizes)), key=lambda j: sizes[j])
  upto = next((k for k, j in enumerate(ascending) if sizes[j] >= largest), len(sizes) - 1)
  small = ascending[:max(upto, 1) + 1]       # at least two sizes, to interpolate between
  lossless = [i for i, (_, c) in enumerate(plans) if c is None]
  seconds = np.zeros((len(lossless), len(small)))
  timed: dict[int, dict[int, list[float]]] = {}
  for k, j in enumerate(small):
    x = inputs[sizes[j]]
    calls = [lambda f=compiled[i][j]: jax.block_until_ready(f(x)) for i in lossless]
    counts = _counts(target, sizes[j], reps, calls, warmup)
    times = timing.unpaged(calls, counts, target.barrier, target.most)
    seconds[:, k] = [np.median(t) for t in times]
    timed[j] = dict(zip(lossless, times))
  seconds = np.asarray(target.broadcast(seconds), np.float64)
  none = planner.codec_key([planner.codec_for(None, g.name, jnp.float32) for g in target.groups])
  fits = tuple(profiles.Fit.from_points(plans[i][0], none, [sizes[j] for j in small], row)
               for i, row in zip(lossless, seconds))
  profile = profiles.Profile(key, fits, meta={"levels": [str(g.name) for g in target.groups]})
  if log is not None:
    log("chunk norms: " + ", ".join(
        f"{n} B by {plan['none']}" for n, plan in choices(profile, _norm_sizes(plans, sizes),
                                                          ["none"]).items()))
  return profile, timed


def _norm_sizes(plans, sizes) -> list[int]:
  return sorted({_norms_bytes(c, n) for _, c in plans if _sparsifying(c) for n in sizes})


def _sparsifying(comp) -> bool:
  return comp is not None and not _codec_of(comp).per_hop


def _time_candidates(target, key, codecs, sizes, inputs, reps: int, warmup: int, log):
  """Every candidate plan compiled at every size, then timed size by size, the plans side by
  side (:func:`timing.side_by_side`): ``(plans, compiled, seconds, raw, norms)``,
  ``seconds[plan, size]`` process 0's medians, broadcast (the same on every process),
  ``raw[plan][size]`` this process's seconds of each call, ``norms`` the profile a
  sparsifying codec's programs were traced under (:func:`_norms_profile`; None without one)."""
  plans = list(_candidates(target.groups, codecs))
  t0 = time.perf_counter()
  # compiled before the clock starts: a first call that compiles, among three timed at 32 MiB,
  # makes their median the slower of the other two
  def compile_row(a, c):   # None where the plan is not timed (_sizes_for)
    return [_compiled(target.program(a, c), inputs[n]) if n in _sizes_for(c, sizes) else None
            for n in sizes]
  compiled = [None if _sparsifying(c) else compile_row(a, c) for a, c in plans]
  norms, done = None, {}
  if any(_sparsifying(c) for _, c in plans):
    norms, done = _norms_profile(target, key, plans, compiled, sizes, inputs, reps, warmup, log)
    with profiles.use_profile(norms):
      compiled = [row if row is not None else compile_row(a, c)
                  for (a, c), row in zip(plans, compiled)]
  t_compiled = time.perf_counter()
  raw: list[list[list[float]]] = [[] for _ in plans]
  for j, nbytes in enumerate(sizes):
    x = inputs[nbytes]
    live = [i for i, row in enumerate(compiled) if row[j] is not None]
    if set(done.get(j, ())) == set(live):      # timed for the chunk norms, the same way
      times = done[j]
    else:
      calls = [lambda f=compiled[i][j]: jax.block_until_ready(f(x)) for i in live]
      # the first calls of a compiled program are often slow (docs/design.md,
      # "Investigations"); their time also sets a large point's number of calls
      counts = _counts(target, nbytes, reps, calls, warmup)
      # the median, as users and benchmarks see it: the fastest call favours plans whose times
      # vary (bench cluster, JAX shape, 32 MiB: hierarchical 488-549 ms, gloo psum 495-523
      # ms; the fastest calls chose hierarchical, the medians gloo); calls that paged in fresh
      # memory left out (timing.unpaged: a first-use cost, not the plan's)
      times = dict(zip(live, timing.unpaged(calls, counts, target.barrier, target.most)))
    for i, row in enumerate(raw):
      row.append(times.get(i, []))
  medians = np.asarray([[np.median(t) if t else np.nan for t in row] for row in raw], np.float64)
  first = np.asarray(target.broadcast(medians), np.float64)
  if log is not None:
    log(f"compiled {len(plans)} plans at {len(sizes)} sizes in {t_compiled - t0:.1f} s, timed "
        f"side by side in {time.perf_counter() - t_compiled:.1f} s")
    for (algorithm, comp), row in zip(plans, first):
      log(f"{algorithm:>12} {_label(comp):<10} " + "  ".join(
          f"{s >> 10:>7} KiB {t * 1e3:9.2f} ms" for s, t in zip(sizes, row) if np.isfinite(t)))
  return plans, compiled, first, raw, norms


def calibrate(mesh: jax.sharding.Mesh | None = None, axes: Sequence[str] | str | None = None, *,
              sizes: Sequence[int] = DEFAULT_SIZES, codecs: Sequence[str] | None = None,
              reps: int = 3, warmup: int = 1, reuse: bool = True, save: bool = True,
              log=None) -> profiles.Profile:
  """Times the candidate plans of ``psum`` over ``axes`` and returns (and keeps) their profile.

  Collective: every process of the job calls it, with the same arguments.

  Args:
    mesh: the mesh the program reduces over (every device of it takes part); None for an axis
      name bound to an MPI communicator (``jaxring.distributed.bind_mpi_axis``).
    axes: the axis names, as the program passes them to ``psum`` (default: all of the mesh's).
    sizes: bytes per device to time the plans at (at least two; compressed plans from
      :data:`COMPRESSED_FROM` up; costs between and beyond are interpolated, ``Fit.predict``).
    codecs: codec spellings (``jaxring.codecs.parse``) to time, ``none`` for lossless plans
      (default: every codec registered for the sweep, ``codecs.base.sweep()``).
    reps, warmup: timed and untimed calls per point (the median is kept; three times ``reps``
      below 4 MiB, above it up to :data:`QUICK_REPS_FACTOR` times where they fit in
      :data:`POINT_BUDGET_S`, or :data:`QUICK_BUDGET_S` for a quick plan: :func:`_counts`).
      Each program is compiled, then warmed up. At each size the plans are timed side by
      side, each call after a barrier, leaving out calls that paged in fresh memory
      (:func:`timing.unpaged`), as ``bench cluster`` times its rows; then every plan again
      (:func:`_again` calls), keeping the lower median (alone in its codec, or with a
      sparsifying codec: the median of all its calls; :func:`timing.confirm`).
      With a sparsifying codec the lossless plans are first timed at the sizes its chunk norms
      take (``meta["chunk_norms"]`` records the plan they chose).
    reuse: return the cached profile of these axes if every process has the same one.
    save: write the profile to the cache, where ``auto`` finds it.
    log: a callable receiving one line per measured plan (e.g. ``print``).

  Returns:
    The :class:`~jaxring._src.profiles.Profile`; ``auto`` uses it from now on (and in later
    processes, through the cache).

  Raises:
    ValueError: fewer than two sizes, or no mesh and no MPI-bound axis name.

  Example:
    >>> mesh = jax.make_mesh((2, 4), ("node", "local"))  # doctest: +SKIP
    >>> profile = jaxring.calibrate(mesh, sizes=(1 << 20, 8 << 20))  # doctest: +SKIP
  """
  if len(sizes) < 2:
    raise ValueError(f"calibrate: need at least two sizes to interpolate, got {tuple(sizes)}")
  if isinstance(axes, str):
    axes = (axes,)
  if codecs is None:
    codecs = sweep()
  target = targets.target(mesh, axes)
  key = profiles.profile_key(target.axes, target.sizes, target.transport, jax.process_count(),
                               jax.default_backend())
  if reuse:
    cached = profiles.find_profile(key)
    digest = cached.digest() if cached else -1
    # every process takes part, cached or not; the largest of d and of -d is d, -d: all alike
    if target.most([digest, -digest]) == [digest, -digest] and cached is not None:
      return cached
  t0 = time.perf_counter()
  inputs = {nbytes: target.input(max(1, nbytes // 4)) for nbytes in sizes}
  plans, compiled, first, raw, norms = _time_candidates(target, key, codecs, sizes, inputs,
                                                          reps, warmup, log)

  def retime(rows: list[int], j: int) -> np.ndarray:
    x = inputs[sizes[j]]
    again = timing.unpaged(
        [lambda f=compiled[i][j]: jax.block_until_ready(f(x)) for i in rows],
        [_again(sizes[j], reps, len(raw[i][j]), first[i, j]) for i in rows], target.barrier,
        target.most)
    return target.broadcast(np.asarray([(np.median(t), np.median(t + raw[i][j]))
                                        for i, t in zip(rows, again)], np.float64))
  table = timing.confirm(first, [_label(comp) for _, comp in plans], retime,
                         pooled={_label(comp) for _, comp in plans if _sparsifying(comp)})
  if log is not None:
    changed = "  ".join(
        f"{a}/{_label(c)}@{sizes[j] >> 10}KiB {first[i, j] * 1e3:.1f}->{table[i, j] * 1e3:.1f}"
        for i, (a, c) in enumerate(plans) for j in range(len(sizes)) if first[i, j] != table[i, j]
        and np.isfinite(first[i, j]))
    log(f"timed again, every plan: {changed}")
  fits = []
  for (algorithm, comp), seconds in zip(plans, table):
    codec_names = planner.codec_key(
        [planner.codec_for(comp, g.name, jnp.float32) for g in target.groups])
    fits.append(profiles.Fit.from_points(algorithm, codec_names, *zip(*(
        (n, float(t)) for n, t in zip(sizes, seconds) if np.isfinite(t)))))
  del inputs, compiled
  meta = {"statistic": f"median of {reps} to {QUICK_REPS_FACTOR * reps} calls ({3 * reps} below "
                       f"4 MiB; above, as many as fit in {POINT_BUDGET_S} s, {QUICK_BUDGET_S} s "
                       f"under {QUICK_S} s a call, by the quicker of "
                       f"{warmup + 1} warm-up calls; compressed plans from {COMPRESSED_FROM >> 20}"
                       f" MiB up) after {warmup} warm-up, process 0's, side by side, each call "
                       f"after a barrier, calls that paged left out; every plan timed again (above "
                       f"4 MiB as many calls as its first median fits in the budget), the "
                       f"lower median kept (alone in its codec, or sparsifying: the median of "
                       f"all its calls)",
          "codecs": list(codecs), "levels": [str(g.name) for g in target.groups],
          "seconds_to_calibrate": round(time.perf_counter() - t0, 1)}
  profile = profiles.Profile(key, tuple(fits),
                               datetime.datetime.now(datetime.timezone.utc).isoformat(), meta)
  if norms is not None:
    # the chunk norms' plan the sparsifying codec was timed with, and the one it will run with
    # under this profile (they differ only where the two timings of the lossless plans do)
    timed, later = (choices(p, _norm_sizes(plans, sizes), ["none"]) for p in (norms, profile))
    meta["chunk_norms"] = {str(n): timed[n]["none"] for n in timed}
    if timed != later:
      meta["chunk_norms_now"] = {str(n): later[n]["none"] for n in later}
      if log is not None:
        log(f"chunk norms: timed with {meta['chunk_norms']}, this profile picks "
            f"{meta['chunk_norms_now']}")
  if save:
    profiles.save_profile(profile)
  return profile


def _label(comp) -> str:
  return "none" if comp is None else _codec_of(comp).name


def choices(profile: profiles.Profile, sizes: Sequence[int],
            codecs: Sequence[str] | None = None) -> dict[int, dict[str, str]]:
  """What ``auto`` picks from ``profile`` per size and codec spelling (for reports).

  ``codecs`` defaults to the ones the profile was calibrated with; each is on the slowest level,
  as :func:`calibrate` times it.

  Example:
    >>> choices(profile, [1 << 20], ["none", "int8"])  # doctest: +SKIP
    {1048576: {'none': 'xla', 'int8': 'hierarchical'}}
  """
  if codecs is None:
    codecs = profile.meta.get("codecs", sweep())
  levels = len(profile.meta.get("levels", ())) or len(profile.key["axes"])
  out: dict[int, dict[str, str]] = {}
  for nbytes in sizes:
    row: dict[str, str] = {}
    for spec in codecs:
      codec = parse_codec(spec)
      level = [None] * (levels - 1) + [codec]
      level_codecs = [planner.codec_for(c, "", jnp.float32) for c in level]
      row[spec] = planner.choose(nbytes, len(level_codecs), level_codecs,
                                 any(c.lossy for c in level_codecs), profile,
                                 transport=_TRANSPORTS.get(profile.key.get("transport")))
    out[nbytes] = row
  return out
