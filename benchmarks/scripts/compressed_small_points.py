"""Does the simulator need the compressed plans' calibration points below 1 MiB?

Calibration times compressed plans from ``calibrate.COMPRESSED_FROM`` (1 MiB) up only. This
program answers the question on past runs: for each ``jaxring bench cluster`` JSON given, it
validates the simulator (``jaxring simulate --validate``) against the run's rows twice, with the
run's calibration as measured and with the compressed plans' points below 1 MiB removed, and
prints the rows within 15%, the worst and the mean |error| of each.

  python benchmarks/scripts/compressed_small_points.py benchmarks/results/cluster-2026112*.json

Writes ``benchmarks/results/compressed-small-points-<time>.json``.
"""
import datetime
import json
import pathlib
import subprocess
import sys
import tempfile

from jaxring._src.calibrate import _sizes_for


def strip(result: dict) -> dict:
  """The run's calibration with only the points calibration now times (``_sizes_for``)."""
  for job in result["calibration"]:
    for fit in job["profile"]["fits"]:
      comp = None if fit["codecs"][-1] == "Codec()" else fit["codecs"][-1]   # lossless or not
      keep = _sizes_for(comp, fit["sizes"])
      fit["seconds"] = [t for s, t in zip(fit["sizes"], fit["seconds"]) if s in keep]
      fit["sizes"] = list(keep)
  return result


def score(path: pathlib.Path, out_dir: pathlib.Path) -> dict:
  before = set(out_dir.glob("simulate-validate-*.json"))
  subprocess.run([sys.executable, "-m", "jaxring", "simulate", "--validate", str(path),
                  "--out-dir", str(out_dir)], check=True, capture_output=True)
  (written,) = set(out_dir.glob("simulate-validate-*.json")) - before
  errors = [abs(r["calibrated_error"]) for r in json.loads(written.read_text())["rows"]]
  written.unlink()
  return {"within_15": sum(e <= 0.15 for e in errors), "rows": len(errors),
          "worst": max(errors), "mean": sum(errors) / len(errors)}


def main(paths: list[str]) -> None:
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    for path in map(pathlib.Path, paths):
      result = json.loads(path.read_text())
      if not result.get("calibration"):
        continue
      stripped = tmp / path.name
      stripped.write_text(json.dumps(strip(result)))
      # one at a time: validation names its output by the second
      rows.append({"run": path.name, "all_points": score(path, tmp),
                   "compressed_from_1mib": score(stripped, tmp)})
      a, b = rows[-1]["all_points"], rows[-1]["compressed_from_1mib"]
      print(f"{path.name:>32}  all points: {a['within_15']}/{a['rows']} within 15%, worst "
            f"{a['worst']:.0%}, mean {a['mean']:.1%}   compressed from 1 MiB: {b['within_15']}/"
            f"{b['rows']}, worst {b['worst']:.0%}, mean {b['mean']:.1%}", flush=True)
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  out = (pathlib.Path(__file__).resolve().parents[1] / "results" /
         f"compressed-small-points-{stamp}.json")
  out.write_text(json.dumps({"bench": "compressed_small_points", "rows": rows}, indent=1))
  print("wrote", out)


if __name__ == "__main__":
  main(sys.argv[1:])
