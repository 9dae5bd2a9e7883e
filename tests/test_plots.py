"""The PNG plots of ``jaxring bench collectives`` and ``jaxring bench cluster``."""
from __future__ import annotations

import json
import os
import sys

import pytest

from jaxring._src.tools.bench import plots

RESULTS = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "results")
EXAMPLES = {"collectives": "collectives.json",
            "cluster": "cluster.json"}


def _load(name: str) -> dict:
  with open(os.path.join(RESULTS, EXAMPLES[name])) as f:
    return json.load(f)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_plot_writes_png(name, tmp_path):
  pytest.importorskip("matplotlib")
  path = str(tmp_path / f"{name}.png")
  assert getattr(plots, name)(_load(name), path) == path
  assert os.path.exists(path)
  with open(path, "rb") as f:
    assert f.read(4) == b"\x89PNG"
  assert os.path.getsize(path) > 10 * 1024


def test_no_matplotlib_returns_none(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
  for name in sorted(EXAMPLES):
    path = tmp_path / f"{name}.png"
    assert getattr(plots, name)(_load(name), str(path)) is None
    assert not path.exists()
