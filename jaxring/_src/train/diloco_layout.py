""":func:`jaxring.diloco` through ``@jaxring.train_step``: how the step keeps a DiLoCo state.

``@jr.train_step(axis_name=("node", "local"), grad_axes="local")`` averages each step's
gradients over the fast axes only; the state's optimizer, ``jr.diloco(inner, axis="node", ...)``,
syncs the slow one every H steps (and, told by the step, averages the pseudo-gradients over the
fast axes too: its ``fast_axes``, so a member sends ``1/local`` of them over the slow links).

Between two syncs the members of the slow axis hold different parameters, so the step keeps two
kinds of values. What every replica holds alike stays replicated: the outer parameters, which
are the state's ``params`` (the model as of its last sync: what an evaluation or a checkpoint
reader takes), the outer optimizer's state and the count. What differs is kept per replica,
``(replicas, *shape)`` sharded over the step's axes as the error-feedback residuals are: each
replica's own parameters (``opt_state.local``), the inner optimizer's state, the
pseudo-gradients' residual and the pending fragments. Inside the step the user's function sees
the form ``jr.diloco`` has in a ``shard_map`` (``params`` its own, ``opt_state.outer_params`` the
outer ones), so ``state.apply_gradients`` and ``tx.update`` run unchanged.

Both layouts have one tree (an NNX optimizer holds its state in Variables, one per leaf): kept,
``opt_state.outer_params`` holds a scalar per leaf in place of the outer parameters (they are
``params``), and inside the step ``opt_state.local`` is this replica's row.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxring._src.optim.diloco import DiLoCoState
from jaxring._src.optim.diloco_parts import plan_of, spanning, without_host_transfers
from jaxring._src.train.grad import replica_mean

# the fields of a DiLoCoState each replica keeps its own of, in a train step's state
ROWS = ("inner", "residual", "pending", "local", "local_stats")


def _split(state):
  """With ``shard="optimizer"``, the function that cuts the outer state made outside the step to
  a replica's share (None otherwise, or where the step does not know the transformation)."""
  plan = plan_of(getattr(state, "tx", None))
  return None if plan is None else plan["split"]


def rows(state) -> tuple:
  """The fields each replica keeps its own of: with ``shard="optimizer"`` the outer optimizer's
  state too (each member of the fast axes its share)."""
  return ROWS + (("outer",) if _split(state) is not None else ())


class HostSchedule:
  """Which program a train step runs with a ``transfer="host"`` diloco: on the steps that start
  and finish no host transfer, the step's program traced without the transfers' callbacks
  (``diloco_parts.without_host_transfers``: jax's C++ dispatch, not Python's). The count is
  read from the device once, then followed while each step is handed the count it returned."""

  def __init__(self, spmd, donate_argnums: tuple):
    self._spmd, self._donate, self._quiet = spmd, donate_argnums, None
    self._last = self._next = None   # (the count array a step returned, its value); the next
    self._whole_ran = False
    self.quiet_steps = self.count_reads = 0   # for inspection

  def program(self, state, jitted):
    """``jitted`` (the whole step's program), or the quiet one where this step moves nothing."""
    plan = plan_of(getattr(state, "tx", None)) if is_diloco(state) else None
    self._next = None
    if plan is None or plan.get("host_steps") is None:
      return jitted
    count = state.opt_state.count
    if self._last is not None and self._last[0] is count:
      n = self._last[1]
    else:
      n, self.count_reads = int(np.asarray(count.addressable_data(0))), self.count_reads + 1
    self._next = n + 1
    # the first step runs the whole program (at a step that moves nothing the quiet one's
    # equal), so that both are compiled by the second step, not at the first transfer's
    if plan["host_steps"](n) or not self._whole_ran:
      self._whole_ran = True
      return jitted
    self.quiet_steps += 1
    if self._quiet is None:
      def quiet(*args):
        with without_host_transfers():
          return self._spmd(*args)
      self._quiet = jax.jit(quiet, donate_argnums=self._donate)
    return self._quiet

  def ran(self, new_state) -> None:
    self._last = None if self._next is None else (new_state.opt_state.count, self._next)


def is_diloco(state) -> bool:
  return isinstance(getattr(state, "opt_state", None), DiLoCoState)


def is_stored(state) -> bool:
  """Whether ``state`` is already laid out as the step keeps it."""
  return is_diloco(state) and state.opt_state.local is not None


def check(state, cfg) -> None:
  """A DiLoCo state needs a step that leaves the slow axis to it, and only it does."""
  slow = cfg.slow_axes
  if not is_diloco(state) and _holds_diloco(getattr(state, "opt_state", None)):
    raise ValueError(
        "train_step: the state's optimizer holds jaxring.diloco inside another transformation "
        "(optax.chain, a wrapper); the step keeps DiLoCo's per-replica state only when "
        "jaxring.diloco is the optimizer itself: put the others inside it, "
        "jaxring.diloco(optax.chain(optax.clip_by_global_norm(1.0), inner), axis=..., every=H)")
  if is_diloco(state) and not slow:
    raise ValueError(
        "train_step: the state's optimizer is jaxring.diloco, which syncs the slow axis every H "
        f"steps itself; the step averages gradients over all of {cfg.axes}. Leave the slow axis "
        "to it: @jaxring.train_step(axis_name=('node', 'local'), grad_axes='local')")
  if slow and not is_diloco(state):
    raise ValueError(
        f"train_step: grad_axes={cfg.reduce_axes} leaves {slow} unreduced, which only "
        "jaxring.diloco as the state's optimizer syncs (the replicas would drift apart): "
        "tx=jaxring.diloco(inner, axis=..., every=H), or drop grad_axes")
  if is_diloco(state) and cfg.shard != "none":
    raise ValueError("train_step: jaxring.diloco with shard=" + repr(cfg.shard) + " is not "
                     "supported; use shard='none' (each replica keeps its own parameters)")


def _holds_diloco(tree) -> bool:
  kind = lambda x: isinstance(x, DiLoCoState)  # noqa: E731
  return any(map(kind, jax.tree_util.tree_leaves(tree, is_leaf=kind)))


def specs(state, state_specs, axis_name):
  """``state_specs`` with the per-replica fields of a stored DiLoCo state split over the axes."""
  if not is_stored(state):
    return state_specs
  kept = {f: jax.tree_util.tree_map(lambda _: P(axis_name), getattr(state.opt_state, f))
          for f in rows(state)}
  return state_specs.replace(opt_state=state_specs.opt_state._replace(**kept))


def stored(state, replicas: int, mesh, cfg):
  """The user's state (``params`` the members' common parameters, ``opt_state`` as
  ``jr.diloco``'s ``init`` made it) laid out as the step keeps it, on ``mesh``; with
  ``shard="optimizer"`` each replica's row of the outer state, residual and pending moves its
  share (cut in a ``shard_map`` over the step's axes, the fast ones as the step's update sees
  them)."""
  if is_stored(state):
    return state
  opt, axis_name = state.opt_state, cfg.axis_name
  copies = lambda t: jax.tree_util.tree_map(   # noqa: E731
      lambda x: jnp.broadcast_to(jnp.asarray(x)[None], (replicas,) + np.shape(x)), t)
  cut = _split(state)
  fields = {"local": state.params, "inner": opt.inner}
  if cut is None:   # else cut below
    fields.update(residual=opt.residual, pending=opt.pending)
  if getattr(state, "batch_stats", None) is not None:
    fields["local_stats"] = state.batch_stats
  split = NamedSharding(mesh, P(axis_name))
  made = jax.jit(lambda f: {k: copies(v) for k, v in f.items()},
                 out_shardings={k: jax.tree_util.tree_map(lambda _: split, v)
                                for k, v in fields.items()})(fields)
  if cut is not None:
    def shares(tree):   # this replica's share of each fragment, as a row
      with spanning(cfg.reduce_axes, cfg.slow_axes):
        return jax.tree_util.tree_map(lambda x: x[None], cut(tree))

    made.update(jax.jit(jax.shard_map(shares, mesh=mesh, in_specs=P(), out_specs=P(axis_name),
                                      check_vma=False), out_shardings=split)(
        {"residual": opt.residual, "outer": opt.outer, "pending": opt.pending}))
  return state.replace(params=opt.outer_params,
                       opt_state=opt._replace(outer_params=_placeholders(state.params), **made))


def _placeholders(params):
  return jax.tree_util.tree_map(lambda x: jnp.zeros((), jnp.result_type(x)), params)


def user_view(state):
  """Inside the step: this replica's values, as ``jr.diloco`` has them in a ``shard_map``."""
  opt = state.opt_state
  row = {f: jax.tree_util.tree_map(lambda r: r[0], getattr(opt, f)) for f in rows(state)}
  if row["local_stats"] is not None:
    state = state.replace(batch_stats=row["local_stats"])
  return state.replace(params=row["local"],
                       opt_state=opt._replace(outer_params=state.params, **row))


def from_user(new):
  """The user's function's state laid out as the step keeps it (``user_view``'s inverse)."""
  opt = new.opt_state
  if not isinstance(opt, DiLoCoState):
    raise TypeError("train_step: the state came in with a jaxring.diloco optimizer state and the "
                    f"step returned a {type(opt).__name__}; update it with tx.update or "
                    "state.apply_gradients")
  row = {f: jax.tree_util.tree_map(lambda x: x[None], getattr(opt, f))
         for f in rows(new) if f not in ("local", "local_stats")}
  local = jax.tree_util.tree_map(lambda x: x[None], new.params)
  return new.replace(params=opt.outer_params, opt_state=opt._replace(
      outer_params=_placeholders(opt.outer_params), local=local, **row))


def settle_stats(old, new, cfg):
  """BatchNorm statistics under DiLoCo: each replica's averaged over the fast axes every step
  and over the slow ones too only where the parameters sync (a warm-up step, the first
  fragment's sync), so the slow links carry nothing between syncs. The state's ``batch_stats``
  are those of the last sync (with its ``params``, the model an evaluation takes); each
  replica's own are kept in ``opt_state.local_stats``. ``old`` is the state as kept."""
  stats = getattr(new, "batch_stats", None)
  if stats is None:
    return new
  plan = plan_of(getattr(old, "tx", None))
  syncs = True if plan is None else plan["syncs"](old.opt_state.count)
  stats = replica_mean(stats, cfg.reduce_axes)
  stats = lax.cond(syncs, lambda s: replica_mean(s, cfg.slow_axes), lambda s: s, stats)
  kept = jax.tree_util.tree_map(lambda s, o: jnp.where(syncs, s, o).astype(jnp.result_type(o)),
                                stats, old.batch_stats)
  rows = jax.tree_util.tree_map(lambda s, o: s.astype(jnp.result_type(o))[None], stats,
                                old.batch_stats)
  return new.replace(batch_stats=kept, opt_state=new.opt_state._replace(local_stats=rows))
