"""Flax NNX, tutorial style: an MLP, ``nnx.Optimizer`` and ``nnx.MultiMetric`` updated in place
by a step under ``@jaxring.train_step`` (int8 gradients, 8 emulated CPU devices); evaluation under
``nnx.jit``. Run from the checkout (a few seconds): ``python recipes/examples/nnx_mlp.py``

The gradients come back averaged over the 8 replicas; the metrics' float totals are averaged over
them after the step (counts are each replica's, equal): ``metrics.compute()`` reads as on one
device with the global batch.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxring as jr

jax.config.update("jax_num_cpu_devices", 8)   # before any device is used


class MLP(nnx.Module):
  def __init__(self, din: int, dhidden: int, dout: int, *, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(din, dhidden, rngs=rngs)
    self.l2 = nnx.Linear(dhidden, dout, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.relu(self.l1(x)))


def loss_fn(model, batch):
  logits = model(batch["x"])
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])), logits


@jr.train_step(compression=jr.codecs.int8())
def train_step(model, optimizer, metrics, batch):
  (loss, logits), grads = jr.value_and_grad(loss_fn, has_aux=True)(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["y"])
  optimizer.update(model, grads)
  return {"loss": loss}


@nnx.jit
def eval_step(model, metrics, batch):
  loss, logits = loss_fn(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["y"])


def main(epochs: int = 5, steps_per_epoch: int = 30, batch_size: int = 64) -> None:
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2560, 16)).astype(np.float32)
  y = np.argmax(x @ rng.normal(size=(16, 4)), axis=-1).astype(np.int32)
  test = {"x": x[2048:], "y": y[2048:]}
  model = MLP(16, 64, 4, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
  metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
  for epoch in range(epochs):
    for _ in range(steps_per_epoch):
      idx = rng.integers(0, 2048, batch_size)            # the global batch, over 8 devices
      train_step(model, optimizer, metrics, {"x": x[idx], "y": y[idx]})
    train = metrics.compute()
    metrics.reset()
    eval_step(model, metrics, test)
    held_out = metrics.compute()
    metrics.reset()
    print(f"epoch {epoch}  loss {train['loss']:.4f}  accuracy {train['accuracy']:.3f}  "
          f"test loss {held_out['loss']:.4f}  test accuracy {held_out['accuracy']:.3f}")


if __name__ == "__main__":
  main()
