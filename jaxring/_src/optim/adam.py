"""Adam over compressed gradients: an exact warm-up, then frozen variance and compressed momentum.

Adam's second moment is a nonlinear function of the gradient: fed the bursts that top-k with
error feedback releases, it blows up where they land and the step shrinks there (measured on
digits: top-k 1% + EF before ``optax.adam`` 80.7% against 97.8% uncompressed).
1-bit Adam (Tang et al. 2021) observes that the variance settles early and that with it frozen
Adam is momentum SGD with a fixed per-coordinate preconditioner, which *is* linear, so error
feedback and momentum correction apply:

* steps ``< warmup_steps``: exact (uncompressed) all-reduce, plain Adam; the moments are
  identical on every member;
* afterwards: each member keeps its own first moment of its own gradient,
  ``u_i <- b1 u_i + (1 - b1) g_i`` (starting from the shared, bias-corrected one), and sends it
  with error feedback and momentum flush/masking exactly as :func:`jaxring.momentum_correction`
  does (its ``corrected_mean``); the average is divided by ``sqrt(nu_hat) + eps``, identical on
  every member. ``nu`` stays frozen, or (``variance_every``) is refreshed from an exact
  all-reduce of the gradient every that many steps.

The momentum is sent in gradient units, not preconditioned: top-k then picks the chunks whose
gradient matters most, as it does for SGD, rather than nearly all alike (Adam's steps are all of
about the learning rate). Measured on digits, top-k 1%: 96.3% against 95.1% preconditioned
(Adam uncompressed 97.4%; means of 3 seeds).

The warm-up costs uncompressed reductions (``warmup_steps`` of them); the rest run at the codec's
size.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxring._src.algorithms import engine
from jaxring._src.algorithms.planner import validate_algorithm
from jaxring._src.collectives import axis_names, pmean, validate_compression
from jaxring._src.optim import sparse
from jaxring._src.optim.momentum import MASKINGS, corrected_mean


class CompressedAdamState(NamedTuple):
  """State of :func:`compressed_adam` (plain arrays: checkpoint it with the optimizer state).

  Attributes:
    count: updates applied (int32).
    mu: Adam's first moment during the warm-up (the same on every member).
    nu: Adam's second moment, frozen after the warm-up (the same on every member).
    velocity: this member's first moment after the warm-up (gradient units).
    residual: this member's accumulated, not yet sent, first moment (gradient units).
  """

  count: jax.Array
  mu: Any
  nu: Any
  velocity: Any
  residual: Any


def compressed_adam(axis_name, *, compression=None, b1: float = 0.9, b2: float = 0.999,
                    eps: float = 1e-8, warmup_steps: int = 100, algorithm="auto",
                    masking: str = "flush",
                    variance_every: int = 5) -> optax.GradientTransformation:
  """Averages gradients over ``axis_name`` and returns Adam's direction, compressed after a warm-up.

  The supported way to train Adam/AdamW over a sparsifying codec (module docstring). Chain it
  before ``optax.scale_by_learning_rate(lr)`` (Adam), with ``optax.add_decayed_weights(wd)``
  between the two for AdamW. Use it inside ``shard_map`` over ``axis_name`` (``init`` too).

  Args:
    axis_name: mapped axis name or tuple of names to average over.
    compression: None, a codec, or a dict level name -> codec, used after the warm-up.
    b1, b2, eps: Adam's (``optax.scale_by_adam``'s) coefficients.
    warmup_steps: exact Adam steps before the variance is frozen (at least 1); 1-bit Adam uses
      about 15-25% of training.
    algorithm: as in :func:`jaxring.psum`.
    masking: the momentum of sent chunks, as in :func:`jaxring.momentum_correction`.
    variance_every: after the warm-up, refresh the variance from an exact all-reduce of the
      gradient every this many steps (one dense reduction per that many compressed ones);
      0 keeps it frozen (1-bit Adam). Measured on digits, top-k 1%, 3 seeds: frozen 1.9 points
      behind uncompressed Adam, every 10 steps 1.1, every 5 steps 0.8 (docs/benchmarks.md).

  Returns:
    An ``optax.GradientTransformation`` whose updates are Adam's direction ``m_hat / (sqrt(v_hat)
    + eps)`` (not yet scaled by the learning rate).

  Example:
    >>> tx = optax.chain(                                 # AdamW, top-k 1% after 50 steps
    ...     jaxring.compressed_adam("data", compression=jaxring.codecs.topk_chunks(0.01),
    ...                             warmup_steps=50),
    ...     optax.add_decayed_weights(1e-4), optax.scale_by_learning_rate(1e-3))
  """
  validate_algorithm(algorithm)
  validate_compression(compression)
  if int(warmup_steps) < 1:
    raise ValueError(f"compressed_adam: warmup_steps must be >= 1 (the variance is measured "
                     f"before it is frozen), got {warmup_steps!r}")
  for name, b in (("b1", b1), ("b2", b2)):
    if not 0.0 <= float(b) < 1.0:
      raise ValueError(f"compressed_adam: {name} must be in [0, 1), got {b!r}")
  if masking not in MASKINGS:
    raise ValueError(f"compressed_adam: masking must be one of {MASKINGS}, got {masking!r}")
  axes = axis_names(axis_name)
  warm = int(warmup_steps)
  b1, b2, eps = float(b1), float(b2), float(eps)

  def init_fn(params):
    zeros = sparse.zeros_per_member(params, ())
    return CompressedAdamState(count=jnp.zeros((), jnp.int32), mu=zeros, nu=zeros,
                               velocity=sparse.zeros_per_member(params, axes),
                               residual=sparse.zeros_per_member(params, axes))

  def update_fn(updates, state, params=None):
    del params
    groups = sparse.Groups.of(updates)
    binding = engine.bind(axes, "compressed_adam")
    flat = {d: groups.flat(updates, d) for d in groups.by_dtype}
    carried = tuple({d: groups.flat(getattr(state, f), d) for d in groups.by_dtype}
                    for f in ("mu", "nu", "velocity", "residual"))
    t = state.count.astype(jnp.float32) + 1

    def exact(args):
      g, (mu, nu, vel, res) = args
      out, new_mu, new_nu = {}, {}, {}
      for d, gd in g.items():
        mean = pmean(gd, axis_name, algorithm=algorithm)
        new_mu[d] = b1 * mu[d] + (1 - b1) * mean
        new_nu[d] = b2 * nu[d] + (1 - b2) * mean * mean
        out[d] = (new_mu[d] / (1 - b1 ** t)) / (jnp.sqrt(new_nu[d] / (1 - b2 ** t)) + eps)
      return out, (new_mu, new_nu, vel, res)

    def refreshed(g, nu):
      """``nu`` after this step's exact refresh (every ``variance_every`` steps), and the count of
      steps it stands for (its bias correction)."""
      if not variance_every:
        return nu, jnp.float32(warm)
      k = int(variance_every)
      due = (state.count - warm) % k == k - 1
      decay = b2 ** k

      def refresh(nu):
        return {d: decay * nu[d] + (1 - decay) * jnp.square(pmean(g[d], axis_name,
                                                                  algorithm=algorithm))
                for d in nu}
      nu = lax.cond(due, refresh, lambda nu: nu, nu)
      return nu, (warm + k * ((state.count - warm + 1) // k)).astype(jnp.float32)

    def compressed(args):
      g, (mu, nu, vel, res) = args
      out, new_vel, new_res = {}, {}, {}
      new_nu, new_t = refreshed(g, nu)
      for d, gd in g.items():
        pre = 1.0 / (jnp.sqrt(new_nu[d] / (1 - b2 ** new_t)) + eps)
        u = jnp.where(state.count == warm, mu[d] / (1 - b1 ** warm), vel[d])
        mean, new_vel[d], new_res[d] = corrected_mean(
            u, (1 - b1) * gd, res[d], d, binding, algorithm, compression, momentum=b1,
            nesterov=False, masking=masking, segments=groups.sizes(d))
        out[d] = mean * pre
      return out, (mu, new_nu, new_vel, new_res)

    if binding.size <= 1:
      out, carried = exact((flat, carried))
    else:
      out, carried = lax.cond(state.count < warm, exact, compressed, (flat, carried))
    leaves = groups.leaves
    others = [pmean(leaves[i], axis_name, algorithm="xla") if i in groups.others() else None
              for i in range(len(leaves))]
    trees = [groups.unflatten(c, groups.treedef.flatten_up_to(getattr(state, f)), cast=False)
             for c, f in zip(carried, ("mu", "nu", "velocity", "residual"))]
    return (groups.unflatten(out, others, cast=True),
            CompressedAdamState(state.count + 1, *trees))

  return optax.GradientTransformation(init_fn, update_fn)
