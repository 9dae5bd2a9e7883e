"""Momentum correction and compressed Adam (jaxring._src.optim) against float64 references.

Momentum correction keeps momentum SGD's bookkeeping exact whatever the codec: after T steps,

  sum_t applied_t + mean_i (r_i + c u_i) = sum_t mean_i g_i(t) / (1 - m),

with c = m / (1 - m) (Nesterov: m^2 / (1 - m)): every gradient is applied with momentum SGD's total
weight 1 / (1 - m), now, later, or still pending in a residual r_i or a velocity u_i. That holds
only if the errors, the momentum flush and the masking are each counted exactly once.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring import codecs

AUTO = jax.sharding.AxisType.Auto
MESH = jax.make_mesh((8,), ("d",), axis_types=(AUTO,))


def gradients(seed, steps, n):
  rng = np.random.RandomState(seed)
  g = rng.randn(steps, 8, n) * np.exp(rng.randn(1, 1, n)) + 0.3
  return jnp.asarray(g, jnp.float32)


def run(tx, grads, *, state_out=True):
  """Feeds grads[t, i] to member i; returns (applied [T, n] as member 0 saw them, final state with
  a leading member axis)."""
  n = grads.shape[-1]

  def body(g):
    state = tx.init(jnp.zeros(n))

    def step(state, gt):
      upd, state = tx.update(gt, state)
      return state, upd

    state, applied = lax.scan(step, state, g[:, 0])
    return applied[None], jax.tree.map(lambda v: v[None], state)

  f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P(None, "d"), out_specs=(P("d"), P("d"))))
  applied, state = f(grads)
  applied = np.asarray(applied, np.float64)
  for member in applied[1:]:
    np.testing.assert_array_equal(member, applied[0])
  return applied[0], state


CODECS = {
    "none": None,
    "int8": codecs.int8(),
    "bf16": codecs.bf16(),
    "topk": codecs.topk_chunks(0.05, 32),
    "topk+int8": codecs.topk_chunks(0.1, 64, inner=codecs.int8(64)),
}


@pytest.mark.parametrize("nesterov", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["heavy-ball", "nesterov"])
@pytest.mark.parametrize("name", [  # the quick loop keeps two (~0.5 s each)
    n if n in ("none", "topk") else pytest.param(n, marks=pytest.mark.slow) for n in CODECS])
def test_every_gradient_gets_momentum_sgds_total_weight(name, nesterov):
  m, steps, n = 0.9, 30, 1500
  g = gradients(0, steps, n)
  tx = jaxring.momentum_correction("d", algorithm="ring", compression=CODECS[name], momentum=m,
                                   nesterov=nesterov, clip_norm=None)
  applied, state = run(tx, g)
  c = (m * m if nesterov else m) / (1 - m)
  pending = (np.asarray(state.residual, np.float64) + c * np.asarray(state.velocity, np.float64))
  true = np.asarray(g, np.float64).mean(1).sum(0) / (1 - m)
  scale = np.abs(true).max()
  np.testing.assert_allclose(applied.sum(0) + pending.mean(0), true, rtol=0, atol=scale * 2e-5)
  if CODECS[name] is not None:  # compression held something back, which the state carried
    assert np.abs(pending.mean(0)).max() > 1e-2 * scale
  assert int(np.asarray(state.count)[0]) == steps


@pytest.mark.parametrize("nesterov", [False, True], ids=["heavy-ball", "nesterov"])
def test_uncompressed_it_is_momentum_sgd(nesterov):
  m, steps, n = 0.9, 12, 300
  g = gradients(1, steps, n)
  applied, _ = run(jaxring.momentum_correction("d", momentum=m, nesterov=nesterov,
                                               clip_norm=None), g)
  u = np.zeros(n)
  for t, gt in enumerate(np.asarray(g, np.float64).mean(1)):
    u = m * u + gt
    want = gt + m * u if nesterov else u
    np.testing.assert_allclose(applied[t], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.slow   # steps through the warm-up (~1.5 s)
def test_density_warms_up_by_factors_of_4():
  n, cs = 6400, 16                       # 400 chunks: 100, 25, 7, then 4 (1%) sent
  codec = codecs.topk_chunks(0.01, cs)
  tx = jaxring.momentum_correction("d", algorithm="ring", compression=codec, warmup_steps=30)
  applied, _ = run(tx, gradients(2, 40, n))
  sent = (np.abs(applied.reshape(40, -1, cs)).max(2) > 0).sum(1)
  np.testing.assert_array_equal(sent[[0, 9, 10, 19, 20, 29, 30, 39]],
                                [100, 100, 25, 25, 7, 7, 4, 4])


def test_local_clipping_bounds_each_members_gradient():
  n = 256
  g = gradients(3, 1, n) * 100
  applied, _ = run(jaxring.momentum_correction("d", momentum=0.0, clip_norm=1.0), g)
  gl = np.asarray(g[0], np.float64)
  limit = 1.0 / np.sqrt(8)
  want = (gl * np.minimum(1, limit / np.linalg.norm(gl, axis=1))[:, None]).mean(0)
  np.testing.assert_allclose(applied[0], want, rtol=1e-5, atol=1e-7)


def _auto_clip_reference(g):
  """float64 NumPy: clip_norm="auto" for each member of g [T, members, n]; returns the applied
  means [T, n] (momentum 0, no codec) and each member's final running norm."""
  from jaxring._src.optim.momentum import AUTO_CLIP_DECAY, AUTO_CLIP_FACTOR
  g = np.asarray(g, np.float64)
  avg = np.zeros(g.shape[1])
  applied = []
  for gt in g:
    norm = np.linalg.norm(gt, axis=1)
    limit = np.where(avg > 0, AUTO_CLIP_FACTOR * avg, np.inf)
    applied.append((gt * np.minimum(1, limit / norm)[:, None]).mean(0))
    kept = np.minimum(norm, limit)
    avg = np.where(avg > 0, AUTO_CLIP_DECAY * avg + (1 - AUTO_CLIP_DECAY) * kept, kept)
  return np.stack(applied), avg


def test_auto_clipping_follows_each_members_running_norm():
  """Spikes of 30x on some members and steps are cut to twice the member's running norm; the
  rest pass; each member's running norm is its own."""
  steps, n = 60, 128
  g = np.asarray(gradients(4, steps, n)) * np.linspace(0.5, 2.0, 8)[None, :, None]
  rng = np.random.RandomState(0)
  spikes = rng.rand(steps, 8) < 0.1
  g = jnp.asarray(np.where(spikes[..., None], 30 * g, g), jnp.float32)
  applied, state = run(jaxring.momentum_correction("d", momentum=0.0, clip_norm="auto"), g)
  want, avg = _auto_clip_reference(g)
  np.testing.assert_allclose(applied, want, rtol=2e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(state.grad_norm), avg, rtol=2e-5)
  assert np.abs(applied).max() < 0.2 * np.abs(np.asarray(g).mean(1)).max()  # spikes were cut


def test_clipping_is_auto_by_default():
  g = np.array(gradients(6, 20, 64))
  g[10, 3] *= 50                         # one member's spike
  codec = codecs.topk_chunks(0.25, 8)
  default, auto, off = (
      run(jaxring.momentum_correction("d", algorithm="ring", compression=codec, **kw),
          jnp.asarray(g))[0] for kw in ({}, {"clip_norm": "auto"}, {"clip_norm": None}))
  np.testing.assert_array_equal(default, auto)
  assert np.abs(off[10:]).max() > 3 * np.abs(auto[10:]).max()


def test_auto_clipping_passes_a_nonfinite_gradient_and_keeps_its_average():
  steps, n = 4, 64
  g = np.array(gradients(5, steps, n))
  g[3, 2, 7] = np.nan                   # member 2, the last step
  applied, state = run(jaxring.momentum_correction("d", momentum=0.0, clip_norm="auto"),
                       jnp.asarray(g))
  assert np.isnan(applied[3, 7])
  assert np.isfinite(applied[:3]).all() and np.isfinite(np.delete(applied[3], 7)).all()
  before, after = _auto_clip_reference(g[:3])[1], _auto_clip_reference(g[:, [0, 1, 3]])[1]
  np.testing.assert_allclose(np.asarray(state.grad_norm)[2], before[2], rtol=2e-5)
  np.testing.assert_allclose(np.asarray(state.grad_norm)[[0, 1, 3]], after, rtol=2e-5)


def test_quotas_share_the_global_count_between_tensors_by_size():
  tk = codecs.topk_chunks(0.1, 4)        # a pool needs 10 chunks (40 values) to earn one
  # chunks start at 0, 4, ...: the 2-value tensor's only chunk starts in the first tensor
  assert tk.quotas(400, [42, 2, 236, 120]) == [(0, 11, 1), (11, 70, 6), (70, 100, 3)]
  assert sum(q for *_, q in tk.quotas(1003, [1, 1, 1001])) == tk.num_selected(1003) == 26
  assert tk.quotas(36, [20, 16]) == [(0, 9, 1)]            # too small to split: one pool
  with pytest.raises(ValueError, match="summing to the buffer's 36 values"):
    tk.quotas(36, [20, 15])


def _per_tensor_reference(g: dict, codec) -> np.ndarray:
  """The chunks a per-tensor top-k sends for members' gradients ``g`` (name -> [8, size]),
  flattened in key order: per pool, those with the largest sum over members of their norm."""
  names = sorted(g)
  flat = np.concatenate([np.asarray(g[k], np.float64) for k in names], axis=1)
  norms = np.linalg.norm(flat.reshape(8, -1, codec.chunk_size), axis=2).sum(0)
  want = []
  for a, b, q in codec.quotas(flat.shape[1], [g[k].shape[1] for k in names]):
    want += list(a + np.argsort(-norms[a:b], kind="stable")[:q])
  return np.sort(want)


def _sent_chunks(tree: dict, cs: int) -> np.ndarray:
  flat = np.concatenate([np.asarray(tree[k], np.float64).ravel() for k in sorted(tree)])
  return np.flatnonzero(np.abs(flat.reshape(-1, cs)).max(1) > 0)


def _two_tensors(seed):
  """Gradients of a tensor of 200 chunks of 8 and one of 100 whose values are 1000x smaller."""
  rng = np.random.RandomState(seed)
  return {"a_big": rng.randn(8, 1600), "b_small": rng.randn(8, 800) * 1e-3}


@pytest.mark.parametrize("nesterov", [False, pytest.param(True, marks=pytest.mark.slow)],  # ~0.5 s
                         ids=["heavy-ball", "nesterov"])
def test_per_tensor_top_k_sends_each_tensors_largest_chunks(nesterov):
  """One step of momentum correction from zero state: the chunks sent are, per pool of tensors,
  those with the largest sum over members of their norm (float64), so the tensor of small
  gradients that the global selection starves gets its share (a third of the 15)."""
  g = _two_tensors(5)

  def sent_by(codec):
    tx = jaxring.momentum_correction("d", algorithm="ring", compression=codec, momentum=0.9,
                                     nesterov=nesterov)

    def body(gs):
      gs = jax.tree.map(lambda v: v[0], gs)
      upd, _ = tx.update(gs, tx.init(jax.tree.map(jnp.zeros_like, gs)))
      return jax.tree.map(lambda v: v[None], upd)

    f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P("d"), out_specs=P("d")))
    upd = f(jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), g))
    return _sent_chunks({k: v[0] for k, v in upd.items()}, 8)

  per_tensor = codecs.topk_chunks(0.05, 8)                     # the default
  assert per_tensor.per_tensor
  want = _per_tensor_reference(g, per_tensor)
  assert len(want) == per_tensor.num_selected(2400) == 15 and (want >= 200).sum() == 5
  np.testing.assert_array_equal(sent_by(per_tensor), want)
  global_ = codecs.topk_chunks(0.05, 8, per_tensor=False)
  assert (sent_by(global_) < 200).all()                        # global: all to a_big


@pytest.mark.parametrize("where", ["psum", "reduce_gradients"])
def test_per_tensor_top_k_in_psum_and_reduce_gradients(where):
  """The same selection where the engine fuses a pytree's leaves; the chunks sent carry the
  exact float64 sum over members."""
  g = _two_tensors(6)
  codec = codecs.topk_chunks(0.05, 8, per_tensor=True)

  def body(gs):
    gs = jax.tree.map(lambda v: v[0], gs)
    if where == "psum":
      out = jaxring.psum(gs, "d", algorithm="ring", compression=codec)
    else:
      tx = jaxring.reduce_gradients("d", algorithm="ring", compression=codec,
                                    plain_sgd_after=True)
      out, _ = tx.update(gs, tx.init(gs))
    return jax.tree.map(lambda v: v[None], out)

  f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P("d"), out_specs=P("d")))
  out = f(jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), g))
  out = {k: np.asarray(v[0], np.float64) for k, v in out.items()}
  want = _per_tensor_reference(g, codec)
  np.testing.assert_array_equal(_sent_chunks(out, 8), want)
  scale = 1.0 if where == "psum" else 8.0                   # reduce_gradients: the mean
  total = np.concatenate([g[k].sum(0) for k in sorted(g)]).reshape(-1, 8)
  got = np.concatenate([out[k] for k in sorted(out)]).reshape(-1, 8)
  bound = np.concatenate([np.abs(g[k]).sum(0) for k in sorted(g)]).reshape(-1, 8) * 1e-6
  assert (np.abs(got[want] * scale - total[want]) <= bound[want]).all()   # f32 rounding only


@pytest.mark.slow   # trains, saves and resumes (~8 s)
def test_state_resumes_bit_for_bit_from_an_orbax_checkpoint(tmp_path):
  n, steps = 2000, 8
  g = gradients(4, steps, n)
  tx = jaxring.momentum_correction("d", algorithm="ring", compression=codecs.topk_chunks(0.02, 32),
                                   nesterov=True, warmup_steps=4)

  def init(params):
    return jax.tree.map(lambda v: v[None], tx.init(params))

  def train(params, state, gs):
    state = jax.tree.map(lambda v: v[0], state)
    params = lax.pcast(params, "d", to="varying")

    def step(carry, gt):
      params, state = carry
      upd, state = tx.update(gt, state, params)
      return (optax.apply_updates(params, upd), state), None

    (params, state), _ = lax.scan(step, (params, state), gs[:, 0])
    return params[None], jax.tree.map(lambda v: v[None], state)

  init_f = jax.jit(jax.shard_map(init, mesh=MESH, in_specs=P(), out_specs=P("d")))
  train_f = jax.jit(jax.shard_map(train, mesh=MESH, in_specs=(P(), P("d"), P(None, "d")),
                                  out_specs=(P("d"), P("d"))))
  params = jnp.zeros(n)
  straight = train_f(params, init_f(params), g)
  p_mid, mid = train_f(params, init_f(params), g[:5])
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "mid", {"params": p_mid, "opt": mid})
  with ocp.StandardCheckpointer() as ckpt:
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": p_mid, "opt": mid})
    restored = ckpt.restore(tmp_path / "mid", abstract)
  assert isinstance(restored["opt"], jaxring.MomentumCorrectionState)
  resumed = train_f(restored["params"][0], restored["opt"], g[5:])
  for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _adam_reference(gmean, b1, b2, eps):
  mu, nu, out = 0.0, 0.0, []
  for t, gt in enumerate(gmean, 1):
    mu = b1 * mu + (1 - b1) * gt
    nu = b2 * nu + (1 - b2) * gt * gt
    out.append(mu / (1 - b1 ** t) / (np.sqrt(nu / (1 - b2 ** t)) + eps))
  return np.asarray(out), mu, nu


@pytest.mark.parametrize("name", ["none", pytest.param("topk", marks=pytest.mark.slow)])  # ~0.8 s
def test_compressed_adam_is_adam_then_keeps_the_frozen_preconditioned_total(name):
  b1, b2, eps, warm, steps, n = 0.9, 0.999, 1e-8, 5, 25, 1500
  g = gradients(5, steps, n)
  gmean = np.asarray(g, np.float64).mean(1)
  tx = jaxring.compressed_adam("d", algorithm="ring", compression=CODECS[name], warmup_steps=warm,
                               variance_every=0)
  applied, state = run(tx, g)
  want, mu, nu = _adam_reference(gmean[:warm], b1, b2, eps)
  np.testing.assert_allclose(applied[:warm], want, rtol=2e-4, atol=2e-4)   # exact Adam
  # afterwards: sum of updates + pending = (b1/(1-b1) u0 + sum_t g_t) pre (frozen pre; the
  # velocity and residual are in gradient units, u0 the bias-corrected first moment)
  pre = 1 / (np.sqrt(nu / (1 - b2 ** warm)) + eps)
  c = b1 / (1 - b1)
  pending = (np.asarray(state.residual, np.float64)
             + c * np.asarray(state.velocity, np.float64)) * pre
  true = (c * mu / (1 - b1 ** warm) + gmean[warm:].sum(0)) * pre
  np.testing.assert_allclose(applied[warm:].sum(0) + pending.mean(0), true, rtol=2e-4,
                             atol=2e-4 * np.abs(true).max())
  if name == "none":  # nothing pending after an exact reduction but the velocity's tail
    np.testing.assert_allclose(np.asarray(state.residual), 0, atol=1e-6 * np.abs(true).max())


def test_compressed_optimizer_picks_the_supported_composition():
  params = jnp.zeros(64)
  topk = codecs.topk_chunks(0.01)

  def state_types(tx):
    return {type(s).__name__ for s in jax.tree.leaves(
        jax.eval_shape(tx.init, params), is_leaf=lambda s: isinstance(s, tuple) and hasattr(
            s, "_fields"))}

  assert "MomentumCorrectionState" in state_types(
      jaxring.compressed_optimizer("nesterov", 0.1, "d", compression=topk))
  assert "CompressedAdamState" in state_types(
      jaxring.compressed_optimizer("adamw", 1e-3, "d", compression=topk, weight_decay=1e-4))
  dense = state_types(jaxring.compressed_optimizer("momentum", 0.1, "d",
                                                   compression=codecs.int8()))
  assert "TraceState" in dense and "ReduceGradientsState" in dense
  with pytest.raises(ValueError, match="unknown optimizer"):
    jaxring.compressed_optimizer("lion", 0.1, "d")


def test_compressed_adam_refreshes_the_variance_from_exact_gradients():
  b2, warm, every, steps, n = 0.999, 3, 4, 12, 500
  g = gradients(6, steps, n)
  gmean = np.asarray(g, np.float64).mean(1)
  tx = jaxring.compressed_adam("d", algorithm="ring", compression=CODECS["topk"],
                               warmup_steps=warm, variance_every=every)
  _, state = run(tx, g)
  nu = 0.0
  for gt in gmean[:warm]:
    nu = b2 * nu + (1 - b2) * gt * gt
  for t in range(warm, steps):   # refreshed at the last step of every `every` after the warm-up
    if (t - warm) % every == every - 1:
      nu = b2 ** every * nu + (1 - b2 ** every) * gmean[t] ** 2
  np.testing.assert_allclose(np.asarray(state.nu)[0], nu, rtol=1e-4, atol=1e-12)


def test_bad_arguments():
  with pytest.raises(ValueError, match="momentum must be in"):
    jaxring.momentum_correction("d", momentum=1.0)
  with pytest.raises(ValueError, match="masking must be one of"):
    jaxring.momentum_correction("d", masking="half")
  for bad in ("adaptive", 0.0, -1):
    with pytest.raises(ValueError, match="clip_norm must be None, 'auto' or positive"):
      jaxring.momentum_correction("d", clip_norm=bad)
  with pytest.raises(ValueError, match="per_tensor must be True or False"):
    codecs.topk_chunks(0.01, per_tensor="yes")
  with pytest.raises(ValueError, match="warmup_steps must be >= 1"):
    jaxring.compressed_adam("d", warmup_steps=0)


def _trust_reference(updates, params, warm, bound, decay=0.98):
  """float64 NumPy: LAMB's ratio ||w|| / ||u|| per leaf, its bias-corrected running mean over the
  first ``warm`` steps, then the ratio clipped to [mean / bound, mean * bound]."""
  out, mean = [], {k: 0.0 for k in params[0]}
  for t, (u, w) in enumerate(zip(updates, params)):
    step = {}
    for k in u:
      r = np.linalg.norm(w[k]) / np.linalg.norm(u[k])
      if t < warm:
        mean[k] = decay * mean[k] + (1 - decay) * r
        step[k] = u[k] * r
      else:
        m = mean[k] / (1 - decay ** warm)
        step[k] = u[k] * np.clip(r, m / bound, m * bound)
    out.append(step)
  return out


@pytest.mark.parametrize("bound", [1.0, pytest.param(1.5, marks=pytest.mark.slow)])  # ~0.5 s
def test_frozen_trust_ratio_is_lambs_then_held_near_its_mean(bound):
  from jaxring._src.optim.lamb import frozen_trust_ratio
  rng = np.random.RandomState(7)
  warm, steps = 4, 9
  shapes = {"w": (6, 5), "b": (7,)}
  ups = [{k: rng.randn(*s) * np.exp(rng.randn()) for k, s in shapes.items()} for _ in range(steps)]
  ws = [{k: rng.randn(*s) * (1 + t) for k, s in shapes.items()} for t in range(steps)]
  tx = frozen_trust_ratio(warm, bound=bound)
  state = tx.init(jax.tree.map(jnp.asarray, ws[0]))
  update = jax.jit(tx.update)
  got = []
  for u, w in zip(ups, ws):
    out, state = update(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), u), state,
                        jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), w))
    got.append(out)
  want = _trust_reference(ups, ws, warm, bound)
  lamb = optax.scale_by_trust_ratio()
  for t in range(steps):
    for k in shapes:
      np.testing.assert_allclose(np.asarray(got[t][k]), want[t][k], rtol=1e-5,
                                 atol=1e-6 * np.abs(want[t][k]).max())
    if t < warm:  # LAMB's own ratio while the reduction is exact
      f32 = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree)  # noqa: E731
      ref, _ = lamb.update(f32(ups[t]), optax.EmptyState(), f32(ws[t]))
      for k in shapes:
        np.testing.assert_allclose(np.asarray(got[t][k]), ref[k], rtol=1e-5)


@pytest.mark.slow   # steps LAMB beside optax's (~1 s)
def test_lamb_uncompressed_is_optax_lamb_on_the_mean_gradient():
  lr, steps, n = 1e-2, 6, 300
  g = gradients(8, steps, n)
  w0 = jnp.asarray(np.random.RandomState(9).randn(n), jnp.float32)
  tx = jaxring.compressed_optimizer("lamb", lr, "d", algorithm="ring", weight_decay=1e-3)

  def body(w, g):
    w = lax.pcast(w, "d", to="varying")
    state = tx.init(w)

    def step(carry, gt):
      w, state = carry
      upd, state = tx.update(gt, state, w)
      return (optax.apply_updates(w, upd), state), None

    (w, _), _ = lax.scan(step, (w, state), g[:, 0])
    return w[None]

  f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(P(), P(None, "d")), out_specs=P("d")))
  ref = optax.lamb(lr, eps=1e-8, weight_decay=1e-3)
  with jax.numpy_dtype_promotion("standard"):   # optax's bias correction: float ** int32
    got = np.asarray(f(w0, g))
    w, state = w0, ref.init(w0)
    for gt in np.asarray(g, np.float64).mean(1):
      upd, state = ref.update(jnp.asarray(gt, jnp.float32), state, w)
      w = optax.apply_updates(w, upd)
  for member in got:
    np.testing.assert_allclose(member, np.asarray(w), rtol=2e-5, atol=2e-6)


def test_lamb_over_topk_is_refused_with_the_supported_line():
  topk = codecs.topk_chunks(0.01)
  with pytest.raises(ValueError, match=r"compression=jr.codecs.int8\(\)"):
    jaxring.compressed_optimizer("lamb", 1e-2, "d", compression=topk)
  with pytest.raises(ValueError, match="plain_sgd_after"):   # what people write: refused too
    optax.chain(jaxring.reduce_gradients("d", compression=topk), optax.lamb(1e-2))
  state = jax.eval_shape(jaxring.compressed_optimizer("lamb", 1e-2, "d",
                                                      compression=codecs.int8()).init,
                         {"w": jnp.zeros(64)})
  assert "ScaleByAdamState" in {type(s).__name__ for s in jax.tree.leaves(
      state, is_leaf=lambda s: isinstance(s, tuple) and hasattr(s, "_fields"))}
