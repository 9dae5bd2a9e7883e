"""ResNet v1.5 (ResNet-18/34/50) in Flax, for ImageNet and for small low-resolution inputs.

v1.5 differs from the original ResNet (He et al. 2015) in one place: a bottleneck block that
downsamples puts the stride on its 3x3 convolution, not on the first 1x1 (a 1x1 convolution with
stride 2 skips three quarters of its input). It costs ~5% more FLOPs and gains ~0.5% top-1.

BatchNorm here normalizes with each replica's own batch statistics (no cross-replica reduction in
the forward pass: that would add one latency-bound collective per layer). ``@jaxring.train_step``
averages the running statistics over the replicas after every step, so every replica evaluates with
the same ones (``jaxring._src.train.step``).

The last BatchNorm of every residual branch starts with scale 0 (Goyal et al. 2017): each block is
the identity at initialization, which is what makes large-batch training with warm-up stable.

``stem="cifar"`` replaces the 7x7/2 convolution and the max-pool by one 3x3/1 convolution, for
32-64 pixel inputs where the ImageNet stem would leave a 1x1 feature map by the last stage.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import flax.linen as nn
import jax.numpy as jnp

from recipes import batchnorm

STAGE_SIZES = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3),
               152: (3, 8, 36, 3)}


class FlaxBatchNorm(nn.BatchNorm):
  """``flax.linen.BatchNorm``, then ``nn.relu`` if ``relu``: the reference for
  :class:`recipes.batchnorm.BatchNorm`, with the same parameter tree."""

  relu: bool = False

  @nn.compact
  def __call__(self, x, use_running_average=None):
    y = super().__call__(x, use_running_average=use_running_average)
    return nn.relu(y) if self.relu else y


NORMS = {"fused": batchnorm.BatchNorm, "flax": FlaxBatchNorm}


class BasicBlock(nn.Module):
  """Two 3x3 convolutions (ResNet-18/34)."""

  features: int
  strides: int
  conv: Any
  norm: Any

  @nn.compact
  def __call__(self, x):
    y = self.norm(name="bn1", relu=True)(self.conv(self.features, (3, 3), self.strides,
                                                   name="conv1")(x))
    y = self.norm(name="bn2", scale_init=nn.initializers.zeros)(
        self.conv(self.features, (3, 3), name="conv2")(y))
    if x.shape != y.shape:
      x = self.norm(name="proj_bn")(self.conv(self.features, (1, 1), self.strides,
                                              name="proj_conv")(x))
    return nn.relu(x + y)


class BottleneckBlock(nn.Module):
  """1x1 reduce, 3x3 (carrying the stride: v1.5), 1x1 expand by 4 (ResNet-50 and deeper)."""

  features: int
  strides: int
  conv: Any
  norm: Any

  @nn.compact
  def __call__(self, x):
    y = self.norm(name="bn1", relu=True)(self.conv(self.features, (1, 1), name="conv1")(x))
    y = self.norm(name="bn2", relu=True)(self.conv(self.features, (3, 3), self.strides,
                                                   name="conv2")(y))
    y = self.norm(name="bn3", scale_init=nn.initializers.zeros)(
        self.conv(4 * self.features, (1, 1), name="conv3")(y))
    if x.shape != y.shape:
      x = self.norm(name="proj_bn")(self.conv(4 * self.features, (1, 1), self.strides,
                                              name="proj_conv")(x))
    return nn.relu(x + y)


class ResNet(nn.Module):
  """ResNet v1.5.

  Attributes:
    stage_sizes: blocks per stage, e.g. ``(3, 4, 6, 3)``.
    block: :class:`BasicBlock` or :class:`BottleneckBlock`.
    num_classes: outputs of the classifier.
    width: channels of the first stage (64 in the paper); doubles at every stage.
    stem: ``"imagenet"`` (7x7/2 conv + 3x3/2 max-pool) or ``"cifar"`` (3x3/1 conv).
    dtype: compute dtype (e.g. ``jnp.bfloat16``); parameters and BatchNorm statistics stay f32.
    norm: ``"fused"`` (:mod:`recipes.batchnorm`: BatchNorm + ReLU with a two-pass gradient) or
      ``"flax"`` (``flax.linen.BatchNorm`` then ``nn.relu``); same parameters, same checkpoints.

  Example:
    >>> model = resnet(50, num_classes=1000, dtype=jnp.bfloat16)
    >>> variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 224, 224, 3)), train=False)
    >>> logits, updates = model.apply(variables, images, train=True, mutable=["batch_stats"])
  """

  stage_sizes: Sequence[int]
  block: Any
  num_classes: int
  width: int = 64
  stem: str = "imagenet"
  dtype: Any = jnp.float32
  norm: str = "fused"

  @nn.compact
  def __call__(self, x, train: bool = True):
    if self.norm not in NORMS:
      raise ValueError(f"norm must be one of {sorted(NORMS)}, got {self.norm!r}")
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype,
                             kernel_init=nn.initializers.variance_scaling(2.0, "fan_out",
                                                                          "normal"))
    norm = functools.partial(NORMS[self.norm], use_running_average=not train, momentum=0.9,
                             epsilon=1e-5, dtype=self.dtype)
    x = x.astype(self.dtype)
    if self.stem == "imagenet":
      x = conv(self.width, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="stem_conv")(x)
      x = norm(name="stem_bn", relu=True)(x)
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    elif self.stem == "cifar":
      x = norm(name="stem_bn", relu=True)(conv(self.width, (3, 3), name="stem_conv")(x))
    else:
      raise ValueError(f"stem must be 'imagenet' or 'cifar', got {self.stem!r}")
    for i, blocks in enumerate(self.stage_sizes):
      for j in range(blocks):
        strides = 2 if i > 0 and j == 0 else 1
        x = self.block(self.width * 2 ** i, strides, conv, norm,
                       name=f"stage{i + 1}_block{j + 1}")(x)
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)
    return x.astype(jnp.float32)


def resnet(depth: int, *, num_classes: int = 1000, width: int = 64, stem: str = "imagenet",
           dtype: Any = jnp.float32, norm: str = "fused") -> ResNet:
  """The ResNet v1.5 of ``depth`` layers (18, 34: basic blocks; 50, 101, 152: bottlenecks).

  Example:
    >>> resnet(18, num_classes=10, width=16, stem="cifar")  # a CPU-sized ResNet-18
  """
  if depth not in STAGE_SIZES:
    raise ValueError(f"ResNet depth must be one of {sorted(STAGE_SIZES)}, got {depth}")
  block = BasicBlock if depth < 50 else BottleneckBlock
  return ResNet(STAGE_SIZES[depth], block, num_classes, width=width, stem=stem, dtype=dtype,
                norm=norm)
