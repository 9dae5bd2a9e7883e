"""Codecs: what crosses a link, and how partial sums are re-encoded hop by hop."""
from jaxring._src.codecs.base import Codec as Codec
from jaxring._src.codecs.base import accum_dtype as accum_dtype
from jaxring._src.codecs.base import for_dtype as for_dtype
from jaxring._src.codecs.base import none as none
