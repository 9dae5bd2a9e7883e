"""The MPI streaming ring (``jaxring._mpi_ext``, built from xla_ext/mpi_ring.cc when an MPI is found).

One FFI call runs a whole ring all-reduce over an MPI communicator: every hop split into pieces,
all receives posted up front, each piece sent (``MPI_Isend``) as soon as it is encoded, and the
reduce-scatter flowing into the all-gather piece by piece. The result is the gathered payload in
member order, bit-identical to :func:`jaxring._src.algorithms.ring.all_reduce_payload` with the
same codec.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

try:
  from jaxring import _mpi_ext
except ImportError as exc:  # built without MPI, or libmpi cannot be loaded
  _mpi_ext, LOAD_ERROR = None, exc
else:
  LOAD_ERROR = None
  for _name, _capsule in _mpi_ext.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

AVAILABLE: bool = _mpi_ext is not None
WIRES = tuple(map(jnp.dtype, (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8)))


def ring_all_reduce_payload(x, comm_handle: int, wire, *, block_size: int = 1, pieces: int = 1,
                            timeout_s: float = 120.0) -> tuple:
  """Ring all-reduce of the f32 buffer ``x`` (length ``p * pieces * block_size * m``).

  Args:
    x: this rank's f32 accumulator buffer.
    comm_handle: the communicator's Fortran handle (``comm.py2f()``); a communicator of the
      ring's own, since its messages carry fixed tags.
    wire: what travels: f32, bf16 or f16 (values cast, round to nearest even) or int8 (blockwise,
      round half to even, one f32 scale per ``block_size`` values).
    pieces: transfers per hop.
    timeout_s: seconds to wait for any one piece before failing with the rank waited for.

  Returns:
    ``(values,)`` or, for int8, ``(codes, scales)``: every member's reduced chunk, encoded, in
    member order.
  """
  if not AVAILABLE:
    raise ImportError(f"jaxring._mpi_ext is not built: {LOAD_ERROR}")
  wire = jnp.dtype(wire)
  if wire not in WIRES or x.dtype != jnp.float32 or x.ndim != 1:
    raise ValueError(f"MPI streaming ring: f32 vector in, wire one of {WIRES}; got "
                     f"{x.dtype}{list(x.shape)} and {wire}")
  n = x.shape[0]
  int8 = wire == jnp.dtype(jnp.int8)
  out = (jax.ShapeDtypeStruct((n,), wire),
         jax.ShapeDtypeStruct((n // block_size if int8 else 0,), jnp.float32))
  values, scales = jax.ffi.ffi_call("jaxring_mpi_ring_all_reduce", out, has_side_effect=True)(
      x, comm=int(comm_handle), pieces=int(pieces), block_size=int(block_size if int8 else 1),
      timeout_s=float(timeout_s))
  return (values, scales) if int8 else (values,)
