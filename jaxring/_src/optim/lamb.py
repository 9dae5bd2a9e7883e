"""LAMB over compressed gradients: compressed Adam's direction, then a layerwise trust ratio that
is measured while the reduction is exact and frozen once it is compressed.

LAMB (You et al. 2020) scales each layer's Adam step by ``||w|| / ||step||``. Behind a
sparsifying codec the reduced step of a layer is a few released chunks: its norm says how many
chunks were sent this step, not how far the layer should move, and the per-step ratio rescales
that handful of chunks to the whole layer's step size. 1-bit LAMB (Li et al. 2021) therefore
runs exact LAMB in a warm-up, then keeps the layerwise coefficients from it and lets them move
only within bounds during compression. Here: during ``freeze_after`` steps the ratio is the
exact one and its running mean is kept; afterwards the ratio is the current one clipped to
``[mean / bound, mean * bound]`` (``bound=1``: frozen). Measured on digits (docs/benchmarks.md).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class TrustRatioState(NamedTuple):
  """State of :func:`frozen_trust_ratio`: ``count`` (int32) and per-leaf mean ratios."""

  count: jax.Array
  ratio: Any


def _ratio(update, param):
  w, u = jnp.linalg.norm(param.ravel()), jnp.linalg.norm(update.ravel())
  return jnp.where((w == 0) | (u == 0), jnp.ones_like(w), w / jnp.maximum(u, 1e-30))


def frozen_trust_ratio(freeze_after: int, *, bound: float = 1.0,
                       decay: float = 0.98) -> optax.GradientTransformation:
  """LAMB's layerwise trust ratio, exact for ``freeze_after`` steps, then held near its mean.

  Args:
    freeze_after: steps during which the reduction is exact (compressed Adam's warm-up).
    bound: after that, the ratio is the current one clipped to ``[mean / bound, mean * bound]``
      (1: frozen at the mean, 1-bit LAMB's choice for the start of compression).
    decay: the running mean's decay during the exact steps.

  Example:
    >>> tx = optax.chain(jaxring.compressed_adam("data", compression=c, warmup_steps=100),
    ...                  frozen_trust_ratio(100), optax.scale_by_learning_rate(1e-2))
  """
  if int(freeze_after) < 1:
    raise ValueError(f"frozen_trust_ratio: freeze_after must be >= 1, got {freeze_after!r}")
  if not float(bound) >= 1.0:
    raise ValueError(f"frozen_trust_ratio: bound must be >= 1, got {bound!r}")
  warm, bound, decay = int(freeze_after), float(bound), float(decay)

  def init_fn(params):
    # typed like the parameters' norms (varying inside shard_map), as the update leaves them
    return TrustRatioState(jnp.zeros((), jnp.int32), jax.tree.map(
        lambda p: jnp.zeros_like(jnp.linalg.norm(p.ravel()), jnp.float32), params))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(optax.NO_PARAMS_MSG)
    now = jax.tree.map(_ratio, updates, params)
    exact = state.count < warm
    # the running mean, bias-corrected like Adam's moments so that early steps count fully
    t = jnp.minimum(state.count + 1, warm).astype(jnp.float32)
    mean = jax.tree.map(lambda m, r: jnp.where(exact, decay * m + (1 - decay) * r, m),
                        state.ratio, now)
    corrected = jax.tree.map(lambda m: m / (1 - decay ** t), mean)
    used = jax.tree.map(lambda r, m: jnp.where(exact, r, jnp.clip(r, m / bound, m * bound)),
                        now, corrected)
    out = jax.tree.map(lambda u, r: u * r.astype(u.dtype), updates, used)
    return out, TrustRatioState(state.count + 1, mean)

  return optax.GradientTransformation(init_fn, update_fn)
