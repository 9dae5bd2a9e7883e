"""A state trained with error feedback still works with Flax's ImageNet-example idioms.

The residuals are per replica while the rest of the state is replicated: evaluation with
``jax.pmap(eval_step, in_axes=(None, 0))``, ``flax.jax_utils.replicate``, a ``jax.jit`` of the
state, the example's ``TrainState`` subclass and its checkpoint idioms must keep working, and no
checkpoint path may lose the residuals without saying so. Expected values come from plain jax on
one device.
"""
import warnings
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import jax_utils
from flax import linen as nn
from flax.training import checkpoints, train_state
from jax import lax

import jaxring
import jaxring.train as jt

INT8 = jaxring.codecs.int8(block_size=4)


class Net(nn.Module):
  @nn.compact
  def __call__(self, x, train=True):
    x = nn.Dense(8)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name="data")(x)
    return nn.Dense(3)(nn.relu(x))


NET = Net()
VARIABLES = NET.init(jax.random.PRNGKey(0), jnp.zeros((2, 5)), train=False)
RNG = np.random.RandomState(0)
BATCH = {"image": RNG.randn(16, 5).astype(np.float32),
         "label": RNG.randint(0, 3, 16).astype(np.int32)}


class ExampleState(jt.TrainState):
  """Flax's ImageNet example's ``TrainState``, rebased onto jaxring's: fields without defaults."""
  batch_stats: Any
  dynamic_scale: Any


class OwnState(train_state.TrainState):
  """A user's own Flax state given residuals with the one line jaxring.TrainState documents."""
  batch_stats: Any
  residuals: Any = flax.struct.field(pytree_node=False, default=None, kw_only=True)


def _create(cls, **extra):
  return cls.create(apply_fn=NET.apply, params=VARIABLES["params"], tx=optax.sgd(0.1),
                    batch_stats=VARIABLES["batch_stats"], **extra)


def _train_step(**kwargs):
  @jt.train_step(compression=INT8, **kwargs)
  def step(state, batch):
    def loss_fn(params):
      logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                       batch["image"], mutable=["batch_stats"])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
      return loss, updates["batch_stats"]
    (loss, stats), grads = jt.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=stats), {"loss": loss}
  return step


def eval_step(state, batch):
  """The example's eval step: metrics averaged over the pmapped axis."""
  logits = state.apply_fn({"params": state.params, "batch_stats": state.batch_stats},
                          batch["image"], train=False, mutable=False)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return lax.pmean({"loss": loss, "logits_sum": jnp.sum(logits)}, "batch")


def _expected_eval(state):
  """One device, the whole batch, the state's arrays as NumPy: no pmap, no jaxring."""
  variables = jax.device_get({"params": state.params, "batch_stats": state.batch_stats})
  logits = NET.apply(variables, BATCH["image"], train=False)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, BATCH["label"]).mean()
  return {"loss": float(loss), "logits_sum": float(jnp.sum(logits)) / 8}


def _per_device(batch):
  return jax.tree_util.tree_map(lambda x: x.reshape((8, -1) + x.shape[1:]), batch)


@pytest.fixture(scope="module")
def trained():
  step = _train_step(donate=False)
  state = _create(ExampleState, dynamic_scale=None)
  for _ in range(2):
    state, _ = step(state, BATCH)
  return step, state


def test_the_example_state_rebased_onto_jaxring_trains_with_residuals(trained):
  _, state = trained
  residuals = jax.tree_util.tree_leaves(jax.device_get(state.residuals))
  params = jax.tree_util.tree_leaves(state.params)
  assert [r.shape for r in residuals] == [(8,) + p.shape for p in params]
  assert any(np.abs(r).max() > 0 for r in residuals)  # int8 left something out


@pytest.mark.parametrize("how", ["in_axes_none", pytest.param("replicate", marks=pytest.mark.slow)])
def test_pmap_evaluation_of_the_trained_state(trained, how):
  _, state = trained
  batch = _per_device(BATCH)
  if how == "in_axes_none":
    got = jax.pmap(eval_step, axis_name="batch", in_axes=(None, 0))(state, batch)
  else:
    got = jax.pmap(eval_step, axis_name="batch")(jax_utils.replicate(state), batch)
  for k, want in _expected_eval(state).items():
    np.testing.assert_allclose(np.asarray(got[k]), np.full(8, want), rtol=1e-5, atol=1e-5)


def test_a_jitted_evaluation_compiles_once_across_steps():
  step = _train_step(donate=False)
  state = _create(jt.TrainState)
  traces = []

  @jax.jit
  def logits_sum(state, x):
    traces.append(1)
    return jnp.sum(state.apply_fn(state.variables(), x, train=False))

  for _ in range(3):
    state, _ = step(state, BATCH)
    got = float(logits_sum(state, BATCH["image"]))
    np.testing.assert_allclose(got, 8 * _expected_eval(state)["logits_sum"], rtol=1e-5)
  assert len(traces) == 1


def test_the_one_line_residuals_field_on_a_users_own_flax_state():
  step = _train_step(donate=False)
  state = _create(OwnState)
  state, _ = step(state, BATCH)
  residuals = jax.tree_util.tree_leaves(jax.device_get(state.residuals))
  assert residuals and any(np.abs(r).max() > 0 for r in residuals)
  got = jax.pmap(eval_step, axis_name="batch", in_axes=(None, 0))(state, _per_device(BATCH))
  np.testing.assert_allclose(np.asarray(got["loss"]), np.full(8, _expected_eval(state)["loss"]),
                             rtol=1e-5)


@pytest.mark.slow   # saves and restores (~0.7 s)
def test_jaxring_checkpointer_keeps_every_replicas_residuals(trained, tmp_path):
  step, state = trained
  want = [np.asarray(r) for r in jax.tree_util.tree_leaves(state.residuals)]
  with jt.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(state)
    restored, _ = ckpt.restore(step.prepare(_create(ExampleState, dynamic_scale=None)))
  got = [np.asarray(r) for r in jax.tree_util.tree_leaves(restored.residuals)]
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # nothing was lost: no warning
    step(restored, BATCH)


@pytest.mark.parametrize("idiom", ["flax",
                                   pytest.param("orbax_util", marks=pytest.mark.slow)])  # ~0.5 s
def test_a_checkpoint_without_the_residuals_is_restored_loudly(trained, tmp_path, idiom):
  """Flax's checkpoint idioms save the state's leaves: the per-replica residuals are not among
  them, the rest restores intact, and the next train step says what was lost."""
  step, state = trained
  saved = state
  if idiom == "orbax_util":  # the example's multi-host idiom for pmap-replicated states
    saved = jax.tree_util.tree_map(ocp.utils.fully_replicated_host_local_array_to_global_array,
                                   state)
  checkpoints.save_checkpoint(tmp_path, saved, int(state.step))
  restored = checkpoints.restore_checkpoint(tmp_path, _create(ExampleState, dynamic_scale=None))
  for got, want in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.warns(UserWarning, match="residuals"):
    step(restored, BATCH)


def test_a_stale_state_from_a_jitted_function_fails_before_the_step():
  step = _train_step()  # donating: a consumed state's residuals are deleted
  state, _ = step(_create(jt.TrainState), BATCH)
  same = jax.jit(lambda s: s)
  state = same(state)  # traced once: the output carries these residuals
  state, _ = step(state, BATCH)
  with pytest.raises(RuntimeError, match="residuals"):
    step(same(state), BATCH)  # the cached trace hands back the consumed residuals
