"""The ``jaxring`` command: ``bench``, ``cluster``, ``demo``, ``doctor``, ``train``."""
from __future__ import annotations

import importlib
import os
import sys

BENCHES = {
    "collectives": "jaxring._src.bench.collectives",
    "kernels": "jaxring._src.bench.kernels",
    "wire": "jaxring._src.bench.wire",
    "train": "jaxring._src.bench.train",
    "train-cluster": "jaxring._src.bench.train_cluster",
    "cluster": "jaxring._src.bench.cluster",
    "resnet50": "jaxring._src.bench.resnet50",
}
USAGE = """jaxring <command> [args]

commands:
  bench {%s} [args]   benchmarks: print tables, write JSON under benchmarks/results/
  cluster {up,down,run,status} [args]   the emulated multi-node cluster (root)
  demo [args]          the README's main job
  doctor [--require mpi,cuda,gpu,tcmalloc]   versions, kernels self-test, MPI, allocator: a report
  train <recipe> [--config.name=value ...]   a recipe of recipes/ (imagenet_resnet50, small_cpu)
""" % ",".join(BENCHES)


def _module_main(module: str, argv: list[str]) -> int:
  try:
    mod = importlib.import_module(module)
  except ModuleNotFoundError as e:
    if e.name == module:
      print(f"jaxring: {module} is not available in this build", file=sys.stderr)
      return 2
    raise
  return int(mod.main(argv) or 0)


def bench_main(argv: list[str]) -> int:
  if not argv or argv[0] not in BENCHES:
    print(f"usage: jaxring bench {{{','.join(BENCHES)}}} [args]", file=sys.stderr)
    return 2
  from jaxring._src.bench import common
  common.maybe_reexec_with_tcmalloc(["bench", *argv])
  return _module_main(BENCHES[argv[0]], argv[1:])


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help"):
    print(USAGE)
    return 0 if argv else 2
  cmd, rest = argv[0], argv[1:]
  if cmd == "bench":
    return bench_main(rest)
  if cmd == "cluster":
    return _cluster(rest)
  if cmd == "doctor":
    return _module_main("jaxring._src.doctor", rest)
  if cmd == "demo":
    return _module_main("jaxring._src.demo", rest)
  if cmd == "train":
    return _train(rest)
  print(USAGE, file=sys.stderr)
  return 2


def import_recipe(name: str):
  """``recipes.<name>``; the recipes live beside the package in a source checkout (an editable
  install puts the checkout on ``sys.path``; a plain ``python -m jaxring`` from elsewhere may not).

  Example:
    >>> import_recipe("small_cpu").get_config().depth
    18
  """
  try:
    return importlib.import_module(f"recipes.{name}")
  except ModuleNotFoundError as e:
    if e.name not in ("recipes", f"recipes.{name}"):
      raise
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if e.name != "recipes" or not os.path.isfile(os.path.join(checkout, "recipes", "__init__.py")):
      raise ModuleNotFoundError(f"no recipe {name!r}: the recipes are the folder recipes/ of a "
                                "jaxring source checkout", name=e.name) from e
    sys.path.insert(0, checkout)
    return importlib.import_module(f"recipes.{name}")


def _train(argv: list[str]) -> int:
  if not argv or argv[0].startswith("-"):
    print("usage: jaxring train <recipe> [--config.name=value ...]   (recipes: "
          "imagenet_resnet50, small_cpu)", file=sys.stderr)
    return 2
  return int(import_recipe(argv[0]).main(argv[1:]) or 0)


def _cluster(argv: list[str]) -> int:
  mod = importlib.import_module("jaxring._src.cluster")
  return int(mod.main(argv) or 0)


if __name__ == "__main__":
  raise SystemExit(main())
