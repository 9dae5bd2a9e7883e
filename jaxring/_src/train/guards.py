"""What ``@jaxring.train_step`` refuses before it runs a step that would be silently wrong.

- gradients from ``jax.grad`` / ``jax.value_and_grad`` that are never averaged: the step runs
  with pmap's semantics (a gradient is this replica's own), so the replicas would drift apart
  while the state still claims to be replicated;
- a state whose error-feedback residuals were consumed by an earlier step, or lost;
- a ``bucket_bytes`` that is not a byte count.
"""
from __future__ import annotations

import math
import numbers
import warnings

import jax
import numpy as np

from jaxring._src.train.state import Residuals

# the primitives of jax.lax's collectives (under check_vma=True and False), mpi4jax's, and
# jaxring's in-process custom calls
COLLECTIVES = frozenset({"psum", "psum_invariant", "pmax", "pmin", "all_gather",
                         "all_gather_invariant", "reduce_scatter", "ppermute", "all_to_all",
                         "ragged_all_to_all"})

UNREDUCED = (
    "train_step: the step updates the parameters, but its gradients are never averaged over the "
    "replicas: it calls neither jaxring.value_and_grad (or jaxring.grad) nor any collective. "
    "Gradients from jax.grad / jax.value_and_grad are each replica's own inside the step, so the "
    "replicas would silently drift apart. Use `loss, grads = jaxring.value_and_grad(loss_fn)"
    "(state.params, batch)`; in an NNX step, jaxring.value_and_grad in place of "
    "nnx.value_and_grad: `loss, grads = jaxring.value_and_grad(loss_fn)(model, batch)`.")

BLOCKS_HINT = (
    "train_step(shard='optimizer'|'params'): inside the step, state.params are this replica's "
    "blocks of each "
    "parameter. jaxring.value_and_grad gathers them for the loss; jax.grad and direct use do not "
    "(jaxring.train.full_params(state.params) gathers them for anything else).")


def _has_collective(jaxpr) -> bool:
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in COLLECTIVES or "mpi" in name:
      return True
    if name == "ffi_call" and str(eqn.params.get("target_name", "")).startswith("jaxring_local"):
      return True   # the in-process level's custom calls (jaxring._src.transport.inprocess)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns") and _has_collective(inner):
          return True
  return False


def state_and_metrics(out, state_type) -> tuple:
  """The step function's ``(state, metrics)``; a TypeError naming what it returned instead."""
  if (not isinstance(out, (tuple, list)) or len(out) != 2
      or not isinstance(out[0], state_type)):
    got = (f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list))
           else f"a {type(out).__name__}")
    raise TypeError(f"train_step: the step function must return (state, metrics), a new "
                    f"{state_type.__name__} and a pytree of metrics; it returned {got}")
  return out[0], out[1]


def check_gradients_reduced(fn, args: tuple, new_state) -> None:
  """Raises ValueError where ``fn(*args)`` (``args``: the state, the batch and the step's other
  arguments; traced without a ``jaxring.value_and_grad`` call) changed the parameters and
  reduced nothing over any axis.

  The parameters count as changed when a leaf of ``new_state.params`` is not the very traced
  value the step received; ``fn`` is then traced once more, to look for a collective (a step
  that reduces its gradients itself with ``lax.pmean`` is the user's business).
  """
  before = jax.tree_util.tree_leaves(getattr(args[0], "params", None))
  after = jax.tree_util.tree_leaves(getattr(new_state, "params", None))
  if len(before) == len(after) and all(a is b for a, b in zip(after, before)):
    return
  if not _has_collective(jax.make_jaxpr(fn)(*args).jaxpr):
    raise ValueError(UNREDUCED)


def add_blocks_hint(error: BaseException) -> None:
  """Says, on an error raised while tracing a sharded step, that ``state.params`` are
  blocks (e.g. a shape error in a matmul given a block for the whole weight)."""
  if hasattr(error, "add_note"):
    error.add_note(BLOCKS_HINT)


def check_blocks_returned(new_state, blocks, shard: str) -> None:
  """Raises ValueError where a sharded step returns parameters that are not blocks shaped like
  the ones it was given (a whole leaf from ``full_params`` put back into the state)."""
  params = getattr(new_state, "params", None)
  if params is None:
    return
  paths = jax.tree_util.tree_flatten_with_path(params)[0]
  if len(paths) != len(blocks):
    return  # another structure: the state's own checks name it
  for (path, x), b in zip(paths, blocks):
    if np.shape(x) != np.shape(b):
      raise ValueError(
          f"train_step(shard={shard!r}): the step returned parameter "
          f"{jax.tree_util.keystr(path)} of shape {np.shape(x)}, but this replica's block of it "
          f"is {np.shape(b)}: return the blocks (what state.apply_gradients updates), not whole "
          "leaves (jaxring.train.full_params gathers them for computing, not for the state)")


def check_residual_replicas(residuals, replicas: int) -> None:
  """Raises ValueError where residuals hold another replica count's rows (restored outside
  ``jaxring.train.Checkpointer``'s remapping, which needs the step's prepared state)."""
  for leaf in jax.tree_util.tree_leaves(residuals):
    rows = getattr(leaf, "shape", (replicas,))[:1]
    if rows != (replicas,):
      raise ValueError(
          f"train_step: the state's error-feedback residuals are for {rows[0] if rows else 0} "
          f"replicas, this step has {replicas}. To resume on another device count, restore into "
          "the step's prepared state: `ckpt.restore(step.prepare(fresh_state))` (the residuals "
          "are then remapped)")


def check_residuals(state) -> None:
  """Fails loudly, before the step runs, where the residuals are not this state's own."""
  res = state.residuals
  if any(isinstance(r, jax.Array) and r.is_deleted() for r in jax.tree_util.tree_leaves(res)):
    raise RuntimeError(
        "train_step: state.residuals were already consumed (donated) by an earlier step: this "
        "state is stale. Carry on with the state the last step returned. (The residuals are "
        "static metadata of the state, not leaves, so a jax.jit function that returns the state "
        "returns the residuals it was traced with; give its result the current ones with "
        "`out.replace(residuals=state.residuals)`.)")
  if isinstance(res, Residuals) and res.fresh and (step := int(jax.device_get(state.step))) > 0:
    warnings.warn(
        f"train_step: the state is at step {step} but its error-feedback residuals are zeros: "
        "the residuals it trained with were lost. They are per replica and kept out of the "
        "state's pytree leaves (so that code written for replicated states, such as "
        "jax.pmap(eval_step, in_axes=(None, 0)), works), so orbax or flax.training.checkpoints "
        "saving the state's leaves does not save them: jaxring.train.Checkpointer does (or save "
        "jaxring._src.train.state.residual_tree(state) beside the state and restore it with "
        "jaxring._src.train.state.with_residual_tree).", stacklevel=4)
    state.residuals.fresh = False  # warned once


def validate_momentum(momentum, clip_norm, error_feedback: bool) -> None:
  """train_step's momentum correction arguments (ValueError naming the one that is wrong)."""
  if momentum is not None and not 0.0 <= float(momentum) < 1.0:
    raise ValueError(f"train_step: momentum must be None or in [0, 1), got {momentum!r}")
  if clip_norm not in ("auto", None):
    raise ValueError(f"train_step: clip_norm must be 'auto' or None (momentum correction's "
                     f"per-bucket clipping), got {clip_norm!r}")
  if momentum and not error_feedback:
    raise ValueError("train_step: momentum= keeps each replica's velocity with its error-feedback "
                     "residual; it needs error_feedback=True")


def validate_bucket_bytes(bucket_bytes) -> int | str:
  if bucket_bytes == "auto":
    return bucket_bytes
  # a float such as 25e6 is a byte count too; a bool is not, though Python calls it an int
  if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, numbers.Real):
    raise TypeError(f"train_step: bucket_bytes must be a number of bytes (an int such as "
                    f"25 << 20) or 'auto', got {bucket_bytes!r} of type "
                    f"{type(bucket_bytes).__name__}")
  if not math.isfinite(bucket_bytes) or bucket_bytes < 1:
    raise ValueError(f"train_step: bucket_bytes must be a positive number of bytes, got "
                     f"{bucket_bytes!r}")
  return int(bucket_bytes)


FORMS = ("A train step is one of: `def step(state, batch, *args) -> (state, metrics)` with a "
         "TrainState (Linen); `def step(model, optimizer, batch, *args) -> metrics` with Flax "
         "NNX objects, updated in place; `def step(params, opt_state, batch, *args) -> (params, "
         "opt_state, metrics)` with an optax state (plain JAX, Equinox)")


def check_call(fn, args: tuple, form: str) -> None:
  """Raises TypeError, naming the three forms, where ``fn`` cannot take ``args`` (the step was
  written for one form and called with another's arguments)."""
  import inspect
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):   # a builtin or C callable: let the call say
    return
  try:
    signature.bind(*args)
  except TypeError as e:
    kinds = ", ".join(type(a).__name__ for a in args)
    raise TypeError(f"train_step: the step {getattr(fn, '__name__', fn)!r}{signature} cannot "
                    f"take the arguments it was called with ({kinds}: the {form} form): {e}. "
                    f"{FORMS}") from None
