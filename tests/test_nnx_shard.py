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


def test_lower_and_memory_take_the_nnx_objects():
  """step.lower(model, optimizer, batch) and step.memory(...) as the step is called: the HLO
  holds the int8 ring's reduction; the memory report splits Adam's moments with shard=optimizer."""
  model = MLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)

  @jr.train_step(compression=jr.codecs.int8(), algorithm="ring", shard="optimizer")
  def step(model, optimizer, batch):
    loss, grads = jr.value_and_grad(loss_fn)(model, batch["x"], batch["y"])
    optimizer.update(model, grads)
    return {"loss": loss}

  batch = {"x": np.ones((16, 8), np.float32), "y": np.zeros((16, 8), np.float32)}
  hlo = step.lower(model, optimizer, batch).as_text()
  assert "collective-permute" in hlo or "jaxring" in hlo
  report = step.memory(model, optimizer, batch)
  assert report["opt_state"] > 0
  step(model, optimizer, batch)   # and the step still runs on the objects
  assert optimizer.residuals["l1"]["kernel"].shape == (8, 8, 16)


def test_a_module_holding_a_plain_list_trains():
  """A static list attribute makes the graph definition unhashable; the step still runs, and
  compiles once."""
  class Tagged(MLP):
    def __init__(self, rngs):
      super().__init__(rngs)
      self.tags = ["l1", "l2"]

  model = Tagged(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  traces = []

  @jr.train_step()
  def step(model, optimizer, batch):
    traces.append(1)
    loss, grads = jr.value_and_grad(loss_fn)(model, batch["x"], batch["y"])
    optimizer.update(model, grads)
    return loss

  batch = {"x": np.ones((16, 8), np.float32), "y": np.zeros((16, 8), np.float32)}
  losses = [float(step(model, optimizer, batch)) for _ in range(3)]
  assert losses[2] < losses[0] and len(traces) == 1


def test_the_split_form_of_flaxs_performance_guide():
  """step(graphdef, state, batch) -> (state, metrics): nnx.merge at its top, nnx.split at its
  end, as Flax's performance guide writes a step; equal to the in-place form bit for bit, the
  residuals in the returned state."""
  def make():
    model = MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)

  deco = jr.train_step(compression=jr.codecs.int8(), algorithm="ring")

  @deco
  def split_step(graphdef, state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = jr.value_and_grad(loss_fn)(model, batch["x"], batch["y"])
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), {"loss": loss}

  @deco
  def in_place(model, optimizer, batch):
    loss, grads = jr.value_and_grad(loss_fn)(model, batch["x"], batch["y"])
    optimizer.update(model, grads)
    return {"loss": loss}

  graphdef, state = nnx.split(make())
  model, optimizer = make()
  rng = np.random.default_rng(3)
  for _ in range(3):
    b = {"x": rng.normal(size=(32, 8)).astype(np.float32),
         "y": rng.normal(size=(32, 8)).astype(np.float32)}
    state, m1 = split_step(graphdef, state, b)
    m2 = in_place(model, optimizer, b)
    assert float(m1["loss"]) == float(m2["loss"])
  flat = dict(nnx.to_flat_state(state))
  want = dict(nnx.to_flat_state(nnx.state((model, optimizer))))
  assert flat.keys() == want.keys() and any("residuals" in k for k in flat)
  for k in want:
    np.testing.assert_array_equal(np.asarray(flat[k].get_value()), np.asarray(want[k].get_value()))
