"""An Equinox MLP classifier trained data-parallel through ``@jaxring.train_step``: the
functional form ``step(model, opt_state, batch) -> (model, opt_state, metrics)``, int8 gradients
with error feedback, 8 emulated CPU devices, synthetic data (labels of a random linear teacher).

Run from the checkout (a few seconds):

  python recipes/examples/equinox_mlp.py

``jr.value_and_grad`` of the ``eqx.Module`` differentiates its arrays (as
``eqx.filter_value_and_grad``) and returns the gradients averaged over the 8 replicas, each of
which took 1/8 of the global batch; ``opt_state`` comes back as ``jaxring.train.OptState`` (the
optax state and each replica's int8 residuals) and goes back in on the next call.
"""
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxring as jr

jax.config.update("jax_num_cpu_devices", 8)   # before any device is used

tx = optax.adam(3e-3)


def loss_fn(model, batch):
  logits = jax.vmap(model)(batch["x"])
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


@jr.train_step(compression=jr.codecs.int8())
def step(model, opt_state, batch):
  loss, grads = jr.value_and_grad(loss_fn)(model, batch)
  updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
  return eqx.apply_updates(model, updates), opt_state, {"loss": loss}


def main(steps: int = 150, batch_size: int = 64) -> None:
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2048, 16)).astype(np.float32)
  y = np.argmax(x @ rng.normal(size=(16, 4)), axis=-1).astype(np.int32)
  model = eqx.nn.MLP(16, 4, width_size=64, depth=2, key=jax.random.key(0))
  opt_state = tx.init(eqx.filter(model, eqx.is_array))
  for i in range(steps):
    idx = rng.integers(0, len(x), batch_size)            # the global batch, over 8 devices
    model, opt_state, metrics = step(model, opt_state, {"x": x[idx], "y": y[idx]})
    if i % 25 == 0 or i == steps - 1:
      print(f"step {i:4d}  loss {float(metrics['loss']):.4f}")


if __name__ == "__main__":
  main()
