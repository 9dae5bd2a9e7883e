"""Sharded steps run any optax optimizer with a global view: reductions over split leaves are
finished by all-reduces, and `jr.train.whole` computes statistics of whole leaves from blocks."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxring.train as jt

from sharded_models import (_assert_trees_close, _cnn_state, _cnn_step, _data, _mlp_loss,
                            _mlp_side_by_side, _mlp_state, _mlp_step, _run)


WHOLE_LEAF_TXS = {  # optimizers that reduce over leaves or the tree: run with the global view
    # a trial update would not see this clip: 0 at step 0, then Adam's first step ignores scale
    "clip_by_global_norm+adamw": lambda: optax.chain(
        optax.clip_by_global_norm(0.2), optax.adamw(optax.linear_schedule(0.0, 3e-3, 2))),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.sgd(0.05), 2),
    "lamb": lambda: optax.lamb(3e-3),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),  # factored moments
    "sm3": lambda: optax.sm3(0.1),                   # one accumulator per dimension of a leaf
    "noisy_sgd": lambda: optax.noisy_sgd(0.01, key=jax.random.key(0)),  # noise drawn whole
}


# the quick loop keeps clip_by_global_norm+adamw on sharded parameters; each other case ~1-5 s
@pytest.mark.parametrize("tx", [t if t == "clip_by_global_norm+adamw" else pytest.param(
    t, marks=pytest.mark.slow) for t in sorted(WHOLE_LEAF_TXS)])
@pytest.mark.parametrize("shard", [pytest.param("optimizer", marks=pytest.mark.slow), "params"])
def test_an_optimizer_that_reduces_over_leaves_equals_the_replicated_step(shard, tx):
  batches = _data(4)
  want, _ = _run(_cnn_step(), _cnn_state(WHOLE_LEAF_TXS[tx]()), batches)
  state = _cnn_state(WHOLE_LEAF_TXS[tx]())
  got, metrics = _run(_cnn_step(shard=shard), state, batches)
  _assert_trees_close(got.params, want.params)
  _assert_trees_close(got.opt_state, want.opt_state)
  assert np.isfinite(float(metrics["loss"]))
  assert got.tx is state.tx   # the user's optimizer comes back
  kernel = got.params["Conv_1"]["kernel"]
  assert ("data" in str(kernel.sharding.spec)) == (shard == "params")


def _collectives(step, state, batch) -> tuple[int, int]:
  """(all-gathers compiled, all-reduces lowered) of the step."""
  lowered = step.lower(state, batch)
  return (lowered.compile().as_text().count(" all-gather("),
          lowered.as_text().count("stablehlo.all_reduce"))


@pytest.mark.slow   # lowers and compiles the sharded step (~2 s)
def test_global_norm_clipping_costs_one_scalar_all_reduce_and_gathers_nothing():
  batch = _data(1, shape=(16,), classes=8)[0]
  adamw = lambda: optax.adamw(1e-3)  # noqa: E731
  clip = lambda: optax.chain(optax.clip_by_global_norm(1.0), adamw())  # noqa: E731
  with jax.numpy_dtype_promotion("standard"):
    gathers, reduces = _collectives(_mlp_step(shard="params"), _mlp_state(adamw()), batch)
    got = _collectives(_mlp_step(shard="params"), _mlp_state(clip()), batch)
  # the MLP's 6 leaves: the split ones' squared sums are added up before one all-reduce
  assert got == (gathers, reduces + 1)


def _norm_step(shard):
  @jt.train_step(shard=shard)
  def step(state, batch):
    _, grads = jt.value_and_grad(_mlp_loss(state, batch))(state.params)
    unit = jt.whole(lambda g: jax.tree.map(lambda x: x / optax.tree.norm(g), g))(grads)
    return state.apply_gradients(grads=unit), {
        "norm": jt.whole(optax.tree.norm)(grads), "of_blocks": optax.tree.norm(grads),
        "unit": jt.whole(optax.tree.norm)(unit),
        "layer": jt.whole(optax.tree.norm)(grads["Dense_0"]),            # a subtree
        "kernel": jt.whole(jnp.linalg.norm)(grads["Dense_1"]["kernel"]),  # a leaf
        "param": jt.whole(jnp.max)(state.params["Dense_1"]["kernel"])}
  return step


@pytest.mark.slow   # steps side by side with the replicated step (~1.5 s each)
@pytest.mark.parametrize("shard", ["optimizer", "params"])
def test_whole_computes_a_metric_of_the_whole_gradient_from_the_blocks(shard):
  (want_state, want), (got_state, got) = _mlp_side_by_side(_norm_step, shard, 2)
  for k in ("norm", "layer", "kernel", "param"):
    np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=1e-5, err_msg=k)
  np.testing.assert_allclose(float(got["unit"]), 1.0, rtol=1e-5)  # blocks came back as blocks
  _assert_trees_close(got_state.params, want_state.params)
  if shard == "params":   # optax.tree.norm of the blocks is not the gradient's norm
    assert float(got["of_blocks"]) < 0.8 * float(want["norm"])


def test_the_global_view_evaluates_any_update_on_blocks_like_the_whole():
  """Reductions over and along the split dimension, lazy broadcasts, cumulative sums, a branch,
  and what it cannot split (a matmul, a reshape): gathered, with a warning."""
  from jaxring._src.train import global_view as gv

  def update(g, state, params=None):
    w = g["w"]                                           # (16, 24): split along the 24
    row = jnp.max(w, axis=1, keepdims=True)              # reduced across replicas
    soft = jnp.exp(w - row) / jnp.sum(jnp.exp(w - row), axis=1, keepdims=True)
    col = jnp.cumsum(w, axis=0) + jnp.zeros_like(w) + jnp.mean(w, axis=0)  # stays split
    branch = jax.lax.cond(state["n"] > 0, lambda: soft * 2.0, lambda: soft)
    gram = (w @ w.T).sum() * jnp.ones_like(w)            # a matmul: needs the whole leaf
    flat = jnp.reshape(w, (-1,))[::-1].reshape(w.shape)  # a reshape: the same
    out = {"w": soft + col + branch + gram * 1e-3 + flat, "b": g["b"] / jnp.linalg.norm(g["b"])}
    return out, {"n": state["n"] + 1, "m": state["m"] + jnp.abs(w).max(axis=0)}

  tx = optax.GradientTransformation(lambda p: None, update)
  mesh = Mesh(np.asarray(jax.devices()), ("data",))
  params = {"w": jnp.asarray(np.random.RandomState(0).randn(16, 24), jnp.float32),
            "b": jnp.asarray(np.random.RandomState(1).randn(10), jnp.float32)}
  state = {"n": jnp.int32(1), "m": jnp.zeros((24,))}
  P = jax.sharding.PartitionSpec
  pspecs, ospecs = {"w": P(None, "data"), "b": P()}, {"n": P(), "m": P("data")}
  view = gv.global_view(tx, ("data",), 8, [None, 1], jax.tree.structure(params), [0, None],
                        jax.tree.structure(state))
  blocks = jax.jit(jax.shard_map(lambda g, s: view.update(g, s), mesh=mesh,
                                 in_specs=(pspecs, ospecs), out_specs=(pspecs, ospecs),
                                 check_vma=False))
  with pytest.warns(UserWarning, match="dot_general.*need the whole leaves"):
    got = blocks(params, state)
  want = update(params, state)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=1e-5)
  assert got[1]["m"].sharding.spec == P("data")


def test_extra_update_arguments_split_like_the_parameters_or_passed_as_they_are():
  """``tx.update(..., grad=<like params>, scale_fn=<callable>, value=<scalar>)``: the tree like
  the parameters is split like them, the callable is not traced (optax.lbfgs's ``value_fn``)."""
  from jaxring._src.train import global_view as gv

  def update(u, state, params=None, *, grad, scale_fn, value):
    return jax.tree.map(lambda g: -scale_fn(value) * jnp.sum(g, axis=1, keepdims=True) + g,
                        grad), state

  tx = optax.GradientTransformationExtraArgs(lambda p: (), update)
  mesh = Mesh(np.asarray(jax.devices()), ("data",))
  g = {"w": jnp.asarray(np.random.RandomState(0).randn(16, 24), jnp.float32)}
  P = jax.sharding.PartitionSpec
  view = gv.global_view(tx, ("data",), 8, [1], jax.tree.structure(g), [], jax.tree.structure(()))
  got = jax.jit(jax.shard_map(
      lambda x: view.update(x, (), grad=x, scale_fn=lambda v: v * 2.0, value=jnp.float32(0.5))[0],
      mesh=mesh, in_specs=({"w": P(None, "data")},), out_specs={"w": P(None, "data")},
      check_vma=False))(g)
  want = update(g, (), grad=g, scale_fn=lambda v: v * 2.0, value=0.5)[0]
  np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(want["w"]), rtol=1e-5, atol=1e-5)
