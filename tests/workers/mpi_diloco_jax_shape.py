"""Worker for tests/test_mpi.py, run by ``mpirun -n 2`` in JAX's shape: each rank one process of
``jax.distributed`` with 2 CPU devices, the mesh ``(node, local)`` a row per process, and
``node`` also bound to MPI (COMM_WORLD) for ``jaxring.diloco(transfer="host")``.

``@train_step(axis_name=("node", "local"), grad_axes="local")`` fits each node's own least-squares
data (drawn from ``default_rng(node * 2 + local)``) with ``jaxring.diloco(adam, every=4,
fragments=2, delay=2)``. Uncompressed, the host form (each device moves its half of a fragment on
an exchange of its own) gives each node the same own parameters after every step as the sync in the
program (rtol 1e-6), and the same outer parameters outside a fragment's transfer window (the
program takes the outer step at the send, the host form at the arrival); with int8 and error
feedback (the staged all-to-all, then the gather) it stays within int8's rounding of the program's
ring. The host form's compiled step holds no lax all-reduce: the slow level's bytes left the
program, and the steps that move nothing run it without the transfers' callbacks. Prints
``rank R: OK``.
"""
from __future__ import annotations

import sys
import time

import numpy as np

STEPS, EVERY, FRAGMENTS, DELAY = 13, 4, 2, 2


def main() -> int:
  from mpi4py import MPI

  import jaxring.distributed as jd
  jd.initialize()
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import AxisType, Mesh

  import jaxring
  import jaxring.train as jt
  comm = MPI.COMM_WORLD
  rank = comm.Get_rank()
  jd.bind_mpi_axis("node", comm)
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = Mesh(np.asarray(devices).reshape(jax.process_count(), -1), ("node", "local"),
              axis_types=(AxisType.Auto,) * 2)
  rng = np.random.default_rng(0)
  data = {"a": rng.standard_normal((4, 16, 8)).astype(np.float32),
          "b": rng.standard_normal((4, 16, 3)).astype(np.float32)}
  params0 = {"w": jnp.zeros((8, 3), jnp.float32), "b": jnp.zeros((3,), jnp.float32),
             "v": jnp.ones((5,), jnp.float32)}

  def run(transfer, codec=None):
    tx = jaxring.diloco(optax.adam(0.05), axis="node", every=EVERY, fragments=FRAGMENTS,
                        delay=DELAY, compression=codec, transfer=transfer)

    @jt.train_step(mesh, axis_name=("node", "local"), grad_axes="local")
    def step(state, batch):
      def loss(p):
        a, b = batch["a"][0], batch["b"][0]
        return jnp.mean((a @ p["w"] + p["b"] - b) ** 2) + 0.1 * jnp.sum((p["v"] - 2.0) ** 2)
      value, grads = jt.value_and_grad(loss)(state.params)
      return state.apply_gradients(grads=grads), {"loss": value}

    state = step.prepare(jt.TrainState.create(apply_fn=None, params=params0, tx=tx))
    mine = {k: v[2 * rank:2 * rank + 2] for k, v in data.items()}   # this process's devices'
    batch = {k: jax.make_array_from_process_local_data(
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("node", "local"))), v)
        for k, v in mine.items()}
    seen = []   # (this process's own parameters, the outer parameters) after each step
    for _ in range(STEPS):
      state, _ = step(state, batch)
      seen.append([[np.asarray(x.addressable_shards[0].data) for x in jax.tree.leaves(tree)]
                   for tree in (state.opt_state.local, state.params)])
    return seen, step.lower(state, batch).compile().as_text(), step._host

  def fail(message):   # (stderr too: an abort may cut the launcher's relay of stdout)
    print(message, flush=True)
    print(message, file=sys.stderr, flush=True)
    time.sleep(1)
    comm.Abort(3)

  from jaxring._src.optim.diloco_parts import fragment_of
  frags = fragment_of(params0, FRAGMENTS)   # per leaf, in tree order

  def in_window(t, f):   # fragment f sent at s and not yet back: the outer step is still due
    s = t - (t - f * EVERY // FRAGMENTS) % EVERY
    return s - f * EVERY // FRAGMENTS > 0 and t < s + DELAY

  for codec, rtol in ((None, 1e-6), (jaxring.codecs.int8(), 0.03)):
    want, _, _ = run("program", codec)
    got, hlo, schedule = run("host", codec)
    # steps that start and finish no transfer run the program without the callbacks (jax's C++
    # dispatch): uncompressed, steps 2, 3, 5, 7, 9, 11, 13 (sends at 4 + 4k, 2 + 4k, arrivals 2
    # later; the first step compiles the whole program); int8 also moves at the midway step (1
    # after a send): 2 and 3 only; the count read once
    if (schedule.quiet_steps, schedule.count_reads) != ((7 if codec is None else 2), 1):
      fail(f"rank {rank}: FAIL {codec}: {schedule.quiet_steps} steps ran the quiet program, "
           f"the count was read {schedule.count_reads} times")
    for t, ((g, go), (w, wo)) in enumerate(zip(got, want)):
      # the program form takes the outer step at the send, the host form at the arrival
      pairs = list(zip(g, w)) + [(x, y) for x, y, f in zip(go, wo, frags)
                                 if not in_window(t + 1, f)]
      for x, y in pairs:
        if not np.allclose(x, y, rtol=rtol, atol=rtol):
          fail(f"rank {rank}: FAIL {codec}: step {t + 1} differs from the program form by "
               f"{float(np.max(np.abs(x - y))):.3g}")
    if any(" all-reduce(" in line or " all-reduce-start(" in line for line in hlo.splitlines()):
      fail(f"rank {rank}: FAIL {codec}: the host form's step still all-reduces in the program")
    if np.allclose(got[-1][0][0], 0.0):
      fail(f"rank {rank}: FAIL {codec}: the parameters never moved")
  print(f"rank {rank}: OK", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
