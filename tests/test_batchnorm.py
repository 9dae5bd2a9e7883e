"""recipes.batchnorm: the two-pass BatchNorm (+ReLU) against flax.linen.BatchNorm and a float64
NumPy reference: outputs, gradients of every input, running statistics, inference mode, and the
ResNet built on either (same parameter tree, same gradients)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recipes import batchnorm, models


def _numpy_bn(x, scale, bias, relu, eps=1e-5):
  """float64 reference: (y, mean, var) and the VJP by hand-written backprop."""
  x = x.astype(np.float64)
  axes = tuple(range(x.ndim - 1))
  mean = x.mean(axes)
  var = x.var(axes)
  xhat = (x - mean) / np.sqrt(var + eps)
  z = xhat * scale + bias
  y = np.maximum(z, 0) if relu else z

  def vjp(dy):
    dz = np.where(z > 0, dy, 0) if relu else dy
    n = x.size // x.shape[-1]
    dxhat = dz * scale
    dx = (dxhat - dxhat.mean(axes) - xhat * (dxhat * xhat).mean(axes)) / np.sqrt(var + eps)
    return dx, (dz * xhat).sum(axes), dz.sum(axes), n
  return y, mean, var, vjp


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("shape", [  # the quick loop keeps (3, 7); the others ~0.5 s each
    pytest.param((4, 5, 5, 6), marks=pytest.mark.slow), (3, 7),
    pytest.param((2, 3, 3, 3, 4), marks=pytest.mark.slow)])
def test_values_and_gradients_match_float64(relu, shape):
  rng = np.random.default_rng(0)
  x = (rng.normal(size=shape) * 3 + 1).astype(np.float32)
  scale = rng.normal(size=shape[-1]).astype(np.float32)
  bias = rng.normal(size=shape[-1]).astype(np.float32)
  dy = rng.normal(size=shape).astype(np.float32)
  y, mean, var, vjp = _numpy_bn(x, scale, bias, relu)
  dx, dscale, dbias, _ = vjp(dy)

  (got, got_mean, got_var), pullback = jax.vjp(
      lambda x, s, b: batchnorm.batch_norm_train(x, s, b, relu, 1e-5), x, scale, bias)
  got_dx, got_dscale, got_dbias = pullback((jnp.asarray(dy), jnp.zeros_like(got_mean),
                                            jnp.zeros_like(got_var)))
  np.testing.assert_allclose(got, y, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(got_mean, mean, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_var, var, rtol=1e-4)
  np.testing.assert_allclose(got_dx, dx, rtol=1e-3, atol=1e-4)
  np.testing.assert_allclose(got_dscale, dscale, rtol=1e-3, atol=1e-3)
  np.testing.assert_allclose(got_dbias, dbias, rtol=1e-4, atol=1e-4)


@pytest.mark.slow   # differentiates through the statistics (~1 s)
def test_gradient_flows_through_the_returned_statistics():
  """The returned mean and variance are differentiable too (their cotangents are not dropped)."""
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 3, 5)) * 2 + 0.5
  w = jax.random.normal(jax.random.PRNGKey(1), x.shape)

  def ours(x):
    y, m, v = batchnorm.batch_norm_train(x, jnp.full(5, 1.5), jnp.full(5, 0.1), True, 1e-5)
    return jnp.sum(y * w) + jnp.sum(m ** 2) + jnp.sum(jnp.sin(v))

  def reference(x):
    m, v = jnp.mean(x, (0, 1)), jnp.var(x, (0, 1))
    y = jnp.maximum((x - m) * jax.lax.rsqrt(v + 1e-5) * 1.5 + 0.1, 0)
    return jnp.sum(y * w) + jnp.sum(m ** 2) + jnp.sum(jnp.sin(v))
  np.testing.assert_allclose(jax.grad(ours)(x), jax.grad(reference)(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("train", [pytest.param(True, marks=pytest.mark.slow), False])  # ~3 s
def test_module_matches_flax_batchnorm_and_relu(train):
  x = jax.random.normal(jax.random.PRNGKey(0), (6, 4, 4, 8)) * 2 + 1
  ref = models.FlaxBatchNorm(use_running_average=not train, momentum=0.9, relu=True)
  ours = batchnorm.BatchNorm(use_running_average=not train, momentum=0.9, relu=True)
  variables = ref.init(jax.random.PRNGKey(1), x)
  assert (jax.tree_util.tree_structure(variables)
          == jax.tree_util.tree_structure(ours.init(jax.random.PRNGKey(1), x)))
  # not the initial values: scales, biases and statistics of both signs
  variables = jax.tree_util.tree_map(
      lambda v: v + jax.random.normal(jax.random.PRNGKey(2), v.shape) * 0.5, variables)
  variables["batch_stats"]["var"] = jnp.abs(variables["batch_stats"]["var"])
  w = jax.random.normal(jax.random.PRNGKey(3), x.shape)

  def loss(module, params, x):
    y, updates = module.apply({"params": params, "batch_stats": variables["batch_stats"]}, x,
                              mutable=["batch_stats"])
    return jnp.sum(y * w), updates

  for argnums in (0, 1):
    (l_ref, u_ref), g_ref = jax.value_and_grad(loss, argnums + 1, has_aux=True)(
        ref, variables["params"], x)
    (l_ours, u_ours), g_ours = jax.value_and_grad(loss, argnums + 1, has_aux=True)(
        ours, variables["params"], x)
    np.testing.assert_allclose(l_ours, l_ref, rtol=1e-5)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                           (g_ours, u_ours), (g_ref, u_ref))


def test_bfloat16_output_keeps_the_input_dtype_and_f32_statistics():
  x = (jax.random.normal(jax.random.PRNGKey(0), (16, 4, 4, 8)) * 4 + 2).astype(jnp.bfloat16)
  y, mean, var = batchnorm.batch_norm_train(x, jnp.ones(8), jnp.zeros(8), False, 1e-5)
  assert y.dtype == jnp.bfloat16 and mean.dtype == var.dtype == jnp.float32
  xf = np.asarray(x, np.float64)
  np.testing.assert_allclose(mean, xf.mean((0, 1, 2)), rtol=1e-5)
  np.testing.assert_allclose(var, xf.var((0, 1, 2)), rtol=1e-4)
  dx = jax.grad(lambda x: jnp.sum(batchnorm.batch_norm_train(
      x, jnp.ones(8), jnp.zeros(8), True, 1e-5)[0].astype(jnp.float32)))(x)
  assert dx.dtype == jnp.bfloat16


@pytest.mark.slow   # initializes and differentiates two ResNets (~6 s)
def test_resnets_with_either_norm_share_parameters_and_gradients():
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 16, 16, 3))
  fused = models.resnet(18, num_classes=10, width=8, stem="cifar", norm="fused")
  flax_ = models.resnet(18, num_classes=10, width=8, stem="cifar", norm="flax")
  # the same tree of parameters and statistics; values drawn here, not by `init`, whose
  # threefry draws took 16-20 s to compile for each ResNet on a 2-core AMD EPYC VM
  shapes = [jax.eval_shape(lambda k, m=m: m.init(k, x, train=False), jax.random.PRNGKey(1))
            for m in (flax_, fused)]
  assert jax.tree_util.tree_structure(shapes[0]) == jax.tree_util.tree_structure(shapes[1])
  rng = np.random.default_rng(1)

  def draw(path, leaf):         # as flax initializes: kernels random, the rest 0 or 1
    name = jax.tree_util.keystr(path)
    if "kernel" in name:
      fan_in = int(np.prod(leaf.shape[:-1]))
      return jnp.asarray(rng.normal(0, (2 / fan_in) ** 0.5, leaf.shape), leaf.dtype)
    return jnp.full(leaf.shape, 1 if ("var" in name or "scale" in name) else 0, leaf.dtype)
  variables = jax.tree_util.tree_map_with_path(draw, shapes[0])

  def grads(model):
    def loss(params):
      y, updates = model.apply({"params": params, "batch_stats": variables["batch_stats"]}, x,
                               train=True, mutable=["batch_stats"])
      return jnp.sum(jnp.sin(y)), updates
    return jax.jit(jax.grad(loss, has_aux=True))(variables["params"])   # one compile, not per op
  (g_fused, u_fused), (g_flax, u_flax) = grads(fused), grads(flax_)
  leaves = zip(jax.tree_util.tree_leaves((g_fused, u_fused)),
               jax.tree_util.tree_leaves((g_flax, u_flax)))
  for a, b in leaves:
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5 * float(np.max(np.abs(b)) + 1e-30))
  np.testing.assert_array_equal(fused.apply(variables, x, train=False),
                                flax_.apply(variables, x, train=False))


def test_unknown_norm_is_refused():
  with pytest.raises(ValueError, match="norm must be one of"):
    models.resnet(18, num_classes=10, norm="layer").init(jax.random.PRNGKey(0),
                                                          jnp.zeros((1, 32, 32, 3)))
