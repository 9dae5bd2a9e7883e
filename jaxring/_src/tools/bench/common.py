"""What every benchmark shares: emulated devices, allocator, timing, tables and JSON results."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from jaxring._src.tools.allocator import allocator_in_use as allocator  # noqa: F401 (re-export)
from jaxring._src.tools.allocator import maybe_reexec_with_fast_allocator  # noqa: F401 (re-export)

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "benchmarks",
                           "results")


def set_cpu_devices(n: int) -> None:
  """Asks XLA for ``n`` CPU devices; must run before jax initializes its backends."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
  import jax
  jax.config.update("jax_num_cpu_devices", n)


def median_time(fn: Callable[[], object], reps: int, warmup: int = 2) -> tuple[float, list[float]]:
  for _ in range(warmup):
    _block(fn())
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    _block(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times), times


def _block(out):
  import jax
  jax.block_until_ready(out)


def parse_size(s: str) -> int:
  """``"64KiB"``, ``"1M"``, ``"4096"`` -> bytes.

  Example:
    >>> parse_size("1MiB"), parse_size("64k"), parse_size("512")
    (1048576, 65536, 512)
  """
  s = s.strip().upper()
  mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
  for suffix in ("KIB", "MIB", "GIB", "KB", "MB", "GB", "K", "M", "G"):
    if s.endswith(suffix):
      return int(float(s[: -len(suffix)]) * mult[suffix[0]])
  return int(s)


def fmt_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f}{unit}" if unit == "B" or n == int(n) else f"{n:.1f}{unit}"
    n /= 1024
  return str(n)


def median_ratio_interval(a: Sequence[float], b: Sequence[float], level: float = 0.9,
                          resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
  """A bootstrap interval (``level``, percentile method) of ``median(a) / median(b)``: the calls
  of each row resampled with replacement. On the shared cores two rows of one compiled program
  differ by 5-15% in a run; this says whether a ratio is distinguishable from 1 on the calls
  behind it.

  Example:
    >>> lo, hi = median_ratio_interval([10, 11, 12, 10, 11], [10, 10, 12, 11, 11])
    >>> lo <= 1.0 <= hi
    True
    >>> median_ratio_interval([20, 21, 22, 20, 21], [10, 10, 12, 11, 11])[0] > 1.5
    True
  """
  import numpy as np
  rng = np.random.default_rng(seed)
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  ma = np.median(a[rng.integers(0, a.size, (resamples, a.size))], axis=1)
  mb = np.median(b[rng.integers(0, b.size, (resamples, b.size))], axis=1)
  tail = (1 - level) / 2
  lo, hi = np.quantile(ma / mb, [tail, 1 - tail])
  return float(lo), float(hi)


def print_table(rows: list[dict], columns: Sequence[tuple[str, str, str]]) -> None:
  """Prints ``rows`` as an aligned table; columns are (key, header, format spec)."""
  cells = [[h for _, h, _ in columns]]
  for r in rows:
    cells.append([("" if r.get(k) is None else format(r[k], f)) for k, _, f in columns])
  widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
  for i, c in enumerate(cells):
    print("  ".join(v.rjust(w) for v, w in zip(c, widths)))
    if i == 0:
      print("  ".join("-" * w for w in widths))


def lacks_root(command: str) -> bool:
  """Whether this process is not root; then says that ``jaxring bench <command>`` (the emulated
  cluster's network namespaces and tc) is skipped."""
  if os.geteuid() == 0:
    return False
  print(f"jaxring bench {command}: skipped: needs root (network namespaces and tc)",
        file=sys.stderr)
  return True


def job_args(ap: argparse.ArgumentParser, timeout: float, help: str = "seconds the job may take"):
  """The tail every cluster bench's options share: the job's time limit, the JSON's folder and
  the switch its ranks run with (:func:`worker_argv`)."""
  ap.add_argument("--timeout", type=float, default=timeout, help=help)
  ap.add_argument("--out-dir", default=None, help="folder for the JSON (default "
                  "benchmarks/results)")
  ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def worker_argv(args: argparse.Namespace, driver_only: Sequence[str] = ()) -> list[str]:
  """The command line of a cluster bench's ranks: ``--worker`` and every option of ``args``
  but the driver's own (:func:`job_args`' and ``driver_only``); a flag set as itself, one unset
  or None left out (the ranks parse the same options, so their defaults agree)."""
  skip, argv = {"timeout", "out_dir", "worker", *driver_only}, ["--worker"]
  for key, value in vars(args).items():
    if key in skip or value is None or value is False:
      continue
    flag = "--" + key.replace("_", "-")
    argv += [flag] if value is True else [flag, str(value)]
  return argv


def machine() -> dict:
  import jax
  return {"host": platform.node(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
          "jax": jax.__version__, "devices": [str(d) for d in jax.devices()][:4],
          "device_count": jax.device_count(), "allocator": allocator()}


def git_commit() -> str | None:
  """The checkout's HEAD (short), or None outside a git checkout."""
  out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                       cwd=os.path.dirname(__file__)).stdout.strip()
  return out or None


def write_json(name: str, payload: dict, out_dir: str | None = None) -> str:
  """Writes ``payload`` to ``<out_dir>/<name>.json`` (default ``benchmarks/results``), replacing the
  previous run of the same benchmark: the folder holds each command's current run, and git keeps
  the earlier ones. A PNG beside it is ``<name>.png``. Returns the path."""
  out_dir = os.path.abspath(out_dir or RESULTS_DIR)
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"{name}.json")
  with open(path, "w") as f:
    json.dump(payload, f, indent=1, default=str)
  return path


def warm_up(step, state, batch, steps: int, name: str | None = None):
  """Runs ``steps`` steps (the first compiles); prints how long they took when ``name`` is given."""
  import jax
  t0 = time.perf_counter()
  metrics = None
  for _ in range(steps):
    state, metrics = step(state, batch)
  jax.block_until_ready((state, metrics))
  if name is not None:
    print(f"  {name}: compiled + {steps} warm-up steps in {time.perf_counter() - t0:.1f} s",
          flush=True)
  return state


class ComputeShare:
  """Seconds of one training step's computation on a node of the emulated cluster: this
  process's devices each run ``alone(state, batch)`` (the step's gradients and update, with no
  collective at all: not even inside the process, where gloo's loopback would count), timed on
  every node at once, as the contenders run. Sampled when made and again by :meth:`sample`
  (one sample moved between 20 and 37 ms from run to run of ``bench tta``); :attr:`seconds` is
  the median of the samples.

  Given the job's ``mesh`` (one axis over every device), it also times the same computation
  followed by a scalar ``psum`` over all devices, and that ``psum`` alone: the difference,
  :attr:`skew`, is what the first collective after a step's computation waits for the slowest
  device (8 devices on 2 shared cores finish their computation at different times).

  ``state`` is replicated over this process's devices, ``local_batch`` a dict of NumPy arrays
  split over them along the first axis.
  """

  def __init__(self, alone, state, local_batch, steps: int, mesh=None):
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    def spmd(fn, on):
      return jax.jit(jax.shard_map(fn, mesh=on, in_specs=(P(), P("data")), out_specs=(P(), P()),
                                   check_vma=False), donate_argnums=(0,))

    local = Mesh(np.asarray(jax.local_devices()), ("data",), axis_types=(AxisType.Auto,))
    self._step = spmd(alone, local)
    self._state = jax.device_put(jax.tree.map(np.copy, state), NamedSharding(local, P()))
    self._batch = jax.device_put(local_batch, NamedSharding(local, P("data")))
    self._state = warm_up(self._step, self._state, self._batch, 2)
    self._synced = None
    if mesh is not None:
      (axis,) = mesh.axis_names

      def synced(state, batch):   # a scalar that depends on every updated leaf, then summed
        state, metrics = alone(state, batch)
        last = sum(leaf.ravel()[0].astype("float32") for leaf in jax.tree.leaves(state.params))
        return state, {**metrics, "sync": lax.psum(last, axis)}

      self._synced = jax.jit(jax.shard_map(synced, mesh=mesh, in_specs=(P(), P(axis)),
                                           out_specs=(P(), P()), check_vma=False),
                             donate_argnums=(0,))
      self._sync = jax.jit(jax.shard_map(lambda v: lax.psum(v, axis), mesh=mesh,
                                         in_specs=P(axis), out_specs=P(), check_vma=False))
      glob = lambda x, spec: jax.make_array_from_process_local_data(   # noqa: E731
          NamedSharding(mesh, spec), np.asarray(x))
      self._gstate = jax.tree.map(lambda x: glob(x, P()), state)
      self._gbatch = {k: glob(v, P(axis)) for k, v in local_batch.items()}
      self._one = glob(np.ones(len(jax.local_devices()), np.float32), P(axis))
      self._gstate = warm_up(self._synced, self._gstate, self._gbatch, 2)
      jax.block_until_ready(self._sync(self._one))
    self.samples: list[float] = []
    self.synced: list[float] = []
    self.sync: list[float] = []
    self.sample(steps)

  def sample(self, steps: int, settle: int = 0) -> float:
    """Times ``steps`` computation-only steps (and, with a mesh, as many followed by the
    ``psum`` and the ``psum`` alone), each kind after ``settle`` untimed ones (as
    :func:`time_interleaved` times the contenders); returns the computation's mean seconds."""
    import jax

    def mean_seconds(call) -> float:
      for _ in range(settle):
        jax.block_until_ready(call())
      t0 = time.perf_counter()
      for _ in range(steps):
        jax.block_until_ready(call())
      return (time.perf_counter() - t0) / steps

    def alone():
      self._state, m = self._step(self._state, self._batch)
      return m

    self.samples.append(mean_seconds(alone))
    if self._synced is not None:
      def synced():
        self._gstate, m = self._synced(self._gstate, self._gbatch)
        return m
      self.synced.append(mean_seconds(synced))
      self.sync.append(mean_seconds(lambda: self._sync(self._one)))
    return self.samples[-1]

  @property
  def seconds(self) -> float:
    return float(statistics.median(self.samples))

  @property
  def skew(self) -> float | None:
    """Median seconds the step's computation followed by a ``psum`` took beyond the
    computation and the ``psum`` alone (None without a mesh)."""
    if not self.synced:
      return None
    return max(0.0, statistics.median(self.synced) - self.seconds - statistics.median(self.sync))


def skew_of(recs: list[dict]) -> float:
  """The median over nodes of each node's :attr:`ComputeShare.skew` in a cluster job's records
  (0 where none was measured)."""
  skews = list({r["node"]: r["skew_s"] for r in recs if r.get("skew_s") is not None}.values())
  return float(statistics.median(skews)) if skews else 0.0


def warm_up_contenders(contenders: dict, make_state: Callable[[], object], batch, steps: int,
                       replicated) -> dict:
  """Each train-step contender's state, made by ``make_state()`` and warmed up by ``steps`` steps.

  A jaxring ``train_step`` (it has ``prepare``) prepares its own; any other step gets a copy put on
  ``replicated``: its donation must not delete arrays another contender starts from.
  """
  import jax
  import jax.numpy as jnp
  states = {}
  for name, step in contenders.items():
    if hasattr(step, "prepare"):
      state = step.prepare(make_state())
    else:
      state = jax.device_put(jax.tree.map(jnp.copy, make_state()), replicated)
    states[name] = warm_up(step, state, batch, steps, name)
  return states


def time_interleaved(contenders: dict, states: dict, batch, *, reps: int, steps: int,
                     settle: int = 0, around=None, between=None) -> dict[str, list[float]]:
  """Seconds per step of each train-step contender, ``reps`` repetitions of ``steps`` steps.

  Contenders run one after the other within each repetition, so the machine's drifting load hits
  all alike; ``states`` is updated in place. ``settle`` untimed steps precede each contender's
  timed ones in every repetition: the first step after another contender's can pay for the
  switch, which training, one step after another, does not (on the emulated cluster the int8
  step right after the uncompressed one took 11-24% longer than the same step after its own
  kind; cause not measured; docs/design.md, "Investigations"). ``around(name)``, if
  given, is a context manager entered around each contender's timed steps (a barrier, a byte
  counter); ``between()``, if given, runs after each repetition.
  """
  import contextlib

  import jax
  times: dict[str, list[float]] = {name: [] for name in contenders}
  for _ in range(reps):
    for name, step in contenders.items():
      state = states[name]
      for _ in range(settle):
        state, metrics = step(state, batch)
      jax.block_until_ready(state)
      with (around(name) if around else contextlib.nullcontext()):
        t0 = time.perf_counter()
        for _ in range(steps):
          state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times[name].append((time.perf_counter() - t0) / steps)
      states[name] = state
    if between is not None:
      between()
  return times
