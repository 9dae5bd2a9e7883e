"""The ``slow`` marker lives on the test: no list of test names in conftest.py (a renamed test
would silently leave it), and every test marked ``multiprocess`` or ``netns`` is left out of the
quick loop (``pytest -m "not slow"``, ``make test-quick``)."""
from __future__ import annotations

import ast
import json
import pathlib
import re
import subprocess
import sys

import multiproc

TESTS = pathlib.Path(multiproc.REPO) / "tests"

# Loaded into the collecting pytest (after conftest.py's hook): what `-m "not slow"` kept and left
# out, each with the markers it carries.
_REPORTER = '''
import json, os
_seen = {"selected": [], "deselected": []}

def _entry(item):
  return [item.nodeid, sorted({m.name for m in item.iter_markers()})]

def pytest_deselected(items):
  _seen["deselected"] += [_entry(i) for i in items]

def pytest_collection_finish(session):
  _seen["selected"] = [_entry(i) for i in session.items]
  with open(os.environ["MARKERS_REPORT"], "w") as f:
    json.dump(_seen, f)
'''


def test_conftest_lists_no_test_names():
  source = (TESTS / "conftest.py").read_text()
  assert "SLOW_TESTS" not in source and "SLOW_MODULES" not in source
  names = re.compile(r"(^|/)test_\w*(\.py)?($|::)|::test_")
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
      assert not names.search(node.value), (
          f"conftest.py names a test ({node.value!r}): mark it where it is defined instead "
          "(@pytest.mark.slow, pytest.param(..., marks=pytest.mark.slow) or pytestmark)")


def test_multiprocess_and_netns_tests_are_left_out_of_the_quick_loop(tmp_path):
  # only the modules that use the two markers: a collection of the whole suite costs ~10 s
  files = sorted(str(p) for p in TESTS.glob("test_*.py")
                 if re.search(r"mark\.(multiprocess|netns)\b", p.read_text()))
  assert len(files) >= 2, files
  (tmp_path / "markers_report.py").write_text(_REPORTER)
  report = tmp_path / "report.json"
  env = multiproc.clean_env(PYTHONPATH=str(tmp_path), MARKERS_REPORT=str(report))
  proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow",
                         "-p", "no:cacheprovider", "-p", "markers_report", *files],
                        capture_output=True, text=True, timeout=240, env=env, cwd=multiproc.REPO)
  assert proc.returncode in (0, 5), proc.stdout + proc.stderr   # 5: every test deselected
  seen = json.loads(report.read_text())
  left_out = {name for _, marks in seen["deselected"] for name in marks}
  assert {"multiprocess", "netns"} <= left_out, seen   # the check sees both kinds
  quick = [(nodeid, marks) for nodeid, marks in seen["selected"]
           if {"multiprocess", "netns"} & set(marks)]
  assert not quick, f"in the quick loop though multiprocess or netns: {quick}"
  for _, marks in seen["deselected"]:
    assert "slow" in marks
