"""train_step(shard="optimizer"|"params"): ZeRO-1/2 and FSDP equal the replicated step, split the
state and carry error feedback exactly; the backward pass gathers again what it needs."""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxring
import jaxring.train as jt

from sharded_models import (BATCH, _assert_trees_close, _cnn_state, _cnn_step, _data, _mlp_loss,
                            _mlp_state, _mlp_step, _run)


TXS = {"sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
       "adamw": lambda: optax.adamw(3e-3, weight_decay=1e-2)}


@functools.lru_cache(maxsize=None)
def _replicated(tx: str, steps: int):
  """The replicated step's state after ``steps`` steps (shared by the tests that compare)."""
  state, _ = _run(_cnn_step(), _cnn_state(TXS[tx]()), _data(steps))
  return jax.device_get(state)


# the quick loop keeps params-sgd_momentum; each of the others ~7 s
@pytest.mark.parametrize("tx", [
    t if t == "sgd_momentum" else pytest.param(t, marks=pytest.mark.slow) for t in sorted(TXS)])
@pytest.mark.parametrize("shard", [pytest.param("optimizer", marks=pytest.mark.slow), "params"])
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


@pytest.mark.slow   # 10 steps side by side with the replicated step, per case (~6-10 s each)
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


@pytest.mark.slow   # 10 steps side by side on a two-level mesh (~7 s each)
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


@pytest.mark.slow   # steps side by side with an exact reduction (~1.5-5 s each)
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


@pytest.mark.slow   # trains three ways side by side (~10 s)
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


@pytest.mark.slow   # 10 steps side by side with the replicated step (~1-2 s each)
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


@pytest.mark.slow   # compiles the bench's model three ways (~5 s)
def test_bench_fsdp_memory_part_writes_its_table(tmp_path, capsys):
  from jaxring._src.tools.bench import fsdp
  assert fsdp.main(["--parts", "memory", "--width", "64", "--layers", "2", "--out-dir",
                    str(tmp_path)]) == 0
  path = tmp_path / "fsdp.json"
  rows = {r["shard"]: r for r in json.loads(path.read_text())["memory"]}
  assert rows["none"]["opt_state_share"] == 1.0
  assert rows["optimizer"]["opt_state_share"] <= 1 / 8 + 0.05
  assert rows["params"]["state_share"] <= 1 / 8 + 0.10
  assert "params+opt/replicated" in capsys.readouterr().out
