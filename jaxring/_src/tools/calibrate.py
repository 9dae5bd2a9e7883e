"""``jaxring calibrate``: measure the plans ``auto`` chooses from, on this machine, and keep them.

Run it the way the training job runs, once per machine and mesh shape (the profile is cached per
axes, sizes, transport, process count, platform and jaxring version):

  jaxring calibrate --devices 8 --mesh 2x4 --axes node,local       # one host, 8 CPU devices
  jaxring cluster run --procs-per-node 1 --devices-per-proc 2 -- jaxring calibrate   # a cluster

In a job started by ``jaxring cluster run`` (or any launcher ``jaxring.distributed.initialize``
understands) it starts the multi-process runtime and calibrates the (node, local) process mesh,
or with ``--axes NAME`` (one name) a flat mesh of every device, process by process, as
``Mesh(devices, ("data",))`` programs reduce over it.
It prints each plan's timings and what ``auto`` picks at a few sizes, and writes the profile
(human-readable JSON) where ``auto`` reads it; ``--out`` writes a copy.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parser() -> argparse.ArgumentParser:
  from jaxring._src.codecs.base import grammar, sweep
  ap = argparse.ArgumentParser(prog="jaxring calibrate", description=__doc__.splitlines()[0])
  ap.add_argument("--devices", type=int, default=None, help="emulated CPU devices (one process)")
  ap.add_argument("--mesh", default=None, help="e.g. 2x4 (one process; default: all devices flat)")
  ap.add_argument("--axes", default=None, help="axis names, comma-separated (default node,local "
                  "for two mesh dimensions, i for one; in a multi-process job one name "
                  "calibrates a flat mesh of every device)")
  ap.add_argument("--sizes", default=None, help="bytes per device, comma-separated (default "
                  "1KiB,64KiB,1MiB,32MiB)")
  ap.add_argument("--codecs", default=",".join(sweep()),
                  help=f"codecs to time on the slowest level, comma-separated (default "
                  f"%(default)s); spellings: {grammar()}")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--fresh", action="store_true", help="measure even if a profile is cached")
  ap.add_argument("--out", default=None, help="also write the profile to this file")
  return ap


def _mesh(args):
  import jax
  if os.environ.get("JAXRING_COORDINATOR") or os.environ.get("JAXRING_NUM_PROCESSES"):
    import jaxring.distributed
    jaxring.distributed.initialize()
    if args.axes and "," not in args.axes:
      import numpy as np
      devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
      return jax.sharding.Mesh(np.asarray(devices), (args.axes,)), (args.axes,)
    return jaxring.distributed.process_mesh(), ("node", "local")
  if args.devices:
    jax.config.update("jax_num_cpu_devices", args.devices)
  shape = tuple(int(s) for s in args.mesh.split("x")) if args.mesh else (len(jax.devices()),)
  names = tuple(args.axes.split(",")) if args.axes else (("node", "local")[:len(shape)]
                                                        if len(shape) == 2 else ("i",))
  return jax.make_mesh(shape, names), names


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  import jax

  from jaxring._src import calibrate as calib
  from jaxring._src import profiles
  from jaxring._src.tools.bench import common
  mesh, axes = _mesh(args)
  sizes = ([common.parse_size(s) for s in args.sizes.split(",")] if args.sizes
           else list(calib.DEFAULT_SIZES))
  me = jax.process_index()
  log = print if me == 0 else None
  if log:
    print(f"# jaxring calibrate: axes {axes} of mesh {dict(mesh.shape)}, {jax.process_count()} "
          f"process(es), {jax.default_backend()}; median of {args.reps} per point")
  t0 = time.perf_counter()
  profile = calib.calibrate(mesh, axes, sizes=sizes, codecs=args.codecs.split(","),
                            reps=args.reps, reuse=not args.fresh, log=log)
  took = time.perf_counter() - t0
  if me == 0:
    print(f"# {took:.1f} s; profile: {profiles.profile_path(profile.key)}")
    print("# auto picks (bytes per device -> codecs of the levels: algorithm):")
    for nbytes, row in calib.choices(profile, sizes).items():
      print(f"  {common.fmt_bytes(nbytes):>7}: " + "; ".join(f"{k}: {v}" for k, v in row.items()))
    if args.out:
      with open(args.out, "w") as f:
        f.write(profile.to_json())
    sys.stdout.write(json.dumps({"calibrate_s": took}) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
