"""Compressed reduction inside the backward pass keeps error feedback exact: nothing is lost."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.sharding import AxisType, Mesh

import jaxring
import jaxring.train as jt
from jaxring._src.train.grad import momentum_parts


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Dense(64)(x))
    x = jnp.tanh(nn.Dense(48)(x))
    return nn.Dense(10)(x)


def _loss(apply_fn, params, batch):
  logits = apply_fn({"params": params}, batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _batches(n):
  rng = np.random.RandomState(0)
  return [{"x": rng.randn(32, 16).astype(np.float32),
           "y": rng.randint(0, 10, 32).astype(np.int32)} for _ in range(n)]


CONFIGS = {
    "int8-hierarchical": dict(mesh_shape=(2, 4), axis_name=("node", "local"),
                              algorithm="hierarchical",
                              compression={"node": jaxring.codecs.int8(block_size=64)}),
    "topk-ring": dict(mesh_shape=(8,), axis_name="data", algorithm="ring",
                      compression=jaxring.codecs.topk_chunks(density=0.25, chunk_size=64,
                                                             per_tensor=False)),
    "topk-per-tensor-ring": dict(mesh_shape=(8,), axis_name="data", algorithm="ring",
                                 compression=jaxring.codecs.topk_chunks(
                                     density=0.25, chunk_size=64)),
}


@pytest.mark.parametrize("per_tensor", [False, True], ids=["global", "per-tensor"])
def test_per_tensor_top_k_gives_a_bucket_tensor_of_small_gradients_its_share(per_tensor):
  """One step of plain SGD: a tensor whose gradients are 1000x smaller than its bucket
  neighbour's gets at least its share (5 of 100 chunks at 5%) per tensor, nothing globally."""
  mesh = Mesh(np.asarray(jax.devices()), ("data",), axis_types=(AxisType.Auto,))
  params = {"a_big": jnp.zeros(1600), "b_small": jnp.zeros(800)}
  state = jt.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(1.0))
  codec = jaxring.codecs.topk_chunks(0.05, chunk_size=8, per_tensor=per_tensor)

  @jt.train_step(mesh, algorithm="ring", compression=codec)
  def step(state, batch):
    loss, grads = jt.value_and_grad(lambda p: sum(
        jnp.sum(p[k] * batch[k].mean(0)) for k in p))(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  rng = np.random.RandomState(7)
  batch = {"a_big": rng.randn(8, 1600).astype(np.float32),
           "b_small": (rng.randn(8, 800) * 1e-3).astype(np.float32)}
  state, _ = step(step.prepare(state), batch)
  moved = {k: int((np.abs(np.asarray(v)).reshape(-1, 8).max(1) > 0).sum())
           for k, v in state.params.items()}
  assert moved["a_big"] + moved["b_small"] == codec.num_selected(2401)   # and the loss token
  assert (moved["b_small"] >= 5) if per_tensor else (moved["b_small"] == 0)


@pytest.mark.parametrize("name", [  # the quick loop keeps one (~0.5-1 s each)
    n if n == "topk-ring" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(CONFIGS)])
def test_applied_plus_residuals_equals_exact_mean_gradient(name):
  cfg = dict(CONFIGS[name])
  shape = cfg.pop("mesh_shape")
  axes = cfg["axis_name"] if isinstance(cfg["axis_name"], tuple) else (cfg["axis_name"],)
  mesh = Mesh(np.asarray(jax.devices()).reshape(shape), axes,
              axis_types=(AxisType.Auto,) * len(axes))
  model = MLP()
  p0 = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16)))["params"]
  state = jt.TrainState.create(apply_fn=model.apply, params=p0, tx=optax.sgd(1.0))

  @jt.train_step(mesh, bucket_bytes=8192, **cfg)
  def step(state, batch):
    loss, grads = jt.value_and_grad(lambda p: _loss(state.apply_fn, p, batch))(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  exact_grad = jax.jit(jax.grad(lambda p, b: _loss(model.apply, p, b)))
  params = jax.tree.map(np.asarray, p0)
  exact_sum = jax.tree.map(np.zeros_like, params)
  applied_sum = jax.tree.map(np.zeros_like, params)
  for batch in _batches(2):
    g = jax.tree.map(np.asarray, exact_grad(params, batch))  # single device, global batch
    exact_sum = jax.tree.map(np.add, exact_sum, g)
    state, _ = step(state, batch)
    new = jax.tree.map(np.asarray, state.params)
    applied_sum = jax.tree.map(lambda s, a, b: s + (a - b), applied_sum, params, new)
    params = new
  residuals = jax.tree.map(np.asarray, state.residuals)
  assert len(step.buckets) > 1
  lossy = False
  for a, r, e in zip(jax.tree.leaves(applied_sum), jax.tree.leaves(residuals),
                     jax.tree.leaves(exact_sum)):
    assert r.shape == (8,) + e.shape  # one residual per replica
    # sum of applied updates + mean residual == sum of exact mean gradients
    np.testing.assert_allclose(a + r.mean(axis=0), e, atol=2e-5)
    lossy |= np.abs(a - e).max() > 1e-4
  assert lossy, "compression lost nothing: the test would not see a missing residual"
  assert any(np.abs(r[0] - r[1]).max() > 0 for r in jax.tree.leaves(residuals))


@pytest.mark.parametrize("nesterov", [False, pytest.param(True, marks=pytest.mark.slow)],  # ~0.7 s
                         ids=["heavy-ball", "nesterov"])
def test_momentum_in_the_step_gives_every_gradient_momentum_sgds_weight(nesterov):
  """train_step(momentum=m) with top-k: sum of applied updates + mean_i (r_i + c u_i) equals the
  sum of exact mean gradients / (1 - m) (c = m / (1 - m), Nesterov m^2 / (1 - m))."""
  m = 0.9
  mesh = Mesh(np.asarray(jax.devices()), ("data",), axis_types=(AxisType.Auto,))
  model = MLP()
  p0 = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16)))["params"]
  state = jt.TrainState.create(apply_fn=model.apply, params=p0, tx=optax.sgd(1.0))

  @jt.train_step(mesh, bucket_bytes=8192, algorithm="ring", momentum=m, nesterov=nesterov,
                 compression=jaxring.codecs.topk_chunks(density=0.25, chunk_size=64),
                 clip_norm=None)
  def step(state, batch):
    loss, grads = jt.value_and_grad(lambda p: _loss(state.apply_fn, p, batch))(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  exact_grad = jax.jit(jax.grad(lambda p, b: _loss(model.apply, p, b)))
  params = jax.tree.map(np.asarray, p0)
  exact_sum = jax.tree.map(np.zeros_like, params)
  applied_sum = jax.tree.map(np.zeros_like, params)
  for batch in _batches(3):
    g = jax.tree.map(np.asarray, exact_grad(params, batch))
    exact_sum = jax.tree.map(np.add, exact_sum, g)
    state, _ = step(state, batch)
    new = jax.tree.map(np.asarray, state.params)
    applied_sum = jax.tree.map(lambda s, a, b: s + (a - b), applied_sum, params, new)
    params = new
  c = (m * m if nesterov else m) / (1 - m)
  held = False
  for a, r, e in zip(jax.tree.leaves(applied_sum), jax.tree.leaves(state.residuals),
                     jax.tree.leaves(exact_sum)):
    r = np.asarray(r, np.float64)
    assert r.shape == (8, 2 * e.size + 1)   # per replica: residual, velocity, running norm
    res, vel = (np.stack([p[j] for p in (momentum_parts(x, e.size) for x in r)]) for j in (0, 1))
    pending = (res + c * vel).mean(0).reshape(e.shape)
    np.testing.assert_allclose(a + pending, e / (1 - m), atol=2e-4)
    held |= np.abs(pending).max() > 1e-3
  assert held


@pytest.mark.slow   # steps until the running norm settles (~0.5 s)
def test_momentum_step_clips_each_bucket_to_twice_its_running_norm():
  """clip_norm="auto" (the default) per bucket and replica, against float64: momentum SGD on
  the clipped local gradients (no codec: the mean is exact), and the running norm every leaf of
  the bucket keeps. Two buckets: tensors "a" and "b" together, "c" alone."""
  from jaxring._src.optim.momentum import AUTO_CLIP_DECAY, AUTO_CLIP_FACTOR
  mesh = Mesh(np.asarray(jax.devices()), ("data",), axis_types=(AxisType.Auto,))
  sizes = {"a": 256, "b": 128, "c": 512}
  buckets = (("a", "b"), ("c",))
  state = jt.TrainState.create(apply_fn=None, params={k: jnp.zeros(n) for k, n in sizes.items()},
                               tx=optax.sgd(1.0))

  @jt.train_step(mesh, algorithm="ring", momentum=0.9, bucket_bytes=4 * 384)
  def step(state, batch):   # replica i's gradient of tensor k is batch[k][i]
    loss, grads = jt.value_and_grad(lambda p: sum(
        jnp.sum(p[k] * batch[k].mean(0)) for k in p))(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  rng = np.random.RandomState(0)
  steps = 30
  data = {k: rng.randn(steps, 8, n) * (1 + rng.rand(1, 8, 1)) for k, n in sizes.items()}
  for k in data:   # a tensor's spike on one replica at a time
    data[k] *= np.where(rng.rand(steps, 8, 1) < 0.1, 30.0, 1.0)
  avg = {b: np.zeros(8) for b in buckets}
  vel = {k: np.zeros((8, n)) for k, n in sizes.items()}
  cut = 0
  for t in range(steps):
    before = jax.tree.map(np.asarray, state.params)
    state, _ = step(state, {k: data[k][t].astype(np.float32) for k in sizes})
    for b in buckets:
      norm = np.sqrt(sum(np.sum(data[k][t] ** 2, axis=1) for k in b))
      limit = np.where(avg[b] > 0, AUTO_CLIP_FACTOR * avg[b], np.inf)
      cut += int((norm > limit).sum())
      kept = np.minimum(norm, limit)
      avg[b] = np.where(avg[b] > 0, AUTO_CLIP_DECAY * avg[b] + (1 - AUTO_CLIP_DECAY) * kept, kept)
      for k in b:
        vel[k] = 0.9 * vel[k] + data[k][t] * np.minimum(1, limit / norm)[:, None]
        np.testing.assert_allclose(before[k] - np.asarray(state.params[k]), vel[k].mean(0),
                                   rtol=1e-4, atol=1e-4 * np.abs(vel[k]).max())
  assert cut >= 10   # the spikes were clipped
  for b in buckets:
    for k in b:
      leaf = np.asarray(state.residuals[k])
      np.testing.assert_allclose([momentum_parts(x, sizes[k])[2] for x in leaf], avg[b],
                                 rtol=1e-5)


def test_momentum_step_takes_auto_or_no_clipping():
  for bad in (5.0, "adaptive"):
    with pytest.raises(ValueError, match="clip_norm must be 'auto' or None"):
      jt.train_step(momentum=0.9, clip_norm=bad)


def test_momentum_in_the_step_refuses_a_second_momentum_and_topk_refuses_stateful_optimizers():
  model = MLP()
  p0 = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16)))["params"]
  topk = jaxring.codecs.topk_chunks(density=0.25, chunk_size=64)

  def make(**kw):
    @jt.train_step(bucket_bytes=8192, algorithm="ring", **kw)
    def step(state, batch):
      loss, grads = jt.value_and_grad(lambda p: _loss(state.apply_fn, p, batch))(state.params)
      return state.apply_gradients(grads=grads), {"loss": loss}
    return step

  for tx in (optax.sgd(0.1, momentum=0.9), optax.adam(1e-3)):
    state = jt.TrainState.create(apply_fn=model.apply, params=p0, tx=tx)
    with pytest.raises(ValueError, match=r"train_step\(compression=c, momentum=0.9"):
      make(compression=topk).prepare(state)
    with pytest.raises(ValueError, match="momentum-free"):
      make(compression=jaxring.codecs.int8(), momentum=0.9).prepare(state)
  make(compression=jaxring.codecs.int8()).prepare(
      jt.TrainState.create(apply_fn=model.apply, params=p0, tx=optax.adam(1e-3)))  # dense: fine


@pytest.mark.slow   # trains, saves and resumes (~8 s)
def test_topk_momentum_step_resumes_bit_for_bit_from_a_checkpoint(tmp_path):
  """The velocity travels with the residuals: a run resumed from jt.Checkpointer (orbax) at step 3
  ends exactly where the uninterrupted one does."""
  model = MLP()
  p0 = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16)))["params"]
  tx = optax.sgd(0.05)

  @jt.train_step(bucket_bytes=8192, algorithm="ring", momentum=0.9, nesterov=True,
                 compression=jaxring.codecs.topk_chunks(density=0.1, chunk_size=64))
  def step(state, batch):
    loss, grads = jt.value_and_grad(lambda p: _loss(state.apply_fn, p, batch))(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  def fresh():
    return jt.TrainState.create(apply_fn=model.apply, params=p0, tx=tx)

  def batches():
    rng = np.random.RandomState(0)
    data = {"x": rng.randn(96, 16).astype(np.float32),
            "y": rng.randint(0, 10, 96).astype(np.int32)}
    return jt.BatchIterator(data, batch_size=32, seed=1)

  straight = jt.fit(step, fresh(), batches(), num_steps=6, progress=False)
  first = jt.Checkpointer(tmp_path / "ckpt")
  jt.fit(step, fresh(), batches(), num_steps=3, checkpointer=first, checkpoint_every=3,
         progress=False)
  first.close()
  second = jt.Checkpointer(tmp_path / "ckpt")
  resumed = jt.fit(step, fresh(), batches(), num_steps=6, checkpointer=second, progress=False)
  second.close()

  def leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves((state.step, state.params, state.residuals))]
  for a, b in zip(leaves(straight), leaves(resumed), strict=True):
    np.testing.assert_array_equal(a, b)
  leaf = np.asarray(jax.tree.leaves(resumed.residuals)[0])
  size = (leaf.shape[1] - 1) // 2
  assert np.abs(leaf[:, size:2 * size]).max() > 0        # the velocity
  assert (leaf[:, 2 * size] > 0).all()                   # the running gradient norm


@pytest.mark.slow   # compiles a step on one device (~0.5 s)
def test_one_replica_with_a_codec_is_exact_and_keeps_its_placement(monkeypatch):
  """One device: nothing travels, so int8 must not perturb the gradient; and the state the step
  returns is used as is (no re-placement per call: on one GPU that doubled the step time)."""
  mesh = Mesh(np.asarray(jax.devices()[:1]), ("data",), axis_types=(AxisType.Auto,))
  model = MLP()
  p0 = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16)))["params"]
  tx = optax.sgd(0.5, momentum=0.9)

  @jt.train_step(mesh, bucket_bytes=4096, compression=jaxring.codecs.int8(block_size=64))
  def step(state, batch):
    loss, grads = jt.value_and_grad(lambda p: _loss(state.apply_fn, p, batch))(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  @jax.jit
  def plain(state, batch):
    grads = jax.grad(lambda p: _loss(state.apply_fn, p, batch))(state.params)
    return state.apply_gradients(grads=grads)

  state = jt.TrainState.create(apply_fn=model.apply, params=p0, tx=tx)
  ref = jt.TrainState.create(apply_fn=model.apply, params=p0, tx=tx)
  batches = _batches(3)
  state, _ = step(state, batches[0])
  prepared = []
  monkeypatch.setattr(type(step), "prepare",
                      lambda self, s, _orig=type(step).prepare: prepared.append(1) or _orig(self, s))
  for b in batches[1:]:
    state, _ = step(state, b)
  for b in batches:
    ref = plain(ref, b)
  assert not prepared, "the step re-placed a state it had returned itself"
  assert len(step.buckets) == 1  # one member: one bucket after backprop, nothing to overlap
  for a, e in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-6, atol=1e-7)
  assert all(not np.asarray(r).any() for r in jax.tree.leaves(state.residuals))
