"""The models, data and steps the sharded train-step tests share: a CNN with BatchNorm, an MLP,
a learnable generated task, and each run replicated and sharded on the same batches."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import jaxring.train as jt


BATCH = 32


class CNN(nn.Module):
  """Conv + BatchNorm + a 10-way head: split kernels, split (8,) and (16,), whole (10,) leaves."""

  @nn.compact
  def __call__(self, x, train=True):
    for width in (8, 16):
      x = nn.Conv(width, (3, 3), use_bias=False)(x)  # (a bias before BatchNorm has no gradient)
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
      x = nn.relu(x)
    return nn.Dense(10)(x.mean(axis=(1, 2)))


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(64)(x))
    x = nn.relu(nn.Dense(32)(x))
    return nn.Dense(8)(x)


def _data(steps, shape=(8, 8, 3), classes=10, seed=0):
  """Batches of a learnable task: the label is the argmax of a fixed linear map of the input."""
  rng = np.random.RandomState(seed)
  w = rng.randn(int(np.prod(shape)), classes)
  out = []
  for _ in range(steps):
    x = rng.randn(BATCH, *shape).astype(np.float32)
    out.append({"x": x, "y": np.argmax(x.reshape(BATCH, -1) @ w, axis=1).astype(np.int32)})
  return out


def _cnn_state(tx):
  model = CNN()
  v = model.init(jax.random.PRNGKey(0), jnp.zeros((2, 8, 8, 3)), train=False)
  return jt.TrainState.create(apply_fn=model.apply, params=v["params"],
                              batch_stats=v["batch_stats"], tx=tx)


def _mlp_state(tx, width_in=16):
  model = MLP()
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, width_in)))["params"]
  return jt.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def _cnn_step(**kw):
  @jt.train_step(**kw)
  def step(state, batch):
    def loss_fn(params):
      logits, upd = state.apply_fn(state.variables(params), batch["x"], mutable=["batch_stats"])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
      return loss, upd["batch_stats"]
    (loss, stats), grads = jt.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=stats), {"loss": loss}
  return step


def _mlp_loss(state, batch):
  """The MLP's cross entropy on ``batch`` as a function of its parameters."""
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  return loss_fn


def _mlp_step(**kw):
  @jt.train_step(**kw)
  def step(state, batch):
    loss, grads = jt.value_and_grad(_mlp_loss(state, batch))(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}
  return step


def _run(step, state, batches):
  with jax.numpy_dtype_promotion("standard"):  # optax's Adam bias correction: float ** int32
    for b in batches:
      state, metrics = step(state, b)
  return state, metrics


def _assert_trees_close(a, b, rtol=2e-5, atol=2e-6):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _mlp_side_by_side(make_step, shard: str, steps: int):
  """(state, metrics) of ``make_step("none")`` and of ``make_step(shard)`` after ``steps`` steps
  of SGD on the MLP, on the same batches."""
  batches = _data(steps, shape=(16,), classes=8)
  return tuple(_run(make_step(s), _mlp_state(optax.sgd(0.1)), batches) for s in ("none", shard))
