"""NNX steps with lossy codecs, top-k with the step's momentum, error feedback and mixed
precision: each equals the same model written in Linen through ``@jaxring.train_step`` with the
same settings (the residuals and the loss scale carried from step to step, here in the
``nnx.Optimizer``), and error feedback loses nothing against the exact one-device gradients.
Lossless steps, BatchNorm, dropout and the errors: tests/test_nnx.py."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import AxisType, Mesh

import jaxring as jr
from jaxring._src.train.state import residual_tree

TOL = {"rtol": 1e-5, "atol": 1e-6}


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(8, 16, rngs=rngs)
    self.l2 = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x)))


class LinenMLP(nn.Module):
  """MLP in Linen: the same parameter tree (``l1``/``l2``, ``kernel``/``bias``) and ops."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="l2")(jnp.tanh(nn.Dense(16, name="l1")(x)))


def mse(pred, y):
  return jnp.mean(jnp.square(pred - y))


def batches(n):
  rng = np.random.RandomState(0)
  return [{"x": rng.randn(32, 8).astype(np.float32),
           "y": rng.randn(32, 4).astype(np.float32)} for _ in range(n)]


def flat(tree) -> dict:
  """``{path: numpy array}`` of a pytree or an ``nnx.State``."""
  if isinstance(tree, nnx.State):
    tree = nnx.to_pure_dict(tree)
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def assert_trees_close(got, want, **tol):
  g, w = flat(got), flat(want)
  assert g.keys() == w.keys(), (g.keys(), w.keys())
  for k in w:
    np.testing.assert_allclose(g[k], w[k], err_msg=k, **(tol or TOL))


def mesh_2x4():
  return Mesh(np.asarray(jax.devices()).reshape(2, 4), ("node", "local"),
              axis_types=(AxisType.Auto,) * 2)


def nnx_step(mesh=None, **kw):
  @jr.train_step(mesh, **kw)
  def step(model, optimizer, batch):
    loss, grads = jr.value_and_grad(lambda m, x, y: mse(m(x), y))(model, batch["x"], batch["y"])
    optimizer.update(model, grads)
    return {"loss": loss}
  return step


def linen_step(mesh=None, **kw):
  @jr.train_step(mesh, **kw)
  def step(state, batch):
    loss, grads = jr.value_and_grad(lambda p, x, y: mse(state.apply_fn({"params": p}, x), y))(
        state.params, batch["x"], batch["y"])
    return state.apply_gradients(grads=grads), {"loss": loss}
  return step


def run_twins(tx, n=2, mesh=None, data=None, snapshots=None, **kw):
  """``n`` steps (or one per batch of ``data``) of the NNX model and of its Linen twin (the same
  initial parameters) through ``jr.train_step(mesh, **kw)``: every step's metrics must be equal,
  then the parameters, residuals and loss scale. Returns the NNX step, model, optimizer and
  metrics of each step; ``snapshots`` (a list) gets the NNX parameters after each step."""
  model = MLP(nnx.Rngs(0))
  opt = nnx.Optimizer(model, tx(), wrt=nnx.Param)
  # a copy of the initial parameters: the Linen step donates its state's buffers
  params = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  state = jr.TrainState.create(apply_fn=LinenMLP().apply, params=params, tx=tx())
  step, twin, history = nnx_step(mesh, **kw), linen_step(mesh, **kw), []
  for batch in data or batches(n):
    metrics = step(model, opt, batch)
    history.append(metrics)
    if snapshots is not None:
      snapshots.append(flat(nnx.state(model, nnx.Param)))
    state, want = twin(state, batch)
    assert metrics.keys() == want.keys()
    for k in want:
      np.testing.assert_allclose(np.asarray(metrics[k]), np.asarray(want[k]), err_msg=k, **TOL)
  assert_trees_close(nnx.state(model, nnx.Param), state.params)
  if residual_tree(state) is None:
    assert "residuals" not in nnx.state(opt)
  else:
    assert_trees_close(opt.residuals, residual_tree(state))
  if state.loss_scale is None:
    assert "loss_scale" not in nnx.state(opt)
  else:
    assert_trees_close(opt.loss_scale, {"good_steps": state.loss_scale.good_steps,
                                        "scale": state.loss_scale.scale})
  return step, model, opt, history


def sgd():
  return optax.sgd(0.1, momentum=0.9)


CODECS = {
    "bf16": {"compression": jr.codecs.bf16()},
    "fp16": {"compression": jr.codecs.fp16(block_size=64)},
    "int8": {"compression": jr.codecs.int8(block_size=64)},
    "per-level": {"axis_name": ("node", "local"), "algorithm": "hierarchical",
                  "compression": {"node": jr.codecs.int8(block_size=64),
                                  "local": jr.codecs.bf16()}},
}


@pytest.mark.parametrize("name", [   # the quick loop keeps int8; two 8-device steps (~3-7 s)
    n if n == "int8" else pytest.param(n, marks=pytest.mark.slow) for n in CODECS])
def test_lossy_codec_step_equals_its_linen_twin_and_keeps_residuals_in_the_optimizer(name):
  kw = dict(CODECS[name])
  mesh = mesh_2x4() if "axis_name" in kw else None
  kw.setdefault("algorithm", "ring")
  _, model, opt, _ = run_twins(sgd, mesh=mesh, bucket_bytes=256, **kw)
  residuals = flat(nnx.state(opt)["residuals"])
  params = flat(nnx.state(model, nnx.Param))
  assert residuals.keys() == params.keys()
  for k, r in residuals.items():
    assert r.shape == (8,) + params[k].shape          # a row per replica
  assert all(type(v).__name__ == "Residual" for v in jax.tree.leaves(
      opt.residuals, is_leaf=lambda x: isinstance(x, nnx.Variable)))
  assert any(np.abs(r).max() > 0 for r in residuals.values()), "the codec lost nothing"
  assert any(np.abs(r[0] - r[1]).max() > 0 for r in residuals.values())   # each replica's own


def test_error_feedback_carries_the_residual_and_loses_nothing():
  """int8 with error feedback, plain SGD at rate 1, three steps: the sum of the updates applied
  plus the replicas' mean residual is the sum of the exact mean gradients (one device, the
  global batch, at the step's own parameters). A residual not carried into the next step, or
  not the one applied, breaks the sum."""
  model = MLP(nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param)
  step = nnx_step(algorithm="ring", bucket_bytes=256, compression=jr.codecs.int8(block_size=64))
  graphdef = nnx.graphdef(model)

  @jax.jit
  def exact_grad(params, batch):
    return jax.grad(lambda p: mse(nnx.merge(graphdef, p)(batch["x"]), batch["y"]))(params)

  params = flat(nnx.state(model, nnx.Param))
  exact = {k: np.zeros_like(v) for k, v in params.items()}
  applied = {k: np.zeros_like(v) for k, v in params.items()}
  for batch in batches(3):
    g = flat(exact_grad(nnx.state(model, nnx.Param), batch))
    step(model, opt, batch)
    new = flat(nnx.state(model, nnx.Param))
    for k in params:
      exact[k] += g[k]
      applied[k] += params[k] - new[k]
    params = new
  residuals = flat(opt.residuals)
  lossy = False
  for k in params:
    np.testing.assert_allclose(applied[k] + residuals[k].mean(0), exact[k], atol=2e-6)
    lossy |= np.abs(applied[k] - exact[k]).max() > 1e-4
  assert lossy, "int8 lost nothing: the test would not see a missing residual"


def test_without_error_feedback_the_optimizer_keeps_no_residuals():
  """``error_feedback=False``: as the Linen twin, which keeps none either (run_twins checks)."""
  _, _, opt, _ = run_twins(sgd, algorithm="ring", bucket_bytes=256, error_feedback=False,
                           compression=jr.codecs.int8(block_size=64))
  assert "residuals" not in nnx.state(opt) and not hasattr(opt, "residuals")


@pytest.mark.slow   # three steps of two 8-device top-k steps with momentum (~5-9 s)
def test_topk_with_the_steps_momentum_equals_its_linen_twin():
  """topk_chunks with ``momentum=0.9`` and ``optax.sgd``: the velocity travels with the residuals
  in the optimizer, ``(replicas, 2 * size + 1)`` per parameter, three steps as in Linen."""
  codec = jr.codecs.topk_chunks(density=0.25, chunk_size=16)
  _, model, opt, _ = run_twins(lambda: optax.sgd(0.1), n=3, algorithm="ring", bucket_bytes=256,
                               compression=codec, momentum=0.9)
  params, held = flat(nnx.state(model, nnx.Param)), False
  for k, r in flat(opt.residuals).items():
    size = params[k].size
    assert r.shape == (8, 2 * size + 1)
    held |= np.abs(r[:, size:2 * size]).max() > 0     # the velocity of chunks not sent yet
  assert held


def test_topk_refuses_adam_and_names_the_supported_setting():
  model = MLP(nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  step = nnx_step(algorithm="ring", compression=jr.codecs.topk_chunks(0.25, chunk_size=16))
  before = flat(nnx.state(model))
  with pytest.raises(ValueError, match=r"topk_chunks with error feedback .* momentum=0\.9"):
    step(model, opt, batches(1)[0])
  after = flat(nnx.state(model))
  for k in before:
    np.testing.assert_array_equal(after[k], before[k], err_msg=k)


@pytest.mark.parametrize("precision", [   # the quick loop keeps fp16 (the loss scale; ~3 s)
    pytest.param("bf16", marks=pytest.mark.slow), "fp16"])
def test_mixed_precision_equals_its_linen_twin(precision):
  """bf16 computes in bf16 with float32 parameters; fp16 keeps its dynamic loss scale in the
  optimizer (``good_steps`` counting the finite steps) as the Linen state keeps it."""
  _, model, opt, history = run_twins(sgd, n=2, algorithm="ring", precision=precision)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  batch = batches(1)[0]
  f32_loss = float(mse(MLP(nnx.Rngs(0))(batch["x"]), batch["y"]))
  first = float(history[0]["loss"])
  assert history[0]["loss"].dtype == jnp.float32
  assert abs(first - f32_loss) > 1e-6 * f32_loss                  # computed in 16 bits
  np.testing.assert_allclose(first, f32_loss, rtol=2e-2)
  if precision == "fp16":
    state = nnx.state(opt)
    assert "loss_scale" in state
    assert int(opt.loss_scale["good_steps"][...]) == 2
    assert float(opt.loss_scale["scale"][...]) > 1
  else:
    assert "loss_scale" not in nnx.state(opt)


def test_fp16_overflow_on_one_replica_skips_the_step_and_halves_the_scale_in_the_optimizer():
  """Replica 3's examples overflow fp16: no parameter moves on any replica, the scale in
  ``optimizer.loss_scale`` halves and ``good_steps`` restarts, as in Linen."""
  wild, tame = batches(2)
  wild = dict(wild, y=wild["y"].copy())
  wild["y"][12:16] = 300.0     # (pred - y)**2 past fp16's 65504
  before = flat(nnx.state(MLP(nnx.Rngs(0)), nnx.Param))
  snapshots = []
  _, _, opt, history = run_twins(sgd, data=[tame, wild], snapshots=snapshots, algorithm="ring",
                                 precision="fp16")
  assert [float(m["grads_finite"]) for m in history] == [1.0, 0.0]
  assert float(history[1]["loss_scale"]) == float(history[0]["loss_scale"])
  assert float(opt.loss_scale["scale"][...]) == float(history[0]["loss_scale"]) / 2
  assert int(opt.loss_scale["good_steps"][...]) == 0
  assert any(np.abs(snapshots[0][k] - before[k]).max() > 0 for k in before)   # the tame step
  for k in before:
    np.testing.assert_array_equal(snapshots[1][k], snapshots[0][k], err_msg=k)  # skipped
