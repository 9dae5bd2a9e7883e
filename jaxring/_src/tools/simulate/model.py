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


# Llama-style decoders by their published shapes: (width, blocks, MLP width, vocabulary, key and
# value width). TinyLlama 1.1B (Zhang et al. 2024) has 4 key-value heads of 64; Llama 2 7B
# (Touvron et al. 2023) has full attention.
DECODERS = {
    "tinyllama-1.1b": (2048, 22, 5632, 32000, 256),
    "llama2-7b": (4096, 32, 11008, 32000, 4096),
}
SEQ_LEN = 2048   # tokens in one example of a decoder


def decoder(width: int, blocks: int, mlp: int, vocab: int, kv_width: int | None = None,
            seq_len: int = SEQ_LEN) -> list[Layer]:
  """A Llama-style decoder's layers (RMSNorm, q/k/v/o, RMSNorm, SwiGLU's gate/up/down per block;
  an untied embedding and head), one example a sequence of ``seq_len`` tokens. Forward FLOPs: 2
  per weight and token; none for the embedding's lookup and the norms; attention's scores
  (4·seq_len·width per token and block, 8% of Llama 2 7B's FLOPs at 2,048 tokens) left out.

  Example:
    >>> sum(lay.params for lay in decoder(*DECODERS["llama2-7b"]))
    6738415616
    >>> sum(lay.params for lay in decoder(*DECODERS["tinyllama-1.1b"]))
    1100048384
  """
  kv = width if kv_width is None else kv_width

  def dense(name, n_in, n_out):
    return Layer(name, n_in * n_out, 2.0 * n_in * n_out * seq_len)

  layers = [Layer("embed", vocab * width, 0.0)]
  for b in range(blocks):
    pre = f"block{b}/"
    layers += [Layer(pre + "attn_norm", width, 0.0), dense(pre + "q", width, width),
               dense(pre + "k", width, kv), dense(pre + "v", width, kv),
               dense(pre + "o", width, width), Layer(pre + "mlp_norm", width, 0.0),
               dense(pre + "gate", width, mlp), dense(pre + "up", width, mlp),
               dense(pre + "down", mlp, width)]
  return layers + [Layer("norm", width, 0.0), dense("head", width, vocab)]
