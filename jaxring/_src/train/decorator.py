"""``@jaxring.train_step``: the decorator's arguments checked and turned into a
:class:`~jaxring._src.train.step.TrainStep` (the data-parallel step, jaxring._src.train.step)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax.sharding import Mesh

from jaxring._src.algorithms.planner import validate_algorithm
from jaxring._src.collectives import axis_names, validate_compression
from jaxring._src.train import guards, sharding
from jaxring._src.train.context import ReduceConfig
from jaxring._src.train.precision import as_policy
from jaxring._src.train.step import TrainStep


def train_step(mesh: Mesh | None = None, *, axis_name: Any = "data", algorithm: Any = "auto",
               compression: Any = None, error_feedback: bool = True,
               bucket_bytes: int | str = 25 << 20,
               overlap: bool = True, donate: bool = True, precision: Any = None,
               momentum: float | None = None, nesterov: bool = False,
               clip_norm: str | None = "auto", shard: str = "none", hpz: bool = False,
               grad_axes: Any = None):
  """Turns a per-replica train step into a data-parallel step.

  The step is written for one device in one of three forms: ``step(state, batch) -> (state,
  metrics)`` with a ``TrainState`` (Linen); ``step(model, optimizer, batch) -> metrics`` with
  Flax NNX objects, updated in place as under ``nnx.jit`` (the NNX objects first; the float
  variables that are neither parameters nor optimizer state, ``nnx.BatchStat``, averaged over the
  replicas; residuals in ``optimizer.residuals``); ``step(params, opt_state, batch) -> (params,
  opt_state, metrics)`` with an optax state (plain JAX, Equinox; residuals returned in
  :class:`jaxring.train.OptState`). The batch is split over the replicas along its leading axis;
  arguments after it (``step(state, batch, key)``) reach every replica whole. Gradients must
  come from :func:`jaxring.value_and_grad` (or a collective of your own): a step that updates
  the parameters with unreduced ``jax.grad`` (or ``nnx.value_and_grad``) gradients is refused.

  Args:
    mesh: device mesh with axis/axes ``axis_name`` (default: all devices of all processes).
    axis_name: the data-parallel axis, or a tuple such as ``("node", "local")`` (hierarchical).
    algorithm: ``"auto"``, ``"xla"``, ``"ring"``, ``"hierarchical"`` or a per-level dict (as
      :func:`jaxring.psum`).
    compression: None, a codec, or a dict level -> codec (as :func:`jaxring.psum`): the
      gradients' reduction. With ``shard="params"``, ``{"params": c1, "grads": c2}`` also
      compresses the parameters' all-gather (each value as above).
    error_feedback: with a lossy codec, carry each replica's compression error into the next step
      (residuals in ``state.residuals``).
    bucket_bytes: gradient bytes fused into one reduction, or ``"auto"``: chosen jointly with
      each bucket's algorithm from the measured profile (``jaxring calibrate``; the model:
      jaxring._src.train.buckets.auto_bucket_bytes), 25 MiB without one.
    overlap: reduce each bucket inside the backward pass (False: after it, the baseline).
    donate: donate the input state's buffers to the output state.
    precision: None (f32), ``"bf16"``, ``"fp16"`` (dynamic loss scaling) or a ``Policy``.
    momentum: momentum correction (:func:`jaxring.momentum_correction`'s rule) inside the
      reduction: each replica accumulates its velocity before compression, with error feedback;
      the state's optimizer must then be momentum-free (``optax.sgd(lr)``). Needed for momentum
      with ``topk_chunks``, where momentum in the optimizer is refused (it trains to chance).
      The velocity is kept beside the residuals and checkpointed with them: ``state.residuals``
      leaves are then ``(replicas, 2 * size + 1)``, each replica's residual, velocity and the
      bucket's running gradient norm, flat (``jaxring._src.train.grad.momentum_parts``).
    nesterov: Nesterov momentum (with ``momentum``).
    clip_norm: with ``momentum``, ``"auto"`` (default) clips each bucket's gradient on each
      replica to twice the running average of its norm before it enters the velocity
      (:func:`jaxring.momentum_correction`'s ``"auto"`` per bucket, since a bucket is reduced
      before the rest of the gradient exists); None: no clipping.
    shard: ``"none"`` (replicated state), ``"optimizer"`` (ZeRO-1/2: optimizer state split over
      the replicas, gradients reduce-scattered, parameters all-gathered after the update) or
      ``"params"`` (FSDP/ZeRO-3: parameters split too, gathered bucket by bucket where the
      forward and backward passes use them). The step function is the same; inside it
      ``state.params`` are this replica's blocks, which ``jaxring.value_and_grad`` gathers. Any
      optax optimizer: one that reduces over leaves (global-norm clipping, LAMB, Adafactor) runs
      with its reductions made collective (jaxring._src.train.global_view).
    hpz: with ``shard="params"`` and a hierarchical ``axis_name`` such as ``("node", "local")``,
      keep between the two passes each gathered bucket's piece for this device's node (1/local
      of the bucket, ZeRO++'s secondary partition), so the backward pass all-gathers over the
      last axis only, within the node, instead of across every node again.
    grad_axes: the axes each step's gradients are averaged over (default: all of ``axis_name``).
      With ``tx=jaxring.diloco(inner, axis="node", every=H)``, the fast ones (``"local"``): the
      slow axis is then synced every H steps by the optimizer, whose per-replica values (each
      replica's parameters between syncs, the inner optimizer's state) the step keeps sharded
      beside the state; ``state.params`` are the outer parameters, as of the last sync
      (jaxring._src.train.diloco_layout).

  Returns:
    A decorator producing a :class:`TrainStep`.

  Example:
    >>> @jaxring.train_step(compression=jaxring.codecs.int8())
    ... def step(state, batch):
    ...   loss, grads = jaxring.value_and_grad(loss_fn)(state.params, batch)
    ...   return state.apply_gradients(grads=grads), {"loss": loss}
    >>> state, metrics = step(state, {"x": x, "y": y})  # x, y: the global batch
  """
  if callable(mesh) and not isinstance(mesh, Mesh):  # bare @train_step
    return train_step()(mesh)
  validate_algorithm(algorithm)
  shard = sharding.validate_shard(shard)
  param_compression, compression = sharding.split_compression(compression, shard)
  validate_compression(param_compression)
  validate_compression(compression)
  if shard != "none" and (momentum or not overlap):
    raise ValueError(f"train_step: shard={shard!r} reduce-scatters inside the backward pass and "
                     "keeps no velocity; it takes neither momentum= nor overlap=False")
  axes = axis_names(axis_name)
  if hpz and (shard != "params" or len(axes) < 2):
    raise ValueError(f"train_step: hpz=True keeps a node-local copy of the gathered parameters: "
                     f"it needs shard='params' and a hierarchical axis_name such as ('node', "
                     f"'local'); got shard={shard!r}, axis_name={axis_name!r}")
  if mesh is not None and not set(axes) <= set(mesh.axis_names):
    raise ValueError(f"train_step: axis_name {axis_name!r} is not an axis of the mesh "
                     f"{mesh.axis_names}")
  guards.validate_momentum(momentum, clip_norm, error_feedback)
  fast = axes if grad_axes is None else axis_names(grad_axes)
  fast = tuple(a for a in axes if a in fast) if set(fast) <= set(axes) else fast
  if not fast or not set(fast) <= set(axes):
    raise ValueError(f"train_step: grad_axes={grad_axes!r} must name one or more of the step's "
                     f"axes {axes} (the fast ones, with jaxring.diloco syncing the rest)")
  config = ReduceConfig(axes, algorithm, compression, error_feedback,
                        guards.validate_bucket_bytes(bucket_bytes), overlap, as_policy(precision),
                        momentum=momentum, nesterov=bool(nesterov), clip_norm=clip_norm,
                        shard=shard, param_compression=param_compression, hpz=bool(hpz),
                        grad_axes=() if fast == axes else fast)

  def decorate(fn: Callable) -> TrainStep:
    return TrainStep(fn, mesh, config, donate)

  return decorate
