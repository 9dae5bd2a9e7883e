"""``jaxring bench convergence``: test accuracy after a fixed step budget, per optimizer and codec.

Task ``digits``: a 64-64-10 MLP on scikit-learn's bundled digits (1440 training, 357 test
images), trained full-batch and data-parallel on 8 members (180 images each). Task ``shapes``: a
small ResNet (``--model resnet``, the default) or a small CNN (``--model cnn``) on
``hard_shapes`` (jaxring._src.data.hard_shapes: 16 classes, 16384 training images with 10% label
noise, 1024 clean test images), 16 images per member a step. A digits run is one ``shard_map`` +
``lax.scan``; a shapes run one jitted ``shard_map`` call per step. For every optimizer it trains
uncompressed, then per codec:

* ``EF``: ``optax.chain(jr.reduce_gradients(axis, compression=c), <optimizer>)``, the composition
  people write (with top-k it needs ``plain_sgd_after=True`` to be built at all: measured here
  to show why);
* ``no EF``: the same without error feedback;
* ``supported``: what jaxring supports for that optimizer and codec
  (:func:`supported_optimizer`): the EF composition for dense codecs and plain SGD, momentum
  correction (momentum, Nesterov) or compressed Adam (Adam, AdamW) for top-k.

Every member must end with the same parameters (checked). Prints a table and writes JSON under
benchmarks/results/.

  jaxring bench convergence                       # digits, 5 optimizers x 3 codecs (~3 min)
  jaxring bench convergence --optimizers momentum,adam --codecs topk --seeds 3
  jaxring bench convergence --task shapes --optimizers momentum,adamw --modes ""   # the hard task
"""
from __future__ import annotations

import argparse
import time

from jaxring._src.tools.bench.models import MODELS

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw", "lamb")
LEARNING_RATES = {"sgd": 0.5, "momentum": 0.05, "nesterov": 0.05, "adam": 1e-3, "adamw": 1e-3,
                  "lamb": 5e-3}
WEIGHT_DECAY = 1e-4   # AdamW and LAMB (decoupled)
MOMENTUM = 0.9
ALGORITHM = "ring"    # the codecs' ring, also where "auto" would pick XLA's all-reduce (no codec)


def codec_of(name: str, chunk_size: int, per_tensor: bool = True):
  from jaxring import codecs
  if name in ("none", ""):
    return None
  if name == "topk":
    return codecs.topk_chunks(0.01, chunk_size=chunk_size, per_tensor=per_tensor)
  return codecs.parse(name)


def plain_optimizer(name: str, lr: float):
  import optax
  if name == "sgd":
    return optax.sgd(lr)
  if name in ("momentum", "nesterov"):
    return optax.sgd(lr, momentum=MOMENTUM, nesterov=name == "nesterov")
  if name == "adam":
    return optax.adam(lr)
  if name == "adamw":
    return optax.adamw(lr, weight_decay=WEIGHT_DECAY)
  if name == "lamb":
    return optax.lamb(lr, eps=1e-8, weight_decay=WEIGHT_DECAY)
  raise ValueError(f"unknown optimizer {name!r}; one of {OPTIMIZERS}")


def naive_optimizer(name, lr, axis, codec, error_feedback: bool):
  """``optax.chain(jr.reduce_gradients(...), <optimizer>)``, whatever the codec."""
  import optax

  import jaxring as jr
  return optax.chain(jr.reduce_gradients(axis, algorithm=ALGORITHM, compression=codec,
                                         error_feedback=error_feedback, plain_sgd_after=True),
                     plain_optimizer(name, lr))


def supported_optimizer(name, lr, axis, codec, *, warmup_steps: int = 0, adam_warmup: int = 100,
                        adam_variance_every: int = 5, clip_norm: float | str | None = "auto",
                        warmup_density: float = 0.25, masking: str = "flush"):
  """The composition jaxring supports for optimizer ``name`` over ``codec`` (see the README)."""
  import jaxring as jr
  return jr.compressed_optimizer(name, lr, axis, compression=codec, algorithm=ALGORITHM,
                                 momentum=MOMENTUM,
                                 weight_decay=WEIGHT_DECAY if name in ("adamw", "lamb") else 0.0,
                                 warmup_steps=warmup_steps, warmup_density=warmup_density,
                                 adam_warmup_steps=adam_warmup,
                                 adam_variance_every=adam_variance_every, clip_norm=clip_norm,
                                 masking=masking)


def lamb_candidate(lr, axis, codec, adam_warmup: int, adam_variance_every: int):
  """LAMB over a sparsifying codec as 1-bit LAMB would build it, which ``compressed_optimizer``
  refuses (measured short of the goal): compressed Adam, decoupled decay, the trust ratio frozen
  after the exact warm-up."""
  import optax

  import jaxring as jr
  from jaxring._src.optim.lamb import frozen_trust_ratio
  return optax.chain(jr.compressed_adam(axis, compression=codec, warmup_steps=adam_warmup,
                                        algorithm=ALGORITHM, variance_every=adam_variance_every),
                     optax.add_decayed_weights(WEIGHT_DECAY), frozen_trust_ratio(adam_warmup),
                     optax.scale_by_learning_rate(lr))


def digits(train: int = 1440):
  import numpy as np

  from jaxring._src.extras import require
  datasets = require("sklearn.datasets", "test", "the digits task needs scikit-learn")
  d = datasets.load_digits()
  perm = np.random.RandomState(0).permutation(len(d.target))
  x = (d.data[perm] / 16.0).astype(np.float32)
  y = d.target[perm].astype(np.int32)
  return x[:train], y[:train], x[train:], y[train:]


def init_mlp(key, hidden: int = 64):
  import jax
  import jax.numpy as jnp
  import numpy as np
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (64, hidden)) / 8.0, "b1": jnp.zeros(hidden),
          "w2": jax.random.normal(k2, (hidden, 10)) / np.sqrt(hidden), "b2": jnp.zeros(10)}


def mlp_logits(params, x):
  import jax
  return jax.nn.relu(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def train_digits(tx, steps: int, data=None, seed: int = 0):
  """Trains the MLP with ``tx`` (an optax chain that reduces over axis ``"d"``) on 8 members;
  returns (test accuracy in %, final parameters)."""
  import jax
  import numpy as np
  import optax
  from jax import lax
  from jax.sharding import PartitionSpec as P

  xtr, ytr, xte, yte = data if data is not None else digits()

  def loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(mlp_logits(params, x), y).mean()

  def body(params, xs, ys):
    params = jax.tree.map(lambda v: lax.pcast(v, "d", to="varying"), params)
    state = tx.init(params)

    def step(carry, _):
      params, state = carry
      updates, state = tx.update(jax.grad(loss)(params, xs, ys), state, params)
      return (optax.apply_updates(params, updates), state), None

    (params, _), _ = lax.scan(step, (params, state), None, length=steps)
    return jax.tree.map(lambda v: v[None], params)

  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=P("d")))
  out = f(init_mlp(jax.random.key(seed)), xtr, ytr)
  if not _replicas_agree(out):
    return float("nan"), None
  params = jax.tree.map(lambda v: np.asarray(v[0]), out)
  acc = float((np.asarray(mlp_logits(params, xte)).argmax(1) == yte).mean() * 100)
  return acc, params


def _replicas_agree(out) -> bool:
  """Whether every member ended with the same parameters; False (reported as accuracy NaN) when
  training diverged to NaN or Inf; an AssertionError when finite replicas differ (a defect)."""
  import jax
  import numpy as np
  leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(out)]
  if not all(np.isfinite(leaf).all() for leaf in leaves):
    print("  diverged: non-finite parameters (reported as NaN)", flush=True)
    return False
  for leaf in leaves:
    if not (leaf[1:] == leaf[:1]).all():
      raise AssertionError("members ended with different parameters")
  return True


def train_shapes(tx, steps: int, data, batch: int = 16, seed: int = 0, model: str = "resnet",
                 return_params: bool = False):
  """Trains ``model`` (``MODELS``) on ``hard_shapes`` with ``tx`` (reducing over ``"d"``), 8
  members of ``batch`` images a step each (a cyclic walk through each member's shard); returns
  test accuracy in % (and the final parameters, one row per member, if ``return_params``).

  One jitted ``shard_map`` call per step, not a ``lax.scan`` over the steps: XLA:CPU runs a
  convolution step inside a while loop about 25x slower than the same step called on its own
  (jax 0.10.2: 0.84 against 0.033 s for this ResNet's gradient at batch 128). The state crosses
  the calls as global arrays: a leaf typed varying over ``"d"`` (a member's residual or velocity)
  one row per member, an invariant one (a step count) replicated, as ``tx.init`` typed it.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax import lax
  from jax.sharding import PartitionSpec as P

  from jaxring._src.vma import is_varying, pvary

  xtr, ytr, xte, yte = data
  init, logits_fn = MODELS[model]
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

  def loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, x), y).mean()

  def varying(params):
    return jax.tree.map(lambda v: lax.pcast(v, "d", to="varying"), params)

  def spec_of(v):
    return P("d") if is_varying(v, ("d",)) else P()

  def export(tree, specs):   # a member's values -> the global arrays of out_specs ``specs``
    return jax.tree.map(lambda v, s: v[None] if s == P("d") else v, tree, specs)

  def local(tree, specs):
    return jax.tree.map(lambda v, s: v[0] if s == P("d") else v, tree, specs)

  params0 = init(jax.random.key(seed))
  found = {}

  def probe(params):   # traced once (eval_shape): how tx.init types each state leaf
    state = tx.init(varying(params))
    found["state"] = jax.tree.map(spec_of, state)
    return jax.tree.map(lambda v: pvary(v, ("d",))[None], state)

  jax.eval_shape(jax.shard_map(probe, mesh=mesh, in_specs=(P(),), out_specs=P("d")), params0)
  state_specs = found["state"]
  pspecs = jax.tree.map(lambda _: P("d"), params0)

  def start(params):
    params = varying(params)
    return export(params, pspecs), export(tx.init(params), state_specs)

  def step(params, state, xs, ys, t):
    params, state = local(params, pspecs), local(state, state_specs)
    i = (t % (xs.shape[0] // batch)) * batch
    x = lax.dynamic_slice_in_dim(xs, i, batch)
    y = lax.dynamic_slice_in_dim(ys, i, batch)
    updates, state = tx.update(jax.grad(loss)(params, x, y), state, params)
    return export(optax.apply_updates(params, updates), pspecs), export(state, state_specs)

  start = jax.jit(jax.shard_map(start, mesh=mesh, in_specs=(P(),),
                                out_specs=(pspecs, state_specs)))
  step = jax.jit(jax.shard_map(step, mesh=mesh,
                               in_specs=(pspecs, state_specs, P("d"), P("d"), P()),
                               out_specs=(pspecs, state_specs)), donate_argnums=(0, 1))
  params, state = start(params0)
  xtr, ytr = jax.device_put((xtr, ytr), jax.sharding.NamedSharding(mesh, P("d")))
  for t in range(steps):
    params, state = step(params, state, xtr, ytr, jnp.int32(t))
  acc = float("nan")
  if _replicas_agree(params):
    logits = jax.jit(logits_fn)(jax.tree.map(lambda v: v[0], params), xte)
    acc = float((np.asarray(logits).argmax(1) == yte).mean() * 100)
  return (acc, params) if return_params else acc


TASKS = {
    # task: (default steps, learning rates, top-k chunk size, compressed Adam's warm-up)
    "digits": (300, LEARNING_RATES, 16, 100),
    "shapes": (1200, {"sgd": 0.5, "momentum": 0.1, "nesterov": 0.1, "adam": 3e-3,
                      "adamw": 3e-3}, 16, 300),
}
# the small ResNet (no normalization) diverges with momentum at 0.05 and above; at 0.03 plain
# training reaches 86.6% in 1200 steps (and AdamW at 3e-3 87.7%)
MODEL_RATES = {("shapes", "resnet"): {"momentum": 0.03, "nesterov": 0.03}}


SCHEDULES = ("constant", "cosine")


def learning_rate(peak: float, schedule: str, steps: int):
  """``peak`` held (``constant``) or decayed to 0 along a cosine over ``steps`` (``cosine``).

  A constant rate leaves the shapes task's models mid-climb at the end of the budget: test
  accuracy still moves by points from one 100 steps to the next. A cosine to 0 ends on a flat
  stretch (measured: within 0.2 points over the last 400 of 3600 steps). It does not remove
  the spread between seeds (up to 7.5 points uncompressed, docs/benchmarks.md), so read a gap
  over several seeds."""
  import optax
  if schedule == "constant":
    return peak
  if schedule == "cosine":
    return optax.cosine_decay_schedule(peak, steps)
  raise ValueError(f"unknown schedule {schedule!r}; one of {SCHEDULES}")


def run(task: str, optimizers, codecs, steps: int, chunk_size: int, warmup_steps: int,
        adam_warmup: int, adam_variance_every: int, seeds: int = 1, modes=("EF", "no EF"),
        model: str = "resnet", clip_norm: float | str | None = "auto",
        lr_override: float | None = None,
        warmup_density: float = 0.25, masking: str = "flush",
        schedule: str = "constant", per_tensor: bool = True,
        first_seed: int = 0) -> list[dict]:
  import numpy as np
  if task == "digits":
    data = digits()
    train = lambda tx, seed: train_digits(tx, steps, data, seed)[0]  # noqa: E731
  else:
    from jaxring._src.data.hard_shapes import hard_shapes
    data = hard_shapes()
    train = lambda tx, seed: train_shapes(tx, steps, data, seed=seed, model=model)  # noqa: E731
  rates = {**TASKS[task][1], **MODEL_RATES.get((task, model), {})}
  rows = []

  def measure(make):
    runs = [train(make(), seed) for seed in range(first_seed, first_seed + seeds)]
    if seeds > 1:   # the spread between seeds is the scale any gap is read against
      print("    seeds: " + ", ".join(f"{a:.2f}" for a in runs), flush=True)
    return float(np.mean(runs))

  for name in optimizers:
    peak = rates[name] if lr_override is None else lr_override
    lr = learning_rate(peak, schedule, steps)
    t0 = time.perf_counter()
    row = {"optimizer": name, "lr": peak, "schedule": schedule,
           "none": measure(lambda: supported_optimizer(name, lr, "d", None))}
    for cname in codecs:
      codec = codec_of(cname, chunk_size, per_tensor)
      if "EF" in modes:
        row[f"{cname} EF"] = measure(lambda: naive_optimizer(name, lr, "d", codec, True))
      if "no EF" in modes:
        row[f"{cname} no EF"] = measure(lambda: naive_optimizer(name, lr, "d", codec, False))
      try:
        row[f"{cname} supported"] = measure(lambda: supported_optimizer(
            name, lr, "d", codec, warmup_steps=warmup_steps, adam_warmup=adam_warmup,
            adam_variance_every=adam_variance_every, clip_norm=clip_norm,
            warmup_density=warmup_density, masking=masking))
      except ValueError as e:   # refused (LAMB over top-k): measure the candidate it refuses
        row[f"{cname} supported"] = None
        row[f"{cname} refused candidate"] = measure(lambda: lamb_candidate(
            lr, "d", codec, adam_warmup, adam_variance_every))
        print(f"  {name} over {cname}: {e}; the candidate (compressed Adam + frozen trust "
              f"ratio): {row[f'{cname} refused candidate']:.2f}", flush=True)
    row["seconds"] = time.perf_counter() - t0
    print(f"  {name}: done in {row['seconds']:.0f} s: " + ", ".join(
        f"{k} {v:.2f}" for k, v in row.items() if isinstance(v, float) and k not in
        ("lr", "seconds")), flush=True)   # each row as it ends: a later crash loses no result
    rows.append(row)
  return rows


def _clip_norm(text: str) -> float | str | None:
  if text in ("auto", "none"):
    return None if text == "none" else text
  value = float(text)
  if not value > 0:
    raise argparse.ArgumentTypeError(f"a positive norm, 'auto' or 'none', got {text!r}")
  return value


def main(argv=None) -> int:
  from jaxring._src.codecs.base import grammar, sweep
  parser = argparse.ArgumentParser(prog="jaxring bench convergence", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--task", default="digits", choices=sorted(TASKS),
                      help="digits (MLP, full batch) or shapes (hard_shapes, --model)")
  parser.add_argument("--model", default="resnet", choices=sorted(MODELS),
                      help="the shapes task's model")
  parser.add_argument("--clip-norm", type=_clip_norm, default="auto",
                      help="momentum correction's local gradient clipping: 'auto' (default: "
                           "twice each member's running norm), a norm, or 'none'")
  parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
  parser.add_argument("--codecs", default=",".join(c for c in sweep() if c != "none"),
                      help=f"codecs, comma-separated, each against the uncompressed run "
                      f"(default %(default)s; topk: 1%%); spellings: {grammar()}")
  parser.add_argument("--steps", type=int, default=0, help="0: the task's default")
  parser.add_argument("--chunk-size", type=int, default=0,
                      help="top-k chunk size (0: the task's, 16: 1%% of digits' is 4 chunks)")
  parser.add_argument("--warmup-steps", type=int, default=0, help="top-k density warm-up")
  parser.add_argument("--warmup-density", type=float, default=0.25,
                      help="the warm-up's first density (1: dense, then falling by 4x)")
  parser.add_argument("--lr", type=float, default=0.0,
                      help="one learning rate for every optimizer (0: the task's table)")
  parser.add_argument("--adam-warmup", type=int, default=0,
                      help="compressed Adam's exact steps (0: the task's default)")
  parser.add_argument("--adam-variance-every", type=int, default=5,
                      help="compressed Adam's exact variance refresh interval (0: frozen)")
  parser.add_argument("--modes", default="EF,no EF",
                      help="naive compositions to run besides the supported one")
  parser.add_argument("--masking", default="flush",
                      choices=("flush", "zero", "none"),
                      help="momentum correction's rule for the velocity of sent chunks")
  parser.add_argument("--global-topk", dest="per_tensor", action="store_false",
                      help="top-k: the largest chunks of the whole buffer "
                      "(topk_chunks(per_tensor=False)), not each tensor's share")
  parser.add_argument("--schedule", default="constant", choices=SCHEDULES,
                      help="the learning rate over the run: held, or a cosine decay to 0")
  parser.add_argument("--seeds", type=int, default=1, help="average over this many inits")
  parser.add_argument("--first-seed", type=int, default=0, help="the first of --seeds seeds")
  parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
  args = parser.parse_args(argv)

  from jaxring._src.tools.bench import common
  common.set_cpu_devices(8)
  default_steps, _, default_chunk, default_adam = TASKS[args.task]
  steps = args.steps or default_steps
  chunk = args.chunk_size or default_chunk
  adam_warmup = args.adam_warmup or default_adam
  optimizers = [o for o in args.optimizers.split(",") if o]
  codecs = [c for c in args.codecs.split(",") if c]
  modes = [m.strip() for m in args.modes.split(",") if m.strip()]
  what = ("digits MLP, full batch" if args.task == "digits"
          else f"hard_shapes small {args.model}, 16 images per member")
  print(f"{what}, 8 members, {steps} steps, {args.schedule} learning rate; top-k: 1% of "
        f"{chunk}-value chunks; compressed Adam: {adam_warmup} exact steps, variance every "
        f"{args.adam_variance_every}; test accuracy (%)", flush=True)
  rows = run(args.task, optimizers, codecs, steps, chunk, args.warmup_steps, adam_warmup,
             args.adam_variance_every, args.seeds, modes, args.model, args.clip_norm,
             lr_override=args.lr or None, warmup_density=args.warmup_density,
             masking=args.masking, schedule=args.schedule, per_tensor=args.per_tensor,
             first_seed=args.first_seed)
  cols = [("optimizer", "optimizer", "s"), ("none", "none", ".2f")]
  for c in codecs:
    cols += [(f"{c} {m}", f"{c} {m}", ".2f") for m in modes]
    cols.append((f"{c} supported", f"{c} supported", ".2f"))
  common.print_table(rows, cols)
  path = common.write_json("convergence", {
      "benchmark": "convergence", "task": args.task, "steps": steps, "chunk_size": chunk,
      "model": args.model if args.task == "shapes" else "mlp", "clip_norm": args.clip_norm,
      "warmup_steps": args.warmup_steps, "masking": args.masking, "adam_warmup": adam_warmup,
      "adam_variance_every": args.adam_variance_every, "seeds": args.seeds,
      "first_seed": args.first_seed, "per_tensor": args.per_tensor,
      "schedule": args.schedule, "rows": rows,
      "machine": common.machine()}, args.out)
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
