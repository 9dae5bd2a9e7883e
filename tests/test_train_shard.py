"""train_step(shard="optimizer"|"params"): ZeRO-1/2 and FSDP equal the replicated step, split the
state, carry error feedback exactly, checkpoint sharded and refuse what they cannot do."""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.sharding import Mesh

import jaxring
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


TXS = {"sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
       "adamw": lambda: optax.adamw(3e-3, weight_decay=1e-2)}


@functools.lru_cache(maxsize=None)
def _replicated(tx: str, steps: int):
  """The replicated step's state after ``steps`` steps (shared by the tests that compare)."""
  state, _ = _run(_cnn_step(), _cnn_state(TXS[tx]()), _data(steps))
  return jax.device_get(state)


@pytest.mark.parametrize("tx", sorted(TXS))
@pytest.mark.parametrize("shard", ["optimizer", "params"])
def test_sharded_step_equals_the_replicated_step_after_10_steps(shard, tx):
  batches = _data(10)
  want = _replicated(tx, 10)
  got, metrics = _run(_cnn_step(shard=shard), _cnn_state(TXS[tx]()), batches)
  _assert_trees_close(got.params, want.params)
  _assert_trees_close(got.opt_state, want.opt_state)
  _assert_trees_close(got.batch_stats, want.batch_stats)
  assert np.isfinite(float(metrics["loss"]))
  # the state is split as documented: every leaf with a dimension 8 divides, along its largest
  kernel = got.params["Conv_1"]["kernel"]  # (3, 3, 8, 16): the 16
  split = jax.sharding.PartitionSpec(None, None, None, "data")
  assert kernel.shape == (3, 3, 8, 16)
  assert kernel.sharding.spec == (split if shard == "params" else jax.sharding.PartitionSpec())
  assert got.params["Dense_0"]["bias"].sharding.spec == jax.sharding.PartitionSpec()  # (10,)
  mu = jax.tree.leaves(got.opt_state)
  assert any(getattr(m, "sharding", None) is not None and "data" in str(m.sharding.spec)
             for m in mu)


def _frozen_head(params):
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "frozen" if "Dense_0" in jax.tree_util.keystr(path) else "train", params)


MASKED_TXS = {
    # MaskedNode stands in the moments for the parameters a transform does not own
    "multi_transform": lambda labels: optax.multi_transform(
        {"train": optax.adam(3e-3), "frozen": optax.set_to_zero()}, labels),
    "masked": lambda labels: optax.chain(
        optax.masked(optax.sgd(0.05, momentum=0.9),
                     jax.tree_util.tree_map(lambda l: l == "train", labels)),
        optax.masked(optax.sgd(0.01), jax.tree_util.tree_map(lambda l: l == "frozen", labels))),
}


@pytest.mark.parametrize("tx", sorted(MASKED_TXS))
@pytest.mark.parametrize("shard", ["optimizer", "params"])
def test_masked_optimizer_state_is_split_like_the_parameters_it_owns(shard, tx):
  labels = _frozen_head(_cnn_state(optax.sgd(0.1)).params)
  make = lambda: MASKED_TXS[tx](labels)  # noqa: E731
  batches = _data(4)
  want, _ = _run(_cnn_step(), _cnn_state(make()), batches)
  got, _ = _run(_cnn_step(shard=shard), _cnn_state(make()), batches)
  _assert_trees_close(got.params, want.params)
  _assert_trees_close(got.opt_state, want.opt_state)
  # the moment of the (3, 3, 8, 16) kernel is split; the frozen head kept its initial values
  split = [x for x in jax.tree.leaves(got.opt_state)
           if np.shape(x) == (3, 3, 8, 16) and "data" in str(x.sharding.spec)]
  assert split, "the optimizer state of a masked transform was not split"
  start = _cnn_state(make()).params["Dense_0"]
  if tx == "multi_transform":
    _assert_trees_close(got.params["Dense_0"], start, rtol=0, atol=0)


@pytest.mark.parametrize("hpz", [False, True], ids=["flat-blocks", "hpz"])
def test_hierarchical_mesh_with_a_ring_per_level_equals_the_replicated_step(hpz):
  mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("node", "local"))
  want = _replicated("sgd_momentum", 10)
  got, _ = _run(_cnn_step(mesh=mesh, axis_name=("node", "local"), shard="params",
                          algorithm="hierarchical", hpz=hpz),
                _cnn_state(TXS["sgd_momentum"]()), _data(10))
  _assert_trees_close(got.params, want.params)
  _assert_trees_close(got.opt_state, want.opt_state)
  spec = got.params["Conv_1"]["kernel"].sharding.spec[3]
  assert spec == (("local", "node") if hpz else ("node", "local"))  # hpZ: node-local pieces


def _per_replica_grads(state, batch, p):
  """float64 NumPy sums of each replica's own gradient (on its slice of the batch)."""
  def loss_fn(params, x, y):
    logits = state.apply_fn({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  params = jax.device_get(state.params)
  n = BATCH // p
  per = [jax.grad(loss_fn)(params, batch["x"][i * n:(i + 1) * n], batch["y"][i * n:(i + 1) * n])
         for i in range(p)]
  return jax.tree.map(lambda *g: np.sum([np.asarray(x, np.float64) for x in g], axis=0), *per)


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical", "hierarchical-hpz"])
def test_error_feedback_of_the_compressed_reduce_scatter_loses_nothing(algorithm):
  """With SGD(lr=1): p * (-update) + the sum of every replica's new residual equals the sum of
  the replicas' gradients, leaf by leaf (nothing lost, nothing counted twice)."""
  p = len(jax.devices())
  kw = dict(shard="params", algorithm=algorithm.split("-")[0],
            compression={"grads": jaxring.codecs.int8(block_size=32)})
  if algorithm.startswith("hierarchical"):
    kw.update(mesh=Mesh(np.asarray(jax.devices()).reshape(2, 4), ("node", "local")),
              axis_name=("node", "local"), hpz=algorithm.endswith("hpz"))
  step = _mlp_step(**kw)
  state = _mlp_state(optax.sgd(1.0))
  batch = _data(1, shape=(16,), classes=8)[0]
  before = jax.device_get(state.params)
  want = _per_replica_grads(state, batch, p)
  after, _ = step(state, batch)
  residuals = jax.device_get(after.residuals.tree)
  lost = 0.0
  for path, g in jax.tree_util.tree_flatten_with_path(want)[0]:
    old = np.asarray(_at(before, path), np.float64)
    new = np.asarray(_at(jax.device_get(after.params), path), np.float64)
    r = np.asarray(_at(residuals, path), np.float64)
    assert r.shape == (p,) + old.shape  # one full-shaped residual per replica
    np.testing.assert_allclose(p * (old - new) + r.sum(0), g, atol=2e-5, rtol=1e-5)
    lost = max(lost, np.abs(r).max())
  assert lost > 1e-6  # int8 did lose something, which the residuals hold


def _at(tree, path):
  for k in path:
    tree = tree[k.key]
  return tree


def test_compressed_parameters_and_gradients_train_like_uncompressed():
  batches = _data(30, shape=(16,), classes=8)
  plain, m_plain = _run(_mlp_step(shard="params"), _mlp_state(optax.sgd(0.1, momentum=0.9)),
                        batches)
  both = {"params": jaxring.codecs.int8(), "grads": jaxring.codecs.int8()}
  comp, m_comp = _run(_mlp_step(shard="params", algorithm="ring", compression=both),
                      _mlp_state(optax.sgd(0.1, momentum=0.9)), batches)
  first = float(_mlp_step(shard="params")(_mlp_state(optax.sgd(0.0)), batches[0])[1]["loss"])
  assert float(m_comp["loss"]) < 0.8 * first
  assert abs(float(m_comp["loss"]) - float(m_plain["loss"])) < 0.05 * float(m_plain["loss"])
  # the weights that travel quantized are not the master weights: those stay f32 and exact
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(comp.params))


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


@pytest.mark.parametrize("tx", sorted(WHOLE_LEAF_TXS))
@pytest.mark.parametrize("shard", ["optimizer", "params"])
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


def test_global_norm_clipping_costs_one_scalar_all_reduce_and_gathers_nothing():
  batch = _data(1, shape=(16,), classes=8)[0]
  adamw = lambda: optax.adamw(1e-3)  # noqa: E731
  clip = lambda: optax.chain(optax.clip_by_global_norm(1.0), adamw())  # noqa: E731
  with jax.numpy_dtype_promotion("standard"):
    gathers, reduces = _collectives(_mlp_step(shard="params"), _mlp_state(adamw()), batch)
    got = _collectives(_mlp_step(shard="params"), _mlp_state(clip()), batch)
  # the MLP's 6 leaves: the split ones' squared sums are added up before one all-reduce
  assert got == (gathers, reduces + 1)


def _mlp_side_by_side(make_step, shard: str, steps: int):
  """(state, metrics) of ``make_step("none")`` and of ``make_step(shard)`` after ``steps`` steps
  of SGD on the MLP, on the same batches."""
  batches = _data(steps, shape=(16,), classes=8)
  return tuple(_run(make_step(s), _mlp_state(optax.sgd(0.1)), batches) for s in ("none", shard))


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


@pytest.mark.parametrize("shard", ["optimizer", "params"])
def test_whole_computes_a_metric_of_the_whole_gradient_from_the_blocks(shard):
  (want_state, want), (got_state, got) = _mlp_side_by_side(_norm_step, shard, 2)
  for k in ("norm", "layer", "kernel", "param"):
    np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=1e-5, err_msg=k)
  np.testing.assert_allclose(float(got["unit"]), 1.0, rtol=1e-5)  # blocks came back as blocks
  _assert_trees_close(got_state.params, want_state.params)
  if shard == "params":   # optax.tree.norm of the blocks is not the gradient's norm
    assert float(got["of_blocks"]) < 0.8 * float(want["norm"])


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


@pytest.mark.parametrize("shard", ["optimizer", "params"])
def test_the_gradient_is_taken_at_the_parameters_the_step_passes(shard):
  (want_state, want), (got_state, got) = _mlp_side_by_side(_perturbed_step, shard, 3)
  np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-5)
  _assert_trees_close(got_state.params, want_state.params)
  if shard == "optimizer":  # the state's own blocks are not gathered, other values are
    batch = _data(1, shape=(16,), classes=8)[0]
    plain, moved = (step.lower(_mlp_state(optax.sgd(0.1)), batch).as_text().count(
        "stablehlo.all_gather") for step in (_mlp_step(shard=shard), _perturbed_step(shard)))
    assert moved > plain


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


def test_the_backward_pass_gathers_again_the_parameters_it_needs():
  """Rematerialization: with shard="params" the lowered program all-gathers each of the MLP's six
  split leaves for the forward pass and, in the backward pass, again the two kernels that
  backpropagation through a later layer reads (Dense_1's and Dense_2's; Dense_0's input needs no
  gradient, a bias is never read back). shard="optimizer" gathers only after the update."""
  batch = _data(1, shape=(16,), classes=8)[0]
  counts = {}
  for shard in ("params", "optimizer"):
    step = _mlp_step(shard=shard)
    counts[shard] = step.lower(_mlp_state(optax.sgd(0.1)), batch).as_text().count(
        "stablehlo.all_gather\"")
  assert counts["params"] == 6 + 2
  assert counts["optimizer"] == 6  # each updated block, once, after the update


def _gather_groups(text: str) -> dict:
  """How many all-gathers the lowered program has, by the shape of their replica groups."""
  import re
  shapes = re.findall(r'"stablehlo.all_gather"\(.*?replica_groups = dense<.*?> : tensor<(\w+)xi64>',
                      text)
  return {k: shapes.count(k) for k in set(shapes)}


def test_hpz_gathers_across_nodes_once_and_within_the_node_in_the_backward_pass():
  """2 nodes x 4: without hpZ every gather spans the 8 devices (6 forward + 2 backward, as
  above); with it the forward pass gathers each split leaf across the nodes (groups of 2) then
  within the node (groups of 4), and the backward pass only within the node again."""
  mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("node", "local"))
  batch = _data(1, shape=(16,), classes=8)[0]
  groups = {}
  for hpz in (False, True):
    step = _mlp_step(mesh=mesh, axis_name=("node", "local"), shard="params", hpz=hpz)
    groups[hpz] = _gather_groups(step.lower(_mlp_state(optax.sgd(0.1)), batch).as_text())
  assert groups[False] == {"1x8": 6 + 2}
  assert groups[True] == {"4x2": 6, "2x4": 6 + 2}


def test_hpz_with_int8_parameters_across_nodes_trains_like_uncompressed():
  mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("node", "local"))
  batches = _data(30, shape=(16,), classes=8)
  kw = dict(mesh=mesh, axis_name=("node", "local"), shard="params", algorithm="hierarchical")
  plain, m_plain = _run(_mlp_step(**kw), _mlp_state(optax.sgd(0.1, momentum=0.9)), batches)
  both = {"params": {"node": jaxring.codecs.int8()}, "grads": {"node": jaxring.codecs.int8()}}
  comp, m_comp = _run(_mlp_step(hpz=True, compression=both, **kw),
                      _mlp_state(optax.sgd(0.1, momentum=0.9)), batches)
  first = float(_mlp_step(**kw)(_mlp_state(optax.sgd(0.0)), batches[0])[1]["loss"])
  assert float(m_comp["loss"]) < 0.8 * first
  assert abs(float(m_comp["loss"]) - float(m_plain["loss"])) < 0.05 * float(m_plain["loss"])
  diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(jax.tree.leaves(comp.params), jax.tree.leaves(plain.params)))
  assert diff > 0  # the weights travelled quantized


def test_checkpoint_of_a_sharded_state_resumes_exactly_and_restores_on_fewer_devices(tmp_path):
  step = _mlp_step(shard="params", algorithm="ring",
                   compression={"grads": jaxring.codecs.int8(block_size=32)})
  batches = _data(5, shape=(16,), classes=8)
  state, _ = _run(step, _mlp_state(optax.adam(1e-2)), batches[:3])
  with jt.Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(state, step=3)
    ckpt.wait_until_finished()
  saved = jax.device_get((state.params, state.opt_state))
  saved_residuals = jax.device_get(state.residuals.tree)
  straight, _ = _run(step, state, batches[3:])  # (donates state)
  with jt.Checkpointer(tmp_path / "ckpt") as ckpt, jax.numpy_dtype_promotion("standard"):
    restored, _ = ckpt.restore(step.prepare(_mlp_state(optax.adam(1e-2))))
  assert "data" in str(restored.params["Dense_0"]["kernel"].sharding.spec)
  resumed, _ = _run(step, restored, batches[3:])
  for a, b in zip(jax.tree.leaves((straight.params, straight.opt_state, straight.residuals)),
                  jax.tree.leaves((resumed.params, resumed.opt_state, resumed.residuals))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # the same checkpoint on a 4-device mesh: parameters and optimizer state as saved, and each
  # replica's residual the mean of the 8 saved ones (what they add back to the mean is kept)
  small = Mesh(np.asarray(jax.devices()[:4]), ("data",))
  step4 = _mlp_step(mesh=small, shard="params", algorithm="ring",
                    compression={"grads": jaxring.codecs.int8(block_size=32)})
  with jt.Checkpointer(tmp_path / "ckpt") as ckpt, jax.numpy_dtype_promotion("standard"):
    on4, _ = ckpt.restore(step4.prepare(_mlp_state(optax.adam(1e-2))))
  assert on4.params["Dense_0"]["kernel"].sharding.mesh.devices.size == 4
  _assert_trees_close((on4.params, on4.opt_state), saved, rtol=0, atol=0)
  for r8, r4 in zip(jax.tree.leaves(saved_residuals), jax.tree.leaves(on4.residuals)):
    assert r4.shape == (4,) + r8.shape[1:]
    np.testing.assert_allclose(np.asarray(r4).sum(0) / 4, np.asarray(r8).sum(0) / 8, rtol=1e-6,
                               atol=1e-9)
  _run(step4, on4, batches[3:4])  # and it trains there


def test_an_hpz_checkpoint_restores_into_a_flat_step_and_back(tmp_path):
  """hpZ orders the blocks local-major (spec ("local", "node")); a checkpoint holds the global
  arrays, so a step without hpZ on a flat 8-device mesh restores them as saved, trains, and its
  checkpoint restores into the hpZ step again."""
  mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("node", "local"))
  hpz = _mlp_step(mesh=mesh, axis_name=("node", "local"), shard="params", hpz=True)
  flat = _mlp_step(shard="params")
  batches = _data(3, shape=(16,), classes=8)
  state, _ = _run(hpz, _mlp_state(optax.adam(1e-2)), batches[:2])
  assert state.params["Dense_0"]["kernel"].sharding.spec[1] == ("local", "node")
  saved = jax.device_get((state.params, state.opt_state))
  with jt.Checkpointer(tmp_path / "a") as ckpt:
    ckpt.save(state, step=2)
    ckpt.wait_until_finished()
  with jt.Checkpointer(tmp_path / "a") as ckpt, jax.numpy_dtype_promotion("standard"):
    on_flat, _ = ckpt.restore(flat.prepare(_mlp_state(optax.adam(1e-2))))
  assert on_flat.params["Dense_0"]["kernel"].sharding.spec[1] == "data"
  _assert_trees_close((on_flat.params, on_flat.opt_state), saved, rtol=0, atol=0)
  on_flat, _ = _run(flat, on_flat, batches[2:])
  trained = jax.device_get((on_flat.params, on_flat.opt_state))
  with jt.Checkpointer(tmp_path / "b") as ckpt:
    ckpt.save(on_flat, step=3)
    ckpt.wait_until_finished()
  with jt.Checkpointer(tmp_path / "b") as ckpt, jax.numpy_dtype_promotion("standard"):
    back, _ = ckpt.restore(hpz.prepare(_mlp_state(optax.adam(1e-2))))
  assert back.params["Dense_0"]["kernel"].sharding.spec[1] == ("local", "node")
  _assert_trees_close((back.params, back.opt_state), trained, rtol=0, atol=0)


@pytest.mark.parametrize("shard", ["optimizer", "params"])
def test_full_params_inside_the_step_is_the_whole_updated_model(shard):
  """A metric of the updated model computed in the step (jt.full_params gathers the blocks)
  is the replicated step's."""
  @jt.train_step(shard=shard)
  def step(state, batch):
    loss_fn = _mlp_loss(state, batch)
    _, grads = jt.value_and_grad(loss_fn)(state.params)
    state = state.apply_gradients(grads=grads)
    return state, {"after": loss_fn(jt.full_params(state.params))}
  batch = _data(1, shape=(16,), classes=8)[0]
  _, metrics = step(_mlp_state(optax.sgd(0.5)), batch)
  with jax.numpy_dtype_promotion("standard"):
    ref = _mlp_state(optax.sgd(0.5))
    grads = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
        ref.apply_fn({"params": p}, batch["x"]), batch["y"]).mean())(ref.params)
    new = ref.apply_gradients(grads=grads)
    want = optax.softmax_cross_entropy_with_integer_labels(
        new.apply_fn({"params": new.params}, batch["x"]), batch["y"]).mean()
  np.testing.assert_allclose(float(metrics["after"]), float(want), rtol=1e-5)
  assert jt.full_params({"a": 1}) == {"a": 1}  # outside a step: as it is


def test_fp16_loss_scaling_skips_the_same_steps_sharded():
  """precision="fp16": the sharded step's overflow check (on the reduce-scattered rows) agrees
  with the replicated one's, so both skip or apply the same steps and end equal."""
  batches = _data(4, shape=(16,), classes=8)
  batches[1] = dict(batches[1], x=batches[1]["x"] * 1e6)  # overflows fp16 in the backward pass
  out = {}
  for shard in ("none", "params"):
    state, metrics = _run(_mlp_step(shard=shard, precision="fp16"),
                          _mlp_state(optax.sgd(0.1)), batches)
    out[shard] = (state, metrics)
  _assert_trees_close(out["params"][0].params, out["none"][0].params, rtol=1e-3, atol=1e-5)
  assert float(out["params"][0].loss_scale.scale) == float(out["none"][0].loss_scale.scale)
  assert float(out["none"][0].loss_scale.scale) < 2.0 ** 15  # the overflow was seen


def test_bench_fsdp_memory_part_writes_its_table(tmp_path, capsys):
  from jaxring._src.tools.bench import fsdp
  assert fsdp.main(["--parts", "memory", "--width", "64", "--layers", "2", "--out-dir",
                    str(tmp_path)]) == 0
  [path] = tmp_path.glob("fsdp-*.json")
  rows = {r["shard"]: r for r in json.loads(path.read_text())["memory"]}
  assert rows["none"]["opt_state_share"] == 1.0
  assert rows["optimizer"]["opt_state_share"] <= 1 / 8 + 0.05
  assert rows["params"]["state_share"] <= 1 / 8 + 0.10
  assert "params+opt/replicated" in capsys.readouterr().out
