"""``TrainState``: Flax's train state plus what data-parallel training with jaxring carries.

Fields added to :class:`flax.training.train_state.TrainState` (keyword-only, so a subclass may
still add fields without defaults, as Flax's examples do):

* ``batch_stats``: BatchNorm's mutable statistics (averaged over the replicas after every step;
  under ``jaxring.diloco``, over a node each step and over all at a sync: train/diloco_layout);
* ``rng``: a PRNG key; :meth:`TrainState.step_rng` derives this step's (and this replica's) key;
* ``residuals``: error-feedback residuals, one set per replica, as :class:`Residuals`;
* ``loss_scale``: a :class:`~jaxring.train.DynamicLossScale` for fp16.

Every pytree leaf of the state is replicated. The residuals are not (each replica's compression
error is its own), so they sit in a ``pytree_node=False`` field, out of sight of code written for
replicated states: ``jax.pmap(eval_step, in_axes=(None, 0))(state, batch)``, ``jax.jit``,
``flax.jax_utils.replicate``, a ``tree_map`` over the leaves. Checkpointers that save the leaves
(orbax, ``flax.training.checkpoints``) do not save them either: :class:`jaxring.train.Checkpointer`
does, and a train_step warns when it is handed a state past step 0 whose residuals were lost.

The decorator fills ``residuals`` and ``loss_scale`` when it first sees a state (``prepare``).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from flax.training import train_state
from jax import lax

from jaxring._src.train.context import current_context
from jaxring._src.train.precision import DynamicLossScale


class Residuals:
  """Each replica's error-feedback residuals: a tree like the parameters whose leaves have shape
  ``(replicas, *param.shape)``, sharded over the data axis.

  Kept as static metadata of the state (see the module docstring), so two ``Residuals`` are equal
  when their trees have the same structure, shapes, dtypes and shardings: a jitted evaluation of
  the state compiles once, not once per step. It is also a pytree itself, so
  ``jax.tree.leaves(state.residuals)`` and ``jax.device_get(state.residuals)`` read the arrays.
  Being metadata, they pass through a ``jax.jit`` function that returns the state as they were
  when it was traced: carry on with the train step's own output state (a step handed residuals
  that an earlier step already donated raises).

  Attributes:
    tree: the residual arrays.
    fresh: zeros made by ``prepare``, not yet carried through a step (a state past step 0 holding
      fresh residuals has lost the ones it trained with).

  Example:
    >>> state, _ = step(state, batch)  # a train_step with a lossy codec
    >>> state.residuals["dense"]["kernel"].shape  # (replicas, *kernel.shape)
  """

  __slots__ = ("tree", "fresh")

  def __init__(self, tree: Any, *, fresh: bool = False):
    self.tree = tree.tree if isinstance(tree, Residuals) else tree
    self.fresh = fresh

  def _signature(self) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(self.tree)
    return treedef, tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x))),
                           getattr(x, "sharding", None)) for x in leaves)

  def __eq__(self, other) -> bool:
    return isinstance(other, Residuals) and self._signature() == other._signature()

  def __hash__(self) -> int:
    return hash(self._signature())

  def __getitem__(self, key):
    return self.tree[key]

  def __repr__(self) -> str:
    shapes = jax.tree_util.tree_map(lambda x: getattr(x, "shape", x), self.tree)
    return f"Residuals({shapes}{', fresh' if self.fresh else ''})"


jax.tree_util.register_pytree_node(
    Residuals, lambda r: ((r.tree,), r.fresh), lambda fresh, c: Residuals(c[0], fresh=fresh))


def residual_tree(state) -> Any:
  """The residual arrays of ``state`` (a tree like its parameters), or None.

  Example:
    >>> tree = residual_tree(state)  # what a checkpoint must save besides the state's leaves
  """
  res = getattr(state, "residuals", None)
  return res.tree if isinstance(res, Residuals) else res


def with_residual_tree(state, tree: Any, *, fresh: bool = False):
  """``state`` holding ``tree`` as its residuals (``state`` itself when ``tree`` is None).

  Example:
    >>> state = with_residual_tree(state, restored_tree)
  """
  if tree is None:
    return state
  return state.replace(residuals=Residuals(tree, fresh=fresh))


def remapped(tree: Any, replicas: int) -> Any:
  """Residuals saved by another replica count (``tree``'s leaves ``(p_old, ...)``) for
  ``replicas``: each new replica carries the mean of the old rows, so the error all replicas
  add back to the next mean, ``sum(r) / p``, is the same. ``tree`` itself where the counts agree.
  """
  rows = {tuple(getattr(r, "shape", (replicas,))[:1]) for r in jax.tree_util.tree_leaves(tree)}
  if tree is None or rows <= {(replicas,)}:
    return tree
  remap = jax.jit(lambda r: jnp.broadcast_to(jnp.mean(r, axis=0, keepdims=True),
                                             (replicas,) + r.shape[1:]))
  return jax.tree_util.tree_map(remap, tree)


def _optional(pytree_node: bool = True):
  # keyword-only, so that a subclass may add fields without defaults; a default_factory rather
  # than a default, which would stay behind as a class attribute that a subclass redeclaring the
  # field without a default (Flax's ImageNet example: `batch_stats: Any`) inherits as its default
  return struct.field(pytree_node=pytree_node, default_factory=lambda: None, kw_only=True)


class TrainState(train_state.TrainState):
  """Flax ``TrainState`` with batch statistics, an RNG key, residuals and a loss scale.

  The added fields are keyword-only with defaults, so a subclass can add its own fields (with or
  without defaults) as with Flax's ``TrainState``. To give your own Flax ``TrainState`` subclass
  error-feedback residuals instead, add this one line to it (a ``train_step`` fills it)::

    residuals: Any = flax.struct.field(pytree_node=False, default=None, kw_only=True)

  Example:
    >>> variables = model.init(jax.random.PRNGKey(0), x, train=False)
    >>> state = jaxring.TrainState.create(apply_fn=model.apply, params=variables["params"],
    ...                                   tx=optax.sgd(0.1), batch_stats=variables["batch_stats"],
    ...                                   rng=jax.random.PRNGKey(1))
    >>> class MyState(jaxring.TrainState):  # Flax's ImageNet example's state, rebased
    ...   batch_stats: Any
    ...   dynamic_scale: Any
  """

  batch_stats: Any = _optional()
  rng: Any = _optional()
  residuals: Residuals | None = _optional(pytree_node=False)
  loss_scale: DynamicLossScale | None = _optional()

  def variables(self, params=None) -> dict:
    """``{"params": ..., "batch_stats": ...}`` for ``apply_fn`` (``params`` defaults to own)."""
    out = {"params": self.params if params is None else params}
    if self.batch_stats is not None:
      out["batch_stats"] = self.batch_stats
    return out

  def step_rng(self, *, per_replica: bool = True):
    """This step's key: ``rng`` folded with ``step`` and, inside a train_step, the replica index.

    Example:
      >>> dropout_key = state.step_rng()  # different on every replica and every step
    """
    if self.rng is None:
      raise ValueError("TrainState.step_rng: the state has no rng; create it with rng=...")
    key = jax.random.fold_in(self.rng, self.step)
    ctx = current_context()
    if per_replica and ctx is not None:
      key = jax.random.fold_in(key, lax.axis_index(ctx.config.axis_name))
    return key
