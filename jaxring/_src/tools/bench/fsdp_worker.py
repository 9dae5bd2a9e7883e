"""Worker of ``jaxring bench fsdp`` on the emulated cluster (one process per node, JAX shape).

``--part collectives``: times gloo's ``lax.all_gather`` / ``lax.psum_scatter`` (tiled, over the
global (node, local) mesh) against jaxring's, uncompressed and with each codec on the node level,
on a buffer of ``--mib`` MiB of f32 per device (the gathered parameters, the scattered
gradients). Each result is checked against gloo's.
``--part train``: times one FSDP step (``train_step(shard="params")``) of an MLP whose
parameters are ``--mib`` MiB, uncompressed and with int8 weights + int8 gradients on the node
level, and the same forward + backward on this process's devices alone (compute, no network).

Contenders are timed in rounds (bench cluster's ``time_rounds``); lines ``JRB <json>``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from jaxring._src.tools.bench.cluster_worker import emit, time_rounds

AXES = ("node", "local")


def _mesh():
  from jax.sharding import Mesh

  import jaxring.distributed
  # the process mesh's devices (one row per process), with Auto axes as train_step expects
  return Mesh(jaxring.distributed.process_mesh(AXES).devices, AXES)


def _collectives(args, mesh, me):
  import jax
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxring
  p = mesh.devices.size
  n = args.mib * (1 << 20) // 4 // p * p
  per_proc = mesh.shape["local"]
  rng = np.random.default_rng(me)
  full = jax.make_array_from_process_local_data(
      NamedSharding(mesh, P(AXES)), rng.standard_normal((per_proc, n), dtype=np.float32))
  blocks = jax.make_array_from_process_local_data(
      NamedSharding(mesh, P(AXES)), rng.standard_normal((per_proc, n // p), dtype=np.float32))

  def make(op, kind, codec_name):
    codec = jaxring.codecs.parse(codec_name)
    comp = None if codec is None else {"node": codec}
    if op == "all_gather":
      body = ((lambda v: lax.all_gather(v[0], AXES, tiled=True)[None]) if kind == "gloo" else
              (lambda v: jaxring.all_gather(v[0], AXES, tiled=True, algorithm=kind,
                                            compression=comp)[None]))
      arg = blocks
    else:
      body = ((lambda v: lax.psum_scatter(v[0], AXES, tiled=True)[None]) if kind == "gloo" else
              (lambda v: jaxring.psum_scatter(v[0], AXES, tiled=True, algorithm=kind,
                                              compression=comp)[None]))
      arg = full
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES),
                              check_vma=False))
    return f, arg

  codecs = [c for c in args.codecs.split(",") if c]
  ready = []
  for op in ("all_gather", "psum_scatter"):
    ref = None
    contenders = [(f"gloo lax.{op}", "gloo", "none")] + [
        (f"jaxring {op} {a} {c}", a, c) for a in args.algorithms.split(",") for c in codecs
        if a != "ring" or c == "none"]
    for label, kind, codec_name in contenders:
      f, arg = make(op, kind, codec_name)
      y = jax.block_until_ready(f(arg))
      got = np.asarray(y.addressable_data(0), np.float64).reshape(-1)
      ref = got if ref is None else ref
      rel_err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
      ready.append((label, lambda f=f, a=arg: jax.block_until_ready(f(a)),
                    dict(op=op, codec=codec_name, rel_err=rel_err)))
  return ready


def _train(args, mesh, me):
  import jax
  import jax.numpy as jnp
  import optax
  from flax import linen as nn

  import jaxring
  import jaxring.train as jt
  width = args.width
  layers = max(1, args.mib * (1 << 20) // 4 // (width * width))

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(layers):
        x = nn.relu(nn.Dense(width)(x))
      return nn.Dense(16)(x)

  model = MLP()
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, width)))["params"]
  per_device = args.batch
  rng = np.random.default_rng(0)
  x = rng.standard_normal((mesh.devices.size * per_device, width)).astype(np.float32)
  batch = {"x": x, "y": (x[:, :16].argmax(1)).astype(np.int32)}
  lo = me * mesh.shape["local"] * per_device
  local_batch = {k: v[lo:lo + mesh.shape["local"] * per_device] for k, v in batch.items()}

  def loss_fn(p, b, apply_fn):
    logits = apply_fn({"params": p}, b["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  def make_step(compression, hpz):
    @jt.train_step(mesh, axis_name=AXES, shard="params", algorithm=args.algorithm,
                   compression=compression, hpz=hpz)
    def step(state, b):
      loss, grads = jt.value_and_grad(lambda p: loss_fn(p, b, state.apply_fn))(state.params)
      return state.apply_gradients(grads=grads), {"loss": loss}
    return step

  int8 = {"node": jaxring.codecs.int8()}
  ready = []
  both = {"params": int8, "grads": int8}
  for label, comp, hpz in (("fsdp uncompressed", None, False),
                           ("fsdp int8 weights + int8 grads", both, False),
                           ("fsdp hpz uncompressed", None, True),
                           ("fsdp hpz int8 weights + int8 grads", both, True)):
    step = make_step(comp, hpz)
    holder = {"state": step.prepare(jt.TrainState.create(apply_fn=model.apply, params=params,
                                                         tx=optax.sgd(1e-3, momentum=0.9)))}

    def call(step=step, holder=holder):
      # the whole step, not only its metrics: with two programs in flight at once, XLA:CPU can
      # run a device's part of one while its peers wait for it in the other (a deadlock)
      holder["state"], m = step(holder["state"], local_batch)
      jax.block_until_ready((holder["state"], m))
    call()
    ready.append((label, call, dict(params_mib=sum(v.size for v in jax.tree.leaves(params)) * 4
                                    / (1 << 20), layers=layers, width=width)))
  # compute alone: the same forward + backward on this process's devices, no collective
  local = jax.local_devices()[0]
  grad = jax.jit(jax.grad(lambda p, b: loss_fn(p, b, model.apply)), device=local)
  one = {k: v[:per_device] for k, v in batch.items()}
  jax.block_until_ready(grad(params, one))
  t = []
  for _ in range(args.reps):
    t0 = time.perf_counter()
    jax.block_until_ready(grad(params, one))
    t.append(time.perf_counter() - t0)
  emit(contender="compute only (one device, forward + backward)", node=me, rank=me, times=t,
       median=statistics.median(t), tx_per_call=0)
  return ready


def main(argv=None) -> int:
  from jaxring._src.codecs.base import grammar, sweep
  ap = argparse.ArgumentParser()
  ap.add_argument("--part", choices=("collectives", "train"), required=True)
  ap.add_argument("--mib", type=int, default=32)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--codecs", default=",".join(sweep(per_hop=True)),
                  help=f"collectives: node-level codecs, comma-separated, run hop by hop "
                  f"(default %(default)s); spellings: {grammar()}")
  ap.add_argument("--algorithms", default="hierarchical,ring")
  ap.add_argument("--algorithm", default="hierarchical", help="train: the step's algorithm")
  ap.add_argument("--width", type=int, default=1024, help="train: the MLP's width")
  ap.add_argument("--batch", type=int, default=32, help="train: examples per device")
  args = ap.parse_args(argv)
  import jaxring.distributed
  jaxring.distributed.initialize()
  import jax
  me = jax.process_index()
  mesh = _mesh()
  ready = (_collectives if args.part == "collectives" else _train)(args, mesh, me)
  for _, call, _ in ready:
    for _ in range(max(0, args.warmup - 1)):
      call()
  import os
  iface = os.environ.get("JAXRING_INTERFACE", "jreth0")
  barrier = lambda name: jaxring.distributed.barrier(name, timeout_s=300)
  for label, times, tx, extra in time_rounds(ready, args, barrier, iface):
    emit(contender=label, node=me, rank=me, times=times, median=statistics.median(times),
         tx_per_call=tx, **extra)
  jaxring.distributed.barrier("done", timeout_s=120)
  return 0


if __name__ == "__main__":
  sys.exit(main())
