"""Checkpoints: a resumed run is bit-identical to an uninterrupted one; a crash mid-save loses
nothing that was committed."""
import glob
import json
import os
import shutil
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


@pytest.mark.slow   # three training runs (~4 s)
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


def test_a_fresh_state_is_a_template_for_a_trained_one_residuals_included(step, tmp_path):
  # the restart a script writes: create the state afresh (step=0, a Python int, no residuals)
  # and restore into it; the saved step is an int32 array and the residuals are per replica
  batches = _batches()
  straight = _fresh_state()
  for _ in range(5):
    straight, _ = step(straight, next(batches))
  ckpt = jt.Checkpointer(tmp_path / "ckpt", async_save=False)
  partial, batches = _fresh_state(), _batches()
  for _ in range(3):
    partial, _ = step(partial, next(batches))
  ckpt.save(partial)
  resumed, _ = jt.Checkpointer(tmp_path / "ckpt").restore(_fresh_state())
  assert int(resumed.step) == 3 and resumed.residuals is not None
  for _ in range(2):
    resumed, _ = step(resumed, next(batches))
  for g, w in zip(_leaves(resumed), _leaves(straight)):
    np.testing.assert_array_equal(g, w)


def test_an_fp16_state_restores_into_a_fresh_template_by_orbax_or_flax(tmp_path):
  # the fresh state has no loss scale yet (the step makes one); the saved state has one
  import flax.serialization

  @jt.train_step(precision="fp16", donate=False)
  def fp16_step(state, batch):
    def loss_fn(params):
      x = batch["x"].astype(jax.tree.leaves(params)[0].dtype)   # fp16 like the parameters
      logits = state.apply_fn({"params": params}, x, train=False)
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    loss, grads = jt.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  batches = _batches()
  trained, _ = fp16_step(_fresh_state(), next(batches))
  want, _ = fp16_step(trained, next(_batches()))
  ckpt = jt.Checkpointer(tmp_path / "ckpt", async_save=False)
  ckpt.save(trained)
  by_orbax, _ = ckpt.restore(_fresh_state())
  by_flax = flax.serialization.from_bytes(_fresh_state(), flax.serialization.to_bytes(trained))
  for restored in (by_orbax, by_flax):
    got, _ = fp16_step(restored, next(_batches()))
    assert float(got.loss_scale.scale) == float(want.loss_scale.scale)
    for g, w in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_residuals_of_another_replica_count_need_the_prepared_template(step, tmp_path):
  state, _ = step(_fresh_state(), next(_batches()))
  from jaxring._src.train.state import Residuals
  state = state.replace(residuals=Residuals(jax.tree.map(lambda r: np.asarray(r)[:4],
                                                            jax.device_get(state.residuals))))
  with pytest.raises(ValueError, match="residuals are for 4 replicas, this step has 8"):
    step(state, next(_batches()))


@pytest.mark.slow   # a fresh process killed mid-save (~2 s)
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


# Corruption: a checkpoint whose bytes changed on disk is refused with a named error, and fit
# resumes from the previous one.

def _largest_file(directory) -> str:
  """The largest of the data files orbax wrote under ``directory`` (OCDBT keeps them in d/)."""
  files = [p for p in glob.glob(os.path.join(str(directory), "**", "d", "*"), recursive=True)
           if os.path.isfile(p)]
  return max(files, key=os.path.getsize)


def _flip_middle_bit(path: str) -> None:
  data = bytearray(open(path, "rb").read())
  data[len(data) // 2] ^= 0x08
  with open(path, "wb") as f:
    f.write(bytes(data))


@pytest.fixture()
def saved(tmp_path):
  """A committed step 1 of the kill worker's state (a 1024x1024 f32 array, 4 MiB on disk)."""
  state = _worker_state()
  ckpt = jt.Checkpointer(tmp_path / "ckpt", async_save=False)
  ckpt.save(state, step=1)
  ckpt.close()
  return state, tmp_path / "ckpt"


def _silent_flip(state_dir, template) -> float:
  """Flips one bit near the middle of the largest data file so that orbax reads it back without
  error (zstd has no checksum: most flips inside its literals decode to wrong values); returns
  how much params['big'] then differs."""
  import orbax.checkpoint as ocp
  path = _largest_file(state_dir)
  pristine = open(path, "rb").read()
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      if isinstance(x, jax.Array) else x, template)
  for k in range(40):
    data = bytearray(pristine)
    data[len(data) // 2 + 101 * k] ^= 0x08
    with open(path, "wb") as f:
      f.write(bytes(data))
    try:
      got = ocp.StandardCheckpointer().restore(str(state_dir), abstract)
    except Exception:  # noqa: BLE001 - this flip broke the zstd stream: orbax notices, try another
      continue
    diff = float(np.abs(np.asarray(got.params["big"]) - np.asarray(template.params["big"])).max())
    if diff > 0:
      return diff
  pytest.fail("no flip near the middle of the file was silent")


def test_a_flipped_bit_in_an_array_file_is_refused(saved):
  state, directory = saved
  assert os.path.getsize(_largest_file(directory / "1" / "state")) > 1 << 20
  assert _silent_flip(directory / "1" / "state", state) > 0  # plain orbax: a wrong value, no error
  with pytest.raises(jt.CheckpointCorruptError) as info:
    jt.Checkpointer(directory).restore(state)
  err = info.value
  assert isinstance(err, OSError) and err.step == 1 and err.path == str(directory / "1")
  assert f"checkpoint step 1 at {directory / '1'} is corrupt" in str(err)
  assert "params['big']" in err.reason and "crc32" in err.reason, err.reason


def test_a_flip_that_breaks_the_compressed_stream_is_named(saved):
  state, directory = saved
  _flip_middle_bit(_largest_file(directory / "1" / "state"))
  with pytest.raises(jt.CheckpointCorruptError, match=r"step 1 at .*/1 is corrupt: "):
    jt.Checkpointer(directory).restore(state)


def test_a_deleted_metadata_file_is_named(saved):
  state, directory = saved
  os.remove(directory / "1" / "state" / "_METADATA")
  with pytest.raises(jt.CheckpointCorruptError,
                     match=r"step 1 at .*/1 is corrupt: state/_METADATA is missing"):
    jt.Checkpointer(directory).restore(state)


def test_a_truncated_file_is_named_in_one_line(saved):
  state, directory = saved
  data_file = _largest_file(directory / "1" / "state")
  with open(data_file, "r+b") as f:
    f.truncate(os.path.getsize(data_file) // 2)
  with pytest.raises(jt.CheckpointCorruptError) as info:
    jt.Checkpointer(directory).restore(state)
  reason = info.value.reason
  assert reason.startswith("orbax could not read it: ") and "\n" not in reason, reason
  assert "params.big" in reason and len(reason) < 600, reason  # tensorstore's words, not its spec


def test_a_different_template_is_a_value_error_not_corruption(saved):
  state, directory = saved
  other = state.replace(params={**state.params, "small": jnp.zeros(8, jnp.float32)})
  with pytest.raises(ValueError, match=r"different state than the template: "
                                       r"\.params\['small'\]: checkpoint float32\[7\], template "
                                       r"float32\[8\]") as info:
    jt.Checkpointer(directory).restore(other)
  assert not isinstance(info.value, jt.CheckpointCorruptError)


@pytest.mark.slow   # trains, corrupts and resumes (~8 s)
def test_fit_skips_a_corrupt_checkpoint_and_resumes_from_the_previous(step, tmp_path, caplog):
  straight = jt.fit(step, _fresh_state(), _batches(), num_steps=7, progress=False)
  first = jt.Checkpointer(tmp_path / "ckpt", max_to_keep=3)
  jt.fit(step, _fresh_state(), _batches(), num_steps=4, checkpointer=first, checkpoint_every=2,
         progress=False)
  first.close()
  _flip_middle_bit(_largest_file(tmp_path / "ckpt" / "4" / "state"))

  second = jt.Checkpointer(tmp_path / "ckpt", max_to_keep=3)
  metrics = tmp_path / "m.jsonl"
  with caplog.at_level("WARNING", logger="jaxring._src.train.loop"):
    resumed = jt.fit(step, _fresh_state(), _batches(), num_steps=7, checkpointer=second,
                     checkpoint_every=2, log_every=1, metrics_path=str(metrics), progress=False)
  second.close()

  skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
  assert len(skipped) == 1 and f"step 4 at {tmp_path / 'ckpt' / '4'}" in skipped[0], skipped
  assert "4.corrupt" in skipped[0], skipped
  assert [json.loads(l)["step"] for l in metrics.read_text().splitlines()] == [3, 4, 5, 6, 7]
  assert os.path.isdir(tmp_path / "ckpt" / "4.corrupt")  # kept for inspection, not a step
  assert jt.Checkpointer(tmp_path / "ckpt").all_steps() == [4, 6, 7]  # 4 redone from step 2
  for g, w in zip(_leaves(resumed), _leaves(straight)):
    np.testing.assert_array_equal(g, w)


def _run_two_processes(directory, steps: int, *extra: str):
  import multiproc as mp
  port = mp.free_port()
  results = mp.spawn(2, lambda i: mp.python_worker(
      "train_checkpoint_dist.py", "--dir", str(directory), "--steps", str(steps), *extra),
                     lambda i: mp.clean_env(JAXRING_COORDINATOR=f"127.0.0.1:{port}",
                                            JAXRING_NUM_PROCESSES=2, JAXRING_PROCESS_ID=i,
                                            JAXRING_LOCAL_DEVICE_COUNT=2), timeout=200)
  mp.assert_all_ok(results)
  return results, mp.report(results)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_two_processes_skip_a_corrupt_checkpoint_together(tmp_path):
  # one straight run of 6 steps (each pair of processes is most of the test's time) leaves the
  # checkpoints of a run interrupted after step 4 once its last one is removed
  straight, report = _run_two_processes(tmp_path / "ckpt", 6)
  final = {r.stdout.split("FINAL ")[1].split()[0] for r in straight}
  assert len(final) == 1, report
  assert all("RESUMED" not in r.stdout for r in straight), report
  assert jt.Checkpointer(tmp_path / "ckpt").all_steps() == [2, 4, 6]
  shutil.rmtree(tmp_path / "ckpt" / "6")
  assert jt.Checkpointer(tmp_path / "ckpt").all_steps() == [2, 4]
  _flip_middle_bit(_largest_file(tmp_path / "ckpt" / "4" / "residuals"))  # one process's shard
  results, report = _run_two_processes(tmp_path / "ckpt", 6)
  for r in results:
    assert "RESUMED 2" in r.stdout and "RESUMED 4" not in r.stdout, report
    assert "skipping checkpoint step 4" in r.stderr, report
    assert r.stdout.split("FINAL ")[1].split()[0] in final, report  # bit-identical to straight


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_two_processes_resume_diloco_exactly(tmp_path):
  # a node per process: a run interrupted after step 4 (a fragment's result pending, the other's
  # residual held) resumes bit for bit into each node's parameters, residuals and outer state
  straight, report = _run_two_processes(tmp_path / "straight", 7, "--diloco")
  first, report = _run_two_processes(tmp_path / "ckpt", 4, "--diloco")
  assert jt.Checkpointer(tmp_path / "ckpt").all_steps()[-1] == 4, report
  resumed, report = _run_two_processes(tmp_path / "ckpt", 7, "--diloco")
  for a, b in zip(straight, resumed):
    assert "RESUMED 4" in b.stdout, report
    assert a.stdout.split("FINAL ")[1].split()[0] == b.stdout.split("FINAL ")[1].split()[0], report
  finals = {r.stdout.split("FINAL ")[1].split()[0] for r in straight}
  assert len(finals) == 2, report   # the nodes' own values differ: both were compared
  # between syncs nothing crosses gloo: the gradients' and the metrics' means over the node's
  # own devices run on the in-process transport, not lax's loopback all-reduce
  assert all("TOP-LEVEL ALL-REDUCES 0" in r.stdout for r in straight), report
