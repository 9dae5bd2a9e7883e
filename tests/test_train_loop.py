"""fit: progress bar and JSON lines from process 0 only, a non-finite loss raises, data position."""
import json

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxring.train as jt
from jaxring._src.train import metrics as metrics_mod
from jaxring.train import FitSummary


def _state():
  params = {"w": jnp.zeros((4, 1), jnp.float32)}
  return jt.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))


@pytest.fixture(scope="module")
def step():
  @jt.train_step()
  def step(state, batch):
    def loss_fn(p):
      return jnp.mean(jnp.square(batch["x"] @ p["w"] - batch["y"]))
    loss, grads = jt.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}
  return step


def _data(n=64, nan_from=None):
  rng = np.random.RandomState(0)
  x = rng.randn(n, 4).astype(np.float32)
  y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32))
  if nan_from is not None:
    x[nan_from:] = np.nan
  return {"x": x, "y": y}


def test_fit_logs_every_step_with_throughput(step, tmp_path, capsys):
  path = tmp_path / "metrics.jsonl"
  state = jt.fit(step, _state(), jt.BatchIterator(_data(), 16, shuffle=False), num_steps=6,
                 log_every=4, metrics_path=str(path))
  records = [json.loads(l) for l in path.read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
  assert all(r["images_per_s"] > 0 for r in records)
  assert records[-1]["loss"] < records[0]["loss"]
  assert int(state.step) == 6
  err = capsys.readouterr().err
  assert "6/6" in err and "img/s" in err  # the tqdm bar


def test_non_finite_loss_raises_with_the_step(step, tmp_path):
  path = tmp_path / "metrics.jsonl"
  batches = jt.BatchIterator(_data(nan_from=32), 16, shuffle=False)  # batch 3 (step 3) is nan
  with pytest.raises(FloatingPointError, match="step 3"):
    jt.fit(step, _state(), batches, num_steps=8, log_every=1, metrics_path=str(path),
           progress=False)
  records = [json.loads(l) for l in path.read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["loss"] == "nan"


def test_only_process_zero_writes(step, tmp_path, capsys, monkeypatch):
  batches = jt.BatchIterator(_data(), 16)
  monkeypatch.setattr(metrics_mod.jax, "process_index", lambda: 1)  # as on process 1 of 2
  path = tmp_path / "metrics.jsonl"
  jt.fit(step, _state(), batches, num_steps=2, metrics_path=str(path))
  assert not path.exists()
  assert "img/s" not in capsys.readouterr().err


def test_batch_iterator_resumes_at_its_position():
  data = {"i": np.arange(10)}
  straight = jt.BatchIterator(data, 4, seed=5)
  seen = [next(straight)["i"] for _ in range(5)]  # 2 batches per epoch: crosses two epochs
  again = jt.BatchIterator(data, 4, seed=5)
  for _ in range(3):
    next(again)
  resumed = jt.BatchIterator(data, 4, seed=5)
  resumed.set_state(json.loads(json.dumps(again.get_state())))
  np.testing.assert_array_equal(next(resumed)["i"], seen[3])
  np.testing.assert_array_equal(next(resumed)["i"], seen[4])
  assert sorted(np.concatenate(seen[:2])) != list(range(8))  # shuffled, 2 left out per epoch
  halves = [jt.BatchIterator(data, 4, seed=5, process_index=k, process_count=2) for k in (0, 1)]
  np.testing.assert_array_equal(np.concatenate([next(h)["i"] for h in halves]), np.sort(seen[0]))


def test_fit_evaluates_on_its_cadence_and_at_the_end(step, tmp_path):
  path = tmp_path / "metrics.jsonl"
  seen = []

  def evaluate(state):
    seen.append(int(state.step))
    return {"eval_w0": float(state.params["w"][0, 0])}
  summary = FitSummary()
  jt.fit(step, _state(), jt.BatchIterator(_data(), 16, shuffle=False), num_steps=7, log_every=2,
         metrics_path=str(path), progress=False, evaluate=evaluate, eval_every=3,
         summary=summary)
  assert seen == [3, 6, 7]
  records = [json.loads(l) for l in path.read_text().splitlines()]
  evals = [r for r in records if "eval_w0" in r]
  assert [r["step"] for r in evals] == [3, 6, 7]
  assert summary.last_eval == evals[-1] and summary.start_step == 0
  assert summary.images_per_s > 0 and summary.compile_s is None


def test_steady_state_times_the_first_step_apart_and_resumes(step, tmp_path):
  path = tmp_path / "metrics.jsonl"
  ckpt = jt.Checkpointer(tmp_path / "ckpt")
  summary = FitSummary()
  jt.fit(step, _state(), jt.BatchIterator(_data(), 16, shuffle=False), num_steps=5, log_every=2,
         metrics_path=str(path), progress=False, evaluate=lambda s: {"e": 1.0},
         steady_state=True, checkpointer=ckpt, checkpoint_every=4, summary=summary)
  losses = [json.loads(l) for l in path.read_text().splitlines()]
  assert [r["step"] for r in losses if "loss" in r] == [2, 3, 4, 5]  # step 1 compiled: not logged
  assert summary.compile_s > 0 and summary.images_per_s > 0
  assert sorted(ckpt.all_steps()) == [4, 5]
  again = FitSummary()  # resumed at the last step: nothing to train, evaluated once
  state = jt.fit(step, _state(), jt.BatchIterator(_data(), 16, shuffle=False), num_steps=5,
                 progress=False, evaluate=lambda s: {"e": 2.0}, checkpointer=ckpt,
                 summary=again)
  ckpt.close()
  assert int(state.step) == 5 and again.start_step == 5
  assert again.last_eval == {"e": 2.0, "step": 5}
