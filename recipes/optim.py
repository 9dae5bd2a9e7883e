"""The optimizer of the ImageNet recipes: linear-scaling learning rate, warm-up, cosine decay,
SGD with Nesterov momentum (or LARS), and weight decay only on convolution and dense kernels.

Following Goyal et al. 2017 ("Accurate, Large Minibatch SGD") and He et al. 2019 ("Bag of Tricks"):

* peak learning rate ``base_lr * global_batch / 256`` (0.1 per 256 images);
* linear warm-up from 0 over the first epochs, then cosine decay to 0 at the last step;
* weight decay 1e-4 on kernels only: decaying BatchNorm's scale and shift or a bias regularizes
  nothing (the next BatchNorm undoes any scale) and costs accuracy;
* beyond ~8k images per batch, LARS (You et al. 2017): a per-layer trust ratio
  ``||w|| / ||g + wd w||`` scales each layer's step; BatchNorm parameters and biases get neither
  the trust ratio nor decay (the same mask).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax


def peak_learning_rate(base_lr: float, global_batch_size: int, scaling: str = "linear") -> float:
  """``base_lr * global_batch_size / 256`` (``scaling="linear"``) or ``base_lr`` (``"none"``).

  Example:
    >>> peak_learning_rate(0.1, 1024)
    0.4
  """
  if scaling == "linear":
    return base_lr * global_batch_size / 256
  if scaling == "none":
    return base_lr
  raise ValueError(f"lr scaling must be 'linear' or 'none', got {scaling!r}")


def learning_rate_schedule(peak: float, total_steps: int, warmup_steps: int) -> optax.Schedule:
  """Linear warm-up from 0 to ``peak`` over ``warmup_steps``, then cosine decay to 0.

  Step ``s`` (the count of updates already applied) gets ``peak * s / warmup_steps`` during
  warm-up and ``peak * (1 + cos(pi * (s - warmup_steps) / (total_steps - warmup_steps))) / 2``
  after it.

  Example:
    >>> schedule = learning_rate_schedule(0.4, total_steps=1000, warmup_steps=100)
    >>> float(schedule(50)), float(schedule(100)), float(schedule(1000))
    (0.2, 0.4, 0.0)
  """
  if not 0 <= warmup_steps < total_steps:
    raise ValueError(f"need 0 <= warmup_steps < total_steps, got {warmup_steps}, {total_steps}")
  schedule = optax.cosine_decay_schedule(peak, decay_steps=total_steps - warmup_steps)
  if warmup_steps:
    warmup = optax.linear_schedule(0.0, peak, transition_steps=warmup_steps)
    schedule = optax.join_schedules([warmup, schedule], boundaries=[warmup_steps])
  # optimizers pass an int32 count; optax's schedules mix it with Python floats, which strict
  # dtype promotion refuses
  return lambda count: schedule(jnp.asarray(count, jnp.float32))


def weight_decay_mask(params: Any) -> Any:
  """True for the leaves that weight decay (and LARS's trust ratio) applies to: the kernels.

  Convolution and dense kernels are decayed; BatchNorm scales and shifts and every bias are not.

  Example:
    >>> weight_decay_mask({"conv": {"kernel": w}, "bn": {"scale": s, "bias": b}})
    {'bn': {'bias': False, 'scale': False}, 'conv': {'kernel': True}}
  """
  def decayed(path, _):
    return getattr(path[-1], "key", None) == "kernel"
  return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(schedule: optax.Schedule, *, optimizer: str = "sgd", momentum: float = 0.9,
                   nesterov: bool = True, weight_decay: float = 1e-4,
                   trust_coefficient: float = 0.001,
                   momentum_in_step: bool = False) -> optax.GradientTransformation:
  """SGD with (Nesterov) momentum and masked decoupled-from-BN weight decay, or LARS.

  With ``"sgd"``, ``weight_decay * w`` is added to the gradient of every kernel before momentum
  (PyTorch's ``SGD(weight_decay=...)``); with ``"lars"``, ``optax.lars`` with the same mask for the
  decay and the trust ratio.

  With ``momentum_in_step`` the train step runs the momentum inside the gradient reduction
  (``jaxring.train_step(momentum=...)``: momentum correction, needed for top-k compression) and
  the optimizer here is momentum-free. The weight decay, added after the reduction, then no longer
  passes through the momentum: it is scaled by ``1 / (1 - momentum)``, its weight under momentum
  in the steady state. LARS's trust ratio then sees the averaged velocity, not the gradient.

  Example:
    >>> tx = make_optimizer(learning_rate_schedule(0.4, 1000, 100), weight_decay=1e-4)
    >>> opt_state = tx.init(params)
  """
  if momentum_in_step:
    weight_decay, momentum = weight_decay / (1 - momentum), 0.0
  if optimizer == "sgd" and momentum_in_step:
    return optax.chain(optax.add_decayed_weights(weight_decay, mask=weight_decay_mask),
                       optax.sgd(schedule))
  if optimizer == "sgd":
    return optax.chain(
        optax.add_decayed_weights(weight_decay, mask=weight_decay_mask),
        optax.sgd(schedule, momentum=momentum, nesterov=nesterov))
  if optimizer == "lars":
    return optax.lars(schedule, weight_decay=weight_decay, weight_decay_mask=weight_decay_mask,
                      trust_coefficient=trust_coefficient, trust_ratio_mask=weight_decay_mask,
                      momentum=momentum, nesterov=nesterov and not momentum_in_step)
  raise ValueError(f"optimizer must be 'sgd' or 'lars', got {optimizer!r}")
