"""The repository's shape, read from the tree: a README read in minutes, one benchmarks page
that regenerates, results and scripts that stay few, and links that resolve.

The limits are the project's (README ≤ 160 lines, no prose paragraph over 8 lines;
docs/benchmarks.md ≤ 500 lines, one table and at most 10 lines of prose per section, no dated
headings; docs/simulations.md ≤ 300; benchmarks/results ≤ 24 tracked files and 5 MB, each
command's current run as ``<command>.json``; benchmarks/scripts ≤ 8 files).
"""
import ast
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
SIMULATIONS = ROOT / "docs" / "simulations.md"
DATE = re.compile(r"\b(19|20)\d\d-\d\d-\d\d\b")
LIST_ITEM = re.compile(r"^\s*([-*+]|\d+[.)])\s")


def _tracked(folder: str) -> list[str]:
  """Files git tracks under ``folder`` (the index: what a commit holds)."""
  try:
    out = subprocess.run(["git", "ls-files", "-z", "--", folder], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    pytest.skip("not a git checkout")
  return [p for p in out.split("\0") if p]


def _blocks(text: str) -> list[tuple[str, list[str]]]:
  """The page cut into ``(kind, lines)``: kind is "code", "table", "heading", "comment", "image"
  or "prose"; a prose block is a paragraph or one list item (blank lines and list markers cut)."""
  blocks: list[tuple[str, list[str]]] = []
  fence = None
  for line in text.splitlines():
    stripped = line.strip()
    if fence is not None:
      blocks[-1][1].append(line)
      if stripped.startswith(fence):
        fence = None
      continue
    if stripped.startswith(("```", "~~~")):
      fence = stripped[:3]
      blocks.append(("code", [line]))
      continue
    if not stripped:
      blocks.append(("blank", []))
      continue
    kind = ("table" if stripped.startswith("|") else "heading" if stripped.startswith("#")
            else "comment" if stripped.startswith("<!--") else "image" if stripped.startswith("![")
            else "prose")
    if kind == "prose" and blocks and blocks[-1][0] == "prose" and not LIST_ITEM.match(line):
      blocks[-1][1].append(line)
    elif kind == "table" and blocks and blocks[-1][0] == "table":
      blocks[-1][1].append(line)
    else:
      blocks.append((kind, [line]))
  return [b for b in blocks if b[0] != "blank"]


def _sections(text: str) -> dict[str, str]:
  """Each ``## `` section's text by its heading (what precedes the first is left out)."""
  parts = re.split(r"^## (.+)$", text, flags=re.M)
  return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def test_readme_is_short():
  lines = README.read_text().splitlines()
  assert len(lines) <= 160, f"README.md has {len(lines)} lines (at most 160)"


@pytest.mark.parametrize("page", [README, BENCHMARKS], ids=lambda p: p.name)
def test_no_prose_paragraph_over_8_lines(page):
  long = [b[1][0][:60] for b in _blocks(page.read_text()) if b[0] == "prose" and len(b[1]) > 8]
  assert not long, f"{page.name}: paragraphs over 8 lines begin {long}"


def test_benchmarks_page_is_one_page_of_current_figures():
  text = BENCHMARKS.read_text()
  assert len(text.splitlines()) <= 500, "docs/benchmarks.md over 500 lines"
  dated = [h for h in re.findall(r"^#+ .*$", text, flags=re.M) if DATE.search(h)]
  assert not dated, f"dated headings: {dated}"
  sections = _sections(text)
  assert len(sections) >= 10, list(sections)
  for heading, body in sections.items():
    blocks = _blocks(body)
    tables = sum(kind == "table" for kind, _ in blocks)
    prose = sum(len(lines) for kind, lines in blocks if kind == "prose")
    assert tables <= 1, f"{heading!r}: {tables} tables (one per section)"
    assert prose <= 10, f"{heading!r}: {prose} lines of prose (at most 10)"


def _bench_commands() -> list[str]:
  """The ``jaxring bench`` subcommands, read from the CLI's source (its BENCHES tables)."""
  tree = ast.parse((ROOT / "jaxring" / "_src" / "tools" / "cli.py").read_text())
  names = []
  for node in tree.body:
    if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      if any(getattr(t, "id", "") in ("BENCHES", "RECIPE_BENCHES") for t in targets):
        names += [k.value for k in node.value.keys]
  return names


def test_benchmarks_page_has_a_section_per_bench_command():
  commands = _bench_commands()
  assert len(commands) >= 10, commands
  headings = " ".join(_sections(BENCHMARKS.read_text()))
  missing = [c for c in commands if f"`jaxring bench {c}`" not in headings]
  assert not missing, f"no section for jaxring bench {missing}"
  for name in ("GPU", "The test suite's time"):
    assert name in headings


def test_simulations_page_is_short():
  assert len(SIMULATIONS.read_text().splitlines()) <= 300, "docs/simulations.md over 300 lines"


def test_history_lives_in_git_not_in_a_page():
  assert not (ROOT / "docs" / "benchmarks-history.md").exists()
  assert (ROOT / "CHANGELOG.md").exists()


def test_results_are_each_commands_current_run():
  files = _tracked("benchmarks/results")
  assert len(files) <= 24, f"{len(files)} tracked files in benchmarks/results (at most 24)"
  size = sum((ROOT / f).stat().st_size for f in files if (ROOT / f).exists())
  assert size <= 5 << 20, f"benchmarks/results holds {size / 2**20:.1f} MiB (at most 5)"
  dated = [f for f in files if re.search(r"\d{8}-\d{6}", f)]
  assert not dated, f"dated result files (each command writes <command>.json): {dated}"


def test_scripts_are_few():
  files = _tracked("benchmarks/scripts")
  assert len(files) <= 8, f"{len(files)} files in benchmarks/scripts (at most 8): {files}"


def _slug(heading: str) -> str:
  """GitHub's (and MyST's) anchor of a heading: lower case, punctuation dropped, spaces to -."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
  """The anchors of a page's headings; a repeated heading's get ``-1``, ``-2``, ... as on GitHub."""
  anchors: set[str] = set()
  for kind, lines in _blocks(page.read_text()):
    if kind == "heading":
      slug = _slug(lines[0].lstrip("#"))
      n = 0
      while (f"{slug}-{n}" if n else slug) in anchors:
        n += 1
      anchors.add(f"{slug}-{n}" if n else slug)
  return anchors


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _links(page: pathlib.Path) -> list[str]:
  """Targets of the page's inline links and images, outside code."""
  out = []
  for kind, lines in _blocks(page.read_text()):
    if kind != "code":
      text = re.sub(r"`[^`]*`", "", "\n".join(lines))
      out += LINK.findall(text)
  return out


DOC_PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
  broken = []
  for target in _links(page):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:, MyST's project:
      continue
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    # a docs page may name another without its suffix, or a folder by its index (Sphinx, MyST)
    dest = next((d for d in (dest, dest.with_name(dest.name + ".md"), dest / "index.md")
                 if d.exists()), dest)
    if not dest.exists():
      broken.append(target)
    elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
      broken.append(target)
  assert not broken, f"{page.relative_to(ROOT)}: links that do not resolve: {broken}"


def test_readme_pictures_are_tracked():
  tracked = set(_tracked("."))
  pictures = [t for t in re.findall(r"!\[[^\]]*\]\(([^)\s]+)", README.read_text())
              if not re.match(r"^[a-z]+:", t)]
  assert pictures, "the README shows one measured picture"
  untracked = [p for p in pictures if str((ROOT / p).resolve().relative_to(ROOT)) not in tracked]
  assert not untracked, f"README pictures git does not track: {untracked}"
