"""Multi-process jobs: ``jax.distributed`` start-up (gloo interface, peer watchdog) and axis names
bound to MPI communicators (one process per device under ``mpirun``)."""
from jaxring._src.distributed import BarrierTimeoutError as BarrierTimeoutError
from jaxring._src.reliability.fingerprint import CollectiveMismatchError as CollectiveMismatchError
from jaxring._src.reliability.flight_recorder import dump as dump
from jaxring._src.reliability.fingerprint import FingerprintTimeoutError as FingerprintTimeoutError
from jaxring._src.reliability.rendezvous import StartupTimeoutError as StartupTimeoutError
from jaxring._src.distributed import barrier as barrier
from jaxring._src.distributed import initialize as initialize
from jaxring._src.distributed import is_initialized as is_initialized
from jaxring._src.distributed import process_mesh as process_mesh
from jaxring._src.distributed import shutdown as shutdown
from jaxring._src.transport.mpi_axis import MpiAxis as MpiAxis
from jaxring._src.transport.mpi_axis import bind_mpi_axis as bind_mpi_axis
from jaxring._src.transport.mpi_axis import mpi_axis as mpi_axis
from jaxring._src.transport.mpi_axis import unbind_mpi_axis as unbind_mpi_axis
