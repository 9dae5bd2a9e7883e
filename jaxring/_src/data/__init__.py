"""The ImageNet input pipeline (public API: ``jaxring.data``)."""
