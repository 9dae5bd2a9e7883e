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
