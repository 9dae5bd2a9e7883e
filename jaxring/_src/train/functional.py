"""``@jaxring.train_step`` on a functional step: ``step(params, opt_state, batch, *args) ->
(params, opt_state, metrics)``, as plain JAX + optax and Equinox write one.

``params`` is any pytree (an ``eqx.Module`` included: its arrays are the parameters, its other
leaves, functions and settings, travel as they are); ``opt_state`` is the optax state of them
(``tx.init(eqx.filter(model, eqx.is_array))``). The step runs as the decorator's TrainState step
does, on a :class:`FunctionalState`. What a TrainState keeps in its own fields — each replica's
error-feedback residuals, fp16's loss scale — travels in the optimizer state: the decorated step
returns :class:`OptState` (``opt_state.inner`` is the optax state) wherever it keeps either, and
takes it back on the next call; a checkpoint of the optimizer state holds them.

The form is recognised by its second argument: an optax state (a state of one of optax's
transformations, or an :class:`OptState`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from flax import struct

from jaxring._src.train import guards
from jaxring._src.train.partition import is_array
from jaxring._src.train.state import remapped, residual_tree, with_residual_tree


@struct.dataclass
class FunctionalState:
  """A functional step's arguments as the TrainState step sees them."""

  params: Any            # the array leaves of the user's parameters (None where a leaf is not)
  opt_state: Any
  static: Any = struct.field(pytree_node=False)   # (treedef, the other leaves)
  step: Any = 0
  residuals: Any = struct.field(pytree_node=False, default=None)
  loss_scale: Any = None


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass
class OptState:
  """An optax state with what a jaxring train step keeps beside it.

  Attributes:
    inner: the optax state (what ``tx.update`` takes).
    residuals: each replica's error-feedback residuals, ``(replicas, *param.shape)`` per array
      of the parameters (None without error feedback).
    loss_scale: fp16's ``DynamicLossScale`` (None without loss scaling).
  """

  inner: Any
  residuals: Any = None
  loss_scale: Any = None

  def tree_flatten(self):
    return (self.inner, self.residuals, self.loss_scale), None

  @classmethod
  def tree_unflatten(cls, _, children):
    return cls(*children)


def _optax_like(x) -> bool:
  if type(x).__module__.split(".")[0] == "optax":
    return True
  return isinstance(x, (tuple, list)) and any(_optax_like(y) for y in x)


def is_functional_call(args: tuple) -> bool:
  """Whether ``step(*args)`` is the functional form: its second argument an optax state."""
  return len(args) >= 3 and (isinstance(args[1], OptState) or _optax_like(args[1]))


def split_params(params) -> tuple[Any, tuple]:
  """``(arrays, static)``: ``params`` with None where a leaf is not an array, and what it held
  there (hashable: part of the compiled step's key)."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  others = tuple(None if is_array(x) else x for x in leaves)
  arrays = jax.tree_util.tree_unflatten(treedef, [x if is_array(x) else None for x in leaves])
  return arrays, (treedef, others)


def join_params(arrays, static: tuple):
  treedef, others = static
  leaves = jax.tree_util.tree_leaves(arrays, is_leaf=lambda x: x is None)
  return jax.tree_util.tree_unflatten(treedef, [o if a is None else a
                                                for a, o in zip(leaves, others)])


def adapter(fn: Callable) -> Callable:
  """The user's ``fn(params, opt_state, batch, *args) -> (params, opt_state, metrics)`` as
  ``f(state: FunctionalState, batch, *args) -> (state, metrics)``."""

  def step(state: FunctionalState, batch, *args):
    out = fn(join_params(state.params, state.static), state.opt_state, batch, *args)
    if not isinstance(out, (tuple, list)) or len(out) != 3:
      raise TypeError("train_step: a step taking (params, opt_state, batch) must return "
                      f"(params, opt_state, metrics); it returned {type(out).__name__}"
                      + (f" of {len(out)}" if isinstance(out, (tuple, list)) else ""))
    arrays, static = split_params(out[0])
    if static != state.static:
      raise ValueError("train_step: the step changed the parameters' structure or their "
                       "non-array leaves; a step returns new arrays in the same tree")
    return state.replace(params=arrays, opt_state=out[1]), out[2]

  return step


class Runner:
  """What a TrainStep does with a functional call: ``make_step(adapter(fn))`` on the state."""

  def __init__(self, fn: Callable, make_step: Callable):
    self.fn, self.inner, self.checked = fn, make_step(adapter(fn)), False

  def __call__(self, args: tuple):
    if not self.checked:
      guards.check_call(self.fn, args, "functional (params, opt_state, batch)")
      self.checked = True
    params, opt_state, batch, *rest = args
    held = opt_state if isinstance(opt_state, OptState) else OptState(opt_state)
    arrays, static = split_params(params)
    state = FunctionalState(arrays, held.inner, static, loss_scale=held.loss_scale)
    if held.residuals is not None:   # saved by another replica count: remapped
      state = with_residual_tree(state, remapped(held.residuals, self.inner.num_replicas))
    new, metrics = self.inner(state, batch, *rest)
    residuals = residual_tree(new)
    opt = new.opt_state
    if residuals is not None or new.loss_scale is not None:
      opt = OptState(opt, residuals, new.loss_scale)
    return join_params(new.params, static), opt, metrics
