"""Flax NNX steps through ``@jaxring.train_step``: ``step(model, optimizer, batch)`` updating its
objects in place equals the same step on one device with the global batch (``nnx.jit``,
``nnx.value_and_grad``), or, where replicas differ from one device (BatchNorm statistics of each
replica's shard, per-replica dropout masks), a hand-written ``jax.shard_map`` NNX step. Lossy
codecs, top-k, error feedback and precision: tests/test_nnx_step_features.py."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import jaxring as jr

TOL = {"rtol": 1e-5, "atol": 1e-6}   # float32 rounding: the replicas' mean sums in another order


class MLP(nnx.Module):
  def __init__(self, rngs, norm=False, dropout=False):
    self.l1 = nnx.Linear(8, 16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, momentum=0.8, rngs=rngs) if norm else None
    self.drop = nnx.Dropout(0.5, rngs=rngs) if dropout else None
    self.l2 = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    h = self.l1(x)
    if self.bn is not None:
      h = self.bn(h)
    h = jnp.tanh(h)
    if self.drop is not None:
      h = self.drop(h)
    return self.l2(h)


def loss_fn(model, x, y):
  return jnp.mean(jnp.square(model(x) - y))


def batches(n, size=32):
  rng = np.random.RandomState(0)
  return [{"x": rng.randn(size, 8).astype(np.float32),
           "y": rng.randn(size, 4).astype(np.float32)} for _ in range(n)]


def objects(tx, **kw):
  """A fresh model (the same initial parameters every call) and its optimizer."""
  model = MLP(nnx.Rngs(0, dropout=1), **kw)
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def flat(state) -> dict:
  """``{path: numpy array}`` of an ``nnx.State`` (PRNG keys as their key data)."""
  out = {}
  for path, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state)):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    out[jax.tree_util.keystr(path)] = np.asarray(x)
  return out


def assert_state_close(got, want, **tol):
  """Every variable of ``want`` (an NNX object) equals the same one of ``got``."""
  g, w = flat(nnx.state(got)), flat(nnx.state(want))
  assert set(w) <= set(g), set(w) - set(g)
  for k in w:
    np.testing.assert_allclose(g[k], w[k], err_msg=k, **(tol or TOL))


def adamw():
  return optax.adamw(3e-3)


def sgd():
  return optax.sgd(0.1, momentum=0.9)


def plain_step(vag, model, optimizer, batch):
  loss, grads = vag(loss_fn)(model, batch["x"], batch["y"])
  optimizer.update(model, grads)
  return {"loss": loss}


def run_both(body, make, n=2, mesh=None, **kw):
  """``body(value_and_grad, *objects, batch) -> metrics``, ``n`` steps through
  ``jr.train_step(mesh, **kw)`` with ``jr.value_and_grad`` and on one device under ``nnx.jit``
  with ``nnx.value_and_grad``, each on its own ``make()`` objects: the metrics and then every
  variable of the objects must be equal. Returns the step, both sets of objects and the
  one-device metrics of each step."""
  step = jr.train_step(mesh, **kw)(lambda *a: body(jr.value_and_grad, *a))
  ref = nnx.jit(lambda *a: body(nnx.value_and_grad, *a))
  got, want, history = make(), make(), []
  with jax.numpy_dtype_promotion("standard"):   # optax.adam's bias correction: float ** int32
    for batch in batches(n):
      metrics = step(*got, batch)
      history.append(ref(*want, batch))
      for k, v in history[-1].items():
        np.testing.assert_allclose(np.asarray(metrics[k]), np.asarray(v), err_msg=k, **TOL)
  for a, b in zip(got, want, strict=True):
    assert_state_close(a, b)
  return step, got, want, history


def mesh_2x4():
  return Mesh(np.asarray(jax.devices()).reshape(2, 4), ("node", "local"),
              axis_types=(AxisType.Auto,) * 2)


LOSSLESS = {
    "xla": {"algorithm": "xla"},
    "ring": {"algorithm": "ring"},
    "hierarchical": {"algorithm": "hierarchical", "axis_name": ("node", "local")},
    "auto": {"algorithm": "auto"},
    "codec-none": {"algorithm": "ring", "compression": jr.codecs.none()},
    "small-buckets": {"algorithm": "ring", "bucket_bytes": 256},
    "no-overlap": {"algorithm": "ring", "bucket_bytes": 256, "overlap": False},
}
QUICK = ("ring", "hierarchical", "small-buckets")


@pytest.mark.parametrize("name", [   # each compiles a step for 8 devices and one (~1.5 s)
    n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in LOSSLESS])
def test_lossless_step_equals_the_one_device_step_on_the_global_batch(name):
  kw = dict(LOSSLESS[name])
  mesh = mesh_2x4() if name == "hierarchical" else None
  step, (_, opt), _, _ = run_both(plain_step, lambda: objects(adamw()), n=3, mesh=mesh, **kw)
  assert int(opt.step[...]) == 3
  assert "residuals" not in nnx.state(opt) and "loss_scale" not in nnx.state(opt)   # lossless
  if "bucket_bytes" in kw:
    assert len(step.buckets) > 1   # 212 float32 gradients, 256-byte buckets


def test_has_aux_returns_the_aux_of_each_replica_averaged():
  """``has_aux=True``: each replica's aux (a mean over its shard) averaged as a metric is the
  global batch's."""
  def body(vag, model, optimizer, batch):
    def loss_aux(model, x, y):
      err = model(x) - y
      return jnp.mean(jnp.square(err)), {"mae": jnp.mean(jnp.abs(err))}
    (loss, aux), grads = vag(loss_aux, has_aux=True)(model, batch["x"], batch["y"])
    optimizer.update(model, grads)
    return {"loss": loss, "mae": aux["mae"]}
  run_both(body, lambda: objects(sgd()), algorithm="ring")


def test_diffstate_argnums_trains_only_the_filtered_parameters():
  """``argnums=nnx.DiffState(0, filter)`` with the optimizer's ``wrt`` the same filter: only
  ``l2`` moves; ``l1`` (not the optimizer's) stays where it was, as on one device."""
  head = nnx.All(nnx.Param, nnx.PathContains("l2"))

  def make():
    model = MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, adamw(), wrt=head)

  def body(vag, model, optimizer, batch):
    loss, grads = vag(loss_fn, argnums=nnx.DiffState(0, head))(model, batch["x"], batch["y"])
    optimizer.update(model, grads)
    return {"loss": loss}

  _, (model, _), _, _ = run_both(body, make, algorithm="ring")
  init = MLP(nnx.Rngs(0))
  np.testing.assert_allclose(np.asarray(model.l1.kernel[...]), np.asarray(init.l1.kernel[...]),
                             **TOL)
  assert np.abs(np.asarray(model.l2.kernel[...]) - np.asarray(init.l2.kernel[...])).max() > 1e-3


def two_layer_loss(l1, l2, x, y):
  return jnp.mean(jnp.square(l2(jnp.tanh(l1(x))) - y))


def test_tuple_argnums_differentiates_two_modules():
  """``argnums=(0, 1)`` over two submodules: a gradient State each, applied as one."""
  def body(vag, model, optimizer, batch):
    loss, (g1, g2) = vag(two_layer_loss, argnums=(0, 1))(model.l1, model.l2, batch["x"],
                                                        batch["y"])
    optimizer.update(model, nnx.State({"l1": g1, "l2": g2}))
    return {"loss": loss}
  run_both(body, lambda: objects(sgd()), algorithm="ring")


def test_a_metrics_object_is_updated_in_place_with_the_global_losses():
  """``step(model, optimizer, metrics, batch)`` with an ``nnx.MultiMetric``: its Average holds
  the mean of every step's global loss (the float total averaged over the replicas, the count
  each replica's), as the one-device step's metrics object."""
  def make():
    return (*objects(sgd()), nnx.MultiMetric(loss=nnx.metrics.Average("loss")))

  def body(vag, model, optimizer, metrics, batch):
    out = plain_step(vag, model, optimizer, batch)
    metrics.update(loss=out["loss"])
    return out

  _, (_, _, metrics), _, history = run_both(body, make, n=3, algorithm="ring")
  with jax.numpy_dtype_promotion("standard"):   # Average.compute: float32 total / int32 count
    value = float(metrics.compute()["loss"])
  np.testing.assert_allclose(value, np.mean([float(m["loss"]) for m in history]), **TOL)
  assert int(metrics.loss.count[...]) == 3
  metrics.reset()                                       # still the caller's object
  assert int(metrics.loss.count[...]) == 0


def test_arguments_after_the_batch_reach_every_replica_whole():
  """``step(model, optimizer, batch, weights)``: ``weights`` (4 values, not split over 8
  replicas) is the same array on every replica, as on one device."""
  def body(vag, model, optimizer, batch, weights):
    def weighted(model, x, y):
      return jnp.mean(weights * jnp.square(model(x) - y))
    loss, grads = vag(weighted)(model, batch["x"], batch["y"])
    optimizer.update(model, grads)
    return loss

  weights = jnp.asarray([0.5, 1.0, 2.0, 4.0])
  step = jr.train_step(algorithm="ring")(lambda *a: body(jr.value_and_grad, *a))
  ref = nnx.jit(lambda *a: body(nnx.value_and_grad, *a))
  got, want = objects(sgd()), objects(sgd())
  for batch in batches(2):
    np.testing.assert_allclose(float(step(*got, batch, weights)), float(ref(*want, batch, weights)),
                               **TOL)
  for a, b in zip(got, want):
    assert_state_close(a, b)


def test_one_step_serves_two_models_in_turn():
  """The step walks the objects it is called with: alternating two models (other initial
  parameters), each follows its own one-device trajectory."""
  step = jr.train_step(algorithm="ring")(lambda *a: plain_step(jr.value_and_grad, *a))
  ref = nnx.jit(lambda *a: plain_step(nnx.value_and_grad, *a))

  def pair(seed):
    model = MLP(nnx.Rngs(seed))
    return model, nnx.Optimizer(model, sgd(), wrt=nnx.Param)

  got, want = [pair(0), pair(1)], [pair(0), pair(1)]
  for batch in batches(2):
    for g, w in zip(got, want):
      np.testing.assert_allclose(float(step(*g, batch)["loss"]), float(ref(*w, batch)["loss"]),
                                 **TOL)
  for g, w in zip(got, want):
    for a, b in zip(g, w):
      assert_state_close(a, b)
  kernels = [np.asarray(model.l1.kernel[...]) for model, _ in got]
  assert np.abs(kernels[0] - kernels[1]).max() > 0     # two models indeed


def shard_map_step(model, optimizer, loss, *, fold_keys=True, probe=False):
  """The reference replicas: a hand-written ``jax.jit(jax.shard_map(...))`` NNX step over the 8
  devices. Each replica merges the objects, folds every RngKey with its index (its own dropout
  mask), takes ``nnx.value_and_grad`` on its shard and applies ``lax.pmean`` of the gradients;
  then the keys are put back and the BatchNorm statistics and the loss averaged. ``probe``: one
  more dropout draw after the update, averaged over the replicas, as a metric."""
  mesh = Mesh(np.asarray(jax.devices()), ("data",), axis_types=(AxisType.Auto,))
  graphdef, _ = nnx.split((model, optimizer))

  def body(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    keys = jax.tree.map(lambda k: k, nnx.state(model, nnx.RngKey))   # a copy, not the Variables
    if fold_keys:
      index = lax.axis_index("data")
      nnx.update(model, jax.tree.map(lambda k: jax.random.fold_in(k, index), keys))
    value, grads = nnx.value_and_grad(loss)(model, batch["x"], batch["y"])
    optimizer.update(model, lax.pmean(grads, "data"))
    metrics = {"loss": value}
    if probe:
      metrics["mask"] = model.drop(jnp.ones((4, 16)))
    nnx.update(model, keys)
    nnx.update(model, lax.pmean(nnx.state(model, nnx.BatchStat), "data"))
    return nnx.state((model, optimizer)), lax.pmean(metrics, "data")

  run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()),
                              check_vma=False))

  def step(batch):
    new, metrics = run(nnx.state((model, optimizer)), batch)
    nnx.update((model, optimizer), new)
    return metrics
  return step


def test_batchnorm_statistics_are_each_replicas_then_averaged():
  """BatchNorm normalises with each replica's shard statistics (not the global batch's) and its
  running averages are the replicas' mean after the step: the shard_map reference's."""
  tx = optax.sgd(0.1, momentum=0.9)
  model, opt = objects(tx, norm=True)
  ref_objs = objects(tx, norm=True)
  ref = shard_map_step(*ref_objs, loss_fn)
  step = jr.train_step(algorithm="ring")(lambda *a: plain_step(jr.value_and_grad, *a))
  one_model, one_opt = objects(tx, norm=True)
  one_device = nnx.jit(lambda *a: plain_step(nnx.value_and_grad, *a))
  for batch in batches(2):
    np.testing.assert_allclose(float(step(model, opt, batch)["loss"]),
                               float(ref(batch)["loss"]), **TOL)
    one_device(one_model, one_opt, batch)
  assert_state_close(model, ref_objs[0])
  assert_state_close(opt, ref_objs[1])
  # the global batch's statistics are not the replicas' mean: the test tells them apart
  assert not np.allclose(model.bn.var[...], one_model.bn.var[...], rtol=1e-3)


def test_dropout_masks_differ_per_replica_and_equal_the_folded_keys_reference():
  """Every RngKey is folded with the replica index inside the step: each replica draws its own
  mask (their mean over the 8 replicas is not a single replica's 0 or 2), the very masks of the
  reference that folds by ``lax.axis_index``; outside the step the key is the one it was."""
  tx = optax.sgd(0.1)
  model, opt = objects(tx, dropout=True)
  ref_objs = objects(tx, dropout=True)
  ref = shard_map_step(*ref_objs, loss_fn, probe=True)
  key0 = jax.random.key_data(model.drop.rngs.key[...])

  @jr.train_step(algorithm="ring")
  def step(model, optimizer, batch):
    loss, grads = jr.value_and_grad(loss_fn)(model, batch["x"], batch["y"])
    optimizer.update(model, grads)
    return {"loss": loss, "mask": model.drop(jnp.ones((4, 16)))}

  masks = []
  for batch in batches(2):
    got, want = step(model, opt, batch), ref(batch)
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), **TOL)
    np.testing.assert_allclose(np.asarray(got["mask"]), np.asarray(want["mask"]), **TOL)
    masks.append(np.asarray(got["mask"]))
  assert_state_close(model, ref_objs[0])
  assert_state_close(opt, ref_objs[1])
  mean_mask = np.concatenate(masks)
  assert np.any((mean_mask > 0.1) & (mean_mask < 1.9)), "the same mask on every replica"
  assert not np.array_equal(masks[0], masks[1])          # the count moved on: new masks
  np.testing.assert_array_equal(jax.random.key_data(model.drop.rngs.key[...]), key0)
  assert int(model.drop.rngs.count[...]) == 4            # two draws a step


def test_value_and_grad_outside_a_step_is_nnx_value_and_grad():
  """Values, aux, gradients and the BatchStat written back into the model, for an int, a
  DiffState and a tuple ``argnums``: as ``nnx.value_and_grad`` gives them."""
  def loss_aux(model, x, y):
    pred = model(x)
    return jnp.mean(jnp.square(pred - y)), pred

  batch = batches(1)[0]
  x, y = batch["x"], batch["y"]
  calls = [
      (loss_aux, {"has_aux": True}, lambda m: (m, x, y)),
      (loss_aux, {"has_aux": True, "argnums": nnx.DiffState(0, nnx.PathContains("l2"))},
       lambda m: (m, x, y)),
      (two_layer_loss, {"argnums": (0, 1)}, lambda m: (m.l1, m.l2, x, y)),
  ]
  for fn, kw, args in calls:
    model, twin = MLP(nnx.Rngs(0), norm=True), MLP(nnx.Rngs(0), norm=True)
    got = jr.value_and_grad(fn, **kw)(*args(model))
    want = nnx.value_and_grad(fn, **kw)(*args(twin))
    assert jax.tree.structure(got) == jax.tree.structure(want)   # grads: the same nnx.States
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_state_close(model, twin, rtol=0, atol=0)
    if fn is loss_aux:   # the batch statistics were written back into the model
      assert np.abs(np.asarray(model.bn.mean[...])).max() > 0


def refused(case):
  """A step that must be refused, and its call's arguments."""
  def step(model, optimizer, batch):
    if case == "nnx.value_and_grad":
      loss, grads = nnx.value_and_grad(loss_fn)(model, batch["x"], batch["y"])
    else:
      loss, grads = jr.value_and_grad(loss_fn)(model, batch["x"], batch["y"])
    optimizer.update(model, grads)
    if case == "adds a Variable":
      model.extra = nnx.BatchStat(jnp.zeros(()))
    return {"loss": loss}

  model, opt = objects(sgd())
  batch = batches(1)[0]
  if case == "no batch":
    return (lambda model, optimizer: {}), (model, opt)
  if case == "two optimizers":
    return (lambda model, o1, o2, batch: {}), (model, opt, nnx.Optimizer(model, sgd(),
                                                                          wrt=nnx.Param), batch)
  return step, (model, opt, batch)


@pytest.mark.parametrize("case, error, match", [
    ("nnx.value_and_grad", ValueError, (r"never averaged.*jaxring\.value_and_grad in place of "
                                       r"nnx\.value_and_grad")),
    ("adds a Variable", ValueError, "changed the structure of its objects"),
    ("no batch", TypeError, r"takes a batch after its NNX objects"),
    ("two optimizers", ValueError, r"several nnx\.Optimizer"),
])
def test_a_wrong_nnx_step_is_refused_with_what_to_do_and_leaves_its_objects(case, error, match):
  fn, args = refused(case)
  before = [flat(nnx.state(a)) for a in args if isinstance(a, nnx.Object)]
  with pytest.raises(error, match=match):
    jr.train_step(algorithm="ring")(fn)(*args)
  after = [flat(nnx.state(a)) for a in args if isinstance(a, nnx.Object)]
  for b, a in zip(before, after, strict=True):
    assert b.keys() == a.keys()
    for k in b:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_a_frozen_parameter_the_step_leaves_alone_keeps_its_exact_value():
  """Parameters outside the optimizer's ``wrt`` are neither reduced nor averaged: bit-identical
  after the steps (an average of 8 equal values is not exact), as on one device."""
  head = nnx.All(nnx.Param, nnx.PathContains("l2"))
  model = MLP(nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=head)
  frozen = np.asarray(model.l1.kernel[...]).copy()

  @jr.train_step(algorithm="ring")
  def step(model, optimizer, batch):
    loss, grads = jr.value_and_grad(loss_fn, argnums=nnx.DiffState(0, head))(
        model, batch["x"], batch["y"])
    optimizer.update(model, grads)
    return {"loss": loss}

  head_before = np.asarray(model.l2.kernel[...]).copy()
  for batch in batches(3):
    step(model, opt, batch)
  np.testing.assert_array_equal(np.asarray(model.l1.kernel[...]), frozen)
  assert not np.array_equal(np.asarray(model.l2.kernel[...]), head_before)


def test_alternating_two_models_of_one_structure_compiles_once_per_model():
  traces = []

  @jr.train_step(algorithm="ring")
  def step(model, optimizer, batch):
    traces.append(1)
    loss, grads = jr.value_and_grad(loss_fn)(model, batch["x"], batch["y"])
    optimizer.update(model, grads)
    return {"loss": loss}

  pairs = [(m, nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param))
           for m in (MLP(nnx.Rngs(0)), MLP(nnx.Rngs(1)))]
  for _ in range(3):
    for pair in pairs:
      step(*pair, batches(1)[0])
  assert len(traces) == 2   # nnx.jit: 2 as well
