"""Worker for tests/test_train_checkpoint.py: commits step 1, then hangs in the middle of step 2.

Prints ``COMMITTED 1`` once step 1 is committed (its parameters also go to ``--expected`` as .npz),
then saves step 2 with orbax's final rename replaced by a long sleep, so that whenever the parent's
SIGKILL lands (while files are being written, or just before the commit) step 2 is uncommitted.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def make_state():
  import jax.numpy as jnp
  import optax

  import jaxring.train as jt
  rng = np.random.RandomState(0)
  params = {"big": jnp.asarray(rng.randn(1024, 1024).astype(np.float32)),
            "small": jnp.asarray(rng.randn(7).astype(np.float32))}
  return jt.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1, momentum=0.9))


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--dir", required=True)
  ap.add_argument("--expected", required=True)
  args = ap.parse_args()

  import jax
  from orbax.checkpoint._src.path import atomicity

  import jaxring.train as jt

  state = make_state()
  ckpt = jt.Checkpointer(args.dir, max_to_keep=2, async_save=False)
  ckpt.save(state, step=1)
  ckpt.wait_until_finished()
  np.savez(args.expected, **jax.tree.map(np.asarray, state.params))
  print("COMMITTED 1", flush=True)

  async def never_commit(self):
    print("FINALIZING", flush=True)
    time.sleep(600)
  atomicity.AtomicRenameTemporaryPath.finalize = never_commit

  state = state.replace(params=jax.tree.map(lambda p: p + 1.0, state.params), step=state.step + 1)
  ckpt.save(state, step=2)
  print("SAVED 2 (should not happen)", flush=True)
  return 1


if __name__ == "__main__":
  sys.exit(main())
