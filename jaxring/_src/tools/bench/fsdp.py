"""``jaxring bench fsdp``: what sharding the train state costs and saves.

``memory`` (this machine, emulated CPU devices): bytes per device of the parameters, optimizer
state and error-feedback residuals, and the compiled step's peak, for ``shard="none"``,
``"optimizer"`` and ``"params"``, for an MLP of ResNet-50's size (``--width`` 2048 x
``--layers`` 6: 25.2 M parameters) trained with AdamW.

``collectives`` and ``train`` (the emulated cluster; root): jaxring's all-gather and
reduce-scatter against gloo's ``lax.all_gather`` / ``lax.psum_scatter`` on the same links,
uncompressed and with each codec on the node level; one FSDP step of an MLP uncompressed and with
int8 weights + int8 gradients, each with and without hpZ (``hpz=True``: the backward pass
gathers within the node), beside its compute alone. JAX shape: one process per node.

``accuracy`` (this machine): test accuracy on the harder generated image task, replicated and
fully sharded, uncompressed and with int8 weights + int8 gradients.

  $ jaxring bench fsdp --parts memory,accuracy,collectives,train --link 1gbit
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

from jaxring._src.tools.bench import common

WORKER = "jaxring._src.tools.bench.fsdp_worker"


def _memory(args) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import optax
  from flax import linen as nn

  import jaxring.train as jt
  width, layers = args.width, args.layers

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(layers):
        x = nn.relu(nn.LayerNorm()(nn.Dense(width)(x)))
      return nn.Dense(1000)(x)

  model = MLP()
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, width)))["params"]
  n = jax.device_count()
  batch = {"x": jnp.zeros((n * 4, width)), "y": jnp.zeros((n * 4,), jnp.int32)}
  rows = []
  for shard in ("none", "optimizer", "params"):
    @jt.train_step(shard=shard)
    def step(state, b):
      def loss_fn(p):
        logits = state.apply_fn({"params": p}, b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()
      loss, grads = jt.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), {"loss": loss}
    state = jt.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))
    with jax.numpy_dtype_promotion("standard"):
      rows.append(dict(shard=shard, devices=n, **step.memory(state, batch)))
  full = rows[0]
  for r in rows:
    r["opt_state_share"] = r["opt_state"] / full["opt_state"]
    r["state_share"] = (r["params"] + r["opt_state"]) / (full["params"] + full["opt_state"])
    r["peak_share"] = r["step_peak"] / full["step_peak"]
  return rows


def _accuracy(args) -> list[dict]:
  """Test accuracy on the harder generated image task (jaxring._src.data.hard_shapes, the small
  CNN of ``jaxring bench convergence``, its learning rate) after the same steps, replicated and
  fully sharded, uncompressed and with int8 weights + int8 gradients (error feedback), momentum
  SGD, 16 random images per device a step."""
  import jax
  import numpy as np
  import optax

  import jaxring
  import jaxring.train as jt
  from jaxring._src.data.hard_shapes import hard_shapes
  from jaxring._src.tools.bench.convergence import TASKS
  from jaxring._src.tools.bench.models import MODELS
  xtr, ytr, xte, yte = hard_shapes()
  init, logits_fn = MODELS[args.model]
  n = jax.device_count()
  per = args.batch_per_device * n
  lr = TASKS["shapes"][1]["momentum"]
  int8 = jaxring.codecs.int8()
  rows = []
  for label, shard, comp, algorithm in (
      ("replicated, uncompressed", "none", None, "auto"),
      ("fsdp, uncompressed", "params", None, "auto"),
      ("fsdp, int8 weights + int8 grads", "params", {"params": int8, "grads": int8}, "ring")):
    @jt.train_step(shard=shard, compression=comp, algorithm=algorithm)
    def step(state, b):
      def loss_fn(p):
        return optax.softmax_cross_entropy_with_integer_labels(logits_fn(p, b["x"]),
                                                               b["y"]).mean()
      loss, grads = jt.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), {"loss": loss}
    state = jt.TrainState.create(apply_fn=None, params=init(jax.random.key(0)),
                                 tx=optax.sgd(lr, momentum=0.9))
    rng = np.random.default_rng(0)
    for _ in range(args.steps):
      idx = rng.integers(0, len(xtr), per)
      state, metrics = step(state, {"x": xtr[idx], "y": ytr[idx]})
    logits = jax.jit(logits_fn)(state.params, xte)
    acc = float((np.asarray(logits).argmax(1) == yte).mean() * 100)
    rows.append({"contender": label, "steps": args.steps, "test_accuracy": acc,
                 "final_loss": float(metrics["loss"])})
    print(f"  {label}: {acc:.2f}% after {args.steps} steps (last loss "
          f"{float(metrics['loss']):.3f})", flush=True)
  return rows


def _cluster(args) -> tuple[list[dict], dict]:
  """Each cluster part on a cluster of its own link rate, made and deleted here."""
  from jaxring._src.tools.bench.cluster import _run_job
  from jaxring._src.tools.cluster import netns
  name = "jrf"
  rows, info = [], {"nodes": args.nodes, "devices_per_node": args.devices_per_node}
  for part in [p for p in ("collectives", "train") if p in args.parts]:
    link = args.link if part == "collectives" else args.train_link
    if netns.load_state(name) is not None:
      netns.down(name)
    try:
      state = netns.up(name, args.nodes, rate=link)
      info[part] = {"link": link, "bandwidth_bytes_per_s": state.bandwidth,
                    "quickack": state.quickack}
      worker_args = ["--part", part, "--reps", str(args.reps), "--warmup", str(args.warmup),
                     "--mib", str(args.mib if part == "collectives" else args.train_mib),
                     "--codecs", args.codecs]
      rc, recs, log = _run_job(name, args.nodes, 1, args.devices_per_node, "jax", worker_args,
                               args.timeout, worker=WORKER)
      if rc != 0 or not recs:
        print(f"--- {part}: exit {rc}; last output:\n" + "\n".join(log.splitlines()[-30:]),
              file=sys.stderr)
      rows += [dict(r, link=link) for r in _summarize(part, recs)]
    finally:
      netns.down(name)
  return rows, info


def _summarize(part: str, recs: list[dict]) -> list[dict]:
  by: dict[str, list[dict]] = {}
  for r in recs:
    by.setdefault(r["contender"], []).append(r)
  rows = []
  for label, rs in by.items():
    r0 = min(rs, key=lambda r: r["node"])
    if "error" in r0:
      rows.append({"part": part, "contender": label, "error": r0["error"]})
      continue
    rows.append({"part": part, "contender": label, "op": r0.get("op"),
                 "ms": statistics.median(r0["times"]) * 1e3,
                 "ms_max_node": max(statistics.median(r["times"]) for r in rs) * 1e3,
                 "tx_mib": statistics.mean(r["tx_per_call"] for r in rs) / (1 << 20),
                 "rel_err": r0.get("rel_err"), "times_ms": [t * 1e3 for t in r0["times"]],
                 **{k: r0[k] for k in ("params_mib", "layers", "width") if k in r0}})
  for op in ("all_gather", "psum_scatter"):
    base = next((r["ms"] for r in rows if r.get("op") == op and r["contender"].startswith("gloo")
                 and "ms" in r), None)
    for r in rows:
      if base and r.get("op") == op and "ms" in r:
        r["vs_gloo"] = r["ms"] / base
  fsdp = next((r["ms"] for r in rows if r["contender"] == "fsdp uncompressed" and "ms" in r),
              None)
  for r in rows:
    if fsdp and r["contender"].startswith(("fsdp", "compute")) and "ms" in r:
      r["vs_uncompressed_fsdp"] = r["ms"] / fsdp
  return rows


def main(argv=None) -> int:
  from jaxring._src.codecs.base import grammar, sweep
  ap = argparse.ArgumentParser(prog="jaxring bench fsdp", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--parts", default="memory,accuracy,collectives,train")
  ap.add_argument("--devices", type=int, default=8, help="memory: emulated CPU devices")
  ap.add_argument("--width", type=int, default=2048, help="memory: the MLP's width")
  ap.add_argument("--layers", type=int, default=6, help="memory: the MLP's hidden layers")
  ap.add_argument("--steps", type=int, default=1200, help="accuracy: training steps")
  ap.add_argument("--batch-per-device", type=int, default=16, help="accuracy")
  ap.add_argument("--model", default="cnn", help="accuracy: cnn or resnet (bench convergence's)")
  ap.add_argument("--nodes", type=int, default=4)
  ap.add_argument("--devices-per-node", type=int, default=2)
  ap.add_argument("--link", default="1gbit", help="collectives: every node link's rate")
  ap.add_argument("--train-link", default="100mbit",
                  help="train: a rate at which the uncompressed FSDP step is network-bound")
  ap.add_argument("--mib", type=int, default=32, help="collectives: f32 MiB per device")
  ap.add_argument("--train-mib", type=int, default=32, help="train: the MLP's parameter MiB")
  ap.add_argument("--codecs", default=",".join(sweep(per_hop=True)),
                  help=f"collectives: node-level codecs, comma-separated, run hop by hop "
                  f"(default %(default)s); spellings: {grammar()}")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--timeout", type=float, default=900)
  ap.add_argument("--out-dir", default=None)
  args = ap.parse_args(argv)
  args.parts = [p for p in args.parts.split(",") if p]
  result: dict = {"parts": args.parts}
  if "memory" in args.parts:
    common.set_cpu_devices(args.devices)
    rows = _memory(args)
    print(f"\nper-device bytes, MLP {args.layers} x {args.width}, {args.devices} devices, "
          "AdamW (compiled step: jax memory_analysis)")
    common.print_table([dict(r, **{k: r[k] / (1 << 20) for k in
                                   ("params", "opt_state", "residuals", "step_peak")})
                        for r in rows], [
        ("shard", "shard", ""), ("params", "params MiB", ".1f"),
        ("opt_state", "opt state MiB", ".1f"), ("opt_state_share", "opt/replicated", ".3f"),
        ("state_share", "params+opt/replicated", ".3f"), ("step_peak", "step peak MiB", ".1f"),
        ("peak_share", "peak/replicated", ".3f")])
    result["memory"] = rows
  if "accuracy" in args.parts:
    common.set_cpu_devices(args.devices)
    rows = _accuracy(args)
    common.print_table(rows, [("contender", "contender", ""), ("steps", "steps", "d"),
                              ("test_accuracy", "test accuracy %", ".2f"),
                              ("final_loss", "last loss", ".3f")])
    result["accuracy"] = rows
  if {"collectives", "train"} & set(args.parts):
    if os.geteuid() != 0:
      print("jaxring bench fsdp: cluster parts skipped: need root (network namespaces, tc)",
            file=sys.stderr)
    else:
      rows, info = _cluster(args)
      result.update(cluster=info, cluster_rows=rows)
      print(f"\n{args.nodes} nodes x {args.devices_per_node} devices, one process per node "
            "(median ms of node 0; ratios side by side in one run)")
      common.print_table(rows, [
          ("contender", "contender", ""), ("link", "link", ""), ("ms", "ms", ".1f"),
          ("vs_gloo", "vs gloo", ".3f"),
          ("vs_uncompressed_fsdp", "vs uncompressed FSDP", ".3f"),
          ("tx_mib", "tx MiB/node", ".1f"), ("rel_err", "rel err", ".1e"),
          ("error", "error", "")])
  result["machine"] = common.machine()
  path = common.write_json("fsdp", result, args.out_dir)
  print(f"\nwrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
