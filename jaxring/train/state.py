"""``TrainState``: Flax's train state plus what data-parallel training with jaxring carries.

Fields added to :class:`flax.training.train_state.TrainState`:

* ``batch_stats``: BatchNorm's mutable statistics (averaged over the replicas after every step);
* ``rng``: a PRNG key; :meth:`TrainState.step_rng` derives this step's (and this replica's) key;
* ``residuals``: error-feedback residuals, one set per replica: an array of shape
  ``(replicas, *param.shape)`` per parameter, sharded over the data axis (each replica's compression
  error is its own; it is not replicated like the rest of the state);
* ``loss_scale``: a :class:`~jaxring.train.DynamicLossScale` for fp16.

The decorator fills ``residuals`` and ``loss_scale`` when it first sees a state (``prepare``).
"""
from __future__ import annotations

from typing import Any

import jax
from flax.training import train_state
from jax import lax

from jaxring.train.grad import current_context
from jaxring.train.precision import DynamicLossScale


class TrainState(train_state.TrainState):
  """Flax ``TrainState`` with batch statistics, an RNG key, residuals and a loss scale.

  Example:
    >>> variables = model.init(jax.random.PRNGKey(0), x, train=False)
    >>> state = jaxring.TrainState.create(apply_fn=model.apply, params=variables["params"],
    ...                                   tx=optax.sgd(0.1), batch_stats=variables["batch_stats"],
    ...                                   rng=jax.random.PRNGKey(1))
  """

  batch_stats: Any = None
  rng: Any = None
  residuals: Any = None
  loss_scale: DynamicLossScale | None = None

  def variables(self, params=None) -> dict:
    """``{"params": ..., "batch_stats": ...}`` for ``apply_fn`` (``params`` defaults to own)."""
    out = {"params": self.params if params is None else params}
    if self.batch_stats is not None:
      out["batch_stats"] = self.batch_stats
    return out

  def step_rng(self, *, per_replica: bool = True):
    """This step's key: ``rng`` folded with ``step`` and, inside a train_step, the replica index.

    Example:
      >>> dropout_key = state.step_rng()  # different on every replica and every step
    """
    if self.rng is None:
      raise ValueError("TrainState.step_rng: the state has no rng; create it with rng=...")
    key = jax.random.fold_in(self.rng, self.step)
    ctx = current_context()
    if per_replica and ctx is not None:
      key = jax.random.fold_in(key, lax.axis_index(ctx.config.axis_name))
    return key
