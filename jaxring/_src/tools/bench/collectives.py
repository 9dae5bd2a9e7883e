"""nccl-tests-style table of all-reduce algorithms: ``jaxring bench collectives``.

For each size (bytes per member) every algorithm runs beside ``lax.psum`` in the same process,
interleaved repetition by repetition, so that the machine's noise hits all contenders alike.
algbw = size / time; busbw = algbw * 2(p-1)/p (the all-reduce's bus bandwidth, as nccl-tests).
"""
from __future__ import annotations

import argparse
import math

from jaxring._src.tools.bench import common, plots

DEFAULT_ALGOS = ("lax.psum", "xla", "ring", "hierarchical", "auto")


def _codec(spec: str):
  from jaxring import codecs
  try:
    return codecs.parse(spec)
  except ValueError as e:
    raise SystemExit(f"jaxring bench collectives: {e}") from e


def _programs(mesh, axes, algos, compressions):
  import jax
  from jax import lax
  from jax.sharding import PartitionSpec as P

  import jaxring
  spec = P(axes)
  progs = {}
  for algo in algos:
    for comp in compressions:
      if algo in ("lax.psum", "xla") and comp != "none":
        continue
      codec = _codec(comp)
      if algo == "lax.psum":
        body = lambda v: lax.psum(v, axes)
      else:
        body = (lambda a, c: lambda v: jaxring.psum(v, axes, algorithm=a, compression=c))(
            algo, codec)
      name = algo if comp == "none" else f"{algo}+{comp}"
      progs[name] = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=P()))
  return progs


def run(sizes, algos, compressions, reps, mesh_shape, out_dir=None, topology=None) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxring
  names = ("node", "local") if len(mesh_shape) == 2 else ("data",)
  mesh = jax.make_mesh(mesh_shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))
  axes = ("local", "node") if len(names) == 2 else "data"
  p = math.prod(mesh_shape)
  ctx = jaxring.use_topology(topology) if topology is not None else _nullcontext()
  rows = []
  with ctx:
    progs = _programs(mesh, axes, algos, compressions)
    for size in sizes:
      count = max(size // 4, 1)
      x = jax.device_put(jnp.asarray(np.random.RandomState(0).randn(p * count), jnp.float32),
                         NamedSharding(mesh, P(names)))
      times = {k: [] for k in progs}
      for f in progs.values():  # compile + warm up
        jax.block_until_ready(f(x))
        jax.block_until_ready(f(x))
      for _ in range(reps):
        for k, f in progs.items():
          t, _ = common.median_time(lambda: f(x), reps=1, warmup=0)
          times[k].append(t)
      base = float(np.median(times["lax.psum"])) if "lax.psum" in times else None
      for k, ts in times.items():
        t = float(np.median(ts))
        algbw = count * 4 / t / 1e9
        rows.append({"size": count * 4, "count": count, "dtype": "float32", "algorithm": k,
                     "time_us": t * 1e6, "algbw_GBs": algbw, "busbw_GBs": algbw * 2 * (p - 1) / p,
                     "vs_lax": (t / base) if base else None, "times_us": [v * 1e6 for v in ts]})
      _print_size(rows[-len(times):])
  return {"benchmark": "collectives", "devices": p, "mesh": list(mesh_shape), "reps": reps,
          "machine": common.machine(), "rows": rows}


class _nullcontext:
  def __enter__(self):
    return None

  def __exit__(self, *a):
    return False


_header_done = [False]
COLUMNS = [("size_h", "size", ""), ("count", "count", "d"), ("dtype", "type", ""),
           ("algorithm", "algorithm", ""), ("time_us", "time(us)", ".1f"),
           ("algbw_GBs", "algbw(GB/s)", ".3f"), ("busbw_GBs", "busbw(GB/s)", ".3f"),
           ("vs_lax", "x lax.psum", ".3f")]


def _print_size(rows):
  widths = [8, 10, 7, 26, 11, 11, 11, 10]
  if not _header_done[0]:
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(COLUMNS, widths)))
    print("  ".join("-" * w for w in widths))
    _header_done[0] = True
  for r in rows:
    r = dict(r, size_h=common.fmt_bytes(r["size"]))
    print("  ".join(("" if r.get(k) is None else format(r[k], f)).rjust(w)
                    for (k, _, f), w in zip(COLUMNS, widths)), flush=True)


def main(argv=None) -> int:
  from jaxring._src.codecs.base import grammar
  ap = argparse.ArgumentParser(prog="jaxring bench collectives", description=__doc__)
  ap.add_argument("--devices", type=int, default=8, help="emulated CPU devices (default 8)")
  ap.add_argument("--mesh", default=None, help="e.g. 2x4 for a (node, local) mesh; default flat")
  ap.add_argument("--min-size", default="4K")
  ap.add_argument("--max-size", default="128M")
  ap.add_argument("--factor", type=int, default=4, help="size step factor (default 4)")
  ap.add_argument("--sizes", default=None, help="comma-separated sizes, overrides min/max")
  ap.add_argument("--algorithms", default=",".join(DEFAULT_ALGOS))
  ap.add_argument("--compression", default="none",
                  help=f"comma-separated codecs (jaxring.codecs.parse; ring/hierarchical/auto "
                  f"only): {grammar()}")
  ap.add_argument("--reps", type=int, default=7, help="timed repetitions (median reported)")
  ap.add_argument("--out-dir", default=None, help="where the JSON goes (benchmarks/results)")
  args = ap.parse_args(argv)
  common.set_cpu_devices(args.devices)
  if args.sizes:
    sizes = [common.parse_size(s) for s in args.sizes.split(",")]
  else:
    sizes, s = [], common.parse_size(args.min_size)
    while s <= common.parse_size(args.max_size):
      sizes.append(s)
      s *= args.factor
  mesh_shape = tuple(int(v) for v in args.mesh.split("x")) if args.mesh else (args.devices,)
  algos = [a.strip() for a in args.algorithms.split(",") if a.strip()]
  comps = [c.strip() for c in args.compression.split(",") if c.strip()]
  if "none" not in comps:
    comps = ["none"] + comps
  print(f"# jaxring bench collectives: all-reduce of float32, {args.devices} emulated CPU devices, "
        f"mesh {mesh_shape}, median of {args.reps} after warm-up, allocator: {common.allocator()}")
  result = run(sizes, algos, comps, args.reps, mesh_shape)
  path = common.write_json("collectives", result, args.out_dir)
  print(f"# wrote {path}")
  png = plots.collectives(result, path[:-5] + ".png")
  print(f"# wrote {png}" if png else f"# {plots.NO_MATPLOTLIB}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
