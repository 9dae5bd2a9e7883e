"""Every Python block of README.md, docs/*.md and docs/guides/*.md runs as written, in a fresh
process; the guides are all in the docs site's table of contents and their links resolve.

Only fenced ```python blocks run: commands (```bash) and output (```text) are shown, not run. A
block's first line may say how a user runs it, and the test does the same: ``# mpirun -n 4
python example.py`` runs it under the venv's ``mpirun``; ``XLA_FLAGS=...`` in that line is put in
the environment. Where a README or docs/*.md block prints a result, the test checks the value the
text promises (``_check_output``); a guide's block checks its own with ``assert``. Each block gets
a calibration cache, a flight-recorder folder and a temporary folder (``TMPDIR``) of its own.
"""
from __future__ import annotations

import os
import pathlib
import re
import shlex
import sys

import numpy as np
import pytest

import multiproc

REPO = pathlib.Path(multiproc.REPO)
GUIDES = sorted((REPO / "docs" / "guides").glob("*.md"))
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *GUIDES]
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")


def python_blocks() -> list[tuple[str, int, str]]:
  """``(file, line, code)`` of every fenced ```python block."""
  blocks = []
  for path in DOC_FILES:
    text = path.read_text()
    for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
      line = text.count("\n", 0, m.start()) + 1
      blocks.append((str(path.relative_to(REPO)), line, m.group(1)))
  return blocks


def _floats(line: str) -> np.ndarray:
  return np.array([float(v) for v in re.findall(r"-?\d+\.?\d*(?:e-?\d+)?", line)])


def _check_output(code: str, stdout: str) -> None:
  """The values the prose around each block promises."""
  lines = stdout.strip().splitlines()
  if "def allreduce" in code:
    np.testing.assert_allclose(_floats(lines[-1]), 8.0)
  if "bind_mpi_axis" in code:
    arrays = re.findall(r"\[([^\]]*)\]", stdout)   # ranks print at once: lines interleave
    assert len(arrays) == 4, stdout
    for a in arrays:   # int8 on the slow level rounds within 1%
      np.testing.assert_allclose(_floats(a), 1.5, rtol=1e-2)
  if 'shard="params"' in code:  # FSDP: the state is split, and int8 weights still fit
    assert lines[-2] == "P(None, 'data')" and float(lines[-1]) < 0.01, stdout
  elif "@jr.train_step" in code:
    assert float(lines[-1]) < 1e-3, stdout
  if "ImageLoader" in code:
    assert lines[0].startswith("(256, 224, 224, 3)"), stdout


@pytest.fixture(scope="module")
def imagenet_dir(tmp_path_factory) -> str:
  from jaxring import data
  root = tmp_path_factory.mktemp("imagenet")
  data.write_image_folder(root, num_classes=4, train_per_class=64, val_per_class=1, image_size=48)
  return str(root)


BLOCKS = python_blocks()


def test_the_docs_have_python_blocks():
  assert len(BLOCKS) >= 4, [b[:2] for b in BLOCKS]
  with_blocks = {f for f, _, _ in BLOCKS}
  assert GUIDES and all(str(g.relative_to(REPO)) in with_blocks for g in GUIDES), with_blocks


def _toctree_entries(path: pathlib.Path) -> set[str]:
  """The documents listed in the ```{toctree} blocks of a MyST page (options left out)."""
  entries = set()
  for m in re.finditer(r"^```\{toctree\}\n(.*?)^```", path.read_text(), re.S | re.M):
    entries |= {line.strip() for line in m.group(1).splitlines()
                if line.strip() and not line.startswith(":")}
  return entries


def test_every_guide_is_in_the_sites_table_of_contents():
  entries = _toctree_entries(REPO / "docs" / "index.md")
  missing = [g.name for g in GUIDES if f"guides/{g.stem}" not in entries]
  assert not missing, f"docs/index.md's toctree lacks {missing}: {sorted(entries)}"


def _paragraphs(text: str) -> list[list[str]]:
  """The prose of a page: paragraphs and list items, outside code, tables and headings."""
  text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
  paragraphs, current = [], []
  for line in [*text.splitlines(), ""]:
    stripped = line.strip()
    if stripped and not stripped.startswith(("|", "#")) and not (
        current and re.match(r"\s*([-*+]|\d+[.)])\s", line)):
      current.append(line)
      continue
    if current:
      paragraphs.append(current)
    current = [line] if stripped and not stripped.startswith(("|", "#")) else []
  return paragraphs


@pytest.mark.parametrize("page", [*GUIDES, REPO / "docs" / "index.md"],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_guides_are_short_paragraphs(page):
  long = [p[0][:60] for p in _paragraphs(page.read_text()) if len(p) > 8]
  assert not long, f"{page.relative_to(REPO)}: paragraphs over 8 lines begin {long}"


@pytest.mark.parametrize("page", [*GUIDES, REPO / "docs" / "index.md",
                                  *sorted((REPO / "docs" / "api").glob("*.md"))],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve_to_files(page):
  """Every relative ``[text](target)`` link of a guide (and of the site's index and API pages)
  names a file that exists; Sphinx (``make docs``) checks the anchors."""
  text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)   # code is not a link
  broken = []
  for target in re.findall(r"\]\(([^)\s]+)\)", text):
    if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
      continue   # a URL, or an anchor on the same page
    if not (page.parent / target.split("#")[0]).exists():
      broken.append(target)
  assert not broken, f"{page.relative_to(REPO)}: links to missing files: {broken}"


@pytest.mark.slow   # each README/docs block in a fresh process, some under mpirun (~3-5 s each)
@pytest.mark.parametrize("where,code", [(f"{f}:{line}", code) for f, line, code in BLOCKS],
                         ids=[f"{f}:{line}" for f, line, _ in BLOCKS])
def test_block_runs_as_written(where, code, tmp_path, imagenet_dir):
  first = code.splitlines()[0]
  script = tmp_path / "example.py"
  script.write_text(code)
  extra = dict(re.findall(r"\b(XLA_FLAGS)=(\S+)", first))
  env = multiproc.clean_env(IMAGENET_DIR=imagenet_dir, JAXRING_CACHE_DIR=str(tmp_path / "cache"),
                            JAXRING_FLIGHT_DIR=str(tmp_path / "flight"), TMPDIR=str(tmp_path),
                            **extra)
  cmd = [sys.executable, str(script)]
  m = re.search(r"mpirun -n (\d+)", first)
  if m:
    if not os.path.exists(MPIRUN):
      pytest.skip("no mpirun next to this interpreter (pip install mpich)")
    cmd = [MPIRUN, "-n", m.group(1), *cmd]
  [done] = multiproc.spawn(1, lambda _: cmd, lambda _: env, timeout=240)
  assert done.returncode == 0, f"{where} failed as written ({shlex.join(cmd)}):\n" + \
      multiproc.report([done])
  if not where.startswith("docs/guides/"):
    _check_output(code, done.stdout)
