"""Worker for tests/test_train_checkpoint.py: one of 2 processes of a checkpointed fit.

Trains ``train_dist.problem()`` with int8 compression (residuals sharded across the processes) to
``--steps``, checkpointing every 2 steps into the shared ``--dir``, resuming from it if it holds a
step. Prints ``RESUMED <step>`` (the step fit started from) and ``FINAL <crc32 of the params>``.
With ``--diloco`` the processes are the nodes: ``jaxring.diloco`` (every 3 steps, 2 fragments,
delay 1, int8 with error feedback) through ``train_step(grad_axes="local")``, and the crc covers
each replica's own parameters and the residuals too, and ``TOP-LEVEL ALL-REDUCES <n>`` counts
the compiled step's lax all-reduces outside the outer syncs' conditionals (the fast level's
gradients and metrics run in-process).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--dir", required=True)
  ap.add_argument("--steps", type=int, required=True)
  ap.add_argument("--diloco", action="store_true")
  args = ap.parse_args()
  logging.basicConfig(level=logging.WARNING)

  import jaxring.distributed
  jaxring.distributed.initialize()
  import jax
  import jax.numpy as jnp

  import jaxring
  import jaxring.train as jt
  from train_dist import problem
  model, tx, data, loss_fn = problem()
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 5)))["params"]
  kw = dict(compression=jaxring.codecs.int8(block_size=16))
  if args.diloco:   # a node per process, its 2 devices the fast level
    tx = jaxring.diloco(tx, axis="node", every=3, fragments=2, delay=1,
                        compression=jaxring.codecs.int8(block_size=16))
    mesh = jax.make_mesh((2, 2), ("node", "local"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    kw = dict(mesh=mesh, axis_name=("node", "local"), grad_axes="local")
  state = jt.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  @jt.train_step(**kw)
  def step(state, batch):
    loss, grads = jt.value_and_grad(lambda p: loss_fn(state.apply_fn, p, batch))(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  batches = jt.BatchIterator(data, 32, seed=1)
  ckpt = jt.Checkpointer(args.dir, max_to_keep=5)
  original_restore = ckpt.restore

  def restore(template, *, step=None):
    out = original_restore(template, step=step)
    print(f"RESUMED {int(jax.device_get(out[0].step))}", flush=True)
    return out
  ckpt.restore = restore
  state = jt.fit(step, state, batches, num_steps=args.steps, checkpointer=ckpt,
                 checkpoint_every=2, progress=False)
  ckpt.close()
  if args.diloco:
    hlo = step.lower(state, next(iter(batches))).compile().as_text()
    lax_ops = [l for l in hlo.splitlines() if " all-reduce(" in l or " all-reduce-start(" in l]
    print(f"TOP-LEVEL ALL-REDUCES {sum('/cond/' not in l for l in lax_ops)}", flush=True)
    # this process's rows of everything: its node's parameters, residuals
    flat = [np.asarray(s.data) for x in jax.tree.leaves((state.params, state.opt_state))
            for s in x.addressable_shards]
  else:
    flat = [np.asarray(x.addressable_shards[0].data) for x in jax.tree.leaves(state.params)]
  print(f"FINAL {zlib.crc32(b''.join(a.tobytes() for a in flat)):08x}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
