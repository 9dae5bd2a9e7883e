"""How far a calibration point can sit from the median a benchmark row measures, from sampling
alone: each row's calls in ``bench cluster`` results are resampled as a calibration takes them
(``n`` calls, timed twice), and the lower of the two medians (what a plan with rivals keeps,
``jaxring._src.timing.confirm``) is compared with the median of all ``2n`` (what a plan alone in
its codec keeps) and with the row's own median.

  python benchmarks/scripts/confirm_bias.py benchmarks/results/cluster-*.json [--n 16] [--match topk]
"""
import argparse
import json
import os
import time

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("files", nargs="+")
ap.add_argument("--n", type=int, default=16, help="calls per timing (top-k at 32 MiB: 16-18)")
ap.add_argument("--match", default="topk", help="rows whose name contains this")
ap.add_argument("--draws", type=int, default=4000)
ap.add_argument("--out-dir", default="benchmarks/results")
args = ap.parse_args()
rng = np.random.default_rng(0)
out = []
print(f"{'run':>16} {'row':>44}  {'lower of two medians: bias, 5-95%':>34}  "
      f"{'median of both: bias, 5-95%':>28}")
for path in args.files:
  run = json.load(open(path))
  for row in run["rows"]:
    if args.match not in row["contender"] or len(row.get("times_ms", ())) < 2 * args.n:
      continue
    calls = np.asarray(row["times_ms"])
    first, again = (rng.choice(calls, (args.draws, args.n)) for _ in range(2))
    lower = np.minimum(np.median(first, 1), np.median(again, 1)) / np.median(calls) - 1
    both = np.median(np.concatenate([first, again], 1), 1) / np.median(calls) - 1
    stats = {name: [float(v.mean()), *map(float, np.percentile(v, [5, 95]))]
             for name, v in (("lower_of_two", lower), ("pooled", both))}
    out.append({"run": os.path.basename(path), "row": row["contender"], "calls": len(calls),
                **stats})
    cells = ["{:+.3f} ({:+.3f}, {:+.3f})".format(*stats[k]) for k in stats]
    print(f"{os.path.basename(path)[8:-5]:>16} {row['contender'][:44]:>44}  {cells[0]:>34}  "
          f"{cells[1]:>28}")
for name in ("lower_of_two", "pooled"):
  print(f"mean bias, {name}: {np.mean([o[name][0] for o in out]):+.3f}")
os.makedirs(args.out_dir, exist_ok=True)
dest = os.path.join(args.out_dir, time.strftime("confirm-bias-%Y%m%d-%H%M%S.json"))
with open(dest, "w") as fh:
  json.dump({"n": args.n, "match": args.match, "rows": out}, fh, indent=1)
print("wrote", dest)
