"""The layout's rules, read from the source (docs/design.md, "Layers"): imports point down only,
no cycles, no other layer's private names, public modules only re-export, modules stay small."""
import ast
import collections
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 450

# Each folder (or module) of jaxring/_src and its layer: a module imports only from lower layers
# or from its own folder. Two folders on one layer are independent axes and never import each other.
LAYERS = {
    "tools": 9,           # applications of the library: CLI, benchmarks, emulated cluster, doctor
    "train": 8,           # train_step, value_and_grad's buckets, state, checkpoints, the loop
    "optim": 7,           # optax transforms that compress (momentum correction, compressed Adam)
    "calibrate": 7,       # times the candidate plans on the mesh, writes the profile auto reads
    "error_feedback": 6,  # reduce_gradients (optax) and the one error-feedback rule
    "data": 6,            # input pipeline
    "distributed": 6,     # multi-process start-up (public API over transport/ and reliability/)
    "collectives": 5,     # the lax contract
    "algorithms": 4,      # planner, engine, ring, hierarchical
    "transport": 3,       # how a collective's bytes move: XLA, MPI, in-process
    "codecs": 2,
    "reliability": 2,     # watchdog, heartbeats, roll call, fingerprints, launches, flight recorder
    "cost_model": 2,      # the alpha-beta formulas (tools and the simulator read them)
    "profiles": 2,        # measured profiles: what auto reads, where calibration keeps them
    "ext": 1,             # the native kernels and their references
    "topology": 1,
    "vma": 0,
    "native": 0,          # lax's own collectives, whatever jax.lax holds later
    "fuse": 0,            # leaves of one dtype fused into one buffer and back
    "cache": 0,           # where measured profiles and kernel choices are kept
    "timing": 0,          # calls timed side by side, and their order (calibrate, benchmarks)
    "extras": 0,          # optional dependencies imported with the extra to install named
}
FACES = {"jaxring", "jaxring.codecs", "jaxring.distributed", "jaxring.bench", "jaxring.__main__",
         "jaxring.data", "jaxring.train"}
NATIVE = "jaxring._ext"


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in (ROOT / "jaxring").rglob("*.py")}


def _imports(path: pathlib.Path):
  """(imported module, imported name or None) for every import in the file, lazy ones included."""
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      yield from ((a.name, None) for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for a in node.names:
        full = f"{node.module}.{a.name}"
        yield (full, None) if full in MODULES or full == NATIVE else (node.module, a.name)


def _resolve(name: str) -> str:
  while name not in MODULES and "." in name:
    name = name.rsplit(".", 1)[0]
  return name


def _group(module: str) -> str | None:
  parts = module.split(".")
  return parts[2] if len(parts) > 2 and parts[1] == "_src" else None


def _graph():
  graph = collections.defaultdict(set)
  for module, path in MODULES.items():
    for target, _ in _imports(path):
      if target.startswith("jaxring") and target != NATIVE and _resolve(target) != module:
        graph[module].add(_resolve(target))
  return graph


def test_every_library_folder_has_a_layer():
  groups = {_group(m) for m in MODULES} - {None}
  assert groups <= set(LAYERS), f"add {sorted(groups - set(LAYERS))} to LAYERS (and design.md)"


def test_imports_point_down_only():
  wrong = []
  for module, targets in _graph().items():
    src = _group(module)
    for target in targets:
      dst = _group(target)
      if src is None or src == dst:
        continue
      if dst is None:
        if src != "tools":   # tools are applications of the public API, like recipes
          wrong.append(f"{module} -> {target} (a public face)")
      elif LAYERS[dst] >= LAYERS[src]:
        wrong.append(f"{module} ({src}, layer {LAYERS[src]}) -> {target} ({dst}, layer "
                     f"{LAYERS[dst]})")
  assert not wrong, "imports that run up or across a layer:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
  graph, index, low, stack, on_stack, cycles = _graph(), {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while not component or component[-1] != v:
        component.append(stack.pop())
        on_stack.discard(component[-1])
      if len(component) > 1:
        cycles.append(sorted(component))

  for v in list(MODULES):
    if v not in index:
      visit(v)
  assert not cycles, "modules that import each other (directly or around a loop):\n" + "\n".join(
      map(str, cycles))


def test_no_other_layers_private_names():
  wrong = [f"{module}: from {target} import {name}"
           for module, path in MODULES.items() for target, name in _imports(path)
           if name and name.startswith("_") and not name.startswith("__")
           and target.startswith("jaxring") and _group(_resolve(target)) != _group(module)]
  assert not wrong, "\n".join(wrong)


def test_the_library_never_imports_the_recipes():
  wrong = [f"{m} imports {t}" for m, p in MODULES.items() for t, _ in _imports(p)
           if t == "recipes" or t.startswith("recipes.")]
  assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("face", sorted(FACES))
def test_public_modules_only_reexport(face):
  """A public module holds imports, its docstring and lazy-import plumbing; the code is in _src."""
  path = MODULES[face]
  defined = [node.name for node in ast.parse(path.read_text()).body
             if isinstance(node, (ast.FunctionDef, ast.ClassDef))
             and node.name not in ("__getattr__", "__dir__")]
  assert not defined, f"{path.relative_to(ROOT)} defines {defined}: move them under jaxring/_src"
  assert {m for m in MODULES if m.split(".")[1:2] != ["_src"]} <= FACES, "a new public module?"


def test_modules_stay_small():
  paths = [*(ROOT / "jaxring").rglob("*.py"), *(ROOT / "recipes").glob("*.py")]
  paths += [p for folder in ("xla_ext", "benchmarks") for p in (ROOT / folder).rglob("*")
            if p.suffix in (".py", ".cc", ".cu", ".cuh", ".h", ".c", ".sh") and p.is_file()]
  big = {str(p.relative_to(ROOT)): n for p in paths
         if (n := len(p.read_text().splitlines())) > MAX_LINES}
  assert not big, f"modules over {MAX_LINES} lines: {big}"
