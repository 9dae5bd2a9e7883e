"""The functional train step, step(params, opt_state, batch) -> (params, opt_state, metrics), for
plain JAX + optax and Equinox; and the error naming the three forms when a step is called with
another form's arguments."""
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxring as jr
import jaxring.train as jt

TX = optax.sgd(0.1, momentum=0.9)   # adamw: b1 ** count trips strict dtype promotion


def batches(n=3, seed=0):
  rng = np.random.default_rng(seed)
  return [{"x": rng.normal(size=(32, 4)).astype(np.float32), "y": rng.integers(0, 3, 32)}
          for _ in range(n)]


def eqx_loss(model, b):
  logits = jax.vmap(model)(b["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()


def eqx_step(value_and_grad):
  def step(model, opt_state, b):
    loss, grads = value_and_grad(eqx_loss)(model, b)
    updates, opt_state = TX.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, {"loss": loss}
  return step


def test_equinox_step_equals_the_single_device_step():
  model = eqx.nn.MLP(4, 3, 16, 2, key=jax.random.key(0))
  ref, step = eqx.filter_jit(eqx_step(eqx.filter_value_and_grad)), jr.train_step()(
      eqx_step(jr.value_and_grad))
  m0 = m1 = model
  o0 = o1 = TX.init(eqx.filter(model, eqx.is_array))
  for b in batches():
    m0, o0, l0 = ref(m0, o0, b)
    m1, o1, l1 = step(m1, o1, b)
    np.testing.assert_allclose(l1["loss"], l0["loss"], rtol=1e-6)
  assert isinstance(m1, eqx.nn.MLP) and m1.activation is model.activation
  for a, b in zip(jax.tree.leaves(eqx.filter(m0, eqx.is_array)),
                  jax.tree.leaves(eqx.filter(m1, eqx.is_array))):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_plain_jax_step_with_int8_keeps_residuals_in_the_returned_opt_state():
  """Each replica's residual comes back in jaxring.train.OptState and is taken back on the next
  call: two steps give the TrainState step's bits, parameters and residuals."""
  params = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(4, 3)), jnp.float32),
            "b": jnp.zeros(3)}

  def loss_fn(p, b):
    return optax.softmax_cross_entropy_with_integer_labels(b["x"] @ p["w"] + p["b"], b["y"]).mean()

  @jr.train_step(compression=jr.codecs.int8(), algorithm="ring")
  def step(p, o, b):
    loss, g = jr.value_and_grad(loss_fn)(p, b)
    u, o = TX.update(g, o, p)
    return optax.apply_updates(p, u), o, loss

  p, o = params, TX.init(params)
  for b in batches(2):
    p, o, loss = step(p, o, b)
  assert isinstance(o, jt.OptState) and o.residuals["w"].shape == (8, 4, 3)
  assert float(jnp.abs(o.residuals["w"]).max()) > 0
  assert jax.tree.structure(o.inner) == jax.tree.structure(TX.init(params))
  # the reference: the TrainState step with the same codec (tests/test_train_compression.py
  # checks that one against lax and the residual rule)
  lin = jr.train_step(compression=jr.codecs.int8(), algorithm="ring")(
      lambda s, b: (s.apply_gradients(grads=jr.value_and_grad(loss_fn)(s.params, b)[1]), {}))
  s = jt.TrainState.create(apply_fn=None, params=params, tx=TX)
  for b in batches(2):
    s, _ = lin(s, b)
  for a, b in zip(jax.tree.leaves(s.params), jax.tree.leaves(p)):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))   # the TrainState step's bits
  for a, b in zip(jax.tree.leaves(s.residuals.tree), jax.tree.leaves(o.residuals)):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_value_and_grad_of_an_equinox_module_is_equinox_filter_value_and_grad():
  model = eqx.nn.MLP(4, 3, 8, 1, key=jax.random.key(2))
  b = batches(1)[0]
  (l1, g1), (l2, g2) = jr.value_and_grad(eqx_loss)(model, b), eqx.filter_value_and_grad(
      eqx_loss)(model, b)
  assert float(l1) == float(l2) and jax.tree.structure(g1) == jax.tree.structure(g2)
  for a, c in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_array_equal(a, c)


def test_a_step_called_with_another_forms_arguments_names_the_forms():
  model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  b = batches(1)[0]

  @jr.train_step()
  def linen_step(state, batch):
    return state, {}

  with pytest.raises(TypeError, match=r"NNX form.*def step\(model, optimizer, batch"):
    linen_step(model, optimizer, b)

  @jr.train_step()
  def nnx_step(model, optimizer, batch):
    return {}

  state = jt.TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=optax.sgd(0.1))
  with pytest.raises(TypeError, match=r"TrainState form.*missing a required argument"):
    nnx_step(state, b)
