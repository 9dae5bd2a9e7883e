"""Flax NNX objects in ``jaxring.value_and_grad``: a Module as the differentiated argument.

``nnx.value_and_grad(loss_fn)(model, x, y)`` differentiates ``loss_fn`` with respect to the
model's ``nnx.Param`` variables (or the filter of an ``nnx.DiffState``) and writes the other
variables the call changed (``nnx.BatchStat``, ``nnx.RngCount``) back into ``model``. The same
call through jaxring splits each graph-node argument into its differentiated variables, as
arrays (:func:`pure`: the tree a train step's parameters, residuals and buckets are laid out by,
and the one ``nnx.Optimizer`` hands its optax transformation), and the rest; differentiates a
pure function of those arrays with the pytree path (buckets reduced inside the backward pass);
and hands back the gradients as the ``nnx.State`` ``nnx.value_and_grad`` returns. Outside a train step it is ``nnx.value_and_grad``.
"""
from __future__ import annotations

from typing import Any, Callable

import jax


def nnx_module():
  """``flax.nnx``, or None where this flax has none."""
  try:
    from flax import nnx
  except ImportError:  # pragma: no cover - flax < 0.8
    return None
  return nnx


def pure(tree):
  """``tree`` with every NNX Variable replaced by its value (``nnx.as_pure``; ``nnx.pure`` in
  flax 0.11): the tree ``nnx.Optimizer.update`` hands its optax transformation."""
  nnx = nnx_module()
  return nnx.as_pure(tree) if hasattr(nnx, "as_pure") else nnx.pure(tree)


def is_graph_node(x) -> bool:
  """Whether ``x`` is a Flax NNX object (Module, Optimizer, Rngs, ...)."""
  nnx = nnx_module()
  return nnx is not None and not isinstance(x, type) and nnx.graph.is_graph_node(x)


def diff_specs(argnums) -> list[tuple[int, Any]]:
  """``[(argnum, filter)]`` of an ``argnums`` as NNX takes it: ints (filter ``nnx.Param``),
  ``nnx.DiffState(argnum, filter)``, or a sequence of them."""
  nnx = nnx_module()
  items = argnums if isinstance(argnums, (tuple, list)) else (argnums,)
  out = []
  for a in items:
    if nnx is not None and isinstance(a, nnx.DiffState):
      out.append((int(a.argnum), a.filter))
    elif isinstance(a, int):
      out.append((a, None if nnx is None else nnx.Param))
    else:
      raise TypeError(f"jaxring.value_and_grad: argnums must be ints or nnx.DiffState, got {a!r}")
  return out


def uses_nnx(args, argnums) -> bool:
  """Whether a call differentiates (or passes) NNX objects: NNX's semantics then apply."""
  nnx = nnx_module()
  if nnx is None:
    return False
  items = argnums if isinstance(argnums, (tuple, list)) else (argnums,)
  if any(isinstance(a, nnx.DiffState) for a in items):
    return True
  return any(is_graph_node(a) for a in args)


def _key(path) -> str:
  """A leaf's path without the attribute keys of Variable nodes (``.value``): the same string
  for a leaf of an ``nnx.State`` of Variables and of its ``nnx.pure`` arrays."""
  return jax.tree_util.keystr(tuple(k for k in path if not isinstance(k, jax.tree_util.GetAttrKey)))


def values_by_path(tree) -> dict:
  """``{key path: leaf}`` of a pytree (an ``nnx.State`` of Variables or of arrays)."""
  return {_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def with_values(state, arrays):
  """A new ``nnx.State`` shaped like ``state`` holding the arrays of ``arrays`` (its arrays,
  possibly traced); ``state``'s own Variables are left alone."""
  new = values_by_path(arrays)
  paths, treedef = jax.tree_util.tree_flatten_with_path(state)
  return jax.tree_util.tree_unflatten(treedef, [new[_key(p)] for p, _ in paths])


def value_and_grad(pytree_value_and_grad: Callable, fun: Callable, argnums, has_aux: bool,
                   args: tuple, kwargs: dict):
  """``nnx.value_and_grad(fun, argnums, has_aux)(*args, **kwargs)`` whose differentiation is
  ``pytree_value_and_grad(pure, argnums=0, has_aux=True)``: the train step's reduction."""
  nnx = nnx_module()
  specs = diff_specs(argnums)
  diff_at = dict(specs)
  if len(diff_at) != len(specs):
    raise ValueError(f"jaxring.value_and_grad: argnums {argnums!r} names an argument twice")
  for i in diff_at:
    if not is_graph_node(args[i]):
      raise TypeError(
          f"jaxring.value_and_grad: argument {i} is differentiated with an nnx.DiffState but is "
          f"a {type(args[i]).__name__}, not an NNX object; mixing NNX objects and plain pytrees "
          "among the differentiated arguments is not supported: differentiate the Module")
  nodes = {i: a for i, a in enumerate(args) if is_graph_node(a)}
  graphs, diffs, rests = {}, {}, {}
  for i, node in nodes.items():
    if i in diff_at:
      graphs[i], diffs[i], rests[i] = nnx.split(node, diff_at[i], ...)
    else:
      graphs[i], rests[i] = nnx.split(node)
  order = [i for i, _ in specs]
  single = not isinstance(argnums, (tuple, list))
  pure_diffs = tuple(pure(diffs[i]) for i in order)   # laid out as a step's state.params
  plain_at = [i for i in range(len(args)) if i not in nodes]

  def pure_fun(pure_diffs, *plain):
    pure_diffs = (pure_diffs,) if single else pure_diffs
    new_args = list(args)
    for i, x in zip(plain_at, plain):   # as the step's precision policy cast them
      new_args[i] = x
    merged = {}
    for i in nodes:   # new Variables (a copy of the State), mutable at this trace's level
      rest = jax.tree_util.tree_map(lambda x: x, rests[i])
      if i in diff_at:
        merged[i] = nnx.merge(graphs[i], with_values(diffs[i], pure_diffs[order.index(i)]), rest)
      else:
        merged[i] = nnx.merge(graphs[i], rest)
      new_args[i] = merged[i]
    out = fun(*new_args, **kwargs)
    loss, aux = out if has_aux else (out, None)
    updates = {}
    for i, m in merged.items():   # what the call changed besides the differentiated variables
      updates[i] = nnx.split(m, diff_at[i], ...)[2] if i in diff_at else nnx.split(m)[1]
    return loss, (aux, updates)

  (loss, (aux, updates)), g = pytree_value_and_grad(pure_fun, 0, True)(
      pure_diffs[0] if single else pure_diffs, *(args[i] for i in plain_at))
  for i, node in nodes.items():
    nnx.update(node, updates[i])
  g = (g,) if single else g
  grads = [with_values(diffs[i], g_i) for i, g_i in zip(order, g)]
  grads = grads[0] if single else tuple(grads)
  return ((loss, aux) if has_aux else loss), grads
