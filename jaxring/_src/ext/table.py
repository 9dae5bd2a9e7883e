"""The one table of jaxring's kernels; every list of kernel names is derived from it.

Each entry is a public wrapper of :mod:`.kernels` and whether it is an FFI target
``jaxring_<name>`` of the extension (False: computed in Python around the targets). Every FFI
kernel has a pure-jnp reference of the same name in :mod:`.reference`, and the codecs resolve
exactly these names (``codecs/kernels.py``). ``jaxring doctor`` checks the registered targets
and self-tests every FFI kernel against its reference from this table. A new kernel is one line
here, its C++/CUDA handler, its wrapper and its reference.
"""

KERNEL_TABLE: dict[str, bool] = {
    "quantize_int8": True,
    "dequantize_int8": True,
    "fake_quantize_int8": False,   # quantize then dequantize, with a straight-through gradient
    "ring_hop_int8": True,
    "ring_hop_int8_last": True,
    "ring_hop_cast": True,
    "ring_hop_cast_last": True,
    "chunk_norms": True,
    "gather_chunks": True,
    "scatter_add_chunks": True,
    "quantize_fp4": True,
    "dequantize_fp4": True,
    "ring_hop_fp4": True,
    "ring_hop_fp4_last": True,
    "num_blocks": False,           # block counts: integer arithmetic on static shapes
    "num_chunks": False,
    "fp4_bytes": False,            # packed fp4 code bytes: the same
}
KERNELS = tuple(KERNEL_TABLE)
#: The kernels that are FFI targets (each with a reference), and the targets' registered names.
FFI_KERNELS = tuple(name for name, is_target in KERNEL_TABLE.items() if is_target)
FFI_TARGETS = tuple(f"jaxring_{name}" for name in FFI_KERNELS)
#: The kernels with a CPU target reading the chunk in place, ``jaxring_<name>_at`` (:mod:`.window`).
WINDOW_KERNELS = ("quantize_int8", "ring_hop_int8", "ring_hop_int8_last", "ring_hop_cast",
                  "ring_hop_cast_last", "quantize_fp4", "ring_hop_fp4", "ring_hop_fp4_last")
WINDOW_TARGETS = tuple(f"jaxring_{name}_at" for name in WINDOW_KERNELS)
