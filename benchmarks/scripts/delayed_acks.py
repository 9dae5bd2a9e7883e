"""What delayed TCP ACKs cost the emulated cluster's small all-reduces, side by side in one job.

JAX shape (one process per node). Each round, every process sets its own node's route to the
cluster's subnet with ``quickack 1`` (ACK every segment at once, what ``jaxring cluster up`` sets)
or without it (Linux's delayed ACKs), the two in alternating order, then after a barrier calls
gloo's ``lax.psum`` and jaxring's hierarchical all-reduce of ``NB`` bytes per device (default
1 MiB), and a program of ``CHAIN`` gloo all-reduces one after another (timed per all-reduce),
``CALLS`` calls each with a barrier before every call (``BARRIERS=0``: before the first only),
counting the node's delayed ACKs (``TcpExt:DelayedACKs``: ACKs the delayed-ACK timer sent)
around each call. The route is put back
as it was at the end. Process 0 prints, per setting and program, the median and quartiles, the
share of calls taking at least twice the fastest call of that program, and the delayed ACKs per
call in those slow calls and in the others; it writes
``benchmarks/results/delayed-acks-<time>.json``.

  sudo jaxring cluster up --name jrq --nodes 4
  sudo jaxring cluster run --name jrq --nodes 4 --procs-per-node 1 --transport jax \\
      --devices-per-proc 2 -- python benchmarks/scripts/delayed_acks.py
  sudo jaxring cluster down --name jrq
"""
import os
import subprocess
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

import jaxring
from emulated_jax import jax_shape
from jaxring._src.tools.bench import common

NB = int(os.environ.get("NB", str(1 << 20)))
ROUNDS = int(os.environ.get("ROUNDS", "6"))
CALLS = int(os.environ.get("CALLS", "20"))
#: 0: one barrier before each setting's calls of a program, then the calls back to back (as a
#: training step issues its reductions), each still timed by itself
BARRIERS = int(os.environ.get("BARRIERS", "1"))
#: all-reduces chained in one program (each reduces the last one's result, as a step's
#: reductions follow one another): its row is the program's time divided by CHAIN
CHAIN = int(os.environ.get("CHAIN", "20"))
IFACE = os.environ.get("JAXRING_INTERFACE", "jreth0")
mesh, axes, x, program = jax_shape(NB)
me = jax.process_index()


def route() -> str:
  """This node's route to the cluster's subnet, as ``ip route`` prints it."""
  out = subprocess.run(["ip", "route", "show", "dev", IFACE, "proto", "kernel"],
                       capture_output=True, text=True, check=True).stdout.split("\n")[0]
  return out.strip()


def set_route(spec: str, quickack: bool) -> None:
  words = spec.replace("quickack 1", "").split()   # ip leaves out the dev and proto it was asked
  subprocess.run(["ip", "route", "replace", *words, "dev", IFACE, "proto", "kernel",
                  *(["quickack", "1"] if quickack else [])], check=True, capture_output=True)


def delayed_acks() -> int:
  with open("/proc/net/netstat") as f:
    lines = f.read().splitlines()
  for names, values in zip(lines[::2], lines[1::2]):
    if names.startswith("TcpExt:"):
      return int(dict(zip(names.split()[1:], values.split()[1:]))["DelayedACKs"])
  raise RuntimeError("no TcpExt:DelayedACKs in /proc/net/netstat")


def chained(v):
  for _ in range(CHAIN):
    v = jax.lax.psum(v, axes) * 0.125
  return v


# name -> (program, all-reduces it makes)
progs = {"gloo lax.psum": (program(lambda v: jax.lax.psum(v, axes)), 1),
         "jaxring hierarchical": (program(
             lambda v: jaxring.psum(v, axes, algorithm="hierarchical")), 1),
         f"gloo lax.psum, {CHAIN} in one program (per call)": (program(chained), CHAIN)}
for f, _ in progs.values():
  for _ in range(3):
    jax.block_until_ready(f(x))
original = route()
settings = ("ACKs at once", "delayed ACKs")
times = {(s, k): [] for s in settings for k in progs}
acks = {(s, k): [] for s in settings for k in progs}
try:
  for r in range(ROUNDS):
    for s in (settings if r % 2 else settings[::-1]):
      set_route(original, quickack=s == settings[0])
      for k in (list(progs) if r % 2 else list(progs)[::-1]):
        for c in range(CALLS):
          if BARRIERS or c == 0:
            jaxring.distributed.barrier(f"{r}-{s}-{k}-{c}", timeout_s=300)
          a0, t0 = delayed_acks(), time.perf_counter()
          f, reductions = progs[k]
          jax.block_until_ready(f(x))
          times[s, k].append((time.perf_counter() - t0) / reductions)
          acks[s, k].append(delayed_acks() - a0)
finally:
  set_route(original, quickack="quickack 1" in original)
  jaxring.distributed.barrier("restored", timeout_s=300)

rows = []
for (s, k), t in times.items():
  t = np.asarray(t) * 1e3
  slow = t >= 2 * t.min()
  a = np.asarray(acks[s, k])
  q1, med, q3 = np.percentile(t, [25, 50, 75])
  rows.append(dict(setting=s, program=k, calls=len(t), median_ms=med, q1_ms=q1, q3_ms=q3,
                   slow_share=float(slow.mean()),
                   delayed_acks_slow=float(a[slow].mean()) if slow.any() else None,
                   delayed_acks_other=float(a[~slow].mean())))
everyone = multihost_utils.process_allgather(
    np.asarray([[r["median_ms"], r["slow_share"]] for r in rows]))
if me == 0:
  print(f"{jax.process_count()} processes x {mesh.shape['local']} devices, {NB} bytes per device, "
        f"{ROUNDS} rounds of {CALLS} calls per setting and program, "
        f"{'a barrier before each' if BARRIERS else 'back to back'}; process 0's calls")
  print(f"{'setting':<13} {'program':<40} {'median ms':>9} {'quartiles':>13} {'calls >= 2x':>11} "
        f"{'delayed ACKs/call slow, other':>30}")
  for r in rows:
    slow_acks = "-" if r["delayed_acks_slow"] is None else f"{r['delayed_acks_slow']:.2f}"
    print(f"{r['setting']:<13} {r['program']:<40} {r['median_ms']:>9.2f} "
          f"{r['q1_ms']:>6.2f}-{r['q3_ms']:<6.2f} {r['slow_share']:>11.0%} "
          f"{slow_acks:>14}, {r['delayed_acks_other']:.2f}")
  print("medians over the processes:", {f"{r['setting']} / {r['program']}": [
      round(float(v), 2) for v in everyone[:, i, 0]] for i, r in enumerate(rows)})
  path = common.write_json("delayed-acks", dict(
      bench="delayed_acks", nbytes=NB, chain=CHAIN, rounds=ROUNDS, calls=CALLS,
      barriers=bool(BARRIERS),
      processes=jax.process_count(), route=original, jax=jax.__version__,
      allocator=common.allocator(), rows=rows,
      medians_by_process=everyone.tolist()))
  print("wrote", path)
jaxring.distributed.barrier("end", timeout_s=300)
