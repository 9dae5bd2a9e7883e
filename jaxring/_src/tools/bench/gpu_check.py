"""The GPU half in one run: ``make gpu-check`` builds the CUDA kernels, then runs this.

Steps, each in its own process with a time limit: ``jaxring doctor --require cuda,gpu`` (the
kernels registered for CUDA and matching their references on the card), ``pytest -m gpu``,
``jaxring bench kernels`` (GB/s beside the card's device-to-device copy) and ``jaxring bench
resnet50 --data synthetic --compare-norms`` in bf16 (images/s, jaxring's step beside a plain jit
step, and the plain step with flax's BatchNorm). One JSON
under ``benchmarks/results/gpu-check.json`` holds every step's exit code, the tail of
its output and the results its benchmark wrote. The exit code is non-zero when a step failed.

Example:
    make gpu-check
    python -m jaxring._src.tools.bench.gpu_check --skip resnet50
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from jaxring._src.tools.bench import common

STEPS = {
    "doctor": (["-m", "jaxring", "doctor", "--require", "cuda,gpu"], 300),
    "pytest-gpu": (["-m", "pytest", "-q", "-m", "gpu", "tests/test_ext_gpu.py"], 600),
    "kernels": (["-m", "jaxring._src.tools.bench.kernels", "--sizes", "16", "64", "256",
                 "--launches", "50", "--save-choice"], 600),
    "resnet50": (["-m", "jaxring", "bench", "resnet50", "--data", "synthetic", "--dtype",
                  "bfloat16", "--compare-norms"], 900),
}


def run_step(name: str, args: list[str], timeout: float, out_dir: str) -> dict:
  """Runs one step; returns its record (exit code, seconds, output tail, JSON it wrote)."""
  env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cuda,cpu"))
  cmd = [sys.executable, *args]
  if name in ("kernels", "resnet50"):
    cmd += ["--out" if name == "kernels" else "--out-dir", out_dir]
  t0 = time.perf_counter()
  try:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    rc, output = p.returncode, p.stdout + p.stderr
  except subprocess.TimeoutExpired as e:
    rc, output = None, f"{e.stdout or ''}{e.stderr or ''}\n[killed after {timeout} s]"
  if name == "pytest-gpu" and rc == 0 and " passed" not in output:
    rc = "no GPU test ran (all skipped: is the GPU visible to JAX?)"
  record = {"command": " ".join(["python", *args]), "returncode": rc,
            "seconds": round(time.perf_counter() - t0, 1), "output_tail": output[-6000:]}
  written = os.path.join(out_dir, f"{name}.json")
  if os.path.exists(written):
    with open(written) as f:
      record["result"] = json.load(f)
  print(f"== {name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {record['seconds']} s")
  print(output[-3000:])
  return record


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m jaxring._src.tools.bench.gpu_check",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--skip", nargs="*", default=[], choices=list(STEPS), help="steps to leave out")
  p.add_argument("--out-dir", default=None, help="folder for the JSON (default benchmarks/results)")
  args = p.parse_args(argv)
  steps = {}
  with tempfile.TemporaryDirectory(prefix="jaxring-gpu-check-") as tmp:
    for name, (step_args, timeout) in STEPS.items():
      if name not in args.skip:
        steps[name] = run_step(name, step_args, timeout, tmp)
  failed = [n for n, s in steps.items() if s["returncode"] != 0]
  path = common.write_json("gpu-check", {"machine": common.machine(), "steps": steps,
                                         "failed": failed}, args.out_dir)
  print(f"gpu-check: {'all steps passed' if not failed else 'FAILED: ' + ', '.join(failed)}; "
        f"wrote {path}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
