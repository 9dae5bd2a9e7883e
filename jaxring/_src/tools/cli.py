"""The ``jaxring`` command: ``bench``, ``calibrate``, ``cluster``, ``demo``, ``doctor``,
``simulate``, ``train``.

``demo``, ``train <recipe>`` and ``bench resnet50`` run code of ``recipes/``, the application that
sits on top of the library in a source checkout (configs, models, the demo, the ResNet-50 bench).
The library never imports it: those commands replace this process with ``python -m
recipes.<module> [args]``, run with the checkout that holds this ``jaxring`` on ``PYTHONPATH``
(the same pid, so a launcher's signals, mpirun's rank environment and the exit status are the
recipe's own). Where this ``jaxring`` has no ``recipes/`` beside it (a wheel install), they say so
and exit 2.
"""
from __future__ import annotations

import importlib
import os
import sys

BENCHES = {
    "collectives": "jaxring._src.tools.bench.collectives",
    "kernels": "jaxring._src.tools.bench.kernels",
    "wire": "jaxring._src.tools.bench.wire",
    "train": "jaxring._src.tools.bench.train",
    "train-cluster": "jaxring._src.tools.bench.train_cluster",
    "cluster": "jaxring._src.tools.bench.cluster",
    "data": "jaxring._src.tools.bench.data",
    "convergence": "jaxring._src.tools.bench.convergence",
    "tta": "jaxring._src.tools.bench.tta",
    "faults": "jaxring._src.tools.bench.faults",
    "fsdp": "jaxring._src.tools.bench.fsdp",
    "outer-sync": "jaxring._src.tools.bench.outer_sync",
    "diloco-quality": "jaxring._src.tools.bench.diloco_quality",
}
#: Benchmarks that are recipes (they train the recipes' models): run as ``python -m <module>``.
RECIPE_BENCHES = {"resnet50": "recipes.bench_resnet50"}
USAGE = """jaxring <command> [args]

commands:
  bench {%s} [args]   benchmarks: print tables, write JSON under benchmarks/results/
  calibrate [--mesh 2x4 --axes node,local]   time the plans `auto` picks from, keep the profile
  cluster {up,down,run,status} [args]   the emulated multi-node cluster (root)
  simulate [--cluster 8xh100-25gbe] [--reproduce baidu]   projected scaling to 1,024 GPUs
  demo [args]          the README's main job (recipes/demo.py)
  doctor [--require mpi,cuda,gpu,tcmalloc]   versions, kernels self-test, MPI, allocator: a report
  train <recipe> [--config.name=value ...]   a recipe of recipes/ (imagenet_resnet50, small_cpu, lm)
""" % ",".join([*BENCHES, *RECIPE_BENCHES])


def _module_main(module: str, argv: list[str]) -> int:
  try:
    mod = importlib.import_module(module)
  except ModuleNotFoundError as e:
    if e.name == module:
      print(f"jaxring: {module} is not available in this build", file=sys.stderr)
      return 2
    raise
  return int(mod.main(argv) or 0)


def recipes_checkout() -> str | None:
  """The source checkout whose ``recipes/`` folder sits beside this ``jaxring`` package, or None.

  Example:
    >>> os.path.isdir(os.path.join(recipes_checkout(), "recipes"))  # in a source checkout
    True
  """
  import jaxring
  root = os.path.dirname(os.path.dirname(os.path.abspath(jaxring.__file__)))
  return root if os.path.isfile(os.path.join(root, "recipes", "__init__.py")) else None


def exec_recipe(module: str, argv: list[str], command: str) -> int:
  """Replaces this process with ``python -m <module> <argv>`` run from the recipes' checkout.

  Returns 2 (after saying why on stderr) only when there is no ``recipes/`` folder to run.

  Example:
    >>> exec_recipe("recipes.demo", ["--steps", "20"], "demo")  # doctest: +SKIP
  """
  root = recipes_checkout()
  if root is None:
    print(f"jaxring {command}: needs the recipes/ folder of a jaxring source checkout (git clone "
          "the repository, then `make install` or `pip install -e .` there); this jaxring is "
          "installed without it", file=sys.stderr)
    return 2
  path = os.path.join(root, *module.split(".")) + ".py"
  if not os.path.isfile(path) or (command.startswith("train ") and not _is_recipe(path)):
    names = sorted(f[:-3] for f in os.listdir(os.path.join(root, "recipes"))
                   if f.endswith(".py") and _is_recipe(os.path.join(root, "recipes", f)))
    print(f"jaxring {command}: no recipe {module} in {root}; recipes: {', '.join(names)}",
          file=sys.stderr)
    return 2
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
  return 0  # not reached


def _is_recipe(path: str) -> bool:
  with open(path, encoding="utf-8") as f:
    return "def get_config(" in f.read()


def bench_main(argv: list[str]) -> int:
  names = [*BENCHES, *RECIPE_BENCHES]
  if not argv or argv[0] not in names:
    print(f"usage: jaxring bench {{{','.join(names)}}} [args]", file=sys.stderr)
    return 2
  from jaxring._src.tools.bench import common
  common.maybe_reexec_with_fast_allocator(["bench", *argv])
  if argv[0] in RECIPE_BENCHES:
    return exec_recipe(RECIPE_BENCHES[argv[0]], argv[1:], f"bench {argv[0]}")
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
    return _module_main("jaxring._src.tools.doctor", rest)
  if cmd == "calibrate":
    return _module_main("jaxring._src.tools.calibrate", rest)
  if cmd == "simulate":
    return _module_main("jaxring._src.tools.simulate.cli", rest)
  if cmd == "demo":
    return exec_recipe("recipes.demo", rest, "demo")
  if cmd == "train":
    return _train(rest)
  print(USAGE, file=sys.stderr)
  return 2


def _train(argv: list[str]) -> int:
  if not argv or argv[0].startswith("-") or not argv[0].isidentifier():
    print("usage: jaxring train <recipe> [--config.name=value ...]   (recipes: "
          "imagenet_resnet50, small_cpu, lm)", file=sys.stderr)
    return 2
  return exec_recipe(f"recipes.{argv[0]}", argv[1:], f"train {argv[0]}")


def _cluster(argv: list[str]) -> int:
  mod = importlib.import_module("jaxring._src.tools.cluster")
  return int(mod.main(argv) or 0)


if __name__ == "__main__":
  raise SystemExit(main())
