"""Flax NNX with a sharded state: shard="optimizer" (ZeRO) and shard="params" (FSDP, and hpZ
on a (node, local) mesh) equal the single-device nnx.jit step on the global batch, with an
optimizer that reduces over every leaf (global-norm clipping) and Adam's moments split."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh

import jaxring as jr


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(8, 16, rngs=rngs)
    self.l2 = nnx.Linear(16, 8, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.relu(self.l1(x)))


def loss_fn(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def run(value_and_grad, decorate, steps=3):
  model = MLP(nnx.Rngs(0))
  tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(3e-3))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  def step(model, optimizer, batch):
    loss, grads = value_and_grad(loss_fn)(model, batch["x"], batch["y"])
    optimizer.update(model, grads)
    return {"loss": loss}

  step = decorate(step)
  rng = np.random.default_rng(0)
  losses = []
  with jax.numpy_dtype_promotion("standard"):   # optax's bias correction: float ** int32
    for _ in range(steps):
      b = {"x": rng.normal(size=(32, 8)).astype(np.float32),
           "y": rng.normal(size=(32, 8)).astype(np.float32)}
      losses.append(float(step(model, optimizer, b)["loss"]))
  return losses, model, optimizer


def hierarchical_mesh():
  return Mesh(np.asarray(jax.devices()).reshape(2, 4), ("node", "local"),
              axis_types=(AxisType.Auto,) * 2)


@pytest.mark.parametrize("kind", ["optimizer", "params", "params-hpz", "params-int8"])
def test_sharded_nnx_step_equals_the_single_device_step(kind):
  ref, m0, o0 = run(nnx.value_and_grad, nnx.jit)
  kw = {"shard": kind.split("-")[0]}
  if kind == "params-hpz":
    kw.update(mesh=hierarchical_mesh(), axis_name=("node", "local"), hpz=True)
  if kind == "params-int8":   # the parameters' all-gather compressed, the gradients exact
    kw.update(compression={"params": jr.codecs.int8(), "grads": None})
  got, m1, o1 = run(jr.value_and_grad, jr.train_step(**kw))
  tol = dict(rtol=2e-2, atol=2e-3) if kind == "params-int8" else dict(rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got, ref, **tol)
  for a, b in zip(jax.tree.leaves(nnx.state((m0, o0))), jax.tree.leaves(nnx.state((m1, o1)))):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), **tol)
  kernel = m1.l1.kernel.get_value()
  if kw["shard"] == "params":   # the parameters stay split in the model's Variables
    assert any(s is not None for s in kernel.sharding.spec), kernel.sharding
  mu = jax.tree.leaves(o1.opt_state)[1]
  assert any(s is not None for s in mu.sharding.spec), mu.sharding   # Adam's moments split
