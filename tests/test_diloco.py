"""jaxring.diloco against a float64 NumPy DiLoCo: 2 nodes x 4 local devices, each device its own
data, gradients averaged over "local" every step and the pseudo-gradients over "node" every H
steps; Nesterov outer steps, streaming fragments, a delay, a warm-up, codecs with error
feedback; and every=1 with outer SGD(1) is synchronous data parallel."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxring as jr
from jaxring._src.optim.diloco_parts import fragment_of

LR, STEPS = 0.05, 12
RNG = np.random.default_rng(0)
X = RNG.normal(size=(8, 16, 5)).astype(np.float32)
Y = (X @ RNG.normal(size=(5, 1)) + 0.1 * RNG.normal(size=(8, 16, 1))).astype(np.float32)
P0 = {"b": np.zeros((1,), np.float32), "w": np.zeros((5, 1), np.float32)}


def loss(p, x, y):
  return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def grads64(p, i):
  """Device i's gradient of its own data, float64."""
  x, y = X[i].astype(np.float64), Y[i].astype(np.float64)
  r = x @ p["w"] + p["b"] - y
  return {"b": 2 * r.mean(0), "w": 2 * x.T @ r / r.size}


def reference(every, steps=STEPS, fragments=1, delay=0, warmup=0, lr_outer=0.7, momentum=0.9,
              nesterov=True):
  """DiLoCo in float64: per node, inner SGD on the mean of its 4 devices' gradients."""
  keys = sorted(P0)
  local = [{k: P0[k].astype(np.float64) for k in keys} for _ in range(2)]
  outer = {k: P0[k].astype(np.float64) for k in keys}
  mom = {k: np.zeros_like(outer[k]) for k in keys}
  frag = dict(zip(keys, fragment_of(P0, fragments)))
  pending = {k: (outer[k].copy(), [local[0][k].copy(), local[1][k].copy()]) for k in keys}
  for s in range(steps):
    gs = [[grads64(local[n], 4 * n + j) for j in range(4)] for n in range(2)]
    g = [{k: np.mean([gg[k] for gg in gs[n]], 0) for k in keys} for n in range(2)]
    if s < warmup:
      mean = {k: (g[0][k] + g[1][k]) / 2 for k in keys}
      for n in range(2):
        local[n] = {k: local[n][k] - LR * mean[k] for k in keys}
      outer = {k: local[0][k].copy() for k in keys}
      pending = {k: (outer[k].copy(), [local[0][k].copy(), local[1][k].copy()]) for k in keys}
      continue
    for n in range(2):
      local[n] = {k: local[n][k] - LR * g[n][k] for k in keys}
    t = s - warmup + 1
    for k in keys:
      offset = frag[k] * every // fragments
      if delay and t - delay - offset > 0 and (t - delay - offset) % every == 0:
        waiting, sent = pending[k]
        for n in range(2):
          local[n][k] = waiting + (local[n][k] - sent[n])
      if t - offset > 0 and (t - offset) % every == 0:
        pseudo = np.mean([outer[k] - local[n][k] for n in range(2)], 0)
        mom[k] = momentum * mom[k] + pseudo
        step = momentum * mom[k] + pseudo if nesterov else mom[k]
        outer[k] = outer[k] - lr_outer * step
        if delay:
          pending[k] = (outer[k].copy(), [local[0][k].copy(), local[1][k].copy()])
        else:
          for n in range(2):
            local[n][k] = outer[k].copy()
  return local


def train(tx, check_vma, steps=STEPS):
  """Each device's parameters after ``steps`` of ``tx`` (grads pmean'd over "local")."""
  mesh = jax.make_mesh((2, 4), ("node", "local"), axis_types=(AxisType.Auto,) * 2)
  axes = ("node", "local")

  def run(x, y):
    x, y = x[0], y[0]
    p = jax.tree.map(jnp.asarray, P0)
    if check_vma:   # each device's own parameters (else jax.grad would psum them over the mesh)
      p = jax.tree.map(lambda a: jax.lax.pcast(a, axes, to="varying"), p)
    s = tx.init(p)

    def body(carry, _):
      p, s = carry
      g = jax.lax.pmean(jax.grad(loss)(p, x, y), "local")
      u, s = tx.update(g, s, p)
      return (optax.apply_updates(p, u), s), None

    (p, _), _ = jax.lax.scan(body, (p, s), None, length=steps)
    return jax.tree.map(lambda a: a[None], p)

  f = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(P(axes), P(axes)), out_specs=P(axes),
                            check_vma=check_vma))
  return jax.tree.map(np.asarray, f(X, Y))


def assert_nodes_match(got, want, **tol):
  for n in range(2):
    for d in range(4):
      for k in P0:
        np.testing.assert_allclose(got[k][4 * n + d], want[n][k], **tol)


@pytest.mark.parametrize("check_vma", [False, True])
@pytest.mark.parametrize("kw", [dict(every=3), dict(every=4, fragments=2),
                                dict(every=4, fragments=2, delay=1), dict(every=3, warmup=2),
                                dict(every=5, delay=2)],
                         ids=["H3", "H4-fragments2", "H4-fragments2-delay1", "H3-warmup2",
                              "H5-delay2"])
def test_diloco_equals_the_float64_reference(kw, check_vma):
  tx = jr.diloco(optax.sgd(LR), axis="node", every=kw["every"],
                 fragments=kw.get("fragments", 1), delay=kw.get("delay", 0),
                 warmup_steps=kw.get("warmup", 0))
  assert_nodes_match(train(tx, check_vma), reference(**kw), rtol=2e-5, atol=2e-6)


def test_every_step_with_outer_sgd_1_is_synchronous_data_parallel():
  tx = jr.diloco(optax.sgd(LR), axis="node", every=1, outer=optax.sgd(1.0))
  got = train(tx, False)
  want = reference(every=1, lr_outer=1.0, momentum=0.0)
  assert_nodes_match(got, want, rtol=2e-5, atol=2e-6)
  p = {k: v.astype(np.float64) for k, v in P0.items()}   # plain SGD on all 8 devices' mean
  for _ in range(STEPS):
    g = [grads64(p, i) for i in range(8)]
    p = {k: p[k] - LR * np.mean([gg[k] for gg in g], 0) for k in p}
  for k in P0:
    np.testing.assert_allclose(got[k][0], p[k], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_a_compressed_outer_sync_loses_nothing_with_error_feedback(codec):
  """With outer SGD(1) the outer parameters move by the averaged pseudo-gradients: with error
  feedback those sum, with the members' mean residual, to the exact averages' sum."""
  c = {"bf16": jr.codecs.bf16(), "int8": jr.codecs.int8()}[codec]
  exact = train(jr.diloco(optax.sgd(LR), axis="node", every=3, outer=optax.sgd(1.0)), False)
  got = train(jr.diloco(optax.sgd(LR), axis="node", every=3, outer=optax.sgd(1.0),
                        compression=c), False)
  for k in P0:   # the codec's rounding, within its bound, and not accumulating
    np.testing.assert_allclose(got[k], exact[k], rtol=0, atol=2e-2 if codec == "int8" else 5e-3)
    np.testing.assert_array_equal(got[k][0], got[k][7])   # one outer model after the sync


def test_residual_carries_what_the_codec_left_out():
  # every=2, 4 steps: after each sync, what the outer moves + the mean residual = the exact sum
  mesh = jax.make_mesh((2, 4), ("node", "local"), axis_types=(AxisType.Auto,) * 2)
  tx = jr.diloco(optax.sgd(LR), axis="node", every=2, outer=optax.sgd(1.0),
                 compression=jr.codecs.int8())
  axes = ("node", "local")

  def run(x, y):
    x, y = x[0], y[0]
    p = jax.tree.map(jnp.asarray, P0)
    s = tx.init(p)
    applied = jax.tree.map(jnp.zeros_like, p)
    exact = jax.tree.map(jnp.zeros_like, p)
    for _ in range(4):
      g = jax.lax.pmean(jax.grad(loss)(p, x, y), "local")
      u, s = tx.update(g, s, p)
      exact = jax.tree.map(lambda e, a: e + jax.lax.pmean(a, "node"), exact,
                           jax.tree.map(lambda a: -LR * a, g))
      applied = jax.tree.map(lambda a, b: a + b, applied, u)
      p = optax.apply_updates(p, u)
    mean_res = jax.tree.map(lambda r: jax.lax.pmean(r, "node"), s.residual)
    return jax.tree.map(lambda a, e, r: (a - r - e)[None], applied, exact, mean_res)

  f = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(P(axes), P(axes)), out_specs=P(axes),
                            check_vma=False))
  gap = f(X, Y)
  # applied + mean residual = exact: the outer updates are -pseudo-gradients (pseudo = outer -
  # local = +LR * g), the residual is on the pseudo-gradient, so applied - (-res) ... = exact
  for k in P0:
    assert float(np.max(np.abs(np.asarray(gap[k])))) < 1e-5, (k, gap[k])


def sparse_reference(every, k, decay, shares=1, steps=STEPS, lr_outer=0.7, momentum=0.9):
  """DiLoCo whose sync sends the top ``k`` values (SparseLoCo, chunks of 1) in float64: per
  node ``v = decay * e + pseudo``; in each of ``shares`` equal parts of the flat values (padded)
  the k of largest ``|v|`` summed over the nodes are averaged, the rest kept in ``e``; Nesterov
  outer steps, as :func:`reference`."""
  keys = sorted(P0)
  flat = lambda p: np.concatenate([p[q].ravel() for q in keys])  # noqa: E731 (tree order)
  tree = lambda v: {"b": v[:1], "w": v[1:].reshape(5, 1)}  # noqa: E731
  local = [{q: P0[q].astype(np.float64) for q in keys} for _ in range(2)]
  outer, mom, res = flat(local[0]), np.zeros(6), [np.zeros(6), np.zeros(6)]
  for s in range(steps):
    for n in range(2):
      g = [grads64(local[n], 4 * n + j) for j in range(4)]
      local[n] = {q: local[n][q] - LR * np.mean([gg[q] for gg in g], 0) for q in keys}
    if (s + 1) % every:
      continue
    v = [decay * res[n] + outer - flat(local[n]) for n in range(2)]
    score = np.pad(np.abs(v[0]) + np.abs(v[1]), (0, -6 % shares), constant_values=-1)
    part = score.size // shares
    chosen = np.concatenate([j * part + np.argsort(-score[j * part:(j + 1) * part],
                                                   kind="stable")[:k] for j in range(shares)])
    chosen = chosen[chosen < 6]
    pseudo = np.zeros(6)
    pseudo[chosen] = (v[0][chosen] + v[1][chosen]) / 2
    for n in range(2):
      res[n] = v[n].copy()
      res[n][chosen] = 0
    mom = momentum * mom + pseudo
    outer = outer - lr_outer * (momentum * mom + pseudo)
    local = [tree(outer.copy()) for _ in range(2)]
  return local


@pytest.mark.parametrize("decay", [1.0, 0.5])
@pytest.mark.parametrize("shard", [None, "none", "optimizer"])
def test_top_k_outer_sync_with_a_decayed_residual_equals_the_float64_reference(decay, shard):
  """3 of the 6 values sent; over fast_axes each of a node's 4 devices sends 1 of its 2."""
  codec = jr.codecs.topk_chunks(0.5, chunk_size=1, per_tensor=False)
  kw = {} if shard is None else dict(fast_axes="local", shard=shard)
  tx = jr.diloco(optax.sgd(LR), axis="node", every=3, compression=codec, residual_decay=decay,
                 **kw)
  got = train(tx, False)
  k, shares = (3, 1) if shard is None else (1, 4)
  assert_nodes_match(got, sparse_reference(3, k, decay, shares), rtol=2e-5, atol=2e-6)
  other = sparse_reference(3, k, 1.5 - decay, shares)   # the decay changes the result
  assert not np.allclose(got["w"][0], other[0]["w"], rtol=1e-3)


def test_a_sparsifying_codec_decays_its_residual_by_default():
  from jaxring._src.optim.diloco import SPARSE_DECAY
  codec = jr.codecs.topk_chunks(0.5, chunk_size=1, per_tensor=False)
  got = train(jr.diloco(optax.sgd(LR), axis="node", every=3, compression=codec), False)
  assert SPARSE_DECAY < 1
  assert_nodes_match(got, sparse_reference(3, 3, SPARSE_DECAY), rtol=2e-5, atol=2e-6)


def test_arguments_are_checked():
  with pytest.raises(ValueError, match="every must be >= 1"):
    jr.diloco(optax.sgd(0.1), every=0)
  with pytest.raises(ValueError, match="residual_decay must be in"):
    jr.diloco(optax.sgd(0.1), every=3, residual_decay=0.0)
  with pytest.raises(ValueError, match="delay=3 must be below every=3"):
    jr.diloco(optax.sgd(0.1), every=3, delay=3)
  with pytest.raises(ValueError, match="every=1.*use shard='none'"):
    jr.diloco(optax.sgd(0.1), every=1, fast_axes="local", shard="optimizer",
              compression=jr.codecs.int8())


def test_in_an_nnx_optimizer_and_a_linen_train_state_inside_shard_map():
  """The transform is optax: an nnx.Optimizer and a flax TrainState built on it, stepped inside
  a shard_map as their users write, give the pytree run's parameters."""
  from flax import nnx
  from flax.training import train_state

  mesh = jax.make_mesh((2, 4), ("node", "local"), axis_types=(AxisType.Auto,) * 2)
  axes = ("node", "local")
  tx = jr.diloco(optax.sgd(LR), axis="node", every=3)
  want = train(tx, False)

  class Linear(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.zeros((5, 1)))
      self.b = nnx.Param(jnp.zeros((1,)))

    def __call__(self, x):
      return x @ self.w[...] + self.b[...]

  def nnx_run(x, y):
    x, y = x[0], y[0]
    model = Linear()
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    for _ in range(STEPS):
      grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
      optimizer.update(model, jax.lax.pmean(grads, "local"))
    return {"b": model.b[...][None], "w": model.w[...][None]}

  def linen_run(x, y):
    x, y = x[0], y[0]
    state = train_state.TrainState.create(apply_fn=None, params=jax.tree.map(jnp.asarray, P0),
                                          tx=tx)
    for _ in range(STEPS):
      g = jax.lax.pmean(jax.grad(loss)(state.params, x, y), "local")
      state = state.apply_gradients(grads=g)
    return jax.tree.map(lambda a: a[None], state.params)

  for run in (nnx_run, linen_run):
    got = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(P(axes), P(axes)), out_specs=P(axes),
                                check_vma=False))(X, Y)
    for k in P0:
      np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("codec", [None, "int8"])
def test_fast_axes_change_the_plan_not_the_result(codec):
  """fast_axes=("local",): the pseudo-gradient, equal on a node's devices, is averaged over
  ("node", "local") hierarchically (a device sends 1/4 of it over the node link): the same
  outer model as the reference (exact) or within int8's rounding of the plain sync."""
  c = None if codec is None else jr.codecs.int8()
  kw = dict(axis="node", every=3, compression=c)
  got = train(jr.diloco(optax.sgd(LR), fast_axes=("local",), **kw), False)
  if codec is None:
    assert_nodes_match(got, reference(every=3), rtol=2e-5, atol=2e-6)
  else:
    plain = train(jr.diloco(optax.sgd(LR), **kw), False)
    for k in P0:
      np.testing.assert_allclose(got[k], plain[k], rtol=0, atol=2e-2)
      np.testing.assert_array_equal(got[k][0], got[k][7])   # one outer model after the sync


@pytest.mark.parametrize("check_vma", [False, True])
@pytest.mark.parametrize("kw", [dict(every=3), dict(every=4, fragments=2, delay=1),
                                dict(every=3, warmup=2), dict(every=3, fragments=3)],
                         ids=["H3", "H4-fragments2-delay1", "H3-warmup2", "H3-empty-fragment"])
def test_outer_state_split_over_the_fast_axes_changes_nothing(kw, check_vma):
  """shard="optimizer": each of a node's 4 devices keeps a quarter of the outer parameters and
  momentum and steps it; the nodes' models are still the reference's (3 fragments over 2 leaves
  leave one empty)."""
  tx = jr.diloco(optax.sgd(LR), axis="node", every=kw["every"], fast_axes="local",
                 shard="optimizer", fragments=kw.get("fragments", 1), delay=kw.get("delay", 0),
                 warmup_steps=kw.get("warmup", 0))
  assert_nodes_match(train(tx, check_vma), reference(**kw), rtol=2e-5, atol=2e-6)


def outer_state_sizes(tx):
  """Values per device of the state's outer parameters, outer optimizer state and pending
  fragments."""
  mesh = jax.make_mesh((2, 4), ("node", "local"), axis_types=(AxisType.Auto,) * 2)

  def run(x):
    s = tx.init(jax.tree.map(jnp.asarray, P0))
    sizes = [sum(int(np.size(a)) for a in jax.tree.leaves(t))
             for t in (s.outer_params, s.outer, s.pending)]
    return jnp.asarray(sizes)[None] + jnp.zeros_like(x[:1, 0, 0, 0], jnp.int32)

  f = jax.shard_map(run, mesh=mesh, in_specs=P(("node", "local")),
                    out_specs=P(("node", "local")), check_vma=False)
  return np.asarray(jax.jit(f)(X[:, None]))[0]


def test_split_outer_state_is_a_share_and_int8_matches_the_whole():
  # 6 values: a share of 2 (padded to 8 over 4 devices) of parameters, momentum and, with a
  # delay, the pending move (one copy whole: what the waiting outer parameters add)
  kw = dict(axis="node", every=3, fast_axes="local", delay=1)
  whole = outer_state_sizes(jr.diloco(optax.sgd(LR), **kw))
  split = outer_state_sizes(jr.diloco(optax.sgd(LR), shard="optimizer", **kw))
  assert list(whole) == [6, 6, 6] and list(split) == [2, 2, 2], (whole, split)
  kw = dict(axis="node", every=3, fast_axes="local", compression=jr.codecs.int8())
  got = train(jr.diloco(optax.sgd(LR), shard="optimizer", **kw), False)
  plain = train(jr.diloco(optax.sgd(LR), **kw), False)
  for k in P0:   # the same shares synced: only where the outer step runs differs
    np.testing.assert_allclose(got[k], plain[k], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got[k][0], got[k][7])   # one outer model after the sync


def test_split_outer_state_needs_the_fast_axes():
  with pytest.raises(ValueError, match="name them, e.g. fast_axes='local'"):
    jr.diloco(optax.sgd(0.1), every=3, shard="optimizer")
  with pytest.raises(ValueError, match="shard must be one of"):
    jr.diloco(optax.sgd(0.1), every=3, shard="params")
  tx = jr.diloco(optax.sgd(0.1), every=3, fast_axes="local", shard="optimizer")
  with pytest.raises(ValueError, match=r"fast axes \('local',\) are not bound here; call"):
    jax.jit(tx.init)(P0)   # traced outside the shard_map
  whole = tx.init(P0)      # eager: the fragments whole, for a train step to cut
  assert [np.shape(x) for x in whole.outer_params.values()] == [(1,), (5, 1)]
  mesh = jax.make_mesh((2, 4), ("node", "local"), axis_types=(AxisType.Auto,) * 2)
  update = jax.shard_map(lambda g, s, p: tx.update(g, s, p), mesh=mesh, in_specs=P(),
                         out_specs=P(), check_vma=False)
  with pytest.raises(ValueError, match=r"whole fragments \(6 values, not this member's share of "
                     r"2\): its init ran outside the fast axes \('local',\)"):
    update(P0, whole, P0)


@pytest.mark.parametrize("kw", [dict(every=3, compression=jr.codecs.int8()),
                                dict(every=4, fragments=2, delay=1),
                                dict(every=3, fast_axes="local", shard="optimizer")],
                         ids=["H3-int8", "H4-fragments2-delay1", "H3-split"])
def test_outer_state_in_host_memory_changes_nothing(kw):
  """outer_memory="host": the outer parameters, the outer momentum and the residual live in host
  memory between syncs (checked on a step's returned state) and the run, a scan inside
  shard_map, is the device form's bit for bit."""
  make = lambda memory: jr.diloco(optax.sgd(LR), axis="node", outer_memory=memory, **kw)  # noqa: E731
  got, want = train(make("host"), True), train(make("device"), True)
  for k in P0:
    np.testing.assert_array_equal(got[k], want[k])
  mesh = jax.make_mesh((2, 4), ("node", "local"), axis_types=(AxisType.Auto,) * 2)
  tx, axes = make("host"), ("node", "local")

  def one_step(x, y):
    p = jax.tree.map(lambda a: jax.lax.pcast(jnp.asarray(a), axes, to="varying"), P0)
    s = tx.init(p)
    g = jax.lax.pmean(jax.grad(loss)(p, x[0], y[0]), "local")
    _, s = tx.update(g, s, p)
    return jax.tree.map(lambda a: a[None], s)

  state = jax.jit(jax.shard_map(one_step, mesh=mesh, in_specs=(P(axes), P(axes)),
                                out_specs=P(axes)))(X, Y)
  kinds = lambda t: {a.sharding.memory_kind for a in jax.tree.leaves(t)}  # noqa: E731
  assert kinds((state.outer_params, state.outer)) == {"pinned_host"}, state
  assert kinds(state.residual) <= {"pinned_host"} and kinds(state.count) == {"device"}
  with pytest.raises(ValueError, match="outer_memory must be one of"):
    jr.diloco(optax.sgd(0.1), every=3, outer_memory="disk")
  with pytest.raises(NotImplementedError, match="transfer='host' moves the sync by ordered"):
    jr.diloco(optax.sgd(0.1), every=3, delay=1, transfer="host", outer_memory="host")
