"""Blockwise int8: one int8 code per value and one f32 scale per ``block_size`` values.

Encoding (jaxring._src.ext, rules in ext/reference.py): ``scale = max|x_block| / 127``,
``q = round_half_even(x / scale)``; decoding ``q * scale``. One encode errs by at most
``max|x_block| / 254`` per element (``/ 127`` with stochastic rounding, which is unbiased instead).

On the ring every hop decodes what arrived, adds the local partial in f32 and re-encodes the new
partial with fresh scales, in one fused kernel (``ring_hop_int8``). An element whose partial sums
on their way round the ring are ``S_1 .. S_p`` (``S_p`` the total, encoded once more for the
all-gather) therefore ends within ``sum_j max|S_j over its block| / 254`` of the exact sum (plus f32
rounding): the error grows with the number of hops, not with the magnitude of what is summed.
Non-finite values are never hidden: a block holding inf/nan decodes to nan.

Small values: within a block, a value below ``max|x_block| / 254`` rounds to 0 (the code's
resolution). A block whose largest magnitude is below ``2**-64`` gets scale 0 and decodes to
zeros, on every hop (measured: ``2**-64`` is kept, ``2**-64.5`` is not); scale gradients up (loss
scaling) before reducing values that small.
"""
from __future__ import annotations

import dataclasses
import operator

import jax.numpy as jnp
from jax import lax

from jaxring._src.codecs import kernels
from jaxring._src.codecs.base import (
    MAX_BLOCK_SIZE,
    Codec,
    accum_dtype,
    is_float,
    no_inner,
    spelling,
)

_F32 = jnp.dtype(jnp.float32)
_SCALE_BYTES = 4


def _seed(x):
  """A per-call stochastic-rounding seed from the data itself (codecs are stateless): the bits of
  three elements, so that members, hops and steps draw different offsets."""
  bits = lax.bitcast_convert_type(x.astype(_F32), jnp.uint32)
  n = x.shape[0]
  return bits[0] ^ (bits[n // 2] * jnp.uint32(0x9E3779B1)) ^ (bits[n - 1] * jnp.uint32(0x85EBCA77))


@dataclasses.dataclass(frozen=True)
class Int8(Codec):
  """int8 codes plus one f32 scale per ``block_size`` values, re-encoded at every ring hop.

  Attributes:
    block_size: values per scale; also the chunk alignment on the ring (blocks never straddle
      two members' chunks).
    stochastic: stochastic rounding (unbiased, twice the worst-case error) instead of
      round-half-to-even.
  """

  block_size: int = 256
  stochastic: bool = False

  name = "int8"
  lossy = True

  def __post_init__(self):
    try:
      bs = operator.index(self.block_size)
    except TypeError:
      raise ValueError(f"int8: block_size must be a positive integer, got {self.block_size!r}"
                       ) from None
    if not 1 <= bs <= MAX_BLOCK_SIZE:
      raise ValueError(f"int8: block_size must be a positive integer of at most {MAX_BLOCK_SIZE} "
                       f"(2**31 - 1), got {bs}")
    if not isinstance(self.stochastic, bool):
      raise ValueError(f"int8: stochastic must be True or False, got {self.stochastic!r}")
    object.__setattr__(self, "block_size", bs)

  @property
  def align(self) -> int:  # type: ignore[override]
    return self.block_size

  def applies_to(self, dtype) -> bool:
    return is_float(dtype)

  def wire_bytes(self, n: int, dtype=jnp.float32) -> int:
    if not self.applies_to(dtype):
      return super().wire_bytes(n, dtype)
    n = int(n)
    return n + _SCALE_BYTES * -(-n // self.block_size)

  def max_error(self, block_amax):
    """Worst-case error of one encode of a block whose largest magnitude is ``block_amax``."""
    return block_amax / (127.0 if self.stochastic else 254.0)

  def _seed_of(self, x):
    return _seed(x) if self.stochastic else 0

  def encode(self, x, dtype) -> tuple:
    x32 = x.astype(_F32) if x.dtype != _F32 else x
    return tuple(kernels.ops().quantize_int8(x32, self.block_size, self.stochastic,
                                             self._seed_of(x32)))

  def decode(self, payload: tuple, dtype):
    q, scales = payload
    out = kernels.ops().dequantize_int8(q, scales, self.block_size, _F32)
    acc = accum_dtype(dtype)
    return out if acc == _F32 else out.astype(acc)

  def in_process_decode(self, dtype) -> int | None:
    if not self.applies_to(dtype):
      return super().in_process_decode(dtype)
    return self.block_size if accum_dtype(dtype) == _F32 else None

  def hop(self, payload: tuple, local, dtype) -> tuple:
    if local.dtype != _F32:  # f64 partials: decode, add in f64, encode
      return super().hop(payload, local, dtype)
    q, scales = payload
    partial, q_out, s_out = kernels.ops().ring_hop_int8(q, scales, local, self.block_size,
                                                        self.stochastic, self._seed_of(local))
    return partial, (q_out, s_out)

  def last_hop(self, payload: tuple, local, dtype):
    if local.dtype != _F32:
      return super().last_hop(payload, local, dtype)
    q, scales = payload
    return kernels.ops().ring_hop_int8_last(q, scales, local, self.block_size)

  # the local chunk read in place (codecs/base.py); the stochastic variants seed from the chunk's
  # values, which the sliced path reads
  def encode_at(self, base, offset, n: int, dtype) -> tuple:
    at = None if self.stochastic else kernels.in_place("quantize_int8", base, n)
    if at is None:
      return super().encode_at(base, offset, n, dtype)
    return at(base, offset, n, self.block_size)

  def hop_at(self, payload: tuple, base, offset, n: int, dtype) -> tuple:
    at = None if self.stochastic else kernels.in_place("ring_hop_int8", base, n)
    if at is None:
      return super().hop_at(payload, base, offset, n, dtype)
    partial, q_out, s_out = at(*payload, base, offset, self.block_size)
    return partial, (q_out, s_out)

  def last_hop_at(self, payload: tuple, base, offset, n: int, dtype):
    at = kernels.in_place("ring_hop_int8_last", base, n)
    if at is None:
      return super().last_hop_at(payload, base, offset, n, dtype)
    return at(*payload, base, offset, self.block_size)


def int8(block_size: int = 256, stochastic: bool = False) -> Int8:
  """Blockwise int8 on the wire (~0.25 of f32 with 256-value blocks), f32 partial sums.

  Blocks whose largest magnitude is below ``2**-64`` are sent as zeros (module docstring).

  Args:
    block_size: values per f32 scale (a positive integer, at most ``2**31 - 1``).
    stochastic: unbiased stochastic rounding instead of round-half-to-even.

  Returns:
    The codec, for ``compression=`` of the collectives and ``jaxring.reduce_gradients``.

  Raises:
    ValueError: ``block_size`` is not a positive integer, or too large.

  Example:
    >>> jaxring.psum(g, ("node", "local"), algorithm="hierarchical",
    ...              compression={"node": jaxring.codecs.int8()})
    >>> jaxring.codecs.int8().wire_bytes(1024)  # 1024 codes + 4 scales
    1040
  """
  return Int8(block_size, stochastic)


@spelling("int8[:block_size[:stochastic]]", "int8", sweep=True)
def _read_int8(args, inner) -> Int8:
  no_inner("int8", inner)
  if len(args) > 2 or args[1:] not in ([], ["stochastic"]):
    raise ValueError("int8 takes a block size and 'stochastic'")
  return int8(*map(int, args[:1]), stochastic=args[1:] == ["stochastic"])
