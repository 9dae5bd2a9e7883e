"""A sharded step's optimizer with a global view: the whole-leaf math on each replica's blocks.

With ``shard="optimizer"|"params"`` each replica updates its blocks of the parameters. Running
the optimizer on the blocks as if they were leaves is exact for a coordinate-wise optimizer (SGD,
Adam) and wrong for one that reduces over a leaf or the tree (``optax.clip_by_global_norm``,
LAMB's trust ratio, Adafactor's factored moments, SM3, ``apply_if_finite``), and for one that
draws noise (``noisy_sgd``: every block would get the same). So the replicas run the optimizer
through :func:`global_view`: its ``update`` is traced on the *whole* shapes and the resulting
jaxpr is evaluated on the blocks, equation by equation:

* elementwise equations run on the blocks (a replicated operand is sliced to the block);
* a reduction over the split dimension reduces the block, then all-reduces the partial results
  (``psum``/``pmax``/``pmin``); one over other dimensions stays split. Partial sums stay local
  through additions (and scaling by a replicated scalar) and are all-reduced where first needed
  whole, so a global norm's per-leaf terms cost one all-reduce, not one per leaf;
* a replicated value broadcast to a leaf's shape stays lazy until an elementwise equation needs
  its block, so ``jnp.zeros_like`` or a broadcast scalar never materializes a whole leaf;
* calls (``jit``, ``custom_jvp``) are evaluated inside, ``cond`` runs every branch and selects;
  any other equation on a split operand (a matmul, a reshape, a loop) gathers its operands whole
  and runs replicated, with a warning: correct, at the replicated step's memory for that value.

A coordinate-wise optimizer runs exactly the equations it would run on the blocks; the global-
norm clip adds one scalar all-reduce; every update equals the replicated step's to
float32 rounding. Which optimizers need it is decided by their equations, not by comparing a
trial update (a warm-up schedule at 0, or Adam's scale-invariant first step, hides a clip).
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxring._src import native
from jaxring._src.train.context import current_context
from jaxring._src.train.sharding import dim_list, full_shape, local_block

ELEMENTWISE = frozenset("""
  abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp conj convert_element_type copy
  copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow
  is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or polygamma pow
  real reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic
  shift_right_logical sign sin sinh sqrt square stop_gradient sub tan tanh xor
""".split())
ALL_REDUCE = {"reduce_sum": lax.psum, "reduce_max": lax.pmax, "reduce_min": lax.pmin,
              "reduce_and": lax.pmin, "reduce_or": lax.pmax}
CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
IDENTITY = frozenset({"reshard", "sharding_constraint", "mesh_cast", "optimization_barrier"})
CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call",
                   "custom_vjp_call", "custom_vjp_call_jaxpr", "checkpoint", "remat"})


class _Value:
  """A value of the traced jaxpr: its block along ``dim`` (``dim`` None: the whole value), or a
  lazy whole-shaped value, ``make(dim)`` giving its block along ``dim`` (None: the whole), or
  (``partial``) this replica's term of a sum over the replicas not yet taken."""

  __slots__ = ("x", "dim", "make", "shape", "partial")

  def __init__(self, x, dim, shape, make: Callable | None = None, partial: bool = False):
    self.x, self.dim, self.shape, self.make = x, dim, tuple(shape), make
    self.partial = partial


def _is_zero(v: _Value) -> bool:
  return (v.make is None and v.dim is None and not v.partial and not v.shape
          and isinstance(v.x, (int, float, np.generic, np.ndarray)) and float(v.x) == 0)


class _Evaluator:
  """Evaluates a jaxpr of whole-shaped values on blocks split over ``axes`` (``p`` replicas)."""

  def __init__(self, axes, p: int):
    self.axes, self.p = axes, p
    self._index = None
    self.gathered: set[str] = set()   # equations that needed a split operand whole

  @property
  def index(self):
    if self._index is None:
      self._index = lax.axis_index(self.axes)
    return self._index

  def whole(self, v: _Value):
    if v.partial:   # the sum over the replicas, taken once
      v.x, v.partial = native.psum(v.x, self.axes), False
    if v.make is not None:
      return v.make(None)
    if v.dim is None:
      return v.x
    return native.all_gather(v.x, self.axes, axis=v.dim, tiled=True)

  def block(self, v: _Value, dim: int):
    if v.make is not None:
      return v.make(dim)
    if v.dim == dim:
      return v.x
    return local_block(self.whole(v), dim, self.p, self.index)

  def part(self, v: _Value, dim):
    """``v`` as an operand next to blocks along ``dim`` (None: whole); scalars and operands
    broadcast along ``dim`` (size 1 there) as they are."""
    if dim is None or len(v.shape) <= dim or v.shape[dim] == 1:
      return self.whole(v)
    return self.block(v, dim)

  def run(self, jaxpr, consts: Sequence, args: Sequence[_Value]) -> list[_Value]:
    env: dict = {}

    def read(var):
      if isinstance(var, jcore.Literal):
        return _Value(var.val, None, np.shape(var.val))
      return env[var]

    for var, c in zip(jaxpr.constvars, consts):
      env[var] = _Value(c, None, np.shape(c))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
      outs = self.equation(eqn, [read(v) for v in eqn.invars])
      for var, out in zip(eqn.outvars, outs):
        if not isinstance(var, jcore.DropVar):
          env[var] = out
    return [read(v) for v in jaxpr.outvars]

  # --- one equation --------------------------------------------------------------------------

  def equation(self, eqn, ins: list[_Value]) -> list[_Value]:
    name, params = eqn.primitive.name, eqn.params
    shapes = [tuple(v.aval.shape) for v in eqn.outvars]
    split = [v.dim for v in ins if v.dim is not None]
    lazy = any(v.make is not None for v in ins)
    if any(v.partial for v in ins) and self._stays_partial(name, ins):
      if name in ("add", "sub"):   # a replicated term enters the sum once: on replica 0's side
        args = [v.x if v.partial or _is_zero(v) else
                jnp.where(self.index == 0, v.x, 0).astype(var.aval.dtype)
                for v, var in zip(ins, eqn.invars)]
      else:
        args = [v.x for v in ins]
      return [_Value(o.x, None, o.shape, partial=True)
              for o in self._bind(eqn, args, None, shapes)]
    if not split and not lazy:
      return self._replicated(eqn, ins, shapes)
    if name in IDENTITY:   # sharding annotations of the whole: the layout stays ours
      return list(ins)
    if name in CALLS:
      inner = params.get("jaxpr", params.get("call_jaxpr", params.get("fun_jaxpr")))
      if inner is not None:
        closed = inner if hasattr(inner, "consts") else jcore.ClosedJaxpr(inner, ())
        return self.run(closed.jaxpr, closed.consts, ins)
    if name == "cond":
      return self._cond(eqn, ins, shapes)
    if name in ELEMENTWISE:
      return self._elementwise(eqn, ins, shapes, split)
    if name == "broadcast_in_dim":
      return self._broadcast(eqn, ins, shapes)
    x = ins[0]
    if x.dim is not None and x.make is None:
      d = x.dim
      if name in ALL_REDUCE:
        return [self._reduce(eqn, x, shapes[0])]
      if name == "transpose":
        return self._bind(eqn, [x.x], params["permutation"].index(d), shapes)
      if name == "squeeze":
        return self._bind(eqn, [x.x], d - sum(a < d for a in params["dimensions"]), shapes)
      if name in CUMULATIVE and params["axis"] != d:
        return self._bind(eqn, [x.x], d, shapes)
    return self._replicated(eqn, ins, shapes)

  @staticmethod
  def _stays_partial(name: str, ins: list[_Value]) -> bool:
    """Whether an equation on partial sums is linear in them, so that its result may be summed
    over the replicas later: the terms of a global norm are added up before one all-reduce."""
    if name in ("add", "sub"):
      return all(v.partial or (v.dim is None and v.make is None) for v in ins)
    if name == "neg":
      return True
    if name == "mul":   # by a replicated scalar
      return sum(v.partial for v in ins) == 1 and all(
          v.partial or (v.dim is None and v.make is None and not v.shape) for v in ins)
    return False

  def _bind(self, eqn, args, dim, shapes) -> list[_Value]:
    out = eqn.primitive.bind(*args, **eqn.params)
    out = out if eqn.primitive.multiple_results else [out]
    return [_Value(o, dim, s) for o, s in zip(out, shapes)]

  def _replicated(self, eqn, ins, shapes) -> list[_Value]:
    if any(v.dim is not None for v in ins):
      self.gathered.add(eqn.primitive.name)
    return self._bind(eqn, [self.whole(v) for v in ins], None, shapes)

  def _elementwise(self, eqn, ins, shapes, split) -> list[_Value]:
    if split:  # a block of every operand along the first split one's dimension
      d = split[0]
      return self._bind(eqn, [self.part(v, d) for v in ins], d, shapes)

    def make(dim, i):  # replicated and lazy operands only: the result stays lazy
      out = eqn.primitive.bind(*[self.part(v, dim) for v in ins], **eqn.params)
      return out[i] if eqn.primitive.multiple_results else out

    return [_Value(None, None, s, make=lambda dim, i=i: make(dim, i))
            for i, s in enumerate(shapes)]

  def _cond(self, eqn, ins, shapes) -> list[_Value]:
    """Every branch on the blocks, then the chosen branch's results: an optimizer's branches are
    cheap elementwise math (``optax.novograd``'s first step), not worth gathering leaves for."""
    index, operands = self.whole(ins[0]), ins[1:]
    results = [self.run(b.jaxpr, b.consts, operands) for b in eqn.params["branches"]]
    out = []
    for options, shape in zip(zip(*results), shapes):
      dims = [v.dim for v in options if v.dim is not None and v.make is None]
      d = dims[0] if dims and shape else None
      picked = lax.select_n(index, *[self.part(v, d) for v in options])
      out.append(_Value(picked, d, shape))
    return out

  def _broadcast(self, eqn, ins, shapes) -> list[_Value]:
    x, params = ins[0], dict(eqn.params)
    out_shape, bdims = tuple(params["shape"]), tuple(params["broadcast_dimensions"])
    if len(ins) > 1:   # dynamic shapes: not in an optimizer
      return self._replicated(eqn, ins, shapes)

    def bind(operand, dim):
      shape = list(out_shape)
      if dim is not None:
        shape[dim] //= self.p
      return eqn.primitive.bind(operand, **{**params, "shape": tuple(shape)})

    if x.dim is not None and x.make is None and x.shape[x.dim] == out_shape[bdims[x.dim]]:
      return [_Value(bind(x.x, bdims[x.dim]), bdims[x.dim], out_shape)]

    def make(dim):   # the block along ``dim`` of the broadcast of a replicated operand
      if dim is None:
        return bind(self.whole(x), None)
      src = [e for e, b in enumerate(bdims) if b == dim and x.shape[e] == out_shape[dim]]
      return bind(self.block(x, src[0]) if src else self.whole(x), dim)

    return [_Value(None, None, out_shape, make=make)]

  def _reduce(self, eqn, x: _Value, shape) -> _Value:
    d, axes = x.dim, tuple(eqn.params["axes"])
    local = eqn.primitive.bind(x.x, **eqn.params)
    if d not in axes:
      return _Value(local, d - sum(a < d for a in axes), shape)
    if eqn.primitive.name == "reduce_sum":   # summed over the replicas where it is needed
      return _Value(local, None, shape, partial=True)
    collective = ALL_REDUCE[eqn.primitive.name]
    if local.dtype == np.bool_:   # and/or over replicas: min/max of 0/1
      return _Value(collective(local.astype(np.int32), self.axes).astype(np.bool_), None, shape)
    return _Value(collective(local, self.axes), None, shape)


def _dim_of(spec, axes) -> int | None:
  for i, entry in enumerate(spec):
    names = entry if isinstance(entry, tuple) else (entry,)
    if entry is not None and set(names) & set(axes):
      return i
  return None


def dims_of_specs(specs, axes) -> list:
  """Each leaf's split dimension (or None) from a tree of PartitionSpecs over ``axes``."""
  return [_dim_of(s, axes) for s in jax.tree_util.tree_leaves(
      specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))]


def evaluate(fn: Callable, leaves: Sequence, dims: Sequence, axes: tuple, p: int,
             out_dims: Callable) -> Any:
  """``fn(*leaves)`` as it is on the whole leaves, evaluated on this replica's blocks (``leaves``
  split along ``dims`` over ``axes``; None: whole). ``out_dims(out_shape)`` gives the split
  dimension of each leaf of the result (None: whole); the result is a tree like ``fn``'s."""
  types = [jax.typeof(x) for x in leaves]
  avals = [jax.ShapeDtypeStruct(full_shape(t.shape, d, p), t.dtype, weak_type=t.weak_type)
           for t, d in zip(types, dims)]
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*avals)
  ev = _Evaluator(axes, p)
  outs = ev.run(closed.jaxpr, closed.consts,
                [_Value(x, d, a.shape) for x, d, a in zip(leaves, dims, avals)])
  if ev.gathered:
    warnings.warn(f"jaxring: {', '.join(sorted(ev.gathered))} of split leaves need the whole "
                  "leaves: each replica gathers them (memory of the replicated step for those "
                  "values)", stacklevel=3)
  flat = [ev.whole(v) if d is None else ev.block(v, d) for v, d in zip(outs, out_dims(out_shape))]
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), flat)


def global_view(tx, axes: tuple, p: int, param_dims: Sequence, param_def, opt_dims: Sequence,
                opt_def) -> optax.GradientTransformationExtraArgs:
  """``tx`` whose ``update``, called on blocks inside the step, computes what the whole-leaf
  update gives each block (see the module docstring).

  ``param_dims``/``opt_dims``: the split dimension of each leaf of the parameters (also the
  gradients' and the updates') and of the optimizer state, in the order of ``param_def`` and
  ``opt_def``. Outputs land split like the inputs they stand for.
  """
  axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)

  def dims_for(tree, treedef, dims, what):
    leaves, got = jax.tree_util.tree_flatten(tree)
    if got == treedef:
      return leaves, list(dims), got
    ctx = current_context()   # a subtree of the gradients or parameters (optax.lookahead's)
    known = [ctx.dim_of(x) if ctx is not None else None for x in leaves]
    if ctx is None or any(d is None and id(x) not in ctx.split_leaves
                          for x, d in zip(leaves, known)):
      raise ValueError(f"train_step: the sharded step's optimizer was handed {what} shaped "
                       f"{got}, not like the state's {treedef} nor a subtree of its gradients "
                       "or parameters")
    return leaves, known, got

  def update(updates, state, params=None, **extra):
    u, u_dims, u_def = dims_for(updates, param_def, param_dims, "updates")
    s, s_dims, _ = dims_for(state, opt_def, opt_dims, "an optimizer state")
    w, w_dims, w_def = ([], [], None) if params is None else dims_for(
        params, param_def, param_dims, "parameters")
    e, e_dims, rebuild = _extra_args(extra, param_def, param_dims)
    a, b, c = len(u), len(u) + len(s), len(u) + len(s) + len(w)

    def whole_update(*flat):
      return tx.update(jax.tree_util.tree_unflatten(u_def, flat[:a]),
                       jax.tree_util.tree_unflatten(opt_def, flat[a:b]),
                       None if params is None else jax.tree_util.tree_unflatten(w_def, flat[b:c]),
                       **rebuild(flat[c:]))

    def out_dims(out_shape):
      new_updates, new_state = out_shape
      return (_dims_back(new_updates, param_def, param_dims, u_def, u_dims)
              + dims_for(new_state, opt_def, opt_dims, "a new optimizer state back")[1])

    return evaluate(whole_update, u + s + w + e, u_dims + s_dims + w_dims + e_dims, axes, p,
                    out_dims)

  return optax.GradientTransformationExtraArgs(tx.init, update)


def _dims_back(out, param_def, param_dims, in_def, in_dims) -> list:
  """Split dimensions of the updates ``tx.update`` returns: like the parameters, or like the
  updates it was handed (a subtree of them)."""
  got = jax.tree_util.tree_structure(out)
  if got == param_def:
    return list(param_dims)
  if got == in_def:
    return list(in_dims)
  raise ValueError(f"train_step: the sharded step's optimizer returned updates shaped {got}, "
                   f"neither like the state's parameters {param_def} nor like its input")


def _extra_args(extra: dict, param_def, param_dims):
  """The arrays among ``tx.update``'s extra keyword arguments, their split dimensions (a tree
  shaped like the parameters, e.g. ``grad=``, is split like them; others whole), and how to
  rebuild the arguments from them: anything else (``value_fn=``, a Python flag) is passed as it
  is, not traced."""
  arrays, dims, parts = [], [], []
  for key, value in extra.items():
    leaves, treedef = jax.tree_util.tree_flatten(value)
    like_params = treedef == param_def
    slots = []
    for i, x in enumerate(leaves):
      if isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex)):
        slots.append(len(arrays))
        arrays.append(x)
        dims.append(param_dims[i] if like_params else None)
      else:
        slots.append(("static", x))
    parts.append((key, treedef, slots))

  def rebuild(flat):
    return {key: jax.tree_util.tree_unflatten(
        treedef, [slot[1] if isinstance(slot, tuple) else flat[slot] for slot in slots])
        for key, treedef, slots in parts}
  return arrays, dims, rebuild


def whole(fn: Callable) -> Callable:
  """``fn`` of whole leaves, run on this replica's blocks inside a sharded train step
  (``shard="optimizer"|"params"``): arguments shaped like ``state.params``, and the step's
  parameters and the gradients ``value_and_grad`` returned (any subtree or leaf of them), are
  taken as split like them; reductions over a split dimension are finished across the
  replicas, and the result is what ``fn`` gives on the whole leaves (a result shaped like the
  parameters: this replica's blocks of it). Other arrays are taken as whole. Elsewhere ``fn``
  itself.

  Example:
    >>> grad_norm = jaxring.train.whole(optax.tree.norm)(grads)   # the whole gradient's norm
    >>> enc_norm = jaxring.train.whole(optax.tree.norm)(grads["encoder"])
  """
  def wrapped(*args):
    ctx = current_context()
    if ctx is None or ctx.shard is None:
      return fn(*args)
    split = ctx.shard

    def dims_of(tree):
      if jax.tree_util.tree_structure(tree) == split.treedef:
        return list(split.dims)
      return [ctx.dim_of(x) for x in jax.tree_util.tree_leaves(tree)]

    leaves, treedef = jax.tree_util.tree_flatten(args)
    dims = [d for a in args for d in dims_of(a)]
    p = math.prod(int(lax.axis_size(a)) for a in ctx.config.split_axes)
    return evaluate(lambda *xs: fn(*jax.tree_util.tree_unflatten(treedef, xs)),
                                leaves, dims, ctx.config.split_axes, p, dims_of)

  return functools.wraps(fn)(wrapped)


def for_state(state, specs, dims, axes: tuple, p: int):
  """The global view of ``state.tx`` for a step whose state is split by ``specs`` (the
  parameters along ``dims``), or None where the state has no optimizer."""
  if getattr(state, "tx", None) is None or getattr(state, "opt_state", None) is None:
    return None
  dim_leaves = dim_list(state.params, dims)
  return global_view(state.tx, axes, p, dim_leaves, jax.tree_util.tree_structure(state.params),
                     dims_of_specs(specs.opt_state, axes),
                     jax.tree_util.tree_structure(state.opt_state))
