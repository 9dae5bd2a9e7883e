"""Error feedback (jaxring.reduce_gradients): nothing is lost, only delayed; residuals stay bounded.

Over T steps, what was applied plus the final mean residual must equal the sum of the true mean
gradients (float64 reference, to f32 rounding), for every codec and algorithm: that holds only if
the errors the all-reduce reports are exactly what it left out, each counted once.
"""
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring import codecs

AUTO = jax.sharding.AxisType.Auto
TOPO = jaxring.Topology((jaxring.Level("local", 4), jaxring.Level("node", 2, 1.25e8, 1e-4)))
FLAT = ((8,), ("d",), "ring", lambda c: c, None)
MESH_2X4 = ((2, 4), ("node", "local"), "hierarchical", lambda c: {"node": c}, None)
SPLIT = ((8,), ("d",), "hierarchical", lambda c: {"node": c}, TOPO)


def mesh_of(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))


def run_steps(grads, codec, place=FLAT, *, check_vma=True, error_feedback=True):
  """Feeds grads[t, i] to member i at step t; returns (applied [members, T, n], residual
  [members, n]) as each member saw them."""
  shape, names, algorithm, comp, topo = place
  axis = names if len(names) > 1 else names[0]
  tx = jaxring.reduce_gradients(axis, algorithm=algorithm, compression=comp(codec),
                                error_feedback=error_feedback, plain_sgd_after=True)
  n = grads.shape[-1]

  def body(g):
    state = tx.init(jnp.zeros(n, grads.dtype))

    def step(state, gt):
      upd, state = tx.update(gt, state)
      return state, upd

    state, applied = lax.scan(step, state, g[:, 0])
    res = state.residual if error_feedback else jnp.zeros(n, jnp.float32)
    return applied[None], res[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh_of(shape, names), in_specs=P(None, names),
                            out_specs=(P(names), P(names)), check_vma=check_vma))
  if topo is None:
    out = f(grads)
  else:
    with jaxring.use_topology(topo):
      out = f(grads)
  return np.asarray(out[0], np.float64), np.asarray(out[1], np.float64)


def gradients(seed, steps, n, dtype=jnp.float32):
  rng = np.random.RandomState(seed)
  g = rng.randn(steps, 8, n) * np.exp(rng.randn(1, 1, n)) + 0.3  # a bias EF must not lose
  return jnp.asarray(g, dtype)


CASES = {
    "int8-ring": (codecs.int8(), FLAT, True),
    "int8-stochastic-ring": (codecs.int8(block_size=64, stochastic=True), FLAT, True),
    "bf16-ring": (codecs.bf16(), FLAT, True),
    "fp16-ring": (codecs.fp16(), FLAT, False),
    "topk-ring": (codecs.topk_chunks(0.05, 32), FLAT, True),
    "topk-ring-novma": (codecs.topk_chunks(0.05, 32), FLAT, False),
    "topk-int8-ring": (codecs.topk_chunks(0.1, 256, inner=codecs.int8()), FLAT, True),
    "int8-hier2x4": (codecs.int8(), MESH_2X4, True),
    "topk-hier2x4": (codecs.topk_chunks(0.05, 32), MESH_2X4, True),
    "int8-split": (codecs.int8(), SPLIT, True),
    "int8-split-novma": (codecs.int8(), SPLIT, False),
    "topk-split": (codecs.topk_chunks(0.05, 32), SPLIT, False),
}


# the quick loop keeps one case per codec family and place (~1 s each)
@pytest.mark.parametrize("case", [
    c if c in ("int8-ring", "int8-split", "topk-split", "topk-hier2x4")
    else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_applied_plus_residual_equals_true_mean(case):
  codec, place, check_vma = CASES[case]
  steps, n = 30, 1500
  g = gradients(0, steps, n)
  applied, residual = run_steps(g, codec, place, check_vma=check_vma)
  for member in applied[1:]:
    np.testing.assert_array_equal(member, applied[0])
  true = np.asarray(g, np.float64).mean(1).sum(0)
  got = applied[0].sum(0) + residual.mean(0)
  scale = np.abs(np.asarray(g, np.float64)).max()
  np.testing.assert_allclose(got, true, rtol=0, atol=steps * 8 * scale * 2e-7)
  # and compression did leave something out, which the residual carried
  assert np.abs(applied[0].sum(0) - true).max() > 10 * np.abs(got - true).max()


@pytest.mark.slow   # steps with and without feedback (~3 s)
def test_without_error_feedback_the_left_out_part_is_lost():
  steps, n = 30, 1500
  g = gradients(1, steps, n)
  applied, _ = run_steps(g, codecs.topk_chunks(0.05, 32), error_feedback=False)
  true = np.asarray(g, np.float64).mean(1).sum(0)
  lost = np.abs(applied[0].sum(0) - true)
  assert lost.max() > 0.3 * steps / 2  # the bias of chunks never picked is missing
  # and each step is exactly the compressed pmean (nothing carried over)
  mesh = mesh_of((8,), ("d",))
  f = jax.jit(jax.shard_map(
      lambda v: jaxring.pmean(v[0, 0], "d", algorithm="ring",
                              compression=codecs.topk_chunks(0.05, 32))[None],
      mesh=mesh, in_specs=P(None, "d"), out_specs=P("d")))
  np.testing.assert_array_equal(np.asarray(f(g[:1]))[0], applied[0, 0])


def test_bf16_gradients_keep_f32_residuals():
  steps, n = 20, 700
  g = gradients(2, steps, n, jnp.bfloat16)
  applied, residual = run_steps(g, codecs.int8())
  true = np.asarray(g, np.float64).mean(1).sum(0)
  scale = np.abs(np.asarray(g, np.float64)).max()
  # applied values are bf16, the residual carries their rounding too
  np.testing.assert_allclose(applied[0].sum(0) + residual.mean(0), true, rtol=0,
                             atol=steps * 8 * scale * 2e-7)
  tx = jaxring.reduce_gradients("d", compression=codecs.int8())
  assert tx.init({"w": jnp.zeros(3, jnp.bfloat16)}).residual["w"].dtype == jnp.float32


# int8: a residual is one encode's error, <= max|partial| / 254 with partial sums of at most 8
# unit normals (+ residuals): <= 8 * 6 / 254 < 0.2. top-k (2 of 16 chunks a step): a chunk's
# residual grows until its norm wins a place; an unselected chunk left to drift would random-walk
# to ~sqrt(1000) = 32 standard deviations (measured worst with feedback: ~12.5).
@pytest.mark.slow   # 1000 steps per codec (~3 s)
@pytest.mark.parametrize("codec,limit", [(codecs.topk_chunks(0.125, 16), 20.0),
                                         (codecs.int8(block_size=64), 0.2)],
                         ids=["topk", "int8"])
def test_residual_stays_bounded_over_1000_steps(codec, limit):
  """Zero-mean unit-normal gradients, 1000 steps: the residual stays bounded and does not drift."""
  n, steps = 256, 1000
  tx = jaxring.reduce_gradients("d", algorithm="ring", compression=codec, plain_sgd_after=True)

  def body(key):
    me = lax.axis_index("d")
    state = tx.init(jnp.zeros(n))

    def step(carry, t):
      state, worst = carry
      g = jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, t), me), (n,))
      _, state = tx.update(g, state)
      size = jnp.abs(state.residual).max()
      return (state, jnp.maximum(worst, size)), size

    worst = lax.pcast(jnp.zeros(()), "d", to="varying")
    (state, worst), sizes = lax.scan(step, (state, worst), jnp.arange(steps))
    return worst[None], sizes[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh_of((8,), ("d",)), in_specs=P(),
                            out_specs=(P("d"), P("d"))))
  worst, sizes = (np.asarray(a) for a in f(jax.random.key(0)))
  assert worst.max() <= limit, worst
  # no drift: the last 200 steps are no worse than steps 200-400 (with a margin)
  assert sizes[:, 800:].max() <= 1.5 * sizes[:, 200:400].max()


@pytest.mark.slow   # trains, checkpoints and restores (~6 s)
def test_composes_with_optax_chain_and_checkpoints():
  n, steps = 300, 6
  g = gradients(3, steps, n)
  tx = optax.chain(jaxring.reduce_gradients("d", algorithm="ring",
                                            compression=codecs.topk_chunks(0.1, 10),
                                            plain_sgd_after=True),
                   optax.sgd(0.1))
  mesh = mesh_of((8,), ("d",))

  def init(params):
    return jax.tree.map(lambda v: v[None], tx.init(params))

  def train(params, state, gs):
    state = jax.tree.map(lambda v: v[0], state)  # the momentum, restored per member, is varying
    params = lax.pcast(params, "d", to="varying")

    def step(carry, gt):
      params, state = carry
      upd, state = tx.update(gt, state, params)
      return (optax.apply_updates(params, upd), state), None

    (params, state), _ = lax.scan(step, (params, state), gs[:, 0])
    return params[None], jax.tree.map(lambda v: v[None], state)

  params = jnp.zeros(n)
  state_spec = P("d")
  init_f = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=state_spec))
  train_f = jax.jit(jax.shard_map(train, mesh=mesh, in_specs=(P(), state_spec, P(None, "d")),
                                  out_specs=(P("d"), state_spec)))
  state0 = init_f(params)
  p_mid, mid = train_f(params, state0, g[:3])
  p_mid = p_mid[0]
  # save, restore, continue: same as continuing from the live state
  restored = flax.serialization.from_bytes(mid, flax.serialization.to_bytes(mid))
  a = train_f(p_mid, mid, g[3:])
  b = train_f(p_mid, jax.tree.map(jnp.asarray, restored), g[3:])
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  residual = mid[0].residual
  assert residual.shape == (8, n) and np.abs(np.asarray(residual)).max() > 0


def test_topk_with_error_feedback_is_refused_unless_plain_sgd_follows():
  topk = codecs.topk_chunks(0.01)
  with pytest.raises(ValueError, match=r"momentum_correction\(axis, compression=c, momentum=0.9\)"):
    jaxring.reduce_gradients("d", compression=topk)
  with pytest.raises(ValueError, match="compressed_adam"):
    jaxring.reduce_gradients("d", compression={"node": topk})
  jaxring.reduce_gradients("d", compression=topk, plain_sgd_after=True)   # stated: accepted
  jaxring.reduce_gradients("d", compression=topk, error_feedback=False)   # nothing held back
  jaxring.reduce_gradients("d", compression=codecs.int8())                # dense: any optimizer


def test_bad_arguments():
  with pytest.raises(TypeError, match="compression must be None"):
    jaxring.reduce_gradients("d", compression="int8")
  with pytest.raises(ValueError, match="algorithm must be one of"):
    jaxring.reduce_gradients("d", algorithm="tree")
