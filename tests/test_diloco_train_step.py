"""jaxring.diloco through @jaxring.train_step (grad_axes: the fast axes only), against the float64
NumPy DiLoCo of test_diloco and against synchronous data parallel: the TrainState form and the
functional form, a codec with error feedback equal to the shard_map form, an exact resume from a
checkpoint, and the refusals."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from test_diloco import LR, P0, X, Y, loss, reference
from test_diloco import train as shard_map_train

import jaxring as jr

AXES = ("node", "local")


def mesh():
  return jax.make_mesh((2, 4), AXES, axis_types=(AxisType.Auto,) * 2)


def make_step(**kw):
  @jr.train_step(mesh(), axis_name=AXES, **kw)
  def step(state, batch):
    value, grads = jr.value_and_grad(loss)(state.params, batch["x"], batch["y"])
    return state.apply_gradients(grads=grads), {"loss": value}
  return step


BATCH = {"x": X.reshape(-1, 5), "y": Y.reshape(-1, 1)}   # device 4n+d gets X[4n+d]


def run(tx, steps, step=None, state=None, **kw):
  step = step or make_step(**kw)
  if state is None:
    state = jr.TrainState.create(apply_fn=None, params=jax.tree.map(jnp.asarray, P0), tx=tx)
  for _ in range(steps):
    state, metrics = step(state, BATCH)
  return state, metrics


def local_rows(state):
  """Each replica's own parameters, (8, ...) per leaf, device 4n+d's row 4n+d."""
  return jax.tree.map(np.asarray, state.opt_state.local)


def assert_rows_match(rows, want, **tol):
  for n in range(2):
    for d in range(4):
      for k in P0:
        np.testing.assert_allclose(rows[k][4 * n + d], want[n][k], **tol)


@pytest.mark.parametrize("inner", ["sgd", "adamw"])
def test_every_step_with_outer_sgd_1_is_the_synchronous_train_step(inner):
  # AdamW too: each node's Adam step of its own gradients, averaged, is not synchronous Adam
  make = {"sgd": lambda: optax.sgd(LR), "adamw": lambda: optax.adamw(LR, weight_decay=0.1)}[inner]
  tx = jr.diloco(make(), axis="node", every=1, outer=optax.sgd(1.0))
  with jax.numpy_dtype_promotion("standard"):   # optax.adam's bias correction: float ** int32
    got, m1 = run(tx, 8, grad_axes="local")
    want, m2 = run(make(), 8)
    for k in P0:
      np.testing.assert_allclose(got.params[k], want.params[k], rtol=2e-5, atol=2e-6)
      np.testing.assert_allclose(local_rows(got)[k], np.broadcast_to(
          want.params[k], (8,) + want.params[k].shape), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(m1["loss"].mean(), m2["loss"], rtol=2e-5)
    # the metrics are each node's own (no per-step traffic over the slow links): its devices' mean
    before = jax.tree.map(np.asarray, got.params)
    _, m = run(tx, 1, make_step(grad_axes="local"), got)
    assert m["loss"].shape == (2,)
    np.testing.assert_allclose(m["loss"], [np.mean([loss(before, X[i], Y[i]) for i in range(
        4 * n, 4 * n + 4)]) for n in range(2)], rtol=2e-5)


@pytest.mark.parametrize("kw", [dict(every=3), dict(every=4, fragments=2, delay=1),
                                dict(every=3, warmup=2)],
                         ids=["H3", "H4-fragments2-delay1", "H3-warmup2"])
def test_equals_the_float64_reference(kw):
  steps = 12
  tx = jr.diloco(optax.sgd(LR), axis="node", every=kw["every"], fragments=kw.get("fragments", 1),
                 delay=kw.get("delay", 0), warmup_steps=kw.get("warmup", 0))
  state, _ = run(tx, steps, grad_axes="local")
  assert_rows_match(local_rows(state), reference(**kw, steps=steps), rtol=2e-5, atol=2e-6)
  assert int(state.step) == steps and int(state.opt_state.count) == steps


def test_the_state_params_are_the_outer_parameters_as_of_the_last_sync():
  tx = jr.diloco(optax.sgd(LR), axis="node", every=3)
  synced, _ = run(tx, 6, grad_axes="local")       # a sync at step 6: every row = the outer
  outer, rows = jax.tree.map(np.asarray, synced.params), local_rows(synced)
  later, _ = run(tx, 2, make_step(grad_axes="local"), synced)   # no sync since
  for k in P0:
    np.testing.assert_array_equal(rows[k], np.broadcast_to(outer[k], rows[k].shape))
    np.testing.assert_array_equal(later.params[k], outer[k])
    assert not np.allclose(local_rows(later)[k][0], local_rows(later)[k][4])   # nodes apart


@pytest.mark.parametrize("codec", [jr.codecs.int8(block_size=4),
                                   jr.codecs.topk_chunks(0.25, chunk_size=1, per_tensor=False)],
                         ids=["int8", "topk"])
def test_a_codec_with_error_feedback_equals_the_shard_map_form(codec):
  kw = dict(axis="node", every=3, compression=codec)
  state, _ = run(jr.diloco(optax.sgd(LR), **kw), 9, grad_axes="local")
  want = shard_map_train(jr.diloco(optax.sgd(LR), fast_axes="local", **kw), False, steps=9)
  for k in P0:
    np.testing.assert_allclose(local_rows(state)[k], want[k], rtol=1e-6, atol=1e-7)
  assert jax.tree.leaves(state.opt_state.residual)[0].shape[0] == 8
  assert any(np.abs(r).max() > 0 for r in jax.tree.leaves(state.opt_state.residual))   # lossy


def test_fast_axes_none_is_none():
  # None, as (): no fast axes of the transform's own (the step's grad_axes are the fast ones)
  kw = dict(axis="node", every=3)
  got, _ = run(jr.diloco(optax.sgd(LR), fast_axes=None, **kw), 4, grad_axes="local")
  want, _ = run(jr.diloco(optax.sgd(LR), **kw), 4, grad_axes="local")
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_outer_state_in_host_memory_through_the_step():
  # the outer momentum and the residual rows stay in host memory between steps; the state's
  # params (the outer parameters: the model an evaluation reads) and the replicas' own stay on
  # the device; the run is the device form's bit for bit
  kw = dict(axis="node", every=3, compression=jr.codecs.int8(block_size=4),
            outer=optax.sgd(0.7, momentum=0.9, nesterov=True))
  host, _ = run(jr.diloco(optax.sgd(LR), outer_memory="host", **kw), 7, grad_axes="local")
  device, _ = run(jr.diloco(optax.sgd(LR), **kw), 7, grad_axes="local")
  for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(device)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  kinds = lambda t: {a.sharding.memory_kind for a in jax.tree.leaves(t)}  # noqa: E731
  opt = host.opt_state
  assert kinds((opt.outer, opt.residual)) == {"pinned_host"}, opt
  assert kinds((host.params, opt.local, opt.inner, opt.count)) == {"device"}


def test_outer_state_split_over_the_fast_axes_through_the_step():
  # shard="optimizer": each device keeps its quarter of the outer momentum (and residual), the
  # state's params staying the whole outer parameters; the float64 reference, and the int8 run
  # equal to the whole-state step's
  kw = dict(axis="node", every=4, fragments=2, delay=1)
  split, _ = run(jr.diloco(optax.sgd(LR), fast_axes="local", shard="optimizer", **kw), 12,
                 grad_axes="local")
  assert_rows_match(local_rows(split), reference(every=4, fragments=2, delay=1, steps=12),
                    rtol=2e-5, atol=2e-6)
  # fragment 0 is b (1 value), fragment 1 w (5): a row of 1 and of 2 values per device
  assert [x.shape for x in jax.tree.leaves(split.opt_state.outer)] == [(8, 1), (8, 2)]
  assert {k: x.shape for k, x in split.params.items()} == {"b": (1,), "w": (5, 1)}
  codec = dict(kw, compression=jr.codecs.int8(block_size=4))
  got, _ = run(jr.diloco(optax.sgd(LR), fast_axes="local", shard="optimizer", **codec), 9,
               grad_axes="local")
  want, _ = run(jr.diloco(optax.sgd(LR), **codec), 9, grad_axes="local")
  for k in P0:
    np.testing.assert_allclose(local_rows(got)[k], local_rows(want)[k], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got.params[k], want.params[k], rtol=1e-6, atol=1e-7)
  assert [x.shape for x in jax.tree.leaves(got.opt_state.residual)] == [(8, 4), (8, 4)]


def test_the_functional_form():
  def functional(tx):
    @jr.train_step(mesh(), axis_name=AXES, grad_axes="local")
    def step(params, opt_state, batch):
      _, grads = jr.value_and_grad(loss)(params, batch["x"], batch["y"])
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, {}
    return step

  wrong = jr.diloco(optax.sgd(LR), axis="local", every=3)
  params = jax.tree.map(jnp.asarray, P0)
  with pytest.raises(ValueError, match=r"nothing would sync \('node',\)"):   # as the others
    functional(wrong)(params, wrong.init(params), BATCH)

  tx = jr.diloco(optax.sgd(LR), axis="node", every=3)
  step = functional(tx)
  opt_state = tx.init(params)
  for _ in range(7):
    params, opt_state, _ = step(params, opt_state, BATCH)
  inner = opt_state.inner if isinstance(opt_state, jr.train.OptState) else opt_state
  assert_rows_match(jax.tree.map(np.asarray, inner.local), reference(every=3, steps=7),
                    rtol=2e-5, atol=2e-6)
  # the functional form's state is the user's to lay out: a split one is refused, by name
  split = jr.diloco(optax.sgd(LR), axis="node", every=3, fast_axes="local", shard="optimizer")
  with pytest.raises(ValueError, match="not the functional form's"):
    functional(split)(params, split.init(params), BATCH)


@pytest.mark.slow   # orbax writes and restores a trained state (~5 s)
@pytest.mark.parametrize("memory,shard", [("device", "none"), ("host", "none"),
                                          ("device", "optimizer")])
def test_a_checkpoint_resumes_exactly(tmp_path, memory, shard):
  tx = jr.diloco(optax.sgd(LR), axis="node", every=4, fragments=2, delay=1, fast_axes="local",
                 compression=jr.codecs.int8(block_size=4), outer_memory=memory, shard=shard)
  step = make_step(grad_axes="local")
  state, _ = run(tx, 5, step)
  ckpt = jr.train.Checkpointer(tmp_path)
  ckpt.save(state)
  ckpt.wait_until_finished()
  straight, _ = run(tx, 6, step, state)
  template = jr.TrainState.create(apply_fn=None, params=jax.tree.map(jnp.asarray, P0), tx=tx)
  restored, _ = ckpt.restore(step.prepare(template))
  resumed, _ = run(tx, 6, make_step(grad_axes="local"), restored)
  for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_refusals():
  tx = jr.diloco(optax.sgd(LR), axis="node", every=3)
  with pytest.raises(ValueError, match="grad_axes='local'"):
    run(tx, 1)
  with pytest.raises(ValueError, match="would drift apart"):
    run(optax.sgd(LR), 1, grad_axes="local")
  with pytest.raises(ValueError, match="must name one or more"):
    make_step(grad_axes="model")
  with pytest.raises(ValueError, match="not supported"):
    run(tx, 1, grad_axes="local", shard="optimizer")
  for kw in (dict(grad_axes="local"), {}):   # inside a chain: the step could not keep its rows
    with pytest.raises(ValueError, match=r"put the others inside it.*jaxring.diloco\(optax.ch"):
      run(optax.chain(optax.clip_by_global_norm(1.0), tx), 1, **kw)
  # the step leaves "node" to the optimizer, which syncs "local": the nodes would drift apart
  wrong = jr.diloco(optax.sgd(LR), axis="local", every=3)
  with pytest.raises(ValueError, match=r"nothing would sync \('node',\).*axis='node'"):
    run(wrong, 1, grad_axes="local")
  with pytest.raises(ValueError, match=r"syncs axis=\('node', 'local'\)"):
    run(jr.diloco(optax.sgd(LR), axis=("node", "local"), every=3), 1, grad_axes="local")
  from flax import nnx   # NNX objects: the optimizer's tx is checked alike
  model = nnx.Linear(5, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, wrong, wrt=nnx.Param)

  @jr.train_step(mesh(), axis_name=AXES, grad_axes="local")
  def nnx_step(model, optimizer, batch):
    value, grads = jr.value_and_grad(lambda m: ((m(batch["x"]) - batch["y"]) ** 2).mean())(model)
    optimizer.update(model, grads)
    return {"loss": value}
  with pytest.raises(ValueError, match=r"nothing would sync \('node',\)"):
    nnx_step(model, optimizer, BATCH)


@pytest.mark.slow   # NNX and TrainState steps compiled side by side (~5 s)
@pytest.mark.parametrize("shard", ["none", "optimizer"])
def test_nnx_objects_train_as_the_train_state_does(shard):
  from flax import nnx

  class Linear(nnx.Module):
    def __init__(self):
      self.w, self.b = nnx.Param(jnp.asarray(P0["w"])), nnx.Param(jnp.asarray(P0["b"]))

    def __call__(self, x):
      return x @ self.w[...] + self.b[...]

  @jr.train_step(mesh(), axis_name=AXES, grad_axes="local")
  def step(model, optimizer, batch):
    value, grads = jr.value_and_grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
    optimizer.update(model, grads)
    return {"loss": value}

  kw = dict(axis="node", every=3, compression=jr.codecs.int8(block_size=4), fast_axes="local",
            shard=shard)
  model = Linear()
  optimizer = nnx.Optimizer(model, jr.diloco(optax.sgd(LR), **kw), wrt=nnx.Param)
  for _ in range(7):
    metrics = step(model, optimizer, BATCH)
  state, want = run(jr.diloco(optax.sgd(LR), **dict(kw, shard="none")), 7, grad_axes="local")
  np.testing.assert_allclose(metrics["loss"], want["loss"], rtol=1e-6)   # (nodes,) both
  if shard == "optimizer":   # each device its share of the residual: 4 of the fragment's 6
    held = jax.tree.leaves(optimizer.opt_state.residual, is_leaf=lambda v: isinstance(
        v, nnx.Variable))
    assert [v.get_value().shape for v in held] == [(8, 4)]
  for k in P0:
    np.testing.assert_allclose(getattr(model, k).get_value(), state.params[k], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(optimizer.opt_state.local[k].get_value(), local_rows(state)[k],
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kw", [dict(every=1), dict(every=3), dict(every=3, warmup_steps=2)],
                         ids=["H1", "H3", "H3-warmup2"])
def test_batchnorm_statistics_cross_the_slow_axis_only_at_a_sync(kw):
  """A BatchNorm on the inputs: its running statistics do not depend on the parameters, so a
  float64 NumPy EMA per node, averaged over the nodes where the parameters sync, is exact."""
  import flax.linen as nn

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(1)(nn.BatchNorm(use_running_average=False, momentum=0.9)(x))

  model = Model()
  variables = model.init(jax.random.key(0), X[0])
  tx = jr.diloco(optax.sgd(LR), axis="node", **kw)
  state = jr.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                               batch_stats=variables["batch_stats"])

  @jr.train_step(mesh(), axis_name=AXES, grad_axes="local")
  def step(state, batch):
    def f(params):
      out, upd = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                batch["x"], mutable=["batch_stats"])
      return jnp.mean((out - batch["y"]) ** 2), upd["batch_stats"]
    (value, stats), grads = jr.value_and_grad(f, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads).replace(batch_stats=stats), {"loss": value}

  x64 = X.astype(np.float64)
  target = [{"mean": x64[4 * n:4 * n + 4].mean(1).mean(0),
             "var": x64[4 * n:4 * n + 4].var(1).mean(0)} for n in range(2)]
  node = [{"mean": np.zeros(5), "var": np.ones(5)} for _ in range(2)]
  synced = dict(node[0])
  warmup = kw.get("warmup_steps", 0)
  for s in range(7):
    state, _ = step(state, BATCH)
    node = [{k: 0.9 * node[n][k] + 0.1 * target[n][k] for k in target[n]} for n in range(2)]
    t = s - warmup + 1
    if t <= 0 or t % kw["every"] == 0:   # a sync: the nodes' statistics averaged
      synced = {k: (node[0][k] + node[1][k]) / 2 for k in synced}
      node = [dict(synced), dict(synced)]
    rows = state.opt_state.local_stats["BatchNorm_0"]
    for k in synced:
      np.testing.assert_allclose(state.batch_stats["BatchNorm_0"][k], synced[k], rtol=1e-5,
                                 atol=1e-7)
      for i in range(8):
        np.testing.assert_allclose(rows[k][i], node[i // 4][k], rtol=1e-5, atol=1e-7)
  if kw["every"] > 1:   # between syncs the nodes' own statistics differ
    assert not np.allclose(rows["mean"][0], rows["mean"][4])


def test_nnx_batchnorm_holds_the_statistics_of_the_last_sync():
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self):
      self.bn = nnx.BatchNorm(5, momentum=0.9, rngs=nnx.Rngs(0))
      self.lin = nnx.Linear(5, 1, rngs=nnx.Rngs(1))

    def __call__(self, x):
      return self.lin(self.bn(x))

  @jr.train_step(mesh(), axis_name=AXES, grad_axes="local")
  def step(model, optimizer, batch):
    value, grads = jr.value_and_grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
    optimizer.update(model, grads)
    return {"loss": value}

  model = Model()
  optimizer = nnx.Optimizer(model, jr.diloco(optax.sgd(LR), axis="node", every=3), wrt=nnx.Param)
  x64 = X.astype(np.float64)
  target = [x64[4 * n:4 * n + 4].mean(1).mean(0) for n in range(2)]
  node = [np.zeros(5), np.zeros(5)]
  for s in range(4):
    step(model, optimizer, BATCH)
    node = [0.9 * node[n] + 0.1 * target[n] for n in range(2)]
    if s == 2:   # the sync at step 3
      synced = (node[0] + node[1]) / 2
      node = [synced, synced]
  np.testing.assert_allclose(model.bn.mean.get_value(), synced, rtol=1e-5, atol=1e-7)
  rows = np.asarray(jax.tree.leaves(optimizer.opt_state.local_stats)[0])   # bn's mean, per replica
  for i in range(8):
    np.testing.assert_allclose(rows[i], node[i // 4], rtol=1e-5, atol=1e-7)
