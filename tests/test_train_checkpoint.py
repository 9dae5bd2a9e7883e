"""Checkpoints: a resumed run is bit-identical to an uninterrupted one; a crash mid-save loses
nothing that was committed."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import jaxring
import jaxring.train as jt

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class DropoutMLP(nn.Module):
  @nn.compact
  def __call__(self, x, train=True):
    x = nn.relu(nn.Dense(32)(x))
    x = nn.Dropout(0.25, deterministic=not train)(x)
    return nn.Dense(4)(x)


MODEL, TX = DropoutMLP(), optax.sgd(0.1, momentum=0.9)  # shared: one compilation for all runs


def _fresh_state():
  params = MODEL.init(jax.random.PRNGKey(0), jnp.zeros((1, 8)), train=False)["params"]
  return jt.TrainState.create(apply_fn=MODEL.apply, params=params, rng=jax.random.PRNGKey(7),
                              tx=TX)


def _batches():
  rng = np.random.RandomState(0)
  data = {"x": rng.randn(80, 8).astype(np.float32), "y": rng.randint(0, 4, 80).astype(np.int32)}
  return jt.BatchIterator(data, batch_size=16, seed=3)  # 5 batches per epoch: crosses epochs


@pytest.fixture(scope="module")
def step():
  # int8 + error feedback: the residuals are state a resumed run must get back exactly
  @jt.train_step(algorithm="ring", compression=jaxring.codecs.int8(block_size=32))
  def step(state, batch):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, batch["x"],
                              rngs={"dropout": state.step_rng()})
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    loss, grads = jt.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}
  return step


def _leaves(state):
  return [np.asarray(x) for x in jax.tree.leaves(
      (state.step, state.params, state.opt_state, state.rng, state.residuals))]


def test_resume_is_bit_identical_to_an_uninterrupted_run(step, tmp_path):
  straight = jt.fit(step, _fresh_state(), _batches(), num_steps=7, progress=False)

  first = jt.Checkpointer(tmp_path / "ckpt", max_to_keep=2)
  jt.fit(step, _fresh_state(), _batches(), num_steps=4, checkpointer=first, checkpoint_every=2,
         progress=False)
  first.close()
  second = jt.Checkpointer(tmp_path / "ckpt", max_to_keep=2)
  assert second.latest_step == 4 and second.all_steps() == [2, 4]  # keep-2 dropped nothing yet
  metrics = tmp_path / "m.jsonl"
  resumed = jt.fit(step, _fresh_state(), _batches(), num_steps=7, checkpointer=second,
                   checkpoint_every=2, log_every=1, metrics_path=str(metrics), progress=False)
  second.close()

  assert [json.loads(l)["step"] for l in metrics.read_text().splitlines()] == [5, 6, 7]
  assert jt.Checkpointer(tmp_path / "ckpt", max_to_keep=2).all_steps() == [6, 7]
  got, want = _leaves(resumed), _leaves(straight)
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  assert any(np.abs(r).max() > 0 for r in jax.tree.leaves(jax.device_get(resumed.residuals)))


def test_sigkill_in_the_middle_of_a_save_keeps_the_last_commit(tmp_path):
  directory, expected = tmp_path / "ckpt", tmp_path / "expected.npz"
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
  log = open(tmp_path / "worker.log", "w+")
  proc = subprocess.Popen(
      [sys.executable, os.path.join(REPO, "tests", "workers", "train_checkpoint_kill.py"),
       "--dir", str(directory), "--expected", str(expected)],
      stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
  try:
    deadline = time.time() + 120
    while not glob.glob(str(directory / "2.orbax-checkpoint-tmp*")):
      assert proc.poll() is None, open(tmp_path / "worker.log").read()
      assert time.time() < deadline, "worker never started saving step 2"
      time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)  # step 2 is being written
    proc.wait(timeout=30)
  finally:
    if proc.poll() is None:
      os.kill(proc.pid, signal.SIGKILL)
      proc.wait(timeout=30)
    log.close()
  output = (tmp_path / "worker.log").read_text()
  assert "COMMITTED 1" in output and "SAVED 2" not in output, output
  assert proc.returncode == -signal.SIGKILL

  ckpt = jt.Checkpointer(directory, max_to_keep=2, async_save=False)
  assert ckpt.latest_step == 1
  template = _worker_state()
  state, _ = ckpt.restore(template)
  want = np.load(expected)
  for k in ("big", "small"):
    np.testing.assert_array_equal(np.asarray(state.params[k]), want[k])
  ckpt.save(state.replace(step=state.step + 1), step=2)  # the interrupted step can be redone
  ckpt.close()
  assert jt.Checkpointer(directory).all_steps() == [1, 2]
  assert not glob.glob(str(directory / "*.orbax-checkpoint-tmp*"))


def _worker_state():
  sys.path.insert(0, os.path.join(REPO, "tests", "workers"))
  try:
    import train_checkpoint_kill
  finally:
    sys.path.pop(0)
  return train_checkpoint_kill.make_state()
