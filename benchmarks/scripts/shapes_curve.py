"""The learning curve of uncompressed momentum SGD on ``hard_shapes`` (docs/benchmarks.md,
"The small ResNet on the harder task"): test accuracy, loss and gradient norm every 100 steps.

One device takes the batch the 8 members of ``jaxring bench convergence --task shapes`` take
together (16 images from each member's shard), so the mean gradient is the same.

  python benchmarks/scripts/shapes_curve.py resnet 0.03 0 constant 1200
  python benchmarks/scripts/shapes_curve.py resnet_gn 0.05 0 cosine 3600
"""
import sys

import jax
import numpy as np
import optax

from jaxring._src.data.hard_shapes import hard_shapes
from jaxring._src.tools.bench.convergence import learning_rate
from jaxring._src.tools.bench.models import MODELS

model, peak, seed, schedule, steps = (sys.argv[1], float(sys.argv[2]), int(sys.argv[3]),
                                      sys.argv[4], int(sys.argv[5]))
xtr, ytr, xte, yte = hard_shapes()
init, logits = MODELS[model]
params = init(jax.random.key(seed))
tx = optax.sgd(learning_rate(peak, schedule, steps), momentum=0.9)
state = tx.init(params)


def loss(p, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits(p, x), y).mean()


@jax.jit
def step(p, s, x, y):
  value, g = jax.value_and_grad(loss)(p, x, y)
  updates, s = tx.update(g, s, p)
  return optax.apply_updates(p, updates), s, value, optax.global_norm(g)


accuracy = jax.jit(lambda p: (logits(p, xte).argmax(1) == yte).mean() * 100)
shard = xtr.shape[0] // 8
print(f"{model}, momentum SGD 0.9, lr {peak} {schedule}, seed {seed}")
print("step  test %   loss  |g|")
for t in range(steps):
  i = (t % (shard // 16)) * 16
  idx = np.concatenate([np.arange(k * shard + i, k * shard + i + 16) for k in range(8)])
  params, state, value, norm = step(params, state, xtr[idx], ytr[idx])
  if (t + 1) % 100 == 0:
    print(f"{t + 1:4d}  {float(accuracy(params)):6.1f}  {float(value):5.2f}  {float(norm):4.1f}",
          flush=True)
