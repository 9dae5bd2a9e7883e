"""Layers of a network as the simulator needs them: gradient bytes and compute, in forward order."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Layer:
  name: str
  params: int        # parameters (the gradient has as many values)
  flops: float       # forward FLOPs per example (backward: twice as many)


def _conv(name, cin, cout, k, hw_out) -> list[Layer]:
  """A bias-free conv followed by BatchNorm (scale and offset: 2 parameters per channel)."""
  return [Layer(name, cin * cout * k * k, 2.0 * cin * cout * k * k * hw_out * hw_out),
          Layer(name + "/bn", 2 * cout, 4.0 * cout * hw_out * hw_out)]


def resnet50() -> list[Layer]:
  """ResNet-50 v1.5 at 224x224 (He et al. 2016; the stride on the 3x3 conv): 25.56 M parameters,
  about 4.1 G multiply-adds per image.

  Example:
    >>> sum(l.params for l in resnet50())
    25557032
  """
  layers = _conv("conv1", 3, 64, 7, 112)
  cin, hw = 64, 56
  for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
    for b in range(blocks):
      stride = 2 if b == 0 and stage > 0 else 1
      out_hw = hw // stride
      pre = f"stage{stage + 1}/block{b + 1}"
      layers += _conv(pre + "/conv1", cin, width, 1, hw)
      layers += _conv(pre + "/conv2", width, width, 3, out_hw)
      layers += _conv(pre + "/conv3", width, 4 * width, 1, out_hw)
      if b == 0:
        layers += _conv(pre + "/proj", cin, 4 * width, 1, out_hw)
      cin, hw = 4 * width, out_hw
  layers.append(Layer("fc", cin * 1000 + 1000, 2.0 * cin * 1000))
  return layers


def from_params(params, flops_per_example: float | None = None) -> list[Layer]:
  """Layers from a parameter pytree (e.g. ``jax.eval_shape(model.init, ...)["params"]``), one
  per leaf in flatten order; compute is shared out in proportion to parameters when only the
  total is known (``flops_per_example``; default 6 FLOPs per parameter, a dense layer's)."""
  import jax
  import numpy as np
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  sizes = [(jax.tree_util.keystr(path), int(np.prod(leaf.shape))) for path, leaf in leaves]
  total = sum(s for _, s in sizes) or 1
  flops = flops_per_example if flops_per_example is not None else 2.0 * total
  return [Layer(name, size, flops * size / total) for name, size in sizes]
