"""Per call of one plan in the emulated cluster's MPI shape (4 nodes x 2 ranks, 32 MiB f32 per
rank): rank 0's seconds, the most minor page faults of any rank, and the TCP segments
retransmitted and retransmission timeouts (RTO) in each node's network namespace during the call
(``/proc/net/snmp``, ``/proc/net/netstat``: the counters of the namespace the reading process is
in). Are the rare calls 2-3x slower than a plan's median TCP timeouts, or page faults?
``PLAN=ring`` (default) or ``hierarchical``, ``CODEC=bf16`` (default), ``int8`` or ``none``;
``CALLS`` (default 20).

  jaxring cluster up --name jrq --nodes 4
  jaxring cluster run --name jrq --nodes 4 --procs-per-node 2 --transport mpi -- \\
      env PLAN=ring CODEC=bf16 python benchmarks/scripts/ring_retransmits.py
"""
import os
import resource
import time

from mpi4py import MPI

import jax
import jax.numpy as jnp
import jaxring
import jaxring.distributed

comm = MPI.COMM_WORLD
local = 2
nodes = comm.Get_size() // local
topology = jaxring.Topology((jaxring.Level("local", local),
                             jaxring.Level("node", nodes, 1e9 / 8, 1e-4)))
jaxring.distributed.bind_mpi_axis("mpi", comm, topology)
plan, codec = os.environ.get("PLAN", "ring"), os.environ.get("CODEC", "bf16")
comp = None if codec == "none" else {"node": jaxring.codecs.parse(codec)}
f = jax.jit(lambda v: jaxring.psum(v, "mpi", algorithm=plan, compression=comp))
x = jnp.ones(((32 << 20) // 4,), jnp.float32)


def counters():
  snmp = open("/proc/net/snmp").read().splitlines()
  tcp = [l.split() for l in snmp if l.startswith("Tcp:")]
  retrans = int(tcp[1][tcp[0].index("RetransSegs")])
  ext = [l.split() for l in open("/proc/net/netstat").read().splitlines()
         if l.startswith("TcpExt:")]
  return retrans, int(ext[1][ext[0].index("TCPTimeouts")])


jax.block_until_ready(f(x))
jax.block_until_ready(f(x))
for i in range(int(os.environ.get("CALLS", "20"))):
  comm.Barrier()
  c0, f0 = counters(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  t = time.perf_counter()
  jax.block_until_ready(f(x))
  dt = time.perf_counter() - t
  comm.Barrier()
  c1, f1 = counters(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  faults = comm.reduce(f1 - f0, op=MPI.MAX, root=0)
  rows = comm.gather((c1[0] - c0[0], c1[1] - c0[1]), root=0)
  if comm.Get_rank() == 0:
    per_node = [rows[r] for r in range(0, comm.Get_size(), local)]   # one rank per namespace
    print(f"call {i:2d} {dt * 1e3:7.1f} ms  page faults {faults:4d}  retransmitted segments, "
          f"timeouts per node: {per_node}", flush=True)
