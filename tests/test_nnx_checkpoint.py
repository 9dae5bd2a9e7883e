"""Checkpoints of Flax NNX training: ``(model, optimizer)`` saved and restored in place by
``jaxring.train.Checkpointer``, through ``jaxring.train.fit``, or by plain orbax on ``nnx.state``
of prepared objects. A resumed run is bit-identical to an uninterrupted one (parameters, AdamW's
state, BatchNorm statistics, dropout RNG counts, int8 error-feedback residuals, losses, data
position); residuals saved by 8 replicas continue on 4 as the mean of the saved rows; evaluation
under ``nnx.jit`` sees the replicas' averaged BatchNorm statistics, after steps and after a
restore.

Run as a script (``python tests/test_nnx_checkpoint.py resume DIR OUT``) it is the 4-device
worker of the 8-to-4 test."""
import dataclasses
import json
import os
import pickle
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxring as jr
import jaxring.train as jt

pytestmark = pytest.mark.slow   # orbax writes and restores of several trained NNX runs (~40 s on 2 cores); the quick loop keeps test_nnx*'s step checks

MOMENTUM = 0.5   # BatchNorm's: the statistics of one step weigh as much as those before it


class Net(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(4, 16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, momentum=MOMENTUM, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)   # its RNG count is state a resume must get back
    self.l2 = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def loss_fn(model, batch):
  logits = model(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


@jr.train_step(compression=jr.codecs.int8())   # lossy: error-feedback residuals in the optimizer
def step(model, optimizer, batch):
  loss, grads = jr.value_and_grad(loss_fn)(model, batch)
  optimizer.update(model, grads)
  return {"loss": loss}


def objects(seed):
  """A fresh model (its initial parameters and RNG streams from ``seed``) and AdamW."""
  model = Net(nnx.Rngs(seed, dropout=seed + 100))
  return model, nnx.Optimizer(model, optax.adamw(0.05, weight_decay=1e-3), wrt=nnx.Param)


def batches():
  """32 examples a step out of 160 (5 steps an epoch: 6 steps cross an epoch), shuffled."""
  rng = np.random.RandomState(0)
  x = rng.randn(160, 4).astype(np.float32)
  y = np.argmax(x @ rng.randn(4, 3), axis=1).astype(np.int32)
  return jt.BatchIterator({"x": x, "y": y}, batch_size=32, seed=3)


def adam_promotion():
  return jax.numpy_dtype_promotion("standard")   # optax.adam's bias correction: float ** int32


def flat(objs) -> dict:
  """``{path: numpy copy}`` of every variable of ``objs`` (PRNG keys as their key data)."""
  out = {}
  for path, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(objs))):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    out[jax.tree_util.keystr(path)] = np.array(x, copy=True)   # the step donates its inputs
  return out


def assert_same(got: dict, want: dict, skip=()):
  assert set(got) == set(want), set(got) ^ set(want)
  for k, value in want.items():
    if not any(s in k for s in skip):
      np.testing.assert_array_equal(got[k], value, err_msg=k)


def residual_keys(state: dict) -> list:
  return [k for k in state if k.startswith("[1]['residuals']")]


def train(objs, it, n):
  """``n`` steps of ``step`` on ``objs`` in place: the losses and the state after each step."""
  losses, states = [], []
  with adam_promotion():
    for _ in range(n):
      losses.append(float(step(*objs, next(it))["loss"]))
      states.append(flat(objs))
  return losses, states


@dataclasses.dataclass
class Run:
  objs: tuple
  losses: list
  states: list        # flat() after each step
  initial: dict = None
  directory: str = None
  data_state: dict = None


@pytest.fixture(scope="module")
def straight():
  """The uninterrupted run: 6 steps from seed 0."""
  objs = objects(0)
  losses, states = train(objs, batches(), 6)
  return Run(objs, losses, states)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A run of its own: 3 steps from seed 0, saved with the Checkpointer (and the data position)."""
  objs, it = objects(0), batches()
  initial = flat(objs)
  losses, states = train(objs, it, 3)
  directory = str(tmp_path_factory.mktemp("nnx") / "ckpt")
  with jt.Checkpointer(directory, async_save=False) as ckpt:
    ckpt.save(objs, data_state=it.get_state())
  return Run(objs, losses, states, initial, directory, it.get_state())


def test_the_saved_state_is_what_a_resume_needs(straight, saved):
  state = saved.states[-1]
  assert_same(state, straight.states[2])   # the same 3 steps
  res = residual_keys(state)
  assert len(res) == 6, res   # one per parameter, laid out like the parameters
  for k in res:
    param = state[k.replace("[1]['residuals']", "[0]")]
    assert state[k].shape == (8,) + param.shape, k
  assert any(np.abs(state[k]).max() > 0 for k in res)
  rows = state["[1]['residuals']['l1']['kernel']"]
  assert not all(np.array_equal(rows[0], r) for r in rows[1:])   # each replica its own
  assert np.abs(state["[0]['bn']['mean']"]).max() > 0             # BatchNorm statistics moved
  assert int(state["[1]['step']"]) == 3
  assert state["[0]['drop']['rngs']['count']"] > saved.initial[
      "[0]['drop']['rngs']['count']"]


def test_restore_into_fresh_objects_continues_bit_identically(straight, saved):
  model, opt = objects(1)   # another seed: nothing but the restore makes it the saved run
  assert not np.array_equal(flat(model)["['l1']['kernel']"],
                            saved.states[-1]["[0]['l1']['kernel']"])
  (got_model, got_opt), data_state = jt.Checkpointer(saved.directory).restore((model, opt))
  assert got_model is model and got_opt is opt   # in place
  assert data_state == saved.data_state
  assert_same(flat((model, opt)), saved.states[-1])
  it = batches()
  it.set_state(data_state)
  losses, states = train((model, opt), it, 3)
  assert losses == straight.losses[3:]
  for got, want in zip(states, straight.states[3:]):
    assert_same(got, want)


def test_fit_resumes_from_its_checkpoint_bit_identically(straight, tmp_path):
  model, opt = objects(0)
  it = batches()
  with adam_promotion():
    out = jt.fit(step, (model, opt), it, num_steps=6, progress=False)
  assert out[0] is model and out[1] is opt
  assert_same(flat(out), straight.states[-1])   # fit steps the objects as the loop above
  fitted, end_position = flat(out), it.get_state()

  directory = tmp_path / "ckpt"
  with jt.Checkpointer(directory) as ckpt, adam_promotion():
    jt.fit(step, objects(0), batches(), num_steps=3, checkpointer=ckpt, checkpoint_every=3,
           progress=False)
  model, opt = objects(1)
  it, metrics = batches(), tmp_path / "metrics.jsonl"
  with jt.Checkpointer(directory) as ckpt, adam_promotion():
    assert ckpt.latest_step == 3
    jt.fit(step, (model, opt), it, num_steps=6, checkpointer=ckpt, checkpoint_every=3,
           log_every=1, metrics_path=str(metrics), progress=False)
  records = [json.loads(line) for line in metrics.read_text().splitlines()]
  assert [r["step"] for r in records] == [4, 5, 6]   # resumed at 3
  assert [r["loss"] for r in records] == straight.losses[3:]
  assert_same(flat((model, opt)), fitted)
  assert it.get_state() == end_position             # the data position was restored too
  assert jt.Checkpointer(directory).all_steps() == [3, 6]


def test_plain_orbax_on_the_nnx_state_of_prepared_objects(straight, tmp_path):
  import orbax.checkpoint as ocp
  model, opt = objects(0)
  step.prepare(model, opt)   # the residuals exist (zeros) before the first step
  prepared = flat((model, opt))
  res = residual_keys(prepared)
  assert len(res) == 6 and "residuals" in nnx.state(opt)
  for k in res:
    assert prepared[k].shape == (8,) + prepared[k.replace("[1]['residuals']", "[0]")].shape
    assert not prepared[k].any()
  it = batches()
  losses, _ = train((model, opt), it, 3)
  assert losses == straight.losses[:3]

  path = tmp_path / "orbax"
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, nnx.state((model, opt)))
  checkpointer.wait_until_finished()
  fresh = objects(1)
  step.prepare(*fresh)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(fresh))
  nnx.update(fresh, checkpointer.restore(path, abstract))
  checkpointer.close()
  assert_same(flat(fresh), straight.states[2])
  losses, states = train(fresh, it, 3)
  assert losses == straight.losses[3:]
  assert_same(states[-1], straight.states[-1])


def _numpy_forward(state: dict, x):
  """The model in eval mode in float64 NumPy from ``state`` (a ``flat`` dict of the objects)."""
  def p(name):
    return state[f"[0]{name}"].astype(np.float64)
  h = x.astype(np.float64) @ p("['l1']['kernel']") + p("['l1']['bias']")
  h = (h - p("['bn']['mean']")) / np.sqrt(p("['bn']['var']") + 1e-5)
  h = np.maximum(h * p("['bn']['scale']") + p("['bn']['bias']"), 0)
  return h @ p("['l2']['kernel']") + p("['l2']['bias']")


def test_batch_statistics_are_the_mean_of_the_replicas(saved):
  # after step 1: each replica's running statistics moved towards those of its 4 examples, then
  # averaged (not those of the global batch of 32)
  x = next(batches())["x"].astype(np.float64)
  init, after = saved.initial, saved.states[0]
  h = (x @ init["[0]['l1']['kernel']"] + init["[0]['l1']['bias']"]).reshape(8, 4, 16)
  mean = MOMENTUM * 0.0 + (1 - MOMENTUM) * h.mean(axis=1).mean(axis=0)
  var = MOMENTUM * 1.0 + (1 - MOMENTUM) * h.var(axis=1).mean(axis=0)
  np.testing.assert_allclose(after["[0]['bn']['mean']"], mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(after["[0]['bn']['var']"], var, rtol=1e-5, atol=1e-6)
  global_var = MOMENTUM + (1 - MOMENTUM) * h.reshape(32, 16).var(axis=0)
  assert np.abs(global_var - var).max() > 1e-2   # the two rules differ here


def test_eval_under_nnx_jit_after_steps_and_after_a_restore(straight, saved):
  forward = nnx.jit(lambda m, x: m(x))
  x = np.random.RandomState(1).randn(16, 4).astype(np.float32)

  model, opt = straight.objs
  model.eval()
  try:
    np.testing.assert_allclose(forward(model, x), _numpy_forward(straight.states[-1], x),
                               rtol=1e-5, atol=1e-5)
  finally:
    model.train()

  model, opt = objects(1)
  jt.Checkpointer(saved.directory).restore((model, opt))
  model.eval()
  y = forward(model, x)
  np.testing.assert_allclose(y, _numpy_forward(saved.states[-1], x), rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(y) - _numpy_forward(saved.initial, x)).max() > 1e-2
  model.train()   # evaluation left nothing behind: training continues as if it had not run
  it = batches()
  it.set_state(saved.data_state)
  losses, states = train((model, opt), it, 1)
  assert losses == straight.losses[3:4]
  assert_same(states[0], straight.states[3])


@pytest.mark.slow   # a 4-device process compiling its step and taking 5 steps (~15 s; ~30 s
#                     alone, with the 8-device runs it compares against)
@pytest.mark.timeout(400)
def test_residuals_saved_by_8_replicas_continue_on_4_as_their_mean(straight, saved, tmp_path):
  import multiproc as mp
  out = tmp_path / "resumed.pkl"
  flags = "--xla_force_host_platform_device_count=4"
  (result,) = mp.spawn(1, lambda i: [sys.executable, os.path.abspath(__file__), "resume",
                                     saved.directory, str(out)],
                       lambda i: mp.clean_env(XLA_FLAGS=flags), timeout=300)
  assert result.returncode == 0, mp.report([result])
  got = pickle.loads(out.read_bytes())
  want = saved.states[-1]
  keys = residual_keys(want)

  assert_same(got["restored"], want)   # read back as saved, 8 rows (remapped at the step)
  remapped = got["prepared_restored"]  # a prepared 4-device template: remapped at the restore
  assert_same(remapped, want, skip=["['residuals']"])
  for k in keys:
    assert remapped[k].shape == (4,) + want[k].shape[1:], k
    mean = want[k].astype(np.float64).mean(axis=0)
    for row in remapped[k]:
      np.testing.assert_allclose(row, mean, rtol=1e-6, atol=1e-6 * np.abs(want[k]).max(),
                                 err_msg=k)

  # the first step's residual input is the mean of the saved rows: the step of the objects
  # restored as they were equals that of the prepared template and that of objects whose
  # residuals were set by hand to 4 rows of the mean
  for name in ("prepared", "by_hand"):
    assert got[f"{name}_loss"] == got["loss"], name
    assert_same(got[name], got["after"])
  after = got["after"]
  for k in keys:
    assert after[k].shape == (4,) + want[k].shape[1:], k
  assert int(after["[1]['step']"]) == 4

  # the loss continues from where it was, not from a fresh model's: the restored model
  # evaluates on 4 devices as the saved one does, and its training loss at step 4 (BatchNorm
  # and dropout on shards of 8, not 4) is nearer the 8-device step 4 than step 1
  it = batches()
  it.set_state(saved.data_state)
  batch = next(it)
  logits = _numpy_forward(want, batch["x"])
  log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
  np.testing.assert_allclose(got["eval_loss"], -log_p[np.arange(32), batch["y"]].mean(),
                             rtol=1e-5)
  drop = straight.losses[0] - straight.losses[3]
  assert drop > 0.3 and abs(got["loss"] - straight.losses[3]) < drop / 2, (got["loss"],
                                                                           straight.losses)
  assert np.isfinite(got["more"]).all() and int(got["end"]["[1]['step']"]) == 6
  assert max(got["more"]) < straight.losses[1]


def _resume_on_4(directory: str, out: str) -> None:
  """The 4-device side of the 8-to-4 test: restores the 8-replica checkpoint three ways and
  takes a step with each."""
  assert jax.device_count() == 4
  ckpt = jt.Checkpointer(directory)
  result = {}
  with adam_promotion():
    model, opt = objects(1)
    _, data_state = ckpt.restore((model, opt))
    result["restored"] = flat((model, opt))
    it = batches()
    it.set_state(data_state)
    batch = next(it)
    model.eval()
    result["eval_loss"] = float(nnx.jit(loss_fn)(model, batch))
    model.train()
    result["loss"] = float(step(model, opt, batch)["loss"])
    result["after"] = flat((model, opt))

    prepared = objects(2)
    step.prepare(*prepared)
    ckpt.restore(prepared)
    result["prepared_restored"] = flat(prepared)
    result["prepared_loss"] = float(step(*prepared, batch)["loss"])
    result["prepared"] = flat(prepared)

    by_hand = objects(3)
    ckpt.restore(by_hand)
    for v in jax.tree.leaves(by_hand[1].residuals, is_leaf=lambda x: isinstance(x, nnx.Variable)):
      rows = jnp.asarray(v.get_value())
      v.set_value(jnp.broadcast_to(jnp.mean(rows, axis=0, keepdims=True), (4,) + rows.shape[1:]))
    result["by_hand_loss"] = float(step(*by_hand, batch)["loss"])
    result["by_hand"] = flat(by_hand)

    result["more"] = [float(step(model, opt, next(it))["loss"]) for _ in range(2)]
    result["end"] = flat((model, opt))
  with open(out, "wb") as f:
    pickle.dump(result, f)


if __name__ == "__main__" and sys.argv[1:2] == ["resume"]:
  _resume_on_4(*sys.argv[2:4])
