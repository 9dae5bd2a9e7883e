"""A sharded train step's buckets: all-gather the parameters forward, reduce-scatter backward.

A bucket of split leaves (jaxring._src.train.sharding) passes through one ``jax.custom_vjp``
before the loss function sees it, like an all-reduced bucket (jaxring._src.train.grad), but its
primal is the replica's *blocks*: the forward rule all-gathers them into the full leaves (one
collective for the bucket, with the parameters' codec; or, with ``shard="optimizer"``, takes the
replicated leaves the step already holds), and the backward rule turns the full cotangents into
rows, one per replica, adds this replica's error-feedback residual, and reduce-scatters them (one
collective, the gradients' codec, per-hop requantization on the ring): each replica gets the mean
of its own block, and the error its encodings made as the residual's cotangent.

With ``shard="params"`` the loss is rematerialized with :func:`regather_policy`, which saves
everything except the exact all-gathers: the backward pass gathers those parameters again instead
of keeping every layer's full parameters alive between the two passes.

With ``hpz`` (ZeRO++'s secondary partition, on axes ``(outer..., local)``) the blocks are ordered
local-major (``ReduceConfig.split_axes``), so gathering over the outer axes gives each device a
contiguous piece of every leaf, 1/local of it, and gathering those pieces over ``local`` gives
the leaf. The policy keeps the pieces and drops the leaves: the backward pass gathers within the
node only. The reduce-scatter runs in the engine's node-major order, so its rows are permuted.

Each bucket's rows carry one extra column, the token (see grad.py): the previous bucket's
reduced token, so that XLA neither merges the reduce-scatters nor reorders them.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxring._src import fuse, native
from jaxring._src.algorithms import engine
from jaxring._src.codecs.base import accum_dtype
from jaxring._src.collectives import is_lossy
from jaxring._src.error_feedback import next_residual
from jaxring._src.train.sharding import dim_list, from_rows, full_shape, to_rows
from jaxring._src.transport.groups import axis_arg


def regather_policy(axes: tuple, local=None):
  """A ``jax.checkpoint`` policy saving everything but the exact all-gathers over ``axes`` (and,
  with hpZ, over the node's axis ``local``): the backward pass gathers those parameters again
  instead of keeping them from the forward pass."""
  dropped = [set(axes)] + ([{local}] if local is not None else [])

  def policy(prim, *_, **params):
    if prim.name != "all_gather":
      return True
    axis = params.get("axis_name")
    return set(axis if isinstance(axis, tuple) else (axis,)) not in dropped

  return policy


def _hpz_levels(axes: tuple) -> tuple[str, tuple]:
  """``(local, outer)`` of blocks ordered by ``ReduceConfig.split_axes`` with hpZ."""
  return axes[0], axes[1:]


def gather_leaves(blocks: Sequence, dims: Sequence[int], shapes: Sequence, axes: tuple,
                  algorithm, compression, hpz: bool = False) -> list:
  """The full leaves of ``shapes`` from every replica's blocks (split along ``dims``, ordered by
  ``axes``; with ``hpz`` the node's axis first: gathered over the outer axes, then the node).

  Exactly (no codec): one native all-gather per leaf, straight into the leaf's layout, so that
  the all-gather's output *is* the full leaf and :func:`regather_policy` can leave it out of
  what the backward pass keeps (XLA combines the per-leaf gathers; gloo's and NCCL's all-gather
  are bandwidth-optimal rings already). With a codec: one all-gather of the bucket, by the
  step's algorithm, in the codec's wire format (the blocks' dtype is what is encoded: f32
  master weights stay f32 on their owner); the decoded leaves are kept for the backward pass.
  """
  if hpz:
    local, outer = _hpz_levels(axes)
  if not is_lossy(compression):
    if hpz:  # the node's piece (kept for the backward pass), then the leaf (dropped)
      return [native.all_gather(native.all_gather(b, axis_arg(outer), axis=d, tiled=True),
                                local, axis=d, tiled=True) for b, d in zip(blocks, dims)]
    return [native.all_gather(b, axis_arg(axes), axis=d, tiled=True)
            for b, d in zip(blocks, dims)]
  p = engine.bind(axes, "all_gather").size
  dtype = jnp.result_type(*blocks)
  flat = jnp.concatenate([jnp.ravel(b).astype(dtype) for b in blocks])
  if hpz:  # the codec on the outer level only; within the node the decoded values, exactly
    piece = engine.all_gather(flat, 0, True, engine.bind(outer, "all_gather"), algorithm,
                              compression)
    gathered = native.all_gather(piece, local, axis=0, tiled=True)
  else:
    gathered = engine.all_gather(flat, 0, True, engine.bind(axes, "all_gather"), algorithm,
                                 compression)
  rows = gathered.reshape(p, -1)
  out, col = [], 0
  for b, d, shape in zip(blocks, dims, shapes):
    n = b.size
    out.append(from_rows(rows[:, col:col + n], d, tuple(shape)).astype(b.dtype))
    col += n
  return out


def scatter_bucket(cfg, cts: Sequence, dims: Sequence[int], residuals, tok, inv_scale,
                   check_finite: bool):
  """Mean of one bucket's full cotangents, each replica getting its own blocks, in one collective.

  Returns ``(block means, new full-shaped residuals or None, token, local non-finite flag)``.
  """
  binding = engine.bind(cfg.axes, "value_and_grad")
  p = binding.size
  dtype = jnp.dtype(cts[0].dtype)
  acc = accum_dtype(dtype)
  rows = [to_rows(c.astype(acc), d, p) for c, d in zip(cts, dims)]
  if inv_scale is not None:
    rows = [r * inv_scale.astype(acc) for r in rows]
  nonfinite = None
  if check_finite:
    nonfinite = jnp.logical_not(jnp.all(jnp.stack([jnp.all(jnp.isfinite(r)) for r in rows])))
    nonfinite = nonfinite.astype(jnp.float32)
  if residuals is not None:
    rows = [r + to_rows(e.astype(acc), d, p) for r, e, d in zip(rows, residuals, dims)]
  grid = jnp.concatenate(rows + [jnp.broadcast_to(jnp.reshape(tok, (1, 1)).astype(acc), (p, 1))],
                         axis=1)
  local = int(lax.axis_size(cfg.axes[-1])) if cfg.hpz else 1
  if cfg.hpz:  # rows in block order (local-major) -> the engine's member order (node-major)
    grid = grid.reshape(local, p // local, -1).swapaxes(0, 1).reshape(p, -1)
  want_error = residuals is not None
  shard, err = engine.reduce_scatter_flat(grid.reshape(-1), dtype, binding, cfg.algorithm,
                                          cfg.compression, want_error=want_error)
  mean = shard / p
  tok_out = shard[-1].astype(jnp.float32)
  blocks, col = [], 0
  for c, d in zip(cts, dims):
    n = c.size // p
    block_shape = c.shape[:d] + (c.shape[d] // p,) + c.shape[d + 1:]
    blocks.append(mean[col:col + n].reshape(block_shape).astype(dtype))
    col += n
  new_res = None
  if want_error:
    err = jnp.zeros_like(grid) if err is None else err.reshape(grid.shape)
    err = next_residual(mean, err, dtype, row=lax.axis_index(cfg.axes))  # the block's owner's row
    if cfg.hpz:  # back to block order
      err = err.reshape(p // local, local, -1).swapaxes(0, 1).reshape(p, -1)
    new_res, col = [], 0
    for c, d in zip(cts, dims):
      n = c.size // p
      new_res.append(from_rows(err[:, col:col + n], d, c.shape))
      col += n
  return blocks, new_res, tok_out, nonfinite


def sharded_identity(cfg, dims: tuple, shapes: tuple, check_finite: bool):
  """Identity from a bucket's blocks to its full leaves whose backward rule reduce-scatters.

  Called as ``ident(blocks, full, residuals, tok, inv_scale, flag)``; ``full`` is None (gather
  the blocks) or, with ``shard="optimizer"``, the replicated leaves, None where the step passed
  other values than the state's blocks (those are gathered).
  """

  @jax.custom_vjp
  def ident(blocks, full, residuals, tok, inv_scale, flag):
    return _forward(blocks, full), tok

  def _forward(blocks, full):
    full = list(full) if full is not None else [None] * len(blocks)
    todo = [k for k, f in enumerate(full) if f is None]
    if todo:
      gathered = gather_leaves([blocks[k] for k in todo], [dims[k] for k in todo],
                               [shapes[k] for k in todo], cfg.split_axes, cfg.algorithm,
                               cfg.param_compression, cfg.hpz)
      for k, x in zip(todo, gathered):
        full[k] = x
    return tuple(full)

  def fwd(blocks, full, residuals, tok, inv_scale, flag):
    del flag
    return (_forward(blocks, full), tok), (residuals, inv_scale, tok)

  def bwd(saved, cts):
    residuals, inv_scale, tok = saved
    ct_leaves, ct_tok = cts
    means, new_res, tok_out, nonfinite = scatter_bucket(cfg, ct_leaves, dims, residuals, ct_tok,
                                                        inv_scale, check_finite)
    return (tuple(means), None, None if new_res is None else tuple(new_res),
            tok_out.astype(tok.dtype), None if inv_scale is None else jnp.zeros_like(inv_scale),
            nonfinite)

  ident.defvjp(fwd, bwd)
  return ident


def gather_params(params, dims, axes: tuple, algorithm):
  """The full parameters from every replica's blocks (exactly: the state's replicated copy),
  one all-gather per dtype; leaves with ``dims`` None are already whole."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  dim_leaves = dim_list(params, dims)
  p = engine.bind(axes, "all_gather").size
  out = list(leaves)
  for idx in fuse.by_dtype(leaves).values():
    idx = [i for i in idx if dim_leaves[i] is not None]
    if not idx:
      continue
    full = gather_leaves([leaves[i] for i in idx], [dim_leaves[i] for i in idx],
                         [full_shape(leaves[i].shape, dim_leaves[i], p) for i in idx], axes,
                         algorithm, None)
    for i, x in zip(idx, full):
      out[i] = x
  return jax.tree_util.tree_unflatten(treedef, out)
