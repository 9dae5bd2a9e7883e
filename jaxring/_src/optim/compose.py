"""Which optimizer composition trains over which codec, chosen in one place.

Measured on digits (docs/benchmarks.md, "Convergence with compression"): a dense lossy codec
(bf16, int8) with error feedback in front of any optax optimizer trains like the uncompressed
run; a sparsifying one (``topk_chunks``) with error feedback does only in front of a stateless
optimizer (plain SGD). Momentum multiplies the bursts that error feedback releases (momentum SGD
trains to chance) and Adam's variance is thrown by them; those need the velocity accumulated
before compression (:func:`jaxring.momentum_correction`) or the variance frozen
(:func:`jaxring.compressed_adam`).

Nothing inside an ``optax.chain`` can see the transformations after it, so
:func:`jaxring.reduce_gradients` refuses a sparsifying codec with error feedback unless told that
plain SGD follows (``plain_sgd_after=True``), and :func:`compressed_optimizer` builds the right
chain from the optimizer's name. Where the optimizer state is at hand (a train state),
``jaxring.train_step`` refuses per-parameter optimizer state behind a sparsifying codec
(:func:`has_per_parameter_state`).
"""
from __future__ import annotations

import jax
import numpy as np
import optax

from jaxring._src.error_feedback import is_sparsifying

NAMES = ("sgd", "momentum", "nesterov", "adam", "adamw", "lamb")

#: LAMB over a sparsifying codec, measured on digits (3 seeds, 300 steps, docs/benchmarks.md):
#: compressed Adam's direction with LAMB's layerwise trust ratio, per step or frozen after the
#: exact warm-up (1-bit LAMB's idea, :func:`jaxring._src.optim.lamb.frozen_trust_ratio`), ends
#: 2.7-6.9 points behind uncompressed LAMB at its best learning rate: refused, not shipped.
LAMB_REFUSAL = (
    "compressed_optimizer: LAMB over topk_chunks misses uncompressed LAMB by 3-7 points "
    "(measured on digits); supported: jr.compressed_optimizer('lamb', lr, axis, "
    "compression=jr.codecs.int8()), or 'adamw' over topk_chunks")


def has_per_parameter_state(opt_state, params) -> bool:
  """Whether ``opt_state`` holds float arrays shaped like parameters (momentum, Adam moments).

  Example:
    >>> has_per_parameter_state(optax.sgd(0.1, momentum=0.9).init(params), params)
    True
  """
  shapes = {np.shape(p) for p in jax.tree_util.tree_leaves(params) if np.size(p) > 1}
  for leaf in jax.tree_util.tree_leaves(opt_state):
    dtype = getattr(leaf, "dtype", None)
    if (dtype is not None and jax.numpy.issubdtype(dtype, jax.numpy.floating)
        and np.shape(leaf) in shapes):
      return True
  return False


def compressed_optimizer(name: str, learning_rate, axis_name, *, compression=None,
                         algorithm="auto", momentum: float = 0.9, weight_decay: float = 0.0,
                         b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                         warmup_steps: int = 0, warmup_density: float = 0.25,
                         adam_warmup_steps: int = 100,
                         adam_variance_every: int = 5,
                         clip_norm: float | str | None = "auto",
                         masking: str = "flush") -> optax.GradientTransformation:
  """A data-parallel optimizer that reduces its gradients over ``axis_name`` and converges.

  The composition is chosen by the codec (module docstring): over no codec or a dense one,
  ``optax.chain(jr.reduce_gradients(axis, compression=c), <optax optimizer>)``; over
  ``topk_chunks``, momentum correction for ``"momentum"``/``"nesterov"`` and compressed Adam for
  ``"adam"``/``"adamw"``; LAMB over ``topk_chunks`` is refused (``ValueError``: measured 3-7
  points behind, see ``LAMB_REFUSAL``). Use it inside ``shard_map`` over ``axis_name`` (``init``
  too).

  Args:
    name: ``"sgd"``, ``"momentum"``, ``"nesterov"``, ``"adam"``, ``"adamw"`` or ``"lamb"``.
    learning_rate: a float or an optax schedule.
    axis_name: mapped axis name or tuple of names to average over.
    compression: None, a codec, or a dict level name -> codec.
    algorithm: as in :func:`jaxring.psum`.
    momentum: the momentum of ``"momentum"`` and ``"nesterov"``.
    weight_decay: SGD: added to the gradient (``w * decay``, before momentum); AdamW, LAMB:
      decoupled.
    b1, b2, eps: Adam's coefficients.
    warmup_steps: top-k density warm-up of momentum correction (see its docstring).
    warmup_density: that warm-up's first density (1.0: dense first).
    adam_warmup_steps: exact Adam steps before compressed Adam freezes the variance.
    adam_variance_every: compressed Adam refreshes the variance exactly every this many steps
      (0: frozen).
    clip_norm: momentum correction's local gradient clipping: a norm, ``"auto"`` or None (see
      its docstring).
    masking: momentum correction's treatment of sent chunks (see its docstring).

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> tx = jaxring.compressed_optimizer("nesterov", 0.1, "data",
    ...                                   compression=jaxring.codecs.topk_chunks(0.01))
  """
  from jaxring._src.error_feedback import reduce_gradients
  from jaxring._src.optim.adam import compressed_adam
  from jaxring._src.optim.momentum import momentum_correction
  if name not in NAMES:
    raise ValueError(f"compressed_optimizer: unknown optimizer {name!r}; one of {NAMES}")
  sparse = is_sparsifying(compression)
  decay = [optax.add_decayed_weights(weight_decay)] if weight_decay else []
  if name in ("sgd", "momentum", "nesterov"):
    mom = None if name == "sgd" else momentum
    if sparse and mom:
      return optax.chain(*decay, momentum_correction(
          axis_name, compression=compression, momentum=mom, nesterov=name == "nesterov",
          algorithm=algorithm, clip_norm=clip_norm, warmup_steps=warmup_steps,
          warmup_density=warmup_density, masking=masking),
          optax.sgd(learning_rate))
    return optax.chain(*decay, reduce_gradients(axis_name, algorithm=algorithm,
                                                compression=compression,
                                                plain_sgd_after=not mom),
                       optax.sgd(learning_rate, momentum=mom, nesterov=name == "nesterov"))
  if sparse and name == "lamb":
    raise ValueError(LAMB_REFUSAL)
  if sparse:
    wd = [optax.add_decayed_weights(weight_decay)] if name == "adamw" and weight_decay else []
    return optax.chain(compressed_adam(axis_name, compression=compression, b1=b1, b2=b2, eps=eps,
                                       warmup_steps=adam_warmup_steps, algorithm=algorithm,
                                       variance_every=adam_variance_every),
                       *wd, optax.scale_by_learning_rate(learning_rate))
  after = {"adam": lambda: optax.adam(learning_rate, b1=b1, b2=b2, eps=eps),
           "adamw": lambda: optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps,
                                        weight_decay=weight_decay),
           "lamb": lambda: optax.lamb(learning_rate, b1=b1, b2=b2, eps=eps,
                                      weight_decay=weight_decay)}[name]()
  return optax.chain(reduce_gradients(axis_name, algorithm=algorithm, compression=compression),
                     after)
