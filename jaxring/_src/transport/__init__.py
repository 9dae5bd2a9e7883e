"""How one step of a collective moves bytes; algorithms are written once against a transport.

``binding.bind`` says which transport an axis name is bound to: XLA collectives (``xla.py``, names
bound by ``shard_map``/``pmap``) or MPI (``mpi.py``; the binding of a name to a communicator in
``mpi_axis.py``). A level whose members are devices of one process may instead meet in shared
memory (``inprocess.py``), the transport the hierarchical plan puts on such a level. The watchdog, heartbeats and start-up roll call that keep a multi-process job
from hanging live in jaxring._src.reliability, below this folder.
"""
from jaxring._src.transport.groups import Group as Group
from jaxring._src.transport.xla import XlaTransport as XlaTransport
