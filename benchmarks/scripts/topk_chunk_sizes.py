"""Which chunk size top-k DiLoCo wants: ``jaxring bench diloco-quality``'s task (bench tta's
GroupNorm ResNet, 8 members as 4 nodes x 2, 3000 steps, H = 20, the Nesterov outer step, no
warm-up, seed 0) with the pseudo-gradients' codec given by name:

* ``plain:<c>``: ``topk_chunks(0.01, chunk_size=c, per_tensor=False)``;
* ``tensor:<c>`` and ``tensor:<c>+bf16``: the same chosen per tensor (``topk:0.01:<c>``), the
  chosen chunks' values in bf16 with ``+bf16``;
* ``two:<C>:<q>:<c>``: a two-stage agreed selection, the norms of ``C``-value chunks summed
  first, then those of the ``c``-value chunks inside the top ``q`` fraction of them, the top 1%
  of ``c``-value chunks of the buffer taken from those (norm bytes ~ 4/C + 4q/c a value).

Prints each contender's test accuracy. One process per ``two:`` name (its parameters are not
fields of the codec, so two of them in one process would share a compiled program).

  python benchmarks/scripts/topk_chunk_sizes.py tensor:1,tensor:4,tensor:8,tensor:16
  python benchmarks/scripts/topk_chunk_sizes.py plain:64,tensor:64+bf16
  python benchmarks/scripts/topk_chunk_sizes.py two:256:0.04:4
"""
import argparse
import math
import sys

from jaxring._src.tools.bench import common
from jaxring._src.tools.bench import diloco_quality as dq

common.set_cpu_devices(8)

import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import jaxring as jr  # noqa: E402
from jaxring._src.codecs import topk  # noqa: E402
from jaxring._src.ext import reference  # noqa: E402


class TwoStage(topk.TopKChunks):
  coarse, candidates = 256, 0.04

  def select(self, flat, reduce_norms, segments=None):
    n, big, c = flat.shape[0], self.coarse, self.chunk_size
    x = jnp.pad(flat, (0, -(-n // big) * big - n))
    total = reduce_norms(reference.chunk_norms(x, big).astype(jnp.float32))
    kc = max(1, math.ceil(self.candidates * total.shape[0]))
    _, ci = lax.top_k(total, kc)
    per = big // c
    fine = reference.chunk_norms(x.reshape(-1, big)[ci].reshape(-1), c)
    _, fi = lax.top_k(reduce_norms(fine.astype(jnp.float32)), min(self.num_selected(n), kc * per))
    idx = jnp.minimum(ci[fi // per] * per + fi % per, self.num_chunks(n) - 1)
    return jnp.sort(idx).astype(jnp.int32)


def codec_of(name):
  kind, _, rest = name.partition(":")
  if kind == "plain":
    return jr.codecs.topk_chunks(0.01, chunk_size=int(rest), per_tensor=False)
  if kind == "tensor":
    return jr.codecs.parse(f"topk:0.01:{rest}")
  big, q, c = rest.split(":")
  codec = TwoStage(0.01, chunk_size=int(c), per_tensor=False)
  object.__setattr__(codec, "coarse", int(big))
  object.__setattr__(codec, "candidates", float(q))
  return codec


dq.codec_of = codec_of
args = argparse.Namespace(every="20", outer="nesterov", warmup="0", codec=sys.argv[1],
                          decay="default", steps=3000, lr=0.05, seeds=1, first_seed=0)
contenders = dq.contenders
dq.contenders = lambda *a, **k: contenders(*a, **k)[1:]   # not the synchronous row
dq.run(args)
