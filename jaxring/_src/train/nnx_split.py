"""``@jaxring.train_step`` on NNX's split form, ``step(graphdef, state, batch, *args) ->
(state, metrics)``: the functional step of Flax's performance guide (``nnx.merge`` at its top,
``nnx.split`` at its end), run as the in-place form (jaxring._src.train.nnx_step) on the merged
objects."""
from __future__ import annotations

from typing import Callable

import jax

from jaxring._src.train.nnx_graph import nnx_module
from jaxring._src.train.nnx_step import Binding, Runner


def is_split_call(args: tuple) -> bool:
  """Whether ``step(*args)`` is NNX's functional form, ``step(graphdef, state, batch, ...)``."""
  nnx = nnx_module()
  return nnx is not None and len(args) >= 3 and isinstance(args[0], nnx.GraphDef)


class SplitRunner:
  """``step(graphdef, state, batch, *args) -> (state, metrics)`` (or ``-> state``), the split
  form of Flax's performance guide, as the in-place form on the merged objects. The objects
  merged for the last call are kept with the state returned: handed that state back, the next
  call merges nothing."""

  def __init__(self, fn: Callable, make_step: Callable, axes: tuple):
    self.fn = fn
    self.runner = Runner(self.in_place, make_step, axes)
    self.last = None   # (the state returned last, the objects it came from)

  def in_place(self, *args):
    """The user's split-form step as an in-place one (traced inside each replica)."""
    nnx = nnx_module()
    objs, rest = args[:self.count], args[self.count:]
    graphdef, state = nnx.split(objs if self.count > 1 else objs[0])
    out = self.fn(graphdef, state, *rest)
    new_state, metrics = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    nnx.update(objs if self.count > 1 else objs[0], new_state)
    return metrics

  def __call__(self, args: tuple):
    nnx = nnx_module()
    graphdef, state, *rest = args
    if self.last is not None and self.last[0] is state:
      objs = self.last[1]
    else:
      merged = nnx.merge(graphdef, state)
      objs = merged if isinstance(merged, tuple) else (merged,)
    self.count = len(objs)
    metrics = self.runner((*objs, *rest))
    b = self.runner.binding or Binding.of(objs)   # walked again after the optimizer grew
    new_state = jax.tree_util.tree_unflatten(b.treedef, [v.get_value() for v in b.variables])
    self.last = (new_state, objs)
    return new_state, metrics
