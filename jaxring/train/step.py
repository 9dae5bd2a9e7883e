"""``@jaxring.train_step``: a per-replica train step turned into a jitted data-parallel SPMD step.

The decorated ``step(state, batch) -> (state, metrics)`` is written as for one device. The
decorator runs it under ``jax.shard_map`` over every device of every process: the batch is split
along its leading axis, the state is replicated, gradients from :func:`jaxring.value_and_grad` are
averaged inside the backward pass (jaxring.train.grad), BatchNorm statistics and metrics are
averaged after the step, and with fp16 a step whose gradients overflowed on any replica is skipped
on all of them.

``shard_map`` runs with ``check_vma=False`` (pmap's semantics): a gradient with respect to the
replicated parameters is then this replica's own, as in the single-device step, and only jaxring
reduces it. (With vma checking, the transpose of the implicit broadcast of the parameters would
insert a native ``psum`` of every gradient behind jaxring's back.)
"""
from __future__ import annotations

import functools
import math
import numbers
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxring._src.algorithms.planner import validate_algorithm
from jaxring._src.codecs.base import accum_dtype
from jaxring._src.collectives import _validate_compression
from jaxring.train.grad import ReduceConfig, StepContext, step_context
from jaxring.train.precision import DynamicLossScale, as_policy, select_tree


def _axes(axis_name) -> tuple:
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def default_mesh(axis_name="data") -> Mesh:
  """All devices of all processes on one axis, or (processes, local devices) for two axes.

  Example:
    >>> dict(jaxring.train.default_mesh(("node", "local")).shape)  # one process, 8 devices
    {'node': 1, 'local': 8}
  """
  axes = _axes(axis_name)
  devices = np.asarray(jax.devices())
  if len(axes) == 1:
    shape = (devices.size,)
  elif len(axes) == 2:
    shape = (jax.process_count(), jax.local_device_count())
  else:
    raise ValueError(f"default_mesh: pass a mesh for {len(axes)} axes {axes}")
  return Mesh(devices.reshape(shape), axes, axis_types=(AxisType.Auto,) * len(axes))


def _mean_over(tree, axis_name):
  def mean(x):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
      x = x.astype(jnp.float32)
    return lax.pmean(x, axis_name)
  return jax.tree_util.tree_map(mean, tree)


def _place(x, sharding: NamedSharding):
  if isinstance(x, (int, float, bool)) or getattr(x, "weak_type", False):
    # TrainState.create's step=0 is a Python int (weakly typed once on a device), a restored or
    # stepped one is not: the whole step would compile twice for that difference alone
    x = jnp.asarray(x, jnp.result_type(x))
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x
  if jax.process_count() > 1:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
  # a copy: the step donates the state, which must not delete the caller's arrays (e.g. the
  # variables returned by model.init, shared with other states); device_put(may_alias=False)
  # still aliases the caller's buffer as the first device's shard (jax 0.10)
  if isinstance(x, jax.Array):
    x = jnp.copy(x)
  return jax.device_put(x, sharding)


class TrainStep:
  """A data-parallel train step; made by :func:`train_step`. Call it as ``step(state, batch)``.

  Attributes:
    mesh: the device mesh (built on first use when none was given).
    config: the gradient-reduction settings.
    buckets: the gradient buckets of the last trace (backward order), for inspection.
  """

  def __init__(self, fn: Callable, mesh: Mesh | None, config: ReduceConfig, donate: bool):
    functools.update_wrapper(self, fn)
    self._fn = fn
    self._mesh = mesh
    self.config = config
    self.buckets = None
    self._jitted = jax.jit(self._spmd, donate_argnums=(0,) if donate else ())

  @property
  def mesh(self) -> Mesh:
    if self._mesh is None:
      self._mesh = default_mesh(self.config.axis_name)
    return self._mesh

  @property
  def num_replicas(self) -> int:
    return int(np.prod([self.mesh.shape[a] for a in self.config.axes]))

  def _state_specs(self, state):
    specs = jax.tree_util.tree_map(lambda _: P(), state)
    if getattr(state, "residuals", None) is not None:
      specs = specs.replace(residuals=jax.tree_util.tree_map(
          lambda _: P(self.config.axis_name), state.residuals))
    return specs

  def prepare(self, state):
    """Puts ``state`` on the mesh: residuals and loss scale created if needed, the rest replicated.

    Example:
      >>> state = step.prepare(state)  # optional: the first call does it
    """
    cfg = self.config
    if cfg.uses_residuals and getattr(state, "residuals", None) is None:
      if not hasattr(state, "residuals"):
        raise TypeError("train_step: error feedback keeps residuals in the state; use "
                        "jaxring.TrainState (or pass error_feedback=False)")
      state = state.replace(residuals=self._zero_residuals(state.params))
    if cfg.policy is not None and cfg.policy.loss_scaling and getattr(state, "loss_scale",
                                                                      None) is None:
      if not hasattr(state, "loss_scale"):
        raise TypeError("train_step: fp16 loss scaling keeps the scale in the state; use "
                        "jaxring.TrainState")
      state = state.replace(loss_scale=DynamicLossScale.create())
    shardings = jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s),
                                       self._state_specs(state))
    return jax.tree_util.tree_map(_place, state, shardings)

  def _zero_residuals(self, params):
    r = self.num_replicas
    sharding = NamedSharding(self.mesh, P(self.config.axis_name))
    shapes = jax.tree_util.tree_map(lambda p: ((r,) + tuple(np.shape(p)), accum_dtype(p.dtype)),
                                    params, is_leaf=lambda x: hasattr(x, "dtype"))
    make = jax.jit(lambda: jax.tree_util.tree_map(lambda sd: jnp.zeros(*sd), shapes,
                                                  is_leaf=lambda x: isinstance(x, tuple)),
                   out_shardings=jax.tree_util.tree_map(lambda _: sharding, params))
    return make()

  def shard_batch(self, batch):
    """Splits a global batch (or, with several processes, this process's part) over the replicas.

    Example:
      >>> batch = step.shard_batch({"x": images, "y": labels})  # leading axis = examples
    """
    sharding = NamedSharding(self.mesh, P(self.config.axis_name))

    def put(x):
      if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
      if jax.process_count() > 1 and not (isinstance(x, jax.Array)
                                          and not x.is_fully_addressable):
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))
      return jax.device_put(x, sharding)
    return jax.tree_util.tree_map(put, batch)

  def _needs_prepare(self, state) -> bool:
    cfg = self.config
    if cfg.uses_residuals and getattr(state, "residuals", None) is None:
      return True
    if (cfg.policy is not None and cfg.policy.loss_scaling
        and getattr(state, "loss_scale", None) is None):
      return True
    leaves = jax.tree_util.tree_leaves(state)
    return bool(leaves) and not (isinstance(leaves[0], jax.Array)
                                 and isinstance(leaves[0].sharding, NamedSharding)
                                 and leaves[0].sharding.mesh == self.mesh)

  def __call__(self, state, batch):
    if self._needs_prepare(state):
      state = self.prepare(state)
    return self._jitted(state, self.shard_batch(batch))

  def lower(self, state, batch):
    """``jax.jit(...).lower`` of the SPMD step (e.g. to read its compiled HLO)."""
    return self._jitted.lower(self.prepare(state), self.shard_batch(batch))

  def _spmd(self, state, batch):
    specs = self._state_specs(state)
    body = jax.shard_map(self._per_replica, mesh=self.mesh,
                         in_specs=(specs, P(self.config.axis_name)), out_specs=(specs, P()),
                         check_vma=False)
    return body(state, batch)

  def _per_replica(self, state, batch):
    cfg = self.config
    has_res = getattr(state, "residuals", None) is not None
    if has_res:
      state = state.replace(residuals=jax.tree_util.tree_map(lambda r: r[0], state.residuals))
    scaling = cfg.policy is not None and cfg.policy.loss_scaling
    ctx = StepContext(cfg, residuals=state.residuals if has_res else None,
                      loss_scale=state.loss_scale.scale if scaling else None)
    with step_context(ctx):
      new_state, metrics = self._fn(state, batch)
    self.buckets = ctx.buckets
    if has_res and ctx.new_residuals is not None:
      new_state = new_state.replace(residuals=ctx.new_residuals)
    if getattr(new_state, "batch_stats", None) is not None:
      new_state = new_state.replace(batch_stats=_mean_over(new_state.batch_stats, cfg.axis_name))
    metrics = _mean_over(metrics, cfg.axis_name)
    if scaling:
      new_state, metrics = self._skip_on_overflow(state, new_state, metrics, ctx.finite)
    if has_res:
      new_state = new_state.replace(
          residuals=jax.tree_util.tree_map(lambda r: r[None], new_state.residuals))
    return new_state, metrics

  @staticmethod
  def _skip_on_overflow(old, new, metrics, finite):
    """Keeps the old parameters, optimizer state and statistics where gradients overflowed.

    ``finite`` is the result of an all-reduce (jaxring.train.grad), so every replica decides alike.
    """
    finite = jnp.asarray(True) if finite is None else finite
    fields = [f for f in ("params", "opt_state", "batch_stats", "residuals")
              if getattr(new, f, None) is not None]
    new = new.replace(**{f: select_tree(finite, getattr(new, f), getattr(old, f)) for f in fields},
                      loss_scale=old.loss_scale.adjust(finite))
    if isinstance(metrics, dict):
      metrics = dict(metrics, loss_scale=old.loss_scale.scale,
                     grads_finite=finite.astype(jnp.float32))
    return new, metrics


def _validate_bucket_bytes(bucket_bytes) -> int:
  # a float such as 25e6 is a byte count too; a bool is not, though Python calls it an int
  if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, numbers.Real):
    raise TypeError(f"train_step: bucket_bytes must be a number of bytes (an int such as "
                    f"25 << 20), got {bucket_bytes!r} of type {type(bucket_bytes).__name__}")
  if not math.isfinite(bucket_bytes) or bucket_bytes < 1:
    raise ValueError(f"train_step: bucket_bytes must be a positive number of bytes, got "
                     f"{bucket_bytes!r}")
  return int(bucket_bytes)


def train_step(mesh: Mesh | None = None, *, axis_name: Any = "data", algorithm: Any = "auto",
               compression: Any = None, error_feedback: bool = True, bucket_bytes: int = 25 << 20,
               overlap: bool = True, donate: bool = True, precision: Any = None):
  """Turns a per-replica ``step(state, batch) -> (state, metrics)`` into a data-parallel step.

  Args:
    mesh: device mesh with axis/axes ``axis_name`` (default: all devices of all processes).
    axis_name: the data-parallel axis, or a tuple such as ``("node", "local")`` (hierarchical).
    algorithm: ``"auto"``, ``"xla"``, ``"ring"``, ``"hierarchical"`` or a per-level dict (as
      :func:`jaxring.psum`).
    compression: None, a codec, or a dict level -> codec (as :func:`jaxring.psum`).
    error_feedback: with a lossy codec, carry each replica's compression error into the next step
      (residuals in ``state.residuals``).
    bucket_bytes: gradient bytes fused into one reduction.
    overlap: reduce each bucket inside the backward pass (False: after it, the baseline).
    donate: donate the input state's buffers to the output state.
    precision: None (f32), ``"bf16"``, ``"fp16"`` (dynamic loss scaling) or a ``Policy``.

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
  _validate_compression(compression)
  axes = _axes(axis_name)
  if mesh is not None and not set(axes) <= set(mesh.axis_names):
    raise ValueError(f"train_step: axis_name {axis_name!r} is not an axis of the mesh "
                     f"{mesh.axis_names}")
  config = ReduceConfig(axes, algorithm, compression, error_feedback,
                        _validate_bucket_bytes(bucket_bytes), overlap, as_policy(precision))

  def decorate(fn: Callable) -> TrainStep:
    return TrainStep(fn, mesh, config, donate)

  return decorate
