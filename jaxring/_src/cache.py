"""Where jaxring keeps what it measured on this machine (calibrated profiles, kernel choices)."""
from __future__ import annotations

import os
import pathlib

ENV_CACHE_DIR = "JAXRING_CACHE_DIR"


def cache_dir() -> pathlib.Path:
  """``$JAXRING_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxring``, else ``~/.cache/jaxring``.

  Example:
    >>> cache_dir().name in ("jaxring",) or "JAXRING_CACHE_DIR" in os.environ
    True
  """
  base = os.environ.get(ENV_CACHE_DIR) or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxring")
  return pathlib.Path(base)
