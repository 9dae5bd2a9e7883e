"""BatchNorm (optionally followed by ReLU) with a hand-written gradient: two passes over the
activations forward and two backward.

ResNet-50's step on a GPU is bound by memory traffic, most of it in BatchNorm's passes over the
convolutions' outputs (docs/benchmarks.md, GPU section). Differentiating ``flax.linen.BatchNorm``
gives XLA separate reductions for the statistics, the scale and offset gradients and the input
gradient's two sums, several of them re-reading the same activations, and a separate ReLU whose
gradient needs BatchNorm's output kept. Here:

* forward: one reduction pass reads ``x`` for both sums (Σx, Σx²); one elementwise pass
  normalizes, scales, shifts and applies the ReLU;
* backward: one reduction pass reads ``x`` and the output gradient for Σdz and Σdz·x
  (``dz``: the gradient masked by the ReLU, recomputed from ``x``, so nothing but ``x`` is saved);
  one elementwise pass writes the input gradient.

The statistics are the same as Flax's with ``use_fast_variance`` (its default): f32 sums,
``var = E[x²] - E[x]²`` clipped at 0. Parameters (``scale``, ``bias``) and statistics (``mean``,
``var``) have Flax's names, shapes and initializers, so checkpoints move between the two.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp


def _sums(*operands, axes):
  """Σ over ``axes`` of every operand. XLA:GPU merges the sibling reductions into one kernel
  with several outputs (XLA:CPU keeps them apart); one variadic ``lax.reduce`` instead measured
  1% slower on an H100 and 28% on a CPU."""
  return tuple(jnp.sum(o, axis=axes) for o in operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def batch_norm_train(x, scale, bias, relu: bool, epsilon: float):
  """Training-mode BatchNorm over every axis but the last, then ReLU if ``relu``.

  Returns ``(y, mean, var)``: ``y`` in ``x``'s dtype, the batch's f32 mean and (biased) variance.
  Gradients flow to ``x``, ``scale`` and ``bias``, and through ``mean`` and ``var`` as well.
  """
  return _forward(x, scale, bias, relu, epsilon)[0]


def _stats(x):
  axes = tuple(range(x.ndim - 1))
  n = x.size // x.shape[-1]
  xf = x.astype(jnp.float32)
  s1, s2 = _sums(xf, xf * xf, axes=axes)
  mean = s1 / n
  return mean, jnp.maximum(s2 / n - mean * mean, 0.0), n


def _forward(x, scale, bias, relu, epsilon):
  mean, var, _ = _stats(x)
  inv = jax.lax.rsqrt(var + epsilon)
  a = scale.astype(jnp.float32) * inv
  b = bias.astype(jnp.float32) - mean * a
  z = x.astype(jnp.float32) * a + b
  y = (jnp.maximum(z, 0.0) if relu else z).astype(x.dtype)
  return (y, mean, var), (x, scale, bias, mean, inv)


def _fwd(x, scale, bias, relu, epsilon):
  return _forward(x, scale, bias, relu, epsilon)


def _bwd(relu, epsilon, saved, cotangents):
  del epsilon
  x, scale, bias, mean, inv = saved
  dy, dmean, dvar = cotangents
  axes = tuple(range(x.ndim - 1))
  n = x.size // x.shape[-1]
  xf = x.astype(jnp.float32)
  a = scale.astype(jnp.float32) * inv
  dz = dy.astype(jnp.float32)
  if relu:
    dz = jnp.where(xf * a + (bias.astype(jnp.float32) - mean * a) > 0, dz, 0.0)
  sdz, sdzx = _sums(dz, dz * xf, axes=axes)
  dscale = inv * (sdzx - mean * sdz)              # Σ dz · x̂
  # d/dx of  scale·x̂ + bias  with the batch's own mean and variance, then the direct paths of the
  # returned mean (1/n each) and variance (2(x - mean)/n each)
  xc = xf - mean
  dx = a * (dz - sdz / n - xc * (inv * inv) * (sdzx - mean * sdz) / n)
  dx = dx + dmean / n + dvar * 2.0 * xc / n
  return (dx.astype(x.dtype), dscale.astype(scale.dtype), sdz.astype(bias.dtype))


batch_norm_train.defvjp(_fwd, _bwd)


class BatchNorm(nn.Module):
  """``flax.linen.BatchNorm`` over the last axis (no cross-replica statistics), with an optional
  fused ReLU and the two-pass gradient of :func:`batch_norm_train`.

  Attributes follow Flax's: ``momentum`` weighs the old running statistics; ``dtype`` is the
  output dtype (default: the input's); ``relu`` applies ``max(0, ·)`` to the output.

  Example:
    >>> bn = BatchNorm(use_running_average=False, relu=True)
    >>> y, updates = bn.apply(bn.init(key, x), x, mutable=["batch_stats"])
  """

  use_running_average: bool = False
  momentum: float = 0.99
  epsilon: float = 1e-5
  dtype: Any = None
  relu: bool = False
  scale_init: Callable = nn.initializers.ones
  bias_init: Callable = nn.initializers.zeros

  @nn.compact
  def __call__(self, x):
    features = x.shape[-1]
    scale = self.param("scale", self.scale_init, (features,), jnp.float32)
    bias = self.param("bias", self.bias_init, (features,), jnp.float32)
    ra_mean = self.variable("batch_stats", "mean", lambda: jnp.zeros((features,), jnp.float32))
    ra_var = self.variable("batch_stats", "var", lambda: jnp.ones((features,), jnp.float32))
    dtype = self.dtype or x.dtype
    x = x.astype(dtype)
    if self.use_running_average:
      a = scale * jax.lax.rsqrt(ra_var.value + self.epsilon)
      z = x.astype(jnp.float32) * a + (bias - ra_mean.value * a)
      return (jnp.maximum(z, 0.0) if self.relu else z).astype(dtype)
    y, mean, var = batch_norm_train(x, scale, bias, self.relu, self.epsilon)
    if not self.is_initializing():
      m = self.momentum
      ra_mean.value = m * ra_mean.value + (1 - m) * jax.lax.stop_gradient(mean)
      ra_var.value = m * ra_var.value + (1 - m) * jax.lax.stop_gradient(var)
    return y
