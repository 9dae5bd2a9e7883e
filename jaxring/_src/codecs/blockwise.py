"""What the blockwise codecs (int8, fp4) share: codes plus one f32 scale per ``block_size``
values, the fused ring-hop kernels named ``<op>_<name>`` (jaxring._src.ext), the chunk read in
place where a windowed kernel exists, f64 partials through the base codec's decode-add-encode.

A subclass is a frozen dataclass with the fields ``block_size`` and ``stochastic`` and says how
many bytes its codes take, its worst-case error, and whether two codes share a byte (``paired``:
even block sizes and counts; the windowed kernels then take the chunk's length).
"""
from __future__ import annotations

import operator

import jax.numpy as jnp
from jax import lax

from jaxring._src.codecs import kernels
from jaxring._src.codecs.base import MAX_BLOCK_SIZE, Codec, accum_dtype, is_float

F32 = jnp.dtype(jnp.float32)
SCALE_BYTES = 4


def seed(x):
  """A per-call stochastic-rounding seed from the data itself (codecs are stateless): the bits of
  three elements, so that members, hops and steps draw different offsets."""
  bits = lax.bitcast_convert_type(x.astype(F32), jnp.uint32)
  n = x.shape[0]
  return bits[0] ^ (bits[n // 2] * jnp.uint32(0x9E3779B1)) ^ (bits[n - 1] * jnp.uint32(0x85EBCA77))


class Blockwise(Codec):
  """The shared part of a blockwise codec (see the module docstring)."""

  lossy = True
  paired = False          # two codes a byte: block sizes and encoded counts even
  nearest_error = 254.0   # one encode to nearest errs by at most max|x_block| / this
  decodes_in_process = True

  def __post_init__(self):
    kind = "positive even integer" if self.paired else "positive integer"
    try:
      bs = operator.index(self.block_size)
    except TypeError:
      raise ValueError(f"{self.name}: block_size must be a {kind}, got {self.block_size!r}"
                       ) from None
    limit = MAX_BLOCK_SIZE - 1 if self.paired else MAX_BLOCK_SIZE
    if not (2 if self.paired else 1) <= bs <= limit or (self.paired and bs % 2):
      why = "two codes a byte" if self.paired else "2**31 - 1"
      raise ValueError(f"{self.name}: block_size must be a {kind} of at most {limit} ({why}), "
                       f"got {bs}")
    if not isinstance(self.stochastic, bool):
      raise ValueError(f"{self.name}: stochastic must be True or False, got {self.stochastic!r}")
    object.__setattr__(self, "block_size", bs)

  @property
  def align(self) -> int:  # type: ignore[override]
    return self.block_size

  def applies_to(self, dtype) -> bool:
    return is_float(dtype)

  def code_bytes(self, n: int) -> int:
    return -(-n // 2) if self.paired else n

  def wire_bytes(self, n: int, dtype=jnp.float32) -> int:
    if not self.applies_to(dtype):
      return super().wire_bytes(n, dtype)
    n = int(n)
    return self.code_bytes(n) + SCALE_BYTES * -(-n // self.block_size)

  def max_error(self, block_amax):
    """Worst-case error of one encode of a block whose largest magnitude is ``block_amax``
    (stochastic rounding: twice that to nearest)."""
    return block_amax / (self.nearest_error / (2.0 if self.stochastic else 1.0))

  def _seed_of(self, x):
    return seed(x) if self.stochastic else 0

  def _op(self, op: str):
    return getattr(kernels.ops(), f"{op}_{self.name}")

  def encode(self, x, dtype) -> tuple:
    if self.paired and x.shape[0] % 2:
      raise ValueError(f"{self.name} encodes an even count of values (two codes a byte), got "
                       f"{x.shape[0]}: pad to a multiple of the codec's align, as the "
                       "collectives do")
    x32 = x.astype(F32) if x.dtype != F32 else x
    return tuple(self._op("quantize")(x32, self.block_size, self.stochastic, self._seed_of(x32)))

  def decode(self, payload: tuple, dtype):
    q, scales = payload
    out = self._op("dequantize")(q, scales, self.block_size, F32)
    acc = accum_dtype(dtype)
    return out if acc == F32 else out.astype(acc)

  def in_process_decode(self, dtype) -> int | None:
    if not self.decodes_in_process or not self.applies_to(dtype):
      return super().in_process_decode(dtype)
    return self.block_size if accum_dtype(dtype) == F32 else None

  def hop(self, payload: tuple, local, dtype) -> tuple:
    if local.dtype != F32:  # f64 partials: decode, add in f64, encode
      return super().hop(payload, local, dtype)
    q, scales = payload
    partial, q_out, s_out = self._op("ring_hop")(q, scales, local, self.block_size,
                                                 self.stochastic, self._seed_of(local))
    return partial, (q_out, s_out)

  def last_hop(self, payload: tuple, local, dtype):
    if local.dtype != F32:
      return super().last_hop(payload, local, dtype)
    q, scales = payload
    return getattr(kernels.ops(), f"ring_hop_{self.name}_last")(q, scales, local, self.block_size)

  # the local chunk read in place (codecs/base.py); the stochastic variants seed from the chunk's
  # values, which the sliced path reads
  def _at(self, op: str, base, n: int, stochastic_too: bool = False):
    if (self.stochastic and not stochastic_too) or (self.paired and n % 2 and op == "quantize"):
      return None
    return kernels.in_place(f"{op}_{self.name}" if op != "last" else f"ring_hop_{self.name}_last",
                            base, n)

  def _length(self, n: int) -> tuple:
    return (n,) if self.paired else ()

  def encode_at(self, base, offset, n: int, dtype) -> tuple:
    at = self._at("quantize", base, n)
    if at is None:
      return super().encode_at(base, offset, n, dtype)
    return at(base, offset, n, self.block_size)

  def hop_at(self, payload: tuple, base, offset, n: int, dtype) -> tuple:
    at = self._at("ring_hop", base, n)
    if at is None:
      return super().hop_at(payload, base, offset, n, dtype)
    partial, q_out, s_out = at(*payload, base, offset, *self._length(n), self.block_size)
    return partial, (q_out, s_out)

  def last_hop_at(self, payload: tuple, base, offset, n: int, dtype):
    at = self._at("last", base, n, stochastic_too=True)
    if at is None:
      return super().last_hop_at(payload, base, offset, n, dtype)
    return at(*payload, base, offset, *self._length(n), self.block_size)
