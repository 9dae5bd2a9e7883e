#!/usr/bin/env bash
# JAX's own tests of psum, pmean, psum_scatter and all_gather, run with jaxring's in their place.
#
#   tools/jax_tests/run.sh [JAX_CHECKOUT] [ALGORITHMS...]
#
# JAX_CHECKOUT: a git clone of github.com/jax-ml/jax (default: a shallow clone into a temporary
# folder, which needs the network); the tests are taken at the tag of the installed jax
# (jax-v<version>). ALGORITHMS default to "none auto ring hierarchical"; "none" runs the files
# unchanged (the baseline). Python: $PYTHON, default .venv/bin/python. Prints pytest's summary
# and failures per algorithm. Takes ~25 minutes on 2 cores.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
version=$("$py" -c 'import jax; print(jax.__version__)')
src=${1:-}
shift || true
algs=${*:-none auto ring hierarchical}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -z "$src" ]; then
  git clone -q --depth 1 --branch "jax-v$version" https://github.com/jax-ml/jax "$work/jax"
  src=$work/jax
fi
mkdir "$work/run"
git -C "$src" archive "jax-v$version" tests | tar -x -C "$work"
cp "$work"/tests/{shard_map_test,pmap_test,batching_test,lax_control_flow_test,custom_api_test,checkify_test,api_test,pjit_test,async_collectives_test,control_deps_test,shard_alike_test}.py "$work/run/"
cp "$here/conftest.py" "$work/run/"
cd "$work/run"
# the other files' tests that call lax.psum & co. (most of those files test other things)
others=$("$py" - <<'PY'
import ast, re
for f in ("lax_control_flow_test custom_api_test checkify_test api_test pjit_test "
          "async_collectives_test control_deps_test shard_alike_test").split():
  src = open(f + ".py").read()
  for cls in (n for n in ast.parse(src).body if isinstance(n, ast.ClassDef)):
    for fn in cls.body:
      if (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test") and re.search(
          r"lax\.(psum|pmean|psum_scatter|all_gather)\(", ast.get_source_segment(src, fn) or "")):
        print(f"{f}.py::{cls.name}::{fn.name}")
PY
)
for alg in $algs; do
  echo "== jax $version tests, algorithm: $alg"
  if [ "$alg" = none ]; then unset JR_ALG; else export JR_ALG=$alg; fi
  # one pytest per group: some files set up the CPU devices at import, and collected together
  # they leave others' multi-device tests skipped
  for files in shard_map_test.py "pmap_test.py batching_test.py" "$others"; do
    # shellcheck disable=SC2086
    "$py" -m pytest -q -n 2 -p no:cacheprovider -rf $files 2>&1 \
        | grep -E "^(FAILED|ERROR)|^E  .*Error|passed|failed" || true
  done
done
