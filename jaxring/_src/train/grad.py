"""``jaxring.value_and_grad`` / ``grad``: gradients reduced across replicas inside the backward pass.

Inside a :func:`jaxring.train_step`, each bucket of parameters (jaxring._src.train.buckets) passes
through an identity ``jax.custom_vjp`` before the loss function sees it. Its backward rule receives
the bucket's complete cotangents as soon as backprop has produced them, flattens them into one
buffer, adds this replica's error-feedback residual, reduces the buffer with one collective and
returns the mean as the parameters' cotangent and the new compression error as the residual's
cotangent (we differentiate with respect to parameters and residuals together). The reduction thus
sits in the middle of the backward pass, where XLA can run it alongside the remaining backprop.

Each bucket's buffer carries one extra element, a token: the previous bucket's reduced token. That
data dependency keeps XLA's all-reduce combiner from merging every bucket into one all-reduce at the
end of the step (measured: without it, XLA:CPU combines them all), and orders the reductions as the
buckets complete. The token is always 0 (a sum of zeros).

Outside a train_step these functions are ``jax.value_and_grad`` / ``jax.grad``.
"""
from __future__ import annotations

import sys
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxring._src import fuse, native
from jaxring._src.algorithms import engine
from jaxring._src.codecs.base import accum_dtype
from jaxring._src.collectives import axis_names
from jaxring._src.error_feedback import next_residual
from jaxring._src.optim.momentum import auto_clip, corrected_mean
from jaxring._src.train import nnx_graph, partition
from jaxring._src.train.buckets import (
  Bucket,
  auto_bucket_bytes,
  make_buckets,
  use_order,
)
from jaxring._src.train.context import (
  ReduceConfig,
  ShardedParams,
  StepContext,
  current_context,
  replica_count,
)
from jaxring._src.train.fsdp import gather_params, regather_policy, sharded_identity
from jaxring._src.train.loss_check import check_output
from jaxring._src.train.precision import Policy


def _all_reduce(flat, dtype, cfg: ReduceConfig, want_error: bool, segments=None):
  return engine.all_reduce_flat(flat, dtype, engine.bind(cfg.reduce_axes, "value_and_grad"),
                                cfg.algorithm, cfg.compression, want_error=want_error,
                                segments=segments)


def _split(flat, like: Sequence, dtype=None):
  out, offset = [], 0
  for x in like:
    size = x.size
    out.append(flat[offset:offset + size].reshape(x.shape).astype(dtype or x.dtype))
    offset += size
  return out


def replica_mean(tree, axis_name):
  """Every leaf's mean over the replicas (integers as float32), a dtype's leaves fused into one
  all-reduce (gloo ran XLA:CPU's combined one operand by operand: docs/benchmarks.md, "Training
  on the emulated cluster"), planned as ``auto`` (a process's own devices: in shared memory)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  leaves = [jnp.asarray(x) for x in leaves]
  leaves = [x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.float32) for x in leaves]
  binding, out = engine.bind(axis_names(axis_name), "train_step"), list(leaves)
  for idxs in fuse.by_dtype(leaves).values():
    flat = fuse.concat(leaves, idxs)
    total = engine.all_reduce_flat(flat.astype(accum_dtype(flat.dtype)), flat.dtype, binding,
                                   "auto", None)[0]
    for i, x in zip(idxs, fuse.split((total / binding.size).astype(flat.dtype), leaves, idxs)):
      out[i] = x
  return jax.tree_util.tree_unflatten(treedef, out)


def reduce_bucket(cfg: ReduceConfig, cts: Sequence, residuals, tok, inv_scale, check_finite: bool):
  """Mean of one bucket's cotangents over the replicas, in one collective.

  Returns ``(means, new_residuals or None, token, local non-finite flag or None)``.
  """
  dtype = jnp.dtype(cts[0].dtype)
  acc = accum_dtype(dtype)
  grads = [jnp.ravel(c).astype(acc) for c in cts]
  if inv_scale is not None:
    grads = [g * inv_scale.astype(acc) for g in grads]
  flat = jnp.concatenate(grads)
  nonfinite = None
  if check_finite:
    nonfinite = jnp.logical_not(jnp.all(jnp.isfinite(flat))).astype(jnp.float32)
  if residuals is not None and cfg.corrects_momentum:
    return _reduce_bucket_with_momentum(cfg, cts, grads, residuals, tok, dtype) + (nonfinite,)
  if residuals is not None:
    flat = flat + jnp.concatenate([jnp.ravel(r).astype(acc) for r in residuals])
  flat = jnp.concatenate([flat, jnp.reshape(tok, (1,)).astype(acc)])
  total, err = _all_reduce(flat, dtype, cfg, want_error=residuals is not None,
                           segments=_segments(cts))
  mean = total[:-1] / replica_count(cfg.reduce_axes)
  new_res = None
  if residuals is not None:
    new_res = _split(next_residual(mean, None if err is None else err[:-1], dtype), residuals)
  return _split(mean, cts), new_res, total[-1].astype(jnp.float32), nonfinite


def _segments(cts: Sequence) -> tuple[int, ...]:
  """The sizes of a bucket's tensors in its flat buffer, and the token after them."""
  return engine.segment_sizes(cts) + (1,)


def momentum_parts(leaf, size: int):
  """A momentum-corrected residual leaf (one replica's, flat): ``(residual, velocity, running
  gradient norm)`` of a tensor of ``size`` values."""
  return leaf[:size], leaf[size:2 * size], leaf[2 * size]


def momentum_leaf_size(size: int) -> int:
  """Values in a momentum-corrected residual leaf of a tensor of ``size`` values."""
  return 2 * size + 1


def _reduce_bucket_with_momentum(cfg: ReduceConfig, cts: Sequence, grads, residuals, tok, dtype):
  """reduce_bucket's momentum-corrected form: the velocity is accumulated before compression
  (jaxring.momentum_correction's rule, one source: corrected_mean). With ``clip_norm="auto"``
  the bucket's gradient is first clipped to twice the running average of its norm on this
  replica: momentum_correction's auto rule over as much of the gradient as exists when the
  bucket is reduced (all of it when the model fits one bucket). Every leaf of the bucket keeps
  the bucket's running norm."""
  acc = grads[0].dtype
  parts = [momentum_parts(x, g.size) for x, g in zip(residuals, grads)]
  norms = jnp.stack([p[2] for p in parts])
  if cfg.clip_norm == "auto":
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in grads))
    scale, average = auto_clip(norm, norms[0])
    grads = [g * scale.astype(acc) for g in grads]
    norms = jnp.broadcast_to(average, norms.shape)
  zero = jnp.zeros((1,), acc)
  r, u = (jnp.concatenate([p[i] for p in parts] + [zero]) for i in (0, 1))
  g = jnp.concatenate(grads + [jnp.reshape(tok, (1,)).astype(acc)])
  binding = engine.bind(cfg.reduce_axes, "value_and_grad")
  mean, u, r = corrected_mean(u, g, r, dtype, binding, cfg.algorithm, cfg.compression,
                              momentum=float(cfg.momentum), nesterov=cfg.nesterov,
                              masking="flush", segments=_segments(cts))
  flat = [jnp.ravel(c) for c in cts]
  new_res = [jnp.concatenate([a, b, n[None].astype(acc)])
             for a, b, n in zip(_split(r[:-1], flat, acc), _split(u[:-1], flat, acc), norms)]
  tokens = mean[-1] * replica_count(cfg.reduce_axes)
  return _split(mean[:-1], cts), new_res, tokens.astype(jnp.float32)


def _bucket_identity(cfg: ReduceConfig, check_finite: bool):
  """Identity on (leaves, token) whose backward rule reduces the leaves' cotangents."""

  @jax.custom_vjp
  def ident(leaves, residuals, tok, inv_scale, flag):
    del residuals, inv_scale, flag
    return leaves, tok

  def fwd(leaves, residuals, tok, inv_scale, flag):
    del flag
    return (leaves, tok), (residuals, inv_scale, tok)

  def bwd(saved, cts):
    residuals, inv_scale, tok = saved
    ct_leaves, ct_tok = cts
    means, new_res, tok_out, nonfinite = reduce_bucket(cfg, ct_leaves, residuals, ct_tok,
                                                       inv_scale, check_finite)
    return (tuple(means), None if new_res is None else tuple(new_res), tok_out.astype(tok.dtype),
            None if inv_scale is None else jnp.zeros_like(inv_scale), nonfinite)

  ident.defvjp(fwd, bwd)
  return ident


def _caller(fun, args, kwargs, argnums, treedef, policy: Policy | None):
  """``fun`` as a function of the flattened differentiated arguments (cast by the policy)."""
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

  def call(diff_leaves):
    new_args = list(args)
    tree = jax.tree_util.tree_unflatten(treedef, list(diff_leaves))
    if isinstance(argnums, int):
      new_args[argnums] = tree
    else:
      for k, i in enumerate(nums):
        new_args[i] = tree[k]
    if policy is not None:
      new_args = [policy.cast_to_compute(a) if i in nums or _is_data(a) else a
                  for i, a in enumerate(new_args)]
    return fun(*new_args, **kwargs)
  return call


def _through_bucket_identities(cfg, buckets, diff_leaves, residuals, flags, inv_scale, check,
                               shard: ShardedParams | None = None, held: tuple = ()):
  """Passes each bucket through its reducing identity, chained by the token in forward order.

  A bucket of split leaves (``shard``) goes through jaxring._src.train.fsdp's identity instead:
  blocks in, full leaves out, reduce-scattered gradients back. ``held[i]``: the replicated leaf
  ``i`` where the step passed the state's own block of it (``ShardedParams.held_full``).
  """
  diff_leaves = list(diff_leaves)
  tok = jnp.zeros((), jnp.float32)
  for k in reversed(range(len(buckets))):  # forward order: the bucket reduced last goes first
    b = buckets[k]
    res = None if residuals is None else tuple(residuals[i] for i in b.indices)
    blocks = tuple(diff_leaves[i] for i in b.indices)
    flag = flags[k] if check else None
    if shard is not None and shard.dims[b.indices[0]] is not None:
      ident = sharded_identity(cfg, tuple(shard.dims[i] for i in b.indices),
                               tuple(shard.shapes[i] for i in b.indices), check)
      full = tuple(held[i] for i in b.indices)
      full = None if all(f is None for f in full) else full
      out, tok = ident(blocks, full, res, tok, inv_scale, flag)
    else:
      out, tok = _bucket_identity(cfg, check)(blocks, res, tok, inv_scale, flag)
    for i, x in zip(b.indices, out):
      diff_leaves[i] = x
  return diff_leaves


def _bucket_bytes(cfg: ReduceConfig, leaves, order) -> int:
  """``cfg.bucket_bytes``, or with ``"auto"`` the profile's choice for these gradients."""
  if cfg.bucket_bytes != "auto":
    return cfg.bucket_bytes
  return auto_bucket_bytes(leaves, order, cfg.reduce_axes, algorithm=cfg.algorithm,
                           compression=cfg.compression, overlap=cfg.overlap).bucket_bytes


def _sharded_buckets(cfg, shard: ShardedParams, leaves, call) -> list[Bucket]:
  """Buckets of a sharded step: split leaves and whole leaves never share one (one is gathered
  and reduce-scattered, the other all-reduced); both lists merged in order of readiness."""
  full = [jax.ShapeDtypeStruct(s, x.dtype) for s, x in zip(shard.shapes, leaves)]
  order = use_order(lambda *ls: call(ls), full)
  split = [i for i in order if shard.dims[i] is not None]
  whole = [i for i in order if shard.dims[i] is None]
  position = {i: k for k, i in enumerate(reversed(order))}
  buckets = []
  for part in (split, whole):
    if part:
      sub = make_buckets([full[i] for i in part], range(len(part)),
                         _bucket_bytes(cfg, [full[i] for i in part], range(len(part))))
      buckets += [Bucket(tuple(part[j] for j in b.indices), b.dtype, b.numel) for b in sub]
  return sorted(buckets, key=lambda b: max(position[i] for i in b.indices))


def _after_backward_token(grads: Sequence):
  """A zero scalar that depends on every gradient, so the first reduction waits for all of them."""
  return sum(jnp.isnan(jnp.ravel(g)[0]).astype(jnp.float32) for g in grads if g.size)


def _reduced_value_and_grad(ctx: StepContext, fun, argnums, has_aux, args, kwargs):
  cfg = ctx.config
  ctx.calls += 1
  if ctx.calls > 1 and cfg.uses_residuals:
    raise RuntimeError("jaxring.value_and_grad: called twice in one train_step with error feedback;"
                       " the residuals of one step belong to one gradient reduction")
  diff = args[argnums] if isinstance(argnums, int) else tuple(args[i] for i in argnums)
  leaves, treedef = jax.tree_util.tree_flatten(diff)
  res_leaves = None
  if cfg.uses_residuals:
    res_leaves, res_def = jax.tree_util.tree_flatten(ctx.residuals)
    if res_def != treedef:
      raise ValueError("jaxring.value_and_grad: with error feedback the differentiated argument "
                       "must have the structure of state.params (the residuals are shaped like it;"
                       " NNX: the model's variables that the nnx.Optimizer's `wrt` selects); got "
                       f"{treedef} vs residuals {res_def}")
  policy = cfg.policy
  scale = ctx.loss_scale if policy is not None and policy.loss_scaling else None
  call = _caller(fun, args, kwargs, argnums, treedef, policy)
  shard = ctx.shard
  # One member: the reduction is exact and moves nothing, so there is nothing to overlap or
  # compress: one bucket per dtype after backprop, whatever the codec.
  single = shard is None and replica_count(cfg.reduce_axes) == 1
  overlap = cfg.overlap and not single
  held = ()
  if shard is None:
    order = use_order(lambda *ls: call(ls), leaves)
    bucket_bytes = sys.maxsize if single else _bucket_bytes(cfg, leaves, order)
    buckets = make_buckets(leaves, order, bucket_bytes)
  else:
    part = shard.part(leaves, treedef)
    if part is None:
      raise ValueError(
          "jaxring.value_and_grad: a sharded train_step differentiates with respect to "
          "state.params, or to a subtree of them as the step received them (each replica holds "
          f"blocks, gathered here); got an argument of structure {treedef}, the parameters are "
          f"{shard.treedef}")
    shard = part
    buckets = _sharded_buckets(cfg, shard, leaves, call)
    held = tuple(shard.held_full(i, x) for i, x in enumerate(leaves))  # before tracing the vjp
  ctx.buckets = buckets
  inv_scale = None if scale is None else (1.0 / scale).astype(jnp.float32)
  check = scale is not None

  def inner(diff_leaves, residuals, flags):
    if overlap:
      diff_leaves = _through_bucket_identities(cfg, buckets, diff_leaves, residuals, flags,
                                               inv_scale, check, shard, held)
    out = call(diff_leaves)
    check_output(out, has_aux)
    loss, aux = out if has_aux else (out, None)
    objective = loss.astype(jnp.float32)
    if scale is not None:
      objective = objective * scale
    return objective, (loss, aux)

  if shard is not None and shard.remat:
    inner = jax.checkpoint(inner, policy=regather_policy(cfg.axes, cfg.axes[-1] if cfg.hpz
                                                         else None))

  flags = [jnp.zeros((), jnp.float32) for _ in buckets] if check else None
  (_, (loss, aux)), (g_leaves, g_res, g_flags) = jax.value_and_grad(
      inner, argnums=(0, 1, 2), has_aux=True)(leaves, res_leaves, flags)
  if not overlap:
    g_leaves, g_res, g_flags = _reduce_after_backward(cfg, buckets, g_leaves, res_leaves,
                                                      inv_scale, check)
  if cfg.uses_residuals:
    ctx.new_residuals = jax.tree_util.tree_unflatten(treedef, list(g_res))
  if check:
    local = sum(g_flags) if g_flags else jnp.zeros((), jnp.float32)
    ctx.finite = native.psum(local, cfg.axis_name) == 0
  grads = jax.tree_util.tree_unflatten(treedef, list(g_leaves))
  if shard is not None:
    ctx.note_split(g_leaves, shard.dims)
  if policy is not None:
    loss = loss.astype(jnp.float32)
  value = (loss, aux) if has_aux else loss
  return value, grads


def _reduce_after_backward(cfg, buckets, grads, residuals, inv_scale, check):
  """The baseline: the same buckets, reduced one after another once backprop has finished."""
  grads, flags = list(grads), []
  new_res = None if residuals is None else list(residuals)
  tok = _after_backward_token(grads)
  for b in buckets:
    res = None if residuals is None else [residuals[i] for i in b.indices]
    means, nr, tok, nonfinite = reduce_bucket(cfg, [grads[i] for i in b.indices], res, tok,
                                              inv_scale, check)
    for j, i in enumerate(b.indices):
      grads[i] = means[j]
      if nr is not None:
        new_res[i] = nr[j]
    if check:
      flags.append(nonfinite)
  return grads, new_res, flags


def _is_data(x) -> bool:
  """Non-differentiated arguments cast by a compute policy: arrays and pytrees of arrays."""
  leaves = jax.tree_util.tree_leaves(x)
  return bool(leaves) and all(hasattr(l, "dtype") for l in leaves)


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False):
  """``jax.value_and_grad`` whose gradients are already averaged over the replicas.

  Inside a :func:`jaxring.train_step`, the gradients are reduced bucket by bucket inside the
  backward pass, with the step's algorithm, compression and error feedback; the value (and aux) is
  this replica's. An optimizer that reads the loss (``optax.contrib.reduce_on_plateau``,
  ``polyak_sgd``, ``lbfgs``: ``tx.update(..., value=loss)``) must get the same value on every
  replica, ``jax.lax.pmean(loss, "data")`` (the step's ``axis_name``), or the replicas drift
  apart. Outside a train step, this is ``jax.value_and_grad``. Call it once per step.

  The differentiated argument may be a Flax NNX Module: then this is ``nnx.value_and_grad``
  (``argnums`` may be ``nnx.DiffState``; the gradients are an ``nnx.State``; the other variables
  the call changes, ``nnx.BatchStat`` say, are written back). An argument holding leaves that are
  not numbers (an ``eqx.Module``'s functions) is differentiated in its arrays, as
  ``eqx.filter_value_and_grad`` does (None gradients for the rest).

  Args:
    fun: the loss function; returns a scalar (or ``(scalar, aux)`` with ``has_aux``).
    argnums: which positional argument(s) to differentiate (or ``nnx.DiffState``).
    has_aux: as in ``jax.value_and_grad``.

  Returns:
    A function returning ``(value, grads)`` (``((value, aux), grads)`` with ``has_aux``).

  Example:
    >>> @jaxring.train_step()
    ... def step(state, batch):
    ...   loss, grads = jaxring.value_and_grad(loss_fn)(state.params, batch)
    ...   return state.apply_gradients(grads=grads), {"loss": loss}
    >>> @jaxring.train_step()              # Flax NNX: the objects updated in place
    ... def nnx_step(model, optimizer, batch):
    ...   loss, grads = jaxring.value_and_grad(loss_fn)(model, batch)
    ...   optimizer.update(model, grads)
    ...   return {"loss": loss}
  """

  def wrapped(*args, **kwargs):
    ctx = current_context()
    if nnx_graph.uses_nnx(args, argnums):
      if ctx is None:
        return nnx_graph.nnx_module().value_and_grad(fun, argnums=argnums, has_aux=has_aux)(
            *args, **kwargs)
      reduced = lambda f, nums, aux: lambda *a: _reduced_value_and_grad(  # noqa: E731
          ctx, f, nums, aux, a, {})
      return nnx_graph.value_and_grad(reduced, fun, argnums, has_aux, args, kwargs)
    if ctx is None:
      plain = lambda f, nums, aux: jax.value_and_grad(f, argnums=nums, has_aux=aux)  # noqa: E731
    else:
      plain = lambda f, nums, aux: lambda *a, **k: _reduced_value_and_grad(  # noqa: E731
          ctx, f, nums, aux, a, k)
    if partition.has_static_leaves(args, argnums):   # an Equinox Module: its arrays only
      return partition.value_and_grad(plain, fun, argnums, has_aux, args, kwargs)
    return plain(fun, argnums, has_aux)(*args, **kwargs)

  return wrapped


def full_params(params):
  """Inside a sharded train step (``shard="optimizer"|"params"``), the whole parameters gathered
  exactly from this replica's blocks ``params`` (e.g. ``state.params``, before or after the
  update); elsewhere ``params`` itself. For what the step computes outside
  :func:`value_and_grad` (a metric of the updated model); gradients need no such call.

  Example:
    >>> logits = state.apply_fn({"params": jaxring.train.full_params(state.params)}, x)
  """
  ctx = current_context()
  if ctx is None or ctx.shard is None:
    return params
  leaves, treedef = jax.tree_util.tree_flatten(params)
  if treedef != ctx.shard.treedef:
    raise ValueError(f"jaxring.train.full_params: expected a tree like state.params "
                     f"({ctx.shard.treedef}), got {treedef}")
  dims = jax.tree_util.tree_unflatten(treedef, list(ctx.shard.dims))
  return gather_params(params, dims, ctx.config.split_axes, ctx.config.algorithm)


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False):
  """``jax.grad`` whose gradients are averaged over the replicas (see :func:`value_and_grad`).

  Example:
    >>> grads = jaxring.grad(loss_fn)(state.params, batch)  # inside a train_step: the mean
  """
  vg = value_and_grad(fun, argnums=argnums, has_aux=has_aux)

  def wrapped(*args, **kwargs):
    value, grads = vg(*args, **kwargs)
    return (grads, value[1]) if has_aux else grads

  return wrapped
