"""Worker for tests/test_train_multiprocess.py: one of N processes of a data-parallel fit
(``--shard params``: the parameters split over every process's devices; ``params-hpz``: the
same on a (process, local) mesh, hierarchical, with hpZ).

Every process feeds only its own slice of each global batch (BatchIterator's default process
split) and all write to the same metrics file, which only process 0 may touch. Process 0 saves the
final parameters to ``--out``. ``--shard`` may name several modes (``none,params``): one fit after
the other in the same processes (starting them is most of a run's time), each writing to
``--metrics`` and ``--out`` with ``{shard}`` replaced by its mode.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def problem():
  """The model, optimizer, data and loss shared by the worker and the in-process reference."""
  import jax.numpy as jnp
  import optax
  from flax import linen as nn

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(3)(jnp.tanh(nn.Dense(16)(x)))

  rng = np.random.RandomState(0)
  data = {"x": rng.randn(96, 5).astype(np.float32), "y": rng.randint(0, 3, 96).astype(np.int32)}

  def loss_fn(apply_fn, params, batch):
    logits = apply_fn({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  # the clip reduces over every leaf: sharded, its squared sums cross the processes
  tx = optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.3, momentum=0.9))
  return MLP(), tx, data, loss_fn


def run_nnx(num_steps: int, metrics_path: str | None, shard: str = "none"):
  """The same problem as a Flax NNX model and nnx.Optimizer, stepped in place; returns the
  step and the parameters (a plain nested dict, as run's state.params)."""
  import jax.numpy as jnp
  from flax import nnx

  import jaxring.train as jt
  _, tx, data, _ = problem()

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.hidden, self.out = nnx.Linear(5, 16, rngs=rngs), nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
      return self.out(jnp.tanh(self.hidden(x)))

  model = MLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  def loss_fn(model, batch):
    import optax
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

  @jt.train_step(bucket_bytes=256, shard=shard)
  def step(model, optimizer, batch):
    loss, grads = jt.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return {"loss": loss}

  jt.fit(step, (model, optimizer), jt.BatchIterator(data, 32, seed=1), num_steps=num_steps,
         log_every=1, metrics_path=metrics_path, progress=False)
  return step, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def run(num_steps: int, metrics_path: str | None, shard: str = "none"):
  import jax
  import jax.numpy as jnp

  import jaxring.train as jt
  model, tx, data, loss_fn = problem()
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 5)))["params"]
  state = jt.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  kw = dict(shard=shard)
  if shard == "params-hpz":  # one mesh row per process: the node level crosses processes, the
    # local level meets in shared memory (the in-process custom calls, under FSDP's remat)
    from jax.sharding import Mesh
    mesh = Mesh(np.asarray(jax.devices()).reshape(jax.process_count(), -1), ("node", "local"))
    kw = dict(mesh=mesh, axis_name=("node", "local"), algorithm="hierarchical", shard="params",
              hpz=True)

  @jt.train_step(bucket_bytes=256, **kw)
  def step(state, batch):
    loss, grads = jt.value_and_grad(lambda p: loss_fn(state.apply_fn, p, batch))(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  state = jt.fit(step, state, jt.BatchIterator(data, 32, seed=1), num_steps=num_steps,
                 log_every=1, metrics_path=metrics_path, progress=False)
  return step, state


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--port", type=int, required=True)
  ap.add_argument("--process-id", type=int, required=True)
  ap.add_argument("--num-processes", type=int, default=2)
  ap.add_argument("--local-devices", type=int, default=4)
  ap.add_argument("--steps", type=int, default=4)
  ap.add_argument("--metrics", required=True)
  ap.add_argument("--out", required=True)
  ap.add_argument("--shard", default="none")
  ap.add_argument("--api", default="linen", choices=["linen", "nnx"])
  args = ap.parse_args()

  import jax
  jax.config.update("jax_num_cpu_devices", args.local_devices)
  jax.config.update("jax_numpy_dtype_promotion", "strict")
  if "params-hpz" in args.shard.split(","):  # jaxring's topology: "local" is one process's devices
    import jaxring.distributed
    jaxring.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.num_processes,
                                   process_id=args.process_id)
  else:
    jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.num_processes,
                               process_id=args.process_id)
  for shard in args.shard.split(","):
    metrics, out = (a.replace("{shard}", shard) for a in (args.metrics, args.out))
    if args.api == "nnx":
      step, params = run_nnx(args.steps, metrics, shard)
    else:
      step, state = run(args.steps, metrics, shard)
      params = state.params
    assert step.num_replicas == args.num_processes * args.local_devices
    from jax.experimental import multihost_utils
    params = jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)),
                          params)  # split leaves: every process's blocks
    if jax.process_index() == 0:
      np.savez(out, **{"/".join(k): v for k, v in _flat(params)})
  print("DONE", flush=True)
  jax.distributed.shutdown()
  return 0


def _flat(tree, prefix=()):
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _flat(v, prefix + (k,))
    else:
      yield prefix + (k,), v


if __name__ == "__main__":
  sys.exit(main())
