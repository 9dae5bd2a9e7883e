"""Codecs: what crosses a link, and how partial sums are re-encoded hop by hop."""
from jaxring._src.codecs.base import Codec as Codec
from jaxring._src.codecs.base import accum_dtype as accum_dtype
from jaxring._src.codecs.base import for_dtype as for_dtype
from jaxring._src.codecs.base import none as none
from jaxring._src.codecs.cast import Bf16 as Bf16
from jaxring._src.codecs.cast import CastCodec as CastCodec
from jaxring._src.codecs.cast import Fp16 as Fp16
from jaxring._src.codecs.cast import bf16 as bf16
from jaxring._src.codecs.cast import fp16 as fp16
# int8 before fp4: the spellings are listed (jaxring.codecs.parse's help) in registration order
from jaxring._src.codecs.int8 import Int8 as Int8  # isort: skip
from jaxring._src.codecs.int8 import int8 as int8  # isort: skip
from jaxring._src.codecs.fp4 import Fp4 as Fp4  # isort: skip
from jaxring._src.codecs.fp4 import fp4 as fp4  # isort: skip
from jaxring._src.codecs.topk import TopKChunks as TopKChunks
from jaxring._src.codecs.topk import topk_chunks as topk_chunks
