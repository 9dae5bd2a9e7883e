"""The optional dependencies: the core imports and runs without them, a feature whose extra is
missing raises an ImportError naming the extra, and pyproject's core dependencies hold none."""
from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import tomllib

import pytest

from jaxring._src import extras

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Each extra: the modules it provides (blocked in the subprocesses) and the packages it installs.
MODULES = {"mpi": ("mpi4py", "mpi4jax"), "data": ("PIL", "cv2", "simplejpeg"),
           "plot": ("matplotlib",)}
PACKAGES = {"mpi": {"mpich", "mpi4py", "mpi4jax"},
            "data": {"pillow", "simplejpeg", "opencv-python-headless"},
            "plot": {"matplotlib"}}
CORE = {"jax", "jaxlib", "numpy", "flax", "optax", "orbax-checkpoint"}

# Run first in each subprocess: a meta-path finder that refuses the blocked modules (and their
# submodules) and records every attempt, so that an import swallowed by a try/except shows too.
_PRELUDE = """
import importlib.abc, json, sys
BLOCKED, TRIED = {blocked!r}, []
class Block(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in BLOCKED:
      TRIED.append(name)
      raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
    return None
sys.meta_path.insert(0, Block())
def expect(extra, call):
  try:
    call()
  except ImportError as e:
    assert f"pip install 'jaxring[{{extra}}]'" in str(e), str(e)
    print("RAISED", type(e).__name__, e)
  else:
    raise AssertionError(f"{{call}} ran without the {{extra}} extra")
import jaxring, jaxring.codecs, jaxring.train, jaxring.distributed
assert not TRIED, f"importing jaxring tried {{TRIED}}"
import jaxring.data   # tries simplejpeg and OpenCV, and falls back to Pillow without them
from jaxring._src import extras
from jaxring._src.tools.bench import plots
"""

_CHECKS = {
    # the MPI transport: bind_mpi_axis / mpi_axis with the default and with a given communicator,
    # and the transport's own moves
    "mpi": """
import jax.numpy as jnp
from jaxring._src.transport.mpi import MPI_TRANSPORT, MpiGroup
expect("mpi", lambda: jaxring.distributed.bind_mpi_axis("data"))
expect("mpi", lambda: jaxring.distributed.bind_mpi_axis("data", object()))
def in_block():
  with jaxring.distributed.mpi_axis():
    pass
expect("mpi", in_block)
expect("mpi", lambda: MPI_TRANSPORT.shift((jnp.zeros(4),), MpiGroup(object(), "node")))
""",
    # jaxring.data still imports and serves synthetic batches; decoding and writing JPEGs raise
    "data": """
import os, tempfile
from jaxring._src.data import decode
root = tempfile.mkdtemp()
os.makedirs(os.path.join(root, "train", "n00000000"))
open(os.path.join(root, "train", "n00000000", "a.JPEG"), "wb").write(b"not a jpeg")
assert next(jaxring.data.SyntheticImages(4, image_size=8, num_classes=2))["image"].shape[1:] == (
    8, 8, 3)
folder = jaxring.data.ImageFolder(root, "train")
assert "pip install 'jaxring[data]'" in jaxring.data.fast_decoder_error()
expect("data", lambda: jaxring.data.load_image(folder.paths[0], 8, train=False))
expect("data", lambda: jaxring.data.ImageLoader(folder, 1, train=False, worker_type="thread"))
expect("data", lambda: decode.resolve_decoder("turbo"))
expect("data", lambda: jaxring.data.write_image_folder(os.path.join(root, "w"), num_classes=1))
assert not os.path.exists(os.path.join(root, "w"))
""",
    # the benchmarks' plots are skipped, saying what to install
    "plot": """
assert plots.pyplot() is None
assert "pip install 'jaxring[plot]'" in plots.NO_MATPLOTLIB
expect("plot", lambda: extras.require("matplotlib.pyplot", "plot", "the plots need matplotlib"))
""",
}


def _run(blocked: tuple[str, ...], checks: str) -> str:
  code = _PRELUDE.format(blocked=blocked) + checks
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=120)
  assert p.returncode == 0, p.stdout + p.stderr
  return p.stdout


@pytest.mark.slow   # a fresh interpreter per extra (~3 s each)
@pytest.mark.parametrize("extra", sorted(MODULES))
def test_core_works_and_the_feature_names_its_extra(extra):
  out = _run(MODULES[extra], _CHECKS[extra])
  assert out.count("RAISED") == _CHECKS[extra].count("expect("), out


@pytest.mark.slow   # a fresh interpreter with every extra blocked (~3 s)
def test_nothing_but_the_core_installed():
  """A plain ``pip install jaxring``: every extra missing at once."""
  out = _run(sum(MODULES.values(), ()), "".join(_CHECKS.values()))
  assert out.count("RAISED") == sum(c.count("expect(") for c in _CHECKS.values()), out


def test_partial_data_extra_falls_back_to_pillow():
  """Pillow without simplejpeg: ``auto`` decodes with Pillow, ``turbo`` names the extra."""
  _run(("cv2", "simplejpeg"), """
from jaxring._src.data import decode
assert decode.resolve_decoder("auto") == "pil"
assert "pip install 'jaxring[data]'" in jaxring.data.fast_decoder_error()
expect("data", lambda: decode.resolve_decoder("turbo"))
""")


def test_the_message_names_the_extra_and_keeps_the_cause():
  with pytest.raises(extras.MissingExtraError) as info:
    extras.require("jaxring_no_such_module", "mpi", "the X needs Y", hint="build Y first")
  e = info.value
  assert isinstance(e, ImportError) and e.name == "jaxring_no_such_module"
  assert str(e).startswith("the X needs Y: pip install 'jaxring[mpi]'; build Y first (No module")
  assert isinstance(e.__cause__, ModuleNotFoundError)
  assert extras.require("json", "plot", "unused") is sys.modules["json"]


def _name(requirement: str) -> str:
  return re.split(r"[\s<>=!~;\[]", requirement.strip(), maxsplit=1)[0].lower()


def _project() -> dict:
  with open(ROOT / "pyproject.toml", "rb") as f:
    return tomllib.load(f)["project"]


def test_core_dependencies_hold_no_extra():
  project = _project()
  core = {_name(d) for d in project["dependencies"]}
  optional = project["optional-dependencies"]
  assert CORE <= core, core
  for extra, packages in PACKAGES.items():
    assert packages <= {_name(d) for d in optional[extra]}, (extra, optional[extra])
  in_extras = {_name(d) for e in ("mpi", "data", "plot", "dali") for d in optional[e]}
  assert not core & (in_extras | set().union(*PACKAGES.values())), core & in_extras
  assert not any(n.startswith("nvidia-dali") for n in core), core


def test_all_is_mpi_data_and_plot():
  optional = _project()["optional-dependencies"]
  names = set()
  for d in optional["all"]:
    m = re.fullmatch(r"jaxring\[([\w,\s-]+)\]", d.strip())
    if m:   # the extras named, as pip installs them
      names |= {_name(r) for e in m.group(1).split(",") for r in optional[e.strip()]}
    else:
      names.add(_name(d))
  assert set().union(*PACKAGES.values()) <= names, names


def test_make_install_keeps_installing_everything():
  """``make demo`` / ``make test`` install requirements.txt (and build mpi4jax): the core and
  the mpi and data extras, as before the split."""
  listed = {_name(line) for line in (ROOT / "requirements.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")}
  needed = {_name(d) for d in _project()["dependencies"]} | (
      PACKAGES["mpi"] - {"mpi4jax"}) | PACKAGES["data"]
  assert needed <= listed, needed - listed
  assert "mpi4jax" in (ROOT / "Makefile").read_text()


def test_extras_are_imported_through_the_helper_only():
  """Every import of an extra's module in the library goes through ``extras.require`` (so the
  message names the extra); DALI keeps its own check (``jaxring.data.dali_error``)."""
  tops = {m for mods in MODULES.values() for m in mods} | {"sklearn"}
  wrong = []
  for path in (ROOT / "jaxring").rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
      wrong += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                if n.split(".")[0] in tops]
  assert not wrong, "\n".join(wrong)
