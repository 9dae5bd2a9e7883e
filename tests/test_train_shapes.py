"""The harder task's trainer (``bench convergence --task shapes``) calls one jitted step per step.

It carries the optimizer state between calls as global arrays (a member's residual one row per
member, a step count replicated), so it must give exactly what one ``lax.scan`` over the same
steps gives: checked with compressed Adam over top-k, whose state holds both kinds of leaves and
whose exact warm-up ends (a ``lax.cond`` on the count) inside the run.
"""
import jax
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxring import codecs
from jaxring._src.data.hard_shapes import hard_shapes
from jaxring._src.tools.bench import convergence as bench

STEPS, BATCH = 6, 4


def scanned(tx, data, init, logits_fn):
  """The same training as one shard_map + lax.scan (the formulation train_shapes replaced)."""
  xtr, ytr = data[0], data[1]

  def loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, x), y).mean()

  def body(params, xs, ys):
    params = jax.tree.map(lambda v: lax.pcast(v, "d", to="varying"), params)
    state = tx.init(params)

    def step(carry, t):
      params, state = carry
      i = (t % (xs.shape[0] // BATCH)) * BATCH
      x, y = lax.dynamic_slice_in_dim(xs, i, BATCH), lax.dynamic_slice_in_dim(ys, i, BATCH)
      updates, state = tx.update(jax.grad(loss)(params, x, y), state, params)
      return (optax.apply_updates(params, updates), state), None

    (params, _), _ = lax.scan(step, (params, state), np.arange(STEPS, dtype=np.int32))
    return jax.tree.map(lambda v: v[None], params)

  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=P("d")))
  return f(init(jax.random.key(0)), xtr, ytr)


@pytest.mark.slow   # compiles a scan of train steps (~5 s)
def test_step_by_step_equals_one_scan():
  data = hard_shapes(8 * 3 * BATCH, 32)
  tx = bench.supported_optimizer("adamw", 3e-3, "d", codecs.topk_chunks(0.05, chunk_size=16),
                                 adam_warmup=2, adam_variance_every=2)
  with jax.numpy_dtype_promotion("standard"):   # optax's bias correction: float ** int32
    acc, params = bench.train_shapes(tx, STEPS, data, batch=BATCH, model="cnn",
                                     return_params=True)
    want = scanned(tx, data, *bench.MODELS["cnn"])
  assert 0.0 <= acc <= 100.0
  init = bench.MODELS["cnn"][0](jax.random.key(0))
  for name in want:
    got, ref = np.asarray(params[name]), np.asarray(want[name])
    assert got.shape == (8, *np.shape(init[name]))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5, err_msg=name)  # fusion order
    assert not np.allclose(got[0], np.asarray(init[name])), name   # it trained


def test_groupnorm_resnet_normalizes_and_starts_as_its_shortcuts():
  """The benchmark's GroupNorm ResNet: its logits do not change when the input is scaled (the
  stem's GroupNorm removes the scale; fails without it), and every block's branch starts at zero
  (its last GroupNorm's scale), so perturbing a branch's convolution changes nothing at init."""
  init, logits = bench.MODELS["resnet_gn"]
  params = init(jax.random.key(1))
  x = np.asarray(jax.random.normal(jax.random.key(2), (4, 16, 16, 3)))
  y = np.asarray(logits(params, x))
  np.testing.assert_allclose(np.asarray(logits(params, 3.0 * x)), y, rtol=1e-4, atol=1e-5)
  bumped = dict(params, a2=params["a2"] + 1.0, c1=params["c1"] * 2.0)
  np.testing.assert_allclose(np.asarray(logits(bumped, x)), y, rtol=1e-5, atol=1e-6)
  trained = dict(params, a2_g=params["a2_g"] + 1.0)
  assert np.max(np.abs(np.asarray(logits(trained, x)) - y)) > 1e-3


def test_cosine_schedule_starts_at_the_peak_and_ends_at_zero():
  assert bench.learning_rate(0.05, "constant", 100) == 0.05
  lr = bench.learning_rate(0.05, "cosine", 100)
  np.testing.assert_allclose([lr(0), lr(50), lr(100)], [0.05, 0.025, 0.0], atol=1e-7)
  assert float(lr(25)) > float(lr(75))
  with pytest.raises(ValueError, match="unknown schedule 'linear'"):
    bench.learning_rate(0.05, "linear", 100)
