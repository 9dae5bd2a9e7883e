"""jaxring: fast, hierarchical, compressed gradient reduction for data-parallel JAX."""
