"""The small image models of ``jaxring bench convergence`` (and ``tta``, ``fsdp``, ``simulate``):
plain functions of a parameter dict, NHWC inputs, 16 classes by default.

``cnn``: two convolutions and a dense head. ``resnet``: a stem and three residual blocks without
normalization, the last block's second convolution at zero (the untrained network is the stem and
the shortcuts). ``resnet_gn``: the same with GroupNorm after every 3x3 convolution.
"""
from __future__ import annotations


def init_cnn(key, num_classes: int = 16):
  """A small CNN for 16x16x3 images: two 3x3 convolutions (16, 32 channels), each followed by
  ReLU and 2x2 average pooling, then a dense layer (~13k parameters)."""
  import jax
  import jax.numpy as jnp
  k1, k2, k3 = jax.random.split(key, 3)
  return {"c1": jax.random.normal(k1, (3, 3, 3, 16)) * (2 / 27) ** 0.5, "b1": jnp.zeros(16),
          "c2": jax.random.normal(k2, (3, 3, 16, 32)) * (2 / 144) ** 0.5, "b2": jnp.zeros(32),
          "w": jax.random.normal(k3, (4 * 4 * 32, num_classes)) / 512 ** 0.5,
          "b": jnp.zeros(num_classes)}


def cnn_logits(params, x):
  import jax
  from jax import lax

  def conv(x, w, b):
    y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    y = jax.nn.relu(y + b)
    n, h, w_, c = y.shape
    return y.reshape(n, h // 2, 2, w_ // 2, 2, c).mean((2, 4))

  x = conv(conv(x, params["c1"], params["b1"]), params["c2"], params["b2"])
  return x.reshape(x.shape[0], -1) @ params["w"] + params["b"]


def init_resnet(key, num_classes: int = 16, width: int = 16):
  """A small ResNet for 16x16x3 images, without normalization: a 3x3 stem of ``width`` channels,
  a residual block, a 2x2 average pool and a 1x1 convolution to ``2 * width`` channels, two
  residual blocks, global average pooling and a dense layer (43,120 parameters at width 16). Each block's second convolution starts at zero (Goyal et al.'s
  zero-initialized residual), so the untrained network is the stem and the shortcuts."""
  import jax
  import jax.numpy as jnp
  ks = iter(jax.random.split(key, 8))
  he = lambda shape: jax.random.normal(next(ks), shape) * (2 / (shape[0] * shape[1] * shape[2])) ** 0.5  # noqa: E731
  w2 = 2 * width
  return {"stem": he((3, 3, 3, width)), "stem_b": jnp.zeros(width),
          "a1": he((3, 3, width, width)), "a1_b": jnp.zeros(width),
          "a2": jnp.zeros((3, 3, width, width)), "a2_b": jnp.zeros(width),
          "down": he((1, 1, width, w2)),
          "b1": he((3, 3, w2, w2)), "b1_b": jnp.zeros(w2),
          "b2": jnp.zeros((3, 3, w2, w2)), "b2_b": jnp.zeros(w2),
          "c1": he((3, 3, w2, w2)), "c1_b": jnp.zeros(w2),
          "c2": jnp.zeros((3, 3, w2, w2)), "c2_b": jnp.zeros(w2),
          "w": jax.random.normal(next(ks), (w2, num_classes)) / w2 ** 0.5,
          "b": jnp.zeros(num_classes)}


def resnet_logits(params, x):
  import jax
  from jax import lax

  def conv(x, w, b=None):
    y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y if b is None else y + b

  def block(x, name):
    y = jax.nn.relu(conv(x, params[f"{name}1"], params[f"{name}1_b"]))
    return jax.nn.relu(x + conv(y, params[f"{name}2"], params[f"{name}2_b"]))

  x = block(jax.nn.relu(conv(x, params["stem"], params["stem_b"])), "a")
  n, h, w, c = x.shape
  x = conv(x.reshape(n, h // 2, 2, w // 2, 2, c).mean((2, 4)), params["down"])
  x = block(block(x, "b"), "c")
  return x.mean((1, 2)) @ params["w"] + params["b"]


def init_resnet_gn(key, num_classes: int = 16, width: int = 16, groups: int = 4):
  """:func:`init_resnet`'s network with GroupNorm (``groups`` groups; stateless, so training and
  evaluation normalize alike) after every 3x3 convolution, as ResNets normalize: convolutions
  without bias, He-initialized; each block's last GroupNorm starts with scale 0 (Goyal et al.),
  so the untrained network is again the stem and the shortcuts (43,296 parameters at width 16)."""
  import jax
  import jax.numpy as jnp
  del groups  # the forward pass's; the parameters do not depend on it
  ks = iter(jax.random.split(key, 10))
  he = lambda shape: jax.random.normal(next(ks), shape) * (2 / (shape[0] * shape[1] * shape[2])) ** 0.5  # noqa: E731
  w2 = 2 * width
  params = {"stem": he((3, 3, 3, width)), "down": he((1, 1, width, w2)),
            "w": jax.random.normal(next(ks), (w2, num_classes)) / w2 ** 0.5,
            "b": jnp.zeros(num_classes)}
  for name, c in (("stem", width), ("a1", width), ("a2", width), ("b1", w2), ("b2", w2),
                  ("c1", w2), ("c2", w2)):
    if name != "stem":
      params[name] = he((3, 3, c, c))
    params[f"{name}_g"] = (jnp.zeros if name.endswith("2") else jnp.ones)(c)
    params[f"{name}_gb"] = jnp.zeros(c)
  return params


def resnet_gn_logits(params, x, groups: int = 4):
  import jax
  from jax import lax

  def conv_gn(x, name):
    y = lax.conv_general_dilated(x, params[name], (1, 1), "SAME",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    n, h, w, c = y.shape
    g = y.reshape(n, h, w, groups, c // groups)
    mean = g.mean((1, 2, 4), keepdims=True)
    var = ((g - mean) ** 2).mean((1, 2, 4), keepdims=True)
    y = ((g - mean) * lax.rsqrt(var + 1e-5)).reshape(n, h, w, c)
    return y * params[f"{name}_g"] + params[f"{name}_gb"]

  def block(x, name):
    y = jax.nn.relu(conv_gn(x, f"{name}1"))
    return jax.nn.relu(x + conv_gn(y, f"{name}2"))

  x = block(jax.nn.relu(conv_gn(x, "stem")), "a")
  n, h, w, c = x.shape
  x = lax.conv_general_dilated(x.reshape(n, h // 2, 2, w // 2, 2, c).mean((2, 4)),
                               params["down"], (1, 1), "SAME",
                               dimension_numbers=("NHWC", "HWIO", "NHWC"))
  x = block(block(x, "b"), "c")
  return x.mean((1, 2)) @ params["w"] + params["b"]


MODELS = {"cnn": (init_cnn, cnn_logits), "resnet": (init_resnet, resnet_logits),
          "resnet_gn": (init_resnet_gn, resnet_gn_logits)}
