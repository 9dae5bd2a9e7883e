"""``jaxring bench diloco-quality``: ``jaxring.diloco``'s test accuracy at equal steps against
synchronous data parallel, on ``bench tta``'s task and GroupNorm ResNet, over seeds.

8 members as 4 nodes x 2 devices (the emulated cluster's shape, in one process: no link is
timed, only quality), 16 images each a step, each member walking its shard of ``hard_shapes``
as ``bench tta``'s members do; momentum SGD (0.9) with a cosine from ``--lr`` to 0 over
``--steps``. Every contender is ``@jaxring.train_step`` on one ``("node", "local")`` mesh:

* ``synchronous``: each step's gradients averaged over all 8 members;
* ``diloco H=<H> <outer> warmup=<W>``: ``jaxring.diloco(that SGD, axis="node", every=H,
  outer=..., warmup_steps=W)`` with ``grad_axes="local"``; ``nesterov`` is DiLoCo's outer SGD
  (0.7, Nesterov momentum 0.9), ``average`` the outer SGD at 1 (post-local SGD's averaging).
  Evaluated on the outer parameters (``state.params``, the last sync's). ``--codec`` adds the
  pseudo-gradients' codec (with error feedback) to the name: ``int8``, ``topk`` (1% of 16-value
  chunks, SparseLoCo's sparsity) or ``none``; ``--decay`` the residual's (``residual_decay``;
  ``default``: the transformation's own).

Per contender: the mean, the seeds' figures and the gap to synchronous (points), seed by seed
(the same initialization and batches: the seeds' spread of several points is not in it). Prints
a table, writes ``benchmarks/results/diloco-quality.json``.

  jaxring bench diloco-quality                                # H=20, warm-up 300, 3 seeds
  jaxring bench diloco-quality --every 20,100 --outer average,nesterov --warmup 0,300
  jaxring bench diloco-quality --outer average,nesterov --codec none,topk --seeds 1
  jaxring bench diloco-quality --outer nesterov --warmup 0 --codec int8,topk --decay 1,0.9
"""
from __future__ import annotations

import argparse
import itertools
import time
from typing import NamedTuple

from jaxring._src.tools.bench import common

MOMENTUM = 0.9
OUTER = {"nesterov": (0.7, 0.9), "average": (1.0, 0.0)}
CODECS = ("none", "int8", "topk")


def codec_of(name: str):
  """The pseudo-gradients' codec a ``--codec`` name stands for (None: uncompressed)."""
  import jaxring as jr
  return {"none": None, "int8": jr.codecs.int8(),
          "topk": jr.codecs.topk_chunks(0.01, chunk_size=16, per_tensor=False)}[name]


class Contender(NamedTuple):
  name: str
  every: int | None    # None: synchronous
  outer: str | None
  warmup: int
  codec: str = "none"
  decay: float | None = None   # the residual's; None: diloco's default


def contenders(every, outers, warmups, codecs=("none",), decays=(None,)) -> list[Contender]:
  """Every contender, synchronous first; a decay only for a codec (the residual's)."""
  rows = [Contender("synchronous", None, None, 0)]
  for h, outer, w, c in itertools.product(every, outers, warmups, codecs):
    for d in decays if c != "none" else (None,):
      name = f"diloco H={h} {outer} warmup={w}" + (f" {c}" if c != "none" else "")
      rows.append(Contender(name + (f" decay={d:g}" if d is not None else ""), h, outer, w, c,
                            d))
  return rows


def train(every, outer, warmup, *, steps: int, lr: float, seed: int, data, mesh,
          batch: int = 16, model: str = "resnet_gn", codec: str = "none", decay=None):
  """The parameters after ``steps`` steps of one contender (``every`` None: synchronous): the
  outer ones for DiLoCo, as NumPy arrays."""
  import jax
  import numpy as np
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxring as jr
  from jaxring._src.tools.bench.convergence import learning_rate
  from jaxring._src.tools.bench.models import MODELS
  from jaxring._src.tools.bench.tta import Batches, _loss

  xtr, ytr = data[:2]
  init = MODELS[model][0]
  inner = optax.sgd(learning_rate(lr, "cosine", steps), momentum=MOMENTUM)
  kw = {}
  tx = inner
  if every is not None:
    rate, momentum = OUTER[outer]
    tx = jr.diloco(inner, axis="node", every=every, warmup_steps=warmup,
                   compression=codec_of(codec),
                   **({} if decay is None else {"residual_decay": decay}),
                   outer=optax.sgd(rate, momentum=momentum or None, nesterov=momentum > 0))
    kw["grad_axes"] = "local"

  @jr.train_step(mesh, axis_name=("node", "local"), **kw)
  def step(state, b):
    loss, grads = jr.value_and_grad(_loss)(state.params, b, model)
    return state.apply_gradients(grads=grads), {"loss": loss}

  members = mesh.devices.size
  batches = Batches(xtr, ytr, members, batch, list(range(members)),
                    NamedSharding(mesh, P(("node", "local"))))
  state = step.prepare(jr.TrainState.create(apply_fn=None, params=init(jax.random.key(seed)),
                                            tx=tx))
  for t in range(steps):
    state, _ = step(state, batches(t))
  return jax.tree.map(np.asarray, state.params)


def accuracy(params, data, model: str = "resnet_gn") -> float:
  """Test accuracy (%) of ``params`` (NaN where training diverged)."""
  import jax
  import numpy as np

  from jaxring._src.tools.bench.models import MODELS
  if not all(np.isfinite(p).all() for p in jax.tree.leaves(params)):
    return float("nan")
  logits = jax.jit(MODELS[model][1])(params, data[2])
  return float((np.asarray(logits).argmax(1) == data[3]).mean() * 100)


def row_of(contender: Contender, seeds, accs, base=None) -> dict:
  """A contender's row; ``base``: synchronous's, whose accuracies the gaps are paired with (by
  seed: the same initialization and batches, so the seeds' spread is not in them)."""
  import numpy as np
  gaps = [a - b for a, b in zip(accs, base["accuracy"])] if base else [0.0] * len(accs)
  row = contender._asdict()
  row["contender"] = row.pop("name")
  return {**row, "seeds": list(seeds), "accuracy": list(accs), "mean": float(np.mean(accs)),
          "gaps": gaps, "gap": float(np.mean(gaps))}


def run(args) -> list[dict]:
  import jax
  from jax.sharding import AxisType

  from jaxring._src.data.hard_shapes import hard_shapes
  if jax.device_count() < 8:
    raise SystemExit("jaxring bench diloco-quality: needs 8 devices; on a CPU run it with "
                     "XLA_FLAGS=--xla_force_host_platform_device_count=8")
  mesh = jax.make_mesh((4, 2), ("node", "local"), axis_types=(AxisType.Auto,) * 2)
  data = hard_shapes()
  seeds = range(args.first_seed, args.first_seed + args.seeds)
  rows = []
  decays = [None if d == "default" else float(d) for d in args.decay.split(",")]
  for c in contenders(_ints(args.every), args.outer.split(","), _ints(args.warmup),
                      args.codec.split(","), decays):
    t0 = time.perf_counter()
    accs = [accuracy(train(c.every, c.outer, c.warmup, steps=args.steps, lr=args.lr, seed=s,
                           data=data, mesh=mesh, codec=c.codec, decay=c.decay), data)
            for s in seeds]
    row = row_of(c, seeds, accs, rows[0] if rows else None)
    row["seconds"] = time.perf_counter() - t0
    print(f"  {c.name}: {row['mean']:.2f} ({', '.join(f'{a:.2f}' for a in accs)}), gap "
          f"{row['gap']:+.2f} points ({', '.join(f'{g:+.2f}' for g in row['gaps'])}), "
          f"{row['seconds']:.0f} s", flush=True)
    rows.append(row)
  return rows


def _ints(text: str) -> list[int]:
  return [int(v) for v in text.split(",") if v]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="jaxring bench diloco-quality", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--every", default="20", help="comma-separated H (inner steps a sync)")
  ap.add_argument("--outer", default="average", help=f"comma-separated, of {sorted(OUTER)}")
  ap.add_argument("--warmup", default="300", help="comma-separated synchronous steps first")
  ap.add_argument("--codec", default="none",
                  help=f"comma-separated pseudo-gradient codecs (error feedback), of {CODECS}")
  ap.add_argument("--decay", default="default",
                  help="comma-separated residual decays of the codecs' rows (default: diloco's)")
  ap.add_argument("--steps", type=int, default=3000)
  ap.add_argument("--lr", type=float, default=0.05, help="the cosine's peak")
  ap.add_argument("--seeds", type=int, default=3)
  ap.add_argument("--first-seed", type=int, default=0)
  ap.add_argument("--out-dir", default=None)
  args = ap.parse_args(argv)
  if bad := set(args.outer.split(",")) - set(OUTER):
    ap.error(f"--outer: unknown {sorted(bad)}; of {sorted(OUTER)}")
  if bad := set(args.codec.split(",")) - set(CODECS):
    ap.error(f"--codec: unknown {sorted(bad)}; of {list(CODECS)}")
  common.set_cpu_devices(8)
  rows = run(args)
  for r in rows:
    r["per_seed"] = " / ".join(f"{a:.2f}" for a in r["accuracy"])
    r["per_seed_gap"] = " / ".join(f"{g:+.2f}" for g in r["gaps"])
  common.print_table(rows, [("contender", "contender", ""), ("mean", "mean %", ".2f"),
                            ("per_seed", "seeds", ""), ("gap", "gap (points)", "+.2f"),
                            ("per_seed_gap", "per seed", "")])
  path = common.write_json("diloco-quality", {"machine": common.machine(),
                                              "commit": common.git_commit(),
                                              "args": vars(args), "rows": rows}, args.out_dir)
  print(f"wrote {path}")
  return 0
