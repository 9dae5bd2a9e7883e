"""jaxring.value_and_grad / grad and @train_step reject what jax rejects, with jax's own errors.

Every expected error is produced by jax itself on the same function, never written out by hand.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxring.train as jt

PARAMS = {"w": jnp.arange(4, dtype=jnp.float32)}
BATCH = {"x": np.arange(32, dtype=np.float32).reshape(8, 4)}


def _int_loss(params, x):
  return jnp.sum(params["w"] * x).astype(jnp.int32)


def _scalar_loss(params, x):
  return jnp.sum(params["w"] * x)


def _vector_loss(params, x):
  return params["w"] * x


def _complex_loss(params, x):
  return jnp.sum(params["w"] * x).astype(jnp.complex64)


def _jax_error(fun, **kwargs) -> TypeError:
  with pytest.raises(TypeError) as info:
    jax.value_and_grad(fun, **kwargs)(PARAMS, BATCH["x"][0])
  return info.value


def _run(fun, grad_fn, **kwargs):
  state = jt.TrainState.create(apply_fn=None, params=PARAMS, tx=optax.sgd(0.1))

  @jt.train_step(donate=False)
  def step(state, batch):
    out = grad_fn(fun, **kwargs)(state.params, batch["x"][0])
    grads = out[1] if grad_fn is jt.value_and_grad else out
    grads = grads[0] if kwargs.get("has_aux") and grad_fn is jt.grad else grads
    return state.apply_gradients(grads=grads), {}

  return step(state, BATCH)


@pytest.mark.parametrize("grad_fn", [jt.value_and_grad, jt.grad])
@pytest.mark.parametrize("fun", [_int_loss, _vector_loss, _complex_loss])
def test_a_loss_jax_cannot_differentiate_raises_jax_type_error(fun, grad_fn):
  # an int32 loss used to train silently with zero gradients
  want = _jax_error(fun)
  with pytest.raises(TypeError, match=re.escape(str(want))):
    _run(fun, grad_fn)


@pytest.mark.parametrize("grad_fn", [jt.value_and_grad, jt.grad])
def test_has_aux_with_a_scalar_output_raises_jax_type_error(grad_fn):
  want = str(_jax_error(_scalar_loss, has_aux=True))
  # jax's message ends with the value it got (a tracer of jax's own trace): compare up to there
  head = want[:want.index("but got")]
  assert head, want
  with pytest.raises(TypeError, match=re.escape(head)):
    _run(_scalar_loss, grad_fn, has_aux=True)


def test_outside_a_train_step_the_errors_are_jax_errors():
  want = _jax_error(_int_loss)
  with pytest.raises(TypeError, match=re.escape(str(want))):
    jt.value_and_grad(_int_loss)(PARAMS, BATCH["x"][0])


@pytest.mark.parametrize("bad, error", [("25MB", TypeError), (None, TypeError), (True, TypeError),
                                        (0, ValueError), (-1, ValueError),
                                        (float("nan"), ValueError)])
def test_a_bad_bucket_bytes_is_named_in_the_error(bad, error):
  with pytest.raises(error, match="bucket_bytes"):
    jt.train_step(bucket_bytes=bad)


def test_a_float_bucket_bytes_is_a_byte_count():
  step = jt.train_step(bucket_bytes=25e6)(lambda state, batch: (state, {}))
  assert step.config.bucket_bytes == 25_000_000


def test_auto_bucket_bytes_without_a_profile_buckets_as_the_default(tmp_path, monkeypatch):
  """bucket_bytes="auto" reaches the step (buckets.auto_bucket_bytes); with no measured profile
  it keeps the 25 MiB default, so the buckets are the default's."""
  monkeypatch.setenv("JAXRING_CACHE_DIR", str(tmp_path))  # an empty cache: no profile
  buckets = {}
  for size in ("auto", 25 << 20):
    step = jt.train_step(bucket_bytes=size, algorithm="ring")(
        lambda state, batch: (state.apply_gradients(grads=jt.value_and_grad(
            lambda p: jnp.mean((batch["x"] @ p["w"]) ** 2))(state.params)[1]), {}))
    assert step.config.bucket_bytes == size
    state = jt.TrainState.create(apply_fn=None, params={"w": jnp.ones((4, 2))},
                                 tx=optax.sgd(0.1))
    step(state, {"x": np.ones((16, 4), np.float32)})
    buckets[size] = [b.indices for b in step.buckets]
  assert buckets["auto"] == buckets[25 << 20]
  with pytest.raises(TypeError, match="or 'auto'"):
    jt.train_step(bucket_bytes="fast")


def _mse(params, batch):
  return jnp.mean((batch["x"] @ params["w"]) ** 2)


def _grad_step(reduce=None, shard="none"):
  @jt.train_step(donate=False, shard=shard)
  def step(state, batch):
    grads = jax.grad(_mse)(state.params, batch)   # jax's, not jaxring's
    if reduce is not None:
      grads = reduce(grads)
    return state.apply_gradients(grads=grads), {}
  return step


def _state():
  return jt.TrainState.create(apply_fn=None, params={"w": jnp.ones((4, 8))}, tx=optax.sgd(0.1))


def test_gradients_from_jax_grad_that_are_never_averaged_are_refused():
  # they are each replica's own: the replicas used to drift apart under a replicated sharding
  with pytest.raises(ValueError, match="never averaged over the replicas"):
    _grad_step()(_state(), BATCH)


def test_gradients_averaged_by_hand_with_lax_pmean_are_the_users_choice():
  got, _ = _grad_step(lambda g: jax.lax.pmean(g, "data"))(_state(), BATCH)

  @jt.train_step(donate=False)
  def step(state, batch):
    grads = jt.grad(_mse)(state.params, batch)
    return state.apply_gradients(grads=grads), {}
  want, _ = step(_state(), BATCH)
  np.testing.assert_allclose(np.asarray(got.params["w"]), np.asarray(want.params["w"]),
                             rtol=1e-6)


def test_a_step_that_leaves_the_parameters_alone_needs_no_gradients():
  @jt.train_step(donate=False)
  def evaluate(state, batch):
    return state, {"loss": _mse(state.params, batch)}
  _, metrics = evaluate(_state(), BATCH)
  want = np.mean((BATCH["x"] @ np.ones((4, 8))) ** 2)
  np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-6)


def test_jax_grad_on_the_blocks_of_a_fully_sharded_step_says_they_are_blocks():
  state = jt.TrainState.create(apply_fn=None, params={"w": jnp.ones((8, 4))}, tx=optax.sgd(0.1))
  with pytest.raises(TypeError) as info:   # x @ (one row of w): jax's shape error, and a note
    _grad_step(shard="params")(state, {"x": np.ones((8, 8), np.float32)})
  assert "this replica's blocks" in "".join(getattr(info.value, "__notes__", []))


@pytest.mark.parametrize("batch, named", [
    ({"x": np.ones((60, 4), np.float32)}, r"batch\['x'\] has shape \(60, 4\): 60 is not a multiple of 8"),
    ({"x": np.ones((8, 4), np.float32), "scale": 2.0}, r"batch\['scale'\] has shape \(\): a scalar"),
])
def test_a_batch_that_cannot_be_split_over_the_replicas_is_named(batch, named):
  @jt.train_step(donate=False)
  def step(state, batch):
    loss, grads = jt.value_and_grad(_mse)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": loss}
  with pytest.raises(ValueError, match=named):
    step(_state(), batch)


def test_arguments_after_the_batch_reach_every_replica_whole():
  # e.g. a dropout key: each replica folds in its own index, as under pmap(in_axes=(0, 0, None))
  @jt.train_step(donate=False)
  def step(state, batch, key, scale):
    def loss_fn(params):
      noise = jax.random.normal(jax.random.fold_in(key, jax.lax.axis_index("data")), (4, 8))
      return _mse({"w": params["w"] * scale + 0.0 * noise}, batch)
    loss, grads = jt.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss, "scale": scale}

  got, metrics = step(_state(), BATCH, jax.random.key(3), jnp.float32(2.0))
  x, w = BATCH["x"].astype(np.float64), np.ones((4, 8))
  grad = 2 * x.T @ (x @ (2 * w)) * 2 / (x.shape[0] * 8)   # d/dw mean((x @ 2w)^2)
  np.testing.assert_allclose(np.asarray(got.params["w"]), w - 0.1 * grad, rtol=1e-5)
  assert float(metrics["scale"]) == 2.0


@pytest.mark.parametrize("returns", ["state", "triple", "swapped"])
def test_a_step_that_does_not_return_state_and_metrics_is_named(returns):
  @jt.train_step(donate=False)
  def step(state, batch):
    loss, grads = jt.value_and_grad(_mse)(state.params, batch)
    new = state.apply_gradients(grads=grads)
    return {"state": new, "triple": (new, {}, loss), "swapped": ({"loss": loss}, new)}[returns]
  with pytest.raises(TypeError, match=r"must return \(state, metrics\)"):
    step(_state(), BATCH)
