"""ResNet v1.5 in Flax NNX: the twin of :mod:`recipes.models` (``jaxring demo --api nnx``).

The same network as the Linen :class:`recipes.models.ResNet` — stride on the 3x3 convolution of a
downsampling bottleneck, the last BatchNorm of every residual branch starting at scale 0, He
(fan-out) initialization of the bias-free convolutions, BatchNorm momentum 0.9 and epsilon 1e-5,
the ``"imagenet"`` and ``"cifar"`` stems — with the same variable paths: the ``nnx.Param`` and
``nnx.BatchStat`` states, as pure dicts, are the Linen model's ``params`` and ``batch_stats``
(``stage1_block1/conv1/kernel``, ``stem_bn/mean``, ...), so either loads the other's weights.

BatchNorm is ``nnx.BatchNorm`` (the Linen model's ``norm="flax"``): ``model.train()`` normalizes
with each replica's batch statistics and updates the running ones (``@jaxring.train_step``
averages them over the replicas after the step), ``model.eval()`` with the running ones.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from recipes.models import STAGE_SIZES

_HE = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")


def _conv(cin: int, cout: int, kernel: int, strides: int = 1, *, dtype, rngs, **kw) -> nnx.Conv:
  return nnx.Conv(cin, cout, (kernel, kernel), strides, use_bias=False, dtype=dtype,
                  kernel_init=_HE, rngs=rngs, **kw)


def _norm(features: int, *, dtype, rngs, zero: bool = False) -> nnx.BatchNorm:
  return nnx.BatchNorm(features, momentum=0.9, epsilon=1e-5, dtype=dtype, rngs=rngs,
                       scale_init=nnx.initializers.zeros if zero else nnx.initializers.ones)


class BasicBlock(nnx.Module):
  """Two 3x3 convolutions (ResNet-18/34); ``features`` out, ``features`` wide."""

  expansion = 1

  def __init__(self, cin: int, features: int, strides: int, *, dtype, rngs: nnx.Rngs):
    self.conv1 = _conv(cin, features, 3, strides, dtype=dtype, rngs=rngs)
    self.bn1 = _norm(features, dtype=dtype, rngs=rngs)
    self.conv2 = _conv(features, features, 3, dtype=dtype, rngs=rngs)
    self.bn2 = _norm(features, dtype=dtype, rngs=rngs, zero=True)
    self._projection(cin, features, strides, dtype, rngs)

  def _projection(self, cin, features, strides, dtype, rngs):
    out = features * self.expansion
    projected = cin != out or strides != 1
    self.proj_conv = (_conv(cin, out, 1, strides, dtype=dtype, rngs=rngs) if projected
                      else None)
    self.proj_bn = _norm(out, dtype=dtype, rngs=rngs) if projected else None

  def shortcut(self, x):
    return x if self.proj_conv is None else self.proj_bn(self.proj_conv(x))

  def __call__(self, x):
    y = nnx.relu(self.bn1(self.conv1(x)))
    y = self.bn2(self.conv2(y))
    return nnx.relu(self.shortcut(x) + y)


class BottleneckBlock(BasicBlock):
  """1x1 reduce, 3x3 (carrying the stride: v1.5), 1x1 expand by 4 (ResNet-50 and deeper)."""

  expansion = 4

  def __init__(self, cin: int, features: int, strides: int, *, dtype, rngs: nnx.Rngs):
    self.conv1 = _conv(cin, features, 1, dtype=dtype, rngs=rngs)
    self.bn1 = _norm(features, dtype=dtype, rngs=rngs)
    self.conv2 = _conv(features, features, 3, strides, dtype=dtype, rngs=rngs)
    self.bn2 = _norm(features, dtype=dtype, rngs=rngs)
    self.conv3 = _conv(features, 4 * features, 1, dtype=dtype, rngs=rngs)
    self.bn3 = _norm(4 * features, dtype=dtype, rngs=rngs, zero=True)
    self._projection(cin, features, strides, dtype, rngs)

  def __call__(self, x):
    y = nnx.relu(self.bn1(self.conv1(x)))
    y = nnx.relu(self.bn2(self.conv2(y)))
    y = self.bn3(self.conv3(y))
    return nnx.relu(self.shortcut(x) + y)


class ResNet(nnx.Module):
  """ResNet v1.5 on ``[batch, height, width, 3]`` images, logits f32 ``[batch, num_classes]``.

  Blocks are the attributes ``stage{i}_block{j}`` (the Linen model's names).

  Example:
    >>> model = resnet(18, num_classes=10, width=16, stem="cifar", rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 32, 32, 3))).shape
    (2, 10)
    >>> model.eval()   # running BatchNorm statistics, for evaluation; model.train() to go back
  """

  def __init__(self, stage_sizes: Sequence[int], block: type, num_classes: int, *,
               width: int = 64, stem: str = "imagenet", dtype: Any = jnp.float32,
               rngs: nnx.Rngs):
    if stem not in ("imagenet", "cifar"):
      raise ValueError(f"stem must be 'imagenet' or 'cifar', got {stem!r}")
    self.stem, self.dtype = stem, dtype
    self.stem_conv = (_conv(3, width, 7, 2, padding=[(3, 3), (3, 3)], dtype=dtype, rngs=rngs)
                      if stem == "imagenet" else _conv(3, width, 3, dtype=dtype, rngs=rngs))
    self.stem_bn = _norm(width, dtype=dtype, rngs=rngs)
    names, cin = [], width
    for i, blocks in enumerate(stage_sizes):
      for j in range(blocks):
        name = f"stage{i + 1}_block{j + 1}"
        features = width * 2 ** i
        setattr(self, name, block(cin, features, 2 if i > 0 and j == 0 else 1, dtype=dtype,
                                  rngs=rngs))
        names.append(name)
        cin = features * block.expansion
    self.block_names = tuple(names)   # static: hashable, as a graph definition must be
    self.head = nnx.Linear(cin, num_classes, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.stem_bn(self.stem_conv(x.astype(self.dtype))))
    if self.stem == "imagenet":
      x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for name in self.block_names:
      x = getattr(self, name)(x)
    return self.head(jnp.mean(x, axis=(1, 2))).astype(jnp.float32)


def resnet(depth: int, *, num_classes: int = 1000, width: int = 64, stem: str = "imagenet",
           dtype: Any = jnp.float32, rngs: nnx.Rngs) -> ResNet:
  """The ResNet v1.5 of ``depth`` layers (18, 34: basic blocks; 50, 101, 152: bottlenecks).

  Example:
    >>> model = resnet(18, num_classes=10, width=16, stem="cifar", rngs=nnx.Rngs(0))
  """
  if depth not in STAGE_SIZES:
    raise ValueError(f"ResNet depth must be one of {sorted(STAGE_SIZES)}, got {depth}")
  block = BasicBlock if depth < 50 else BottleneckBlock
  return ResNet(STAGE_SIZES[depth], block, num_classes, width=width, stem=stem, dtype=dtype,
                rngs=rngs)


def create_model(config) -> ResNet:
  """A :class:`recipes.config.Config`'s ResNet, initialized by one compiled function (``nnx.jit``
  of the constructor; an ``rbg`` key: XLA:CPU compiles its initializers ~4x faster than
  threefry's, as :func:`recipes.train.create_train_state`)."""
  from recipes.train import DTYPES

  @nnx.jit
  def create():
    return resnet(config.depth, num_classes=config.num_classes, width=config.width,
                  stem=config.stem, dtype=DTYPES[config.dtype],
                  rngs=nnx.Rngs(jax.random.key(config.seed, impl="rbg")))
  return create()
