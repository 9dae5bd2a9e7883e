"""Multi-process start-up for jaxring jobs (``jax.distributed`` + gloo interface + peer watchdog)."""
from jaxring._src.distributed import BarrierTimeoutError as BarrierTimeoutError
from jaxring._src.distributed import barrier as barrier
from jaxring._src.distributed import initialize as initialize
from jaxring._src.distributed import is_initialized as is_initialized
from jaxring._src.distributed import shutdown as shutdown
