"""Measured planning: time every candidate plan on the real mesh, fit its cost line, keep it.

``auto`` (the planner) reads the profile this writes (jaxring._src.cost_model.find_profile). Each
candidate is ``jaxring.psum`` of f32 over the axes with one algorithm (``xla``, ``ring``,
``hierarchical``) and one codec, the codec on the slowest level only over several levels (the
BlueConnect way: ``compression={"node": codec}``), timed at a few sizes; a line
``seconds = alpha + beta * bytes`` is fitted to each. Every process of a multi-process job must
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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxring._src import collectives, cost_model
from jaxring._src.algorithms import planner
from jaxring._src.codecs.base import parse as parse_codec
from jaxring._src.transport import mpi_axis

# Two points fit each line exactly; every size is one more compilation per plan (gloo compiles
# dominated calibration on the emulated cluster), and 16 MiB is where the plans differ.
DEFAULT_SIZES = (1 << 20, 16 << 20)
DEFAULT_CODECS = ("none", "bf16", "int8", "topk")


def _candidates(groups, codecs: Sequence[str]):
  """(algorithm, compression argument) pairs worth timing over these levels."""
  algorithms = ("ring", "hierarchical") if len(groups) > 1 else ("ring",)
  out = []
  for spec in codecs:
    codec = parse_codec(spec)
    comp = None if codec is None else ({groups[-1].name: codec} if len(groups) > 1 else codec)
    out += [(a, comp) for a in (("xla",) if codec is None else ()) + algorithms]
  return out


class _MeshTarget:
  """psum over axes of a mesh (XLA collectives; every process of a jax.distributed job)."""

  def __init__(self, mesh, axes):
    self.mesh, self.axes = mesh, axes
    self.sizes = tuple(mesh.shape[a] for a in axes)
    self.groups = tuple(planner.levels_for(axes, self.sizes)[0])
    self.transport = "xla"

  def program(self, algorithm, comp):
    spec = P(self.axes)
    return jax.jit(jax.shard_map(
        lambda v: collectives.psum(v, self.axes, algorithm=algorithm, compression=comp),
        mesh=self.mesh, in_specs=spec, out_specs=P()))

  def input(self, n: int):
    return jax.device_put(jnp.ones((self.mesh.size * n,), jnp.float32),
                          NamedSharding(self.mesh, P(self.axes)))

  def broadcast(self, values: np.ndarray) -> np.ndarray:
    if jax.process_count() == 1:
      return values
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.broadcast_one_to_all(values))

  def gather(self, value: int) -> list[int]:
    if jax.process_count() == 1:
      return [value]
    from jax.experimental import multihost_utils
    return [int(v) for v in np.asarray(multihost_utils.process_allgather(np.int64(value)))]


class _MpiTarget:
  """psum over an axis name bound to an MPI communicator (one process per device)."""

  def __init__(self, binding):
    self.binding, self.axes, self.sizes = binding, binding.axes, binding.sizes
    self.groups = tuple(binding.hierarchy.groups)
    self.transport = binding.hierarchy.transport.name

  def program(self, algorithm, comp):
    return jax.jit(lambda v: collectives.psum(v, self.axes, algorithm=algorithm,
                                              compression=comp))

  def input(self, n: int):
    return jnp.ones((n,), jnp.float32)

  def broadcast(self, values: np.ndarray) -> np.ndarray:
    return np.asarray(self.binding.comm.bcast(values, root=0))

  def gather(self, value: int) -> list[int]:
    return [int(v) for v in self.binding.comm.allgather(int(value))]


def _target(mesh, axes):
  if mesh is not None:
    return _MeshTarget(mesh, tuple(mesh.axis_names if axes is None else axes))
  binding = mpi_axis.lookup(tuple(axes or ()))
  if binding is None:
    raise ValueError(f"calibrate: give the mesh of axes {axes}, or an axis name bound to an MPI "
                     "communicator by jaxring.distributed.bind_mpi_axis")
  return _MpiTarget(binding)


def _time(fn, x, reps: int, warmup: int) -> float:
  for _ in range(warmup):
    jax.block_until_ready(fn(x))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(x))
    times.append(time.perf_counter() - t)
  return min(times)   # the machine's noise only ever adds time


def calibrate(mesh: jax.sharding.Mesh | None = None, axes: Sequence[str] | str | None = None, *,
              sizes: Sequence[int] = DEFAULT_SIZES, codecs: Sequence[str] = DEFAULT_CODECS,
              reps: int = 3, warmup: int = 1, reuse: bool = True, save: bool = True,
              log=None) -> cost_model.Profile:
  """Times the candidate plans of ``psum`` over ``axes`` and returns (and keeps) their profile.

  Collective: every process of the job calls it, with the same arguments.

  Args:
    mesh: the mesh the program reduces over (every device of it takes part); None for an axis
      name bound to an MPI communicator (``jaxring.distributed.bind_mpi_axis``).
    axes: the axis names, as the program passes them to ``psum`` (default: all of the mesh's).
    sizes: bytes per device to time each plan at (at least two: a line is fitted).
    codecs: codec spellings (``jaxring.codecs.parse``) to time, ``none`` for lossless plans.
    reps, warmup: timed and untimed calls per point (the fastest is kept).
    reuse: return the cached profile of these axes if every process has the same one.
    save: write the profile to the cache, where ``auto`` finds it.
    log: a callable receiving one line per measured plan (e.g. ``print``).

  Returns:
    The :class:`~jaxring._src.cost_model.Profile`; ``auto`` uses it from now on (and in later
    processes, through the cache).

  Raises:
    ValueError: fewer than two sizes, or no mesh and no MPI-bound axis name.

  Example:
    >>> mesh = jax.make_mesh((2, 4), ("node", "local"))  # doctest: +SKIP
    >>> profile = jaxring.calibrate(mesh, sizes=(1 << 20, 8 << 20))  # doctest: +SKIP
  """
  if len(sizes) < 2:
    raise ValueError(f"calibrate: need at least two sizes to fit a line, got {tuple(sizes)}")
  if isinstance(axes, str):
    axes = (axes,)
  target = _target(mesh, axes)
  key = cost_model.profile_key(target.axes, target.sizes, target.transport, jax.process_count(),
                               jax.default_backend())
  if reuse:
    cached = cost_model.find_profile(key)
    digest = cached.digest() if cached else -1
    everyone = set(target.gather(digest))   # every process takes part, cached or not
    if cached is not None and everyone == {digest}:
      return cached
  fits = []
  for algorithm, comp in _candidates(target.groups, codecs):
    codec_names = planner.codec_key(
        [planner.codec_for(comp, g.name, jnp.float32) for g in target.groups])
    fn = target.program(algorithm, comp)
    seconds = [_time(fn, target.input(max(1, nbytes // 4)), reps, warmup) for nbytes in sizes]
    seconds = [float(t) for t in target.broadcast(np.asarray(seconds, np.float64))]
    fits.append(cost_model.Fit.from_points(algorithm, codec_names, sizes, seconds))
    if log is not None:
      log(f"{algorithm:>12} {_label(comp):<10} " + "  ".join(
          f"{s >> 10:>7} KiB {t * 1e3:9.2f} ms" for s, t in zip(sizes, seconds)))
  profile = cost_model.Profile(key, tuple(fits),
                               datetime.datetime.now(datetime.timezone.utc).isoformat())
  if save:
    cost_model.save_profile(profile)
  return profile


def _label(comp) -> str:
  if comp is None:
    return "none"
  codec = next(iter(comp.values())) if isinstance(comp, dict) else comp
  return codec.name


def choices(profile: cost_model.Profile, sizes: Sequence[int]) -> dict[int, dict[str, str]]:
  """What ``auto`` picks from ``profile`` per size and measured codec (for reports).

  Example:
    >>> choices(profile, [1 << 20])  # doctest: +SKIP
    {1048576: {'none': 'xla', 'int8': 'hierarchical'}}
  """
  out: dict[int, dict[str, str]] = {}
  for nbytes in sizes:
    row: dict[str, str] = {}
    for codecs in sorted({f.codecs for f in profile.fits}):
      lossy = any(c != repr(_NONE) for c in codecs)
      label = codecs[-1] if lossy else "none"
      row[label] = planner.choose(nbytes, len(codecs), codecs, lossy, profile)
    out[nbytes] = row
  return out


_NONE = planner.codec_for(None, "", jnp.float32)   # what an uncompressed f32 level carries
