"""Per-level costs of a machine, fitted from a calibration profile: the simulator's measured model.

The alpha-beta formulas of ``jaxring._src.cost_model`` give what the links cost. What a plan
costs on a machine also holds what they leave out, and ``jaxring calibrate`` measures it: the
profile times each plan at a few sizes. This module splits those timings into parts that
carry over to other sizes, link rates and plans:

  t(plan, n) = link(plan, n) + sum over levels (messages x alpha_l + bytes x beta_l)
               + coded bytes x kappa_c + gamma_c

- ``link`` is the slow level's wire bytes at the link rate (known: the rate the links are
  shaped to). Each node's devices run their node-level rings side by side and share its link.
- ``alpha_l``, ``beta_l``: the cost per message and per byte on level ``l`` beyond the link time
  (on the emulated cluster: gloo's loopback TCP between the devices of a process, the kernel's
  TCP work, XLA:CPU's buffer handling). Over two levels the hierarchical plan is the only one
  with local and node hops, always as many of each, so a calibration determines what its hops
  cost together, not each level's share.
- ``alpha_ring``: the cost per hop of the flat ring through every member. Its hop is not a
  node-level hop: in the JAX shape every hop is one collective permute of all the devices, a
  process's two devices included, and the calibration's dense flat ring took 16-25 ms at 1 KiB
  (14 hops) where the hierarchical plan took 5-7 (2 local and 6 node hops); one ``alpha_node``
  for both under-predicted the flat ring's top-k by 9-31% (docs/simulations.md).
- ``kappa_c``, ``gamma_c``: codec ``c``'s encode and decode per f32 byte of the slow level's
  hops, and its cost per call (``c`` the codec's registered name, ``codecs.base.name_of``).
- Top-k chunks: the chunk norms' all-reduce, by the lossless plan ``auto`` picks from the
  profile (:func:`norms_plans`); selection and scatter on the whole buffer (``kappa``,
  ``gamma``); the dense plan on the packed chunks.
- The native all-reduce (``xla``: gloo, or ``MPI_Allreduce``) is a black box: a cost per call
  and a multiple of the flat ring's link time (MPICH's large-message algorithm sends about twice
  the ring's bytes per node link), of which the share ``hidden_native`` of the smaller runs
  under the larger (:func:`native`: gloo's latency mostly does, 0.74 in one calibration).

Messages and bytes per level come from the cost model's own formulas, evaluated with unit
constants, so the two cannot disagree. The coefficients are fitted by least squares over the
timed points of the profile (:func:`fit`): the native all-reduce's three from its own points
first (:func:`_fit_native`), then the others, non-negative, from the rest, less any point timed
far slower than the fit of all the others gives it (:data:`OUTLIER`).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from jaxring._src import cost_model, profiles
from jaxring._src.codecs.base import from_repr, name_of, parse, sweep

LEVELS = ("local", "node")


def coefficients(codecs) -> tuple[str, ...]:
  """The coefficients of a model of these (lossy) codecs: per level, then per codec."""
  return (("alpha_local", "alpha_node", "alpha_ring", "beta_local", "beta_node", "alpha_native",
           "link_native") + tuple(f"kappa_{c}" for c in codecs)
          + tuple(f"gamma_{c}" for c in codecs))


# Each codec has fitted coefficients of its own (kappa_<codec>, gamma_<codec>): these are the
# codec registry's sweep (codecs.base.sweep) as the codec modules registered it, less the
# lossless none; a profile that timed other codecs fits theirs too (fit).
CODECS = tuple(c for c in sweep() if c != "none")
NAMES = coefficients(CODECS)


def codec_spelling(text: str) -> str:
  """The registered name (``none``, ``bf16``, ``int8``, ``topk``, ...) of a profile's codec
  string: the repr of a level's codec (``planner.codec_key``), read back by the codec registry.

  Example:
    >>> codec_spelling("Int8(block_size=256, stochastic=False)")
    'int8'
  """
  try:
    return name_of(from_repr(text))
  except ValueError as e:
    raise ValueError(f"calibrated: no model for the codec {text!r} ({e})") from e


@dataclasses.dataclass(frozen=True)
class Wire:
  """What a codec puts on the wire: bytes per f32 byte, and for top-k the packed chunks."""
  ratio: float = 1.0
  density: float = 0.0          # top-k: the fraction of chunks sent (0: a dense codec)
  chunk_bytes: int = 0          # top-k: f32 bytes per chunk

  def packed(self, nbytes: float) -> float:
    chunks = max(1, math.ceil(nbytes / self.chunk_bytes))
    return max(1, round(chunks * self.density)) * self.chunk_bytes


def codec_wire(codec) -> Wire:
  """What ``codec`` (None: none) puts on the wire, by its own arithmetic: its bytes per f32 byte
  (``Codec.compression_ratio`` of ``wire_bytes``), or for a codec that wraps the all-reduce
  (top-k: not ``per_hop``) the fraction of chunks it sends and their f32 bytes."""
  if codec is None:
    return Wire()
  if not codec.per_hop:
    return Wire(density=float(codec.density), chunk_bytes=4 * int(codec.chunk_size))
  return Wire(float(codec.compression_ratio(np.float32)))


def wire_of(text: str) -> Wire:
  """The wire format of a profile's codec string (the codec its repr names: :func:`codec_wire`)."""
  try:
    return codec_wire(from_repr(text))
  except ValueError as e:
    raise ValueError(f"calibrated: no model for the codec {text!r} ({e})") from e


def terms(algorithm: str, codec: str, wire: Wire, nbytes: float, sizes: tuple[int, int],
          link_bytes_per_s: float, extra=None, norms=None) -> tuple[float, dict[str, float]]:
  """``(link seconds, {coefficient: its multiplier})`` of one all-reduce of ``nbytes`` per member.

  ``sizes`` are the members per level, fast to slow; ``link_bytes_per_s`` is one node's link;
  ``extra(algorithm, codec, nbytes)``: the link bytes a call costs beyond its payload
  (:class:`LinkBytes`), or None (none); ``norms(nbytes)``: the lossless plan top-k's chunk
  norms of ``nbytes`` are summed by (``auto``'s pick, :func:`norms_plans`), or None (the native
  all-reduce).
  """
  f = dict.fromkeys(NAMES, 0.0)
  if wire.density:
    # the chunk norms' all-reduce (one f32 per chunk), then the dense plan on the chunks
    n_norms = 4 * math.ceil(nbytes / wire.chunk_bytes)
    norms_link, norms_f = terms("xla" if norms is None else norms(n_norms), "none", Wire(),
                                n_norms, sizes, link_bytes_per_s, extra)
    link, f = terms(algorithm, "none", Wire(), wire.packed(nbytes), sizes, link_bytes_per_s,
                    extra)
    f = {k: v + norms_f[k] for k, v in f.items()}
    f[f"kappa_{codec}"] = f.get(f"kappa_{codec}", 0.0) + nbytes
    f[f"gamma_{codec}"] = f.get(f"gamma_{codec}", 0.0) + 1.0
    return link + norms_link, f
  local, nodes = sizes
  p = local * nodes
  unit = 1.0                                # the formulas at unit latency or bandwidth
  beyond = 0.0 if extra is None else extra(algorithm, codec, nbytes) / link_bytes_per_s
  if algorithm == "xla":
    f["alpha_native"] += 1.0
    f["link_native"] += cost_model.ring_all_reduce(nbytes, p, 0.0, link_bytes_per_s)
    return beyond, f
  if algorithm == "ring":                   # one ring through every member, node by node
    f["alpha_ring"] += cost_model.ring_all_reduce(0.0, p, unit, math.inf)
    f["beta_node"] += cost_model.ring_all_reduce(nbytes, p, 0.0, unit, wire.ratio)
    link = cost_model.ring_all_reduce(nbytes, p, 0.0, link_bytes_per_s, wire.ratio)
    coded = cost_model.ring_all_reduce(nbytes, p, 0.0, unit)
  elif algorithm == "hierarchical":         # BlueConnect; the codec on the node level only
    shard = nbytes / local
    f["alpha_local"] += cost_model.ring_all_reduce(0.0, local, unit, math.inf)
    # the local reduce-scatter moves f32; its all-gather carries the node level's encoding
    f["beta_local"] += (cost_model.ring_reduce_scatter(nbytes, local, 0.0, unit)
                        + cost_model.ring_all_gather(nbytes, local, 0.0, unit, wire.ratio))
    f["alpha_node"] += cost_model.ring_all_reduce(0.0, nodes, unit, math.inf)
    f["beta_node"] += cost_model.ring_all_reduce(shard, nodes, 0.0, unit, wire.ratio)
    link = cost_model.ring_all_reduce(shard, nodes, 0.0, link_bytes_per_s / local, wire.ratio)
    coded = cost_model.ring_all_reduce(shard, nodes, 0.0, unit)
  else:
    raise ValueError(f"calibrated: no model for the algorithm {algorithm!r}")
  if codec != "none":
    f[f"kappa_{codec}"] = f.get(f"kappa_{codec}", 0.0) + coded
    f[f"gamma_{codec}"] = f.get(f"gamma_{codec}", 0.0) + 1.0
  return link + beyond, f


@dataclasses.dataclass(frozen=True)
class LinkBytes:
  """What a call puts on a node's link beyond its payload, by plan and size, as measured
  (``jaxring bench cluster``'s ``link_probe``: the tx counter around small calls).

  Each call of a collective costs link bytes of its own: on the emulated cluster about 0.8 KB
  per gloo message, ~11 KB per native all-reduce of 8 devices (from 16 values up; a 4-byte one
  takes another path and ~0.6 KB). Next to 32 MiB that is nothing; for a step of 25 small
  all-reduces over a 10 Mbit/s link it is half the step. ``points``: ``{(algorithm, codec):
  ((bytes per member, extra link bytes), ...)}``, sizes ascending; between two sizes the extra
  is interpolated in log size, outside them it is the nearest one's.
  """
  points: dict = dataclasses.field(default_factory=dict)

  def __call__(self, algorithm: str, codec: str, nbytes: float) -> float:
    pts = self.points.get((algorithm, codec))
    if not pts:
      return 0.0
    x = np.log2([max(n, 1) for n, _ in pts])
    return float(np.interp(math.log2(max(nbytes, 1)), x, [b for _, b in pts]))

  @classmethod
  def measured(cls, probe: list[dict], wires: dict, sizes: tuple[int, int],
               link_bytes_per_s: float) -> LinkBytes:
    """From ``link_probe`` records: each call's tx bytes less the payload the formulas put on
    the link (the ring's bytes for the native all-reduce: gloo's is a ring), at least 0."""
    points: dict = {}
    for r in sorted(probe, key=lambda r: r["nbytes"]):
      algorithm, codec, n = r["algorithm"], r["codec"], r["nbytes"]
      link, f = terms(algorithm, codec, wires.get(codec) or _wire(codec), n, sizes,
                      link_bytes_per_s)
      payload = (link + f["link_native"]) * link_bytes_per_s
      points.setdefault((algorithm, codec), []).append((n, max(0.0, r["tx_per_call"] - payload)))
    return cls({k: tuple(v) for k, v in points.items()})


def _wire(codec: str) -> Wire:
  return codec_wire(parse(codec))    # the named codec at its defaults


@dataclasses.dataclass(frozen=True)
class Calibrated:
  """A machine's fitted coefficients (seconds per message, per byte, per call; see the module
  docstring) for members laid out ``sizes`` = (per node, nodes)."""
  sizes: tuple[int, int]
  coef: dict
  wires: dict = dataclasses.field(default_factory=dict)   # codec spelling -> Wire, as profiled
  points: int = 0
  extra: LinkBytes = LinkBytes()          # link bytes per call beyond the payload, measured
  norms: object = None                    # top-k's chunk norms' plan by size (norms_plans)
  #: points left out of the fit: (algorithm, codec, bytes, seconds timed, seconds fitted)
  dropped: tuple = ()

  def with_wire(self, codec: str, wire: Wire) -> Calibrated:
    """The same machine with ``codec`` configured otherwise (e.g. top-k with other chunks)."""
    return dataclasses.replace(self, wires={**self.wires, codec: wire})

  def split(self, algorithm: str, codec: str, nbytes: float,
            link_bytes_per_s: float) -> tuple[float, float]:
    """``(seconds on the slow link, seconds of everything else)`` of one all-reduce (the
    native all-reduce's link share is inside its fitted multiple: counted as link)."""
    wire = self.wires.get(codec) or _wire(codec)
    link, f = terms(algorithm, codec, wire, nbytes, self.sizes, link_bytes_per_s, self.extra,
                    self.norms)
    native_link, native_other = native(self.coef, f)
    return link + native_link, _linear(self.coef, f, _NATIVE) + native_other

  def all_reduce_seconds(self, algorithm: str, codec: str, nbytes: float,
                         link_bytes_per_s: float) -> float:
    return sum(self.split(algorithm, codec, nbytes, link_bytes_per_s))


# how a profile names each swept codec at its defaults (planner.codec_key: the repr)
_DEFAULT = {c: repr(parse(c)) for c in CODECS}


def fit(profile: dict, sizes: tuple[int, int], link_bytes_per_s: float,
        link_probe: list[dict] | None = None) -> Calibrated:
  """Fits the coefficients to a profile's timed points (``Profile.to_json``'s dict); the link
  bytes each call costs beyond its payload come from ``link_probe`` (``bench cluster``'s
  records), counted as link time before the fit.

  Example:
    >>> model = fit(json.load(open(path)), (2, 4), 125e6)  # doctest: +SKIP
    >>> model.all_reduce_seconds("hierarchical", "int8", 32 << 20, 250e6)  # doctest: +SKIP
  """
  from scipy.optimize import nnls

  wires = {codec_spelling(f["codecs"][-1]): wire_of(f["codecs"][-1]) for f in profile["fits"]}
  names = coefficients(dict.fromkeys([*CODECS, *(c for c in wires if c != "none")]))
  extra = LinkBytes.measured(link_probe or [], wires, sizes, link_bytes_per_s)
  norms = norms_plans(profile)
  points = []   # (native plan?, seconds - link, weight, multipliers, (plan, codec, bytes, s))
  for fit_ in profile["fits"]:
    codec = codec_spelling(fit_["codecs"][-1])
    for nbytes, seconds in zip(fit_["sizes"], fit_["seconds"]):
      link, f = terms(fit_["algorithm"], codec, wires[codec], nbytes, sizes, link_bytes_per_s,
                      extra, norms)
      # weights 1/sqrt(t): between absolute error (the large sizes decide, and the small ones'
      # latency is lost) and relative error (the small sizes' noise, +-50% from one run to the
      # next at 1 MiB on the emulated cluster, decides)
      f = {**dict.fromkeys(names, 0.0), **f}   # a codec beyond the sweep's: 0 elsewhere
      points.append((fit_["algorithm"] == "xla", seconds - link, seconds ** -0.5, f,
                     (fit_["algorithm"], codec, nbytes, seconds)))
  # The native all-reduce is a black box measured by its own points: fitted first, from them
  # alone, then held (top-k's chunk norms take it too, where auto sums them by it). Fitted
  # jointly, the top-k points pulled its cost per call to 7 ms where its own 1 and 64 KiB
  # points took 10-12 ms (2026-11-26).
  coef = {**dict.fromkeys(names, 0.0), "hidden_native": 0.0}
  _fit_native(coef, [p for p in points if p[0]], nnls)
  # The other plans share coefficients, so one point no fit comes near (a slow phase of the
  # shared cores on a large size's 3 calls) moves every plan of its codec: one MPI-shape
  # calibration timed the flat ring with bf16 at 547 ms for 32 MiB (the flat ring without a
  # codec: 541 ms; the rows: 275 ms), and the fit through it over-predicted the hierarchical
  # bf16 row by 23%. A point over :data:`OUTLIER` times what the fit of all the others gives it
  # is left out (the fit bends towards a point it includes: 482 ms for that one). Only slower:
  # the shared cores' phases add time; a point far faster than the fit is the model's miss (one
  # calibration of 2026-11-26 timed the flat ring with int8 at 191 ms, the others fitted 297,
  # and its row took 190).
  rest, dropped = [p for p in points if not p[0]], []
  others = tuple(k for k in names if k not in _NATIVE)
  while len(dropped) < max(1, len(rest) // 10):
    worst = (math.log(OUTLIER), None, 0.0)
    for i, p in enumerate(rest):      # each point against the fit of all the others
      if sum(q[4][1:3] == p[4][1:3] for q in rest) < 2:
        continue                      # alone for its codec and size: the others cannot judge it
      _nnls_into(coef, others, rest[:i] + rest[i + 1:], nnls)
      fitted = _seconds(coef, p)
      off = math.log(p[4][3] / max(fitted, 1e-9))
      if off > worst[0] and p[4][3] - fitted > OUTLIER_FLOOR_S:
        worst = (off, i, fitted)
    if worst[1] is None:
      break
    dropped.append(rest[worst[1]][4] + (worst[2],))
    del rest[worst[1]]
  _nnls_into(coef, others, rest, nnls)
  return Calibrated(tuple(sizes), coef, wires, len(points) - len(dropped), extra, norms,
                    tuple(dropped))


#: A point of the profile timed this factor (and :data:`OUTLIER_FLOOR_S` seconds) slower than
#: the fit of the others gives it is left out of the fit, one at a time, at most a tenth of the
#: points; ``Calibrated.dropped`` lists them. Over the 32 MiB points of the stored ``bench
#: cluster`` runs of 2026-11-26 to -29 (818), the point against that fit is 0.86-1.16 from the
#: 5th to the 95th percentile; the two at 1.4-1.5 were both off their rows (the fit within 8%
#: and 36% of them, the points 1.63x and 2.32x); of the seven at 1.3-1.4, four were nearer
#: their rows than the fit (docs/simulations.md, "The model").
OUTLIER = 1.4
OUTLIER_FLOOR_S = 0.02


_NATIVE = ("alpha_native", "link_native")


def native(coef: dict, f: dict) -> tuple[float, float]:
  """``(link seconds, other seconds)`` of the native all-reduce's part of multipliers ``f``: its
  latency ``alpha_native`` per call and its multiple ``link_native`` of the flat ring's link
  time, less the share ``hidden_native`` of the smaller of the two that it overlaps with the
  other (0: one after the other; 1: the larger of the two alone).

  Gloo's all-reduce on the emulated cluster took 15.8 ms for 1 KiB and 19.4 ms for 1 MiB, whose
  ring link time is 14.7 ms: its latency runs under its transfer. Fitted as a plain sum, the
  1 MiB point pulled the latency to 11.9 ms, and the hand-written step (103 calls, 82 of them
  of 4 KiB or less, at ~16 ms a call) was predicted 20% short (docs/simulations.md).

  Example:
    >>> native({"alpha_native": 0.015, "link_native": 1.0, "hidden_native": 0.75},
    ...        {"alpha_native": 1.0, "link_native": 0.02})
    (0.02, 0.00375)
  """
  latency = coef["alpha_native"] * f["alpha_native"]
  link = coef["link_native"] * f["link_native"]
  return link, latency - coef.get("hidden_native", 0.0) * min(latency, link)


def _linear(coef: dict, f: dict, leave_out=()) -> float:
  return sum(coef[k] * v for k, v in f.items() if k not in leave_out)


def _seconds(coef: dict, point) -> float:
  """A point's fitted seconds, its link time included."""
  _, t, _, f, (_, _, _, seconds) = point
  return seconds - t + _linear(coef, f, _NATIVE) + sum(native(coef, f))


def _nnls_into(coef: dict, names, points, nnls) -> None:
  """The linear coefficients ``names`` by non-negative least squares, the others held (the
  native all-reduce's among them: :func:`_fit_native` fits it first)."""
  if not points:
    return
  fitting_native = bool(set(names) & set(_NATIVE))
  held = lambda f: (_linear(coef, f, (*names, *_NATIVE))  # noqa: E731
                    + (0.0 if fitting_native else sum(native(coef, f))))
  a = np.asarray([[f[k] * w for k in names] for _, _, w, f, _ in points])
  b = np.asarray([(t - held(f)) * w for _, t, w, f, _ in points])
  x, _ = nnls(a, b)
  coef.update(zip(names, (float(v) for v in x)))


def _fit_native(coef: dict, points, nnls) -> None:
  """``alpha_native``, ``link_native`` and ``hidden_native`` (:func:`native`) by weighted least
  squares over the native all-reduce's own points, from the plain sum's fit and from halfway
  and full overlap; the best of the three."""
  from scipy.optimize import least_squares
  if not points:
    return
  _nnls_into(coef, _NATIVE, points, nnls)      # the plain sum: hidden_native 0
  calls = np.asarray([f["alpha_native"] for _, _, _, f, _ in points])
  rings = np.asarray([f["link_native"] for _, _, _, f, _ in points])
  t = np.asarray([p[1] for p in points])
  w = np.asarray([p[2] for p in points])

  def residuals(x):
    latency, link = x[0] * calls, x[1] * rings
    return w * (latency + link - x[2] * np.minimum(latency, link) - t)
  start = np.asarray([coef["alpha_native"], coef["link_native"], 0.0])
  best = min((least_squares(residuals, start + [0, 0, h], bounds=([0, 0, 0], [np.inf, np.inf, 1]))
              for h in (0.0, 0.5, 1.0)), key=lambda r: r.cost)
  coef.update(alpha_native=float(best.x[0]), link_native=float(best.x[1]),
              hidden_native=float(best.x[2]))


def norms_plans(profile: dict):
  """``nbytes -> algorithm``: the lossless plan ``auto`` sums top-k's chunk norms of ``nbytes``
  with under ``profile`` (``calibrate.choices``), which is the plan the calibration timed top-k
  with (``calibrate._norms_profile``) and the one the rows run. On the emulated cluster's JAX
  shape the hierarchical plan (about 6.6 ms for 8 KiB, against 10 ms for gloo's psum): modelled
  as the native all-reduce, top-k's cost per call was fitted at 0, the least-squares bound."""
  from jaxring._src.calibrate import choices

  prof = profiles.Profile(profile.get("key", {}), tuple(
      profiles.Fit.from_points(f["algorithm"], f["codecs"], f["sizes"], f["seconds"])
      for f in profile["fits"]), meta={"levels": list(LEVELS)})

  @functools.lru_cache(maxsize=None)
  def plan(nbytes: int) -> str:
    return choices(prof, [int(nbytes)], ["none"])[int(nbytes)]["none"]
  return plan
