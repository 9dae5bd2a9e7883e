"""What clients of the sharded step write (found by auditing client scripts): None leaves,
subtrees, perturbed parameters, states created in place, and the errors for what cannot work."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxring
import jaxring.train as jt

from sharded_models import (_assert_trees_close, _data, _mlp_loss, _mlp_side_by_side, _mlp_state,
                            _mlp_step, _run)


@pytest.mark.slow   # steps side by side with the replicated step (~0.5 s each)
@pytest.mark.parametrize("shard", ["optimizer", "params"])
def test_a_parameter_tree_holding_none_trains_like_the_replicated_step(shard):
  """None in the parameters (a layer without a bias) is no leaf: it has no block and no dim."""
  def loss_fn(p, b):
    h = jnp.tanh(b["x"] @ p["w1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["out"]["w"], b["y"]).mean()

  def run(shard):
    @jt.train_step(shard=shard)
    def step(state, batch):
      loss, grads = jt.value_and_grad(loss_fn)(state.params, batch)
      return state.apply_gradients(grads=grads), {"loss": loss}
    rng = np.random.RandomState(0)
    params = {"b0": None, "w1": jnp.asarray(rng.randn(16, 24) * 0.3, jnp.float32),
              "out": {"b": None, "w": jnp.asarray(rng.randn(24, 8) * 0.3, jnp.float32)}}
    state = jt.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))
    return _run(step, state, _data(3, shape=(16,), classes=8))[0]
  want, got = run("none"), run(shard)
  assert got.params["b0"] is None and got.params["out"]["b"] is None
  _assert_trees_close((got.params, got.opt_state), (want.params, want.opt_state))


@pytest.mark.slow   # steps side by side with the replicated step (~0.5 s each)
@pytest.mark.parametrize("shard", ["optimizer", "params"])
def test_a_subtree_of_the_parameters_is_differentiated_and_updated_like_replicated(shard):
  """optax.lookahead as optax documents it: gradients of ``state.params.fast``, updates for the
  whole ``LookaheadParams`` (the subtree is recognised by its blocks)."""
  def loss_fn(p, b):
    return optax.softmax_cross_entropy_with_integer_labels(
        jnp.tanh(b["x"] @ p["w1"]) @ p["w2"], b["y"]).mean()

  def run(shard):
    @jt.train_step(shard=shard)
    def step(state, batch):
      loss, grads = jt.value_and_grad(loss_fn)(state.params.fast, batch)
      return state.apply_gradients(grads=grads), {"loss": loss}
    rng = np.random.RandomState(0)
    params = optax.LookaheadParams.init_synced(
        {"w1": jnp.asarray(rng.randn(16, 24) * 0.3, jnp.float32),
         "w2": jnp.asarray(rng.randn(24, 8) * 0.3, jnp.float32)})
    tx = optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)
    state = jt.TrainState.create(apply_fn=None, params=params, tx=tx)
    return _run(step, state, _data(4, shape=(16,), classes=8))[0]
  want, got = run("none"), run(shard)
  _assert_trees_close((got.params, got.opt_state), (want.params, want.opt_state))


@pytest.mark.slow   # compiles the creation under several shardings (~1.5 s)
def test_a_sharded_state_is_created_in_place_from_its_shardings():
  """jit(create, out_shardings=step.state_shardings(eval_shape(create))): each device creates
  only its blocks, and the step trains from it like from a prepared whole state."""
  step = _mlp_step(shard="params")

  def create():
    return _mlp_state(optax.adam(1e-2))
  abstract = jax.eval_shape(create)
  state = jax.jit(create, out_shardings=step.state_shardings(abstract))()
  kernel = state.params["Dense_0"]["kernel"]
  assert kernel.addressable_shards[0].data.shape == (16, 64 // 8)
  assert state.opt_state[0].mu["Dense_0"]["kernel"].addressable_shards[0].data.shape == (16, 8)
  batches = _data(2, shape=(16,), classes=8)
  got, _ = _run(step, state, batches)
  want, _ = _run(step, create(), batches)
  _assert_trees_close((got.params, got.opt_state), (want.params, want.opt_state), rtol=0, atol=0)


def _perturbed_step(shard):
  """SAM's ascent step (the gradient at parameters moved along their sign): the loss and
  gradient are taken at other values than the state's."""
  @jt.train_step(shard=shard)
  def step(state, batch):
    moved = jax.tree.map(lambda p: p + 0.05 * jnp.sign(p), state.params)
    loss, grads = jt.value_and_grad(_mlp_loss(state, batch))(moved)
    return state.apply_gradients(grads=grads), {"loss": loss}
  return step


@pytest.mark.parametrize("shard", [pytest.param("optimizer", marks=pytest.mark.slow),  # ~0.5 s
                                   "params"])
def test_the_gradient_is_taken_at_the_parameters_the_step_passes(shard):
  (want_state, want), (got_state, got) = _mlp_side_by_side(_perturbed_step, shard, 3)
  np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-5)
  _assert_trees_close(got_state.params, want_state.params)
  if shard == "optimizer":  # the state's own blocks are not gathered, other values are
    batch = _data(1, shape=(16,), classes=8)[0]
    plain, moved = (step.lower(_mlp_state(optax.sgd(0.1)), batch).as_text().count(
        "stablehlo.all_gather") for step in (_mlp_step(shard=shard), _perturbed_step(shard)))
    assert moved > plain


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match="shard must be one of"):
    jt.train_step(shard="zero3")
  with pytest.raises(ValueError, match="compression\\['params'\\]"):
    jt.train_step(shard="optimizer", compression={"params": jaxring.codecs.int8()})
  with pytest.raises(ValueError, match="compression\\['params'\\]"):
    jt.train_step(compression={"params": jaxring.codecs.int8()})
  with pytest.raises(TypeError, match="compression must be"):
    jt.train_step(shard="params", compression={"grads": "int8"})
  with pytest.raises(ValueError, match="momentum"):
    jt.train_step(shard="params", momentum=0.9)
  with pytest.raises(ValueError, match="hpz=True .* shard='params'"):
    jt.train_step(shard="optimizer", axis_name=("node", "local"), hpz=True)
  with pytest.raises(ValueError, match="hierarchical axis_name"):
    jt.train_step(shard="params", hpz=True)


@pytest.mark.parametrize("shard", ["optimizer", "params"])
def test_returning_whole_parameters_into_the_state_is_refused(shard):
  """A max-norm constraint written on full_params and put back: whole leaves where the state
  holds blocks would corrupt the next step, so the step says so."""
  @jt.train_step(shard=shard)
  def step(state, batch):
    _, grads = jt.value_and_grad(_mlp_loss(state, batch))(state.params)
    state = state.apply_gradients(grads=grads)
    return state.replace(params=jt.full_params(state.params)), {}
  with pytest.raises(ValueError, match=r"returned parameter .*Dense_0.*block of it is"):
    step(_mlp_state(optax.sgd(0.1)), _data(1, shape=(16,), classes=8)[0])


def test_differentiating_something_else_than_the_params_is_refused():
  @jt.train_step(shard="params")
  def step(state, batch):
    def loss_fn(tree):
      logits = state.apply_fn({"params": tree["p"]}, batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    # other values than the state's blocks, in another structure: nothing says how they split
    loss, grads = jt.value_and_grad(loss_fn)({"p": jax.tree.map(lambda x: x * 2, state.params)})
    return state.apply_gradients(grads=grads["p"]), {"loss": loss}
  with pytest.raises(ValueError, match="with respect to state.params"):
    step(_mlp_state(optax.sgd(0.1)), _data(1, shape=(16,), classes=8)[0])
