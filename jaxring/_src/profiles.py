"""Measured profiles: what ``auto`` reads to choose a plan, and where calibration keeps them.

The alpha-beta formulas (jaxring._src.cost_model) describe links; what a plan costs on a given
machine also depends on what they leave out (XLA:CPU's buffer allocation, gloo's loopback between
devices of one process, encode/decode). On the emulated cluster (4 nodes x 2 devices, 1 Gbit/s,
32 MiB) the formulas said "hierarchical" where it took 1.41x gloo's psum. ``auto`` therefore
trusts a profile measured on the mesh (``jaxring calibrate``): a line t(n) = alpha + beta * n
fitted per plan (algorithm x codecs) from timed calls, and without one it keeps the native
collective for lossless reductions.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import pathlib
from collections.abc import Sequence

import numpy as np

from jaxring._src import cache

ENV_PROFILE = "JAXRING_PROFILE"          # a profile file to use, or "off"


@dataclasses.dataclass(frozen=True)
class Fit:
  """One plan's measured costs: ``seconds`` at ``sizes`` (bytes per member), and the least-squares
  line ``alpha + beta * bytes`` through them (a summary for people reading the profile).

  :meth:`predict` interpolates between the measured points rather than following the line: the
  costs are not linear in size on the machines measured. On the emulated cluster (JAX shape, 4
  nodes x 2, 1 Gbit/s, glibc malloc; docs/benchmarks.md) hierarchical uncompressed tied gloo's
  psum at 8 and 16 MiB and took 1.08x its time at 32 MiB, and top-k 1% took 3-4x as long at
  32 MiB as at 16 MiB: a line through 1 and 16 MiB chose the slower plan at 32 MiB.
  """
  algorithm: str
  codecs: tuple[str, ...]                # repr of each level's codec, fast -> slow
  alpha: float
  beta: float
  sizes: tuple[int, ...] = ()            # the measured points, ascending
  seconds: tuple[float, ...] = ()

  def predict(self, nbytes: float) -> float:
    """Seconds for ``nbytes`` per member: piecewise linear through the measured points, the end
    segments extended beyond them (never below 0); the line where fewer than two were kept."""
    if len(self.sizes) < 2:
      return self.alpha + self.beta * nbytes
    xs, ys = self.sizes, self.seconds
    k = int(np.searchsorted(xs, nbytes))
    k = min(max(k, 1), len(xs) - 1)      # the segment [k - 1, k], or an end one extended
    slope = (ys[k] - ys[k - 1]) / (xs[k] - xs[k - 1])
    return max(0.0, ys[k - 1] + slope * (nbytes - xs[k - 1]))

  @classmethod
  def from_points(cls, algorithm: str, codecs, sizes, seconds) -> Fit:
    """The points (sorted by size) and their least-squares line (alpha, beta >= 0)."""
    pts = sorted(zip((int(s) for s in sizes), (float(t) for t in seconds)))
    x, y = np.asarray([p[0] for p in pts], np.float64), np.asarray([p[1] for p in pts], np.float64)
    if len(x) == 1:
      beta, alpha = float(y[0] / x[0]), 0.0
    else:
      beta, alpha = (float(v) for v in np.polyfit(x, y, 1))
      if beta < 0:                       # noise on flat timings: a constant cost
        beta, alpha = 0.0, float(np.median(y))
      elif alpha < 0:                    # through the origin instead
        beta, alpha = float(np.dot(x, y) / np.dot(x, x)), 0.0
    # microseconds and 4 digits of beta: the timings are not better than that, and the JSON reads
    return cls(algorithm, tuple(codecs), round(alpha, 6), float(f"{beta:.4g}"),
               tuple(int(v) for v in x), tuple(round(float(v), 6) for v in y))


@dataclasses.dataclass(frozen=True)
class Profile:
  """Measured costs of the plans over one set of axes on one machine (see ``key``)."""
  key: dict
  fits: tuple[Fit, ...]
  created: str = ""
  meta: dict = dataclasses.field(default_factory=dict, compare=False)   # how it was measured

  def fit(self, algorithm: str, codecs: Sequence[str]) -> Fit | None:
    for f in self.fits:
      if f.algorithm == algorithm and f.codecs == tuple(codecs):
        return f
    return None

  def digest(self) -> int:
    """A hash of what ``auto`` reads (not when it was made): equal on processes that agree."""
    what = json.dumps({"key": self.key, "fits": [dataclasses.asdict(f) for f in self.fits]},
                      sort_keys=True)
    return int(hashlib.sha1(what.encode()).hexdigest()[:12], 16)

  def to_json(self) -> str:
    """Indented JSON with one line per plan (its measured sizes and seconds, then its line)."""
    head = json.dumps({"key": self.key, "created": self.created, "meta": self.meta}, indent=1)
    fits = ",\n  ".join(json.dumps(dataclasses.asdict(f)) for f in self.fits)
    return head[:-2] + f',\n "fits": [\n  {fits}\n ]\n}}'

  @classmethod
  def from_json(cls, text: str) -> Profile:
    d = json.loads(text)
    fits = tuple(Fit(f["algorithm"], tuple(f["codecs"]), float(f["alpha"]), float(f["beta"]),
                     tuple(f.get("sizes", ())), tuple(f.get("seconds", ()))) for f in d["fits"])
    return cls(d["key"], fits, d.get("created", ""), d.get("meta", {}))


def profile_key(axes, sizes, transport: str, processes: int, platform: str) -> dict:
  """What a profile is valid for: the axes and their sizes, transport, processes, platform,
  jaxring's version.

  The axes are sorted by name: every plan orders several axes by their levels, not by the order
  the caller wrote (jaxring._src.algorithms.planner.level_order), so ``("local", "node")`` and
  ``("node", "local")`` run the same plans and share one profile.

  Example:
    >>> profile_key(("local", "node"), (2, 4), "xla", 4, "cpu")["axes"]
    ['local', 'node']
  """
  try:
    version = importlib.metadata.version("jaxring")
  except importlib.metadata.PackageNotFoundError:
    version = "unknown"
  axes, sizes = _sorted_axes(axes, sizes)
  return {"axes": axes, "sizes": sizes,
          "transport": transport, "processes": int(processes), "platform": platform,
          "jaxring": version}


def _sorted_axes(axes, sizes) -> tuple[list[str], list[int]]:
  """The axis names sorted, each with its size."""
  pairs = sorted(zip(map(str, axes), map(int, sizes)))
  return [a for a, _ in pairs], [s for _, s in pairs]


def _comparable(key: dict) -> dict:
  """``key`` without jaxring's version, its axes sorted (a profile written in the caller's order
  is found for the axes in any order)."""
  out = {k: v for k, v in key.items() if k != "jaxring"}
  if "axes" in out and "sizes" in out:
    out["axes"], out["sizes"] = _sorted_axes(out["axes"], out["sizes"])
  return out


def cache_dir() -> pathlib.Path:
  return cache.cache_dir() / "profiles"


def profile_path(key: dict) -> pathlib.Path:
  digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
  return cache_dir() / f"{digest}.json"


def save_profile(profile: Profile) -> pathlib.Path:
  """Writes the profile where :func:`find_profile` looks (atomically) and returns the path."""
  path = profile_path(profile.key)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(f".tmp{os.getpid()}")
  tmp.write_text(profile.to_json())
  os.replace(tmp, path)
  _read_profile.cache_clear()
  return path


_active: list[Profile] = []


@contextlib.contextmanager
def use_profile(profile: Profile | None):
  """Makes ``profile`` the one ``auto`` reads in this block (None: no profile at all)."""
  _active.append(profile)
  try:
    yield profile
  finally:
    _active.pop()


@functools.lru_cache(maxsize=64)
def _read_profile(path: str) -> Profile | None:
  try:
    return Profile.from_json(pathlib.Path(path).read_text())
  except FileNotFoundError:
    return None


def find_profile(key: dict) -> Profile | None:
  """The profile ``auto`` uses for ``key``: :func:`use_profile`'s, else ``JAXRING_PROFILE``'s
  file, else the calibrated one in :func:`cache_dir`; None if there is none or it is for other
  axes."""
  if _active:
    profile = _active[-1]
  else:
    env = os.environ.get(ENV_PROFILE, "")
    if env.lower() in ("off", "0", "none"):
      return None
    profile = _read_profile(env or str(profile_path(key)))
  if profile is None:
    return None
  return profile if _comparable(profile.key) == _comparable(key) else None
