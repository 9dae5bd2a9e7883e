"""Worker for tests/test_mpi.py, run by ``mpirun -n 4``: ``jaxring.diloco`` over MPI with
the outer sync in the step's program and moved by a host thread (``transfer="host"``).

Ranks ``2 * node + local``: ``local`` is bound to the two ranks of a node, ``node`` to the ranks
with the same local rank. Each rank fits its own least-squares problem (its data drawn from
``default_rng((node, local))``), its gradients averaged over ``local`` by ``jaxring.pmean``, then
``jaxring.diloco(optax.adam, every=4, fragments=2, delay=2)`` steps it. ``--check equal``:
uncompressed, the host form's parameters after every step equal the program form's (rtol 1e-6; the
outer step waits for the transfer, the local parameters do not), whether each rank sends the whole
fragment or its half (``fast_axes="local"``); with int8 and error feedback the host form (each
member's codes gathered) stays within int8's rounding of the program form (a ring that requantizes
per hop) and carries a non-zero residual; with ``shard="optimizer"`` too, a rank keeping only its
half of the outer state; and the program form with ``fast_axes`` (each rank its half of the sync)
equals it; with ``residual_decay=0.5`` each send's residual is the decayed rule's, exactly
(``decayed_residual``); ``outer_memory="host"`` is refused over MPI-bound axes (jax cannot lower
its moves beside MPI's ordered effects). ``--check resume``: a checkpoint taken with a transfer
in flight resumes exactly. ``--check stall``: the ranks of node 1 never sync (``every`` beyond the
run); the others must give up within ``JAXRING_FAILURE_TIMEOUT`` with the message naming the slow
axis. Prints ``rank R: OK``.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

STEPS, EVERY, FRAGMENTS, DELAY = 15, 4, 2, 2


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--check", choices=("equal", "stall", "resume"), required=True)
  ap.add_argument("--dir", help="--check resume: where each rank writes its checkpoints")
  args = ap.parse_args()
  from mpi4py import MPI

  import jax
  import jax.numpy as jnp
  import optax

  import jaxring
  import jaxring.distributed as jd
  comm = MPI.COMM_WORLD
  rank = comm.Get_rank()
  node, local = divmod(rank, 2)
  jd.bind_mpi_axis("local", comm.Split(node, rank))
  node_comm = comm.Split(local, rank)   # the ranks of one local rank: the slow axis
  jd.bind_mpi_axis("node", node_comm)
  rng = np.random.default_rng((node, local))
  a = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((32, 3)), jnp.float32)
  params0 = {"w": jnp.zeros((8, 3), jnp.float32), "b": jnp.zeros((3,), jnp.float32),
             "v": jnp.ones((5,), jnp.float32)}

  def loss(p):
    return jnp.mean((a @ p["w"] + p["b"] - b) ** 2) + 0.1 * jnp.sum((p["v"] - 2.0) ** 2)

  def stepper(tx):
    @jax.jit
    def step(params, state):
      g = jaxring.pmean(jax.grad(loss)(params), "local")
      updates, state = tx.update(g, state, params)
      return optax.apply_updates(params, updates), state
    return step

  def run(tx):
    step = stepper(tx)
    params, state, seen = params0, tx.init(params0), []
    for _ in range(STEPS):
      params, state = step(params, state)
      seen.append(jax.tree_util.tree_map(np.asarray, (params, state.outer_params)))
    return seen, state

  def fail(message):   # the others would wait in a collective for a rank that returned
    print(message, flush=True)
    comm.Abort(3)

  def make(transfer, codec=None, every=EVERY, fast=(), shard="none", delay=DELAY,
           memory="device", decay=None):
    return jaxring.diloco(optax.adam(0.05), axis="node", every=every, fragments=FRAGMENTS,
                          delay=delay, fast_axes=fast, shard=shard, residual_decay=decay,
                          compression=codec, transfer=transfer, outer_memory=memory)

  if args.check == "stall":
    try:
      run(make("host", every=EVERY if node == 0 else 1000))
    except Exception as exc:   # the io_callback's TimeoutError, as XLA re-raises it
      text = str(exc)
      if "host-side transfer" not in text or "'node'" not in text:
        fail(f"rank {rank}: FAIL the error does not name the transfer: {text[:400]}")
      print(f"rank {rank}: OK gave up: {text[text.find('jaxring: the host'):][:200]}")
      return 0
    if node == 0:
      fail(f"rank {rank}: FAIL no error although node 1 never synced")
    print(f"rank {rank}: OK (never synced, as told)")
    return 0

  if args.check == "resume":
    return resume(make, stepper, params0, rank, args.dir, fail)

  # outer_memory="host" beside MPI's ordered effects: refused by name, not jax's safe_zip error
  try:
    run(make("program", fast="local", memory="host"))
    fail(f"rank {rank}: FAIL outer_memory='host' over MPI-bound axes ran")
  except NotImplementedError as exc:
    if "bound to MPI" not in str(exc):
      fail(f"rank {rank}: FAIL the refusal does not say why: {exc}")

  from jaxring._src.optim.diloco_parts import fragment_of
  frag = dict(zip(sorted(params0), fragment_of(params0, FRAGMENTS)))

  def window(delay):
    def in_window(t, f):   # sent at s (every EVERY from its offset), arrived at s + delay
      s = t - (t - f * EVERY // FRAGMENTS) % EVERY
      return s - f * EVERY // FRAGMENTS > 0 and t < s + delay
    return in_window

  # uncompressed: every member sends the whole fragment, or its half (fast_axes="local": the
  # halves gathered over local at arrival); int8 + EF: its half; shard="optimizer": it keeps
  # and steps only its half of the outer state, the new halves gathered at arrival
  # (and in the program, a member's half averaged over node, the halves gathered over local)
  int8, wants = jaxring.codecs.int8(), {}
  # (int8 with delay 2: each rank's chunks all-to-all, averaged and gathered a step later; with
  # delay 1 its codes gathered)
  for how, codec, fast, shard, rtol, delay in (
      ("host", None, (), "none", 1e-6, DELAY), ("host", None, "local", "none", 1e-6, DELAY),
      ("host", int8, "local", "none", 0.03, DELAY), ("host", int8, "local", "none", 0.03, 1),
      ("host", None, "local", "optimizer", 1e-6, DELAY),
      ("host", int8, "local", "optimizer", 0.03, DELAY),
      ("program", None, "local", "none", 1e-6, DELAY),
      ("program", None, "local", "optimizer", 1e-6, DELAY)):
    if (codec, delay) not in wants:   # the program form each row is held to, run once
      wants[codec, delay] = run(make("program", codec, delay=delay))[0]
    want = wants[codec, delay]
    got, state = run(make(how, codec, fast=fast, shard=shard, delay=delay))
    if shard == "optimizer":
      n = [sum(np.size(params0[k]) for k in frag if frag[k] == f) for f in range(FRAGMENTS)]
      if [np.size(x) for x in state.outer_params] != [-(-m // 2) for m in n] and codec is None:
        fail(f"rank {rank}: FAIL the outer parameters are not this rank's half: "
             f"{[np.shape(x) for x in state.outer_params]} of {n}")
    in_window = window(delay)
    for t, (w, g) in enumerate(zip(want, got)):
      (wp, wo), (gp, go) = w, g
      for k in wp:
        scale = np.abs(wp[k]).max() + 1e-6
        err = np.abs(gp[k] - wp[k]).max() / scale
        if not err <= rtol:
          fail(f"rank {rank}: FAIL {how} {codec} {fast} {shard} step {t + 1} {k}: differs by {err}")
        # the outer parameters agree outside their fragment's transfer window
        if shard == "none" and not in_window(t + 1, frag[k]) and \
            not np.abs(go[k] - wo[k]).max() / scale <= rtol:
          fail(f"rank {rank}: FAIL {codec} step {t + 1} outer {k} differs")
    # (local rank 1's half of these small fragments is int8's block padding: no residual)
    if codec is not None and local == 0:
      res = max(float(np.abs(np.asarray(r)).max())
                for r in jax.tree_util.tree_leaves(state.residual))
      if not res > 0:
        fail(f"rank {rank}: FAIL int8's residual is zero: the codec did not apply")
    # every member of the slow axis holds the same outer parameters
    outer = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(got[-1][1])])
    if not np.array_equal((comm if shard == "none" else node_comm).allgather(outer)[0], outer):
      fail(f"rank {rank}: FAIL {codec}: the outer parameters differ between ranks")
  decayed_residual(make, stepper, params0, frag, int8, fail, rank)
  print(f"rank {rank}: OK")
  return 0


def decayed_residual(make, stepper, params0, frag, codec, fail, rank) -> None:
  """``residual_decay`` on the host path: at each send ``v = decay * residual + pseudo-gradient``
  is encoded and the residual becomes ``v - decode(encode(v))`` (checked against the state held
  before and after each send, whole fragments, ``delay=1``; the undecayed rule must not fit)."""
  import jax.numpy as jnp
  decay, f32 = 0.5, jnp.float32
  tx = make("host", codec, delay=1, decay=decay)
  step = stepper(tx)
  params, state, checked = params0, tx.init(params0), 0

  def flat(tree, keys):
    return jnp.concatenate([jnp.ravel(jnp.asarray(tree[k], f32)) for k in keys])

  for t in range(1, STEPS + 1):
    before = state
    params, state = step(params, state)
    for f in range(FRAGMENTS):
      offset = f * EVERY // FRAGMENTS
      if (t - offset) % EVERY or t <= offset:   # fragment f not sent at step t
        continue
      keys = [k for k in sorted(params0) if frag[k] == f]
      sent_from = dict(zip(keys, state.pending[f][0]))   # the local parameters it was sent from
      res = flat(before.residual, keys)
      share = flat(before.outer_params, keys) - flat(sent_from, keys)
      got = np.asarray(flat(state.residual, keys))
      for d in (decay, 1.0):
        v = jnp.asarray(d, f32) * res + share
        want = np.asarray(v - codec.decode(codec.encode(v, f32), f32))
        err = np.abs(got - want).max() / (np.abs(want).max() + 1e-12)
        if d == decay and not err <= 1e-5:
          fail(f"rank {rank}: FAIL step {t} fragment {f}: the residual is not the decayed "
               f"rule's (off by {err})")
        if d == 1.0 and np.abs(res).max() > 0:
          if not err > 1e-2:
            fail(f"rank {rank}: FAIL step {t} fragment {f}: the residual did not decay")
          checked += 1
  if not checked:
    fail(f"rank {rank}: FAIL no send carried a non-zero residual: the decay went unchecked")


def resume(make, stepper, params0, rank, directory, fail) -> int:
  """Each rank checkpoints (params, diloco state) at step 5, fragment 0's transfer sent at step
  4 and due at 6 (in flight), and resumes in a transform made anew: bit-identical to going on."""
  import os

  import jax

  import jaxring

  def go(step, params, state, n):
    for _ in range(n):
      params, state = step(params, state)
    return params, state

  codec = jaxring.codecs.int8()
  tx = make("host", codec, fast="local", shard="optimizer")
  params, state = go(stepper(tx), params0, tx.init(params0), 5)
  ckpt = jaxring.train.Checkpointer(os.path.join(directory, f"rank{rank}"))
  ckpt.save({"params": params, "opt": state}, step=5)
  ckpt.wait_until_finished()
  straight = go(stepper(tx), params, state, 6)
  again = make("host", codec, fast="local", shard="optimizer")
  restored, _ = ckpt.restore({"params": params0, "opt": again.init(params0)})
  resumed = go(stepper(again), restored["params"], restored["opt"], 6)
  for a, b in zip(jax.tree_util.tree_leaves(straight), jax.tree_util.tree_leaves(resumed)):
    if not np.array_equal(np.asarray(a), np.asarray(b)):
      fail(f"rank {rank}: FAIL the resumed run differs from the straight one")
  print(f"rank {rank}: OK resumed")
  return 0


if __name__ == "__main__":
  sys.exit(main())
