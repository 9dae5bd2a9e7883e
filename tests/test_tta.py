"""``jaxring bench tta``'s pieces that decide its figures: the contenders train the same thing, each
member sees the convergence benchmark's batches, and time to target is read off the curve."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxring.train as jt
from jaxring._src.tools.bench import models, tta


def test_time_to_target_is_the_first_evaluation_at_or_above_it():
  curve = [(0.0, 1, 6.0), (9.5, 100, 59.9), (19.0, 200, 60.0), (30.0, 300, 58.0)]
  assert tta.time_to_target(curve, 60.0) == (19.0, 200)
  assert tta.time_to_target(curve, 61.0) == (None, None)


def test_rows_speedups_and_bytes_per_step():
  recs = [{"contender": tta.BASE, "node": n, "curve": [(0.0, 1, 6.0), (40.0, 201, 61.0)],
           "tx_per_step": 2 << 20} for n in (0, 1)]
  recs += [{"contender": tta.INT8, "node": n, "curve": [(0.0, 1, 6.0), (10.0, 201, 62.0)],
            "tx_per_step": (n + 1) << 19} for n in (0, 1)]
  rows = {r["contender"]: r for r in tta.rows_of(recs, 60.0)}
  assert rows[tta.INT8]["speedup_vs_none"] == pytest.approx(4.0)
  assert rows[tta.INT8]["tx_mib_per_step"] == pytest.approx(0.75)   # mean over nodes
  assert rows[tta.BASE]["s_per_step"] == pytest.approx(40.0 / 200)  # the first step is untimed
  assert rows[tta.INT8]["final_accuracy"] == 62.0


def test_each_member_walks_its_shard_as_the_convergence_benchmark_does():
  x = np.arange(8 * 64, dtype=np.float32).reshape(8 * 64, 1, 1, 1)
  y = np.arange(8 * 64, dtype=np.int32)
  mesh = Mesh(np.asarray(jax.devices()), ("data",), axis_types=(AxisType.Auto,))
  batches = tta.Batches(x, y, 8, 16, [2, 3], NamedSharding(mesh, P("data")))
  for t in (0, 1, 5):   # member m, step t: its shard's images (t mod 4) * 16 ... + 16
    i = (t % 4) * 16
    want = np.concatenate([np.arange(m * 64 + i, m * 64 + i + 16) for m in (2, 3)])
    np.testing.assert_array_equal(batches.local(t)["y"], want)
    np.testing.assert_array_equal(batches.local(t)["x"].ravel(), want)


@pytest.mark.slow   # compiles the ResNet's step three times (~30 s on 2 cores)
def test_hand_written_and_train_step_take_momentum_sgds_step_on_the_global_batch():
  mesh = Mesh(np.asarray(jax.devices()), ("data",), axis_types=(AxisType.Auto,))
  params = models.init_resnet(jax.random.key(1))
  params = jax.tree.map(lambda p: p + 0.01 * jax.random.normal(jax.random.key(2), p.shape),
                        params)   # the zero-initialized convolutions get gradients too
  rng = np.random.RandomState(0)
  batch = {"x": rng.rand(32, 16, 16, 3).astype(np.float32),
           "y": rng.randint(0, 16, 32).astype(np.int32)}
  # float64 reference: two momentum SGD steps on the mean gradient of the whole batch
  with jax.enable_x64():
    p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    b64 = {"x": batch["x"].astype(np.float64), "y": batch["y"]}
    grad = jax.jit(jax.grad(lambda p: tta._loss(p, b64)))
    v = jax.tree.map(np.zeros_like, p64)
    for _ in range(2):
      v = jax.tree.map(lambda v, g: 0.9 * v + np.asarray(g), v, grad(p64))
      p64 = jax.tree.map(lambda p, v: p - 0.1 * v, p64, v)
  steps = tta.contenders(mesh, 0.1, 1 << 20, 16)
  sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
  for name in (tta.HAND, tta.BASE):
    step, tx = steps[name]
    state = jt.TrainState.create(apply_fn=None, params=jax.tree.map(jnp.copy, params), tx=tx)
    state = (step.prepare(state) if hasattr(step, "prepare")
             else jax.device_put(state, NamedSharding(mesh, P())))
    for _ in range(2):
      state, _ = step(state, sharded)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(p64)):
      np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5, err_msg=name)


def test_contenders_are_the_four_of_the_issue_and_per_tensor_top_k():
  mesh = Mesh(np.asarray(jax.devices()), ("data",), axis_types=(AxisType.Auto,))
  steps = tta.contenders(mesh, 0.1, 1 << 20, 16)
  assert list(steps) == [tta.HAND, tta.BASE, tta.INT8, tta.TOPK, tta.TOPK_PT]
  for name in (tta.TOPK, tta.TOPK_PT):
    # top-k runs the momentum inside the reduction: its optimizer has no momentum of its own
    state = jax.eval_shape(steps[name][1].init, {"w": jnp.zeros(64)})
    assert not any(np.shape(leaf) == (64,) for leaf in jax.tree.leaves(state))
    codec = steps[name][0].config.compression["node"]
    assert codec.per_tensor == (name == tta.TOPK_PT)
  assert any(np.shape(leaf) == (64,) for leaf in jax.tree.leaves(
      optax.sgd(0.1, momentum=0.9).init({"w": jnp.zeros(64)})))


def test_diloco_contenders_reduce_grads_within_the_node_and_keep_their_codecs_residuals():
  mesh = Mesh(np.asarray(jax.devices()).reshape(4, 2), ("node", "local"),
              axis_types=(AxisType.Auto,) * 2)
  steps = tta.diloco_contenders(mesh, 0.1, 1 << 20, "resnet", "constant", 10, every=5,
                                fragments=2, warmup=0, chunk_size=8)
  assert list(steps) == ["diloco H=5 none", "diloco H=5 int8", "diloco H=5 int8 fragments=2",
                         "diloco H=5 topk"]
  for name, (step, tx) in steps.items():
    assert step.config.grad_axes == ("local",), name
    state = jax.eval_shape(tx.init, {"w": jnp.zeros(64)})
    # a lossy codec keeps its error-feedback residual; the uncompressed sync none
    assert (state.residual is None) == name.endswith("none"), name


def test_cosine_schedule_reaches_every_contenders_optimizer():
  mesh = Mesh(np.asarray(jax.devices()), ("data",), axis_types=(AxisType.Auto,))
  steps = tta.contenders(mesh, 0.1, 1 << 20, 16, model="resnet_gn", schedule="cosine", steps=2)
  rates = [0.1, 0.05]   # optax.cosine_decay_schedule(0.1, 2) at counts 0 and 1
  for name, (_, tx) in steps.items():
    params, g = {"w": jnp.zeros(3)}, {"w": jnp.ones(3)}
    state = tx.init(params)
    momentum = name not in (tta.TOPK, tta.TOPK_PT)   # top-k's momentum is in the reduction
    v, want = 0.0, 0.0
    for rate in rates:
      with jax.numpy_dtype_promotion("standard"):   # optax's cosine mixes int32 and float
        updates, state = tx.update(g, state, params)
      params = optax.apply_updates(params, updates)
      v = 0.9 * v + 1.0 if momentum else 1.0
      want -= rate * v
    np.testing.assert_allclose(np.asarray(params["w"]), want, rtol=1e-6, err_msg=name)


def test_interleaved_timing_settles_each_contender_untimed_before_its_timed_steps():
  from jaxring._src.tools.bench import common
  made = []   # (contender, inside the timed block)
  inside = []

  def stepper(name):
    def step(state, batch):
      made.append((name, bool(inside)))
      return state + batch, {"n": state}
    return step

  @contextlib.contextmanager
  def around(name):
    inside.append(name)
    yield
    inside.pop()

  states = {"a": jnp.zeros(()), "b": jnp.zeros(())}
  times = common.time_interleaved({"a": stepper("a"), "b": stepper("b")}, states, jnp.ones(()),
                                  reps=2, steps=3, settle=1, around=around)
  one_rep = [("a", False)] + [("a", True)] * 3 + [("b", False)] + [("b", True)] * 3
  assert made == one_rep * 2
  assert {k: float(v) for k, v in states.items()} == {"a": 8.0, "b": 8.0}   # every step counted
  assert [len(t) for t in times.values()] == [2, 2]


def test_compute_share_times_the_step_alone_and_before_a_psum():
  from jaxring._src.tools.bench import common
  mesh = Mesh(np.asarray(jax.devices()), ("data",), axis_types=(AxisType.Auto,))

  def alone(state, batch):
    loss, grads = jax.value_and_grad(lambda p: ((batch["x"] @ p["w"]) ** 2).mean())(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  state = jt.TrainState.create(apply_fn=None, params={"w": np.ones((16, 4), np.float32)},
                               tx=optax.sgd(0.1, momentum=0.9))
  share = common.ComputeShare(alone, state, {"x": np.ones((8 * 3, 16), np.float32)}, 2, mesh)
  share.sample(2)
  assert len(share.samples) == len(share.synced) == len(share.sync) == 2
  assert all(t > 0 for t in share.samples + share.synced + share.sync)
  want = max(0.0, float(np.median(share.synced)) - share.seconds - float(np.median(share.sync)))
  assert share.skew == want
  assert common.ComputeShare(alone, state, {"x": np.ones((8, 16), np.float32)}, 1).skew is None
  recs = [{"node": 0, "skew_s": 0.01}, {"node": 1, "skew_s": 0.03}, {"node": 1, "skew_s": 0.03},
          {"node": 2, "skew_s": 0.02}, {"node": 3}]
  assert common.skew_of(recs) == 0.02 and common.skew_of([{"node": 0}]) == 0.0
