#!/usr/bin/env python3
"""Finds the CUDA toolkit root for the build: the folder whose ``include/`` holds
``cuda_runtime.h`` and whose ``bin/`` holds a working ``nvcc``.

Standard library only: the Makefile runs it before anything is installed. The layouts it handles:
``nvcc`` on PATH as a symlink, as a wrapper script that execs the real compiler (``readlink`` leads
nowhere; ``nvcc --dryrun`` reports its own ``TOP``), absent from PATH with the toolkit under
``/usr/local/cuda*`` or ``/opt/cuda``, and ``CUDA_ROOT``/``CUDA_PATH``/``CUDA_HOME`` set by hand.

Usage:
  python3 tools/cuda_root.py                    # the root, or nothing (exit 0) when none is usable
  python3 tools/cuda_root.py --mpi4jax off      # what to give mpi4jax's build as CUDA_ROOT
  python3 tools/cuda_root.py --mpi4jax off --empty-dir .venv/.no-cuda

Example:
  >>> find_cuda_root(environ={"PATH": "/nonexistent"}, prefixes=())
  ''
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys

ENV_VARS = ("CUDA_ROOT", "CUDA_PATH", "CUDA_HOME")
PREFIXES = ("/usr/local/cuda", "/usr/local/cuda-*", "/opt/cuda", "/usr/lib/cuda")


def is_toolkit(root: str) -> bool:
  """A toolkit root has the runtime headers and an nvcc that runs."""
  if not root or not os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")):
    return False
  nvcc = os.path.join(root, "bin", "nvcc")
  if not os.access(nvcc, os.X_OK):
    return False
  try:
    return subprocess.run([nvcc, "--version"], capture_output=True, timeout=30).returncode == 0
  except (OSError, subprocess.TimeoutExpired):
    return False


def _nvcc_top(nvcc: str) -> str:
  """The root nvcc itself reports (``#$ TOP=...`` in ``--dryrun``): right for wrapper scripts."""
  try:
    out = subprocess.run([nvcc, "--dryrun", "-c", "x.cu"], capture_output=True, text=True,
                         timeout=30)
  except (OSError, subprocess.TimeoutExpired):
    return ""
  m = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.M)
  return os.path.realpath(m.group(1).strip()) if m else ""


def candidates(environ: dict[str, str], prefixes=PREFIXES):
  """Candidate roots, most explicit first."""
  for var in ENV_VARS:
    if environ.get(var):
      yield environ[var]
  nvcc = shutil.which("nvcc", path=environ.get("PATH", ""))
  if nvcc:
    yield _nvcc_top(nvcc)
    yield os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
  for pattern in prefixes:
    yield from sorted(glob.glob(pattern), reverse=True)


def find_cuda_root(environ: dict[str, str] | None = None, prefixes=PREFIXES) -> str:
  """The first usable toolkit root, or ``""``."""
  environ = dict(os.environ if environ is None else environ)
  for root in candidates(environ, prefixes):
    if is_toolkit(root):
      return os.path.realpath(root)
  return ""


def mpi4jax_cuda_root(mode: str, root: str, empty_dir: str) -> str:
  """The ``CUDA_ROOT`` to build mpi4jax with. jaxring moves host buffers over MPI, so ``off`` (the
  default) builds mpi4jax's CPU bridge only: its setup.py falls back to nvcc's parent folder or
  /usr/local/cuda when CUDA_ROOT is unset, and then fails on a layout without headers there; an
  existing empty folder as CUDA_ROOT makes it find no CUDA. ``auto`` builds the CUDA bridge where
  the toolkit is usable, ``on`` insists."""
  if mode not in ("off", "auto", "on"):
    raise SystemExit(f"MPI4JAX_CUDA must be off, auto or on, got {mode!r}")
  if mode == "on" and not root:
    raise SystemExit("MPI4JAX_CUDA=on but no usable CUDA toolkit was found (looked at "
                     f"{', '.join(ENV_VARS)}, nvcc on PATH, {', '.join(PREFIXES)}); set CUDA_ROOT")
  if mode != "off" and root:
    return root
  os.makedirs(empty_dir, exist_ok=True)
  return os.path.abspath(empty_dir)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--mpi4jax", choices=("off", "auto", "on"),
                 help="print the CUDA_ROOT for building mpi4jax in this mode")
  p.add_argument("--empty-dir", default=os.path.join(".venv", ".no-cuda"),
                 help="an empty folder to hand mpi4jax when it must build without CUDA")
  args = p.parse_args(argv)
  root = find_cuda_root()
  print(mpi4jax_cuda_root(args.mpi4jax, root, args.empty_dir) if args.mpi4jax else root)
  return 0


if __name__ == "__main__":
  sys.exit(main())
