"""How one step of a collective moves bytes; algorithms are written once against a transport.

``binding.bind`` says which transport an axis name is bound to: XLA collectives (``xla.py``, names
bound by ``shard_map``/``pmap``) or MPI (``mpi.py``; the binding of a name to a communicator in
``mpi_axis.py``). ``watchdog.py`` is the one peer watchdog; each multi-process transport
gives it a heartbeat channel (``coordination.py`` for ``jax.distributed``, ``mpi_heartbeats.py``).
``rendezvous.py`` is the start-up roll call that names a process that never came.
"""
from jaxring._src.transport.groups import Group as Group
from jaxring._src.transport.xla import XlaTransport as XlaTransport
