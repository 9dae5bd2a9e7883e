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

from jaxring._src.codecs.base import no_inner, spelling
from jaxring._src.codecs.blockwise import Blockwise


@dataclasses.dataclass(frozen=True)
class Int8(Blockwise):
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
