"""What ``@jaxring.train_step`` hands ``jaxring.value_and_grad`` while it traces a step.

:class:`ReduceConfig` holds the decorator's arguments, :class:`StepContext` one trace's inputs and
outputs, :class:`ShardedParams` how a sharded step's parameters are split. The context is kept
on a thread-local stack, so that ``value_and_grad`` outside a step is ``jax.value_and_grad``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any

from jax import lax

from jaxring._src.collectives import is_lossy
from jaxring._src.train.buckets import Bucket
from jaxring._src.train.precision import Policy


@dataclasses.dataclass(frozen=True)
class ReduceConfig:
  """How a train_step reduces gradients (the decorator's arguments)."""

  axes: tuple
  algorithm: Any = "auto"
  compression: Any = None
  error_feedback: bool = True
  bucket_bytes: int | str = 25 << 20   # or "auto" (buckets.auto_bucket_bytes)
  overlap: bool = True
  policy: Policy | None = None
  momentum: float | None = None   # momentum correction in the reduction (jaxring._src.optim)
  nesterov: bool = False
  clip_norm: str | None = "auto"  # momentum correction's clipping, per bucket ("auto" or None)
  shard: str = "none"             # "none" | "optimizer" | "params" (jaxring._src.train.sharding)
  param_compression: Any = None   # the parameters' all-gather codec (shard="params")
  hpz: bool = False               # shard="params": the backward pass gathers within the node
  grad_axes: tuple = ()           # the axes gradients are averaged over; () = all of ``axes``

  @property
  def reduce_axes(self) -> tuple:
    """The axes each step's gradients are averaged over: ``axes``, or with ``jaxring.diloco``
    the fast ones (``grad_axes``; the slow axis syncs every H steps, in the optimizer)."""
    return self.grad_axes or self.axes

  @property
  def slow_axes(self) -> tuple:
    """The step's axes gradients are not averaged over (synced by ``jaxring.diloco``)."""
    return tuple(a for a in self.axes if a not in self.reduce_axes)

  @property
  def axis_name(self):
    return self.axes if len(self.axes) > 1 else self.axes[0]

  @property
  def split_axes(self) -> tuple:
    """The order of the replicas' blocks of a split leaf: ``axes``, or with ``hpz`` the node's
    axis first, so that a node's devices hold contiguous pieces of each leaf once they have
    gathered over the outer axes (jaxring._src.train.fsdp)."""
    return (self.axes[-1],) + self.axes[:-1] if self.hpz else self.axes

  @property
  def split_axis_name(self):
    return self.split_axes if len(self.split_axes) > 1 else self.split_axes[0]

  @property
  def uses_residuals(self) -> bool:
    """Error feedback is kept only where something is lost on the wire (or a velocity is kept)."""
    return self.error_feedback and (is_lossy(self.compression) or self.corrects_momentum)

  @property
  def corrects_momentum(self) -> bool:
    """Whether each replica keeps a velocity beside its residual (then each residual leaf is
    flat, ``(2 * size + 1,)``: the residual, the velocity, the tensor's running gradient norm;
    jaxring._src.train.grad.momentum_parts)."""
    return self.error_feedback and bool(self.momentum)


@dataclasses.dataclass(eq=False)
class StepContext:
  """What the decorator hands to ``value_and_grad`` during one trace of the step, and gets back."""

  config: ReduceConfig
  residuals: Any = None     # this replica's residuals, shaped like the parameters, or None
  loss_scale: Any = None    # f32 scalar when the policy scales the loss
  new_residuals: Any = None
  finite: Any = None        # agreed on by every replica
  buckets: list[Bucket] | None = None
  calls: int = 0
  shard: ShardedParams | None = None  # with shard="optimizer"/"params": how the params are split
  # id -> (leaf, split dimension) of the arrays known to be blocks: the parameters the step sees
  # and the gradients value_and_grad returns (jaxring.train.whole reads subtrees of them)
  split_leaves: dict = dataclasses.field(default_factory=dict)

  def note_split(self, leaves, dims) -> None:
    """Records ``leaves`` (a sharded step's blocks) as split along ``dims``."""
    for x, d in zip(leaves, dims):
      self.split_leaves[id(x)] = (x, d)

  def dim_of(self, leaf):
    """The split dimension of a recorded block, None for any other array (whole)."""
    x, d = self.split_leaves.get(id(leaf), (None, None))
    return d if x is leaf else None


@dataclasses.dataclass(frozen=True)
class ShardedParams:
  """What value_and_grad needs of a sharded step's parameters (flattened like state.params)."""

  treedef: Any
  dims: tuple            # each leaf's split dimension, or None (whole)
  shapes: tuple          # each leaf's full shape
  full: tuple | None     # shard="optimizer": the replicated leaves (nothing to gather)
  blocks: tuple | None = None  # the blocks the step's state holds

  def held_full(self, i: int, leaf):
    """The replicated leaf ``i`` when ``leaf`` is the state's own block of it (the forward pass
    needs no gather), else None: the step passed other values (a perturbation, a mask), whose
    full leaf must be gathered from every replica's block."""
    if self.full is None or self.blocks is None or leaf is not self.blocks[i]:
      return None
    return self.full[i]

  def part(self, leaves, treedef) -> ShardedParams | None:
    """What is known of the differentiated leaves: all of the parameters (``treedef`` theirs),
    or a subtree of the state's own blocks (LoRA-style, ``optax.lookahead``'s ``params.fast``),
    recognised by identity; None when neither."""
    if treedef == self.treedef:
      return self
    if self.blocks is None:
      return None
    where = {id(b): i for i, b in enumerate(self.blocks)}
    idx = [where.get(id(x)) for x in leaves]
    if any(i is None or self.blocks[i] is not x for i, x in zip(idx, leaves)):
      return None
    pick = lambda xs: None if xs is None else tuple(xs[i] for i in idx)  # noqa: E731
    return ShardedParams(treedef, pick(self.dims), pick(self.shapes), pick(self.full),
                         pick(self.blocks))

  @property
  def remat(self) -> bool:
    """Gather again in the backward pass rather than keep the full leaves (shard="params")."""
    return self.full is None


_local = threading.local()


@contextlib.contextmanager
def step_context(ctx: StepContext):
  stack = _local.__dict__.setdefault("stack", [])
  stack.append(ctx)
  try:
    yield ctx
  finally:
    stack.pop()


def current_context() -> StepContext | None:
  stack = getattr(_local, "stack", None)
  return stack[-1] if stack else None


def replica_count(axes: tuple) -> int:
  n = 1
  for a in axes:
    n *= int(lax.axis_size(a))
  return n
