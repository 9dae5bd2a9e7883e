"""The LM recipe replicated and fully sharded, uncompressed and with int8 weights and gradients:
final loss after the same steps and the bytes each device holds. Prints a table, writes JSON.

Rows (the same config, seed and batches): ``shard=none`` and ``shard=params``, each uncompressed
and with int8 (``algorithm="ring"``: int8 gradients, and under ``shard=params`` int8 parameters
in the all-gather too, ``{"params": int8, "grads": int8}``). Memory is ``step.memory(state,
batch)``: parameters, optimizer state and error-feedback residuals on one device, and the compiled
step's peak (arguments + outputs not aliased + temporaries).

Launch:

  python -m recipes.bench_lm                              # tiny_cpu, 8 emulated CPU devices
  python -m recipes.bench_lm --num-steps 100 --config.width=128
  python -m recipes.bench_lm --rows=params/none,params/int8 --config.seed=1   # some rows
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
    print(__doc__.strip() + "\n\n--rows=SHARD/GRADS,... picks rows (none/none, params/none, none/int8, params/int8); the recipe's own "
          "options (python -m recipes.lm --help) set the config.")
    return 0
  import jax

  import jaxring.distributed
  from recipes import lm

  names = [a.split("=", 1)[1].split(",") for a in argv if a.startswith("--rows=")]
  config = lm.parse_args([a for a in argv if not a.startswith("--rows=")])
  jaxring.distributed.initialize(local_device_count=config.cpu_devices or None)
  load_before = os.getloadavg()
  rows = measure(config, names[0] if names else None)
  print(format_table(rows))
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
               "config": dataclasses.asdict(config), "rows": rows}, f, indent=1)
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
