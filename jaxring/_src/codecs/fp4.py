"""Blockwise fp4: one 4-bit e2m1 code per value (two a byte) and one f32 scale per ``block_size``
values, re-encoded at every ring hop.

Encoding (jaxring._src.ext, rules in ext/reference.py): ``scale = max|x_block| / 6`` (rounded
down by an ulp, so that no finite value decodes to inf), ``x / scale`` rounded to the nearest of
±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to an even mantissa; decoding ``value * scale``. A float grid,
not an integer one: its steps grow with the magnitude (0.5, 1, 2 scale units), so small values in
a block with a large one keep more of their precision than on int4's uniform grid, at 2.3 times
its worst case. One encode errs by at most ``max|x_block| / 6`` per element (``/ 3`` with
stochastic rounding, which is unbiased instead); to nearest, by at most a fifth of the element's
own magnitude from ``max|x_block| / 6`` on, a third from ``max|x_block| / 12`` on. Measured
against int4 (codes -7..7), and the choice: docs/design.md, "Codecs".

On the ring every hop decodes what arrived, adds the local partial in f32 and re-encodes the new
partial with fresh scales, in one fused kernel (``ring_hop_fp4``). An element whose partial sums
on their way round the ring are ``S_1 .. S_p`` (``S_p`` the total, encoded once more for the
all-gather) therefore ends within ``sum_j max|S_j over its block| / 6`` of the exact sum (plus f32
rounding). Non-finite values are never hidden: a block holding inf/nan decodes to nan.

Small values: within a block, a value at most ``max|x_block| / 24`` rounds to 0 (to nearest). A
block whose largest magnitude is below ``2**-64`` gets scale 0 and decodes to zeros, on every hop
(int8's threshold); scale gradients up (loss scaling) before reducing values that small.

Odd lengths: block sizes are even, and the ring's chunks whole blocks, so every chunk starts on a
byte; the collectives pad a leaf or bucket to the codec's ``align`` as they do for int8.
:meth:`Fp4.encode` therefore takes an even count of values (the kernels any count).
"""
from __future__ import annotations

import dataclasses

from jaxring._src.codecs.base import no_inner, spelling
from jaxring._src.codecs.blockwise import Blockwise


@dataclasses.dataclass(frozen=True)
class Fp4(Blockwise):
  """4-bit e2m1 codes plus one f32 scale per ``block_size`` values, re-encoded at every ring hop.

  Attributes:
    block_size: values per scale, even; also the chunk alignment on the ring (blocks never
      straddle two members' chunks, nor share a byte).
    stochastic: stochastic rounding (unbiased, twice the worst-case error) instead of
      round-half-to-even.
  """

  block_size: int = 64
  stochastic: bool = False

  name = "fp4"
  paired = True         # two codes a byte
  nearest_error = 6.0   # half the widest step (4 to 6 scale units)
  decodes_in_process = False


def fp4(block_size: int = 64, stochastic: bool = False) -> Fp4:
  """Blockwise fp4 (e2m1) on the wire (~0.14 of f32 with 64-value blocks), f32 partial sums.

  For the slowest links: DiLoCo-class outer syncs of pseudo-gradients (as Streaming DiLoCo sends
  them in 4-bit floats), or per-step reductions with error feedback. Blocks whose largest
  magnitude is below ``2**-64`` are sent as zeros (module docstring).

  Args:
    block_size: values per f32 scale (a positive even integer, at most ``2**31 - 2``).
    stochastic: unbiased stochastic rounding instead of round-half-to-even.

  Returns:
    The codec, for ``compression=`` of the collectives and ``jaxring.reduce_gradients``.

  Raises:
    ValueError: ``block_size`` is not a positive even integer, or too large.

  Example:
    >>> jaxring.psum(g, ("node", "local"), algorithm="hierarchical",
    ...              compression={"node": jaxring.codecs.fp4()})
    >>> jaxring.codecs.fp4().wire_bytes(1024)  # 512 bytes of codes + 16 scales
    576
  """
  return Fp4(block_size, stochastic)


@spelling("fp4[:block_size[:stochastic]]", "fp4")
def _read_fp4(args, inner) -> Fp4:
  no_inner("fp4", inner)
  if len(args) > 2 or args[1:] not in ([], ["stochastic"]):
    raise ValueError("fp4 takes an even block size and 'stochastic'")
  return fp4(*map(int, args[:1]), stochastic=args[1:] == ["stochastic"])
