"""``make demo``: the README's main job on an embedded default (8 emulated CPU devices)."""
from __future__ import annotations


def main(argv=None) -> int:
  from jaxring._src.bench import collectives
  args = list(argv or []) or ["--max-size", "32M", "--reps", "5"]
  return collectives.main(args)
