"""Worker for tests/test_axis_order.py: the replica groups of lax's and jaxring's all-reduces over
(node, local) in both orders, across processes, and their sums against float64 numpy."""
from __future__ import annotations

import re

import numpy as np


def main() -> int:
  import jaxring.distributed
  jaxring.distributed.initialize()   # everything from JAXRING_* variables
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxring
  me = jax.process_index()
  mesh = jaxring.distributed.process_mesh()
  per_proc = mesh.shape["local"]
  spec = P(("node", "local"))
  rows = np.random.default_rng(0).standard_normal((mesh.size, 1003)).astype(np.float32)
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, spec),
                                             rows[me * per_proc:(me + 1) * per_proc])
  bodies = {
      "lax(node,local)": lambda v: jax.lax.psum(v, ("node", "local")),
      "lax(local,node)": lambda v: jax.lax.psum(v, ("local", "node")),
      "jaxring(local,node)": lambda v: jaxring.psum(v, ("local", "node")),
      "jaxring(local,node)/xla": lambda v: jaxring.psum(v, ("local", "node"), algorithm="xla"),
      "jaxring(node,local)": lambda v: jaxring.psum(v, ("node", "local")),
  }
  want = rows.astype(np.float64).sum(axis=0)
  for name, body in bodies.items():
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=P()))
    hlo = f.lower(x).compile().as_text()
    groups = re.findall(r"all-reduce(?:-start)?\(.*?replica_groups=(\{\{[\d,{}]*\}\})", hlo)
    print(f"process {me}: groups {name}: {','.join(groups)}", flush=True)
    got = np.asarray(f(x).addressable_data(0), np.float64).reshape(-1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  print(f"process {me}: sums OK", flush=True)
  jaxring.distributed.barrier("done", timeout_s=60)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
