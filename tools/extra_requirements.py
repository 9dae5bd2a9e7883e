#!/usr/bin/env python3
"""Prints the requirements of one of pyproject.toml's optional-dependency groups, one per line,
so that the Makefile installs an extra's packages without reinstalling jaxring itself.

Standard library only (``tomllib`` on Python 3.11+, else a reading of the one table it needs).

Usage:
  python3 tools/extra_requirements.py docs          # sphinx, myst-parser, sphinx-book-theme, ...
  pip install $(python3 tools/extra_requirements.py docs)
"""
from __future__ import annotations

import ast
import pathlib
import re
import sys

PYPROJECT = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"


def extra(name: str, text: str) -> list[str]:
  """The requirement strings of ``[project.optional-dependencies]``'s ``name``."""
  try:
    import tomllib
  except ImportError:   # Python 3.10: the table's `name = [...]` entry, read as a Python list
    table = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[)", text + "\n[",
                      re.M | re.S)
    entry = table and re.search(rf"^{re.escape(name)}\s*=\s*(\[.*?\])[ \t]*(?:#[^\n]*)?$",
                                table.group(1), re.M | re.S)
    if not entry:
      raise SystemExit(f"pyproject.toml: no optional-dependencies group {name!r}")
    return ast.literal_eval(re.sub(r"#[^\n\"']*$", "", entry.group(1), flags=re.M))
  groups = tomllib.loads(text)["project"].get("optional-dependencies", {})
  if name not in groups:
    raise SystemExit(f"pyproject.toml: no optional-dependencies group {name!r}")
  return groups[name]


if __name__ == "__main__":
  print("\n".join(extra(sys.argv[1], PYPROJECT.read_text())))
