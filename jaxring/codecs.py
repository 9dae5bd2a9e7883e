"""Codecs for ``compression=``: what crosses a link (re-exported from jaxring._src.codecs)."""
from jaxring._src.codecs import Codec as Codec
from jaxring._src.codecs import none as none
