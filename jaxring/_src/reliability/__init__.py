"""What makes a multi-process job fail loudly instead of hanging: the peer watchdog and its
heartbeat channels, the start-up roll call, the cross-process plan fingerprint, the launch
markers of collectives, and the flight recorder.

``watchdog.py`` is the one peer watchdog; each multi-process runtime gives it a heartbeat channel
(``coordination.py`` for ``jax.distributed``, ``mpi_heartbeats.py`` for MPI). ``rendezvous.py``
is the start-up roll call that names a process that never came. ``fingerprint.py`` checks that
every process plans a collective alike; ``launches.py`` counts the collectives each process has
launched (the native launch markers), so a stuck peer is named with the call it is behind;
``flight_recorder.py`` keeps the last collectives for a post-mortem. Nothing here moves a
collective's bytes: that is jaxring._src.transport, which builds on this.
"""
