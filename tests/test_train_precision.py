"""Mixed precision: bf16 compute with f32 parameters; fp16 loss scaling skips overflowed steps on
every replica alike."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxring.train as jt

N, D = 32, 16  # global batch 32: 4 examples per replica


def _loss(params, batch):
  pred = batch["x"] @ params["w"] + params["b"]
  return jnp.mean(jnp.square(pred - batch["y"]))


def _state(tx):
  rng = np.random.RandomState(0)
  params = {"w": jnp.asarray(rng.randn(D, 4).astype(np.float32) * 0.3),
            "b": jnp.zeros(4, jnp.float32)}
  return jt.TrainState.create(apply_fn=None, params=params, tx=tx)


def _batch(scale_replica=None, value=0.0):
  rng = np.random.RandomState(1)
  x = rng.randn(N, D).astype(np.float32) * 0.1
  if scale_replica is not None:
    x[4 * scale_replica:4 * scale_replica + 4] = value
  return {"x": x, "y": rng.randn(N, 4).astype(np.float32) * 0.1}


def _make_step(precision):
  @jt.train_step(precision=precision, bucket_bytes=64)
  def step(state, batch):
    loss, grads = jt.value_and_grad(_loss)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": loss}
  return step


def _per_replica(x):
  return [np.asarray(s.data) for s in x.addressable_shards]


def test_bf16_policy_computes_in_bf16_and_keeps_f32_params():
  batch = _batch()
  ref_loss, ref_grads = jax.value_and_grad(_loss)(_state(optax.sgd(1.0)).params, batch)
  step = _make_step("bf16")
  state = _state(optax.sgd(1.0))
  p0 = jax.tree.map(np.asarray, state.params)
  assert "xbf16>" in step.lower(state, batch).as_text()  # StableHLO: tensor<16x4xbf16>
  state, metrics = step(state, batch)
  assert state.params["w"].dtype == jnp.float32
  assert metrics["loss"].dtype == jnp.float32
  np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=2e-2)
  for k in p0:
    np.testing.assert_allclose(p0[k] - np.asarray(state.params[k]), ref_grads[k], rtol=5e-2,
                               atol=2e-3)


def test_fp16_overflow_on_one_replica_skips_the_step_on_all():
  step = _make_step("fp16")
  state = step.prepare(_state(optax.sgd(0.1, momentum=0.9)))
  scale0 = float(state.loss_scale.scale)
  before = jax.tree.map(np.asarray, (state.params, state.opt_state))

  # replica 3's examples overflow fp16 (x**2 sums past 65504); the others are tame
  state, metrics = step(state, _batch(scale_replica=3, value=300.0))
  assert float(metrics["grads_finite"]) == 0.0
  for got, want in zip(jax.tree.leaves((state.params, state.opt_state)), jax.tree.leaves(before)):
    for replica in _per_replica(got):
      np.testing.assert_array_equal(replica, want)  # skipped, on every replica
  assert [float(s) for s in _per_replica(state.loss_scale.scale)] == [scale0 / 2] * 8
  assert int(state.step) == 1

  batch = _batch()
  ref_grads = jax.grad(_loss)(jax.tree.map(jnp.asarray, before[0]), batch)
  state, metrics = step(state, batch)
  assert float(metrics["grads_finite"]) == 1.0
  for k in ("w", "b"):
    replicas = _per_replica(state.params[k])
    for r in replicas[1:]:
      np.testing.assert_array_equal(r, replicas[0])
    # sgd with momentum, first real update: -0.1 * grad (fp16 compute: loose tolerance)
    np.testing.assert_allclose(before[0][k] - replicas[0], 0.1 * np.asarray(ref_grads[k]),
                               rtol=5e-2, atol=1e-4)
  assert float(state.loss_scale.scale) == scale0 / 2
  assert int(state.loss_scale.good_steps) == 1


def test_dynamic_loss_scale_grows_after_a_calm_period():
  s = jt.DynamicLossScale.create(initial_scale=8.0, growth_interval=2)
  s = s.adjust(jnp.array(True))
  assert (float(s.scale), int(s.good_steps)) == (8.0, 1)
  s = s.adjust(jnp.array(True))
  assert (float(s.scale), int(s.good_steps)) == (16.0, 0)
  s = s.adjust(jnp.array(False))
  assert (float(s.scale), int(s.good_steps)) == (8.0, 0)
