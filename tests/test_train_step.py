"""@jaxring.train_step: 8-replica training equals single-device training on the global batch."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import jaxring.train as jt

STEPS = 20
GLOBAL_BATCH = 32


class CNN(nn.Module):
  """Conv + BatchNorm; ``axis_name`` makes BatchNorm use the statistics of the global batch."""
  axis_name: object = None

  @nn.compact
  def __call__(self, x, train=True):
    for width, stride in ((8, 1), (16, 2)):
      x = nn.Conv(width, (3, 3), strides=stride)(x)
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.axis_name)(x)
      x = nn.relu(x)
    return nn.Dense(10)(x.mean(axis=(1, 2)))


def _data():
  rng = np.random.RandomState(0)
  xs = rng.randn(STEPS, GLOBAL_BATCH, 8, 8, 3).astype(np.float32)
  ys = rng.randint(0, 10, (STEPS, GLOBAL_BATCH)).astype(np.int32)
  return xs, ys


def _init(model):
  v = model.init(jax.random.PRNGKey(0), jnp.zeros((2, 8, 8, 3)), train=False)
  return jt.TrainState.create(apply_fn=model.apply, params=v["params"],
                              batch_stats=v["batch_stats"], tx=optax.sgd(0.05, momentum=0.9))


def _loss_fn(state, batch):
  def loss_fn(params):
    logits, updates = state.apply_fn(state.variables(params), batch["x"],
                                     mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, updates["batch_stats"]
  return loss_fn


def _reference():
  """Plain single-device jax: jax.value_and_grad on the whole global batch."""
  state = _init(CNN(axis_name=None))

  @jax.jit
  def step(state, batch):
    (loss, stats), grads = jax.value_and_grad(_loss_fn(state, batch), has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=stats), loss

  xs, ys = _data()
  losses = []
  for i in range(STEPS):
    state, loss = step(state, {"x": xs[i], "y": ys[i]})
    losses.append(float(loss))
  return state, np.array(losses)


@pytest.fixture(scope="module")
def reference():
  return _reference()


def _data_parallel(**kwargs):
  state = _init(CNN(axis_name="data"))

  @jt.train_step(**kwargs)
  def step(state, batch):
    (loss, stats), grads = jt.value_and_grad(_loss_fn(state, batch), has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=stats), {"loss": loss}

  xs, ys = _data()
  losses = []
  for i in range(STEPS):
    state, metrics = step(state, {"x": xs[i], "y": ys[i]})
    losses.append(float(metrics["loss"]))
  return state, np.array(losses), step


@pytest.mark.slow   # compiles whole train steps (~3-5 s each)
@pytest.mark.parametrize("overlap", [True, False])
def test_eight_replicas_match_single_device(reference, overlap):
  ref_state, ref_losses = reference
  state, losses, step = _data_parallel(overlap=overlap, bucket_bytes=2048)
  assert step.num_replicas == 8
  assert len(step.buckets) > 1
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=2e-6)
  for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
  for got, want in zip(jax.tree.leaves(state.batch_stats), jax.tree.leaves(ref_state.batch_stats)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
  assert int(state.step) == STEPS


def test_grad_with_several_argnums_is_the_global_batch_gradient():
  rng = np.random.RandomState(0)
  w, b = rng.randn(5, 3).astype(np.float32), rng.randn(3).astype(np.float32)
  x = rng.randn(32, 5).astype(np.float32)

  def loss(w, b, x):
    return jnp.mean(jnp.square(jnp.tanh(x @ w + b)))

  want = jax.grad(loss, argnums=(0, 1))(w, b, x)  # plain jax, one device, global batch
  outside = jt.grad(loss, argnums=(0, 1))(w, b, x)  # outside a train_step: jax.grad

  @jt.train_step(donate=False, bucket_bytes=8)  # b (12 bytes) and w: two buckets
  def step(state, batch):
    gw, gb = jt.grad(loss, argnums=(0, 1))(state["w"], state["b"], batch)
    return state, {"gw": gw, "gb": gb}

  _, metrics = step({"w": w, "b": b}, x)
  for g, o, r in zip((metrics["gw"], metrics["gb"]), outside, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(r))
  assert len(step.buckets) == 2


@pytest.mark.slow   # fresh processes (~2 s each)
def test_a_loop_without_host_sync_does_not_deadlock_xla_cpu():
  # XLA:CPU deadlocks (and aborts after 40 s) once ~32 steps with collectives are queued; the step
  # paces itself. 300 steps dispatched back to back, nothing read until the end, in a fresh process.
  import subprocess
  import sys
  import textwrap

  import multiproc
  code = textwrap.dedent("""
      import jax.numpy as jnp, numpy as np, optax, jaxring as jr
      @jr.train_step(compression=jr.codecs.int8())
      def step(state, batch):
          loss, grads = jr.value_and_grad(
              lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2))(state.params, batch)
          return state.apply_gradients(grads=grads), {"loss": loss}
      state = jr.TrainState.create(apply_fn=None, params={"w": jnp.zeros((16, 1))},
                                   tx=optax.sgd(0.1))
      x = np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32)
      batch = {"x": x, "y": x @ np.linspace(-1, 1, 16, dtype=np.float32)[:, None]}
      for _ in range(300):
          state, _ = step(state, batch)
      print("W", np.asarray(state.params["w"])[:3, 0].tolist())
      """)
  env = multiproc.clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=8")
  p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                     timeout=240)
  assert p.returncode == 0, p.stderr[-3000:]
  w = np.array(eval(p.stdout.split("W", 1)[1]))
  np.testing.assert_allclose(w, np.linspace(-1, 1, 16)[:3], atol=1e-3)


def test_batch_statistics_and_metrics_are_averaged_by_one_all_reduce():
  """Leaf by leaf, XLA:CPU ran the statistics' means as one all-reduce of many operands, which
  gloo reduced one after the other (docs/benchmarks.md, "Training on the emulated cluster")."""
  import re
  state = _init(CNN(axis_name=None))

  @jt.train_step(bucket_bytes=1 << 30)
  def step(state, batch):
    (loss, stats), grads = jt.value_and_grad(_loss_fn(state, batch), has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=stats), {"loss": loss, "n": 3}

  xs, ys = _data()
  batch = {"x": xs[0], "y": ys[0]}
  text = step.lower(state, batch).as_text()
  stats = sum(int(np.size(x)) for x in jax.tree.leaves(state.batch_stats))
  assert len(jax.tree.leaves(state.batch_stats)) == 4
  # the gradients' one bucket, then the statistics with the loss and the count: one all-reduce
  assert len(re.findall(r"stablehlo\.all_reduce", text)) == 2
  assert f"tensor<{stats + 2}xf32>" in text
  new, metrics = step(state, batch)
  assert float(metrics["n"]) == 3.0 and np.asarray(metrics["n"]).dtype == np.float32
  stats_of = jax.jit(lambda s, b: jax.value_and_grad(_loss_fn(s, b), has_aux=True)(s.params)[0][1])
  shards = [stats_of(state, {k: v.reshape(8, -1, *v.shape[1:])[r] for k, v in batch.items()})
            for r in range(8)]                    # each replica's statistics, then their mean
  want = jax.tree.map(lambda *x: np.mean(np.asarray(x, np.float64), 0), *shards)
  for got, ref in zip(jax.tree.leaves(new.batch_stats), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-6)
