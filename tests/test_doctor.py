"""``jaxring doctor``: the report, and an exit code that reflects real breakage.

Each case runs the command in a fresh process. The broken cases are built for real: a copy of
the package without its compiled extension (what a checkout that was never built looks like), and
an mpi4jax that fails to import (what a build against another MPI does).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import multiproc
from jaxring._src import ext

# `pytest -m "not slow"` leaves it out: `jaxring doctor` in fresh processes, one on a copied
# package (~8 s)
pytestmark = pytest.mark.slow

# The editable install's finder would load the installed jaxring whatever sys.path says; drop it
# so that the copy on sys.path is the package imported.
_RUN_COPY = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'ScikitBuild' not in "
             "type(f).__name__]; sys.path.insert(0, {root!r}); "
             "from jaxring._src.tools.doctor import main; sys.exit(main({argv!r}))")


def doctor(*argv: str, env_extra: dict | None = None, code: str | None = None):
  cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "jaxring", "doctor", *argv]
  env = multiproc.clean_env(**(env_extra or {}))
  return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env,
                        cwd=multiproc.REPO)


def test_report_on_this_install():
  p = doctor()
  assert p.returncode == 0, p.stdout + p.stderr
  out = p.stdout
  for section in ("versions:", "devices:", "extension:", "mpi:", "allocator:", "distributed:"):
    assert section in out, out
  for key in ("jax ", "jaxlib", "flax", "optax", "orbax-checkpoint", "mpi4py", "mpi4jax",
              "MPI library", "FFI targets (cpu)", "CUDA kernels", "topology"):
    assert key in out, f"{key!r} missing from\n{out}"
  # every FFI target of the kernel table has a self-test case, and every windowed CPU target
  n = len(ext.FFI_KERNELS) + len(ext.WINDOW_KERNELS)
  assert n == 21, n   # 13 targets (int8, cast, chunks, fp4) and 8 windowed ones
  assert f"self-test (cpu)            {n}/{n} kernels match their references" in out, out


def test_a_windowed_target_that_reads_the_wrong_chunk_is_reported(monkeypatch):
  from jaxring._src.ext import window
  from jaxring._src.tools import doctor as doctor_tool
  right = window.ring_hop_cast_last
  monkeypatch.setattr(window, "ring_hop_cast_last",
                      lambda recv, base, offset: right(recv, base, offset + 1))
  results = doctor_tool._self_test("cpu")
  assert results["ring_hop_cast_last_at"] == "DIFFERS from its reference"
  assert results["ring_hop_cast_at"] == "ok" and results["ring_hop_cast_last"] == "ok"


def test_missing_extension_is_an_error(tmp_path):
  root = tmp_path / "checkout"
  shutil.copytree(os.path.join(multiproc.REPO, "jaxring"), root / "jaxring",
                  ignore=shutil.ignore_patterns("*.so", "__pycache__"))
  p = doctor(code=_RUN_COPY.format(root=str(root), argv=[]))
  assert p.returncode == 1, p.stdout + p.stderr
  assert "jaxring._ext               NOT LOADED" in p.stdout, p.stdout
  assert "ERROR: jaxring's native extension" in p.stdout and "make install" in p.stdout, p.stdout


def test_broken_mpi_only_matters_when_asked_for(tmp_path):
  shadow = tmp_path / "shadow" / "mpi4jax"
  shadow.mkdir(parents=True)
  (shadow / "__init__.py").write_text(
      "raise ImportError('mpi4jax was built against another MPI library')\n")
  env = {"PYTHONPATH": str(tmp_path / "shadow")}
  p = doctor("--brief", env_extra=env)
  assert p.returncode == 0, p.stdout + p.stderr
  p = doctor("--brief", "--require", "mpi", env_extra=env)
  assert p.returncode == 1, p.stdout + p.stderr
  assert "mpi4jax is not importable" in p.stdout and "built against another MPI" in p.stdout
  # Launched by mpirun, MPI is asked for without saying so.
  p = doctor("--brief", env_extra={**env, "PMI_RANK": "0", "PMI_SIZE": "1"})
  assert p.returncode == 1 and "mpi4jax is not importable" in p.stdout, p.stdout + p.stderr


def test_requirements_are_checked():
  p = doctor("--brief", "--require", "gpu")
  assert p.returncode == 1 and "--require gpu: JAX sees no GPU" in p.stdout, p.stdout + p.stderr
  p = doctor("--require", "wings")
  assert p.returncode == 2 and "unknown requirement(s) ['wings']" in p.stderr, p.stderr
