"""NaN and Inf survive every codec, as they survive jax.lax.psum: a non-finite value in any
member's gradient reaches every member's reduced result (never dropped by top-k selection, never
hidden by an int8 scale, never turned into a finite wrong value), and the fp16 loss-scaling path
skips the step with every codec."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxring
import jaxring.train as jt
from jaxring import codecs

# `pytest -m "not slow"` leaves it out: NaN/Inf through every codec, level and optimizer
# transform (~15 s)
pytestmark = pytest.mark.slow

AUTO = jax.sharding.AxisType.Auto
N = 4096
CODECS = {
    "none": None,
    "bf16": codecs.bf16(),
    "fp16": codecs.fp16(),
    "int8": codecs.int8(),
    "int8-stochastic": codecs.int8(64, stochastic=True),
    "topk": codecs.topk_chunks(0.01, 16),
    "topk+int8": codecs.topk_chunks(0.01, 64, inner=codecs.int8(64)),
}


def _mesh(shape=(8,), names=("d",)):
  return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))


def _grads(bad_member, positions, value):
  g = np.random.RandomState(0).randn(8, N).astype(np.float32)
  for j in positions:
    g[bad_member, j] = value
  return g


def _reduce(fn, g, shape=(8,), names=("d",)):
  f = jax.jit(jax.shard_map(lambda x: fn(x[0])[None], mesh=_mesh(shape, names),
                            in_specs=P(names), out_specs=P(names)))
  return np.asarray(f(jnp.asarray(g)))


def _psum(g):
  return _reduce(lambda x: lax.psum(x, "d"), g)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", list(CODECS))
def test_a_non_finite_value_reaches_every_member(name, value):
  g = _grads(5, [1234], value)
  want = _psum(g)
  assert not np.isfinite(want[:, 1234]).any()
  got = _reduce(lambda x: jaxring.psum(x, "d", algorithm="ring", compression=CODECS[name]), g)
  for member in got[1:]:
    np.testing.assert_array_equal(member, got[0])
  assert not np.isfinite(got[:, 1234]).any(), got[:, 1234]   # where psum is non-finite, so is it
  if name in ("none", "bf16", "fp16"):
    # element by element: the same non-finite value as psum, finite values where psum's are
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    if not np.isnan(value):
      assert got[0, 1234] == want[0, 1234]


@pytest.mark.parametrize("name", ["topk", "topk+int8"])
def test_more_non_finite_chunks_than_topk_sends_still_surface(name):
  # 40 poisoned chunks, 3 sent per step: whichever are sent, the result is not finite
  positions = list(range(7, N, N // 40))[:40]
  got = _reduce(lambda x: jaxring.psum(x, "d", algorithm="ring", compression=CODECS[name]),
                _grads(2, positions, np.nan))
  assert all(not np.isfinite(member).all() for member in got)


@pytest.mark.parametrize("name", ["int8", "topk", "bf16"])
def test_hierarchical_levels_carry_non_finite_values(name):
  g = _grads(6, [99], np.inf)
  got = _reduce(lambda x: jaxring.psum(x, ("node", "local"), algorithm="hierarchical",
                                       compression={"node": CODECS[name]}),
                g, shape=(2, 4), names=("node", "local"))
  assert not np.isfinite(got[:, 99]).any()


@pytest.mark.parametrize("name", ["int8", "topk"])
def test_optimizer_transforms_pass_non_finite_gradients_on(name):
  g = _grads(1, [321], np.nan)
  for tx in (jaxring.reduce_gradients("d", algorithm="ring", compression=CODECS[name],
                                      plain_sgd_after=True),
             jaxring.momentum_correction("d", algorithm="ring", compression=CODECS[name]),
             jaxring.compressed_adam("d", algorithm="ring", compression=CODECS[name],
                                     warmup_steps=1)):
    def one(x, tx=tx):
      state = tx.init(jnp.zeros_like(x))
      _, state = tx.update(jnp.ones_like(x), state)   # past compressed Adam's warm-up
      upd, _ = tx.update(x, state)
      return upd
    got = _reduce(one, g)
    assert not np.isfinite(got[:, 321]).any()


def _loss(params, batch):
  return jnp.mean(jnp.square(batch["x"] @ params["w"] - batch["y"]))


@pytest.mark.parametrize("name", list(CODECS))
def test_fp16_loss_scaling_skips_the_overflowed_step_with_every_codec(name):
  comp = CODECS[name]
  momentum = 0.9 if name.startswith("topk") else None   # topk: the supported momentum
  tx = optax.sgd(0.1) if momentum else optax.sgd(0.1, momentum=0.9)

  @jt.train_step(precision="fp16", compression=comp, algorithm="ring" if comp else "auto",
                 momentum=momentum, bucket_bytes=64)
  def step(state, batch):
    loss, grads = jt.value_and_grad(_loss)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": loss}

  rng = np.random.RandomState(0)
  params = {"w": jnp.asarray(rng.randn(16, 64).astype(np.float32) * 0.3)}
  state = step.prepare(jt.TrainState.create(apply_fn=None, params=params, tx=tx))
  x = rng.randn(32, 16).astype(np.float32) * 0.1
  batch = {"x": x, "y": rng.randn(32, 64).astype(np.float32) * 0.1}
  state, _ = step(state, batch)                  # one real step: residuals and momentum non-zero
  before = jax.tree.map(np.asarray, (state.params, state.opt_state, state.residuals))
  scale = float(state.loss_scale.scale)
  x_bad = x.copy()
  x_bad[12:16] = 300.0                           # replica 3 overflows fp16
  state, metrics = step(state, dict(batch, x=x_bad))
  assert float(metrics["grads_finite"]) == 0.0
  after = jax.tree.map(np.asarray, (state.params, state.opt_state, state.residuals))
  for got, want in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
    np.testing.assert_array_equal(got, want)     # skipped on every replica, residuals kept
  assert float(state.loss_scale.scale) == scale / 2
