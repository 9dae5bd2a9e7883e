"""Error feedback: what compression left out of one step's gradient is sent with the next.

Each member keeps a residual ``r_i`` (its share of what did not make it onto the wire). A step
reduces ``g_i + r_i`` with the codec, which reports the error ``e_i`` each member introduced
(jaxring._src.algorithms.engine.all_reduce_flat, ``want_error=True``; the members' errors sum to the
total error exactly once), and keeps ``e_i`` as the next residual:

  applied = (sum_i (g_i + r_i) - sum_i e_i) / p,        r_i <- e_i

so that after T steps ``sum_t applied_t + mean_i r_i(T) = sum_t mean_i g_i(t)``: nothing is lost,
only delayed (Seide et al. 2014; Karimireddy et al. 2019). Top-k chunks without it simply drops
the gradient in the chunks it never picks.

The residuals live in an optax state (not a global), so they compose with ``optax.chain`` and
are saved with the train state. They are per-member values: inside ``shard_map`` each device holds
its own.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxring._src import fuse, vma
from jaxring._src.algorithms import engine
from jaxring._src.algorithms.planner import validate_algorithm
from jaxring._src.codecs.base import accum_dtype, is_float
from jaxring._src.collectives import axis_names, pmean, validate_compression


class ReduceGradientsState(NamedTuple):
  """State of :func:`reduce_gradients`: this member's residual, a tree like the gradients (in the
  accumulator dtype: f32 for 16-bit gradients)."""

  residual: Any


def is_sparsifying(compression) -> bool:
  """Whether ``compression`` (a codec or a dict level -> codec) sends only part of the values each
  step (``topk_chunks``; ``Codec.sparsifying``).

  Example:
    >>> is_sparsifying(jaxring.codecs.topk_chunks(0.01)), is_sparsifying(jaxring.codecs.int8())
    (True, False)
  """
  codecs = compression.values() if isinstance(compression, dict) else [compression]
  return any(getattr(c, "sparsifying", False) for c in codecs)


SUPPORTED = ("momentum SGD: optax.chain(jr.momentum_correction(axis, compression=c, momentum=0.9), "
             "optax.sgd(lr)); Adam: optax.chain(jr.compressed_adam(axis, compression=c), "
             "optax.scale_by_learning_rate(lr)); or jr.compressed_optimizer('nesterov'|'adam'|..., "
             "lr, axis, compression=c)")


def sparse_refusal(where: str) -> str:
  """The error message for a sparsifying codec with error feedback before a stateful optimizer."""
  return (f"{where}: topk_chunks with error feedback trains to chance when momentum or Adam "
          "follows it (the gradient it holds back is released in bursts that momentum "
          f"multiplies). Supported: {SUPPORTED}. Before plain SGD only: "
          "jr.reduce_gradients(axis, compression=c, plain_sgd_after=True)")


def bound(axes: tuple) -> bool:
  """Whether every axis in ``axes`` is bound (inside ``shard_map``/``pmap``)."""
  try:
    for a in axes:
      lax.axis_size(a)
  except NameError:
    return False
  return True


def zeros_per_member(params, axes: tuple):
  """Zeros shaped like ``params`` in the accumulator dtype, typed varying over bound ``axes``
  (a residual or velocity is each member's own)."""
  def zeros(p):
    dtype = jnp.result_type(p)
    return jnp.zeros(np.shape(p), accum_dtype(dtype) if is_float(dtype) else dtype)
  tree = jax.tree_util.tree_map(zeros, params)
  if bound(axes):
    tree = jax.tree_util.tree_map(lambda z: vma.pvary(z, axes), tree)
  return tree


def next_residual(mean, err, dtype, *, row=None):
  """This member's residual for the next step (``r_i <- e_i`` of the module docstring).

  The one place the rule lives: :func:`mean_with_error`, the compressed optimizers
  (jaxring._src.optim), and the train step's bucket reduction and sharded reduce-scatter
  (jaxring._src.train.grad, jaxring._src.train.fsdp) call it.

  Args:
    mean: this step's mean, flat, in the accumulator dtype.
    err: this member's compression error laid out like ``mean``; None after an exact reduction.
      With ``row``: laid out like the reduce-scatter's rows, ``(members, mean's size)``, not None.
    dtype: the gradients' dtype: rounding the mean to it is an error each member carries once.
    row: None, or this member's row of a reduce-scatter's ``err``, where ``mean`` is this
      member's block only: its rounding is carried in that row, by the block's owner.

  Returns:
    The residual, laid out like ``err`` (like ``mean`` without ``row``). Non-finite errors (an
    inf or nan gradient) are zeroed: this step's result already shows them, and carrying them
    would poison every later step.

  Example:
    >>> next_residual(jnp.full(4, 1 / 3), None, jnp.bfloat16)  # the bf16 rounding, carried
  """
  err = jnp.zeros_like(mean) if err is None else err
  if jnp.dtype(dtype) != mean.dtype:
    rounding = mean - mean.astype(dtype).astype(mean.dtype)
    err = err + rounding if row is None else err.at[row].add(rounding)
  return jnp.where(jnp.isfinite(err), err, jnp.zeros_like(err))


def mean_with_error(grads, residual, axis_name, *, algorithm="auto", compression=None):
  """``(applied, new_residual)`` of one error-feedback step (see the module docstring).

  Floating leaves of one dtype are fused into one flat buffer (as :func:`jaxring.psum` does) and
  reduced by the planned algorithm with ``want_error=True``. Non-finite errors (an inf or nan
  gradient) are not carried into the next step: the result already shows them.
  """
  axes = axis_names(axis_name)
  leaves, treedef = jax.tree_util.tree_flatten(grads)
  res_leaves = treedef.flatten_up_to(residual)
  binding = engine.bind(axes, "reduce_gradients")   # shard_map's axes, or an MPI-bound name
  p = binding.size
  applied, new_res = list(leaves), list(res_leaves)
  fused = lambda g: is_float(jnp.result_type(g)) and np.size(g) > 0 and p > 1
  for i, g in enumerate(leaves):
    if not fused(g):
      applied[i] = pmean(g, axis_name, algorithm=algorithm if is_float(jnp.result_type(g))
                         else "xla")
  for dtype, idxs in fuse.by_dtype(leaves, fused).items():
    acc = accum_dtype(dtype)
    flat = fuse.concat(leaves, idxs, acc) + fuse.concat(res_leaves, idxs, acc)
    total, err = engine.all_reduce_flat(flat, dtype, binding, algorithm, compression,
                                        want_error=True,
                                        segments=engine.segment_sizes(leaves[i] for i in idxs))
    mean = total / jnp.asarray(p, acc)
    # an exact reduction reports no error; the residual stays this member's (typed varying)
    err = next_residual(mean, jnp.zeros_like(flat) if err is None else err, dtype)
    for i, a, r in zip(idxs, fuse.split(mean, leaves, idxs, dtype), fuse.split(err, leaves, idxs)):
      applied[i], new_res[i] = a, r
  return (jax.tree_util.tree_unflatten(treedef, applied),
          jax.tree_util.tree_unflatten(treedef, new_res))


def reduce_gradients(axis_name, *, algorithm="auto", compression=None,
                     error_feedback: bool = True,
                     plain_sgd_after: bool = False) -> optax.GradientTransformation:
  """Mean-all-reduces gradients over ``axis_name``, compressed, with error feedback.

  Use it inside ``shard_map`` (or ``pmap``) as the first link of an optax chain: each member passes
  its local gradients and gets the mean over the members. With ``error_feedback`` the state holds
  this member's residual (per device: give it a per-device sharding when it leaves
  ``shard_map``); call ``init`` inside ``shard_map`` too, where the zeros are typed per member.

  Args:
    axis_name: mapped axis name or tuple of names to average over.
    algorithm: as in :func:`jaxring.psum` (``"auto"``, ``"ring"``, ``"hierarchical"``, ...).
    compression: None, a codec, or a dict level name -> codec (hierarchical).
    error_feedback: carry each step's compression error into the next step (state: residuals);
      without it the state is empty and the error is dropped.
    plain_sgd_after: with a sparsifying codec (``topk_chunks``) and error feedback, the caller
      states that only a stateless optimizer (plain ``optax.sgd``) follows. Without it such a
      codec is refused: momentum or Adam after it trains to chance; use
      :func:`jaxring.momentum_correction` or :func:`jaxring.compressed_adam` instead.

  Returns:
    An ``optax.GradientTransformation``; ``update(grads, state, params=None)`` returns the mean
    gradients (same tree and dtypes) and the new state.

  Raises:
    ValueError: a sparsifying codec with error feedback and not ``plain_sgd_after`` (the message
      shows the supported compositions).

  Example:
    >>> tx = optax.chain(jaxring.reduce_gradients("data", compression=jaxring.codecs.int8()),
    ...                  optax.sgd(0.1, momentum=0.9))
    >>> def train(params, batch):  # inside jax.shard_map over "data"
    ...   opt_state = tx.init(params)
    ...   grads = jax.grad(loss)(params, batch)
    ...   updates, opt_state = tx.update(grads, opt_state, params)
  """
  validate_algorithm(algorithm)
  validate_compression(compression)
  if error_feedback and is_sparsifying(compression) and not plain_sgd_after:
    raise ValueError(sparse_refusal("jaxring.reduce_gradients"))
  axes = axis_names(axis_name)

  def init_fn(params):
    if not error_feedback:
      return optax.EmptyState()
    return ReduceGradientsState(residual=zeros_per_member(params, axes))

  def update_fn(updates, state, params=None):
    del params
    if not error_feedback:
      return pmean(updates, axis_name, algorithm=algorithm, compression=compression), state
    applied, residual = mean_with_error(updates, state.residual, axis_name, algorithm=algorithm,
                                        compression=compression)
    return applied, ReduceGradientsState(residual=residual)

  return optax.GradientTransformation(init_fn, update_fn)
