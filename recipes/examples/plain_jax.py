"""A two-layer MLP classifier in plain JAX (a dict of arrays) and ``optax.adamw``, trained
data-parallel through ``@jaxring.train_step``'s functional form ``step(params, opt_state, batch)
-> (params, opt_state, metrics)``: int8 gradients with error feedback, 8 emulated CPU devices,
synthetic data (labels of a random linear teacher).

Run from the checkout (a few seconds):

  python recipes/examples/plain_jax.py

``jr.value_and_grad`` is ``jax.value_and_grad`` whose gradients come back averaged over the 8
replicas (each took 1/8 of the global batch), int8 on the wire; the returned ``opt_state`` is a
``jaxring.train.OptState`` holding the optax state and each replica's residuals.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxring as jr

jax.config.update("jax_num_cpu_devices", 8)   # before any device is used

tx = optax.adamw(3e-3, weight_decay=1e-4)


def loss_fn(params, batch):
  h = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
  logits = h @ params["w2"] + params["b2"]
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


@jr.train_step(compression=jr.codecs.int8())
def step(params, opt_state, batch):
  loss, grads = jr.value_and_grad(loss_fn)(params, batch)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, {"loss": loss}


def main(steps: int = 150, batch_size: int = 64) -> None:
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2048, 16)).astype(np.float32)
  y = np.argmax(x @ rng.normal(size=(16, 4)), axis=-1).astype(np.int32)
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w1": jax.random.normal(k1, (16, 64)) / 4.0, "b1": jnp.zeros(64),
            "w2": jax.random.normal(k2, (64, 4)) / 8.0, "b2": jnp.zeros(4)}
  opt_state = tx.init(params)
  for i in range(steps):
    idx = rng.integers(0, len(x), batch_size)            # the global batch, over 8 devices
    params, opt_state, metrics = step(params, opt_state, {"x": x[idx], "y": y[idx]})
    if i % 25 == 0 or i == steps - 1:
      print(f"step {i:4d}  loss {float(metrics['loss']):.4f}")


if __name__ == "__main__":
  main()
