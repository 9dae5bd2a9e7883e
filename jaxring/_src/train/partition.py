"""Differentiated arguments holding more than arrays: an Equinox Module's functions and settings.

``jax.value_and_grad`` refuses a pytree with a leaf that is not a number (an ``eqx.Module``
holds its activation functions, its dropout rate, ... as leaves); ``eqx.filter_value_and_grad``
differentiates its array leaves and gives None for the others. ``jaxring.value_and_grad`` does
the same for such an argument, so an Equinox loss takes the whole model: its gradients then have
the structure of ``eqx.filter(model, eqx.is_array)``, which is what the optimizer state and a
train step's parameters are made of. An argument of numbers only is differentiated as jax does.
"""
from __future__ import annotations

import numbers
from typing import Callable

import jax
import numpy as np


def is_array(x) -> bool:
  """``eqx.is_array``'s test: a JAX or NumPy array."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _is_number(x) -> bool:
  return is_array(x) or isinstance(x, numbers.Number) or hasattr(x, "aval")


def has_static_leaves(args: tuple, argnums) -> bool:
  """Whether a differentiated argument holds a leaf that is not a number (jax would refuse it)."""
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  return any(not _is_number(x) for i in nums if i < len(args)
             for x in jax.tree_util.tree_leaves(args[i]))


def value_and_grad(value_and_grad_of: Callable, fun: Callable, argnums, has_aux: bool,
                   args: tuple, kwargs: dict):
  """``value_and_grad_of(fun', argnums, has_aux)`` of the array leaves of the differentiated
  arguments (the other leaves held as they are); gradients None where a leaf is not an array."""
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  held = {}
  new_args = list(args)
  for i in nums:
    leaves, treedef = jax.tree_util.tree_flatten(args[i])
    held[i] = (treedef, [None if is_array(x) else x for x in leaves])
    new_args[i] = jax.tree_util.tree_unflatten(treedef, [x if is_array(x) else None
                                                         for x in leaves])

  def combined(*call_args, **call_kwargs):
    call_args = list(call_args)
    for i, (treedef, others) in held.items():
      arrays = jax.tree_util.tree_leaves(call_args[i], is_leaf=lambda x: x is None)
      call_args[i] = jax.tree_util.tree_unflatten(
          treedef, [o if a is None else a for a, o in zip(arrays, others)])
    return fun(*call_args, **call_kwargs)

  return value_and_grad_of(combined, argnums, has_aux)(*new_args, **kwargs)
