"""The loss a reduced ``value_and_grad`` differentiates must be what ``jax.value_and_grad`` takes."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def check_output(out, has_aux: bool) -> None:
  """Raises the TypeError ``jax.value_and_grad`` raises for ``out`` (an integer, complex or
  non-scalar loss; a ``has_aux`` output that is not a pair), with jax's own message.

  The reduced path differentiates ``loss.astype(float32)``: without this check an integer loss
  would train with zero gradients instead of failing as it does under ``jax.grad``. jax itself
  judges a stand-in of the same shapes and dtypes, so the rules stay exactly jax's.
  """
  def stand_in(x):
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) if _is_array_like(x) else x

  if has_aux and isinstance(out, tuple) and len(out) == 2:
    out = (out[0], None)  # what aux holds is not jax's concern here, only the pair
  shapes = jax.tree_util.tree_map(stand_in, out)

  def like(_):
    return jax.tree_util.tree_map(
        lambda s: jnp.zeros(s.shape, s.dtype) if isinstance(s, jax.ShapeDtypeStruct) else s, shapes)

  try:
    jax.eval_shape(jax.value_and_grad(like, has_aux=has_aux), jax.ShapeDtypeStruct((), jnp.float32))
  except TypeError as e:
    raise TypeError(f"jaxring.value_and_grad: {e}") from None


def _is_array_like(x) -> bool:
  return hasattr(x, "dtype") or isinstance(x, (bool, int, float, complex))
