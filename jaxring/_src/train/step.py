"""``@jaxring.train_step``: a per-replica train step turned into a jitted data-parallel SPMD step.

The decorated ``step(state, batch) -> (state, metrics)`` is written as for one device. The
decorator runs it under ``jax.shard_map`` over every device of every process: the batch is split
along its leading axis, the state is replicated (its per-replica error-feedback residuals travel
beside it, sharded: jaxring._src.train.state), gradients from :func:`jaxring.value_and_grad` are
averaged inside the backward pass (jaxring._src.train.grad), BatchNorm statistics and metrics are
averaged after the step, and with fp16 a step whose gradients overflowed on any replica is skipped
on all of them.

``shard_map`` runs with ``check_vma=False`` (pmap's semantics): a gradient with respect to the
replicated parameters is then this replica's own, as in the single-device step, and only jaxring
reduces it. (With vma checking, the transpose of the implicit broadcast of the parameters would
insert a native ``psum`` of every gradient behind jaxring's back.)
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxring._src.codecs.base import accum_dtype
from jaxring._src.optim.compose import has_per_parameter_state
from jaxring._src.optim.sparse import is_sparsifying
from jaxring._src.optim.diloco_parts import spanning
from jaxring._src.train import (
  diloco_layout,
  functional,
  global_view,
  guards,
  nnx_split,
  nnx_step,
  sharding,
)
from jaxring._src.train.context import (
  ReduceConfig,
  ShardedParams,
  StepContext,
  step_context,
)
from jaxring._src.train.fsdp import gather_params
from jaxring._src.train.grad import momentum_leaf_size, replica_mean
from jaxring._src.train.nnx_graph import is_graph_node
from jaxring._src.train.precision import DynamicLossScale, select_tree
from jaxring._src.train.state import Residuals, residual_tree, with_residual_tree

# Steps Python may dispatch ahead of the devices on XLA:CPU (TrainStep._pace).
MAX_STEPS_IN_FLIGHT = 8


class TrainStep:
  """A data-parallel train step; made by :func:`train_step`. Call it as the step was written:
  ``step(state, batch)`` with a TrainState, ``step(model, optimizer, batch)`` with Flax NNX
  objects (updated in place; returns the metrics), ``step(params, opt_state, batch)`` with an
  optax state. Arguments after the batch (a PRNG key, ...) reach every replica whole.

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
    self._jitted = jax.jit(self._spmd, donate_argnums=(0, 1) if donate else ())
    self._host = diloco_layout.HostSchedule(self._spmd, (0, 1) if donate else ())
    self._donate, self._calls, self._nnx, self._functional = donate, 0, None, None
    self._checked = False  # the step's signature takes the first call's arguments
    self._split = None     # NNX's split form, step(graphdef, state, batch)
    self._view = None  # a sharded step's optimizer as the replicas run it (train/global_view.py)

  @property
  def mesh(self) -> Mesh:
    if self._mesh is None:
      self._mesh = sharding.default_mesh(self.config.axis_name)
    return self._mesh

  @property
  def num_replicas(self) -> int:
    return int(np.prod([self.mesh.shape[a] for a in self.config.axes]))

  @property
  def _residual_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, P(self.config.axis_name))

  def prepare(self, state, *objects):
    """Puts ``state`` on the mesh: residuals and loss scale created if needed, the rest replicated.
    NNX: ``step.prepare(model, optimizer)`` gives the optimizer its residuals, in place.

    Example:
      >>> state = step.prepare(state)  # optional: the first call does it
    """
    if is_graph_node(state):
      return self._nnx_runner().prepare((state, *objects))
    cfg = self.config
    self._check_optimizer(state)
    residuals = residual_tree(state)
    fresh = isinstance(getattr(state, "residuals", None), Residuals) and state.residuals.fresh
    if cfg.uses_residuals and residuals is None:
      if not hasattr(state, "residuals"):
        raise TypeError(
            "train_step: error feedback keeps each replica's residuals in the state, which has no "
            "`residuals` field: use jaxring.TrainState, or add to your TrainState class `residuals:"
            " Any = flax.struct.field(pytree_node=False, default=None, kw_only=True)` (or pass "
            "error_feedback=False)")
      residuals, fresh = self._zero_residuals(state.params), True
    if isinstance(getattr(state, "loss_scale", None), dict):   # flax.serialization.from_bytes
      state = state.replace(loss_scale=DynamicLossScale.from_state_dict(state.loss_scale))
    if cfg.policy is not None and cfg.policy.loss_scaling and getattr(state, "loss_scale",
                                                                      None) is None:
      if not hasattr(state, "loss_scale"):
        raise TypeError("train_step: fp16 loss scaling keeps the scale in the state; use "
                        "jaxring.TrainState")
      state = state.replace(loss_scale=DynamicLossScale.create())
    guards.check_residual_replicas(residuals, self.num_replicas)
    state = _without_residuals(state)
    diloco_layout.check(state, cfg)
    if diloco_layout.is_diloco(state):
      state = diloco_layout.stored(state, self.num_replicas, self.mesh, cfg)
    specs = self._specs(state)
    state = jax.tree_util.tree_map(
        lambda x, s: sharding.place(x, NamedSharding(self.mesh, s)), state, specs)
    if residuals is not None:
      residuals = jax.tree_util.tree_map(lambda x: sharding.place(x, self._residual_sharding),
                                         residuals)
    return with_residual_tree(state, residuals, fresh=fresh)

  def state_shardings(self, state):
    """The ``NamedSharding`` of each leaf of ``state`` as this step keeps it (the parameters and
    optimizer state split for ``shard=``, the rest replicated). ``state`` may be abstract
    (``jax.eval_shape``'s result), so a sharded state can be created in place, never whole on
    one device:

    Example:
      >>> abstract = jax.eval_shape(create_state)      # create_state() -> TrainState
      >>> state = jax.jit(create_state, out_shardings=step.state_shardings(abstract))()
    """
    return sharding.shardings(self._specs(_without_residuals(state)), self.mesh)

  def _specs(self, state):
    """Each leaf's PartitionSpec (the split of ``shard=``, a DiLoCo state's per-replica rows)."""
    cfg = self.config
    specs = sharding.state_specs(state, cfg.shard, self.num_replicas, cfg.split_axis_name)
    return diloco_layout.specs(state, specs, cfg.axis_name)

  def _check_optimizer(self, state) -> None:
    """Refuses an optimizer with per-parameter state (momentum, Adam) behind a sparsifying codec
    with error feedback, or behind the step's own momentum correction."""
    cfg = self.config
    opt_state, params = getattr(state, "opt_state", None), getattr(state, "params", None)
    if opt_state is None or params is None:
      return
    stateful = has_per_parameter_state(opt_state, params)
    if stateful and cfg.corrects_momentum:
      raise ValueError("train_step: momentum= runs the momentum inside the gradient reduction; "
                       "the state's optimizer must be momentum-free, e.g. "
                       "TrainState.create(..., tx=optax.sgd(lr))")
    if stateful and cfg.uses_residuals and is_sparsifying(cfg.compression):
      raise ValueError(
          "train_step: topk_chunks with error feedback trains to chance when the optimizer keeps "
          "momentum or Adam moments (the held-back gradient is released in bursts that momentum "
          "multiplies). Supported: @jr.train_step(compression=c, momentum=0.9, nesterov=True) "
          "with tx=optax.sgd(lr); for Adam use a dense codec (int8, bf16) or "
          "jr.compressed_adam inside your own shard_map")

  def memory(self, state, batch, *args) -> dict:
    """Bytes per device of the state's parts, and the compiled step's own (``memory_analysis``).

    Example:
      >>> step.memory(state, batch)["opt_state"]  # one device's share of the optimizer state
    """
    if is_graph_node(state):   # NNX objects: the functional step's
      call = self._nnx_runner().functional((state, batch, *args))
      return self._nnx.inner.memory(*call)
    state = self.prepare(state)
    compiled = self.lower(state, batch, *args).compile()
    return sharding.memory_report(state, residual_tree(state), compiled)

  def _zero_residuals(self, params):
    r = self.num_replicas

    def shape(p):
      if self.config.corrects_momentum:   # flat: residual, velocity, running norm
        return (r, momentum_leaf_size(int(np.size(p))))
      return (r, *np.shape(p))

    shapes = jax.tree_util.tree_map(
        lambda p: jax.ShapeDtypeStruct(shape(p), accum_dtype(p.dtype)), params,
        is_leaf=lambda x: hasattr(x, "dtype"))
    make = jax.jit(lambda: jax.tree_util.tree_map(lambda sd: jnp.zeros(sd.shape, sd.dtype),
                                                  shapes),
                   out_shardings=jax.tree_util.tree_map(lambda _: self._residual_sharding, params))
    return make()

  def shard_batch(self, batch):
    """Splits a global batch (or, with several processes, this process's part) over the replicas.

    Example:
      >>> batch = step.shard_batch({"x": images, "y": labels})  # leading axis = examples
    """
    split = NamedSharding(self.mesh, P(self.config.axis_name))
    n = self.num_replicas // jax.process_count()   # the replicas this process's part feeds

    def put(path, x):
      if isinstance(x, jax.Array) and x.sharding == split:
        return x
      shape = np.shape(x)
      global_array = isinstance(x, jax.Array) and not x.is_fully_addressable
      if not global_array and (not shape or shape[0] % max(n, 1)):
        raise ValueError(
            f"train_step: the batch is split along its leading axis over {n} replicas, but "
            f"batch{jax.tree_util.keystr(path)} has shape {shape}: "
            + ("a scalar has no leading axis (close over constants, or keep them in the state)"
               if not shape else f"{shape[0]} is not a multiple of {n}"))
      if jax.process_count() > 1 and not (isinstance(x, jax.Array)
                                          and not x.is_fully_addressable):
        return jax.make_array_from_process_local_data(split, np.asarray(x))
      return jax.device_put(x, split)
    return jax.tree_util.tree_map_with_path(put, batch)

  def _needs_prepare(self, state) -> bool:
    cfg = self.config
    residuals = residual_tree(state)
    if cfg.uses_residuals and residuals is None:
      return True
    if diloco_layout.is_diloco(state) and not diloco_layout.is_stored(state):
      return True
    if (cfg.policy is not None and cfg.policy.loss_scaling
        and not isinstance(getattr(state, "loss_scale", None), DynamicLossScale)):
      return True
    # Equivalent, not equal: on one device jit hands back P() for the residuals' P("data").
    if any(not (isinstance(r, jax.Array)
                and r.sharding.is_equivalent_to(self._residual_sharding, r.ndim))
           for r in jax.tree_util.tree_leaves(residuals)):
      return True  # e.g. read back from a checkpoint as NumPy arrays
    leaves = jax.tree_util.tree_leaves(_without_residuals(state))
    return bool(leaves) and not (isinstance(leaves[0], jax.Array)
                                 and isinstance(leaves[0].sharding, NamedSharding)
                                 and leaves[0].sharding.mesh == self.mesh)

  def __call__(self, state, batch, *args):
    if nnx_split.is_split_call((state, batch, *args)):   # step(graphdef, state, batch, ...)
      if self._split is None:
        self._split = nnx_split.SplitRunner(self._fn, lambda f: TrainStep(
            f, self.mesh, self.config, self._donate), self.config.axes)
      out = self._split((state, batch, *args))
      self.buckets = self._split.runner.inner.buckets
      return out
    if self._nnx is not None or is_graph_node(state):   # step(model, optimizer, batch, ...)
      metrics = self._nnx_runner()((state, batch, *args))
      self.buckets = self._nnx.inner.buckets
      return metrics
    if functional.is_functional_call((state, batch, *args)):   # step(params, opt_state, batch)
      if self._functional is None:
        self._functional = functional.Runner(self._fn, lambda f: TrainStep(
            f, self.mesh, self.config, self._donate))
      out = self._functional((state, batch, *args))
      self.buckets = self._functional.inner.buckets
      return out
    if not self._checked:
      guards.check_call(self._fn, (state, batch, *args), "TrainState")
      diloco_layout.check(state, self.config)
      self._checked = True
    if self._needs_prepare(state):
      state = self.prepare(state)
    residuals = residual_tree(state)
    if residuals is not None:
      guards.check_residuals(state)
    run = self._host.program(state, self._jitted)
    new_state, residuals, metrics = run(_without_residuals(state), residuals,
                                        self.shard_batch(batch), args)
    self._host.ran(new_state)
    self._pace((metrics, new_state))
    return with_residual_tree(new_state, residuals), metrics

  def _nnx_runner(self) -> nnx_step.Runner:
    if self._nnx is None:
      self._nnx = nnx_step.Runner(self._fn, lambda f: TrainStep(f, self.mesh, self.config,
                                                                self._donate), self.config.axes)
    return self._nnx

  def _pace(self, outputs) -> None:
    """Bounds the steps in flight on XLA:CPU. With several devices in one process, XLA:CPU
    deadlocks once about 32 executions holding collectives are queued (measured with jax 0.10.2 on
    2 cores: a jitted shard_map of one ppermute, dispatched without a host sync, hangs at a queue
    depth of 32 and runs at 16; the stuck rendezvous aborts the process after 40 s). Waiting for
    every ``MAX_STEPS_IN_FLIGHT``-th step (its outputs, before a later step takes them as donated
    inputs) keeps Python at most that far ahead."""
    if self.mesh.devices.flat[0].platform != "cpu" or self.mesh.devices.size == 1:
      return
    self._calls += 1
    if self._calls % MAX_STEPS_IN_FLIGHT == 0:
      jax.block_until_ready(jax.tree_util.tree_leaves(outputs)[:1])

  def lower(self, state, batch, *args):
    """``jax.jit(...).lower`` of the SPMD step (e.g. to read its compiled HLO); called as the
    step is (``step.lower(model, optimizer, batch)`` with NNX objects)."""
    if is_graph_node(state):
      call = self._nnx_runner().functional((state, batch, *args))
      return self._nnx.inner.lower(*call)
    state = self.prepare(state)
    return self._jitted.lower(_without_residuals(state), residual_tree(state),
                              self.shard_batch(batch), args)

  def _spmd(self, state, residuals, batch, args):
    cfg = self.config
    data = P(cfg.axis_name)
    specs = self._specs(state)
    if cfg.shard != "none":
      self._dims = sharding.param_dims(state.params, self.num_replicas)
      self._view = global_view.for_state(state, specs, self._dims, cfg.split_axes,
                                         self.num_replicas)
    res_specs = jax.tree_util.tree_map(lambda _: data, residuals)
    whole = jax.tree_util.tree_map(lambda _: P(), args)
    body = jax.shard_map(self._per_replica, mesh=self.mesh,
                         in_specs=(specs, res_specs, data, whole),
                         out_specs=(specs, res_specs, P(cfg.slow_axes) if
                                    diloco_layout.is_diloco(state) else P()), check_vma=False)
    return body(state, residuals, batch, args)

  def _per_replica(self, state, residuals, batch, args):
    cfg = self.config
    if residuals is not None:  # this replica's row of every (replicas, *shape) residual
      residuals = jax.tree_util.tree_map(lambda r: r[0], residuals)
    scaling = cfg.policy is not None and cfg.policy.loss_scaling
    ctx = StepContext(cfg, residuals=residuals,
                      loss_scale=state.loss_scale.scale if scaling else None)
    diloco = diloco_layout.is_diloco(state)
    user_state = diloco_layout.user_view(state) if diloco else state
    if cfg.shard != "none":
      ctx.shard, user_state = self._sharded_view(state)
      ctx.note_split(ctx.shard.blocks, ctx.shard.dims)
      if self._view is not None:   # the optimizer's whole-leaf math, on blocks
        user_state = user_state.replace(tx=self._view)
    span = (cfg.reduce_axes, cfg.slow_axes) if diloco else ((), ())   # what diloco syncs
    with step_context(ctx), spanning(*span):
      try:
        new_state, metrics = guards.state_and_metrics(self._fn(user_state, batch, *args),
                                                      type(state))
      except Exception as e:
        if cfg.shard != "none":
          guards.add_blocks_hint(e)
        raise
    if not ctx.calls:
      guards.check_gradients_reduced(self._fn, (user_state, batch, *args), new_state)
    self.buckets = ctx.buckets
    if ctx.shard is not None:
      guards.check_blocks_returned(new_state, ctx.shard.blocks, cfg.shard)
    new_state = _without_residuals(new_state)
    if diloco:
      new_state = diloco_layout.from_user(new_state)
    if self._view is not None and getattr(new_state, "tx", None) is self._view:
      new_state = new_state.replace(tx=state.tx)
    if cfg.shard == "optimizer":  # each replica updated its blocks: gather the whole, exactly
      new_state = new_state.replace(params=gather_params(new_state.params, self._dims,
                                                         cfg.split_axes, cfg.algorithm))
    new_residuals = residuals
    if residuals is not None and ctx.new_residuals is not None:
      new_residuals = ctx.new_residuals
    if diloco:   # the slow links carry the syncs only: each node's own metrics, (nodes,) each
      metrics = replica_mean(metrics, cfg.reduce_axes)
      new_state = diloco_layout.settle_stats(state, new_state, cfg)
    elif getattr(new_state, "batch_stats", None) is not None:   # one pmean with the metrics
      stats, metrics = replica_mean((new_state.batch_stats, metrics), cfg.axis_name)
      new_state = new_state.replace(batch_stats=stats)
    else:
      metrics = replica_mean(metrics, cfg.axis_name)
    if scaling:
      new_state, metrics = self._skip_on_overflow(state, new_state, metrics, ctx.finite)
      if residuals is not None:
        new_residuals = select_tree(_finite(ctx.finite), new_residuals, residuals)
    if residuals is not None:
      new_residuals = jax.tree_util.tree_map(lambda r: r[None], new_residuals)
    if diloco:
      metrics = jax.tree_util.tree_map(lambda m: jnp.asarray(m)[None], metrics)
    return new_state, new_residuals, metrics

  def _sharded_view(self, state):
    """What value_and_grad needs to know of the split parameters, and the state the user's
    function sees: its ``params`` are this replica's blocks (the optimizer updates those)."""
    p, cfg = self.num_replicas, self.config
    leaves, treedef = jax.tree_util.tree_flatten(state.params)
    dims = tuple(sharding.dim_list(state.params, self._dims))
    if cfg.shard == "params":
      shapes = tuple(sharding.full_shape(x.shape, d, p) for x, d in zip(leaves, dims))
      return ShardedParams(treedef, dims, shapes, None, tuple(leaves)), state
    index = lax.axis_index(cfg.split_axis_name)
    blocks = [sharding.local_block(x, d, p, index) for x, d in zip(leaves, dims)]
    view = state.replace(params=jax.tree_util.tree_unflatten(treedef, blocks))
    return ShardedParams(treedef, dims, tuple(x.shape for x in leaves), tuple(leaves),
                         tuple(blocks)), view

  @staticmethod
  def _skip_on_overflow(old, new, metrics, finite):
    """Keeps the old parameters, optimizer state and statistics where gradients overflowed.

    ``finite`` is the result of an all-reduce (jaxring._src.train.grad), so every replica decides alike.
    """
    finite = _finite(finite)
    fields = [f for f in ("params", "opt_state", "batch_stats")
              if getattr(new, f, None) is not None]
    new = new.replace(**{f: select_tree(finite, getattr(new, f), getattr(old, f)) for f in fields},
                      loss_scale=old.loss_scale.adjust(finite))
    if isinstance(metrics, dict):
      metrics = dict(metrics, loss_scale=old.loss_scale.scale,
                     grads_finite=finite.astype(jnp.float32))
    return new, metrics


def _finite(finite):
  return jnp.asarray(True) if finite is None else finite


def _without_residuals(state):
  """``state`` with no residuals: what the jitted step and the user's function see."""
  if getattr(state, "residuals", None) is None:
    return state
  return state.replace(residuals=None)
