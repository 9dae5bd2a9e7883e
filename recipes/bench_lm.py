"""The LM recipe replicated and fully sharded, uncompressed and with int8 weights and gradients:
final loss after the same steps and the bytes each device holds. Prints a table, writes JSON.

Rows (the same config, seed and batches): ``shard=none`` and ``shard=params``, each uncompressed
and with int8 (``algorithm="ring"``: int8 gradients, and under ``shard=params`` int8 parameters
in the all-gather too, ``{"params": int8, "grads": int8}``). Memory is ``step.memory(state,
batch)``: parameters, optimizer state and error-feedback residuals on one device, and the compiled
step's peak (arguments + outputs not aliased + temporaries).

DiLoCo rows (``--seeds`` seeds each, the same seeds and batches for every contender, each run
``--diloco-steps`` steps, 600 by default: 30 outer steps at H = 20): synchronous data parallel
(the flat mesh, every step's gradients averaged over the 8 devices) against ``jaxring.diloco``
on 2 nodes x 4 devices synced every ``--diloco-every`` steps (AdamW inside, gradients averaged
over a node's 4 devices): DiLoCo's outer Nesterov SGD (0.7, 0.9), and plain
averaging (``optax.sgd(1.0)``), uncompressed and int8 with error feedback. Each contender's eval
loss is given as the mean over the seeds and against the synchronous one's mean.

Launch:

  python -m recipes.bench_lm                              # tiny_cpu, 8 emulated CPU devices
  python -m recipes.bench_lm --num-steps 100 --config.width=128
  python -m recipes.bench_lm --rows=params/none,params/int8 --config.seed=1   # some rows
  python -m recipes.bench_lm --rows= --diloco-every=10    # the DiLoCo rows only
  python -m recipes.bench_lm --rows= --diloco-steps=200   # DiLoCo on the recipe's own budget
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time

ROWS = (("none", "none", "none", "auto"), ("params", "none", "none", "auto"),
        ("none", "int8", "none", "ring"), ("params", "int8", "int8", "ring"))
# DiLoCo contenders: name, outer (learning rate, Nesterov momentum), the pseudo-gradients' codec
DILOCO = (("synchronous", None, "none"), ("diloco nesterov", (0.7, 0.9), "none"),
          ("diloco average", (1.0, 0.0), "none"), ("diloco average int8", (1.0, 0.0), "int8"))


def measure(config, names=None) -> list[dict]:
  """The :data:`ROWS` named ``shard/grads`` in ``names`` (all when None) trained and measured."""
  import jax
  import numpy as np

  from recipes import lm, lm_data

  rows = []
  for shard, grads, params, algorithm in ROWS:
    if names is not None and f"{shard}/{grads}" not in names:
      continue
    run = dataclasses.replace(config, shard=shard, compression=grads, param_compression=params,
                              algorithm=algorithm, progress=False)
    start = time.perf_counter()
    summary = lm.train_and_evaluate(run)
    wall = time.perf_counter() - start
    batch = {"tokens": lm_data.sequences(run.dataset, "train", run.batch_size, run.context,
                                         run.seed)}
    with jax.numpy_dtype_promotion("standard"):
      memory = summary["step_fn"].memory(summary["state"], batch)
    losses = summary["losses"]
    rows.append({"shard": shard, "grads": grads, "params_codec": params, "algorithm": algorithm,
                 "eval_loss": summary["final"]["eval_loss"],
                 "eval_perplexity": summary["final"]["eval_perplexity"],
                 "train_loss_last10": float(np.mean(losses[-10:])),
                 "tokens_per_s": summary["tokens_per_s"], "compile_s": summary["compile_s"],
                 "wall_s": wall, "memory": memory, "params": summary["params"],
                 "entropy_floor": summary["entropy_floor"],
                 "unigram_entropy": summary["unigram_entropy"]})
    print(f"  {shard}/{grads}/{params}: eval loss {rows[-1]['eval_loss']:.4f} in {wall:.0f} s",
          flush=True)
  for row in rows:
    base = [r for r in rows if r["shard"] == row["shard"] and r["grads"] == "none"]
    row["loss_vs_uncompressed"] = (row["eval_loss"] / base[0]["eval_loss"] - 1 if base
                                   else float("nan"))
  return rows


def measure_diloco(config, every: int, seeds: int, steps: int) -> list[dict]:
  """Each :data:`DILOCO` contender trained over ``seeds`` seeds: its eval losses, their mean and
  its mean against the synchronous contender's."""
  from recipes import lm

  rows = []
  for name, outer, codec in DILOCO:
    losses, walls = [], []
    outer_lr, momentum = outer or (config.diloco_outer_lr, config.diloco_outer_momentum)
    for seed in range(config.seed, config.seed + seeds):
      run = dataclasses.replace(config, seed=seed, progress=False, num_steps=steps,
                                diloco_every=0 if outer is None
                                else every, diloco_compression=codec, diloco_outer_lr=outer_lr,
                                diloco_outer_momentum=momentum)
      start = time.perf_counter()
      summary = lm.train_and_evaluate(run)
      losses.append(summary["final"]["eval_loss"])
      walls.append(time.perf_counter() - start)
    rows.append({"contender": name, "every": 1 if outer is None else every, "steps": steps,
                 "entropy_floor": summary["entropy_floor"],
                 "outer": outer, "compression": codec, "eval_losses": losses,
                 "eval_loss_mean": sum(losses) / len(losses), "wall_s": walls})
    print(f"  {name}: eval loss {rows[-1]['eval_loss_mean']:.4f} over {seeds} seeds", flush=True)
  for row in rows:
    row["vs_synchronous"] = row["eval_loss_mean"] / rows[0]["eval_loss_mean"] - 1
  return rows


def format_diloco(rows: list[dict]) -> str:
  lines = ["| contender | H | outer (lr, momentum) | codec | eval loss, mean | per seed |"
           " vs synchronous |", "|---|---:|---|---|---:|---|---:|"]
  for r in rows:
    outer = "-" if r["outer"] is None else f"{r['outer'][0]}, {r['outer'][1]}"
    seeds = " / ".join(f"{x:.4f}" for x in r["eval_losses"])
    lines.append(f"| {r['contender']} | {r['every']} | {outer} | {r['compression']} | "
                 f"{r['eval_loss_mean']:.4f} | {seeds} | {100 * r['vs_synchronous']:+.1f}% |")
  return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
  mib = 1 / (1 << 20)
  lines = ["| shard | compression (params / grads) | eval loss | perplexity | vs uncompressed |"
           " params MiB/dev | opt state MiB/dev | residuals MiB/dev | step peak MiB/dev |"
           " tokens/s |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    m = r["memory"]
    comp = "none" if r["grads"] == "none" else (
        f"{r['params_codec']} / {r['grads']} ({r['algorithm']})")
    lines.append(
        f"| {r['shard']} | {comp} | {r['eval_loss']:.4f} | {r['eval_perplexity']:.4f} | "
        f"{100 * r['loss_vs_uncompressed']:+.2f}% | {m['params'] * mib:.3f} | "
        f"{m['opt_state'] * mib:.3f} | {m['residuals'] * mib:.3f} | "
        f"{m.get('step_peak', 0) * mib:.2f} | {r['tokens_per_s'] or 0:.0f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if "-h" in argv or "--help" in argv:
    print(__doc__.strip() + "\n\n--rows=SHARD/GRADS,... picks rows (none/none, params/none, "
          "none/int8, params/int8; --rows= none); --seeds=S (3) and --diloco-every=H (20; 0: no "
          "DiLoCo rows), --diloco-steps=N (600: each DiLoCo row's steps); the recipe's own "
          "options (python -m recipes.lm --help) set the config.")
    return 0
  import jax

  import jaxring.distributed
  from recipes import lm

  ours = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv
          if a.startswith(("--rows=", "--seeds=", "--diloco-every=", "--diloco-steps="))}
  names = ours["--rows"].split(",") if "--rows" in ours else None
  config = lm.parse_args([a for a in argv if a.split("=", 1)[0] not in ours])
  jaxring.distributed.initialize(local_device_count=config.cpu_devices or None)
  load_before = os.getloadavg()
  rows = measure(config, names) if names != [""] else []
  every = int(ours.get("--diloco-every", 20))
  diloco = measure_diloco(config, every, int(ours.get("--seeds", 3)),
                          int(ours.get("--diloco-steps", 600))) if every else []
  if rows:
    print(format_table(rows))
  if diloco:
    print(format_diloco(diloco))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                          text=True).stdout.strip()
  now = datetime.datetime.now(datetime.timezone.utc)
  out = os.path.join(root, "benchmarks", "results", "lm.json")   # the current run (git keeps older)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump({"command": "python -m recipes.bench_lm " + " ".join(argv), "date": now.isoformat(),
               "commit": commit, "devices": jax.device_count(),
               "platform": jax.devices()[0].platform, "cores": os.cpu_count(),
               "load_average_before": load_before, "load_average_after": os.getloadavg(),
               "config": dataclasses.asdict(config), "rows": rows, "diloco": diloco}, f, indent=1)
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
