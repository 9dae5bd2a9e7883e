"""The emulated cluster's JAX shape as these scripts set it up: one process per node
(``jaxring cluster run --transport jax --devices-per-proc D``), ``jax.distributed`` initialized,
the (node, local) process mesh, every device holding its own normal draws.

  from emulated_jax import jax_shape   # beside the script: its folder is on sys.path
  mesh, axes, x, program = jax_shape(1 << 20)
"""
import numpy as np

import jaxring.distributed


def jax_shape(nbytes: int):
  """``(mesh, axes, x, program)``: ``x`` holds ``nbytes`` of f32 per device (process ``p``'s
  drawn from seed ``p``); ``program(body)`` jits ``body`` under ``shard_map`` over both axes."""
  jaxring.distributed.initialize()
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jaxring.distributed.process_mesh()
  axes = ("node", "local")
  local = np.random.default_rng(jax.process_index()).standard_normal(
      (mesh.shape["local"], nbytes // 4))
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P(axes)),
                                             local.astype(np.float32))

  def program(body):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
  return mesh, axes, x, program
