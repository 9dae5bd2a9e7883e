"""Codecs for ``compression=``: what crosses a link (re-exported from jaxring._src.codecs).

``none()`` (own dtype), ``bf16()`` / ``fp16(block_size)`` (16-bit floats; fp16 scaled by a power
of two per block so that small gradients keep fp16's relative precision),
``int8(block_size, stochastic)`` (blockwise int8, re-encoded at every ring hop),
``fp4(block_size, stochastic)`` (blockwise 4-bit e2m1 floats, the same way) and
``topk_chunks(density, chunk_size, inner)`` (coarse-grained sparse all-reduce). Partial sums are
always accumulated in f32 or wider. ``parse("int8:256")`` reads a codec from its command-line
spelling.
"""
from jaxring._src.codecs import Bf16 as Bf16
from jaxring._src.codecs import CastCodec as CastCodec
from jaxring._src.codecs import Codec as Codec
from jaxring._src.codecs import Fp4 as Fp4
from jaxring._src.codecs import Fp16 as Fp16
from jaxring._src.codecs import Int8 as Int8
from jaxring._src.codecs import TopKChunks as TopKChunks
from jaxring._src.codecs import bf16 as bf16
from jaxring._src.codecs import fp4 as fp4
from jaxring._src.codecs import fp16 as fp16
from jaxring._src.codecs import int8 as int8
from jaxring._src.codecs import none as none
from jaxring._src.codecs import topk_chunks as topk_chunks
from jaxring._src.codecs.base import parse as parse
