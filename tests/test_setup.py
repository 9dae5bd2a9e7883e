"""The set-up's CUDA toolkit detection (tools/cuda_root.py) on every layout it must handle, with
fake toolkits in a temp dir: nvcc a symlink, nvcc a wrapper script that execs the real one, nvcc
absent with the toolkit under an install prefix, headers missing, nothing at all."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import stat
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("cuda_root", REPO / "tools" / "cuda_root.py")
cuda_root = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cuda_root)


def _executable(path: pathlib.Path, text: str) -> pathlib.Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)
  path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
  return path


def fake_toolkit(root: pathlib.Path, headers: bool = True) -> pathlib.Path:
  """A folder shaped like a CUDA toolkit whose nvcc answers --version and --dryrun as nvcc does."""
  _executable(root / "bin" / "nvcc", f"""#!/bin/sh
case "$1" in
  --version) echo "Cuda compilation tools, release 13.0"; exit 0;;
  --dryrun) echo '#$ _HERE_={root}/bin' >&2; echo '#$ TOP={root}/bin/..' >&2; exit 0;;
esac
exit 1
""")
  if headers:
    (root / "include").mkdir(parents=True, exist_ok=True)
    (root / "include" / "cuda_runtime.h").write_text("/* fake */\n")
  return root


def env_with_path(*dirs: pathlib.Path) -> dict[str, str]:
  return {"PATH": os.pathsep.join([*map(str, dirs), "/usr/bin", "/bin"])}


def test_nvcc_a_symlink(tmp_path):
  kit = fake_toolkit(tmp_path / "cuda-13.0")
  (tmp_path / "bin").mkdir()
  (tmp_path / "bin" / "nvcc").symlink_to(kit / "bin" / "nvcc")
  assert cuda_root.find_cuda_root(env_with_path(tmp_path / "bin"), prefixes=()) == str(kit)


def test_nvcc_a_wrapper_script(tmp_path):
  # readlink leads nowhere for a wrapper; what nvcc reports as its TOP does.
  kit = fake_toolkit(tmp_path / "opt" / "cuda-13.0")
  _executable(tmp_path / "bin" / "nvcc", f'#!/bin/sh\nexec {kit}/bin/nvcc "$@"\n')
  assert cuda_root.find_cuda_root(env_with_path(tmp_path / "bin"), prefixes=()) == str(kit)


def test_nvcc_absent_toolkit_under_prefix(tmp_path):
  kit = fake_toolkit(tmp_path / "cuda-12.8")
  got = cuda_root.find_cuda_root(env_with_path(tmp_path / "empty"),
                                 prefixes=(str(tmp_path / "cuda"), str(tmp_path / "cuda-*")))
  assert got == str(kit)


def test_headers_missing_is_no_toolkit(tmp_path):
  # The layout that broke mpi4jax's build: nvcc runs, but no cuda_runtime.h anywhere.
  kit = fake_toolkit(tmp_path / "cuda", headers=False)
  assert cuda_root.find_cuda_root(env_with_path(kit / "bin"), prefixes=(str(kit),)) == ""


def test_nothing_installed(tmp_path):
  assert cuda_root.find_cuda_root(env_with_path(tmp_path), prefixes=()) == ""


def test_cuda_root_variable_wins_and_is_checked(tmp_path):
  kit = fake_toolkit(tmp_path / "mine")
  other = fake_toolkit(tmp_path / "other")
  env = {**env_with_path(other / "bin"), "CUDA_ROOT": str(kit)}
  assert cuda_root.find_cuda_root(env, prefixes=()) == str(kit)
  env["CUDA_ROOT"] = str(tmp_path / "no-such-dir")   # a wrong hint falls through to nvcc
  assert cuda_root.find_cuda_root(env, prefixes=()) == str(other)


def test_mpi4jax_modes(tmp_path):
  kit = str(fake_toolkit(tmp_path / "cuda"))
  empty = tmp_path / "no-cuda"
  off = cuda_root.mpi4jax_cuda_root("off", kit, str(empty))
  assert off == str(empty) and os.listdir(off) == []   # mpi4jax then finds no include/ or lib/
  assert cuda_root.mpi4jax_cuda_root("auto", kit, str(empty)) == kit
  assert cuda_root.mpi4jax_cuda_root("auto", "", str(empty)) == str(empty)
  with pytest.raises(SystemExit, match="MPI4JAX_CUDA=on but no usable CUDA toolkit"):
    cuda_root.mpi4jax_cuda_root("on", "", str(empty))
  with pytest.raises(SystemExit, match="must be off, auto or on"):
    cuda_root.mpi4jax_cuda_root("yes", kit, str(empty))


def test_command_line_on_this_machine(tmp_path):
  out = subprocess.run([sys.executable, str(REPO / "tools" / "cuda_root.py")], capture_output=True,
                       text=True, timeout=120, check=True).stdout.strip()
  if out:   # whatever this machine's layout, a root found is a real toolkit
    assert os.path.isfile(os.path.join(out, "include", "cuda_runtime.h"))
    assert os.access(os.path.join(out, "bin", "nvcc"), os.X_OK)
  empty = tmp_path / "e"
  out = subprocess.run([sys.executable, str(REPO / "tools" / "cuda_root.py"), "--mpi4jax", "off",
                        "--empty-dir", str(empty)], capture_output=True, text=True, timeout=120,
                       check=True).stdout.strip()
  assert out == str(empty) and empty.is_dir()
